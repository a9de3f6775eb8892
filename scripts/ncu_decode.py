#!/usr/bin/env python3
"""Qwen3-4B's decode attention (one layer) as a decode step runs it, three calls, for Nsight
Compute:

    ncu --clock-control none -k regex:"_decode_split|_merge" --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \\
        python3 scripts/ncu_decode.py [--rows 1,8] [--context 576]

The split count is the one the engine's CUDA graphs use (`pick_num_splits` for a 40960-token
model), so at short contexts most splits are empty, as in a step.

Why: at batch 8 the split kernel is the largest share of a decode step's critical path after
the linear layers (~10 us a layer for ~18 MB of K/V at 512-640 tokens: under half of what HBM
streams; docs/benchmarks/gpu-2026-11-30d.md). Counters say whether it waits on DRAM, on its
dependent loads (page table, then K/V), or on too few warps.
"""

from __future__ import annotations

import argparse

import torch

from arle_kernels.decode_attention import decode_attention, pick_num_splits

PAGE = 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8", help="batch sizes, comma-separated")
    ap.add_argument("--context", type=int, default=576, help="tokens per row")
    ap.add_argument("--max-model-len", type=int, default=40960, help="what the splits are for")
    args = ap.parse_args()
    heads, kv_heads, d = 32, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch in (int(r) for r in args.rows.split(",")):
        pages_per_row = -(-args.context // PAGE)
        total = batch * pages_per_row + 1
        # each row's pages scattered over the pool, as a running server leaves them
        table = torch.randperm(total - 1, generator=gen, device="cuda").to(torch.int32)
        table = table[: batch * pages_per_row].view(batch, pages_per_row).contiguous()
        k = torch.randn(total, PAGE, kv_heads, d, generator=gen, device="cuda").bfloat16()
        v = torch.randn(total, PAGE, kv_heads, d, generator=gen, device="cuda").bfloat16()
        q = torch.randn(batch, heads, d, generator=gen, device="cuda").bfloat16()
        lens = torch.full((batch,), args.context, dtype=torch.int32, device="cuda")
        splits = pick_num_splits(batch, kv_heads, args.max_model_len)
        for _ in range(3):
            decode_attention(q, k, v, table, lens, d ** -0.5, splits)
        torch.cuda.synchronize()
        print(f"batch {batch}: {splits} splits, {2 * batch * args.context * kv_heads * d * 2 / 1e6:.1f} "
              f"MB of K/V", flush=True)


if __name__ == "__main__":
    main()
