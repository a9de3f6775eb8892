"""EngineConfig and its flags (ENGINE_OPTIONS), and the environment variables (arle.env): each
option and each variable has one source."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import typer
import typer.main
from typer.testing import CliRunner

from arle import env
from arle.cli import common
from arle.cli.app import app
from arle.cli.common import arle_command
from arle.config import ENGINE_OPTIONS, EngineConfig, EngineOption

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}
#: Fields set by a command or kept at their default, never by an engine flag of their own.
UNFLAGGED = {"page_size", "kv_cache_memory_gb", "max_waiting_requests", "seed", "serving"}


def _engine_app(seen: list[EngineConfig]) -> typer.Typer:
    """A one-command app with the engine options; the command records its config."""
    test_app = typer.Typer()

    @test_app.command()
    @arle_command(engine=True, resolve_model=False)
    def run(*, config: EngineConfig) -> None:
        seen.append(config)

    return test_app


def test_every_cli_field_has_exactly_one_flag() -> None:
    fields = [opt.field for opt in ENGINE_OPTIONS]
    assert len(fields) == len(set(fields)), fields
    assert set(fields) <= set(FIELDS)
    assert set(FIELDS) - set(fields) == UNFLAGGED
    flags = [flag for opt in ENGINE_OPTIONS for flag in (opt.flag, *opt.aliases)]
    assert len(flags) == len(set(flags)), flags
    for opt in ENGINE_OPTIONS:
        kind = FIELDS[opt.field].type
        if opt.inverted:
            assert kind == "bool" and FIELDS[opt.field].default is True, opt
        if opt.min is not None or opt.max is not None:
            assert "int" in kind or "float" in kind, opt

    # Each engine command has each flag once, under the field's flag names only.
    commands = typer.main.get_command(app).commands  # type: ignore[attr-defined]
    for name in ("complete", "chat", "serve", "warmup"):
        params = commands[name].params
        for opt in ENGINE_OPTIONS:
            [param] = [p for p in params if opt.flag in p.opts]
            assert param.opts == [opt.flag, *opt.aliases], (name, opt)
            assert param.rich_help_panel == "Engine"


def test_argv_gives_the_expected_config() -> None:
    seen: list[EngineConfig] = []
    runner = CliRunner()
    result = runner.invoke(_engine_app(seen), [])
    assert result.exit_code == 0, result.output
    assert seen == [EngineConfig()]  # no flag: every field keeps EngineConfig's default

    result = runner.invoke(_engine_app(seen), [
        "-m", "/some/model.gguf", "--dtype", "bfloat16", "--device", "cpu",
        "--kv-cache-dtype", "fp8_e4m3", "--no-prefix-cache", "--disable-overlap",
        "--disable-cuda-graph", "--threads", "3", "--max-batched-tokens", "4096",
        "--mem-fraction-static", "0.5"])
    assert result.exit_code == 0, result.output
    assert seen[-1] == EngineConfig(
        model="/some/model.gguf", dtype="bfloat16", device="cpu", kv_cache_dtype="fp8_e4m3",
        enable_prefix_cache=False, overlap=False, cuda_graph=False, num_threads=3,
        max_batched_tokens=4096, mem_fraction_static=0.5)
    assert type(seen[-1].dtype) is str  # the Literal's value, not a choice Enum

    for bad in (["--dtype", "int8"], ["--threads", "0"], ["--mem-fraction-static", "1.0"]):
        result = runner.invoke(_engine_app(seen), bad)
        assert result.exit_code == 2, (bad, result.output)


def test_an_option_added_to_the_table_is_a_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    page_size = EngineOption("page_size", "--page-size", min=1, help="Tokens per KV page.")
    monkeypatch.setattr(common, "ENGINE_OPTIONS", (*ENGINE_OPTIONS, page_size))
    seen: list[EngineConfig] = []
    runner = CliRunner()
    help_text = runner.invoke(_engine_app(seen), ["--help"], env={"COLUMNS": "200"}).stdout
    assert re.search(r"--page-size\s.*Tokens per KV page\. \[default: 16\]", help_text), help_text
    assert runner.invoke(_engine_app(seen), ["--page-size", "32"]).exit_code == 0
    assert seen[-1].page_size == 32
    assert runner.invoke(_engine_app(seen), ["--page-size", "0"]).exit_code == 2


# --- environment variables ---------------------------------------------------------------------


def test_only_arle_env_reads_the_environment() -> None:
    readers = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "arle").rglob("*.py")
                     if re.search(r"os\.environ|getenv", path.read_text()))
    assert readers == ["arle/env.py"]


def test_arle_env_imports_the_standard_library_only() -> None:
    tree = ast.parse((ROOT / "arle" / "env.py").read_text())
    modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
               for alias in node.names}
    modules |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert modules == {"__future__", "os"}


def test_env_accessors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(KeyError, match="HOME"):
        env.get("HOME")  # not listed in env.VARIABLES
    monkeypatch.setenv(env.ARLE_MODEL, "")
    assert env.model() is None  # empty: unset
    monkeypatch.setenv(env.ARLE_MODEL, "/m.gguf")
    assert env.model() == "/m.gguf"
    monkeypatch.setenv(env.CUDA_VISIBLE_DEVICES, "")
    assert env.cuda_visible_devices() == ""  # empty is not unset: every GPU hidden
    monkeypatch.delenv(env.CUDA_VISIBLE_DEVICES)
    assert env.cuda_visible_devices() is None


def test_kv_plan_past_free_memory_names_what_to_change() -> None:
    """--mem-fraction-static is a share of the whole GPU: a KV pool that memory other processes
    hold leaves no room for is refused with the sizes and the two flags, not an OOM later."""
    from arle.errors import ArleError
    from arle.executor.cuda_startup import check_fits

    gib = 2**30
    check_fits(50 * gib, 2 * gib, 52 * gib, 0, 0.85)  # exactly fits
    with pytest.raises(ArleError, match=r"\(57\.0 GiB\).*\(2\.0 GiB\).*26\.0 GiB free.*hold "
                       r"80\.0 GiB.*--mem-fraction-static \(now 0\.85\).*--kv-cache-tokens"):
        check_fits(57 * gib, 2 * gib, 26 * gib, 80 * gib, 0.85)
