"""Micro-benchmarks of arle's Triton kernels on a GPU, one subcommand each, at Qwen3-4B's shapes.

    python3 scripts/bench_kernels.py gemv [--out g.json]     # gemv against F.linear (cuBLAS)
    python3 scripts/bench_kernels.py sweep --kernel tma      # the GEMV kernels' tiles x splits
    python3 scripts/bench_kernels.py fused [--out f.json]    # the fused glue ops against their refs
    python3 scripts/bench_kernels.py decode [--out d.json]   # decode attention's configs x splits
    python3 scripts/bench_kernels.py extend [--out e.json]   # extend attention against SDPA flash
    python3 scripts/bench_kernels.py moe [--out m.json]      # Qwen3-30B-A3B's experts, each kernel kind
    python3 scripts/bench_kernels.py moe1 [--out m.json]     # their one-token GEMV, each tile
    python3 scripts/bench_kernels.py fp8 [--out f.json]      # block-FP8 linears, each kind, vs cuBLAS bf16
    python3 scripts/bench_kernels.py deltanet [--out g.json] # Gated DeltaNet: decode steps, a prefill

Each prints a table; --out writes its rows as JSON. `gemv`, `sweep` and `decode` time calls as a
decode step runs them: back to back in a CUDA graph, each on another copy of its weights (or KV
cache), the copies together well past L2, so that every call reads from HBM. `moe` and `fp8`
time their kernel kinds at each token count (the table their `pick_*_config` chooses from) the
same way: `moe` rotates routings over 128 experts (1.2 GB of bf16 weights), `fp8` weight copies.
`deltanet` times a Gated DeltaNet layer's recurrence at Qwen3.5-4B's shapes: decode steps the
same way (on copies of the state slots), and one prefill row.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
import triton
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stamp import stamp

from arle_kernels import deltanet, fp8_ref, w4a16, w4a16_ref
from arle_kernels import extend_attention as extend
from arle_kernels import fp8 as fp8_kernels
from arle_kernels import moe as moe_kernels
from arle_kernels.decode_attention import decode_attention, default_config, pick_num_splits
from arle_kernels.fused import add_rms_norm, qk_norm_rope_store_kv, rms_norm, silu_and_mul
from arle_kernels.fused_ref import (
    add_rms_norm_ref,
    qk_norm_rope_store_kv_ref,
    quantize_fp8_ref,
    rms_norm_ref,
    silu_and_mul_ref,
)
from arle_kernels.gemv import (
    USE_GEMV_MAX_M,
    GemvConfig,
    _launch,
    _pick_config,
    fp8_glu_config,
    gemv,
    gemv_fp8_silu_mul,
    gemv_silu_mul,
    gemv_w4,
    use_gemv,
    use_w4_gemv,
    w4_gemv_config,
)
from arle_kernels.jit import pdl_enabled
from arle_kernels.noise import exponential_noise
from arle_kernels.noise_ref import exponential_noise_ref
from arle_kernels.split_sums import SplitSums, consumed

Row = dict[str, Any]
T = TypeVar("T")

# Qwen3-4B, bf16
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 2560, 32, 8, 128, 9728, 151936
#: (N, K) of its linear layers
LINEARS: dict[str, tuple[int, int]] = {
    "qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), "o_proj": (HIDDEN, HEADS * HEAD_DIM),
    "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER), "lm_head": (VOCAB, HIDDEN)}
PAGE = 16
#: bytes of copies to rotate over: several times L2 (50 MB on an H200)
ROTATE_BYTES = 400_000_000

#: candidate tiles (block_n, block_k, num_warps, num_stages) of each GEMV kernel for `sweep`:
#: the cp.async tensor-core kernel, the TMA one (block_n >= 64: wgmma; below, mma.sync), and
#: the FMA kernel at a few rows
TILES: dict[str, tuple[tuple[int, int, int, int], ...]] = {
    "mma": ((16, 128, 1, 1), (16, 256, 1, 1), (16, 128, 1, 3), (32, 128, 1, 2), (32, 128, 2, 1),
            (32, 256, 2, 1), (32, 256, 2, 2), (16, 256, 2, 1), (64, 128, 4, 3), (64, 64, 4, 4)),
    "tma": ((64, 128, 4, 2), (64, 128, 4, 3), (64, 128, 4, 4), (64, 128, 4, 6), (64, 256, 4, 2),
            (64, 256, 4, 3), (64, 64, 4, 4), (64, 64, 4, 8), (128, 128, 4, 3), (128, 128, 8, 4),
            (128, 64, 4, 6), (32, 128, 2, 4), (32, 128, 4, 4), (32, 256, 2, 3), (16, 128, 1, 4),
            (16, 128, 1, 6), (16, 256, 1, 3)),
    "fma": ((1, 256, 1, 1), (2, 256, 1, 1), (4, 256, 1, 1), (8, 256, 1, 1), (1, 512, 1, 1),
            (2, 512, 1, 1), (4, 512, 1, 1), (2, 512, 2, 1), (4, 512, 2, 1), (2, 1024, 4, 1),
            (4, 1024, 4, 1)),
}
#: the W4A16 GEMV's tiles (block_n, block_k, num_warps, stack, num_stages) for `w4`, K split
#: by the chosen rule (`w4_gemv_config`); and the GEMM's (BM, BN, warps, splits of K; 0:
#: `w4_gemm`'s default) from 3 rows
W4_TILES = ((4, 1024, 4, 0, 1), (4, 1024, 4, 1, 1), (4, 1024, 4, 1, 2), (8, 1024, 8, 1, 2),
            (4, 512, 2, 1, 2), (8, 512, 4, 1, 2), (4, 2048, 4, 0, 1), (4, 2048, 4, 1, 1),
            (4, 2048, 8, 1, 2), (2, 2048, 2, 1, 1))
W4_GEMM_TILES = ((16, 32, 4, 0), (16, 64, 4, 0), (16, 64, 4, 1), (64, 64, 4, 0))
#: (BLOCK_N, num_warps, num_stages) of decode attention's split kernel tried besides its default
DECODE_CONFIGS = ((64, 8, 2), (64, 4, 2), (32, 4, 2), (16, 4, 2), (64, 4, 3), (32, 2, 3),
                  (128, 4, 2), (16, 2, 4))


def _time_us(fn: Callable[[T], object], inputs: list[T], graph: bool = True) -> float:
    """Median microseconds of one fn(input), the input rotating over `inputs`.

    graph: back to back in a CUDA graph of `calls` calls (no CPU launch cost), replayed 8 times
    (the first a warm-up). Otherwise eager, one call at a time, with triton's do_bench (which
    clears L2 before each call; a small kernel then also pays its CPU launch)."""
    from triton.testing import do_bench

    turn = itertools.count()

    def call() -> object:
        return fn(inputs[next(turn) % len(inputs)])

    if not graph:
        return float(do_bench(call, warmup=10, rep=50, return_mode="median")) * 1e3
    call()  # compile and warm up outside the capture
    calls = max(32, 2 * len(inputs))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            call()
    times = []
    for _ in range(8):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del g
    return sorted(times[1:])[3]


def _copies(nbytes: int) -> int:
    """How many copies of `nbytes` rotate past L2."""
    return max(2, -(-ROTATE_BYTES // nbytes))


def _weights(n: int, k: int, gen: torch.Generator) -> tuple[int, list[Tensor]]:
    """One bf16 [n, k] weight's bytes, and random copies of it to rotate over."""
    w_bytes = n * k * 2
    return w_bytes, [(torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5).bfloat16()
                     for _ in range(_copies(w_bytes))]


