#!/usr/bin/env python3
"""CPU benchmark: arle vs transformers' `generate` on the same model, same machine, same run.

Measures, for each engine, interleaved over several rounds (medians reported):
  - decode tok/s at batch 1: (new tokens - 1) / (end-to-end time - time to first token)
  - prefill tok/s: prompt tokens / time to first token, on a long prompt
Writes the raw numbers as JSON (default bench_cpu.json; docs/results/cpu/ keeps the published
run) and prints a table.

    python scripts/bench_cpu.py [--model PATH] [--new-tokens 128] [--prompt-tokens 512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from stamp import stamp

from arle.config import EngineConfig
from arle.engine.async_engine import AsyncEngine
from arle.engine.build import create_engine
from arle.engine.request import GenerateRequest, SamplingParams
from arle.model.default import resolve_model_path
from arle.threads import torch_thread


def long_prompt(tokenizer: Any, n: int) -> list[int]:
    text = ("The history of France begins with the earliest human settlements, continues through "
            "the Roman conquest of Gaul, the Frankish kingdoms, and the long rule of the Capetian "
            "kings, up to the revolution of 1789 and the republics that followed. ")
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(text, add_special_tokens=False)
    return ids[:n]


async def arle_run(engine: AsyncEngine, ids: list[int], new_tokens: int) -> dict[str, float]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    trace: dict[str, Any] = {}
    async for d in engine.generate(GenerateRequest(prompt=ids, params=params, route="bench")):
        if d.finish_reason:
            trace = d.trace or {}
    ttft, total = trace["ttft_ms"] / 1e3, trace["total_ms"] / 1e3
    return {"ttft_s": ttft, "total_s": total, "prompt_tokens": len(ids),
            "new_tokens": trace["completion_tokens"],
            "decode_tok_s": (trace["completion_tokens"] - 1) / (total - ttft),
            "prefill_tok_s": len(ids) / ttft}


def hf_run(model: Any, ids: list[int], new_tokens: int) -> dict[str, float]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(x, max_new_tokens=1, do_sample=False, attention_mask=torch.ones_like(x))
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, attention_mask=torch.ones_like(x))
        total = time.perf_counter() - t0
    n = out.shape[1] - len(ids)
    return {"ttft_s": ttft, "total_s": total, "prompt_tokens": len(ids), "new_tokens": n,
            "decode_tok_s": (n - 1) / (total - ttft), "prefill_tok_s": len(ids) / ttft}


def load_hf(path: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                dtype=dtype).eval()


def decode_floor(engine: AsyncEngine) -> dict[str, float]:
    """Weight bytes read per decode step over the measured read bandwidth: the batch-1 ceiling."""
    params = list(engine.executor.model.parameters())  # type: ignore[attr-defined]
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    big = torch.cat([p.detach().flatten() for p in params])
    big.sum()
    t0 = time.perf_counter()
    for _ in range(5):
        big.sum()
    read_gb_s = 5 * big.numel() * big.element_size() / (time.perf_counter() - t0) / 1e9
    return {"weight_bytes": weight_bytes, "read_gb_s": read_gb_s,
            "floor_decode_tok_s": read_gb_s * 1e9 / weight_bytes}


def median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--short-prompt-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    path = resolve_model_path(args.model)
    engine = await create_engine(EngineConfig(model=str(path), dtype=args.dtype,
                                                   enable_prefix_cache=False))
    # NOTE: transformers runs on arle's torch thread too: one OpenMP team in the process, so
    # neither engine pays for the other's idle spinning threads (see torch_thread).
    worker = torch_thread()
    hf = None if args.skip_hf else worker.submit(load_hf, path, getattr(torch, args.dtype)).result()
    short = long_prompt(engine.tokenizer, args.short_prompt_tokens)
    long = long_prompt(engine.tokenizer, args.prompt_tokens)
    # warm-up both
    await arle_run(engine, short, 4)
    if hf is not None:
        worker.submit(hf_run, hf, short, 4).result()
    results: dict[str, dict[str, list[dict[str, float]]]] = {
        "arle": {"decode": [], "prefill": []}, "transformers": {"decode": [], "prefill": []}}
    for r in range(args.rounds):
        results["arle"]["decode"].append(await arle_run(engine, short, args.new_tokens))
        results["arle"]["prefill"].append(await arle_run(engine, long, 1 + 1))
        if hf is not None:
            results["transformers"]["decode"].append(
                worker.submit(hf_run, hf, short, args.new_tokens).result())
            results["transformers"]["prefill"].append(worker.submit(hf_run, hf, long, 2).result())
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    floor = worker.submit(decode_floor, engine).result()
    await engine.close()

    summary: dict[str, Any] = {"decode_floor": floor}
    for name, res in results.items():
        if res["decode"]:
            summary[name] = {"decode_tok_s": median(res["decode"], "decode_tok_s"),
                             "prefill_tok_s": median(res["prefill"], "prefill_tok_s")}
    if summary.get("transformers"):
        summary["ratio_arle_over_transformers"] = {
            k: summary["arle"][k] / summary["transformers"][k] for k in summary["arle"]}
    record = {
        **stamp(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "cpu_capability": torch.backends.cpu.get_cpu_capability()},
        "model": str(path), "dtype": args.dtype, "new_tokens": args.new_tokens,
        "short_prompt_tokens": args.short_prompt_tokens, "prompt_tokens": args.prompt_tokens,
        "summary": summary, "raw": results,
    }
    out = Path(args.out or "bench_cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"{'engine':<14}{'decode tok/s':>14}{'prefill tok/s':>15}")
    for name in ("arle", "transformers"):
        if name in summary:
            s = summary[name]
            print(f"{name:<14}{s['decode_tok_s']:>14.1f}{s['prefill_tok_s']:>15.1f}")
    print(f"decode floor (weights / read bandwidth {floor['read_gb_s']:.1f} GB/s): "
          f"{floor['floor_decode_tok_s']:.1f} tok/s")
    print(f"wrote {out}")


if __name__ == "__main__":
    asyncio.run(main())
