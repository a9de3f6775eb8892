"""The serving stack over a simulated device: what the host side costs a closed-loop benchmark.

    python scripts/serve_sim.py [--concurrency 8] [--num-requests 64] [--modes direct serve]

A `SimExecutor` stands in for the GPU: every step takes the device time a model of an H200
running Qwen3-4B gives it (`--decode-ms` a step plus `--prefill-us` a prompt token; defaults
from `bench_gpu.py timeline` at concurrency 8), in launch order, and its result reaches the
engine the way the CUDA executor's does (a thread, then the event loop). The engine, the server
and the client are the real ones, so the run shows what they add to the device's time:
- `direct`: closed-loop clients on `engine.generate` (as `bench_gpu.py timeline`);
- `serve`: the app `arle serve` runs, on uvicorn on the engine's loop, and `arle bench` in a
  separate process (as `bench_gpu.py serve`).
The device's busy time is the same work in both; the difference in wall time is the host's.
The tokenizer is the default model's, or `--tokenizer`'s (a Hugging Face model directory).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arle.cli.serve import run_on_uvloop
from arle.config import EngineConfig
from arle.engine.async_engine import AsyncEngine
from arle.engine.request import GenerateRequest, SamplingParams
from arle.executor.base import KVPoolInfo, StepOutput
from arle.executor.paged import pack_step
from arle.executor.plan import StepPlan
from arle.logging import configure_logging
from arle.model.default import resolve_model_path
from arle.model.gguf_io import read_gguf
from arle.model.tokenizer import Tokenizer


class SimExecutor:
    """Steps of modelled device time, run in launch order on one 'device' thread.

    NOTE: a step starts when the one before it ends or when it is queued, whichever is later
    (a stream); the thread sleeps until the step's modelled end and then hands the result to
    the loop, as the CUDA executor's waiter thread does after its event. With `launch_us`, a
    launcher thread first holds the GIL that long per step (pure Python), as the CUDA
    executor's launcher does while it queues a step's copies and graph replay."""

    def __init__(self, num_slots: int, num_pages: int, decode_ms: float, prefill_us: float,
                 launch_us: float = 0.0) -> None:
        self.num_slots = num_slots
        self.kv_pool = KVPoolInfo(num_pages, 16, 0, "bfloat16")
        self.state: Any = None  # a dense model: no recurrent state
        self.num_snapshots = 0
        self.overlaps_restores = False  # no host KV tier
        self.decode_s = decode_ms / 1e3
        self.prefill_s = prefill_us / 1e6
        self.launch_s = launch_us / 1e6
        self.busy_s = 0.0
        self.idle_s = 0.0  # the device with nothing queued while the run went on
        self.steps = 0
        self._free_at = 0.0
        self._launcher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="launcher")
        self._cv = threading.Condition()
        self._queue: list[tuple[float, asyncio.Future[StepOutput], StepOutput]] = []
        self._thread = threading.Thread(target=self._device, daemon=True)
        self._thread.start()

    def launch(self, plan: StepPlan) -> Awaitable[StepOutput]:
        pack_step(plan, 16)  # the host work the CUDA executor does for a step
        prompt_tokens = sum(r.num_tokens for r in plan.rows if r.input_ids is not None)
        dur = self.decode_s + self.prefill_s * prompt_tokens
        self.steps += 1
        self.busy_s += dur
        n = sum(r.sample for r in plan.rows)
        future: asyncio.Future[StepOutput] = asyncio.get_running_loop().create_future()
        # an id that detokenizes to text (every chunk carries some)
        out = StepOutput([1000 + self.steps % 500] * n, exec_s=dur)
        if self.launch_s:
            self._launcher.submit(self._queue_step, dur, future, out)
        else:
            self._queue_step(dur, future, out)
        return future

    def _queue_step(self, dur: float, future: asyncio.Future[StepOutput], out: StepOutput
                    ) -> None:
        if self.launch_s:
            until = time.perf_counter() + self.launch_s
            while time.perf_counter() < until:  # Python work: the GIL is held
                pass
        now = time.perf_counter()
        if self._free_at and now > self._free_at:
            self.idle_s += now - self._free_at
        start = max(self._free_at, now)
        self._free_at = start + dur
        with self._cv:
            self._queue.append((self._free_at, future, out))
            self._cv.notify()

    def _device(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                end, future, out = self._queue.pop(0)
            wait = end - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            future.get_loop().call_soon_threadsafe(_resolve, future, out)

    def close(self) -> None:
        self._launcher.shutdown(wait=True)


def _resolve(future: asyncio.Future[StepOutput], out: StepOutput) -> None:
    if not future.done():
        future.set_result(out)


def _engine(args: argparse.Namespace, tokenizer: Any) -> tuple[AsyncEngine, SimExecutor]:
    slots = args.concurrency * 2 + 1
    ex = SimExecutor(slots, 8 * args.concurrency * (args.input_len + args.output_len) // 16 + 64,
                     args.decode_ms, args.prefill_us, args.launch_us)
    # the serving defaults `arle serve` takes on a GPU
    cfg = EngineConfig(device="cuda", serving=True, max_batched_tokens=args.max_batched_tokens
                       ).for_device("cuda")
    engine = AsyncEngine(cfg, tokenizer, ex, "sim", 1 << 20)
    return engine, ex


def _prompts(args: argparse.Namespace) -> list[list[int]]:
    return [[(i * 7919 + j * 31) % 40000 + 100 for j in range(args.input_len)]
            for i in range(args.num_requests)]


async def _direct(args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    engine, ex = _engine(args, tokenizer)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    queue = list(reversed(_prompts(args)))
    ttfts: list[float] = []

    async def client() -> None:
        while queue:
            prompt = queue.pop()
            t0 = time.perf_counter()
            first = None
            async for d in engine.generate(GenerateRequest(prompt=prompt, params=params)):
                if first is None and d.token_ids:
                    first = time.perf_counter()
            assert first is not None
            ttfts.append(first - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    wall = time.perf_counter() - t0
    await engine.close()
    return {"mode": "direct", "wall_s": wall, "device_busy_s": ex.busy_s,
            "device_idle_s": ex.idle_s, "steps": ex.steps,
            "output_tok_s": args.num_requests * args.output_len / wall,
            "mean_ttft_ms": statistics.mean(ttfts) * 1e3}


async def bench_over_http(engine: AsyncEngine, args: argparse.Namespace,
                          warmup_requests: int = 2, http: str = "auto") -> dict[str, Any]:
    """`arle bench` (a separate process) against the app `arle serve` runs, served by uvicorn
    on this loop around `engine`: closed-loop clients over HTTP. The bench's JSON summary."""
    import uvicorn

    from arle.server.app import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine), log_config=None,
                                           access_log=False, lifespan="off", http=http))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    out_file = Path(f"/tmp/bench_over_http_{port}.json")
    cmd = [sys.executable, "-m", "arle", "bench", "--base-url", f"http://127.0.0.1:{port}",
           "--num-prompts", str(args.num_requests), "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--max-concurrency",
           str(args.concurrency), "--warmup-requests", str(warmup_requests),
           "--output-file", str(out_file)]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.DEVNULL,
                                                stderr=subprocess.PIPE)
    _, err = await proc.communicate()
    server.should_exit = True
    await task
    if proc.returncode:
        raise RuntimeError(f"arle bench failed: {err.decode()[-2000:]}")
    summary: dict[str, Any] = json.loads(out_file.read_text())
    return summary


