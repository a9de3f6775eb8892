#!/usr/bin/env python3
"""The transformers `generate` baseline: greedy, fixed lengths, random prompts, per mode and batch.

    python scripts/bench_hf.py MODEL_DIR [--batch 1 8] [--input-len 512] [--output-len 128]
        [--modes eager static] [--repeats 3] [--device cuda] [--dtype bfloat16] [--out FILE.json]

Modes:
  eager   `generate` as it comes (dynamic cache, SDPA attention, no compilation)
  static  `cache_implementation="static"`: transformers then compiles the decode-step forward by
          itself (`torch.compile` with its CompileConfig defaults: inductor, mode
          "reduce-overhead", i.e. CUDA graphs) on CUDA; the prefill stays eager. transformers only
          compiles on accelerators, so on the CPU this mode measures an uncompiled static cache.
          Each batch size compiles afresh (torch._dynamo.reset() first), as if run alone.

For each (mode, batch): one warm-up `generate` (its time, minus a timed run's, is reported as the
compile/warm-up overhead), then --repeats timed runs; the median run is reported. Every run
generates exactly --output-len tokens (min_new_tokens = max_new_tokens, greedy). Output tok/s is
batch * output_len / end-to-end time. TTFT and the per-token decode time come from a streamer that
notes when each step's tokens reach the host: generate already waits for every step on the host
(its stop check), so the streamer adds one tiny copy per step and no extra synchronisation.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
from stamp import stamp

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class StepTimer:
    """A generate streamer recording when each new step's tokens arrive (the first put is the
    prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def fp8_dequantized(model_dir: Path) -> dict[str, Any]:
    """`from_pretrained` arguments that make transformers dequantize a block-FP8 checkpoint to
    the compute dtype as it loads it (its own `dequantize` option); {} for other checkpoints."""
    import transformers

    q = json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config", {})
    if q.get("quant_method") != "fp8":
        return {}
    return {"quantization_config": transformers.FineGrainedFP8Config(
        weight_block_size=tuple(q.get("weight_block_size", (128, 128))), dequantize=True,
        modules_to_not_convert=q.get("modules_to_not_convert"))}


def transformers_fp8_runs() -> bool:
    """Whether transformers' own FP8 kernels load here: they come from the `kernels` package,
    which fetches them from the Hub (no network: they do not)."""
    try:
        from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel

        load_finegrained_fp8_kernel()
    except ImportError:
        return False
    return True


def fp8_fallback(model_dir: Path) -> dict[str, Any]:
    """An FP8 checkpoint where transformers' FP8 kernels cannot run: `fp8_dequantized`."""
    dequantized = fp8_dequantized(model_dir)
    return dequantized if dequantized and not transformers_fp8_runs() else {}


def load(model_dir: Path, device: str, dtype: torch.dtype) -> Any:
    import transformers

    # transformers 5 renamed `torch_dtype` to `dtype` (4.56+ accepts both, older only the first).
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    kw: dict[str, Any] = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype,
                          **fp8_fallback(model_dir)}
    auto: Any = transformers.AutoModelForCausalLM
    try:  # straight onto the device; older versions need accelerate for device_map
        model = auto.from_pretrained(model_dir, device_map=device, **kw)
    except (ImportError, ValueError):
        model = auto.from_pretrained(model_dir, **kw).to(device)
    # NOTE: generate fills what a call leaves unset from model.generation_config; the checkpoint's
    # sampling defaults (temperature 0.6, top_k 20, ...) would only draw warnings under greedy.
    gc = model.generation_config
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=gc.bos_token_id, eos_token_id=gc.eos_token_id,
        pad_token_id=gc.pad_token_id if gc.pad_token_id is not None else 0)
    return model.eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def one_run(model: Any, ids: torch.Tensor, gen_config: Any, device: str) -> dict[str, float]:
    timer = StepTimer()
    sync(device)
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                         generation_config=gen_config, streamer=timer)
    sync(device)
    total = time.perf_counter() - t0
    batch, n_in = ids.shape
    new = out.shape[1] - n_in
    assert new == gen_config.max_new_tokens, f"generated {new} tokens, not {gen_config.max_new_tokens}"
    steps = timer.times[1:]  # times[0]: the prompt, put before any forward
    return {
        "total_s": total,
        "output_tok_s": batch * new / total,
        "ttft_s": steps[0] - t0,
        # NOTE: steps after the first are decode steps (one token per sequence each).
        "decode_ms_per_token": (steps[-1] - steps[0]) / (len(steps) - 1) * 1e3
        if len(steps) > 1 else float("nan"),
    }


