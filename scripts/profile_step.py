"""What a decode step costs on the GPU outside its CUDA graph, in the serving engine.

    python scripts/profile_step.py MODEL_DIR --out p.json [--batch 8]

`bench_gpu.py decode` times a decode step's graph replayed alone; in the engine a step also
copies its metadata in, loads the graph's static buffers, samples and copies the tokens out.
This runs `--batch` requests of 512 new tokens (128 out, greedy) in the engine `arle serve`
builds, records every GPU activity (kernels, copies) for a window of pure decode steps with the
torch profiler, and reports per step: each activity's time, the GPU's busy and idle time, and
the span from one step's start to the next. Then it times the sampling ops alone (CUDA events
around 200 calls) for rows 1, 8, 32 and 64.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import _generate, _prompts

from arle.config import EngineConfig
from arle.engine.async_engine import AsyncEngine

MARKER = "qk_norm_rope"  # one a layer: counts the steps in the window


async def _profile(args: argparse.Namespace) -> dict[str, Any]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    engine = await AsyncEngine.create(EngineConfig(model=args.model, device="cuda",
                                                   dtype="bfloat16", serving=True))
    vocab = engine.tokenizer.vocab_size
    layers = engine.executor.model.config.num_layers  # type: ignore[attr-defined]
    await _generate(engine, _prompts(1, 64, vocab, 9)[0], 16)  # warm-up
    prof = profile(activities=[ProfilerActivity.CUDA])

    async def window() -> None:
        await asyncio.sleep(0.15)  # past the prefill: decode steps only
        prof.start()
        await asyncio.sleep(0.1)
        prof.stop()

    prompts = _prompts(args.batch, 512, vocab, 5)
    await asyncio.gather(window(), *(_generate(engine, p, 128) for p in prompts))
    await engine.close()
    events = sorted(((e.name[:90], e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type == DeviceType.CUDA), key=lambda e: e[1])
    steps = sum(MARKER in n for n, _, _ in events) / layers
    by_name: dict[str, list[float]] = {}
    busy = idle = 0.0
    last_end = events[0][1] if events else 0.0
    for name, start, end in events:
        row = by_name.setdefault(name, [0, 0.0])
        row[0] += 1
        row[1] += end - start
        busy += max(0.0, end - max(start, last_end))
        idle += max(0.0, start - last_end)
        last_end = max(last_end, end)
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    return {"batch": args.batch, "steps_in_window": steps,
            "busy_us_per_step": busy / steps if steps else None,
            "idle_us_per_step": idle / steps if steps else None,
            "per_step": [{"name": n, "count": c / steps, "us": round(us / steps, 2)}
                         for n, (c, us) in rows[:40]] if steps else []}


def _time_us(fn: Any, iters: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _sampling_ops(vocab: int) -> dict[str, Any]:
    """The greedy sampling path's ops, back to back on one stream (no host sync)."""
    out: dict[str, Any] = {}
    for rows in (1, 8, 32, 64):
        logits = torch.randn(rows, vocab, device="cuda")
        buf = torch.zeros(1024, dtype=torch.int32, device="cuda")
        slots = torch.arange(rows, device="cuda") * 3
        ids = logits.argmax(dim=-1)
        out[str(rows)] = {
            "argmax_us": _time_us(lambda lg=logits: lg.argmax(dim=-1)),
            "cast_us": _time_us(lambda i=ids: i.to(torch.int32)),
            "index_put_us": _time_us(lambda b=buf, s=slots, i=ids: b.__setitem__(s, i.int())),
            "max_us": _time_us(lambda lg=logits: lg.max(dim=-1)),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model")
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()
    result = asyncio.run(_profile(args))
    result["sampling_ops"] = _sampling_ops(151936)
    result["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result)[:3000])


if __name__ == "__main__":
    main()
