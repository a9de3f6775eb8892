"""GGUF reader: weights and config checked against transformers' loader of the same file."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import require_smollm2_gguf

from arle.errors import ModelLoadError
from arle.model.config import ModelConfig
from arle.model.gguf_io import GGUFModel, read_gguf


@pytest.fixture(scope="module")
def ours() -> GGUFModel:
    return read_gguf(require_smollm2_gguf())


@pytest.fixture(scope="module")
def hf_model() -> Any:
    transformers = pytest.importorskip("transformers")
    path = require_smollm2_gguf()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )


@pytest.mark.slow
def test_weights_match_transformers(ours: GGUFModel, hf_model: Any) -> None:
    expected = hf_model.state_dict()
    seen = set()
    for name, w in ours.iter_tensors():
        assert w.dtype == torch.float32 and w.is_contiguous(), name
        assert w.shape == expected[name].shape, name
        # NOTE: exact: both dequantize the same blocks; q/k also pass our un-permutation.
        assert torch.equal(w, expected[name]), name
        seen.add(name)
    # The head is tied, so transformers' lm_head.weight is the embedding itself.
    assert seen == set(expected) - {"lm_head.weight"}
    assert seen == set(ours.tensor_names)
    assert hf_model.config.tie_word_embeddings and ours.config["tie_word_embeddings"]


@pytest.mark.slow
def test_config_matches_transformers(ours: GGUFModel, hf_model: Any) -> None:
    hf = hf_model.config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
                "bos_token_id", "eos_token_id", "model_type"):
        assert ours.config[key] == getattr(hf, key), key
    assert ours.config["rms_norm_eps"] == pytest.approx(hf.rms_norm_eps, rel=1e-6)
    rope = getattr(hf, "rope_parameters", None) or {"rope_theta": hf.rope_theta}
    assert ours.config["rope_theta"] == rope["rope_theta"]
    assert ours.config["architectures"] == ["LlamaForCausalLM"]
    assert "rope_scaling" not in ours.config
    # The dict is what the model config reader expects.
    cfg = ModelConfig.from_hf(ours.config, ours.path)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)


@pytest.mark.slow
def test_tensors_own_their_memory(ours: GGUFModel) -> None:
    norm = "model.layers.0.input_layernorm.weight"  # F32: the reader hands out a memmap view
    with warnings.catch_warnings():
        # torch warns when it wraps a read-only numpy array (the file mapping).
        warnings.simplefilter("error")
        tensors = ours.iter_tensors()
        assert next(tensors)[0] == "model.embed_tokens.weight"  # file order, one at a time
        w = next(w for name, w in tensors if name == norm)
    first = w[0].item()
    w.add_(1.0)
    again = next(w for name, w in ours.iter_tensors() if name == norm)
    assert again[0].item() == first


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as e:
        read_gguf(tmp_path / "nope.gguf")
    assert e.value.path == str(tmp_path / "nope.gguf")


def test_text_file_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_text("just some text\n")
    with pytest.raises(ModelLoadError, match="not a GGUF") as e:
        read_gguf(path)
    assert e.value.path == str(path)


@pytest.mark.slow
@pytest.mark.parametrize("size", [1_000_000, 50_000_000])
def test_truncated_file(tmp_path: Path, size: int) -> None:
    src = require_smollm2_gguf()
    path = tmp_path / "cut.gguf"
    with src.open("rb") as f, path.open("wb") as out:
        out.write(f.read(size))
    with pytest.raises(ModelLoadError, match=r"truncated|corrupt") as e:
        read_gguf(path)
    assert str(path) in str(e.value)


def _write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> Path:
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), arch=arch)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture(tmp_path: Path) -> None:
    tensors = {"token_embd.weight": np.zeros((4, 4), np.float32)}
    path = _write_gguf(tmp_path / "f.gguf", "falcon", tensors)
    with pytest.raises(ModelLoadError, match="unsupported architecture 'falcon'"):
        read_gguf(path)


def test_unknown_tensor_name(tmp_path: Path) -> None:
    tensors = {"blk.0.mystery.weight": np.zeros(4, np.float32)}
    path = _write_gguf(tmp_path / "u.gguf", "llama", tensors)
    with pytest.raises(ModelLoadError, match=r"unknown tensor name 'blk\.0\.mystery\.weight'"):
        read_gguf(path)


@pytest.mark.slow
def test_copy_without_trailing_bytes_is_truncated(tmp_path: Path) -> None:
    """Cut inside the last tensor's data: the header parses, the size check must catch it."""
    src = require_smollm2_gguf()
    path = tmp_path / "short.gguf"
    shutil.copyfile(src, path)
    with path.open("r+b") as f:
        f.truncate(src.stat().st_size - 100)
    with pytest.raises(ModelLoadError, match=r"truncated|corrupt"):
        read_gguf(path)