def bench_one(model: Any, mode: str, batch: int, input_len: int, output_len: int,
              repeats: int, device: str, seed: int) -> dict[str, Any]:
    from transformers import GenerationConfig

    if mode == "static":
        # NOTE: a fresh compile per batch size, so each row is what a run of that batch alone
        # gets: otherwise dynamo's automatic dynamic shapes would recompile the second batch size
        # with a symbolic batch dimension (slower code, a different compile time).
        torch._dynamo.reset()
    gen = torch.Generator().manual_seed(seed + batch)
    ids = torch.randint(0, model.config.vocab_size, (batch, input_len), generator=gen).to(device)
    gen_config = GenerationConfig(
        max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
        pad_token_id=model.generation_config.pad_token_id,
        eos_token_id=model.generation_config.eos_token_id,
        cache_implementation="static" if mode == "static" else None,
    )
    t0 = time.perf_counter()
    one_run(model, ids, gen_config, device)
    warmup = time.perf_counter() - t0
    # NOTE: private attributes, read only to report: generate keeps its compiled forward there.
    compile_config = getattr(model, "_last_compile_config", None)
    compiles = mode == "static" and getattr(model, "_compiled_call", None) is not None
    runs = [one_run(model, ids, gen_config, device) for _ in range(repeats)]
    median = sorted(runs, key=lambda r: r["total_s"])[len(runs) // 2]
    row: dict[str, Any] = {
        "mode": mode, "batch": batch, "input_len": input_len, "output_len": output_len,
        "compiled": compiles, "warmup_s": warmup,
        "compile_overhead_s": max(0.0, warmup - median["total_s"]),
        **median,
        "runs_total_s": [r["total_s"] for r in runs],
    }
    if compiles and compile_config is not None:
        row["compile_config"] = {k: str(v) for k, v in compile_config.to_dict().items()}
    return row


def environment(device: str) -> dict[str, Any]:
    import transformers

    env: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "device": device,
        "threads": torch.get_num_threads(),
    }
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return env


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--modes", nargs="+", default=["eager", "static"], choices=["eager", "static"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write the results here as JSON")
    args = ap.parse_args(argv)

    dequantized = bool(fp8_fallback(args.model_dir))
    t0 = time.perf_counter()
    model = load(args.model_dir, args.device, _DTYPES[args.dtype])
    load_s = time.perf_counter() - t0
    results: dict[str, Any] = {
        **stamp(), "model_dir": str(args.model_dir), "dtype": args.dtype, "seed": args.seed,
        "repeats": args.repeats, "load_s": load_s,
        "parameters": sum(p.numel() for p in model.parameters()),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "fp8_dequantized_at_load": dequantized,
        "environment": environment(args.device), "results": [],
    }
    print(f"loaded {args.model_dir} in {load_s:.1f} s on {args.device} "
          f"({results['parameters'] / 1e9:.2f}B parameters, {args.dtype})", file=sys.stderr)
    for mode in args.modes:
        for batch in args.batch:
            row = bench_one(model, mode, batch, args.input_len, args.output_len, args.repeats,
                            args.device, args.seed)
            results["results"].append(row)
            print(f"  {mode} batch {batch}: {row['output_tok_s']:.1f} tok/s", file=sys.stderr)
            if args.out:  # after each row: a long run that dies later keeps what it measured
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(results, indent=2) + "\n")
    if args.device.startswith("cuda"):
        results["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)


def print_table(results: dict[str, Any]) -> None:
    env = results["environment"]
    where = env.get("gpu") or env.get("cpu")
    print(f"transformers {env['transformers']}, torch {env['torch']}, {where}, "
          f"{results['dtype']}")
    print(f"{'mode':<7}{'batch':>6}{'in':>6}{'out':>5}{'tok/s':>10}{'TTFT ms':>10}"
          f"{'ms/tok':>9}{'warmup s':>10}{'compiled':>10}")
    for r in results["results"]:
        print(f"{r['mode']:<7}{r['batch']:>6}{r['input_len']:>6}{r['output_len']:>5}"
              f"{r['output_tok_s']:>10.1f}{r['ttft_s'] * 1e3:>10.1f}"
              f"{r['decode_ms_per_token']:>9.2f}{r['warmup_s']:>10.1f}{r['compiled']!s:>10}")


if __name__ == "__main__":
    main(sys.argv[1:])
