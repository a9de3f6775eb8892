#!/usr/bin/env python3
"""Speculative decoding (n-gram drafts) against one token a step, on one model.

Two parts, each in one engine per setting, `--rounds` interleaved rounds (medians):
  - tasks, batch 1, greedy: edit (rewrite a ~300-token code block with one change), quote
    (answer by quoting a document), chat (plain chat). Per setting: decode tok/s (after the
    first token), output tokens per decode step; with speculation, tokens per verify step and
    the drafts accepted. Speculation on must give speculation off's tokens.
  - cost: a verify step with K drafts that are always rejected (what drafting costs when it
    gains nothing) against a decode step, at each batch size: the device time per step of the
    same requests (the trace's decode phase over its decode steps).

    python scripts/bench_speculative.py [--model PATH] [--device cpu|cuda] [--k K]
        [--cost-k 1 2 4 8] [--batch 1 8] [--rounds 2] [--threads N] [--kv-cache-tokens N]
        [--eager-verify] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from stamp import stamp

from arle.config import EngineConfig
from arle.engine.async_engine import AsyncEngine
from arle.engine.build import build_engine
from arle.engine.request import GenerateRequest, SamplingParams
from arle.engine.speculative import Drafter, RequestSpec
from arle.logging import configure_logging
from arle.model.default import resolve_model_path
from arle.threads import torch_thread

CODE = '''def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, age, city = line.strip().split(",")
            users.append({"name": name, "age": int(age), "city": city})
    return users


def average_age(users):
    if not users:
        return 0
    total = 0
    for user in users:
        total += user["age"]
    return total / len(users)


def users_in_city(users, city):
    result = []
    for user in users:
        if user["city"] == city:
            result.append(user)
    return result


def oldest_user(users):
    oldest = None
    for user in users:
        if oldest is None or user["age"] > oldest["age"]:
            oldest = user
    return oldest


def main():
    users = load_users("users.csv")
    print("average age:", average_age(users))
    print("in Paris:", len(users_in_city(users, "Paris")))
    print("oldest:", oldest_user(users)["name"])


if __name__ == "__main__":
    main()
'''
DOCUMENT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the "
    "tower from 1887 to 1889. Locally nicknamed La dame de fer, it was constructed as the "
    "centrepiece of the 1889 World's Fair. Although initially criticised by some of France's "
    "leading artists and intellectuals for its design, it has since become a global cultural "
    "icon of France and one of the most recognisable structures in the world. The tower "
    "received 5,889,000 visitors in 2022. The Eiffel Tower is the most visited monument with "
    "an entrance fee in the world. The tower is 330 metres tall, about the same height as an "
    "81-storey building, and the tallest structure in Paris.")
TASKS = {
    "edit": "Rename the function average_age to mean_age in this code. Reply with the complete "
            f"updated code.\n\n```python\n{CODE}```",
    "quote": f"{DOCUMENT}\n\nCopy the sentences of the text above that give numbers, word for "
             "word.",
    "chat": "Write a short story about a robot who learns to paint.",
}


async def one(engine: AsyncEngine, text: str, max_tokens: int) -> tuple[list[int], dict[str, Any]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    ids: list[int] = []
    trace: dict[str, Any] = {}
    req = GenerateRequest(messages=[{"role": "user", "content": text}], params=params,
                          route="bench")
    async for d in engine.generate(req):
        ids += d.token_ids
        trace = d.trace or trace
    return ids, trace


def decode_steps(trace: dict[str, Any]) -> int:
    """A request's decode steps: its verify rows plus its plain decode rows (one token each)."""
    spec = trace["spec"] or {"accepted": 0, "verify_steps": 0}
    plain = trace["completion_tokens"] - 1 - spec["accepted"] - spec["verify_steps"]
    return spec["verify_steps"] + plain


