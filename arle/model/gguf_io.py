"""Read a GGUF file (llama.cpp's format) as an HF-style config, a tokenizer and float32 tensors.

The rest of arle only knows Hugging Face names and shapes, so everything GGUF-specific ends here:
metadata keys become a config.json dict, tensor names become HF names, quantized blocks are
dequantized, and the q/k row order llama.cpp's converter changed for its RoPE is put back.

The header is parsed here (`_Header`), not by the `gguf` package's reader: that one builds a
numpy view of every part of every field, seconds of every start-up for the default model's
~100k tokenizer strings. The `gguf` package still names the types and sizes,
and dequantizes the block formats that have no torch version here (`_TORCH_DEQUANT`).
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize, quant_shape_to_byte_shape

from arle.errors import ModelLoadError
from arle.model.int_weights import Kind
from arle.model.tokenizer import Tokenizer
from arle_kernels.quant import Int4Groups

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
class _Tensor:
    """A tensor's entry in the header: where its bytes lie in the file and what they hold."""

    name: str
    dims: tuple[int, ...]  # ggml's order: innermost first
    qtype: GGMLQuantizationType
    offset: int  # from the start of the file
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """torch's (and HF's) order: outermost first."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GGUFModel:
    path: Path
    #: An HF config.json dict (what `ModelConfig.from_hf` reads).
    config: dict[str, Any]
    tokenizer: Tokenizer
    _data: mmap.mmap = field(repr=False)
    _tensors: list[_Tensor] = field(repr=False)
    #: GGUF tensor name -> HF name, in file order.
    _names: dict[str, str] = field(repr=False)

    @property
    def tensor_names(self) -> list[str]:
        return list(self._names.values())

    def kinds(self) -> dict[str, Kind]:
        """HF name -> what its tensor stays as where integer weights are kept."""
        return {self._names[t.name]: _KINDS.get(t.qtype, Kind.FLOAT) for t in self._tensors}

    def iter_tensors(self, int4: bool = False
                     ) -> Iterator[tuple[str, torch.Tensor | Int4Groups]]:
        """(HF name, float32 tensor in HF shape), one at a time: peak memory is one tensor.
        With `int4`, the 4-bit formats come as their `Int4Groups` (group 32) instead."""
        permute_heads = {}
        if self.config["model_type"] == "llama":
            # NOTE: only llama GGUFs are permuted; llama.cpp's qwen converters keep HF's order.
            permute_heads = {"self_attn.q_proj": self.config["num_attention_heads"],
                             "self_attn.k_proj": self.config["num_key_value_heads"]}
        for t in self._tensors:
            hf_name = self._names[t.name]
            groups = _INT4_GROUPS.get(t.qtype) if int4 else None
            w: torch.Tensor | Int4Groups
            w = self._dequantize(t) if groups is None else groups(self._raw(t), t.shape)
            heads = next((n for k, n in permute_heads.items() if f".{k}." in hf_name), None)
            if heads is not None:
                w = _unpermute_rope_rows(w, heads)
            yield hf_name, w

    def _raw(self, t: _Tensor) -> torch.Tensor:
        """The tensor's bytes (a copy: the tensor owns its memory, the mapping stays
        read-only)."""
        return torch.from_numpy(np.frombuffer(self._data, np.uint8, t.n_bytes, t.offset).copy())

    def _dequantize(self, t: _Tensor) -> torch.Tensor:
        fast = _TORCH_DEQUANT.get(t.qtype)
        if fast is not None:
            return fast(self._raw(t)).reshape(t.shape).contiguous()
        raw = np.frombuffer(self._data, np.uint8, t.n_bytes, t.offset)
        try:
            arr = dequantize(raw.reshape(quant_shape_to_byte_shape(t.shape, t.qtype)), t.qtype)
        except NotImplementedError:
            raise ModelLoadError(
                self.path, f"tensor {t.name}: unsupported quantization {t.qtype.name}"
            ) from None
        arr = np.require(arr.reshape(t.shape), dtype=np.float32, requirements=["C", "W", "O"])
        return torch.from_numpy(arr)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    """Blocks of 32: an fp16 scale d, 32 int8 q; x = q * d."""
    blocks = b.view(-1, 34)
    d = blocks[:, :2].view(torch.float16).float()
    return blocks[:, 2:].view(torch.int8).float() * d


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes a block -> 32 values 0..15: the low nibbles are the block's first 16."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    """Blocks of 32: an fp16 scale d, 16 bytes of nibbles q; x = d * (q - 8)."""
    blocks = b.view(-1, 18)
    d = blocks[:, :2].view(torch.float16).float()
    return d * (_nibbles(blocks[:, 2:]) - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    """Blocks of 32: fp16 d and m, 16 bytes of nibbles q; x = d * q + m (two roundings)."""
    blocks = b.view(-1, 20)
    d = blocks[:, :2].view(torch.float16).float()
    m = blocks[:, 2:4].view(torch.float16).float()
    return (d * _nibbles(blocks[:, 4:])).add_(m)


#: Formats dequantized in torch, over the whole tensor at once, with the `gguf` package's
#: arithmetic (its results to the bit: tests/test_gguf.py); the others go through that package.
_TORCH_DEQUANT: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.F32: lambda b: b.view(torch.float32),
    GGMLQuantizationType.F16: lambda b: b.view(torch.float16).float(),
    GGMLQuantizationType.BF16: lambda b: b.view(torch.bfloat16).float(),
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
}


def _int4_q4_0(b: torch.Tensor, shape: tuple[int, ...]) -> Int4Groups:
    """Q4_0 as group-32 int4: scale d, zero 0 (exact)."""
    blocks = b.view(-1, 18)
    d = blocks[:, :2].view(torch.float16).float()[:, 0]
    return _groups(_nibbles(blocks[:, 2:]), d, torch.zeros_like(d), shape)


def _int4_q4_1(b: torch.Tensor, shape: tuple[int, ...]) -> Int4Groups:
    """Q4_1 (x = d q + m) as group-32 int4: scale d, zero m + 8 d (exact in fp32, which holds
    the sum of two fp16 values whose exponents differ by 13 or less)."""
    blocks = b.view(-1, 20)
    d = blocks[:, :2].view(torch.float16).float()[:, 0]
    m = blocks[:, 2:4].view(torch.float16).float()[:, 0]
    return _groups(_nibbles(blocks[:, 4:]), d, m + 8 * d, shape)


def _int4_q4_k(b: torch.Tensor, shape: tuple[int, ...]) -> Int4Groups:
    """Q4_K as group-32 int4. A 256-weight super-block: fp16 d and dmin, 12 bytes of 6-bit
    (scale, min) pairs for its 8 sub-blocks, 128 bytes of nibbles (32-byte chunk c: low
    nibbles are sub-block 2c, high ones 2c + 1); x = d sc q - dmin mn, so scale d sc, zero
    8 d sc - dmin mn."""
    blocks = b.view(-1, 144)
    d = blocks[:, 0:2].view(torch.float16).float()
    dmin = blocks[:, 2:4].view(torch.float16).float()
    s = blocks[:, 4:16].long()
    sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], dim=1)
    mn = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=1)
    qs = blocks[:, 16:].reshape(-1, 4, 32)
    q = torch.stack([qs & 15, qs >> 4], dim=2).reshape(-1, 32)  # sub-blocks in order
    scale = (d * sc.float()).reshape(-1)
    return _groups(q, scale, 8 * scale - (dmin * mn.float()).reshape(-1), shape)


def _groups(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
            shape: tuple[int, ...]) -> Int4Groups:
    """Blocks of 32 (q [B, 32] uint8 or float, scale and zero [B]) as an [N, K] weight's."""
    n, k = shape
    return Int4Groups(q.to(torch.uint8).reshape(n, k), scale.reshape(n, k // 32),
                      zero.reshape(n, k // 32), 32)


#: The 4-bit formats kept as group-32 int4 (`GGUFModel.iter_tensors(int4=True)`).
_INT4_GROUPS: dict[GGMLQuantizationType,
                   Callable[[torch.Tensor, tuple[int, ...]], Int4Groups]] = {
    GGMLQuantizationType.Q4_0: _int4_q4_0,
    GGMLQuantizationType.Q4_1: _int4_q4_1,
    GGMLQuantizationType.Q4_K: _int4_q4_k,
}
#: What each quantized format stays as where integer weights are kept: 4-bit as int4, 5-8
#: bit as int8 per row (requantized: not exact), the rest (floats, 2-3 bit) as floats.
_KINDS = {**dict.fromkeys(_INT4_GROUPS, Kind.INT4),
          **dict.fromkeys([GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
                           GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
                           GGMLQuantizationType.Q8_0], Kind.INT8)}


def read_gguf(path: str | os.PathLike[str]) -> GGUFModel:
    """Parse the header and metadata; tensors stay on disk until `iter_tensors`."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(path, "no such file")
    with path.open("rb") as f:
        magic = f.read(4)
        if magic != b"GGUF":
            raise ModelLoadError(path, f"not a GGUF file (starts with {magic!r}, expected "
                                       "b'GGUF')")
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        fields, tensors = _Header(data).read()
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise ModelLoadError(path, f"truncated or corrupt GGUF file: {e}") from None
    end = max((t.offset + t.n_bytes for t in tensors), default=0)
    if end > len(data):
        raise ModelLoadError(
            path, f"truncated or corrupt GGUF file: tensor data needs {end} bytes, "
            f"the file has {len(data)}"
        )

    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            path, f"unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})"
        )
    names = {t.name: _hf_name(t.name, path) for t in tensors}
    tokenizer = Tokenizer.from_gguf_metadata(fields, path)
    config = _hf_config(fields, arch, tensors, tokenizer, path)
    return GGUFModel(path=path, config=config, tokenizer=tokenizer, _data=data,
                     _tensors=tensors, _names=names)


#: struct formats of the scalar value types (little-endian, as GGUF is)
_SCALARS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
            GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
            GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
            GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}
_U64 = struct.Struct("<Q")


class _Header:
    """A cursor over a GGUF file's header (versions 2 and 3): the metadata as plain Python
    (str, int, float, bool, or lists of those) and the tensors' entries. Raises struct.error,
    ValueError or UnicodeDecodeError where the bytes run out or make no sense."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.pos = data, 4  # past the magic

    def read(self) -> tuple[dict[str, Any], list[_Tensor]]:
        version = self._scalar("<I")
        if version not in (2, 3):
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            raise ValueError("a big-endian GGUF (not supported: convert it little-endian)"
                             if swapped in (2, 3) else
                             f"GGUF version {version} (supported: 2 and 3)")
        n_tensors, n_fields = self._scalar("<Q"), self._scalar("<Q")
        fields = {}
        for _ in range(n_fields):
            key = self._string()
            fields[key] = self._value(GGUFValueType(self._scalar("<I")))
        entries = []
        for _ in range(n_tensors):
            name = self._string()
            dims = tuple(self._scalar("<Q") for _ in range(self._scalar("<I")))
            entries.append((name, dims, GGMLQuantizationType(self._scalar("<I")),
                            self._scalar("<Q")))
        align = int(fields.get("general.alignment", 32))
        start = -(-self.pos // align) * align  # the data section, after the header
        tensors = []
        for name, dims, qtype, offset in entries:
            block, size = GGML_QUANT_SIZES[qtype]
            n = math.prod(dims)  # exact: bad dims make a size the file check then refuses
            if n % block:
                raise ValueError(f"tensor {name}: {n} values in blocks of {block}")
            tensors.append(_Tensor(name, dims, qtype, start + offset, n // block * size))
        if len({t.name for t in tensors}) != len(tensors):
            raise ValueError("a tensor name appears twice")
        return fields, tensors

    def _scalar(self, fmt: str) -> Any:
        (v,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        return self._strings(1)[0]

    def _strings(self, n: int) -> list[str]:
        data, pos, out = self.data, self.pos, []
        for _ in range(n):
            (size,) = _U64.unpack_from(data, pos)
            pos += 8
            out.append(data[pos:pos + size].decode("utf-8"))
            pos += size
        if pos > len(data):
            raise ValueError("a string runs past the end of the file")
        self.pos = pos
        return out

    def _value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind != GGUFValueType.ARRAY:
            return self._scalar(_SCALARS[kind])
        item, n = GGUFValueType(self._scalar("<I")), self._scalar("<Q")
        if item == GGUFValueType.STRING:
            return self._strings(n)
        if item == GGUFValueType.ARRAY:
            return [self._value(item) for _ in range(n)]
        dtype = np.dtype(_SCALARS[item].replace("?", "b1"))
        values = np.frombuffer(self.data, dtype, n, self.pos)  # raises past the end
        self.pos += n * dtype.itemsize
        return values.tolist()


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


def _hf_config(fields: dict[str, Any], arch: str, tensors: list[_Tensor],
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
    vocab = (int(embed.dims[1]) if embed is not None
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


@overload
def _unpermute_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor: ...
@overload
def _unpermute_rope_rows(w: Int4Groups, heads: int) -> Int4Groups: ...
def _unpermute_rope_rows(w: torch.Tensor | Int4Groups, heads: int) -> torch.Tensor | Int4Groups:
    """Undo llama.cpp's q/k row permutation.

    HF keeps each head's rotary dims as [first half | second half]; llama.cpp's converter
    interleaves them as pairs (x0, x(d/2), x1, x(d/2+1), ...) for ggml's RoPE. Rows of head h:
    GGUF order [h, j, s] (j < d/2, s in {0, 1}) -> HF order [h, s, j].
    """
    if isinstance(w, Int4Groups):
        return Int4Groups(_unpermute_rope_rows(w.q, heads), _unpermute_rope_rows(w.scale, heads),
                          _unpermute_rope_rows(w.zero, heads), w.group)
    rows = w.shape[0]
    half = rows // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _f32(x: Any) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999975e-06 -> 1e-05)."""
    return float(str(np.float32(x)))
