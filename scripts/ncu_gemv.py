#!/usr/bin/env python3
"""Qwen3-4B's linear layers as a decode step runs them, three calls each, for Nsight Compute:

    ncu --clock-control none -k regex:_gemv --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats python3 scripts/ncu_gemv.py \\
        [--rows 1,8] [--shapes gate_up,lm_head]

gate_up is the fused gate_up + SiLU·up (`gemv_silu_mul`), the others `gemv`. At 1 row they run
`_gemv_kernel` (CUDA cores), at 3..16 `_gemv_tma_kernel` (TMA + wgmma) on Hopper.

Why: at batch 8 the step's linear layers stream ~3.5 TB/s where batch 1's reach 3.96, and
lm_head, the same 8-row kernel and tile on a 778 MB weight, 4.4 (docs/benchmarks/
gpu-2026-11-30b.md, gpu-2026-11-30c.md). Counters say whether a kernel waits on DRAM, on its
pipeline's barriers, or on neither, and how its DRAM traffic compares with its weight bytes.
"""

from __future__ import annotations

import argparse

import torch

from arle_kernels.gemv import BENCH_SHAPES, gemv, gemv_silu_mul


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8", help="batch sizes, comma-separated")
    ap.add_argument("--shapes", default="gate_up", help=f"of {', '.join(BENCH_SHAPES)}")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes.split(","):
        n, k = BENCH_SHAPES[shape]
        w = (torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5).to(torch.bfloat16)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            for _ in range(3):
                gemv_silu_mul(x, w) if shape == "gate_up" else gemv(x, w)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