async def _serve(args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    engine, _ = _engine(args, tokenizer)
    try:
        s = await bench_over_http(engine, args, http=args.http)
    finally:
        await engine.close()
    return {"mode": "serve", "wall_s": s["duration"],
            "output_tok_s": s["output_throughput"],
            "mean_ttft_ms": s["mean_ttft_ms"], "mean_tpot_ms": s["mean_tpot_ms"],
            "server_steps": s.get("server_steps"), "server_device_busy": s.get("server_device_busy")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--decode-ms", type=float, default=2.84, help="device time of a step")
    p.add_argument("--prefill-us", type=float, default=11.0,
                   help="device time added by each prompt token of a step")
    p.add_argument("--launch-us", type=float, default=0.0,
                   help="host time a launcher thread holds the GIL for each step")
    p.add_argument("--modes", nargs="+", default=["direct", "serve"])
    p.add_argument("--max-batched-tokens", type=int, help="the step budget (default: serving's)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--http", default="auto", help="uvicorn's HTTP parser (auto, h11, httptools)")
    p.add_argument("--tokenizer", help="a Hugging Face model directory (default: the default "
                   "model's tokenizer)")
    p.add_argument("--out", help="write the runs here (JSON)")
    args = p.parse_args()
    configure_logging("json", "warning")
    tokenizer = (Tokenizer.from_hf_dir(Path(args.tokenizer)) if args.tokenizer
                 else read_gguf(resolve_model_path(None)).tokenizer)
    runs = []
    for _ in range(args.repeats):
        for mode in args.modes:
            r = run_on_uvloop((_direct if mode == "direct" else _serve)(args, tokenizer))
            runs.append(r)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                              for k, v in r.items()}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
