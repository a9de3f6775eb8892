"""`arle bench`: load-test an OpenAI-compatible server, print a summary, write SGLang-style JSON.

NOTE: the core is arle/bench.py (httpx only: no torch, no engine); it can test any server.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import orjson
import typer

from arle import env
from arle.cli.common import arle_command
from arle.errors import ArleError

WORKLOAD_PANEL = "Workload"


def _opt(*decls: str, help: str, **kw: Any) -> Any:
    return typer.Option(*decls, help=help, rich_help_panel=WORKLOAD_PANEL, **kw)


@arle_command()
def bench(
    base_url: Annotated[str, typer.Option(
        "--base-url", help="The server to test (its /v1 routes).")] = "http://127.0.0.1:8000",
    model: Annotated[str | None, typer.Option(
        "--model", help="Model name to send (default: the first of /v1/models).")] = None,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar=env.ARLE_API_KEY, help="Bearer key for the server.")] = None,
    dataset: Annotated[str, _opt(
        "--dataset", help="The workload; only 'random' for now.")] = "random",
    backend: Annotated[str, _opt(
        "--backend", help="The request shape: arle (token ids, include_usage), sglang-oai, "
                          "sglang-oai-chat (SGLang bench_serving's), guidellm (its chat "
                          "requests: continuous_usage_stats, ignore_eos). The chat shapes "
                          "send text, made by the server's /detokenize.")] = "arle",
    num_prompts: Annotated[int, _opt("--num-prompts", min=1, help="Requests to send.")] = 100,
    input_len: Annotated[int, _opt(
        "--random-input-len", min=1, help="Prompt length in tokens (exact).")] = 256,
    output_len: Annotated[int, _opt(
        "--random-output-len", min=1, help="Output length in tokens (exact: ignore_eos).")
    ] = 64,
    max_concurrency: Annotated[int | None, _opt(
        "--max-concurrency", min=1, help="Most requests in flight (default: no bound).")
    ] = None,
    request_rate: Annotated[float, _opt(
        "--request-rate", help="Requests per second, Poisson arrivals; inf: all at once.")
    ] = math.inf,
    warmup_requests: Annotated[int, _opt(
        "--warmup-requests", min=0, help="Requests sent (and not measured) first.")] = 1,
    seed: Annotated[int, _opt(
        "--seed", help="Seed of the random prompts and arrivals (the warm-up's: seed + 1). "
                       "Runs against one server with the same seed find their prompts in its "
                       "prefix cache: give each run its own.")] = 1,
    vocab_size: Annotated[int | None, _opt(
        "--vocab-size", min=1,
        help="Draw prompt token ids below this (default: the server's /v1/models "
             "vocab_size, which arle reports; other servers need it).")] = None,
    timeout: Annotated[float, _opt(
        "--timeout", min=1.0, help="Per-request timeout in seconds.")] = 600.0,
    output_file: Annotated[Path | None, typer.Option(
        "--output-file", help="Where to write the JSON (default: arle-bench-<time>.json).")
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress bar.")] = False,
) -> None:
    """Benchmark an OpenAI-compatible server (ours or another) with the random workload."""
    from arle.bench import BenchConfig, format_summary, run_bench

    if dataset != "random":
        raise ArleError(f"unknown dataset {dataset!r}; only 'random' is supported")
    cfg = BenchConfig(base_url=base_url, model=model, api_key=api_key, num_prompts=num_prompts,
                      input_len=input_len, output_len=output_len,
                      max_concurrency=max_concurrency, request_rate=request_rate,
                      warmup_requests=warmup_requests, seed=seed, vocab_size=vocab_size,
                      timeout_s=timeout, backend=backend)
    path = output_file or Path(f"arle-bench-{time.strftime('%Y%m%d-%H%M%S')}.json")

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress("[progress.description]{task.description}", BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), disable=quiet, transient=True) as bar:
        task = bar.add_task("requests", total=num_prompts)
        summary = asyncio.run(run_bench(cfg, lambda: bar.advance(task)))
    sys.stdout.write(format_summary(summary) + "\n")
    sys.stdout.flush()
    cached, total = summary["total_cached_input_tokens"], summary["total_input_tokens"]
    if total and cached * 2 > total:
        sys.stderr.write(f"note: {cached} of {total} prompt tokens came from the server's prefix "
                         f"cache (a run before with --seed {seed}?): for prefill in the "
                         "measurement, give each run its own --seed\n")
    path.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2) + b"\n")
    sys.stderr.write(f"arle: wrote {path}\n")
    if summary["completed"] == 0:
        raise ArleError(f"no request completed ({summary['failed']} failed)")