def _x(m: int, k: int, gen: torch.Generator) -> Tensor:
    return torch.randn(m, k, generator=gen, device="cuda").bfloat16()


def _then_silu(linear: Callable[[Tensor, Tensor], Tensor], x: Tensor, w: Tensor) -> Tensor:
    """A gate_up projection, then its activation in a kernel of its own."""
    return silu_and_mul(linear(x, w))


# ---------------------------------------------------------------------------------------------
# GEMV
# ---------------------------------------------------------------------------------------------

def bench_gemv(rows: tuple[int, ...], shapes: list[str]) -> list[Row]:
    """gemv and F.linear (cuBLAS) per shape and M: in a CUDA graph (what to decide on) and eager
    (do_bench: one call at a time, L2 cleared, the CPU launch included); GB/s = weight bytes /
    graph time. gate_up also with its activation fused, against gemv then silu_and_mul."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    out: list[Row] = []
    print(f"{'shape':8} {'M':>2} {'N':>6} {'K':>5} | graph us: {'gemv':>6} {'cuBLAS':>6} | "
          f"GB/s: {'gemv':>5} {'cuBLAS':>6} | speedup | eager us: {'gemv':>6} {'cuBLAS':>6} | "
          f"use config")
    for name in shapes:
        n, k = LINEARS[name]
        w_bytes, weights = _weights(n, k, gen)
        for m in rows:
            x = _x(m, k, gen)
            g_us = _time_us(partial(gemv, x), weights)
            c_us = _time_us(partial(F.linear, x), weights)
            g_eager = _time_us(partial(gemv, x), weights, graph=False)
            c_eager = _time_us(partial(F.linear, x), weights, graph=False)
            cfg = _pick_config(m, n, k)
            use = use_gemv(m, n, k)
            out.append({"shape": name, "m": m, "n": n, "k": k, "gemv_us": g_us, "cublas_us": c_us,
                        "gemv_gbs": w_bytes / g_us / 1e3, "cublas_gbs": w_bytes / c_us / 1e3,
                        "speedup": c_us / g_us, "gemv_eager_us": g_eager,
                        "cublas_eager_us": c_eager, "use_gemv": use,
                        "config": dataclasses.asdict(cfg)})
            print(f"{name:8} {m:>2} {n:>6} {k:>5} | {g_us:16.1f} {c_us:6.1f} | "
                  f"{w_bytes / g_us / 1e3:11.0f} {w_bytes / c_us / 1e3:6.0f} | "
                  f"{c_us / g_us:7.2f} | {g_eager:16.1f} {c_eager:6.1f} | "
                  f"{'yes' if use else 'no ':3} n{cfg.block_n} k{cfg.block_k} "
                  f"w{cfg.num_warps} s{cfg.split_k}", flush=True)
        if name == "gate_up":
            for m in (1, 2):
                x = _x(m, k, gen)
                fused_us = _time_us(partial(gemv_silu_mul, x), weights)
                apart_us = _time_us(partial(_then_silu, gemv, x), weights)
                out.append({"shape": "gate_up+silu", "m": m, "n": n, "k": k,
                            "fused_us": fused_us, "gemv_then_silu_us": apart_us})
                print(f"gate_up+silu M={m}: fused {fused_us:.1f} us, gemv then silu_and_mul "
                      f"{apart_us:.1f} us", flush=True)
        del weights
        torch.cuda.empty_cache()
    return out


def sweep(kernel: str, rows: tuple[int, ...], splits: tuple[int, ...], shapes: list[str],
          tiles: tuple[tuple[int, int, int, int], ...]) -> list[Row]:
    """One GEMV kernel (`kernel`: tma, mma or fma) over tiles x splits, against cuBLAS and what
    gemv picks, per shape and M (CUDA-graph medians); gate_up also as the fused SiLU·up (no
    split) against cuBLAS + silu_and_mul. Prints the best per shape; returns all."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    out: list[Row] = []

    def timed(cfg: GemvConfig, x: Tensor, weights: list[Tensor], glu: bool) -> float | None:
        try:
            return _time_us(lambda w: _launch(x, w, None, None, cfg, glu), weights)
        except Exception as e:  # a tile past the SM's resources: skip it
            print(f"{cfg} glu={glu}: {type(e).__name__}", flush=True)
            return None

    def config(tile: tuple[int, int, int, int], split: int) -> GemvConfig:
        return GemvConfig(*tile, split_k=split, mma=kernel != "fma", tma=kernel == "tma")

    for name in shapes:
        n, k = LINEARS[name]
        w_bytes, weights = _weights(n, k, gen)
        for m in rows:
            x = _x(m, k, gen)
            base = {"shape": name, "m": m, "n": n, "k": k}
            cublas = _time_us(partial(F.linear, x), weights)
            picked = _time_us(partial(gemv, x), weights)
            out += [{**base, "kernel": "cublas", "us": cublas},
                    {**base, "kernel": "picked", "us": picked}]
            best: tuple[float, str] = (float("inf"), "")
            for tile, split in itertools.product(tiles, splits):
                if split > 1 and triton.cdiv(k, tile[1]) < 2 * split:
                    continue
                us = timed(config(tile, split), x, weights, glu=False)
                if us is None:
                    continue
                bn, bk, warps, stages = tile
                out.append({**base, "kernel": kernel, "us": us, "block_n": bn, "block_k": bk,
                            "warps": warps, "stages": stages, "split": split})
                best = min(best, (us, f"n{bn} k{bk} w{warps} st{stages} s{split}"))
            print(f"{name:8} M={m:2} cuBLAS {cublas:6.1f} picked {picked:6.1f} | {kernel} best "
                  f"{best[0]:6.1f} ({w_bytes / best[0] / 1e3:5.0f} GB/s) {best[1]}", flush=True)
            if name == "gate_up":
                glu = [(us, tile) for tile in tiles
                       if (us := timed(config(tile, 1), x, weights, glu=True)) is not None]
                out += [{**base, "kernel": f"{kernel}_glu", "us": us, "block_n": bn,
                         "block_k": bk, "warps": warps, "stages": stages, "split": 1}
                        for us, (bn, bk, warps, stages) in glu]
                apart = _time_us(partial(_then_silu, F.linear, x), weights)
                fused = _time_us(partial(gemv_silu_mul, x), weights)
                out += [{**base, "kernel": "cublas+silu", "us": apart},
                        {**base, "kernel": "picked_glu", "us": fused}]
                print(f"gate_up+silu M={m}: cuBLAS + silu_and_mul {apart:.1f}, picked "
                      f"{fused:.1f}, {kernel} glu best {min(glu)[0]:.1f}", flush=True)
        del weights
        torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------
# The fused glue ops and the sampling noise
# ---------------------------------------------------------------------------------------------

