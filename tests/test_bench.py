"""`arle bench` against a real `arle serve` on the default model, its JSON parsed and checked
against what the server itself counted; its statistics against numpy's."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from helpers import arle_env, require_smollm2_gguf
from served import ServerProcess, arle_server

from arle.bench import BenchConfig, RequestResult, _percentile, summarize

#: SGLang bench_serving's output fields that `arle bench` writes too.
SGLANG_FIELDS = [
    "duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "input_throughput", "output_throughput", "total_throughput", "concurrency",
    "max_output_tokens_per_s", "max_concurrent_requests",
    *(f"{stat}_{metric}_ms" for metric in ("e2e_latency", "ttft", "tpot", "itl")
      for stat in ("mean", "median", "std", "p90", "p95", "p99")),
]


@pytest.fixture(scope="module")
def smol_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = require_smollm2_gguf()
    log = tmp_path_factory.mktemp("bench") / "serve.log"
    with arle_server(["--model", str(model), "--kv-cache-tokens", "4096",
                      "--max-model-len", "512"], log) as s:
        yield s


def _bench(url: str, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = arle_env()
    return subprocess.run(
        [sys.executable, "-m", "arle", "bench", "--base-url", url, "--output-file", str(out),
         "--quiet", *args], env=env, capture_output=True, text=True, timeout=300,
        stdin=subprocess.DEVNULL)


def _prompt_tokens(url: str) -> float:
    return float(httpx.get(url + "/v1/stats", timeout=10).json()["arle_prompt_tokens"])


@pytest.mark.slow
def test_bench_against_arle_serve(smol_server: ServerProcess, tmp_path: Path) -> None:
    before = _prompt_tokens(smol_server.url)
    out = tmp_path / "bench.json"
    proc = _bench(smol_server.url, out, "--num-prompts", "6", "--random-input-len", "24",
                  "--random-output-len", "5", "--max-concurrency", "3",
                  "--warmup-requests", "1")
    assert proc.returncode == 0, proc.stderr
    assert "Serving Benchmark Result" in proc.stdout and "Mean TTFT (ms)" in proc.stdout
    result = json.loads(out.read_text())
    missing = [f for f in SGLANG_FIELDS if f not in result]
    assert not missing, missing
    assert result["completed"] == 6 and result["failed"] == 0
    # Exact lengths: 6 x 24 prompt tokens in, 6 x 5 tokens out (ignore_eos).
    assert result["total_input_tokens"] == 6 * 24
    assert result["total_output_tokens"] == 6 * 5
    # ... as the server counted them too (plus the warm-up request's prompt).
    assert _prompt_tokens(smol_server.url) - before == 7 * 24
    assert 1 <= result["max_concurrent_requests"] <= 3
    assert 0 < result["concurrency"] <= 3 + 1e-6
    assert 0 < result["mean_ttft_ms"] <= result["mean_e2e_latency_ms"]
    assert result["median_ttft_ms"] <= result["p99_ttft_ms"]
    assert result["mean_tpot_ms"] > 0 and result["mean_itl_ms"] > 0
    assert result["output_throughput"] == pytest.approx(30 / result["duration"])
    assert 0 < result["max_output_tokens_per_s"] <= 30


@pytest.mark.slow
def test_bench_reports_prefix_cache_hits(smol_server: ServerProcess, tmp_path: Path) -> None:
    """Run twice with one seed, the second run's prompts are in the server's prefix cache: the
    summary counts those tokens (each 40-token prompt's two full 16-token pages) and the CLI
    says so on stderr; the first run's prompts were all prefilled."""
    args = ("--num-prompts", "4", "--random-input-len", "40", "--random-output-len", "2",
            "--warmup-requests", "0", "--seed", "977")
    runs = []
    for name in ("first.json", "second.json"):
        proc = _bench(smol_server.url, tmp_path / name, *args)
        assert proc.returncode == 0, proc.stderr
        runs.append((json.loads((tmp_path / name).read_text()), proc.stderr))
    (first, first_err), (second, second_err) = runs
    assert first["total_cached_input_tokens"] == 0 and "prefix cache" not in first_err
    assert 4 * 32 <= second["total_cached_input_tokens"] < second["total_input_tokens"] == 160
    assert "prefix cache" in second_err and "--seed" in second_err


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sglang-oai", "sglang-oai-chat", "guidellm"])
def test_bench_with_other_generators_request_shapes(smol_server: ServerProcess, tmp_path: Path,
                                                    backend: str) -> None:
    """SGLang's and guidellm's request bodies (the chat ones with text prompts from
    /detokenize): every request completes with exactly the asked output length."""
    out = tmp_path / "bench.json"
    proc = _bench(smol_server.url, out, "--backend", backend, "--num-prompts", "3",
                  "--random-input-len", "16", "--random-output-len", "4",
                  "--warmup-requests", "0", "--seed", "41")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["backend"] == backend and result["completed"] == 3 and result["failed"] == 0
    assert result["mean_ttft_ms"] > 0
    if backend != "sglang-oai":  # no stream_options: the output length is the chunk count
        assert result["total_output_tokens"] == 3 * 4
    if backend.endswith("chat") or backend == "guidellm":  # the templated text's own length
        assert result["total_input_tokens"] > 3 * 16 * 0.5
    else:
        assert result["total_input_tokens"] == 3 * 16


def test_bench_refuses_an_unknown_backend(tmp_path: Path) -> None:
    proc = _bench("http://127.0.0.1:9", tmp_path / "x.json", "--backend", "tgi")
    assert proc.returncode != 0 and "unknown backend 'tgi'" in proc.stderr


@pytest.mark.slow
def test_bench_poisson_rate(smol_server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = _bench(smol_server.url, out, "--num-prompts", "4", "--random-input-len", "8",
                  "--random-output-len", "2", "--request-rate", "20", "--warmup-requests", "0")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["completed"] == 4 and result["request_rate"] == 20.0


def test_bench_unreachable_server_is_one_error_line(tmp_path: Path) -> None:
    proc = _bench("http://127.0.0.1:9", tmp_path / "x.json", "--num-prompts", "1")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("error: cannot reach")
    assert not (tmp_path / "x.json").exists()


def test_bench_imports_no_torch() -> None:
    code = "import sys, arle.bench, arle.cli.bench; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                   env=arle_env())


def test_summary_statistics_match_numpy() -> None:
    rng = np.random.default_rng(0)
    results = []
    for _ in range(9):
        ttft = float(rng.uniform(0.01, 0.2))
        itl = [float(x) for x in rng.uniform(0.005, 0.05, size=4)]
        results.append(RequestResult(prompt_len=10, ok=True, output_len=5, ttft_s=ttft,
                                     e2e_s=ttft + sum(itl), itl_s=itl,
                                     chunk_times=[(1.0, 5)]))
    results.append(RequestResult(prompt_len=10, error="HTTP 503"))
    s = summarize(BenchConfig(num_prompts=10), "m", results, 2.0, 4)
    ttft_ms = np.array([r.ttft_s for r in results[:9]]) * 1e3
    itl_ms = np.array([g for r in results[:9] for g in r.itl_s]) * 1e3
    assert s["completed"] == 9 and s["failed"] == 1 and s["errors"] == ["HTTP 503"]
    assert s["mean_ttft_ms"] == pytest.approx(np.mean(ttft_ms))
    assert s["median_ttft_ms"] == pytest.approx(np.median(ttft_ms))
    assert s["std_ttft_ms"] == pytest.approx(np.std(ttft_ms))
    for q in (90, 95, 99):
        assert s[f"p{q}_itl_ms"] == pytest.approx(np.percentile(itl_ms, q))
        assert _percentile(list(itl_ms), q) == pytest.approx(np.percentile(itl_ms, q))
    # TPOT excludes the first token: (e2e - ttft) / (5 - 1) = the mean of the 4 gaps.
    assert s["mean_tpot_ms"] == pytest.approx(np.mean(itl_ms))
    assert s["request_throughput"] == pytest.approx(9 / 2.0)
    assert s["max_output_tokens_per_s"] == 45.0 and s["max_concurrent_requests"] == 4
    assert math.isclose(s["concurrency"], sum(r.e2e_s for r in results[:9]) / 2.0)
