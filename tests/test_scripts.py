"""scripts/make_random_model.py and scripts/bench_hf.py: the random Qwen3 directory has transformers'
exact layout, loads in transformers and arle with the same logits, and the transformers baseline
benchmark runs on it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ROOT, load_script, require_smollm2_gguf

mrm = load_script("make_random_model")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_safetensors_writer_round_trip(tmp_path: Path) -> None:
    """The hand-written safetensors stream reads back through the safetensors library."""
    from safetensors import safe_open

    specs = [mrm.TensorSpec("a.weight", (3, 5), 0.5), mrm.TensorSpec("b.norm", (7,), None),
             mrm.TensorSpec("c.weight", (2, 3, 4), 1.0)]
    for dtype in (torch.bfloat16, torch.float32):
        made = {s.name: mrm.make_tensor(s, 1, dtype, torch.device("cpu")) for s in specs}
        path = tmp_path / f"x-{dtype}.safetensors"
        mrm.write_safetensors(path, specs, dtype, lambda s: made[s.name])  # noqa: B023
        with safe_open(str(path), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert sorted(f.keys()) == sorted(made)
            for name, t in made.items():
                assert torch.equal(f.get_tensor(name), t)
    assert bool((made["b.norm"] > 0).all())
    # seeded by name: the same tensor whatever else is drawn, a different one for another seed
    assert torch.equal(mrm.make_tensor(specs[0], 1, torch.float32, torch.device("cpu")),
                       made["a.weight"])
    assert not torch.equal(mrm.make_tensor(specs[0], 2, torch.float32, torch.device("cpu")),
                           made["a.weight"])


def test_plan_shards_bounds_size() -> None:
    specs = mrm.tensor_specs(mrm.CONFIGS["qwen3-8b"])
    shards = mrm.plan_shards(specs, 2, 4 * 10**9)
    assert [s for shard in shards for s in shard] == specs
    sizes = [sum(math.prod(s.shape) * 2 for s in shard) for shard in shards]
    assert len(shards) == 5 and max(sizes) <= 4 * 10**9
    assert sum(sizes) == 8_190_735_360 * 2  # Qwen3-8B's published parameter count, untied


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-4b", "qwen3-8b", "tiny"])
def test_tensor_layout_matches_transformers(name: str) -> None:
    """Names and shapes are exactly those of transformers' Qwen3ForCausalLM for the config."""
    import transformers

    cfg = mrm.CONFIGS[name]
    config = transformers.AutoConfig.for_model(**cfg)
    assert type(config).__name__ == "Qwen3Config"
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg["tie_word_embeddings"]:
        expected.pop("lm_head.weight")  # tied: real checkpoints do not store it
    assert {s.name: s.shape for s in mrm.tensor_specs(cfg)} == expected


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny"
    # Small shards: the embedding alone, then the rest (an index and two files).
    proc = _run("scripts/make_random_model.py", "tiny", str(out), "--device", "cpu",
                "--shard-gb", "0.05")
    assert "wrote tiny" in proc.stdout
    return out


@pytest.mark.slow
def test_tiny_dir_files(tiny_dir: Path) -> None:
    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["vocab_size"] == 151936
    assert json.loads((tiny_dir / "generation_config.json").read_text())["eos_token_id"] == [
        151645, 151643]


@pytest.mark.slow
def test_tiny_loads_with_matching_logits(tiny_dir: Path) -> None:
    """arle and transformers, both fp32 from the bf16 files, agree on teacher-forced logits; the
    logits are spread enough that greedy choices are not near-ties."""
    import transformers

    teacher_forced_logits = load_script("check_gpu_parity").teacher_forced_logits
    from arle.model.loader import load_model

    ids = torch.randint(0, 151936, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    loaded = load_model(tiny_dir, "float32", "cpu")
    with torch.no_grad():
        ours = teacher_forced_logits(loaded.model, ids)
        hf: Any = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir,
                                                                    dtype=torch.float32)
        ref = hf.eval()(torch.tensor([ids])).logits[0]
    assert ours.shape == ref.shape == (40, 151936)
    assert (ours - ref).abs().max().item() < 1e-3
    assert ref.std(dim=-1).min().item() > 1.5
    top2 = ref.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).mean().item() > 0.3

    # The tokenizer: Qwen's special ids, the same ids and template in both libraries.
    text = "<|im_start|>user\ndef f(x):\n    return x + 1  # 42 ü<|im_end|>\n"
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    assert loaded.tokenizer.encode(text) == tok(text).input_ids
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        151643, 151644, 151645]
    assert tok.eos_token_id == 151645 and 151645 in loaded.config.eos_token_ids
    msgs = [{"role": "user", "content": "hi"}]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.slow
