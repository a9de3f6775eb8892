"""The engine loop's own cost per step, with a null executor (no model, no device).

    python scripts/bench_loop.py [--batch 1 8 64 256] [--output-len 256] [--profile]

Everything a step costs on the host except the model: scheduling, flattening the plan
(`pack_step`, the CUDA executor's), processing the outputs (detokenize, stops, deltas) and the
consumers of the deltas. On a GPU this is the time a step must stay under for the device never
to wait: the executor overlaps it with the previous step. The tokenizer is the default model's.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Awaitable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arle.config import EngineConfig
from arle.engine.async_engine import AsyncEngine
from arle.engine.request import GenerateRequest, SamplingParams
from arle.executor.base import KVPoolInfo, StepOutput
from arle.executor.paged import pack_step
from arle.executor.plan import StepPlan
from arle.logging import configure_logging
from arle.model.default import resolve_model_path
from arle.model.gguf_io import read_gguf


class NullExecutor:
    """Samples token 1000 + step % 500 for every row at once; packs the plan like CUDA's."""

    def __init__(self, num_slots: int, num_pages: int) -> None:
        self.num_slots = num_slots
        self.kv_pool = KVPoolInfo(num_pages, 16, 0, "bfloat16")
        self.steps = 0

    def launch(self, plan: StepPlan) -> Awaitable[StepOutput]:
        self.steps += 1
        pack_step(plan, 16)
        n = sum(r.sample for r in plan.rows)
        future: asyncio.Future[StepOutput] = asyncio.get_running_loop().create_future()
        future.set_result(StepOutput([1000 + self.steps % 500] * n))
        return future

    def close(self) -> None:
        pass


async def run(batch: int, input_len: int, output_len: int, tokenizer: object) -> dict[str, float]:
    slots = max(batch, 1) + 1
    ex = NullExecutor(slots, 4 * batch * (input_len + output_len) // 16 + 64)
    engine = AsyncEngine(EngineConfig(max_running_requests=batch, max_batched_tokens=1 << 20,
                                      chunked_prefill_size=1 << 20),
                         tokenizer, ex, "null", 1 << 20)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> int:
        prompt = [(i * 7 + j) % 40000 + 100 for j in range(input_len)]
        n = 0
        async for d in engine.generate(GenerateRequest(prompt=prompt, params=params)):
            n += len(d.token_ids)
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(batch)))
    dt = time.perf_counter() - t0
    await engine.close()
    assert all(c == output_len for c in counts)
    return {"batch": batch, "steps": ex.steps, "ms_per_step": dt / ex.steps * 1e3,
            "us_per_row_step": dt / ex.steps / batch * 1e6, "tokens_per_s": sum(counts) / dt}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="cProfile the largest batch")
    args = p.parse_args()
    configure_logging("console", "warning")
    tokenizer = read_gguf(resolve_model_path(None)).tokenizer
    for b in args.batch:
        rows = [asyncio.run(run(b, args.input_len, args.output_len, tokenizer))
                for _ in range(args.repeats)]
        ms = statistics.median(r["ms_per_step"] for r in rows)
        print(f"batch {b:>4}: {ms:7.3f} ms/step, {ms / b * 1e3:6.1f} us per row, "
              f"{statistics.median(r['tokens_per_s'] for r in rows):9.0f} tok/s (host bound)")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        asyncio.run(run(max(args.batch), args.input_len, args.output_len, tokenizer))
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
