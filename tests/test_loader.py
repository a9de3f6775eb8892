"""Every bad model input gives a ModelLoadError whose message names the file and the problem.

The starting point is a valid sharded checkpoint written by transformers (tests/model_dirs.py);
each test breaks one thing in a copy of it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import arle_env, require_smollm2_gguf
from model_dirs import hf_config, write_model_dir
from safetensors.torch import load_file, save_file

from arle.errors import ModelLoadError
from arle.model.loader import load_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("good") / "qwen3"
    write_model_dir(path, hf_config("Qwen3ForCausalLM"))
    return path


@pytest.fixture
def model_dir(good_dir: Path, tmp_path: Path) -> Path:
    """A fresh copy of the valid checkpoint for one test to break."""
    return Path(shutil.copytree(good_dir, tmp_path / "model"))


def load_error(path: Path) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as info:
        load_model(path, "float32")
    return info.value


def shard_of(path: Path, tensor: str) -> Path:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return path / index["weight_map"][tensor]


def rewrite_shard(shard: Path, edit) -> None:
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_the_unbroken_copy_loads(model_dir):
    """So that the failures below come from what each test breaks, not from the fixture."""
    loaded = load_model(model_dir, "float32")
    assert loaded.config.architecture == "Qwen3ForCausalLM"
    assert loaded.num_parameters > 0


def test_missing_path(tmp_path):
    path = tmp_path / "no-such-model"
    err = load_error(path)
    assert err.path == str(path) and "no such file" in err.problem
    assert str(err).startswith(str(path))


def test_directory_without_config(model_dir):
    (model_dir / "config.json").unlink()
    err = load_error(model_dir)
    assert err.path == str(model_dir / "config.json") and "missing" in err.problem


def test_config_that_is_not_json(model_dir):
    (model_dir / "config.json").write_text("{not json")
    err = load_error(model_dir)
    assert err.path == str(model_dir / "config.json") and "JSON" in err.problem


def test_config_that_is_not_an_object(model_dir):
    (model_dir / "config.json").write_text("[1, 2]")
    err = load_error(model_dir)
    assert err.path == str(model_dir / "config.json") and "object" in err.problem


def test_unsupported_architecture_is_named(model_dir):
    edit_config(model_dir, architectures=["BertModel"], model_type="bert")
    err = load_error(model_dir)
    assert err.path == str(model_dir / "config.json")
    assert "BertModel" in err.problem and "LlamaForCausalLM" in err.problem


def test_bad_config_field(model_dir):
    edit_config(model_dir, hidden_size="wide")
    err = load_error(model_dir)
    assert err.path == str(model_dir / "config.json") and "hidden_size" not in err.path
    assert "bad config field" in err.problem


def test_unsupported_rope_scaling_type(model_dir):
    edit_config(model_dir, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                            "short_factor": [1.0], "long_factor": [1.0]})
    err = load_error(model_dir)
    assert err.path == str(model_dir / "config.json") and "'longrope'" in err.problem


def test_directory_without_safetensors(model_dir):
    for f in model_dir.glob("model*.safetensors*"):
        f.unlink()
    err = load_error(model_dir)
    assert err.path == str(model_dir) and "no *.safetensors" in err.problem


def test_missing_tokenizer(model_dir):
    (model_dir / "tokenizer.json").unlink()
    err = load_error(model_dir)
    assert err.path == str(model_dir / "tokenizer.json") and "missing" in err.problem


def test_truncated_safetensors(model_dir):
    shard = shard_of(model_dir, "model.embed_tokens.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    err = load_error(model_dir)
    assert err.path == str(shard) and "truncated or corrupt" in err.problem


def test_tensor_with_wrong_shape(model_dir):
    name = "model.layers.1.mlp.down_proj.weight"
    shard = shard_of(model_dir, name)
    rewrite_shard(shard, lambda t: t.update({name: t[name][:, :-1].contiguous()}))
    err = load_error(model_dir)
    assert err.path == str(shard)
    assert name in err.problem and "(128, 255)" in err.problem and "(128, 256)" in err.problem


def test_missing_tensor(model_dir):
    name = "model.layers.2.self_attn.k_norm.weight"
    rewrite_shard(shard_of(model_dir, name), lambda t: t.pop(name))
    err = load_error(model_dir)
    assert err.path == str(model_dir) and "lacks" in err.problem and name in err.problem


def test_unexpected_tensor(model_dir):
    name = "model.layers.0.self_attn.rotary_bias"
    shard = shard_of(model_dir, "model.norm.weight")
    rewrite_shard(shard, lambda t: t.update({name: torch.zeros(3)}))
    err = load_error(model_dir)
    assert err.path == str(shard) and name in err.problem


def test_index_lists_a_missing_shard(model_dir):
    shard = shard_of(model_dir, "model.layers.0.mlp.up_proj.weight")
    shard.unlink()
    err = load_error(model_dir)
    assert err.path == str(shard) and "missing" in err.problem and "index" in err.problem


def test_gguf_that_is_text(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("this is not a model\n")
    err = load_error(path)
    assert err.path == str(path) and "not a GGUF file" in err.problem


@pytest.mark.slow
def test_truncated_gguf(tmp_path):
    """(~2 s: the reader parses the tokenizer metadata before it finds the data short.)"""
    path = tmp_path / "cut.gguf"
    with require_smollm2_gguf().open("rb") as f:
        path.write_bytes(f.read(1 << 20))
    err = load_error(path)
    assert err.path == str(path) and "truncated or corrupt" in err.problem


def test_file_that_is_neither(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 64)
    err = load_error(path)
    assert err.path == str(path) and "not a model directory" in err.problem


@pytest.mark.slow
def test_cli_reports_a_bad_model_in_one_line(tmp_path):
    """The user sees one line naming the path, exit status 2, no traceback (~2 s: a subprocess
    that imports torch)."""
    bad = tmp_path / "empty-model"
    bad.mkdir()
    env = arle_env()
    proc = subprocess.run([sys.executable, "-m", "arle", "complete", "-m", str(bad), "hi"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(bad / "config.json") in lines[0] and "Traceback" not in proc.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_gpu_load_through_pinned_buffers_matches_the_checkpoint(good_dir, monkeypatch):
    """Onto a GPU the weights go through two pinned buffers, in chunks. With chunks far smaller
    than the tensors (each spans many; the two buffers take turns), every parameter equals the
    CPU load's bit for bit, converted to bf16 on the GPU there and on the CPU here."""
    from arle.model import loader

    monkeypatch.setattr(loader._HostToDevice, "CHUNK", 4096)
    gpu = load_model(good_dir, "bfloat16", "cuda")
    cpu = load_model(good_dir, "bfloat16", "cpu")
    names = [name for name, _ in cpu.model.named_parameters()]
    assert names == [name for name, _ in gpu.model.named_parameters()]
    for (name, on_gpu), on_cpu in zip(gpu.model.named_parameters(), cpu.model.parameters(),
                                      strict=True):
        assert on_gpu.is_cuda and on_gpu.dtype == torch.bfloat16
        assert torch.equal(on_gpu.cpu(), on_cpu), name
