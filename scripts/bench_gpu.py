"""GPU benchmarks of arle (issue 5's figures), one phase per subcommand, each writing JSON.

    python scripts/bench_gpu.py ceilings --out ceil.json          # read bandwidth, bf16 GEMM rate
    python scripts/bench_gpu.py decode MODEL_DIR --out d.json     # batch-1/8 decode vs the floor
    python scripts/bench_gpu.py prefill MODEL_DIR --out p.json    # TTFT of a 4096-token prompt
    python scripts/bench_gpu.py offline MODEL_DIR --out o.json    # nano-vllm's 256-request run
    python scripts/bench_gpu.py serve MODEL_DIR --out s.json --serve-args="[arle serve flags]"
    python scripts/bench_gpu.py timeline MODEL_DIR --out t.json --num-requests 64  # c = 8, steps
    python scripts/bench_gpu.py startup MODEL_DIR --out s.json    # start-up's phases and builds
    python scripts/bench_gpu.py extend MODEL_DIR --out e.json     # each extend graph's replay
    python scripts/bench_gpu.py chat MODEL_DIR --out c.json --input-len 100 --output-len 200
                                          # a multi-turn chat's TTFT per turn, cache on and off

Floors come from ceilings measured in the same run (`ceilings`), never from datasheets: decode
floor = weight bytes / read bandwidth; prefill floor = FLOPs / bf16 GEMM rate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stamp import stamp

from arle.config import EngineConfig
from arle.engine.async_engine import AsyncEngine
from arle.engine.build import create_engine
from arle.engine.request import GenerateRequest, SamplingParams
from arle.gcwatch import GCPauses, freeze_start_up
from arle_kernels.jit import pdl_enabled
from arle_kernels.w4a16_ref import w4_format


def _write(path: str, data: dict[str, Any]) -> None:
    data = {**stamp(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "pdl": pdl_enabled(), **data}
    Path(path).write_text(json.dumps(data, indent=1))
    print(json.dumps(data)[:2000])


def _median_ms(fn: Any, iters: int = 20) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=50, rep=max(iters * 5, 200),
                                         return_mode="median"))


def _kernel_breakdown(fn: Any, iters: int = 20) -> dict[str, Any]:
    """Device time per call of `fn`, by kernel name (CUPTI sees the kernels inside a graph):
    where a step's time goes, and how much of it is gaps between kernels. Under PDL kernels
    overlap and their times no longer add up; `critical` says what each kernel of a layer adds
    to the step's span instead (see `_critical_path`)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t0) * 1e6 / iters
    by_name: dict[str, list[float]] = {}
    spans: list[tuple[str, float, float]] = []
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            row = by_name.setdefault(e.name[:80], [0, 0.0])
            row[0] += 1
            row[1] += e.device_time_total
            spans.append((e.name[:80], e.time_range.start, e.time_range.end))
    rows = sorted(((n, c / iters, us / iters) for n, (c, us) in by_name.items()),
                  key=lambda r: -r[2])
    return {"kernel_us": sum(r[2] for r in rows), "kernels": sum(r[1] for r in rows),
            "profiled_wall_us": wall_us,
            "top": [{"name": n, "per_step": c, "us": round(us, 1)} for n, c, us in rows[:25]],
            "critical": _critical_path(spans, iters)}


def _critical_path(spans: list[tuple[str, float, float]], iters: int,
                   marker: str = "qk_norm_rope") -> list[dict[str, Any]]:
    """What each kernel adds to a step's span: in start order, how far its end lies past the
    latest end before it (0 when it finished under an earlier kernel). Kernels are labelled by
    their offset from the layer's `marker` kernel, so the four GEMVs of a layer stay apart;
    "pre" / "tail" are the kernels before the first layer and after the last. Per step, in us:
    `critical` (summed over layers: the step's span is their total) and `busy` (end - start,
    which under PDL includes the time spent waiting for the kernel before)."""
    spans = sorted(spans, key=lambda s: s[1])
    per_step = len(spans) // max(iters, 1)
    marks = [i for i, s in enumerate(spans[:per_step]) if marker in s[0]]
    period = marks[1] - marks[0] if len(marks) > 1 else 0
    rows: dict[str, list[float]] = {}
    latest = float("-inf")
    for i, (name, start, end) in enumerate(spans[:per_step * iters]):
        j = i % per_step
        if j == 0:
            latest = start
        if not period or j < marks[0]:
            label = f"pre {name}"
        elif j >= marks[-1] + period:
            label = f"tail {name}"
        else:
            label = f"{(j - marks[0]) % period:02d} {name}"
        row = rows.setdefault(label, [0.0, 0.0, 0.0])
        row[0] += 1
        row[1] += max(0.0, end - latest)
        row[2] += end - start
        latest = max(latest, end)
    return [{"label": k, "per_step": c / iters, "critical_us": round(cr / iters, 1),
             "busy_us": round(b / iters, 1)} for k, (c, cr, b) in sorted(rows.items())]


