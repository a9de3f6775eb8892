#!/usr/bin/env python3
"""What constrained decoding costs per step: the same requests with and without a JSON schema.

For each batch size, `--rounds` interleaved rounds (medians reported) of:
  - constrained: B concurrent greedy requests whose output must match SCHEMA (ends at EOS);
  - unconstrained: the same prompts, as many tokens as the constrained run made (ignore_eos);
and the decode time per step of each: (end-to-end - time to first token) / (tokens - 1). Then,
offline, the grammar's own host work per token over the constrained outputs: filling one mask
and consuming one token (llguidance), which the executor overlaps with the step's forward.

    python scripts/bench_structured.py [--model PATH] [--device cpu|cuda] [--batch 1 8]
                                       [--rounds 3] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from arle.config import EngineConfig
from arle.engine.async_engine import AsyncEngine
from arle.engine.build import build_engine
from arle.engine.request import GenerateRequest, Grammar, SamplingParams
from arle.model.default import resolve_model_path
from arle.threads import torch_thread

SCHEMA = {"type": "object", "properties": {
    "order": {"type": "integer", "minimum": 0, "maximum": 99999},
    "items": {"type": "array", "minItems": 6, "maxItems": 6, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                         "qty": {"type": "integer", "minimum": 1,
                                                 "maximum": 99}},
        "required": ["name", "qty"], "additionalProperties": False}}},
    "required": ["order", "items"], "additionalProperties": False}
PROMPT = "<|im_start|>user\nList a grocery order as JSON.<|im_end|>\n<|im_start|>assistant\n"


async def one(engine: AsyncEngine, grammar: Grammar | None, max_tokens: int
              ) -> tuple[float, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=grammar is None)
    ids: list[int] = []
    trace: dict[str, Any] = {}
    async for d in engine.generate(GenerateRequest(prompt=PROMPT, params=params, grammar=grammar,
                                                   route="bench")):
        ids += d.token_ids
        if d.finish_reason:
            trace = d.trace or {}
    n = trace["completion_tokens"]
    return (trace["total_ms"] - trace["ttft_ms"]) / max(n - 1, 1), ids


async def batch(engine: AsyncEngine, b: int, grammar: Grammar | None, max_tokens: int
                ) -> tuple[float, list[list[int]]]:
    runs = await asyncio.gather(*(one(engine, grammar, max_tokens) for _ in range(b)))
    return statistics.median(r[0] for r in runs), [r[1] for r in runs]


def host_cost(engine: AsyncEngine, outputs: list[list[int]]) -> dict[str, float]:
    """Microseconds per token of the matcher's own work, replaying the constrained outputs."""
    words = (engine.tokenizer.vocab_size + 31) // 32
    mask = torch.empty(words, dtype=torch.int32)
    fill = consume = 0.0
    count = 0
    for ids in outputs:
        m = engine.grammars.matcher(Grammar("json_schema", SCHEMA))
        for t in ids:
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(mask.data_ptr(), words * 4)
            t1 = time.perf_counter()
            m.consume_token(t)
            fill, consume, count = fill + t1 - t0, consume + time.perf_counter() - t1, count + 1
    return {"fill_us": fill / count * 1e6, "consume_us": consume / count * 1e6}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                          max_running_requests=max(args.batch), kv_cache_tokens=32768,
                          num_threads=args.threads)
    engine = await asyncio.wrap_future(torch_thread().submit(build_engine, config))
    grammar = Grammar("json_schema", SCHEMA)
    results: dict[str, Any] = {"model": str(resolve_model_path(args.model)), "schema": SCHEMA,
                               "batches": {}}
    try:
        await one(engine, grammar, 32)  # warm-up (builds the grammar tokenizer once)
        for b in args.batch:
            con, unc, outputs = [], [], []
            for _ in range(args.rounds):
                ms, outs = await batch(engine, b, grammar, 400)
                for out in outs:
                    json.loads(engine.tokenizer.decode(out))  # every output parses
                con.append(ms)
                outputs += outs
                unc.append((await batch(engine, b, None, max(len(o) for o in outs)))[0])
            row = {"constrained_ms_per_step": statistics.median(con),
                   "unconstrained_ms_per_step": statistics.median(unc),
                   "tokens": statistics.median(len(o) for o in outputs)}
            row["overhead_pct"] = 100 * (row["constrained_ms_per_step"]
                                         / row["unconstrained_ms_per_step"] - 1)
            results["batches"][b] = row
        results["host"] = host_cost(engine, outputs)
    finally:
        await engine.close()
    return results


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    res = asyncio.run(main(args))
    print(f"{'batch':>5} {'tokens':>6} {'unconstrained ms/step':>22} {'constrained ms/step':>20} "
          f"{'overhead':>9}")
    for b, row in res["batches"].items():
        print(f"{b:>5} {row['tokens']:>6.0f} {row['unconstrained_ms_per_step']:>22.2f} "
              f"{row['constrained_ms_per_step']:>20.2f} {row['overhead_pct']:>8.1f}%")
    h = res["host"]
    print(f"matcher host work per token: fill {h['fill_us']:.1f} us, "
          f"consume {h['consume_us']:.1f} us (overlapped with the forward)")
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))
    sys.exit(0)
