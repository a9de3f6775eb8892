#!/usr/bin/env python3
"""Qwen3-4B's fused gate_up + SiLU·up as a decode step runs it, at 1 row (`_gemv_kernel`, CUDA
cores) and 8 rows (`_gemv_tma_kernel`, TMA + wgmma), three calls each, for Nsight Compute:

    ncu --clock-control none -k regex:_gemv --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats python3 scripts/ncu_gemv.py

Why: at batch 8 the step's linear layers stream 3.47 TB/s where batch 1's reach 3.96, and
gate_up is most of the gap (docs/benchmarks/gpu-2026-11-30b.md). Counters say whether the
8-row kernel waits on DRAM, on its pipeline's barriers, or on neither.
"""

from __future__ import annotations

import torch

from arle_kernels.gemv import BENCH_SHAPES, gemv_silu_mul


def main() -> None:
    n2, k = BENCH_SHAPES["gate_up"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n2, k, generator=gen, device="cuda") * k ** -0.5).to(torch.bfloat16)
    for m in (1, 8):
        x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
        for _ in range(3):
            gemv_silu_mul(x, w)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