def ceilings(args: argparse.Namespace) -> None:
    """Read bandwidth: sum over 8 GB of bf16 (bytes read / time). GEMM: 8192^3 bf16."""
    x = torch.randn(4 << 30, dtype=torch.bfloat16, device="cuda")
    ms = _median_ms(x.sum)
    read_tbps = x.numel() * 2 / ms / 1e9
    x = torch.empty(0)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms_mm = _median_ms(lambda: a @ b)
    _write(args.out, {"phase": "ceilings", "read_TBps": read_tbps,
                      "bf16_gemm_TFLOPs": 2 * 8192**3 / ms_mm / 1e9})


def _engine_config(args: argparse.Namespace, **kw: Any) -> EngineConfig:
    base: dict[str, Any] = {"model": args.model, "device": "cuda", "dtype": "bfloat16",
                            "overlap": not args.disable_overlap,
                            "cuda_graph": not args.disable_cuda_graph,
                            "kv_cache_dtype": args.kv_cache_dtype,
                            "quantization": args.quantization,
                            "max_batched_tokens": args.max_batched_tokens}
    base.update(kw)
    return EngineConfig(**base)


async def _engine(args: argparse.Namespace, **kw: Any) -> AsyncEngine:
    """The engine of `_engine_config(args, **kw)`, with what its start-up left frozen for the
    cyclic GC as `arle serve` does (`--no-gc-freeze`: not; a full pass over those objects holds
    the loop in the middle of a run, see arle/gcwatch.py).
    `--extend-tokens`: the extend graphs' ladder for this run."""
    if getattr(args, "extend_tokens", None):
        import arle.executor.cuda_graphs as cuda_graphs

        cuda_graphs.EXTEND_GRAPH_TOKENS = tuple(int(t) for t in args.extend_tokens.split(","))
    engine = await create_engine(_engine_config(args, **kw))
    if not args.no_gc_freeze:
        freeze_start_up()
    return engine


async def _generate(engine: AsyncEngine, prompt: list[int], max_tokens: int
                    ) -> tuple[float, list[float]]:
    """(start time, arrival time of every token)."""
    t0 = time.perf_counter()
    times: list[float] = []
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async for d in engine.generate(GenerateRequest(prompt=prompt, params=params)):
        times += [time.perf_counter()] * len(d.token_ids)
    return t0, times


def _latencies(runs: list[tuple[float, list[float]]]) -> tuple[list[float], list[float]]:
    """Each `_generate` run's TTFT and TPOT (time per output token after the first), in s."""
    return ([t[0] - t0 for t0, t in runs],
            [(t[-1] - t[0]) / (len(t) - 1) for _, t in runs])


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def _weight_bytes(engine: AsyncEngine) -> int:
    """Bytes a decode step must read: every weight once (a tied embedding counts once: the
    lm_head read; the embedding lookup reads one row)."""
    model = engine.executor.model  # type: ignore[attr-defined]
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if "embed_tokens" not in n or model.config.tie_word_embeddings)


def floor_bytes(engine: AsyncEngine, batch: int) -> dict[str, float]:
    """Bytes one decode step of `batch` requests must move at least: every weight but the
    experts once, the experts the batch's tokens are expected to touch (E * (1 - (1 - k/E)^b)
    of E per layer, for routing spread evenly: random weights spread it so), and for a hybrid
    model each request's recurrent state read and written. The KV cache read is left out (it
    grows with the context; at the benchmark's ~600 tokens it is under 1% of the weights)."""
    model = engine.executor.model  # type: ignore[attr-defined]
    cfg = model.config
    dense = experts = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name and not cfg.tie_word_embeddings:
            continue  # the lookup reads one row
        nbytes = p.numel() * p.element_size()
        if (w4 := w4_format(p)) is not None:  # 4-bit words: their scales and offsets too
            nbytes += 2 * w4.scale.numel() * w4.scale.element_size()
        if ".experts." in name:
            experts += nbytes
        else:
            dense += nbytes
    share = 1.0
    if cfg.moe is not None:
        share = 1 - (1 - cfg.moe.experts_per_token / cfg.moe.num_experts) ** batch
    state = engine.executor.state
    state_bytes = 2 * batch * state.slot_bytes if state is not None else 0
    return {"dense": dense, "experts_all": experts, "experts_touched": experts * share,
            "state_read_write": state_bytes, "total": dense + experts * share + state_bytes}


