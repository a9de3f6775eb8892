"""Third-party clients against `arle serve` on the default model, offline (no Hub access):
- lm-eval's `local-completions` scores a small multiple-choice task through echo + logprobs and
  the server's tokenizer routes, with the accuracy and per-choice loglikelihoods (within 1e-3)
  of lm-eval's `hf` backend on the same GGUF weights;
- lm-eval's `local-chat-completions` runs generate-until through the chat route;
- guidellm's streaming benchmark (stream_options.continuous_usage_stats, ignore_eos) completes
  every request, with a TTFT for each."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import require_smollm2_gguf, smollm2_tokenizer
from served import ServerProcess, arle_server

pytestmark = pytest.mark.slow

QUESTIONS = [
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("How many legs does a spider have?", ["six", "eight", "ten", "four"], 1),
    ("What color is the sky on a clear day?", ["green", "red", "blue", "purple"], 2),
    ("Which animal says moo?", ["a cat", "a dog", "a cow", "a duck"], 2),
    ("What is two plus two?", ["three", "five", "four", "six"], 2),
    ("Which planet do we live on?", ["Mars", "Earth", "Venus", "Jupiter"], 1),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    require_smollm2_gguf()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    # NOTE: fp32 weights, as the transformers backend the loglikelihoods are checked against
    with arle_server(["--max-model-len", "2048", "--dtype", "float32"], log,
                     timeout_s=300) as s:
        yield s


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A multiple-choice task and a generate-until task on the same six questions."""
    root = tmp_path_factory.mktemp("tasks")
    data = root / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in QUESTIONS))
    source = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
              "test_split: test\n")
    (root / "arle_mc.yaml").write_text(
        "task: arle_mc\n" + source + "output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_target: "{{answer}}"\n'
        'doc_to_choice: "{{choices}}"\nmetric_list:\n  - metric: acc\n'
        "    aggregation: mean\n    higher_is_better: true\n")
    (root / "arle_gen.yaml").write_text(
        "task: arle_gen\n" + source + "output_type: generate_until\n"
        'doc_to_text: "{{question}} Answer in one word."\n'
        'doc_to_target: "{{choices[answer]}}"\n'
        'generation_kwargs:\n  until: ["\\n\\n"]\n  max_gen_toks: 12\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n"
        "    higher_is_better: true\n")
    return root


def served_model(server: ServerProcess) -> str:
    model_id: str = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    return model_id


def offline_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ARLE_", "HF_"))}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp / "hf-home"),
               TOKENIZERS_PARALLELISM="false")
    return env


def lm_eval(tmp: Path, tasks: Path, task: str, model: str, model_args: str,
            *extra: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run lm-eval's CLI; its results and its logged samples (in doc order)."""
    pytest.importorskip("lm_eval")
    out = tmp / f"out-{model}-{task}"
    proc = subprocess.run(
        [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args,
         "--tasks", task, "--include_path", str(tasks), "--output_path", str(out),
         "--log_samples", *extra],
        env=offline_env(tmp), capture_output=True, text=True, timeout=900, cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(Path(glob.glob(f"{out}/*/results_*.json")[0]).read_text())
    samples = [json.loads(line) for line in
               Path(glob.glob(f"{out}/*/samples_{task}_*.jsonl")[0]).read_text().splitlines()]
    return results["results"][task], sorted(samples, key=lambda s: s["doc_id"])


def test_lm_eval_loglikelihood_matches_the_hf_backend(server: ServerProcess, tasks: Path,
                                                      tmp_path: Path) -> None:
    model_id = served_model(server)
    # NOTE: no tokenizer argument: lm-eval finds /tokenizer_info and /tokenize and uses them
    api, api_samples = lm_eval(
        tmp_path, tasks, "arle_mc", "local-completions",
        f"base_url={server.url}/v1/completions,model={model_id},num_concurrent=2,"
        "max_retries=1")
    gguf = require_smollm2_gguf()
    hf, hf_samples = lm_eval(
        tmp_path, tasks, "arle_mc", "hf",
        f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32",
        "--device", "cpu", "--batch_size", "1")
    assert api["acc,none"] == hf["acc,none"]
    assert len(api_samples) == len(hf_samples) == len(QUESTIONS)
    for a, h in zip(api_samples, hf_samples, strict=True):
        ours = [float(r[0][0]) for r in a["resps"]]
        ref = [float(r[0][0]) for r in h["resps"]]
        assert len(ours) == 4
        assert all(abs(x - y) < 1e-3 for x, y in zip(ours, ref, strict=True)), (ours, ref)
        # is_greedy, from the top-1 alternatives
        assert [r[0][1] for r in a["resps"]] == [r[0][1] for r in h["resps"]]


def test_lm_eval_generate_until_through_chat(server: ServerProcess, tasks: Path,
                                             tmp_path: Path) -> None:
    model_id = served_model(server)
    _, samples = lm_eval(
        tmp_path, tasks, "arle_gen", "local-chat-completions",
        f"base_url={server.url}/v1/chat/completions,model={model_id},num_concurrent=2,"
        "max_retries=1", "--apply_chat_template")
    answers = [s["resps"][0][0] for s in samples]
    assert len(answers) == len(QUESTIONS) and all(isinstance(a, str) and a for a in answers)
    assert "Paris" in answers[0]  # greedy on the default model
    routes = [e.get("route") for e in server.events() if e.get("event") == "request_trace"]
    assert routes.count("/v1/chat/completions") >= len(QUESTIONS)


def test_guidellm_streaming_benchmark_completes_every_request(
        server: ServerProcess, tmp_path: Path) -> None:
    guidellm = Path(sys.executable).parent / "guidellm"
    if not guidellm.exists():
        pytest.skip("guidellm is not installed")
    # guidellm draws its synthetic prompts with a transformers tokenizer: the default model's,
    # written as a tokenizer directory (offline)
    tok_dir = tmp_path / "tokenizer"
    tok_dir.mkdir()
    tok = smollm2_tokenizer()
    tok.save(tok_dir / "tokenizer.json")
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eos_token}))
    out = tmp_path / "guidellm.json"
    n = 6
    proc = subprocess.run(
        [str(guidellm), "run", "--backend", f"kind=openai_http,target={server.url}",
         "--profile", "kind=concurrent,streams=2",
         "--constraint", f"kind=max_requests,count={n}",
         "--tokenizer", f"kind=huggingface_auto,model={tok_dir}",
         "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
         "--output", f"kind=json,path={out}", "--disable-console-interactive"],
        env=offline_env(tmp_path), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    bench = json.loads(out.read_text())["benchmarks"][0]
    # NOTE: per-request records, not `metrics`: guidellm's metrics keep only the requests inside
    # its measurement window, whose end it can fix before the last request is reported when the
    # machine is loaded, so a request that completed may be missing there.
    assert bench["scheduler_state"]["successful_requests"] == n
    done = bench["requests"]
    assert len(done["successful"]) == n and not done["errored"] and not done["incomplete"]
    assert all(r["time_to_first_token_ms"] > 0 for r in done["successful"])
    assert [r["output_tokens"] for r in done["successful"]] == [8] * n  # ignore_eos honoured