def bench_fused(tokens: tuple[int, ...], batches: tuple[int, ...],
                num_pages: int = 8192) -> list[Row]:
    """Each op against its torch ref (do_bench, eager), bf16, bf16 and fp8 caches. GB/s counts
    the bytes the op must read and write once. NOTE: the qk and noise refs read device tensors
    on the host (a sync each): that is part of what the kernels replace."""
    from triton.testing import do_bench

    eps, max_pos = 1e-6, 32768
    gen = torch.Generator(device="cuda").manual_seed(0)
    cos_sin = torch.rand(max_pos, HEAD_DIM, device="cuda", generator=gen)
    out: list[Row] = []

    def record(op: str, t: int, nbytes: int, fn: Callable[[], object],
               ref: Callable[[], object]) -> None:
        ms, ms_ref = do_bench(fn), do_bench(ref)
        out.append({"op": op, "T": t, "triton_us": ms * 1e3, "torch_us": ms_ref * 1e3,
                    "speedup": ms_ref / ms, "triton_GBps": nbytes / ms / 1e6})

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    for t in tokens:
        x, res, gu = randn(t, HIDDEN), randn(t, HIDDEN), randn(t, 2 * INTER)
        w = randn(HIDDEN).abs() + 0.5
        e = x.element_size()
        record("rms_norm", t, 2 * t * HIDDEN * e,
               partial(rms_norm, x, w, eps), partial(rms_norm_ref, x, w, eps))
        record("add_rms_norm", t, 4 * t * HIDDEN * e,
               partial(add_rms_norm, x, res, w, eps), partial(add_rms_norm_ref, x, res, w, eps))
        record("silu_and_mul", t, 3 * t * INTER * e,
               partial(silu_and_mul, gu), partial(silu_and_mul_ref, gu))
        qkv = randn(t, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
        pos = torch.randint(0, max_pos, (t,), device="cuda", generator=gen)
        slots = torch.randperm(num_pages * PAGE, device="cuda", generator=gen)[:t]
        qn, kn = randn(HEAD_DIM).abs() + 0.5, randn(HEAD_DIM).abs() + 0.5
        for fp8 in (False, True):
            kc = torch.zeros(num_pages, PAGE, KV_HEADS, HEAD_DIM, device="cuda",
                             dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
            vc = torch.zeros_like(kc)
            ks = torch.zeros(kc.shape[:3], device="cuda") if fp8 else None
            vs = torch.zeros(kc.shape[:3], device="cuda") if fp8 else None
            args = (qkv, pos, cos_sin, qn, kn, eps, HEADS, KV_HEADS, kc, vc, slots, ks, vs)
            nbytes = t * ((2 * HEADS + 2 * KV_HEADS) * HEAD_DIM * e
                          + 2 * KV_HEADS * HEAD_DIM * kc.element_size())
            record(f"qk_norm_rope_store_kv {'fp8' if fp8 else 'bf16'} kv", t, nbytes,
                   partial(qk_norm_rope_store_kv, *args), partial(qk_norm_rope_store_kv_ref, *args))
    for b in batches:
        seeds, offs = torch.arange(b, device="cuda"), torch.full((b,), 7, device="cuda")
        record("exponential_noise", b, b * VOCAB * 4, partial(exponential_noise, seeds, offs, VOCAB),
               partial(exponential_noise_ref, seeds, offs, VOCAB))

    print(f"{'op':34} {'T':>5} {'triton us':>10} {'torch us':>10} {'x':>6} {'GB/s':>7}")
    for r in out:
        print(f"{r['op']!s:34} {r['T']!s:>5} {r['triton_us']:10.2f} {r['torch_us']:10.2f} "
              f"{r['speedup']:6.2f} {r['triton_GBps']:7.0f}")
    return out


# ---------------------------------------------------------------------------------------------
# MoE experts and FP8 linears (Qwen3-30B-A3B)
# ---------------------------------------------------------------------------------------------

#: Qwen3-30B-A3B: experts, top-k, hidden, expert width; (N, K) of its FP8 dense linears
A3B_E, A3B_K, A3B_H, A3B_I = 128, 8, 2048, 768
A3B_LINEARS: dict[str, tuple[int, int]] = {"qkv": (5120, 2048), "o_proj": (2048, 4096)}
#: `fp8`'s shapes: Qwen3-30B-A3B's attention, and Qwen3-4B's linears (`--quantization fp8`)
FP8_SHAPES = {**A3B_LINEARS, **{f"4b_{k}": v for k, v in LINEARS.items() if k != "lm_head"}}
FP8_BLOCK = (128, 128)


def _fp8_weight(shape: tuple[int, ...], gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Random FP8 weights [..., N, K] and their 128 x 128 block scales."""
    *lead, n, k = shape
    w = (torch.randn(shape, generator=gen, device="cuda") * 64).clamp(-448, 448)
    scale = torch.full((*lead, -(-n // 128), -(-k // 128)), 2.0 ** -6 / k ** 0.5, device="cuda")
    return w.to(fp8_ref.FP8), scale


def _moe_kinds(t: int, fp8: bool) -> list[moe_kernels.MoeConfig]:
    """The chosen config and every other kernel kind at t tokens (the GEMV up to 16 tokens)."""
    block = FP8_BLOCK if fp8 else None
    chosen = moe_kernels.pick_moe_config(t, A3B_K, A3B_E, A3B_H, A3B_I, block)
    cfgs = [chosen]
    if chosen.kind != "gemv" and t <= 16:  # (pick_moe_config's GEMV tiles, for more rows)
        m_pad = triton.next_power_of_2(t)
        cfgs.append(moe_kernels.MoeConfig("gemv", m_pad, *moe_kernels.moe_gemv_tiles(m_pad, fp8)))
    if t == 1:  # the one-token path against the sorted GEMV (align, per-pair outputs, sum)
        cfgs.append(moe_kernels.MoeConfig("gemv", 2, *moe_kernels.moe_gemv_tiles(2, fp8)))
    bk = 128 if fp8 else 64
    tile = moe_kernels.MoeTile(64 if t <= 64 else 128, bk)
    bm = max(16, chosen.block_m)
    for kind in ["mma"] + (["w8a8"] if fp8 else []):
        if chosen.kind != kind:
            cfgs.append(moe_kernels.MoeConfig(kind, bm, tile, tile))
        if t > 256:
            continue
        # the swapped product (W's rows on the MMA's wide side) in a few tiles
        for bn, warps, stages in ((64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3)):
            swapped = moe_kernels.MoeTile(bn, 128, warps, stages)
            cfg = moe_kernels.MoeConfig(kind, bm, swapped, swapped, swap=True)
            if cfg != chosen:
                cfgs.append(cfg)
    return cfgs


def _moe_experts_call(weights: dict[str, Any], cfg: moe_kernels.MoeConfig,
                      inputs: tuple[Tensor, ...]) -> object:
    x, _, w, ids = inputs
    return moe_kernels._moe_experts(x, w, ids, weights["w13"], weights["w2"],
                                    weights.get("w13_scale"), weights.get("w2_scale"),
                                    weights.get("block"), cfg)


def _fused_moe_call(weights: dict[str, Any], inputs: tuple[Tensor, ...]) -> object:
    x, logits, _, _ = inputs
    return moe_kernels.fused_moe(x, logits, weights["w13"], weights["w2"], A3B_K, True,
                                 weights.get("w13_scale"), weights.get("w2_scale"),
                                 weights.get("block"))


def _fp8_linear_call(x: Tensor, cfg: GemvConfig | fp8_kernels.Fp8Config,
                     ws: tuple[Tensor, Tensor]) -> Tensor:
    y = fp8_kernels._launch_fp8_linear(x, ws[0], ws[1], FP8_BLOCK, None, cfg)
    assert isinstance(y, Tensor)
    return y


def _fp8_kind(cfg: GemvConfig | fp8_kernels.Fp8Config) -> str:
    """A launch's name in the table: kernels/gemv.py's "gemv" / "gemv_mma", or the GEMM's."""
    if isinstance(cfg, GemvConfig):
        return "gemv_mma" if cfg.mma else "gemv"
    return cfg.kind


def bench_moe(tokens: tuple[int, ...], fp8s: tuple[bool, ...], chosen: bool = False
              ) -> list[Row]:
    """Each MoE kernel kind on Qwen3-30B-A3B's experts (the align and the top-k sum included;
    the router's softmax / top-k timed apart, and the whole layer as the model runs it, op
    "fused"), in a CUDA graph, over 8 random routings. GB/s: the weights of the experts the
    tokens chose, read once; TFLOP/s: the pairs' projections."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    out: list[Row] = []
    expert_bytes = 3 * A3B_H * A3B_I
    for fp8 in fp8s:
        if fp8:
            w13, s13 = _fp8_weight((A3B_E, 2 * A3B_I, A3B_H), gen)
            w2, s2 = _fp8_weight((A3B_E, A3B_H, A3B_I), gen)
            weights = {"w13": w13, "w2": w2, "w13_scale": s13, "w2_scale": s2,
                       "block": FP8_BLOCK}
        else:
            weights = {"w13": (torch.randn(A3B_E, 2 * A3B_I, A3B_H, generator=gen,
                                           device="cuda") * A3B_H ** -0.5).bfloat16(),
                       "w2": (torch.randn(A3B_E, A3B_H, A3B_I, generator=gen,
                                          device="cuda") * A3B_I ** -0.5).bfloat16()}
        for t in tokens:
            inputs = []
            for _ in range(8):
                logits = torch.randn(t, A3B_E, generator=gen, device="cuda").bfloat16()
                w, ids = moe_kernels.moe_route(logits, A3B_K, True)
                inputs.append((_x(t, A3B_H, gen), logits, w, ids))
            used = sum(int(i[3].unique().numel()) for i in inputs) / len(inputs)
            nbytes = used * expert_bytes * (1 if fp8 else 2)
            flops = 2 * t * A3B_K * 3 * A3B_H * A3B_I
            us = _time_us(lambda i: moe_kernels.moe_route(i[1], A3B_K, True), inputs)
            out.append({"op": "route", "fp8": fp8, "T": t, "kind": "-", "us": us,
                        "GBps": 0.0, "TFLOPs": 0.0, "chosen": True})
            # the layer as the model runs it: its routing launch (fused with the align up to
            # ROUTE_ALIGN_MAX_TOKENS), then the chosen experts' launches
            us = _time_us(partial(_fused_moe_call, weights), inputs)
            out.append({"op": "fused", "fp8": fp8, "T": t, "kind": "-", "us": us,
                        "GBps": nbytes / us / 1e3, "TFLOPs": flops / us / 1e6, "chosen": True})
            for j, cfg in enumerate(_moe_kinds(t, fp8)[:1] if chosen else _moe_kinds(t, fp8)):
                us = _time_us(partial(_moe_experts_call, weights, cfg), inputs)
                tile = cfg.up
                out.append({"op": "experts", "fp8": fp8, "T": t, "kind": cfg.kind,
                            "block_m": cfg.block_m, "swap": cfg.swap,
                            "tile": [tile.block_n, tile.block_k, tile.num_warps,
                                     tile.num_stages],
                            "us": us, "GBps": nbytes / us / 1e3,
                            "TFLOPs": flops / us / 1e6, "chosen": j == 0})
    print(f"{'op':8} {'w':>4} {'T':>5} {'kind/bm':>20} {'us':>9} {'GB/s':>7} {'TFLOP/s':>8}")
    for r in out:
        kind = r["kind"]
        if "block_m" in r:
            kind += f"/{r['block_m']}" + ("/swap" if r["swap"] else "")
            kind += "/" + ",".join(map(str, r["tile"]))
        print(f"{r['op']:8} {'fp8' if r['fp8'] else 'bf16':>4} {r['T']:5} {kind:>20} "
              f"{r['us']:9.1f} {r['GBps']:7.0f} {r['TFLOPs']:8.1f}{' *' if r['chosen'] else ''}")
    return out


#: the one-token MoE GEMV's candidate tiles (block_n, block_k, num_warps) for `moe1`
MOE1_UP_TILES = ((1, 2048, 1), (1, 1024, 1), (2, 1024, 1), (2, 512, 1), (4, 512, 4),
                 (4, 512, 2), (2, 1024, 2), (4, 1024, 4), (8, 512, 8), (2, 2048, 2))
MOE1_DOWN_TILES = ((1, 256, 1), (2, 256, 1), (4, 256, 2), (8, 256, 4), (4, 1024, 4),
                   (2, 1024, 2), (8, 256, 2), (16, 256, 8), (8, 1024, 8), (4, 512, 2))


def bench_moe_one_token(up_tiles: tuple[tuple[int, ...], ...],
                        down_tiles: tuple[tuple[int, ...], ...]) -> list[Row]:
    """One token through Qwen3-30B-A3B's FP8 experts, a projection at a time, in each tile:
    gate_up per pair, down per pair into split-sum slots ("slots") or all pairs in one
    program summed in its epilogue ("sum"); then the experts whole at the chosen config, both
    ways. In CUDA graphs over 8 random routings; GB/s: the chosen experts' bytes read."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13, s13 = _fp8_weight((A3B_E, 2 * A3B_I, A3B_H), gen)
    w2, s2 = _fp8_weight((A3B_E, A3B_H, A3B_I), gen)
    inputs = []
    for _ in range(8):
        logits = torch.randn(1, A3B_E, generator=gen, device="cuda").bfloat16()
        w, ids = moe_kernels.moe_route(logits, A3B_K, True)
        inter = torch.randn(A3B_K, A3B_I, generator=gen, device="cuda").bfloat16()
        inputs.append((_x(1, A3B_H, gen), w, ids, inter))
    slots = torch.zeros(A3B_K, 1, A3B_H, dtype=torch.float32, device="cuda")
    summed = torch.empty(1, A3B_H, dtype=torch.bfloat16, device="cuda")
    up_out = torch.empty(A3B_K, A3B_I, dtype=torch.bfloat16, device="cuda")
    out: list[Row] = []

    up_tile, down_tile = moe_kernels.moe_gemv_tiles(1, True)
    chosen_tiles = {"gate_up": up_tile, "down_slots": down_tile}

    def record(name: str, tile: tuple[int, ...], fn: Callable[[Any], object], nbytes: int,
               chosen: bool = False) -> None:
        us = _time_us(fn, inputs)
        picked = chosen_tiles.get(name)
        chosen = chosen or (picked is not None and tile == (picked.block_n, picked.block_k,
                                                            picked.num_warps))
        out.append({"op": name, "tile": list(tile), "us": us, "GBps": nbytes / us / 1e3,
                    "chosen": chosen, "name": f"{name}/" + "x".join(map(str, tile))})
        print(f"{name:14} {tile!s:18} {us:8.2f} us {nbytes / us / 1e3:7.0f} GB/s"
              f"{' *' if chosen else ''}")

    def proj(i: Any, tile: tuple[int, ...], glu: bool, dst: Tensor, rows: int) -> None:
        x, w, ids, inter = i
        cfg_tile = moe_kernels.MoeTile(tile[0], tile[1], tile[2], num_stages=1)
        cfg = moe_kernels.MoeConfig("gemv", 1, cfg_tile, cfg_tile)
        if glu:
            moe_kernels._launch_proj(x, None, w13, s13, dst, w, ids, ids, A3B_K,
                                     row_div=A3B_K, glu=True, block=FP8_BLOCK, cfg=cfg,
                                     tile=cfg_tile, direct_rows=1)
        else:
            moe_kernels._launch_proj(inter, None, w2, s2, dst, w, ids, ids, A3B_K, row_div=1,
                                     glu=False, block=FP8_BLOCK, cfg=cfg, tile=cfg_tile,
                                     direct_rows=rows)
    up_bytes = A3B_K * 2 * A3B_I * A3B_H
    for tile in up_tiles:
        record("gate_up", tile, partial(proj, tile=tile, glu=True, dst=up_out, rows=1),
               up_bytes)
    for tile in down_tiles:
        record("down_slots", tile, partial(proj, tile=tile, glu=False, dst=slots, rows=1),
               up_bytes // 2)
        record("down_sum", tile, partial(proj, tile=tile, glu=False, dst=summed, rows=A3B_K),
               up_bytes // 2)
    cfg = moe_kernels.pick_moe_config(1, A3B_K, A3B_E, A3B_H, A3B_I, FP8_BLOCK)
    for sums in (True, False):
        def experts(i: Any, sums: bool = sums) -> object:
            y = moe_kernels._moe_experts(i[0], i[1], i[2], w13, w2, s13, s2, FP8_BLOCK, cfg,
                                         sums)
            if isinstance(y, SplitSums):
                consumed(y)  # (as a consumer's launch would: no zeroing before the next call)
            return y
        record("experts_" + ("slots" if sums else "sum"), (), experts, up_bytes * 3 // 2,
               chosen=True)
    return out


def _fp8_glu_call(x: Tensor, cfg: GemvConfig, ws: tuple[Tensor, Tensor]) -> Tensor:
    return gemv_fp8_silu_mul(x, ws[0], (ws[1], FP8_BLOCK), cfg)


def _fp8_then_silu(x: Tensor, cfg: GemvConfig, ws: tuple[Tensor, Tensor]) -> Tensor:
    """`_then_silu` for an FP8 weight (its scales beside it)."""
    return silu_and_mul(_fp8_linear_call(x, cfg, ws))


def _fp8_glu_rows(name: str, x: Tensor, copies: list[tuple[Tensor, Tensor]]) -> list[Row]:
    """An FP8 gate_up with its activation: the GEMV's epilogue ("gemv_glu") in the chosen tile
    (`fp8_glu_config`) and others (W's rows a program: gate rows, each with its up row),
    against the unfused weight's chosen GEMV then `silu_and_mul` ("gemv+silu")."""
    m, k = x.shape
    n = copies[0][0].shape[0]
    chosen = fp8_glu_config(m, n, k, FP8_BLOCK[1])
    unfused = fp8_kernels._pick_fp8_config(m, n, k, FP8_BLOCK)
    assert isinstance(unfused, GemvConfig)
    tiles = [chosen] + [c for c in (GemvConfig(bn, bk, num_warps=w) for bn in (1, 2, 4, 8)
                                    for bk, w in ((512, 4), (512, 2), (1024, 2), (2048, 2)))
                        if c != chosen]

    def row(kind: str, cfg: GemvConfig, us: float, chosen: bool) -> Row:
        tile = f"{cfg.block_n}x{cfg.block_k}x{cfg.num_warps}"
        return {"shape": name, "M": m, "kind": kind, "name": f"{kind}/{tile}", "us": us,
                "config": dataclasses.asdict(cfg), "GBps": n * k / us / 1e3, "chosen": chosen}

    rows = [row("gemv_glu", cfg, _time_us(partial(_fp8_glu_call, x, cfg), copies), j == 0)
            for j, cfg in enumerate(tiles)]
    return [*rows, row("gemv+silu", unfused,
                       _time_us(partial(_fp8_then_silu, x, unfused), copies), False)]


def bench_fp8(rows: tuple[int, ...], shapes: list[str]) -> list[Row]:
    """Each FP8 linear kind per shape and M, and F.linear on the same weights in bf16 (cuBLAS),
    in a CUDA graph over weight copies past L2. GB/s counts the FP8 weight's bytes."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    out: list[Row] = []
    for name in shapes:
        n, k = FP8_SHAPES[name]
        copies = [_fp8_weight((n, k), gen) for _ in range(_copies(n * k))]
        bf16 = [fp8_ref.fp8_dequant_ref(w, s, FP8_BLOCK, torch.bfloat16)
                for w, s in copies[:_copies(2 * n * k)]]
        for m in rows:
            x = _x(m, k, gen)
            chosen = fp8_kernels._pick_fp8_config(m, n, k, FP8_BLOCK)
            block_m = min(128, max(16, triton.next_power_of_2(m)))
            kinds: list[GemvConfig | fp8_kernels.Fp8Config] = [chosen] + [
                fp8_kernels.Fp8Config(kind, block_m, 64 if m <= 64 else 128, 128)
                for kind in ("w8a16", "w8a8") if kind != _fp8_kind(chosen)]
            if m <= 2:  # the FMA GEMV's other K chunks and warps; W's rows a program
                kinds += [c for c in (GemvConfig(bn, bk, num_warps=w) for bn in sorted({m, 2 * m, 4, 8})
                                      for bk, w in ((512, 4), (1024, 1), (1024, 4), (2048, 2),
                                                    (2048, 4), (4096, 2), (4096, 4)))
                          if c != chosen]
            if m <= 4:  # the tensor-core GEMV (swap AB) at few rows, K split or not
                kinds += [c for c in (GemvConfig(bn, 128, 4, 3, split_k=s, mma=True)
                                      for bn in (64, 128) for s in (1, 2, 4)) if c != chosen]
            for j, cfg in enumerate(kinds):
                us = _time_us(partial(_fp8_linear_call, x, cfg), copies)
                out.append({"shape": name, "M": m, "kind": _fp8_kind(cfg), "us": us,
                            "config": dataclasses.asdict(cfg),
                            "GBps": n * k / us / 1e3, "chosen": j == 0})
            us = _time_us(partial(F.linear, x), bf16)
            out.append({"shape": name, "M": m, "kind": "cublas_bf16", "us": us,
                        "GBps": 2 * n * k / us / 1e3, "chosen": False})
            if name.endswith("gate_up") and m <= USE_GEMV_MAX_M:
                out += _fp8_glu_rows(name, x, copies)
    print(f"{'shape':8} {'M':>5} {'kind':>24} {'us':>8} {'GB/s':>7}")
    for r in out:
        c = r.get("config", {})
        tile = (f" N{c['block_n']}/K{c['block_k']}/w{c['num_warps']}/s{c['split_k']}"
                if r["kind"] in ("gemv", "gemv_mma", "gemv_glu", "gemv+silu") else "")
        print(f"{r['shape']:8} {r['M']:5} {r['kind'] + tile:>24} {r['us']:8.1f} {r['GBps']:7.0f}"
              f"{' *' if r['chosen'] else ''}")
    return out


def _w4_weight(n: int, k: int, gen: torch.Generator) -> Tensor:
    """Random 4-bit words [n, k / 8] with a group-128 format (Qwen's -AWQ layout's)."""
    words = torch.randint(-2**31, 2**31 - 1, (n, k // 8), generator=gen, device="cuda",
                          dtype=torch.int32)
    scale = (torch.rand(n, 1, k // 128, generator=gen, device="cuda") * 0.02).half()
    scales = torch.cat([scale, torch.zeros_like(scale)], dim=1)
    return w4a16_ref.attach_w4(words, w4a16_ref.W4Format(scales, 128))


def _w4_gemv_call(x: Tensor, cfg: GemvConfig, w: Tensor) -> Tensor:
    fmt = w4a16_ref.w4_format(w)
    assert fmt is not None
    return gemv_w4(x, w, (fmt.scales, fmt.group), cfg=cfg)


def _w4_gemm_call(x: Tensor, tile: tuple[int, int, int, int], w: Tensor) -> Tensor:
    fmt = w4a16_ref.w4_format(w)
    assert fmt is not None
    bm, bn, warps, split = tile
    return w4a16.w4_gemm(x, w, fmt, tile=(bm, bn, warps), split=split or None)


def bench_w4(rows: tuple[int, ...], shapes: list[str],
             tiles: tuple[tuple[int, ...], ...]) -> list[Row]:
    """The W4A16 GEMV (group 128, Qwen3-4B's shapes) in each tile and the GEMM in its tiles,
    in a CUDA graph over weight copies past L2. GB/s counts the words, scales and zeros."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    out: list[Row] = []
    print(f"{'shape':8} {'M':>3} {'kind':>5} {'tile':>22} {'us':>8} {'GB/s':>7}", flush=True)
    for name in shapes:
        n, k = LINEARS[name]
        nbytes = n * k // 2 + 2 * n * (k // 128) * 2
        copies = [_w4_weight(n, k, gen) for _ in range(_copies(nbytes))]
        for m in rows:
            x = _x(m, k, gen)
            cfgs: list[GemvConfig] = []
            if use_w4_gemv(m):  # the GEMV takes 1..MAX_W4_ROWS rows
                chosen = w4_gemv_config(m, n, k)
                cfgs = [chosen] + [c for c in (
                    replace(chosen, block_n=bn, block_k=bk, num_warps=w, stack=bool(st),
                            num_stages=ns)
                    for bn, bk, w, st, ns in (tuple(t) + (0, 1)[len(t) - 3:] for t in tiles))
                    if c != chosen]
            for cfg in cfgs:
                us = _time_us(partial(_w4_gemv_call, x, cfg), copies)
                out.append(_w4_row(name, m, "gemv", [cfg.block_n, cfg.block_k, cfg.num_warps,
                                                     cfg.split_k, int(cfg.stack), cfg.num_stages],
                                   us, nbytes, cfg == cfgs[0]))
            for tile in W4_GEMM_TILES if not use_w4_gemv(m) else ():
                us = _time_us(partial(_w4_gemm_call, x, tile), copies)
                out.append(_w4_row(name, m, "gemm", list(tile), us, nbytes, False))
    return out


def _w4_row(name: str, m: int, kind: str, tile: list[int], us: float, nbytes: int,
            chosen: bool) -> Row:
    """One timing of `bench_w4`, printed as it comes (a sweep cut short still shows it)."""
    print(f"{name:8} {m:3} {kind:>5} {tuple(tile)!s:>22} {us:8.1f} {nbytes / us / 1e3:7.0f}"
          f"{' *' if chosen else ''}", flush=True)
    return {"shape": name, "M": m, "kind": kind, "tile": tile, "us": us,
            "GBps": nbytes / us / 1e3, "chosen": chosen}

# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------

@dataclass
class PagedKV:
    """A paged KV cache of one layer and the rows in it (`extend_attention`'s argument names)."""

    k_cache: Tensor
    v_cache: Tensor
    k_scale: Tensor | None
    v_scale: Tensor | None
    page_table: Tensor  # [rows, max_pages] int32
    seq_lens: Tensor  # [rows] int32


def paged_kv(seq_lens: list[int], fp8: bool = False) -> PagedKV:
    """Random bf16 K/V (FP8 with its scales) for rows of seq_lens tokens, in pages scattered by
    a random permutation."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    need = [-(-n // PAGE) for n in seq_lens]
    num_pages = sum(need) + 1
    perm = torch.randperm(num_pages, generator=gen, device="cuda").int()
    table = torch.zeros(len(seq_lens), max(need) + 1, dtype=torch.int32, device="cuda")
    start = 0
    for row, n in enumerate(need):
        table[row, :n] = perm[start:start + n]
        start += n
    shape = (num_pages, PAGE, KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, generator=gen, device="cuda").bfloat16()
    v = torch.randn(shape, generator=gen, device="cuda").bfloat16()
    k_scale = v_scale = None
    if fp8:
        (k, k_scale), (v, v_scale) = quantize_fp8_ref(k), quantize_fp8_ref(v)
    return PagedKV(k, v, k_scale, v_scale, table,
                   torch.tensor(seq_lens, dtype=torch.int32, device="cuda"))


def _decode_on(q: Tensor, kv: PagedKV, out: Tensor, splits: int, cfg: tuple[int, int, int],
               layer: tuple[Tensor, Tensor]) -> Tensor:
    """decode_attention of kv's rows over the caches of `layer`."""
    return decode_attention(q, *layer, kv.page_table, kv.seq_lens, HEAD_DIM ** -0.5, splits,
                            out=out, config=cfg)


def bench_decode(batches: tuple[int, ...], contexts: tuple[int, ...]) -> list[Row]:
    """One layer's decode attention as a decode step runs it (CUDA graph, each call on another
    copy of the cache): µs per call and KV read GB/s for the default config and DECODE_CONFIGS,
    at split counts around the one the engine's graphs use. Prints each case's best."""
    out: list[Row] = []
    for ctx, batch in itertools.product(contexts, batches):
        kv = paged_kv([ctx] * batch)
        q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda").bfloat16()
        o = torch.empty_like(q)
        kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2
        layers = [(kv.k_cache.clone(), kv.v_cache.clone()) for _ in range(_copies(kv_bytes))]
        default = pick_num_splits(batch, KV_HEADS, 40960)  # the graphs' longest context
        default_cfg = default_config(batch, HEAD_DIM)
        configs = [default_cfg, *(c for c in DECODE_CONFIGS if c != default_cfg)]
        times: dict[tuple[int, tuple[int, int, int]], float] = {}
        for splits in sorted({max(1, default // 2), default, 2 * default, 4 * default}):
            if splits > 64:
                continue
            for cfg in configs:
                try:
                    us = _time_us(partial(_decode_on, q, kv, o, splits, cfg), layers)
                except Exception as e:  # e.g. out of shared memory: report and go on
                    print(f"ctx {ctx} batch {batch} splits {splits} {cfg}: "
                          f"{type(e).__name__}", flush=True)
                    continue
                times[(splits, cfg)] = us
                out.append({"ctx": ctx, "batch": batch, "splits": splits, "block_n": cfg[0],
                            "warps": cfg[1], "stages": cfg[2], "us": us,
                            "gbs": kv_bytes / us / 1e3,
                            "default": splits == default and cfg == default_cfg})
        best = min(times, key=lambda key: times[key])
        base = times.get((default, default_cfg), float("nan"))
        print(f"ctx {ctx:5} batch {batch:3}: default (splits {default}, {default_cfg}) "
              f"{base:6.1f} us | best splits {best[0]} {best[1]} {times[best]:6.1f} us "
              f"{kv_bytes / times[best] / 1e3:5.0f} GB/s", flush=True)
        del layers
        torch.cuda.empty_cache()
    return out


def bench_extend(seq_len: int, prefix: int, fp8: bool,
                 configs: list[tuple[int, int, int, int]]) -> list[Row]:
    """TFLOP/s of one row of seq_len - prefix new tokens after a cached prefix (do_bench, eager
    and in a CUDA graph), against torch SDPA (flash backend, causal, dense K/V expanded to all
    heads) when there is no prefix. configs: also time these (BLOCK_M, BLOCK_N, num_warps,
    num_stages)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench, do_bench_cudagraph

    q_len = seq_len - prefix
    kv = paged_kv([seq_len], fp8)
    q = (torch.randn(q_len, HEADS, HEAD_DIM, device="cuda") * 2).bfloat16()
    cu_q_lens = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")
    scale = HEAD_DIM ** -0.5
    args = (q, kv.k_cache, kv.v_cache, kv.page_table, cu_q_lens, kv.seq_lens, scale, q_len)
    flops = 4 * HEADS * HEAD_DIM * (q_len * prefix + q_len * (q_len + 1) / 2)
    o = torch.empty_like(q)
    base = {"seq_len": seq_len, "prefix": prefix, "kv": "fp8" if fp8 else "bf16"}
    out: list[Row] = []

    def report(name: str, ms: float) -> None:
        out.append({**base, "kernel": name, "us": ms * 1e3, "tflops": flops / ms / 1e9})
        print(f"{name:>34}: {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.1f} TFLOP/s", flush=True)

    def run() -> Tensor:
        return extend.extend_attention(*args, k_scale=kv.k_scale, v_scale=kv.v_scale, out=o)

    print(f"seq_len {seq_len}, prefix {prefix}, heads {HEADS}/{KV_HEADS}, D {HEAD_DIM}, "
          f"fp8 {fp8}")
    report("extend_attention", do_bench(run))
    report("extend_attention (CUDA graph)", do_bench_cudagraph(run))
    for cfg in configs:
        try:
            report(f"config {cfg}", do_bench(
                lambda cfg=cfg: extend._launch(*args, kv.k_scale, kv.v_scale, o, *cfg)))
        except Exception as e:  # e.g. out of shared memory: report and go on
            print(f"config {cfg}: {type(e).__name__}: {str(e)[:200]}")
    if prefix == 0 and not fp8:
        pos = torch.arange(seq_len, device="cuda")
        pages, offs = kv.page_table[0, pos // PAGE].long(), pos % PAGE
        group = HEADS // KV_HEADS
        qd = q.transpose(0, 1)[None].contiguous()  # [1, H, L, D]
        kd, vd = (c[pages, offs].transpose(0, 1)[None].repeat_interleave(group, 1).contiguous()
                  for c in (kv.k_cache, kv.v_cache))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            report("torch SDPA flash (dense)", do_bench(
                lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)))
    return out


# ---------------------------------------------------------------------------------------------
# Gated DeltaNet (Qwen3.5-4B)
# ---------------------------------------------------------------------------------------------

#: Qwen3.5-4B's Gated DeltaNet layers: key heads, value heads, head dim, conv kernel
GDN_HK, GDN_HV, GDN_D, GDN_K = 16, 32, 128, 4


#: the recurrent kernel's launches `deltanet --sweep` times at each batch (value columns, warps)
DELTANET_SWEEP = tuple(deltanet.Launch(bv, w) for bv, w in (
    (8, 1), (8, 2), (16, 1), (16, 2), (16, 4), (32, 4), (32, 8), (64, 8)))


@contextmanager
def _decode_launch(launch: deltanet.Launch) -> Iterator[None]:
    """Every decode row count on `launch` (kernels/deltanet.py's table, swapped for a sweep)."""
    saved = deltanet.DECODE_SMALL, deltanet.DECODE_MID, deltanet.DECODE_LARGE
    deltanet.DECODE_SMALL = deltanet.DECODE_MID = deltanet.DECODE_LARGE = launch
    try:
        yield
    finally:
        deltanet.DECODE_SMALL, deltanet.DECODE_MID, deltanet.DECODE_LARGE = saved


def bench_deltanet(batches: tuple[int, ...], prefill: int, sweep: bool = False) -> list[Row]:
    """One layer's `gated_delta`, bf16 with fp32 states: decode steps of `batches` rows in a CUDA
    graph, each call on another copy of the slots' states (together past L2, as a step's 24
    layers are), GB/s counting the states read and written once; one `prefill`-token row from
    zero states, the chunked path and the token-by-token one (eager and in a CUDA graph); and
    `gated_rms_norm` over those tokens' heads."""
    from triton.testing import do_bench, do_bench_cudagraph

    from arle_kernels.deltanet import gated_delta, gated_rms_norm

    gen = torch.Generator(device="cuda").manual_seed(0)
    c = (2 * GDN_HK + GDN_HV) * GDN_D
    i32 = torch.int32

    def randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        return torch.randn(*shape, device="cuda", generator=gen).to(dtype)

    conv_w = randn(c, GDN_K) / 2
    a_log = torch.empty(GDN_HV, device="cuda").uniform_(1, 16, generator=gen).log().bfloat16()
    dt_bias = randn(GDN_HV)
    state_bytes = GDN_HV * GDN_D * GDN_D * 4 + c * (GDN_K - 1) * 2
    out: list[Row] = []
    print(f"{'case':36} {'us':>10} {'GB/s':>8}")

    def report(case: str, rows: int, tokens: int, us: float, nbytes: int = 0) -> None:
        gbps = nbytes / us / 1e3 if nbytes else 0.0
        out.append({"case": case, "rows": rows, "tokens": tokens, "us": us, "GBps": gbps})
        print(f"{case:36} {us:10.1f} {gbps:8.0f}", flush=True)

    for b in batches:
        x, a, bb = randn(b, c), randn(b, GDN_HV), randn(b, GDN_HV)
        slots = torch.arange(b, device="cuda", dtype=i32)
        seq_lens = torch.randint(1, 4096, (b,), device="cuda", generator=gen, dtype=i32)
        cu = torch.zeros(1, device="cuda", dtype=i32)
        states = [(randn(b, c, GDN_K - 1), randn(b, GDN_HV, GDN_D, GDN_D, dtype=torch.float32))
                  for _ in range(_copies(b * state_bytes))]

        def step(st: tuple[Tensor, Tensor], x: Tensor = x, a: Tensor = a, bb: Tensor = bb,
                 slots: Tensor = slots, seq_lens: Tensor = seq_lens, cu: Tensor = cu,
                 b: int = b) -> Tensor:
            return gated_delta(x, a, bb, conv_w, a_log, dt_bias, *st, slots, seq_lens, cu, b,
                               1, GDN_HK, PAGE)

        report(f"decode, batch {b}", b, b, _time_us(step, states), 2 * b * state_bytes)
        if sweep:  # the recurrent kernel's other launches at this batch
            for launch in DELTANET_SWEEP:
                with _decode_launch(launch):
                    report(f"  BV {launch.block_v}, {launch.num_warps} warps", b, b,
                           _time_us(step, states), 2 * b * state_bytes)
    t = prefill
    x, a, bb = randn(t, c), randn(t, GDN_HV), randn(t, GDN_HV)
    conv = torch.zeros(1, c, GDN_K - 1, device="cuda", dtype=torch.bfloat16)
    ssm = torch.zeros(1, GDN_HV, GDN_D, GDN_D, device="cuda")
    idx = (torch.zeros(1, device="cuda", dtype=i32), torch.full((1,), t, device="cuda", dtype=i32),
           torch.tensor([0, t], device="cuda", dtype=i32))
    for chunked in (True, False):
        def run(chunked: bool = chunked) -> Tensor:
            return gated_delta(x, a, bb, conv_w, a_log, dt_bias, conv, ssm, *idx, 0, t, GDN_HK,
                               PAGE, chunked=chunked)
        name = "chunked" if chunked else "token by token"
        report(f"prefill {t}, {name}", 1, t, do_bench(run) * 1e3)
        report(f"prefill {t}, {name} (CUDA graph)", 1, t, do_bench_cudagraph(run) * 1e3)
    for tokens in (*batches, t):
        h, z = randn(tokens * GDN_HV, GDN_D), randn(tokens * GDN_HV, GDN_D)
        w = randn(GDN_D)
        report(f"gated_rms_norm, {tokens} tokens", 0, tokens,
               do_bench(partial(gated_rms_norm, h, z, w, 1e-6)) * 1e3, 3 * h.numel() * 2)
    return out


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(v) for v in s.split(","))


def run(args: argparse.Namespace) -> list[Row]:
    if args.cmd == "gemv":
        return bench_gemv(tuple(args.rows), args.shapes)
    if args.cmd == "sweep":
        tiles = tuple(args.tiles) if args.tiles else TILES[args.kernel]
        return sweep(args.kernel, tuple(args.rows), tuple(args.splits), args.shapes, tiles)
    if args.cmd == "fused":
        return bench_fused(tuple(args.tokens), tuple(args.batches))
    if args.cmd == "decode":
        return bench_decode(tuple(args.batches), tuple(args.contexts))
    if args.cmd == "moe":
        return bench_moe(tuple(args.tokens), tuple(w == "fp8" for w in args.weights),
                         args.chosen)
    if args.cmd == "moe1":
        return bench_moe_one_token(tuple(args.up_tiles), tuple(args.down_tiles))
    if args.cmd == "fp8":
        return bench_fp8(tuple(args.rows), args.shapes)
    if args.cmd == "w4":
        return bench_w4(tuple(args.rows), args.shapes, tuple(args.tiles))
    if args.cmd == "deltanet":
        return bench_deltanet(tuple(args.batches), args.prefill, args.sweep)
    return [row for prefix in args.prefix for kv in args.kv
            for row in bench_extend(args.seq_len, prefix, kv == "fp8", args.configs)]


def _shapes_arg(c: argparse.ArgumentParser) -> None:
    c.add_argument("--shapes", nargs="+", choices=list(LINEARS), default=list(LINEARS),
                   help="linear layers (default: all)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("gemv", help="gemv against F.linear (cuBLAS)")
    c.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8], help="M")
    _shapes_arg(c)
    c = sub.add_parser("sweep", help="one GEMV kernel's tiles x splits")
    c.add_argument("--kernel", choices=list(TILES), default="tma")
    c.add_argument("--rows", type=int, nargs="+", default=[8], help="M")
    c.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8])
    _shapes_arg(c)
    c.add_argument("--tiles", type=_ints, nargs="+",
                   help="block_n,block_k,num_warps,num_stages ... (default: the kernel's TILES)")
    c = sub.add_parser("fused", help="the fused glue ops and the noise against their refs")
    c.add_argument("--tokens", type=int, nargs="+", default=[1, 4096])
    c.add_argument("--batches", type=int, nargs="+", default=[1, 64], help="noise rows")
    c = sub.add_parser("decode", help="decode attention's configs x splits")
    c.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    c.add_argument("--contexts", type=int, nargs="+", default=[640, 4096])
    c = sub.add_parser("extend", help="extend attention against SDPA flash")
    c.add_argument("--seq-len", type=int, default=4096)
    c.add_argument("--prefix", type=int, nargs="+", default=[0, 3584],
                   help="cached tokens before the new ones (one case each)")
    c.add_argument("--kv", choices=["bf16", "fp8"], nargs="+", default=["bf16", "fp8"])
    c.add_argument("--configs", type=_ints, nargs="+", default=[],
                   help="also BLOCK_M,BLOCK_N,num_warps,num_stages ...")
    c = sub.add_parser("moe", help="Qwen3-30B-A3B's experts: each kernel kind per token count")
    c.add_argument("--tokens", type=int, nargs="+",
                   default=[1, 2, 4, 8, 16, 32, 64, 128, 512, 2048, 8192])
    c.add_argument("--weights", choices=["bf16", "fp8"], nargs="+", default=["bf16", "fp8"])
    c.add_argument("--chosen", action="store_true", help="only the chosen config per count")
    c = sub.add_parser("moe1", help="one token through the FP8 experts: each GEMV tile")
    c.add_argument("--up-tiles", type=_ints, nargs="+", default=list(MOE1_UP_TILES),
                   help="block_n,block_k,num_warps ... of gate_up")
    c.add_argument("--down-tiles", type=_ints, nargs="+", default=list(MOE1_DOWN_TILES),
                   help="block_n,block_k,num_warps ... of down")
    c = sub.add_parser("fp8", help="block-FP8 linears: each kernel kind, and cuBLAS bf16")
    c.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 256, 2048])
    c.add_argument("--shapes", nargs="+", choices=list(FP8_SHAPES), default=list(A3B_LINEARS))
    c = sub.add_parser("w4", help="the W4A16 GEMV (AWQ/GPTQ) in each tile")
    c.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8], help="M")
    _shapes_arg(c)
    c.add_argument("--tiles", type=_ints, nargs="+", default=list(W4_TILES),
                   help="block_n,block_k,num_warps[,stack[,stages]] ... (default: W4_TILES)")
    c = sub.add_parser("deltanet", help="Gated DeltaNet (Qwen3.5-4B): decode steps, a prefill")
    c.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64], help="decode rows")
    c.add_argument("--prefill", type=int, default=4096, help="tokens of the prefill row")
    c.add_argument("--sweep", action="store_true", help="the decode kernel's launches too")
    for c in sub.choices.values():
        c.add_argument("--out", help="write the rows as JSON to this file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    rows = run(args)
    if args.out:
        meta = {**stamp(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                "triton": triton.__version__,
                "pdl": pdl_enabled(), "args": vars(args)}
        Path(args.out).write_text(json.dumps({**meta, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