async def _decode(args: argparse.Namespace) -> dict[str, Any]:
    engine = await _engine(args, max_running_requests=64)
    vocab = engine.tokenizer.vocab_size
    out: dict[str, Any] = {"phase": "decode", "model": args.model, "flags": {k: v for k, v in vars(args).items() if k != "fn"},
                           "weight_bytes": _weight_bytes(engine),
                           "floor_bytes": {f"batch{b}": floor_bytes(engine, b) for b in (1, 8)}}
    await _generate(engine, _prompts(1, 64, vocab, 9)[0], 16)  # warm-up
    for batch in (1, 8, 32, 64):
        prompts = _prompts(batch, args.input_len, vocab, batch)
        runs = await asyncio.gather(*(_generate(engine, p, args.output_len) for p in prompts))
        ttft, tpot = _latencies(runs)
        end = max(t[-1] for _, t in runs)
        start = min(t0 for t0, _ in runs)
        out[f"batch{batch}"] = {
            "mean_tpot_ms": statistics.mean(tpot) * 1e3, "mean_ttft_ms": statistics.mean(ttft) * 1e3,
            "output_tok_s": batch * args.output_len / (end - start),
            "decode_tok_s_per_request": 1 / statistics.mean(tpot)}
    ex = engine.executor
    graphs = getattr(ex, "graphs", None)
    if graphs is not None:
        # The device time of one decode step: replay the batch-1 ... -64 graphs (the last
        # context they were loaded with), and where the time of 1 and 8 goes, kernel by kernel.
        for bs in (1, 8, 32, 64):
            g = graphs.graphs[bs]
            with torch.cuda.stream(ex.stream):  # type: ignore[attr-defined]
                out[f"graph_replay_bs{bs}_ms"] = _median_ms(g.replay)
                if bs > 8:
                    continue
                try:
                    out[f"kernels_bs{bs}"] = _kernel_breakdown(g.replay)
                except Exception as e:  # the profiler is a bonus: never lose the figures for it
                    out[f"kernels_bs{bs}"] = {"error": repr(e)}
    out["startup"] = engine.model_info.get("cuda_graphs")
    await engine.close()
    return out


def decode(args: argparse.Namespace) -> None:
    _write(args.out, asyncio.run(_decode(args)))


async def _prefill(args: argparse.Namespace) -> dict[str, Any]:
    n = args.prompt_len
    engine = await _engine(args, max_running_requests=8, chunked_prefill_size=max(n, 8192),
                           max_batched_tokens=max(n, 8192) + 8, enable_prefix_cache=False)
    vocab = engine.tokenizer.vocab_size
    ttfts = []
    for i in range(args.repeats + 1):
        t0, times = await _generate(engine, _prompts(1, n, vocab, 100 + i)[0], 1)
        ttfts.append(times[0] - t0)
    ttfts = ttfts[1:]  # the first run compiles the kernels for this shape
    cfg = engine.executor.model.config  # type: ignore[attr-defined]
    linear = 2 * n * (_weight_bytes(engine) // 2 - cfg.vocab_size * cfg.hidden_size
                      + cfg.hidden_size)  # every weight but the lm_head: one token samples
    lm_head = 2 * cfg.vocab_size * cfg.hidden_size
    attention = cfg.num_layers * 2 * 2 * cfg.num_heads * cfg.head_dim * n * (n + 1) / 2
    flops = linear + lm_head + attention
    ttft = statistics.median(ttfts)
    await engine.close()
    return {"phase": "prefill", "model": args.model, "prompt_len": n, "ttft_ms": ttft * 1e3,
            "ttft_all_ms": [t * 1e3 for t in ttfts], "flops": flops,
            "achieved_TFLOPs": flops / ttft / 1e12}


def prefill(args: argparse.Namespace) -> None:
    _write(args.out, asyncio.run(_prefill(args)))


async def _context(args: argparse.Namespace) -> dict[str, Any]:
    """How batch-1 cost grows with context: for each length, one prompt's prefill time (its
    TTFT, the whole prompt in one chunk) and its decode TPOT after it. Each length runs twice
    (the first builds the kernels for its shapes); the second is reported."""
    longest = max(args.contexts)
    engine = await _engine(args, max_running_requests=8, chunked_prefill_size=longest,
                           max_batched_tokens=longest + 8, enable_prefix_cache=False)
    vocab = engine.tokenizer.vocab_size
    out: dict[str, Any] = {"phase": "context", "model": args.model,
                           "output_len": args.output_len, "runs": {}}
    for n in args.contexts:
        for i in range(2):
            run = await _generate(engine, _prompts(1, n, vocab, 1000 * i + n)[0], args.output_len)
        (ttft,), (tpot,) = _latencies([run])
        out["runs"][str(n)] = {"ttft_ms": ttft * 1e3, "tpot_ms": tpot * 1e3}
        print(f"context {n}: prefill {ttft * 1e3:.1f} ms, TPOT {tpot * 1e3:.3f} ms", flush=True)
    await engine.close()
    return out


def context(args: argparse.Namespace) -> None:
    _write(args.out, asyncio.run(_context(args)))


