#!/usr/bin/env python3
"""What bounds batch-1 decode attention on the CPU at long contexts: the read bandwidth each
way of computing it reaches over a K/V too large for the caches.

One decode row per layer, over `--layers` layers' pages (SmolLM2-135M's shape by default:
9 query heads, 3 KV heads of 64), each layer's pages apart from the others' so a step reads
them from memory as the engine does. For each context length, the seconds a step's attention
takes and the GB/s of K and V that makes:
  - arle: `decode_attention_ref`, the CPU executor's path (per KV head, q @ K^T, softmax, @ V);
  - one_gemm: all heads in one GEMM over K as [L, kv_heads * head_dim] (a block-diagonal q);
  - read: `K.sum() + V.sum()`, the streaming read of the same bytes (the floor).

    python scripts/bench_cpu_attention.py [--contexts 512,2048,6144] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch
from stamp import stamp

from arle_kernels.decode_attention import decode_attention_ref


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


def measure(length: int, args: argparse.Namespace) -> dict[str, Any]:
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
    ap.add_argument("--contexts", default="512,2048,6144")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench_cpu_attention.json")
    args = ap.parse_args()
    results = {n: measure(int(n), args) for n in args.contexts.split(",")}
    for n, ways in results.items():
        print(n, "  ".join(f"{k} {v['ms']:.2f} ms {v['gb_s']:.1f} GB/s" for k, v in ways.items()))
    report = {**stamp(), "threads": torch.get_num_threads(), "shape": vars(args),
              "contexts": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
