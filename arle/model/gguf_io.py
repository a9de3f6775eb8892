"""Read a GGUF file (llama.cpp's format) as an HF-style config, a tokenizer and float32 tensors.

The rest of arle only knows Hugging Face names and shapes, so everything GGUF-specific ends here:
metadata keys become a config.json dict, tensor names become HF names, quantized blocks are
dequantized, and the q/k row order llama.cpp's converter changed for its RoPE is put back.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField, ReaderTensor
from gguf.quants import dequantize

from arle.errors import ModelLoadError
from arle.model.tokenizer import Tokenizer

#: general.architecture -> (HF architecture, model_type).
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class GGUFModel:
    path: Path
    #: An HF config.json dict (what `ModelConfig.from_hf` reads).
    config: dict[str, Any]
    tokenizer: Tokenizer
    _reader: GGUFReader = field(repr=False)
    #: GGUF tensor name -> HF name, in file order.
    _names: dict[str, str] = field(repr=False)

    @property
    def tensor_names(self) -> list[str]:
        return list(self._names.values())

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 tensor in HF shape), one at a time: peak memory is one tensor."""
        permute_heads = {}
        if self.config["model_type"] == "llama":
            # NOTE: only llama GGUFs are permuted; llama.cpp's qwen converters keep HF's order.
            permute_heads = {"self_attn.q_proj": self.config["num_attention_heads"],
                             "self_attn.k_proj": self.config["num_key_value_heads"]}
        for t in self._reader.tensors:
            hf_name = self._names[t.name]
            w = self._dequantize(t)
            heads = next((n for k, n in permute_heads.items() if f".{k}." in hf_name), None)
            if heads is not None:
                w = _unpermute_rope_rows(w, heads)
            yield hf_name, w

    def _dequantize(self, t: ReaderTensor) -> torch.Tensor:
        shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists dims innermost first
        try:
            arr = dequantize(t.data, GGMLQuantizationType(t.tensor_type))
        except NotImplementedError:
            raise ModelLoadError(
                self.path, f"tensor {t.name}: unsupported quantization {t.tensor_type.name}"
            ) from None
        # F32 comes back as a view of the read-only memmap: copy it, torch wants writable memory.
        arr = np.require(arr.reshape(shape), dtype=np.float32, requirements=["C", "W", "O"])
        return torch.from_numpy(arr)


def read_gguf(path: str | os.PathLike[str]) -> GGUFModel:
    """Parse the header and metadata; tensors stay on disk until `iter_tensors`."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(path, "no such file")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(path, f"not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        reader = GGUFReader(path)
        fields = {name: _field_value(f) for name, f in reader.fields.items()}
    except Exception as e:  # the reader fails on short files with whatever numpy raises
        raise ModelLoadError(path, f"truncated or corrupt GGUF file: {e}") from None
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > path.stat().st_size:
        raise ModelLoadError(
            path, f"truncated or corrupt GGUF file: tensor data needs {end} bytes, "
            f"the file has {path.stat().st_size}"
        )

    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            path, f"unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})"
        )
    names = {t.name: _hf_name(t.name, path) for t in reader.tensors}
    tokenizer = Tokenizer.from_gguf_metadata(fields, path)
    config = _hf_config(fields, arch, reader.tensors, tokenizer, path)
    return GGUFModel(path=path, config=config, tokenizer=tokenizer, _reader=reader, _names=names)


def _hf_name(name: str, path: Path) -> str:
    base, _, kind = name.rpartition(".")
    if base in _GLOBAL_TENSORS and kind == "weight":
        return f"{_GLOBAL_TENSORS[base]}.weight"
    m = _LAYER_NAME.fullmatch(name)
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{m.group(3)}"
    if base == "rope_freqs":
        # Llama 3.1-style RoPE scaling is stored as per-frequency factors, not as config keys.
        raise ModelLoadError(path, "tensor rope_freqs.weight (per-frequency RoPE factors) "
                                   "is not supported")
    raise ModelLoadError(path, f"unknown tensor name {name!r}")


def _hf_config(fields: dict[str, Any], arch: str, tensors: list[ReaderTensor],
               tokenizer: Tokenizer, path: Path) -> dict[str, Any]:
    def get(key: str, default: Any = None, required: bool = False) -> Any:
        v = fields.get(f"{arch}.{key}", default)
        if v is None and required:
            raise ModelLoadError(path, f"GGUF metadata lacks {arch}.{key}")
        if isinstance(v, list):
            # Some files give a per-layer list; we run uniform layers only.
            if len(set(v)) != 1:
                raise ModelLoadError(path, f"{arch}.{key} varies across layers: not supported")
            v = v[0]
        return v

    by_name = {t.name: t for t in tensors}
    hidden = int(get("embedding_length", required=True))
    heads = int(get("attention.head_count", required=True))
    embed = by_name.get("token_embd.weight")
    vocab = (int(embed.shape[1]) if embed is not None
             else int(get("vocab_size") or tokenizer.vocab_size))
    hf_arch, model_type = ARCHITECTURES[arch]
    eos = sorted(tokenizer.eos_token_ids)
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", required=True)),
        "num_hidden_layers": int(get("block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv") or heads),
        "head_dim": int(get("attention.key_length") or hidden // heads),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in by_name,
        "attention_bias": any(n.endswith("attn_q.bias") for n in by_name),
        "bos_token_id": tokenizer.bos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
    }
    kind = get("rope.scaling.type")
    if kind not in (None, "none"):
        factor = _f32(get("rope.scaling.factor", 1.0))
        scaling: dict[str, Any] = {"rope_type": kind, "factor": factor}
        if (orig := get("rope.scaling.original_context_length")) is not None:
            scaling["original_max_position_embeddings"] = int(orig)
        config["rope_scaling"] = scaling
    return config


def _unpermute_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    HF keeps each head's rotary dims as [first half | second half]; llama.cpp's converter
    interleaves them as pairs (x0, x(d/2), x1, x(d/2+1), ...) for ggml's RoPE. Rows of head h:
    GGUF order [h, j, s] (j < d/2, s in {0, 1}) -> HF order [h, s, j].
    """
    rows = w.shape[0]
    half = rows // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _field_value(f: ReaderField) -> Any:
    """A metadata value as plain Python (str, int, float, bool, or a list of those)."""
    if not f.types:
        return None
    if f.types[0] == GGUFValueType.ARRAY:
        if len(f.types) > 2:
            return None  # arrays of arrays: no key we read has them
        if f.types[-1] == GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return np.concatenate([f.parts[i] for i in f.data]).tolist() if f.data else []
    if f.types[0] == GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    return f.parts[f.data[0]][0].item()


def _f32(x: Any) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999975e-06 -> 1e-05)."""
    return float(str(np.float32(x)))