async def _extend(args: argparse.Namespace) -> dict[str, Any]:
    """The device time of each extend graph (a prefill or mixed step padded up to the graph's
    token count): a replay of each, on the padding start-up left in it (its GEMMs, norms and
    lm_head run in full; attention has no rows). What a step pays for the tokens it is padded
    by decides the ladder (`arle.executor.cuda_graphs.EXTEND_GRAPH_TOKENS`; `--extend-tokens` sets
    another for this run)."""
    engine = await _engine(args, serving=True)
    ex = engine.executor
    graphs = ex.extend_graphs  # type: ignore[attr-defined]
    replay_ms: dict[str, float] = {}
    with torch.cuda.stream(ex.stream):  # type: ignore[attr-defined]
        for t in graphs.sizes:
            replay_ms[str(t)] = _median_ms(graphs.graphs[t].replay)
    out = {"phase": "extend", "model": args.model, "tokens": graphs.sizes, "replay_ms": replay_ms,
           "startup": engine.model_info.get("extend_graphs")}
    await engine.close()
    return out


def extend(args: argparse.Namespace) -> None:
    _write(args.out, asyncio.run(_extend(args)))


async def _offline(args: argparse.Namespace) -> dict[str, Any]:
    """nano-vllm's bench: 256 requests, prompt and output lengths uniform in [100, 1024], run
    `--offline-runs` times in one engine. Run 1 is nano-vllm's exact workload; later runs keep
    its lengths with other random tokens (no prefix-cache hits). The host's speed makes single
    runs scatter, so the figure is their median."""
    engine = await _engine(args, max_running_requests=256)
    vocab = engine.tokenizer.vocab_size
    rng = random.Random(0)
    reqs = [([rng.randrange(vocab) for _ in range(rng.randint(100, 1024))],
             rng.randint(100, 1024)) for _ in range(args.num_requests)]
    await _generate(engine, reqs[0][0][:32], 8)  # warm-up
    out_tokens = sum(n for _, n in reqs)
    runs: list[float] = []
    pauses = GCPauses().start()
    for run in range(args.offline_runs):
        if run:
            tokens = random.Random(run)
            reqs = [([tokens.randrange(vocab) for _ in p], n) for p, n in reqs]
        t0 = time.perf_counter()
        await asyncio.gather(*(_generate(engine, p, n) for p, n in reqs))
        runs.append(time.perf_counter() - t0)
    pauses.stop()
    stats = engine.snapshot()
    await engine.close()
    dt = statistics.median(runs)
    return {"phase": "offline", "model": args.model, "requests": len(reqs), "seconds": dt,
            "output_tokens": out_tokens, "prompt_tokens": sum(len(p) for p, _ in reqs),
            "output_tok_s": out_tokens / dt, "runs_tok_s": [out_tokens / t for t in runs],
            "preemptions": stats.get("preemptions"), "gc_frozen_objects": gc.get_freeze_count(),
            "gc_pauses": pauses.summary()}


def offline(args: argparse.Namespace) -> None:
    _write(args.out, asyncio.run(_offline(args)))


def _record_steps(ex: Any, profile: Any = None) -> Callable[[], list[dict[str, Any]]]:
    """Wrap the CUDA executor's enqueue and wait: each step's start (ms since now), graph,
    tokens, decode rows and host time to queue it, in launch order; with `profile` (a cProfile
    Profile) the eager steps' queueing runs under it. Returns `finish`: it unwraps and gives the
    steps, each with its device time from the step's events."""
    steps: list[dict[str, Any]] = []
    exec_ms: list[float] = []
    enqueue, wait = ex._enqueue, ex._wait
    t_start = time.perf_counter()

    def timed_enqueue(h: Any) -> Any:
        eager = profile is not None and not h.graph_bs and not h.extend_tokens
        t0 = time.perf_counter()
        if eager:
            profile.enable()
        try:
            return enqueue(h)
        finally:
            if eager:
                profile.disable()
            steps.append({"t_ms": (t0 - t_start) * 1e3, "graph_bs": h.graph_bs,
                          "extend_graph": h.extend_tokens, "tokens": h.layout.num_tokens,
                          "decode_rows": h.layout.num_decode,
                          "host_ms": (time.perf_counter() - t0) * 1e3})

    def timed_wait(event: Any, pending: Any) -> Any:
        out = wait(event, pending)
        exec_ms.append(out.exec_s * 1e3)
        return out

    def finish() -> list[dict[str, Any]]:
        ex._enqueue, ex._wait = enqueue, wait
        # NOTE: steps are launched and waited in order, one waiter: the i-th wait is the i-th step
        for st, ms in zip(steps, exec_ms, strict=False):
            st["device_ms"] = ms
        return steps

    ex._enqueue, ex._wait = timed_enqueue, timed_wait
    return finish