def test_bench_hf_runs(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = _run("scripts/bench_hf.py", str(tiny_dir), "--device", "cpu", "--dtype", "float32",
                "--modes", "eager", "--batch", "1", "2", "--input-len", "16",
                "--output-len", "4", "--repeats", "1", "--out", str(out))
    data = json.loads(out.read_text())
    assert data["environment"]["device"] == "cpu" and data["environment"]["torch"]
    rows = data["results"]
    assert [(r["mode"], r["batch"]) for r in rows] == [("eager", 1), ("eager", 2)]
    for r in rows:
        assert r["output_len"] == 4 and r["compiled"] is False
        assert 0 < r["ttft_s"] < r["total_s"] and r["decode_ms_per_token"] > 0
        assert r["output_tok_s"] == pytest.approx(r["batch"] * 4 / r["total_s"])
    assert "tok/s" in proc.stdout


def test_bench_kernels_help() -> None:
    """scripts/bench_kernels.py imports and lists its benchmarks without a GPU."""
    out = _run("scripts/bench_kernels.py", "--help").stdout
    assert all(cmd in out for cmd in ("gemv", "sweep", "fused", "decode", "extend"))


def test_bench_gpu_records_steps_in_launch_order() -> None:
    """bench_gpu.py's step recorder (the `timeline` and `host` phases) on a stand-in executor:
    each step's shape in launch order, its device time from the i-th wait, and the executor's
    own methods back afterwards."""
    from types import SimpleNamespace

    bench = load_script("bench_gpu")

    class Executor:
        def _enqueue(self, h: Any) -> tuple[str, Any]:
            return "event", h

        @staticmethod
        def _wait(event: str, pending: Any) -> Any:
            return SimpleNamespace(exec_s=pending.layout.num_tokens / 1000)

    ex = Executor()
    originals = (ex._enqueue, ex._wait)
    finish = bench._record_steps(ex)
    for tokens, decode in ((1024, 2), (8, 8)):
        h = SimpleNamespace(graph_bs=8 if tokens == decode else 0,
                            extend_tokens=0 if tokens == decode else tokens,
                            layout=SimpleNamespace(num_tokens=tokens, num_decode=decode))
        ex._wait(*ex._enqueue(h))
    steps = finish()
    assert [(s["tokens"], s["decode_rows"], s["graph_bs"], s["extend_graph"]) for s in steps] == [
        (1024, 2, 0, 1024), (8, 8, 8, 0)]
    assert [s["device_ms"] for s in steps] == [1024.0, 8.0]
    assert steps[0]["t_ms"] <= steps[1]["t_ms"] and all(s["host_ms"] >= 0 for s in steps)
    assert (ex._enqueue, ex._wait) == originals


def test_bench_gpu_latencies() -> None:
    """TTFT from the request's start to its first token; TPOT over the tokens after the first."""
    bench = load_script("bench_gpu")
    ttft, tpot = bench._latencies([(1.0, [1.5, 2.0, 3.0]), (0.0, [0.25, 0.75])])
    assert ttft == [0.5, 0.25] and tpot == [0.75, 0.5]


def test_serve_sim_runs_the_engine_and_the_server_on_a_simulated_device(tmp_path: Path) -> None:
    """scripts/serve_sim.py, both modes, tiny: every request is served, the simulated device's
    time is what its model gives the engine's steps, and over HTTP the server's counters
    (`arle bench`'s server_steps / server_device_busy) say how busy that device was."""
    require_smollm2_gguf()  # its tokenizer
    out = tmp_path / "sim.json"
    _run("scripts/serve_sim.py", "--concurrency", "2", "--num-requests", "4", "--input-len", "32",
         "--output-len", "6", "--decode-ms", "5", "--prefill-us", "100", "--repeats", "1",
         "--out", str(out))
    direct, served = json.loads(out.read_text())["runs"]
    assert (direct["mode"], served["mode"]) == ("direct", "serve")
    # 4 requests x 6 tokens; each request needs 6 steps of its own (one prefill, five decode)
    assert direct["output_tok_s"] == pytest.approx(24 / direct["wall_s"])
    assert 12 <= direct["steps"] <= 24
    # every step costs 5 ms, plus 0.1 ms a prompt token (4 x 32 of them)
    assert direct["device_busy_s"] == pytest.approx(direct["steps"] * 0.005 + 128 * 1e-4)
    assert direct["device_busy_s"] <= direct["wall_s"] + 1e-3
    assert 12 <= served["server_steps"] <= 30
    assert 0.3 < served["server_device_busy"] <= 1.0 + 1e-6
