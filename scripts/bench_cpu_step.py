#!/usr/bin/env python3
"""Where a CPU decode step's time goes: one batch-1 decode step of the model, replayed.

An engine decodes a few tokens; its last decode step's inputs are kept and the step's forward
replayed on the engine's thread (`eager_forward`: same KV slot, same positions):
  - step_ms: the forward as it runs;
  - without_int_ms: the same with every integer matmul (the packed int4 / int8 kernels and
    the dtype casts around them) replaced by an empty output of its shape: what the rest of
    the step costs (norms, rotary, the cache write, attention, the glue);
  - int_alone_ms: the model's own integer matmuls back to back, in the step's order, on one
    row: what they cost without the rest of the step between them.
step_ms - without_int_ms is what the matmuls cost inside the step; against int_alone_ms it
shows how much the step's other work (its memory traffic, the threads' gaps) slows them.

    python scripts/bench_cpu_step.py [--model PATH] [--context 32] [--rounds 200]
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


def best_ms(fn: Callable[[], Any], rounds: int) -> float:
    """The median of `rounds` timed calls after 10 warm ones, in ms."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


async def measure(args: argparse.Namespace) -> dict[str, Any]:
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

    def timed() -> dict[str, float]:
        out = {"step_ms": best_ms(forward, args.rounds)}
        with (patch.object(quant, "int4_linear", stand_in("int4_linear")),
              patch.object(quant, "int8_linear", stand_in("int8_linear"))):
            forward()  # one forward's calls, in order
            recording[0] = False
            out["without_int_ms"] = best_ms(forward, args.rounds)
        out["int_alone_ms"] = best_ms(lambda: [f(*a) for f, a in calls], args.rounds)
        out["int_calls"] = len(calls)
        return out

    try:
        result = torch_thread().submit(timed).result()
    finally:
        await engine.close()
    return {**stamp(), "model": args.model or "default", "context": args.context,
            "threads": torch.get_num_threads(), **result}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--out", default="bench_cpu_step.json")
    args = ap.parse_args()
    report = asyncio.run(measure(args))
    print(json.dumps(report, indent=1))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
