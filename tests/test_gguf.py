"""GGUF reader: weights and config checked against transformers' loader of the same file."""

from __future__ import annotations

import mmap
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import require_smollm2_gguf

from arle.errors import ModelLoadError
from arle.model.config import ModelConfig
from arle.model.gguf_io import _TORCH_DEQUANT, GGUFModel, _Header, read_gguf


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


def _write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray], *,
                raw_dtype: Any = None, metadata: Callable[[Any], None] | None = None,
                **writer: Any) -> Path:
    """A GGUF written by the `gguf` package: `metadata(writer)` adds keys first; quantized
    tensors come as [rows, bytes] with their `raw_dtype`; `writer`: GGUFWriter's options."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), arch=arch, **writer)
    if metadata is not None:
        metadata(w)
    for name, t in tensors.items():
        w.add_tensor(name, t, raw_dtype=raw_dtype)
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


def _mapped(path: Path) -> mmap.mmap:
    with path.open("rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def test_header_reads_what_the_gguf_package_writes(tmp_path: Path) -> None:
    """Our header parser against the `gguf` package's writer: every value type, arrays of
    numbers, strings and arrays, a non-default alignment, and each tensor's bytes where the
    package put them."""
    gguf = pytest.importorskip("gguf")
    t = gguf.GGUFValueType
    scalars = {"u8": (200, t.UINT8), "i8": (-5, t.INT8), "u16": (60000, t.UINT16),
               "i16": (-300, t.INT16), "u32": (4_000_000_000, t.UINT32), "i32": (-7, t.INT32),
               "f32": (0.5, t.FLOAT32), "yes": (True, t.BOOL), "no": (False, t.BOOL),
               "u64": (2**40, t.UINT64), "i64": (-(2**40), t.INT64), "f64": (0.1, t.FLOAT64),
               "text": ("héllo\n", t.STRING)}

    def metadata(w: Any) -> None:
        w.add_custom_alignment(64)
        for key, (value, kind) in scalars.items():
            w.add_key_value(f"x.{key}", value, kind)
        w.add_array("x.ints", [1, -2, 3])
        w.add_array("x.floats", [0.25, -1.5])
        w.add_array("x.words", ["a", "", "ünï"])
        w.add_array("x.nested", [[1, 2], [3]])

    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((3, 5)).astype(np.float32),
               "b": rng.standard_normal(7).astype(np.float16)}
    path = _write_gguf(tmp_path / "kv.gguf", "llama", tensors, metadata=metadata)

    fields, entries = _Header(_mapped(path)).read()
    for key, (value, _) in scalars.items():
        assert fields[f"x.{key}"] == value, key
    assert fields["general.alignment"] == 64 and fields["general.architecture"] == "llama"
    assert fields["x.ints"] == [1, -2, 3] and fields["x.floats"] == [0.25, -1.5]
    assert fields["x.words"] == ["a", "", "ünï"] and fields["x.nested"] == [[1, 2], [3]]
    data = path.read_bytes()
    for e, (name, x) in zip(entries, tensors.items(), strict=True):
        assert (e.name, e.shape, e.n_bytes) == (name, x.shape, x.nbytes)
        assert e.offset % 64 == 0
        assert np.array_equal(np.frombuffer(data, x.dtype, x.size, e.offset).reshape(x.shape), x)


def test_a_big_endian_file_is_named_so(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    path = _write_gguf(tmp_path / "be.gguf", "llama", {"token_embd.weight": np.zeros(4, np.float32)},
                       endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(ModelLoadError, match="corrupt GGUF file: a big-endian GGUF"):
        read_gguf(path)


def test_header_names_a_version_it_does_not_read(tmp_path: Path) -> None:
    src = _write_gguf(tmp_path / "v.gguf", "llama", {"token_embd.weight": np.zeros(4, np.float32)})
    data = bytearray(src.read_bytes())
    data[4:8] = (7).to_bytes(4, "little")
    src.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="corrupt GGUF file: GGUF version 7"):
        read_gguf(src)


@pytest.mark.parametrize("name", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_torch_dequantizers_match_the_gguf_package(name: str) -> None:
    """Each block format we dequantize in torch gives the `gguf` package's float32 values to
    the bit (the same arithmetic, in the same order), on values quantized by that package."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize

    qtype = gguf.GGMLQuantizationType[name]
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((6, 64)) * rng.uniform(0.01, 10, (6, 1))).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block
    packed = np.ascontiguousarray(quantize(x, qtype)).view(np.uint8)
    ours = _TORCH_DEQUANT[qtype](torch.from_numpy(packed.copy().reshape(-1))).reshape(x.shape)
    theirs = dequantize(packed.reshape(6, -1), qtype).reshape(x.shape)
    assert ours.dtype == torch.float32
    assert np.array_equal(ours.numpy(), theirs, equal_nan=True)
    assert not np.array_equal(theirs, np.zeros_like(theirs))


@pytest.mark.parametrize("name", ["Q4_1", "Q5_0", "Q5_1"])
def test_tensors_read_in_their_shape_whichever_dequantizes(tmp_path: Path, name: str) -> None:
    """A quantized tensor written by the `gguf` package comes back in its shape with the
    package's values, by a torch dequantizer (Q4_1) or by the package's own (Q5_0, Q5_1)."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize

    qtype = gguf.GGMLQuantizationType[name]
    x = np.random.default_rng(2).standard_normal((3, 96)).astype(np.float32)
    packed = quantize(x, qtype)
    path = _write_gguf(tmp_path / "q.gguf", "qwen3", {"token_embd.weight": packed},
                       raw_dtype=qtype)
    data = _mapped(path)
    _, tensors = _Header(data).read()
    model = GGUFModel(path, {"model_type": "qwen3"}, None,  # type: ignore[arg-type]
                      _data=data, _tensors=tensors, _names={"token_embd.weight": "embed"})
    [(hf_name, got)] = list(model.iter_tensors())
    assert hf_name == "embed" and got.shape == x.shape and got.dtype == torch.float32
    assert np.array_equal(got.numpy(), dequantize(packed, qtype))
