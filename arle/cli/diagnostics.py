"""`arle doctor` (fast checks, no weights loaded) and `arle warmup` (load, warm up, one request,
a diagnostics report). Both print text, or one JSON document with `--json`.

NOTE: `arle.diagnostics` is imported inside the commands: it pulls in torch when it runs.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import replace
from typing import Annotated, Any

import orjson
import typer

from arle.cli.common import arle_command
from arle.config import EngineConfig
from arle.errors import ArleError

JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON document instead.")]


class WarmupFailed(ArleError):
    """A warm-up phase failed; the message names it."""


def _print_json(report: dict[str, Any]) -> None:
    sys.stdout.write(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode() + "\n")
    sys.stdout.flush()


@arle_command()
def doctor(
    model: Annotated[str | None, typer.Option(
        "--model", "-m", metavar="PATH", help="Check this model instead of the default.")] = None,
    json_out: JsonOption = False,
) -> None:
    """Check the set-up quickly, without loading weights.

    Versions, the model arle would use and from where, the GPU and Triton, writable history and
    cache paths: each ok / warn / fail with a fix. Exits 1 if any check fails.
    """
    from arle.diagnostics import run_doctor

    report = run_doctor(model)
    if json_out:
        _print_json(report)
    else:
        marks = {"ok": "ok  ", "warn": "warn", "fail": "FAIL"}
        for c in report["checks"]:
            typer.echo(f"{marks[c['status']]}  {c['name']:<15} {c['detail']}")
            if c["fix"]:
                typer.echo(f"{'':<6}{'':<15} fix: {c['fix']}")
    if not report["ok"]:
        failed = [c["name"] for c in report["checks"] if c["status"] == "fail"]
        sys.stderr.write(f"error: doctor: failed: {', '.join(failed)}\n")
        raise typer.Exit(1)


@arle_command(engine=True)
def warmup(
    json_out: JsonOption = False,
    serve_defaults: Annotated[bool, typer.Option(
        "--serve-defaults/--engine-defaults",
        help="Settings as `arle serve` takes them (on a GPU, its smaller step budget, and so "
             "its memory plan and graphs), or the engine's own, as offline runs take them "
             "(complete and chat take those too, with one running request).")
    ] = True,
    *,
    config: EngineConfig,
) -> None:
    """Load the model, warm it up, answer one request, and print a diagnostics report.

    Hardware, versions, the model, the memory plan, each phase's time, the request's TTFT and
    tok/s. Exits non-zero, with the reason, if a phase fails.
    """
    from arle.diagnostics import run_warmup

    report = asyncio.run(run_warmup(replace(config, serving=serve_defaults)))
    if json_out:
        _print_json(report)
    else:
        _print_report(report)
    if not report["ok"]:
        bad = next(p for p in report["phases"] if not p["ok"])
        raise WarmupFailed(f"warmup phase {bad['name']!r} failed: {bad['error']}")


def _size(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _print_report(r: dict[str, Any]) -> None:
    out = typer.echo
    cpu = r["hardware"]["cpu"]
    out("hardware")
    out(f"  cpu        {cpu['name']}, {cpu['cores']} cores, {_size(cpu['ram_bytes'])} RAM")
    for g in r["hardware"]["gpus"]:
        out(f"  gpu {g['index']}      {g['name']}, {_size(g['memory_bytes'])}, {g['sms']} SMs, "
            f"sm_{g['capability'].replace('.', '')}, driver {g['driver']}, CUDA {g['cuda']}")
    if not r["hardware"]["gpus"]:
        out(f"  gpu        none ({r['hardware']['no_gpu_reason']})")
    out("versions")
    out("  " + ", ".join(f"{k} {v or '-'}" for k, v in r["versions"].items()))
    if r["model"]:
        m = r["model"]
        out("model")
        out(f"  {m['name']}: {m['architecture']}, {m['parameters'] / 1e6:.1f}M parameters, "
            f"{m['dtype']}, {_size(m['bytes'])}, context {m['context']}")
        out(f"  {m['path']}")
    if r["memory"]:
        mem, kv = r["memory"], r["memory"]["kv_pool"]
        out("memory plan")
        out(f"  weights    {_size(mem['weights_bytes'])}")
        out(f"  kv pool    {kv['tokens']} tokens = {kv['pages']} pages x {kv['page_size']}, "
            f"{_size(kv['bytes'])} ({kv['dtype']})")
        host = mem.get("kv_host_tier") or {}
        if host.get("pages"):
            snaps = (f", {host['snapshots']} state snapshots {_size(host['snapshot_bytes'])}"
                     if host.get("snapshots") else "")
            out(f"  host tier  {host['tokens']} tokens = {host['pages']} pages, "
                f"{_size(host['bytes'])}{snaps} (--kv-host-cache-gb)")
        out(f"  step       {mem['max_batched_tokens']} tokens, chunks of "
            f"{mem['chunked_prefill_size']} ({'arle serve' if mem['serving'] else 'engine'} "
            f"settings)")
        for rank in mem.get("ranks") or []:
            out(f"  rank {rank['rank']:<5} {rank['device']}: weights {_size(rank['weights_bytes'])}"
                f", kv pool {rank['kv_pages']} pages {_size(rank['kv_bytes'])}, state pool "
                f"{_size(rank['state_bytes'])}")
        if mem.get("cuda"):
            cuda = mem["cuda"]
            out(f"  activations {_size(cuda['activation_peak_bytes'])} (profile run peak), "
                f"mem-fraction-static {cuda['mem_fraction_static']}")
        graphs = mem.get("cuda_graphs")
        if graphs:
            out(f"  cuda graphs {len(graphs['batch_sizes'])} batch sizes up to "
                f"{graphs['batch_sizes'][-1]}, captured in {graphs['capture_s']:.2f} s")
        extend = mem.get("extend_graphs")
        if extend:
            out(f"  extend graphs {len(extend['tokens'])} token counts up to "
                f"{extend['tokens'][-1]} ({extend['rows']} rows), captured in "
                f"{extend['capture_s']:.2f} s")
    out("phases")
    for p in r["phases"]:
        status = "ok" if p["ok"] else f"FAILED: {p['error']}"
        out(f"  {p['name']:<10} {p['ms']:>10.1f} ms  {status}")
    if r["request"]:
        q = r["request"]
        tps = q["tokens_per_s"]
        out("request")
        out(f"  TTFT {q['ttft_ms']:.1f} ms, {q['completion_tokens']} tokens, "
            f"{tps if tps is None else round(tps, 1)} tok/s: {q['text']!r}")
