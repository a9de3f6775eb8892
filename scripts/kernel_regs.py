#!/usr/bin/env python3
"""Registers, spills and shared memory of a decode step's Triton kernels on the H200 (sm_90a),
and so how many programs an SM holds, measured without a GPU.

    python scripts/kernel_regs.py [--model qwen3-4b] [--batch 1 8 32 64] [--json out.json]

The script calls the step's kernel wrappers (`kernels/`) on meta tensors of the model's decode
shapes, with PDL on, as the CUDA executor launches them. It catches each launch, specialises it
as Triton would (constexprs, integers equal to 1, 16-divisible integers and pointers), compiles
it for sm_90a and reads the result with Triton's own `ptxas -v`.

Why: a decode step is hundreds of small kernels chained by PDL, and in them occupancy decides a
lot. A fusion that adds registers loses the step even when it saves a launch. Two sessions of
A/B runs on the H200 (docs/benchmarks/gpu-2026-11-29e.md, f.md) lost that way. The merge fused
into the split kernel went to 247 registers, and the fused RMSNorm to 80 and 96 against 59 and
66. Compare a change here before spending device time on it.
Registers set by ptxas can differ slightly between Triton versions (the H200 machine has 3.6).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDAOptions
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from make_random_model import CONFIGS  # noqa: E402

from arle.model.config import ModelConfig  # noqa: E402
from arle_kernels import decode_attention as da  # noqa: E402
from arle_kernels import fused  # noqa: E402
from arle_kernels import gemv as gemv_module  # noqa: E402
from arle_kernels.gemv import gemv, gemv_silu_mul, use_gemv  # noqa: E402
from arle_kernels.jit import set_pdl  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
#: an H200 SM: registers, threads, resident programs, shared memory in bytes (each program's
#: allocation also takes 1 KB)
SM_REGS, SM_THREADS, SM_BLOCKS, SM_SMEM = 65536, 2048, 32, 233472
_TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                  torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv",
                  torch.uint8: "u8", torch.bool: "i1"}
_OPTIONS = {f.name for f in dataclasses.fields(CUDAOptions)}


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch, specialised as Triton's launcher would."""

    fn: JITFunction
    signature: dict[str, str]
    constexprs: dict[tuple[int, ...], Any]
    attrs: dict[tuple[int, ...], list[list[Any]]]
    options: dict[str, Any]

    @property
    def kernel(self) -> str:
        return self.fn.__name__

    def config(self) -> str:
        """Its constexprs and options: one compiled variant each."""
        shown = {self.fn.arg_names[i[0]]: v for i, v in self.constexprs.items()}
        return f"{shown} {self.options}"


