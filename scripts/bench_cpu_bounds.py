#!/usr/bin/env python3
"""What bounds batch-1 decode on the CPU: where a step's time goes, and attention's read rate.

step: an engine decodes a few tokens; its last decode step's inputs are kept and the step's
forward replayed on the engine's thread (`eager_forward`: same KV slot, same positions):
  - step_ms: the forward as it runs;
  - without_int_ms: the same with every integer matmul (the packed int4 / int8 kernels and
    the dtype casts around them) replaced by an empty output of its shape: what the rest of
    the step costs (norms, rotary, the cache write, attention, the glue);
  - int_alone_ms: the model's own integer matmuls back to back, in the step's order, on one
    row: what they cost without the rest of the step between them.

attention: one decode row per layer over `--layers` layers' pages (SmolLM2-135M's shape by
default: 9 query heads, 3 KV heads of 64), each layer's pages apart from the others' so a
step reads them from memory as the engine does; for each context length the time and the
GB/s of K and V of:
  - arle: `decode_attention_ref`, the CPU executor's path (per KV head, q @ K^T, softmax, @ V);
  - one_gemm: all heads in one GEMM over K as [L, kv_heads * head_dim] (a block-diagonal q);
  - read: `K.sum() + V.sum()`, the streaming read of the same bytes (the floor).

    python scripts/bench_cpu_bounds.py [--model PATH] [--contexts 512,2048,6144] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from typing import Any
from unittest.mock import patch

import torch
from stamp import stamp

from arle_kernels.decode_attention_ref import decode_attention_ref


def median_ms(fn: Callable[[], Any], rounds: int) -> float:
    """The median of `rounds` timed calls after 10 warm ones, in ms."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


async def replay_step(args: argparse.Namespace) -> dict[str, Any]:
    import arle_kernels.quant as quant
    from arle.config import EngineConfig
    from arle.engine.build import create_engine
    from arle.engine.request import GenerateRequest, SamplingParams
    from arle.executor.step import eager_forward
    from arle.threads import torch_thread

    engine = await create_engine(EngineConfig(model=args.model, enable_prefix_cache=False))
    executor: Any = engine.executor
    steps: list[Any] = []
    run_step = executor.run_step

    def keep(inputs: Any) -> Any:
        steps.append(inputs)
        return run_step(inputs)

    executor.run_step = keep
    ids = engine.tokenizer.encode("Tell me a story. " * args.context, add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    async for _ in engine.generate(GenerateRequest(prompt=ids[:args.context], params=params)):
        pass
    decode = steps[-2]  # (the last one's output is dropped: overlap)
    meta = torch.tensor(decode.packed.meta, dtype=torch.int32)
    calls: list[tuple[Callable[..., torch.Tensor], tuple[Any, ...]]] = []
    real: dict[str, Callable[..., torch.Tensor]] = {"int4_linear": quant.int4_linear,
                                                    "int8_linear": quant.int8_linear}

    def forward() -> Any:
        return eager_forward(executor.dev, decode, meta, 1)

    recording = [True]

    def stand_in(name: str) -> Callable[..., torch.Tensor]:
        """An empty output for the kernel `name`; the call (its bf16 rows) kept while
        recording."""
        def call(x: torch.Tensor, w: torch.Tensor, fmt: Any, bias: Any = None) -> torch.Tensor:
            if recording[0]:
                rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
                calls.append((real[name], (rows, w, fmt)))
            return x.new_empty(*x.shape[:-1], fmt.n if name == "int4_linear" else w.shape[0])
        return call

    def measure() -> dict[str, float]:
        out = {"step_ms": median_ms(forward, args.step_rounds)}
        with (patch.object(quant, "int4_linear", stand_in("int4_linear")),
              patch.object(quant, "int8_linear", stand_in("int8_linear"))):
            forward()  # one forward's calls, in order
            recording[0] = False
            out["without_int_ms"] = median_ms(forward, args.step_rounds)
        out["int_alone_ms"] = median_ms(lambda: [f(*a) for f, a in calls], args.step_rounds)
        out["int_calls"] = len(calls)
        return out

    try:
        result = torch_thread().submit(measure).result()
    finally:
        await engine.close()
    return {"model": args.model or "default", "context": args.context, **result}


def one_gemm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [H, D] against k, v [L, KVH, D] with one GEMM each (q block-diagonal per KV head)."""
    h, d = q.shape
    length, kvh = k.shape[:2]
    group = h // kvh
    qbd = torch.zeros(kvh, d, h)
    for i in range(h):
        qbd[i // group, :, i] = q[i]
    p = torch.softmax((k.reshape(length, -1) @ qbd.view(kvh * d, h)).t() * d ** -0.5, dim=-1)
    out = (p @ v.reshape(length, -1)).view(h, kvh, d)
    return out[torch.arange(h), torch.arange(h) // group]


def timed(step: Callable[[int], Any], layers: int, rounds: int) -> float:
    """The fastest of `rounds` passes over every layer (one warm pass first), in seconds."""
    best = float("inf")
    for r in range(rounds + 1):
        t0 = time.perf_counter()
        for i in range(layers):
            step(i)
        if r:
            best = min(best, time.perf_counter() - t0)
    return best


def attention(length: int, args: argparse.Namespace) -> dict[str, Any]:
    ps, kvh, d, h = 16, args.kv_heads, args.head_dim, args.heads
    pages = -(-length // ps)
    kc, vc = (torch.randn(args.layers, pages, ps, kvh, d) for _ in range(2))
    q = torch.randn(1, h, d)
    table = torch.arange(pages, dtype=torch.int32)[None]
    lens = torch.tensor([length], dtype=torch.int32)
    nbytes = 2 * kc[0].numel() * kc.element_size() * args.layers

    def kv(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return kc[i].view(-1, kvh, d), vc[i].view(-1, kvh, d)

    def arle(i: int) -> Any:
        return decode_attention_ref(q, kc[i], vc[i], table, lens, d ** -0.5, 1)

    def gemm(i: int) -> Any:
        return one_gemm(q[0], *kv(i))

    def read(i: int) -> Any:
        return [t.sum() for t in kv(i)]

    out: dict[str, Any] = {}
    for name, step in (("arle", arle), ("one_gemm", gemm), ("read", read)):
        s = timed(step, args.layers, args.rounds)
        out[name] = {"ms": s * 1e3, "gb_s": nbytes / s / 1e9, "bytes": nbytes}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--context", type=int, default=32, help="the replayed step's prompt")
    ap.add_argument("--step-rounds", type=int, default=200)
    ap.add_argument("--contexts", default="512,2048,6144", help="attention's lengths")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench_cpu_bounds.json")
    args = ap.parse_args()
    from arle.threads import torch_thread

    # NOTE: on the engine's thread, as the step: a second thread's OpenMP team would spin
    # against the first one's on the same cores
    lengths = args.contexts.split(",")
    report: dict[str, Any] = {
        **stamp(), "threads": torch.get_num_threads(), "args": vars(args),
        "attention": torch_thread().submit(
            lambda: {n: attention(int(n), args) for n in lengths}).result(),
        "step": asyncio.run(replay_step(args))}
    print(json.dumps(report["step"], indent=1))
    for n, ways in report["attention"].items():
        print(n, "  ".join(f"{k} {v['ms']:.2f} ms {v['gb_s']:.1f} GB/s" for k, v in ways.items()))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
