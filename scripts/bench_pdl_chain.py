#!/usr/bin/env python3
"""What one kernel boundary costs in a decode step's chain, with and without PDL.

A batch-8 decode step of Qwen3-4B is ~440 kernels, each reading what the one before wrote. This
times a CUDA graph of `--kernels` such kernels, each doing (almost) nothing but that handoff: its
programs wait for the previous kernel (`gdc_wait` under PDL), load one fp32 the previous kernel
stored, and store it + 1. The graph replay time divided by the kernel count is the floor a
boundary puts under the step, whatever the kernels compute; the last value read back checks the
chain ran in order.

    python3 scripts/bench_pdl_chain.py [--kernels 432] [--out result.json]

Grids of 8, 132 and 264 programs (a norm at batch 8, one program per SM, two), 4 warps.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
import triton.testing

from arle_kernels.jit import gdc_launch_dependents, gdc_wait, pdl_launch


@triton.jit
def _step_kernel(src_ptr, dst_ptr, PDL: tl.constexpr):
    """dst[pid] = src[pid] + 1, after the kernel that wrote src (PDL: launched early, waits)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    pid = tl.program_id(0)
    tl.store(dst_ptr + pid, tl.load(src_ptr + pid) + 1.0)


def chain_us(kernels: int, programs: int, pdl: bool) -> tuple[float, float]:
    """(us per kernel over a replay of `kernels` chained launches, the last value)."""
    bufs = [torch.zeros(programs, device="cuda") for _ in range(2)]

    def run() -> None:
        for i in range(kernels):
            _step_kernel[(programs,)](bufs[i % 2], bufs[(i + 1) % 2], PDL=pdl, num_warps=4,
                                      **pdl_launch(pdl))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for b in bufs:
        b.zero_()
    graph.replay()
    torch.cuda.synchronize()
    last = float(bufs[kernels % 2][0])
    ms = triton.testing.do_bench(graph.replay, warmup=20, rep=200, return_mode="median")
    return float(ms) * 1000 / kernels, last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", type=int, default=432)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for programs in (8, 132, 264):
        for pdl in (False, True):
            us, last = chain_us(args.kernels, programs, pdl)
            rows.append({"programs": programs, "pdl": pdl, "us_per_kernel": round(us, 3),
                         "chain_ok": last == args.kernels})
            print(rows[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "kernels": args.kernels,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