async def _host(args: argparse.Namespace) -> dict[str, Any]:
    """Where an eager step's time goes on the host: the launcher thread's `_enqueue` (queueing
    every kernel of a step) timed per step and profiled (cProfile) for the eager ones; the
    device time of the same steps from their events. Workload: one 512-token prompt alone,
    then 8 staggered (mixed steps: a prefill beside decode rows, as serving at c = 8 runs)."""
    import cProfile
    import io
    import pstats

    engine = await _engine(args, max_running_requests=64)
    ex = engine.executor
    vocab = engine.tokenizer.vocab_size
    await _generate(engine, _prompts(1, 64, vocab, 9)[0], 16)  # warm-up
    prof = cProfile.Profile()
    finish = _record_steps(ex, prof)
    await _generate(engine, _prompts(1, args.input_len, vocab, 1)[0], 32)

    async def late(i: int, prompt: list[int]) -> None:
        await asyncio.sleep(0.02 * i)
        await _generate(engine, prompt, 64)

    await asyncio.gather(*(late(i, p) for i, p in
                           enumerate(_prompts(8, args.input_len, vocab, 2))))
    await engine.close()
    steps = finish()
    eager = [st for st in steps if not st["graph_bs"] and not st["extend_graph"]]
    text = io.StringIO()
    if eager:  # (a profile that never ran has no statistics)
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(35)
        print(text.getvalue()[:12000])
    return {"phase": "host", "model": args.model, "steps": steps,
            "eager_steps": len(eager),
            "eager_host_ms_mean": statistics.mean(st["host_ms"] for st in eager) if eager else None,
            "profile_top": text.getvalue()[:12000]}


async def _timeline(args: argparse.Namespace) -> dict[str, Any]:
    """Where a closed loop of `--concurrency` clients spends its time, step by step, in the
    engine `arle serve` builds (its serving defaults), without HTTP: `--num-requests` prompts of
    `--input-len` new random tokens, `--output-len` tokens each (ignore EOS), a new request as
    soon as one ends (as `arle bench` sends them). Every step's kind, token and decode-row
    count and device time (the executor's events), and the wall clock: the device's idle time
    is the wall time less the steps' device time. Then the kernels of the largest extend graph
    (a prefill step) by time: what a prefill step's GPU time is made of. And every collection
    of the cyclic GC during the run: when it began, its generation, how long it held the loop.
    `--http`: the same engine behind the app `arle serve` runs, the clients `arle bench`: what
    HTTP changes in the steps."""
    engine = await _engine(args, serving=True)
    ex = engine.executor
    vocab = engine.tokenizer.vocab_size
    await _generate(engine, _prompts(1, 64, vocab, 9)[0], 16)  # warm-up
    prompts = _prompts(args.num_requests, args.input_len, vocab, 77)
    queue = list(reversed(prompts))
    results: list[tuple[float, list[float]]] = []

    async def client() -> None:
        while queue:
            results.append(await _generate(engine, queue.pop(), args.output_len))

    pauses = GCPauses(keep_events=True).start()
    finish = _record_steps(ex)
    t_start = time.perf_counter()
    over_http = None
    if args.http:
        from serve_sim import bench_over_http  # scripts/ is on sys.path (this script's folder)

        over_http = await bench_over_http(engine, args, warmup_requests=0)
        wall = over_http["duration"]  # not the client process's start
    else:
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        wall = time.perf_counter() - t_start
    pauses.stop()
    steps = finish()
    # the loop's longest stalls: gaps between two steps' launches, beside the collections
    gaps = sorted(((b["t_ms"] - a["t_ms"], a["t_ms"]) for a, b in itertools.pairwise(steps)),
                  reverse=True)[:5]
    kinds: dict[str, dict[str, float]] = {}
    for st in steps:
        kind = "decode" if st["tokens"] == st["decode_rows"] else "prefill"
        k = kinds.setdefault(kind, {"steps": 0, "device_ms": 0.0, "tokens": 0})
        k["steps"] += 1
        k["device_ms"] += st.get("device_ms", 0.0)
        k["tokens"] += st["tokens"]
    device = sum(k["device_ms"] for k in kinds.values())
    if over_http is None:
        ttft, tpot = _latencies(results)
        clients = {"requests": len(results), "output_tok_s": len(results) * args.output_len / wall,
                   "mean_ttft_ms": statistics.mean(ttft) * 1e3,
                   "mean_tpot_ms": statistics.mean(tpot) * 1e3}
    else:  # the bench's own figures (its duration excludes starting the client process)
        clients = {"requests": over_http["completed"],
                   "output_tok_s": over_http["output_throughput"],
                   "mean_ttft_ms": over_http["mean_ttft_ms"],
                   "mean_tpot_ms": over_http["mean_tpot_ms"], "bench": over_http}
    out: dict[str, Any] = {
        "phase": "timeline", "model": args.model, "concurrency": args.concurrency,
        "http": args.http, "wall_s": wall, **clients,
        "device_ms": device, "idle_ms": wall * 1e3 - device, "kinds": kinds,
        "decode_step_ms_median": statistics.median(
            [st["device_ms"] for st in steps if st["tokens"] == st["decode_rows"]
             and "device_ms" in st] or [0.0]),
        "gc": {"frozen_objects": gc.get_freeze_count(), "pauses": pauses.summary(),
               "events": [{"t_ms": (t - t_start) * 1e3, "generation": g, "ms": sec * 1e3}
                          for t, g, sec in pauses.events or []]},
        "longest_launch_gaps": [{"t_ms": t, "gap_ms": gap} for gap, t in gaps],
        "steps": steps}
    graphs = getattr(ex, "extend_graphs", None)
    if graphs is not None and graphs.graphs:
        t = max(graphs.graphs)
        with torch.cuda.stream(ex.stream):  # type: ignore[attr-defined]
            out[f"extend_graph_{t}_ms"] = _median_ms(graphs.graphs[t].replay)
            try:
                out[f"kernels_extend_{t}"] = _kernel_breakdown(graphs.graphs[t].replay, 5)
            except Exception as e:  # a bonus: never lose the figures for it
                out[f"kernels_extend_{t}"] = {"error": repr(e)}
    await engine.close()
    return out


