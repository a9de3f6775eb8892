#!/usr/bin/env python3
"""A multi-turn chat benchmark for the host KV tier: more conversations than the device KV pool
holds, each coming back turn after turn to its own long prefix (a document, then the turns so
far). Without the tier a returning conversation whose pages were evicted prefills its whole
prefix again; with it (`--kv-host-cache-gb`) those pages come back from host memory.

Each setting runs in a process of its own (one engine on the device at a time), the same
requests in the same order: mean TTFT, prefill tokens computed, and the tokens served from
each tier.

    python scripts/bench_kv_tier.py [--model PATH] [--device cpu|cuda] [--conversations 16]
        [--turns 4] [--doc-tokens 1024] [--pool-share 0.25] [--host-gb 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from stamp import stamp

SETTINGS = ("off", "host_tier")


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], list[list[int]]]]:
    """Per conversation: its document, then each turn's user tokens (random ids, seeded)."""
    rng = random.Random(args.seed)
    return [([rng.randrange(100, vocab) for _ in range(args.doc_tokens)],
             [[rng.randrange(100, vocab) for _ in range(args.user_tokens)]
              for _ in range(args.turns)])
            for _ in range(args.conversations)]


async def one_setting(args: argparse.Namespace, setting: str) -> dict[str, Any]:
    from arle.config import EngineConfig
    from arle.engine.build import create_engine
    from arle.engine.request import GenerateRequest, SamplingParams

    per_conv = args.doc_tokens + args.turns * (args.user_tokens + args.max_tokens)
    pool = int(args.conversations * per_conv * args.pool_share)
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                          kv_cache_tokens=pool, max_running_requests=args.concurrency,
                          kv_host_cache_gb=args.host_gb if setting == "host_tier" else 0.0)
    engine = await create_engine(config)
    vocab = engine.model_info.get("vocab_size", 32000)
    convs = workload(args, vocab)
    history = [list(doc) for doc, _ in convs]
    traces: list[dict[str, Any]] = []

    async def turn(c: int, t: int) -> None:
        prompt = history[c] + convs[c][1][t]
        req = GenerateRequest(prompt=prompt, params=SamplingParams(
            temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True))
        ids: list[int] = []
        trace: dict[str, Any] = {}
        async for d in engine.generate(req):
            ids += d.token_ids
            trace = d.trace or trace
        history[c] = prompt + ids
        traces.append({"turn": t, **trace})

    try:
        for t in range(args.turns):
            order = list(range(args.conversations))
            for i in range(0, len(order), args.concurrency):
                await asyncio.gather(*(turn(c, t) for c in order[i:i + args.concurrency]))
        snap = engine.snapshot()
    finally:
        await engine.close()
    later = [x for x in traces if x["turn"] > 0]  # the first turn is cold in both settings
    return {"setting": setting, "kv_pool_tokens": pool,
            "kv_host_pages": snap["kv_host_pages_total"],
            "mean_ttft_ms": statistics.fmean(x["ttft_ms"] for x in traces),
            "mean_ttft_ms_returning": statistics.fmean(x["ttft_ms"] for x in later),
            "prefill_tokens_computed": sum(x["prefix"]["computed_tokens"] for x in traces),
            "device_hit_tokens": sum(x["prefix"]["device_hit_tokens"] for x in traces),
            "host_hit_tokens": sum(x["prefix"]["host_hit_tokens"] for x in traces),
            "offloaded_pages": snap["kv_offloaded_pages"],
            "restored_pages": snap["kv_restored_pages"], "requests": len(traces),
            # a hybrid model's state snapshots: moved to the host, and requests started there
            "offloaded_snapshots": snap["kv_offloaded_snapshots"],
            "host_snapshot_hits": snap["kv_host_snapshot_hits"],
            # the tier's copies: bytes both ways and their device time
            "copy_bytes": (snap["kv_offloaded_pages"] + snap["kv_restored_pages"])
            * snap["kv_host_page_bytes"],
            "copy_s": snap["kv_host_copy_us"] / 1e6}


def main(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for setting in SETTINGS:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, __file__, *sys.argv[1:], "--one", setting, "--one-out", f.name]
            subprocess.run(cmd, check=True)
            results[setting] = json.loads(Path(f.name).read_text())
    off, on = results["off"], results["host_tier"]
    return {**stamp(), "model": args.model or "default", "device": args.device,
            "workload": {k: getattr(args, k) for k in ("conversations", "turns", "doc_tokens",
                                                       "user_tokens", "max_tokens",
                                                       "concurrency", "pool_share", "host_gb")},
            "results": results,
            "ttft_speedup_returning": off["mean_ttft_ms_returning"] / on["mean_ttft_ms_returning"],
            "prefill_tokens_saved": off["prefill_tokens_computed"] - on["prefill_tokens_computed"]}


def report(res: dict[str, Any]) -> None:
    print(f"{'setting':>10} {'TTFT ms':>8} {'returning':>9} {'computed':>9} {'device hit':>10} "
          f"{'host hit':>9}")
    for name, r in res["results"].items():
        print(f"{name:>10} {r['mean_ttft_ms']:>8.1f} {r['mean_ttft_ms_returning']:>9.1f} "
              f"{r['prefill_tokens_computed']:>9} {r['device_hit_tokens']:>10} "
              f"{r['host_hit_tokens']:>9}")
    print(f"returning TTFT {res['ttft_speedup_returning']:.2f}x faster with the tier; "
          f"{res['prefill_tokens_saved']} prefill tokens saved")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--doc-tokens", type=int, default=1024)
    p.add_argument("--user-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--pool-share", type=float, default=0.25,
                   help="the device KV pool: this share of all conversations' tokens")
    p.add_argument("--host-gb", type=float, default=4.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--one", choices=SETTINGS, help=argparse.SUPPRESS)
    p.add_argument("--one-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    from arle.logging import configure_logging

    configure_logging(level="warning")
    if args.one:
        args.one_out.write_text(json.dumps(asyncio.run(one_setting(args, args.one))))
        sys.exit(0)
    res = main(args)
    report(res)
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))
