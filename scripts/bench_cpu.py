#!/usr/bin/env python3
"""CPU benchmark: arle against transformers and llama.cpp on the same model, same machine, one run.

Engines (`--engines`; each in its own process, so each resident memory is its own):
  - arle: the default path (a GGUF's 4- and 8-bit weights kept integer on the CPU)
  - arle-fp32: `--dtype float32`, every weight dequantized (arle before integer weights)
  - transformers: `generate`, the model as transformers loads it (a GGUF dequantized to fp32)
  - llama.cpp: llama-cpp-python (a GGUF only; `pip install llama-cpp-python`, benchmark-only)
Measures, for each (medians over `--rounds`):
  - decode tok/s at batch 1: (new tokens - 1) / (end-to-end time - time to first token)
  - decode tok/s at batch `--batch`: the batch's new tokens after its first / the time after
    the first tokens (llama-cpp-python decodes one sequence at a time: none)
  - prefill tok/s: prompt tokens / time to first token, on a `--prompt-tokens` prompt
  - resident memory (VmRSS) after load, and the load time
  - with `--contexts`, arle's decode and prefill at each prompt length (once each)
  - arle's per-op profile of a batch-1 decode (torch.profiler)
Writes the raw numbers as JSON (default bench_cpu.json; docs/results/cpu/ keeps the published
run) and prints a table.

    python scripts/bench_cpu.py [--model PATH] [--engines arle,arle-fp32,transformers,llama.cpp]
                                [--new-tokens 128] [--prompt-tokens 512] [--batch 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal

import torch
from stamp import stamp

from arle.model.default import resolve_model_path

ENGINES = ("arle", "arle-fp32", "transformers", "llama.cpp")
TEXT = ("The history of France begins with the earliest human settlements, continues through "
        "the Roman conquest of Gaul, the Frankish kingdoms, and the long rule of the Capetian "
        "kings, up to the revolution of 1789 and the republics that followed. ")


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


def prompt_ids(encode: Any, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += encode(TEXT)
    return ids[:n]


def median(rows: list[float]) -> float:
    return statistics.median(rows)


# ---- the engines, each run in its own process (`--worker`) ----------------------------------

async def arle_worker(args: argparse.Namespace, dtype: Literal["auto", "float32"]
                      ) -> dict[str, Any]:
    from arle.config import EngineConfig
    from arle.engine.build import create_engine
    from arle.engine.request import GenerateRequest, SamplingParams
    from arle.model.int_weights import weight_stats

    t0 = time.perf_counter()
    engine = await create_engine(EngineConfig(model=args.model, dtype=dtype,
                                              enable_prefix_cache=False))
    load_s, rss = time.perf_counter() - t0, rss_mb()

    def encode(text: str) -> list[int]:
        return engine.tokenizer.encode(text, add_special_tokens=False)

    async def one(ids: list[int], n: int) -> dict[str, Any]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        trace: dict[str, Any] = {}
        async for d in engine.generate(GenerateRequest(prompt=ids, params=params, route="bench")):
            if d.finish_reason:
                trace = d.trace or {}
        return trace

    async def batch(ids: list[int], n: int, size: int) -> float:
        # NOTE: distinct prompts (a different last token each): no request waits on another's
        start = time.perf_counter()
        traces = await asyncio.gather(*(one([*ids[:-1], ids[-1] + i], n) for i in range(size)))
        end = time.perf_counter() - start
        first = max(t["ttft_ms"] for t in traces) / 1e3
        return sum(t["completion_tokens"] - 1 for t in traces) / (end - first)

    short, long = prompt_ids(encode, args.short_prompt_tokens), prompt_ids(encode,
                                                                           args.prompt_tokens)
    await one(short, 4)
    rounds: dict[str, list[float]] = {"decode_tok_s": [], "decode_batch_tok_s": [],
                                      "prefill_tok_s": []}
    for _ in range(args.rounds):
        t = await one(short, args.new_tokens)
        rounds["decode_tok_s"].append((t["completion_tokens"] - 1)
                                      / ((t["total_ms"] - t["ttft_ms"]) / 1e3))
        rounds["decode_batch_tok_s"].append(await batch(short, args.new_tokens, args.batch))
        t = await one(long, 2)
        rounds["prefill_tok_s"].append(len(long) / (t["ttft_ms"] / 1e3))
    profile = await arle_profile(one, short, args.new_tokens)
    contexts: dict[str, dict[str, float]] = {}
    for n in args.contexts:  # decode and prefill cost as the context grows
        t = await one(prompt_ids(encode, n), args.new_tokens)
        contexts[str(n)] = {"decode_tok_s": (t["completion_tokens"] - 1)
                            / ((t["total_ms"] - t["ttft_ms"]) / 1e3),
                            "prefill_tok_s": n / (t["ttft_ms"] / 1e3)}
    executor: Any = engine.executor
    weights = weight_stats(executor.model)[1]
    await engine.close()
    return {"load_s": load_s, "rss_mb": rss, "weight_bytes": weights, "rounds": rounds,
            "contexts": contexts, "profile": profile}


async def arle_profile(one: Any, ids: list[int], n: int) -> dict[str, Any]:
    """Where a batch-1 decode's time goes (torch.profiler over `n` tokens, the prompt's
    prefill step included): per token, each op's self CPU time and calls, the top ones."""
    from arle.threads import torch_thread

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    torch_thread().submit(prof.__enter__).result()
    await one(ids, n)
    torch_thread().submit(prof.__exit__, None, None, None).result()
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in ops)
    return {"tokens": n, "self_ms_per_token": total / n / 1e3,
            "calls_per_token": sum(e.count for e in ops) / n,
            "top": [{"op": e.key, "self_ms_per_token": e.self_cpu_time_total / n / 1e3,
                     "calls_per_token": e.count / n} for e in ops[:12]]}