def task_row(runs: list[tuple[list[int], dict[str, Any]]]) -> dict[str, Any]:
    """Medians over rounds: decode tok/s, tokens per decode step, the drafts' outcome."""
    def per_run(ids: list[int], t: dict[str, Any]) -> dict[str, float]:
        n, ms = len(ids), t["total_ms"] - t["ttft_ms"]
        spec = t["spec"] or {}
        out = {"tokens": n, "decode_tok_s": (n - 1) / ms * 1e3,
               "tokens_per_step": (n - 1) / max(decode_steps(t), 1)}
        if spec.get("verify_steps"):
            out["tokens_per_verify"] = (spec["accepted"] + spec["verify_steps"]) / spec[
                "verify_steps"]
            out["acceptance"] = spec["accepted"] / spec["drafted"]
        return out

    rows = [per_run(*r) for r in runs]
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]}


async def tasks(engines: dict[str, AsyncEngine], rounds: int, max_tokens: int
                ) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, text in TASKS.items():
        runs: dict[str, list[tuple[list[int], dict[str, Any]]]] = {s: [] for s in engines}
        for _ in range(rounds):
            for setting, engine in engines.items():
                runs[setting].append(await one(engine, text, max_tokens))
        outputs = {s: r[0][0] for s, r in runs.items()}
        row: dict[str, Any] = {s: task_row(r) for s, r in runs.items()}
        row["same_tokens"] = len({tuple(o) for o in outputs.values()}) == 1
        # the first output position where the settings part (None: none does)
        row["first_difference"] = next(
            (i for i, ts in enumerate(zip(*outputs.values(), strict=False)) if len(set(ts)) > 1),
            None if row["same_tokens"] else min(len(o) for o in outputs.values()))
        row["speedup"] = row["ngram"]["decode_tok_s"] / row["off"]["decode_tok_s"]
        results[name] = row
    return results


class RejectedDrafts(Drafter):
    """K drafts every step, never the model's choice in practice: verify steps that gain
    nothing (what speculation costs)."""

    def lookup(self, spec: RequestSpec, tokens: Sequence[int], num_output: int,
               k: int) -> list[int]:
        return [0] * k


async def ms_per_step(engine: AsyncEngine, b: int, rounds: int) -> float:
    """The median ms per decode step of b concurrent 48-token chats, over rounds."""
    samples = []
    for _ in range(rounds):
        runs = await asyncio.gather(*(one(engine, TASKS["chat"] + f" ({i})", 48)
                                      for i in range(b)))
        samples += [r[1]["scheduler"]["phase_us"]["decode"] / 1e3 / decode_steps(r[1])
                    for r in runs]
    return statistics.median(samples)


async def cost(engines: dict[str, AsyncEngine], cost_k: list[int], batches: list[int],
               rounds: int) -> dict[str, Any]:
    """ms per decode step, off and with K always-rejected drafts, per batch size (and, with
    an "eager" engine, its verify steps without graphs: `eager_k*`)."""
    results: dict[str, Any] = {}
    spec_engines = {name: engines[key] for name, key in (("", "ngram"), ("eager_", "eager"))
                    if key in engines}
    for b in batches:
        row = {"k0_ms_per_step": await ms_per_step(engines["off"], b, rounds)}
        for prefix, engine in spec_engines.items():
            drafter = engine.scheduler.drafter
            assert drafter is not None
            for k in cost_k:
                engine.scheduler.drafter = RejectedDrafts(replace(
                    drafter.config, num_tokens=k, row_block=1, step_tokens=10**6,
                    max_rows=10**6, verify_cost=0.0, draft_cost=0.0))
                row[f"{prefix}k{k}_ms_per_step"] = await ms_per_step(engine, b, rounds)
                row[f"{prefix}k{k}_vs_decode"] = (row[f"{prefix}k{k}_ms_per_step"]
                                                  / row["k0_ms_per_step"])
            engine.scheduler.drafter = drafter
        results[str(b)] = row
    return results