def timeline(args: argparse.Namespace) -> None:
    if args.http:  # on uvloop, as `arle serve` runs
        from arle.cli.serve import run_on_uvloop

        _write(args.out, run_on_uvloop(_timeline(args)))
    else:
        _write(args.out, asyncio.run(_timeline(args)))


def host(args: argparse.Namespace) -> None:
    _write(args.out, asyncio.run(_host(args)))


def launch(args: argparse.Namespace) -> None:
    """Host microseconds per call (queued without waiting for the GPU) of what an eager step
    launches: cuBLAS linears at a repeated and at an ever-new row count, our Triton wrappers,
    torch.empty. Shapes of Qwen3-4B's layers at 512 tokens."""
    from arle_kernels import fused

    dev = "cuda"
    w = torch.randn(19456, 2560, dtype=torch.bfloat16, device=dev)
    x = torch.randn(2048, 2560, dtype=torch.bfloat16, device=dev)
    norm_w = torch.ones(2560, dtype=torch.bfloat16, device=dev)
    gu = torch.randn(512, 19456, dtype=torch.bfloat16, device=dev)
    out = torch.empty(512, 19456, dtype=torch.bfloat16, device=dev)

    def per_call_us(fn: Any, n: int = 200) -> float:
        fn(0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        dt = time.perf_counter() - t0
        torch.cuda.synchronize()
        return dt / n * 1e6

    res = {
        "linear_same_rows": per_call_us(lambda i: torch.nn.functional.linear(x[:512], w)),
        "linear_new_rows": per_call_us(lambda i: torch.nn.functional.linear(x[:513 + i], w)),
        "linear_rows_seen_before": per_call_us(
            lambda i: torch.nn.functional.linear(x[:513 + i], w)),
        "mm_out_same_rows": per_call_us(lambda i: torch.mm(x[:512], w.t(), out=out)),
        "add_rms_norm": per_call_us(lambda i: fused.add_rms_norm(x[:512], x[1024:1536],
                                                                 norm_w, 1e-6)),
        "silu_and_mul": per_call_us(lambda i: fused.silu_and_mul(gu)),
        "torch_empty": per_call_us(lambda i: torch.empty(512, 2560, dtype=torch.bfloat16,
                                                         device=dev)),
        "tensor_view_slice": per_call_us(lambda i: x[:512].view(512, 20, 128)),
    }
    for k, v in res.items():
        print(f"{k:28} {v:8.1f} us", flush=True)
    _write(args.out, {"phase": "launch", "host_us_per_call": res})


def _traces(lines: list[str]) -> list[dict[str, Any]]:
    """The server's `request_trace` log lines, in order."""
    out = []
    for line in lines:
        if '"request_trace"' in line:
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def _trace_summary(lines: list[str], output_len: int) -> dict[str, Any]:
    """The server's own view of the measured requests (its `request_trace` log lines with
    `output_len` tokens; the warm-ups have fewer): TTFT from the request reaching the engine,
    the prompt's tokenization (a thread) and its wait for admission, means in ms."""
    traces = [t for t in _traces(lines)
              if t.get("completion_tokens") == output_len and t.get("ttft_ms") is not None]
    if not traces:
        return {"count": 0}
    pre = [t["preprocess"] for t in traces]
    return {"count": len(traces),
            "mean_ttft_ms": statistics.mean(t["ttft_ms"] for t in traces),
            "mean_tokenize_ms": statistics.mean(p["tokenize_us"] for p in pre) / 1e3,
            "mean_wait_ms": statistics.mean(p["wait_us"] or 0 for p in pre) / 1e3,
            "mean_total_ms": statistics.mean(t["total_ms"] for t in traces)}


def serve(args: argparse.Namespace) -> None:
    """Start `arle serve`, time it to ready, run `arle bench` at each concurrency, stop it."""
    import httpx

    from arle.bench import BenchConfig, run_bench

    port = args.port
    cmd = [sys.executable, "-m", "arle", "serve", "--model", args.model, "--port", str(port),
           "--log-format", "json", *args.serve_args]
    t0 = time.perf_counter()
    log = open(f"/tmp/serve-{port}-{int(t0)}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    ready = None
    while time.perf_counter() - t0 < 300 and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                ready = time.perf_counter() - t0
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    out: dict[str, Any] = {"phase": "serve", "model": args.model, "cmd": cmd,
                           "time_to_ready_s": ready, "runs": {}}
    try:
        if ready is None:
            raise RuntimeError(f"server not ready (exit {proc.poll()})")
        # the first request after /ready: one prompt token, one new token (its whole latency
        # is its TTFT). NOTE: the client is built before the clock starts: an httpx.Client's
        # set-up (its SSL context) alone takes 30-70 ms.
        with httpx.Client(timeout=60) as client:
            t1 = time.perf_counter()
            first = client.post(f"http://127.0.0.1:{port}/v1/completions",
                                json={"prompt": [9707], "max_tokens": 1, "temperature": 0})
            out["first_request"] = {"status": first.status_code,
                                    "latency_ms": (time.perf_counter() - t1) * 1e3}
        print(f"ready in {ready:.2f} s; first request {out['first_request']}", flush=True)
        for conc in args.concurrency:
            # NOTE: new prompts for each run (and its warm-up, seed + 1): the prompts of an
            # earlier run would be served from the prefix cache
            # NOTE: at least one prompt per client, or a high concurrency measures fewer clients
            cfg = BenchConfig(base_url=f"http://127.0.0.1:{port}",
                              num_prompts=max(args.num_prompts, conc),
                              input_len=args.input_len, output_len=args.output_len,
                              max_concurrency=conc, warmup_requests=2, seed=10 * conc + 1)
            s = asyncio.run(run_bench(cfg))
            out["runs"][str(conc)] = s
            _write(args.out, out)  # after every run: a cut-short call keeps what it measured
            print(f"concurrency {conc}: {s['output_throughput']:.0f} tok/s, "
                  f"TPOT {s['mean_tpot_ms']:.2f} ms, TTFT {s['mean_ttft_ms']:.1f} ms, "
                  f"{s.get('server_steps')} steps, device busy {s.get('server_device_busy')}",
                  flush=True)
        # the cyclic GC's pauses in the server over all the runs (`/v1/stats`)
        out["gc"] = httpx.get(f"http://127.0.0.1:{port}/v1/stats", timeout=10).json()["gc"]
    except Exception as e:
        out["error"] = repr(e)
        log.flush()
        out["server_log_tail"] = Path(log.name).read_text()[-4000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        # kernel variants the warm-up missed (each one stalled every request while it built)
        lines = Path(log.name).read_text().splitlines()
        out["late_compiles"] = [line[:400] for line in lines
                                if "triton_kernel_built_after_warmup" in line]
        out["server_traces"] = _trace_summary(lines, args.output_len)
        firsts = [t for t in _traces(lines) if t.get("prompt_tokens") == 1
                  and t.get("route") == "/v1/completions"]
        if firsts and "first_request" in out:  # the server's own view of the first request
            out["first_request"]["server_ttft_ms"] = firsts[0].get("ttft_ms")
        _write(args.out, out)


async def _chat(args: argparse.Namespace) -> dict[str, Any]:
    """A multi-turn chat (`--turns` turns: a user message of ~`--input-len` random words, then
    `--output-len` new tokens, ignoring EOS), each turn's prompt the whole conversation so far
    through the chat template: each turn's TTFT and the prompt tokens served from the cache,
    with the prefix cache (and, for a hybrid model, its state snapshots) on, then off
    (`--cache-modes`: one of them; one engine per process keeps the GPU memory plan whole)."""
    rng = random.Random(5)
    words = [f"w{rng.randrange(10_000)}" for _ in range(args.turns * args.input_len)]
    out: dict[str, Any] = {"phase": "chat", "model": args.model, "turns": args.turns,
                           "user_words": args.input_len, "new_tokens": args.output_len}
    modes: dict[str, dict[str, Any]] = {"on": {}, "off": {"enable_prefix_cache": False}}
    for mode in args.cache_modes:
        name, kw = f"cache_{mode}", modes[mode]
        engine = await _engine(args, **kw)
        messages: list[dict[str, Any]] = []
        rows: list[dict[str, Any]] = []
        for turn in range(args.turns):
            text = " ".join(words[turn * args.input_len:(turn + 1) * args.input_len])
            messages.append({"role": "user", "content": text})
            params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
            t0 = time.perf_counter()
            ttft = None
            reply, last = [], None
            async for d in engine.generate(GenerateRequest(messages=list(messages), params=params)):
                if ttft is None and d.token_ids:
                    ttft = time.perf_counter() - t0
                reply.append(d.text)
                last = d
            messages.append({"role": "assistant", "content": "".join(reply)})
            usage = last.usage if last is not None else None
            rows.append({"ttft_ms": (ttft or 0) * 1e3,
                         "prompt_tokens": usage.prompt_tokens if usage else None,
                         "cached_tokens": usage.cached_tokens if usage else None})
        await engine.close()
        prompt = sum(r["prompt_tokens"] or 0 for r in rows)
        out[name] = {"turns": rows, "mean_ttft_ms": statistics.mean(r["ttft_ms"] for r in rows),
                     "reused_share": sum(r["cached_tokens"] or 0 for r in rows) / max(prompt, 1)}
        print(f"{name}: TTFT per turn " + " ".join(f"{r['ttft_ms']:.1f}" for r in rows)
              + f" ms; reused {out[name]['reused_share']:.1%}", flush=True)
    return out


def chat(args: argparse.Namespace) -> None:
    _write(args.out, asyncio.run(_chat(args)))


def startup(args: argparse.Namespace) -> None:
    """`arle warmup` with `arle serve`'s settings (the model loaded, memory planned, kernels
    built, graphs captured, the warm-up passes), timed phase by phase, and every Triton kernel
    variant start-up builds or loads from the disk cache, with when (seconds from the start)
    and in which phase. Run it after an empty Triton cache for the cold figure."""
    from dataclasses import replace

    from arle.diagnostics import run_warmup
    from arle_kernels.jit import watch_compiles

    t0 = time.perf_counter()
    builds: list[dict[str, Any]] = []
    watch_compiles(lambda kernel: builds.append(
        {"s": round(time.perf_counter() - t0, 3), "kernel": kernel.split("[")[0][:80]}))
    report = asyncio.run(run_warmup(replace(_engine_config(args), serving=True)))
    total = time.perf_counter() - t0
    model = report.get("model") or {}
    _write(args.out, {"phase": "startup", "model": args.model, "ok": report["ok"],
                      "total_s": round(total, 2), "phases": report["phases"],
                      "startup": {k: model.get(k) for k in ("load_ms", "memory_plan",
                                                            "kernels_built_ahead",
                                                            "cuda_graphs", "extend_graphs")},
                      "builds": len(builds), "build_log": builds})
    print(f"start-up {total:.1f} s, {len(builds)} kernel builds; phases "
          + ", ".join(f"{p['name']} {p['ms'] / 1e3:.1f} s" for p in report["phases"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="phase", required=True)
    c = sub.add_parser("ceilings")
    c.add_argument("--out", required=True)
    c.set_defaults(fn=ceilings)
    c = sub.add_parser("launch")
    c.add_argument("--out", required=True)
    c.set_defaults(fn=launch)
    for name, fn in (("decode", decode), ("prefill", prefill), ("offline", offline),
                     ("host", host), ("timeline", timeline), ("startup", startup),
                     ("extend", extend), ("chat", chat),
                     ("context", context)):
        s = sub.add_parser(name)
        s.add_argument("model")
        s.add_argument("--out", required=True)
        s.add_argument("--input-len", type=int, default=512)
        s.add_argument("--output-len", type=int, default=128)
        s.add_argument("--prompt-len", type=int, default=4096)
        s.add_argument("--repeats", type=int, default=5)
        s.add_argument("--num-requests", type=int, default=256)
        s.add_argument("--concurrency", type=int, default=8, help="timeline's clients")
        s.add_argument("--http", action="store_true",
                       help="timeline: the clients are `arle bench` over HTTP, against the app "
                            "`arle serve` runs (in this process, on uvloop)")
        s.add_argument("--no-gc-freeze", action="store_true",
                       help="leave the engine's start-up objects to the cyclic GC (`arle serve` "
                       "freezes them)")
        s.add_argument("--offline-runs", type=int, default=3)
        s.add_argument("--turns", type=int, default=8, help="chat: the conversation's turns")
        s.add_argument("--cache-modes", nargs="+", default=["on", "off"], choices=["on", "off"],
                       help="chat: with the prefix cache on, off, or both")
        s.add_argument("--disable-overlap", action="store_true")
        s.add_argument("--disable-cuda-graph", action="store_true")
        s.add_argument("--kv-cache-dtype", default="auto")
        s.add_argument("--quantization", default="none", choices=["none", "fp8"],
                       help="--quantization fp8: the checkpoint's linears FP8 at load")
        s.add_argument("--extend-tokens", help="the extend graphs' token counts (T1,T2,...)")
        s.add_argument("--max-batched-tokens", type=int, default=None,
                       help="the engine's step token budget (default: the engine's; "
                            "prefill sets its own, one step for the whole prompt)")
        s.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768],
                       help="context: the prompt lengths")
        s.set_defaults(fn=fn)
    s = sub.add_parser("serve")
    s.add_argument("model")
    s.add_argument("--out", required=True)
    s.add_argument("--port", type=int, default=8123)
    s.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16, 64])
    s.add_argument("--num-prompts", type=int, default=64)
    s.add_argument("--input-len", type=int, default=512)
    s.add_argument("--output-len", type=int, default=128)
    s.add_argument("--serve-args", default="", type=shlex.split,
                   help='flags for arle serve, one string: --serve-args="--disable-overlap"')
    s.set_defaults(fn=serve)
    args = p.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