def hf_worker(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(args.model)
    t0 = time.perf_counter()
    where = ({"pretrained_model_name_or_path": path} if path.is_dir() else
             {"pretrained_model_name_or_path": path.parent, "gguf_file": path.name})
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(**where)
    load_s, rss = time.perf_counter() - t0, rss_mb()

    def encode(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    def gen(rows: list[list[int]], n: int) -> tuple[float, float, int]:
        x = torch.tensor(rows)
        kw = {"do_sample": False, "attention_mask": torch.ones_like(x),
              "pad_token_id": tok.eos_token_id}
        with torch.inference_mode():
            t0 = time.perf_counter()
            model.generate(x, max_new_tokens=1, **kw)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = model.generate(x, max_new_tokens=n, min_new_tokens=n, **kw)
            total = time.perf_counter() - t0
        return first, total, out.shape[1] - x.shape[1]

    short, long = prompt_ids(encode, args.short_prompt_tokens), prompt_ids(encode,
                                                                           args.prompt_tokens)
    gen([short], 4)
    rounds: dict[str, list[float]] = {"decode_tok_s": [], "decode_batch_tok_s": [],
                                      "prefill_tok_s": []}
    for _ in range(args.rounds):
        first, total, n = gen([short], args.new_tokens)
        rounds["decode_tok_s"].append((n - 1) / (total - first))
        rows = [[*short[:-1], short[-1] + i] for i in range(args.batch)]
        first, total, n = gen(rows, args.new_tokens)
        rounds["decode_batch_tok_s"].append(args.batch * (n - 1) / (total - first))
        first, _, _ = gen([long], 1)
        rounds["prefill_tok_s"].append(len(long) / first)
    return {"load_s": load_s, "rss_mb": rss, "rounds": rounds}


def llama_cpp_worker(args: argparse.Namespace) -> dict[str, Any]:
    import llama_cpp

    if not args.llama_extra_buffers:
        # NOTE: llama.cpp's repacked (AMX) weight buffers crash in this sandbox's CPU (a
        # segfault in ggml_backend_amx_mul_mat): off unless asked for
        default_params = llama_cpp.llama_model_default_params

        def params() -> Any:
            p = default_params()
            p.use_extra_bufts = False
            return p

        llama_cpp.llama_model_default_params = params
        llama_cpp.llama.llama_cpp.llama_model_default_params = params
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(args.model, n_threads=torch.get_num_threads(), n_ctx=2048,
                          n_batch=512, verbose=False)
    load_s, rss = time.perf_counter() - t0, rss_mb()

    def encode(text: str) -> list[int]:
        return list(llm.tokenize(text.encode(), add_bos=False, special=False))

    def run(ids: list[int], n: int) -> tuple[float, float]:
        llm.reset()
        t0 = time.perf_counter()
        first = 0.0
        for k, _ in enumerate(llm.generate(ids, temp=0.0, reset=True), start=1):
            if k == 1:
                first = time.perf_counter() - t0
            if k >= n:
                break
        return first, time.perf_counter() - t0

    short, long = prompt_ids(encode, args.short_prompt_tokens), prompt_ids(encode,
                                                                           args.prompt_tokens)
    run(short, 4)
    rounds: dict[str, list[float]] = {"decode_tok_s": [], "prefill_tok_s": []}
    for _ in range(args.rounds):
        first, total = run(short, args.new_tokens)
        rounds["decode_tok_s"].append((args.new_tokens - 1) / (total - first))
        first, _ = run(long, 1)
        rounds["prefill_tok_s"].append(len(long) / first)
    return {"load_s": load_s, "rss_mb": rss, "rounds": rounds,
            "version": llama_cpp.__version__, "extra_buffers": args.llama_extra_buffers}


def worker(args: argparse.Namespace) -> dict[str, Any]:
    if args.worker == "arle":
        return asyncio.run(arle_worker(args, "auto"))
    if args.worker == "arle-fp32":
        return asyncio.run(arle_worker(args, "float32"))
    if args.worker == "transformers":
        return hf_worker(args)
    return llama_cpp_worker(args)


# ---- the run: each engine's worker in turn, then the table ----------------------------------

def run_engine(engine: str, argv: list[str]) -> dict[str, Any] | None:
    proc = subprocess.run([sys.executable, __file__, *argv, "--worker", engine],
                          capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(f"{engine}: failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}",
              file=sys.stderr)
        return None
    return dict(json.loads(lines[-1]))


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    out = {k: median(v) for k, v in res["rounds"].items()}
    return {**out, "rss_mb": res["rss_mb"], "load_s": res["load_s"],
            **({"contexts": res["contexts"]} if res.get("contexts") else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--short-prompt-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--contexts", type=lambda v: [int(x) for x in v.split(",") if x],
                    default=[], help="arle's decode and prefill at these prompt lengths "
                                     "(comma-separated), once each")
    ap.add_argument("--llama-extra-buffers", action="store_true",
                    help="let llama.cpp repack its weights (AMX): crashes on some CPUs")
    ap.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.model = str(resolve_model_path(args.model))
    if args.worker:
        print(json.dumps(worker(args)))
        return

    argv = ["--model", args.model, "--new-tokens", str(args.new_tokens), "--short-prompt-tokens",
            str(args.short_prompt_tokens), "--prompt-tokens", str(args.prompt_tokens),
            "--batch", str(args.batch), "--rounds", str(args.rounds),
            "--contexts", ",".join(map(str, args.contexts)),
            *(["--llama-extra-buffers"] if args.llama_extra_buffers else [])]
    raw: dict[str, Any] = {}
    for engine in args.engines.split(","):
        if engine == "llama.cpp" and not args.model.endswith(".gguf"):
            continue
        res = run_engine(engine, argv)
        if res is not None:
            raw[engine] = res
        print(f"{engine} done", file=sys.stderr)
    summary: dict[str, Any] = {k.replace("-", "_").replace(".", "_"): summarize(v)
                               for k, v in raw.items()}
    if "arle" in raw:
        summary["decode_floor"] = decode_floor(raw["arle"]["weight_bytes"])
    record = {
        **stamp(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "cpu_capability": torch.backends.cpu.get_cpu_capability()},
        "model": args.model, "dtype": "auto", "new_tokens": args.new_tokens,
        "batch": args.batch, "short_prompt_tokens": args.short_prompt_tokens,
        "prompt_tokens": args.prompt_tokens, "summary": summary, "raw": raw,
    }
    out = Path(args.out or "bench_cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    cols = ("decode_tok_s", "decode_batch_tok_s", "prefill_tok_s", "rss_mb", "load_s")
    print(f"{'engine':<14}" + "".join(f"{c:>20}" for c in cols))
    for name, s in summary.items():
        if name != "decode_floor":
            print(f"{name:<14}" + "".join(f"{s.get(c, float('nan')):>20.1f}" for c in cols))
    for name, s in summary.items():
        for n, c in s.get("contexts", {}).items():
            print(f"{name} at {n} tokens of context: decode {c['decode_tok_s']:.1f} tok/s, "
                  f"prefill {c['prefill_tok_s']:.0f} tok/s")
    if "decode_floor" in summary:
        f = summary["decode_floor"]
        print(f"decode floor (arle's weights / read bandwidth {f['read_gb_s']:.1f} GB/s): "
              f"{f['floor_decode_tok_s']:.1f} tok/s")
    print(f"wrote {out}")


def decode_floor(weight_bytes: int) -> dict[str, float]:
    """Weight bytes read per decode step over the measured read bandwidth (of a buffer as
    large, too large for the caches): the batch-1 ceiling."""
    big = torch.ones(max(weight_bytes // 4, 1 << 20))
    big.sum()
    t0 = time.perf_counter()
    for _ in range(5):
        big.sum()
    read_gb_s = 5 * big.numel() * 4 / (time.perf_counter() - t0) / 1e9
    return {"weight_bytes": weight_bytes, "read_gb_s": read_gb_s,
            "floor_decode_tok_s": read_gb_s * 1e9 / weight_bytes}


if __name__ == "__main__":
    main()