def build(config: EngineConfig, extend_graphs: bool = True) -> AsyncEngine:
    """An engine; extend_graphs False: a CUDA engine whose steps with prefill or verify rows
    all run eagerly (the baseline of the verify steps' graphs)."""
    from arle.executor.cuda import CUDAExecutorConfig

    default = CUDAExecutorConfig.extend_graph_max_tokens
    if not extend_graphs:
        CUDAExecutorConfig.extend_graph_max_tokens = 0
    try:
        return build_engine(config)
    finally:
        CUDAExecutorConfig.extend_graph_max_tokens = default


async def main(args: argparse.Namespace) -> dict[str, Any]:
    engines: dict[str, AsyncEngine] = {}
    settings: dict[str, Literal["off", "ngram"]] = {"off": "off", "ngram": "ngram"}
    if args.eager_verify:
        settings["eager"] = "ngram"
    for setting, speculative in settings.items():
        # NOTE: two engines share one GPU: each gets a KV pool of its own size, not a share
        # of the memory (the second would find the first's pool taken)
        kv_tokens = args.kv_cache_tokens or (32768 if args.device == "cuda" else None)
        config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                              max_running_requests=max(args.batch), num_threads=args.threads,
                              speculative=speculative,
                              num_speculative_tokens=args.k, kv_cache_tokens=kv_tokens)
        engines[setting] = await asyncio.wrap_future(torch_thread().submit(
            build, config, setting != "eager"))
    try:
        await one(engines["off"], "Hello", 4)  # warm-up
        await one(engines["ngram"], "Hello", 4)
        drafter = engines["ngram"].scheduler.drafter
        assert drafter is not None
        res: dict[str, Any] = {**stamp(), "model": str(resolve_model_path(args.model)),
                               "device": args.device,
                               "num_speculative_tokens": drafter.config.num_tokens}
        if "tasks" in args.parts:
            res["tasks"] = await tasks(engines, args.rounds, args.max_tokens)
        if "cost" in args.parts:
            res["cost"] = await cost(engines, args.cost_k, args.batch, args.rounds)
        return res
    finally:
        for engine in engines.values():
            await engine.close()


def report(res: dict[str, Any]) -> None:
    print(f"{'task':>6} {'off tok/s':>9} {'ngram tok/s':>11} {'speedup':>7} {'tok/verify':>10} "
          f"{'accepted':>8} {'same':>5}")
    for name, row in res.get("tasks", {}).items():
        on = row["ngram"]
        print(f"{name:>6} {row['off']['decode_tok_s']:>9.1f} {on['decode_tok_s']:>11.1f} "
              f"{row['speedup']:>6.2f}x {on.get('tokens_per_verify', 0):>10.2f} "
              f"{on.get('acceptance', 0):>8.2f} {row['same_tokens']!s:>5}")
    for b, row in res.get("cost", {}).items():
        for prefix in ("", "eager_"):
            ks = ", ".join(f"K={k[len(prefix) + 1:-12]} {v:.2f}x" for k, v in row.items()
                           if k.startswith(prefix + "k") and k.endswith("_ms_per_step")
                           and k != "k0_ms_per_step" for v in [row[k] / row["k0_ms_per_step"]])
            if ks:
                label = "verify step, no graphs" if prefix else "verify step"
                print(f"batch {b}: decode step {row['k0_ms_per_step']:.2f} ms; {label}: {ks}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--k", type=int, default=None,
                   help="--num-speculative-tokens of the tasks (default: the device's)")
    p.add_argument("--cost-k", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="each engine's KV pool (default: 32768 on CUDA, the plan's on CPU)")
    p.add_argument("--eager-verify", action="store_true",
                   help="CUDA: also the verify steps' cost without graphs (a third engine)")
    p.add_argument("--parts", nargs="+", default=["tasks", "cost"], choices=["tasks", "cost"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    configure_logging(level="warning")
    res = asyncio.run(main(args))
    report(res)
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))
    # NOTE: on the CPU speculation keeps the tokens exactly (the engine's tests hold it to
    # that); a CUDA verify step sums in another order than a decode step, so bf16 near-ties
    # may part them there: reported (`first_difference`), not a failure
    same = all(r["same_tokens"] for r in res.get("tasks", {}).values())
    sys.exit(0 if same or args.device == "cuda" else 1)
