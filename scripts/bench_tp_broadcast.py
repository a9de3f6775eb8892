"""What a tensor-parallel step's broadcast costs on the CPU (gloo, 2 ranks on this host).

Rank 0 pickles a step's inputs and broadcasts them (`TPRanks.send`: a 16-byte header, then the
payload), rank 1 receives and unpickles them (`TPRanks.recv`), for a decode step of B rows and
a prefill step of T tokens; prints the median microseconds per step and the payload's bytes.

    python scripts/bench_tp_broadcast.py [--iters 300]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arle.executor.distributed import TPRanks, peer_inputs
from arle.executor.paged import StepInputs
from arle.executor.plan import Row, StepPlan
from arle.model.parallel import TPGroup
from arle.sampling import SamplingParams


def plans() -> dict[str, StepPlan]:
    params = SamplingParams(temperature=0.0)
    decode = [Row(slot=i, start=300 + i, num_tokens=1, input_ids=None, sample=True,
                  sample_offset=10, pages=list(range(i * 40, i * 40 + 40)), params=params)
              for i in range(64)]
    prefill = [Row(slot=0, start=0, num_tokens=512, input_ids=list(range(512)), sample=True,
                   sample_offset=0, pages=list(range(32)), params=params)]
    return {"decode, 64 rows": StepPlan(0, decode), "prefill, 512 tokens": StepPlan(1, prefill)}


def run(rank: int, port: int, iters: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))
    ranks = TPRanks(TPGroup(rank, 2), dist.new_group(backend="gloo"))
    for name, plan in plans().items():
        inputs = StepInputs.of(plan, 16)
        times = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                ranks.send(peer_inputs(inputs))
            else:
                ranks.recv()
            times.append(time.perf_counter() - t0)
        if rank == 1:
            import pickle

            size = len(pickle.dumps(peer_inputs(inputs), protocol=pickle.HIGHEST_PROTOCOL))
            print(f"{name}: {statistics.median(times) * 1e6:.0f} us (median of {iters}), "
                  f"{size} bytes")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args()
    port = 29000 + os.getpid() % 1000
    mp.spawn(run, args=(port, args.iters), nprocs=2)


if __name__ == "__main__":
    main()