def specialise(fn: JITFunction, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Launch:
    """The launch's signature, constexprs and 16-divisibility hints (what Triton keys its cache
    on), and its compile options."""
    options = {k: v for k, v in kwargs.items() if k in _OPTIONS}
    bound = inspect.signature(fn.fn).bind(*args, **{k: v for k, v in kwargs.items()
                                                    if k not in _OPTIONS})
    bound.apply_defaults()
    signature: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, (param, (name, value)) in enumerate(zip(fn.params, bound.arguments.items(),
                                                   strict=True)):
        if param.is_constexpr or value is None:
            signature[name], constexprs[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TRITON_DTYPES[value.dtype]
            if not param.do_not_specialize_on_alignment:  # meta tensors: address 0, aligned
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            if value == 1 and not param.do_not_specialize:
                signature[name], constexprs[(i,)] = "constexpr", 1
                continue
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0 and not param.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif isinstance(value, TensorDescriptor):
            block = ",".join(map(str, value.block_shape))
            signature[name] = f"tensordesc<{_TRITON_DTYPES[value.base.dtype]}[{block}]>"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(value).__name__}")
    return Launch(fn, signature, constexprs, attrs, options)


@contextmanager
def caught_launches() -> Iterator[list[Launch]]:
    """Inside: every `kernel[grid](...)` is recorded instead of run (PDL on and the TMA
    kernels chosen, as on the H200)."""
    launches: list[Launch] = []
    original = JITFunction.run

    def record(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        launches.append(specialise(self, args, kwargs))

    JITFunction.run = record
    set_pdl(True)
    tma = gemv_module.tma_available
    gemv_module.tma_available = lambda: True  # as on the H200
    try:
        yield launches
    finally:
        JITFunction.run = original
        set_pdl(None)
        gemv_module.tma_available = tma


def _ptxas() -> str:
    """The ptxas Triton itself runs for sm_90 (its bundle has more than one)."""
    from triton.backends.nvidia import compiler

    try:
        return str(compiler.get_ptxas(TARGET.arch).path)
    except TypeError:  # Triton <= 3.6: one ptxas, no arch argument
        return str(compiler.get_ptxas().path)


def resources(launch: Launch) -> dict[str, Any]:
    """Compile for sm_90a; registers and spills from ptxas -v, shared memory from Triton, and
    the programs an SM holds by each limit."""
    src = ASTSource(launch.fn, launch.signature, launch.constexprs, launch.attrs)
    compiled = triton.compile(src, target=TARGET, options=launch.options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        out = subprocess.run([_ptxas(), "-v", "-arch=sm_90a", str(ptx), "-o",
                              str(Path(tmp) / "k.cubin")], capture_output=True, text=True,
                             check=True).stderr
    used = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    assert used is not None, out
    regs = int(used.group(1))
    threads = 32 * launch.options.get("num_warps", 4)
    smem = int(compiled.metadata.shared)
    # registers are allocated per warp in units of 8 a thread
    per_sm = {"programs": SM_BLOCKS, "threads": SM_THREADS // threads,
              "registers": SM_REGS // (-(-regs // 8) * 8 * threads),
              "shared": SM_SMEM // (smem + 1024)}
    limit = min(per_sm, key=lambda k: per_sm[k])
    return {"kernel": launch.kernel, "config": launch.config(), "registers": regs,
            "spill_bytes": int(spill.group(1)) + int(spill.group(2)) if spill else 0,
            "shared_bytes": smem, "warps": threads // 32, "programs_per_sm": per_sm[limit],
            "limited_by": limit}


def decode_step(cfg: ModelConfig, batch: int, context: int) -> list[Callable[[], object]]:
    """The kernel wrappers a decode step of `batch` rows calls, on meta tensors of cfg's shapes
    (one layer: every layer launches the same; plus the lm_head)."""
    m, h, kvh, d = batch, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    dt = torch.bfloat16

    def t(*shape: int, dtype: torch.dtype = dt) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device="meta")

    hidden, qkv_n = cfg.hidden_size, (h + 2 * kvh) * d
    pages = -(-context // 16) * batch + 1
    cache = t(pages, 16, kvh, d)
    ints = t(m, dtype=torch.int32)
    table = t(m, -(-context // 16), dtype=torch.int32)
    splits = da.pick_num_splits(batch, kvh, context)

    def linear(n: int, k: int, glu: bool = False) -> Callable[[], object]:
        if not use_gemv(m, n, k, glu):
            return lambda: None  # cuBLAS
        return (lambda: gemv_silu_mul(t(m, k), t(n, k))) if glu else (lambda: gemv(t(m, k), t(n, k)))

    return [
        lambda: fused.add_rms_norm(t(m, hidden), t(m, hidden), t(hidden), 1e-6),
        linear(qkv_n, hidden),
        lambda: fused.qk_norm_rope_store_kv(
            t(m, qkv_n), t(m, dtype=torch.int64), t(context + 1, d, dtype=torch.float32), t(d),
            t(d), 1e-6, h, kvh, cache, cache, t(m, dtype=torch.int64)),
        lambda: da.decode_attention(t(m, h, d), cache, cache, table, ints, d ** -0.5, splits),
        linear(hidden, h * d),
        linear(2 * cfg.intermediate_size, hidden, glu=True),
        linear(hidden, cfg.intermediate_size),
        linear(cfg.vocab_size, hidden),
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-4b", choices=sorted(CONFIGS))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=4096, help="the graphs' longest context")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    cfg = ModelConfig.from_hf(CONFIGS[args.model], args.model)
    rows: list[dict[str, Any]] = []
    seen: set[tuple[str, str]] = set()
    for batch in args.batch:
        with caught_launches() as launches:
            for call in decode_step(cfg, batch, args.context):
                call()
        for launch in launches:  # each variant once, at the first batch that launches it
            if (launch.kernel, launch.config()) not in seen:
                seen.add((launch.kernel, launch.config()))
                rows.append({"batch": batch, **resources(launch)})
    print(f"{'batch':>5} {'kernel':<32} {'warps':>5} {'regs':>4} {'spill':>5} {'smem KB':>7} "
          f"{'per SM':>6}  limit      config")
    for r in rows:
        print(f"{r['batch']:>5} {r['kernel']:<32} {r['warps']:>5} {r['registers']:>4} "
              f"{r['spill_bytes']:>5} {r['shared_bytes'] / 1024:>7.1f} {r['programs_per_sm']:>6}"
              f"  {r['limited_by']:<10} {r['config']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
