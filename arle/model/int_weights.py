"""Which weights of a quantized checkpoint stay integer, and how they load: on the CPU (GGUF,
AWQ, GPTQ) through torch's packed kernels (arle_kernels.quant), on CUDA (AWQ, GPTQ: 4-bit
only) through our W4A16 kernels (arle_kernels.w4a16).

A linear (or the embedding) keeps the checkpoint's precision where every checkpoint tensor it
loads is quantized: all 4-bit -> int4 (`Int4Groups`, packed after load), else int8 with one
scale per row (5-8 bit formats, or a merged projection mixing 4- and 6-bit parts; not exact:
the load log says so). Any float part keeps the module in the compute dtype.

Loading is staged: a held module's weight is q [N, K] (uint8 for int4, int8 for int8) with its
scale (and zero) rows beside it (`Staged`), so the modules' own weight loaders (row slices of
merged projections) place every part; `pack` then makes the weights the products run.
NOTE: one device only (a TP split of the groups' columns is not done): the loader keeps
integer weights only at --tensor-parallel-size 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch import nn

from arle.errors import ModelLoadError
from arle.model.config import Int4Quant
from arle.model.parallel import VocabParallelEmbedding, _Linear
from arle_kernels.quant import (
    Int4Format,
    Int4Groups,
    Int8Format,
    attach_int,
    int_format,
    pack_int4,
    quantize_int8_rows,
)
from arle_kernels.w4a16_ref import attach_w4, nibbles, pack_w4, unpack_w4, w4_format


class Kind(Enum):
    INT4 = "int4"
    INT8 = "int8"
    FLOAT = "float"


@dataclass(frozen=True)
class Staged:
    """A held weight's parts while it loads (rows in the weight's order)."""

    kind: Kind
    scale: torch.Tensor  # int4: [N, K / group]; int8: [N, 1]
    zero: torch.Tensor | None  # int4 only
    group: int
    #: packed for the W4A16 kernels (CUDA), not torch's CPU kernels
    w4: bool = False


def module_kind(kinds: list[Kind]) -> Kind:
    """The format of a module whose checkpoint tensors are `kinds`."""
    if not kinds or Kind.FLOAT in kinds:
        return Kind.FLOAT
    return Kind.INT4 if all(k == Kind.INT4 for k in kinds) else Kind.INT8


def hold(model: nn.Module, kinds: dict[str, Kind], group: int, w4: bool = False
         ) -> dict[str, int]:
    """Make the modules whose checkpoint weights (`kinds`, by checkpoint name) are all
    quantized hold staged integer weights (w4: for the W4A16 kernels; 4-bit only). -> how
    many modules of each kind."""
    names_of = model.checkpoint_names()  # type: ignore[operator]
    counts = {k.value: 0 for k in Kind}
    for module in model.modules():
        if not isinstance(module, _Linear | VocabParallelEmbedding):
            continue
        kind = module_kind([kinds.get(n, Kind.FLOAT) for n in names_of.get(id(module.weight), [])])
        counts[kind.value] += 1
        if kind != Kind.FLOAT:
            assert not w4 or kind == Kind.INT4, "the W4A16 kernels take 4-bit weights only"
            _stage(module, kind, group, w4)
    return counts


def _stage(module: _Linear | VocabParallelEmbedding, kind: Kind, group: int, w4: bool) -> None:
    old = module.weight
    n, k = old.shape
    dev = old.device
    dtype = torch.uint8 if kind == Kind.INT4 else torch.int8
    weight = nn.Parameter(torch.empty(n, k, dtype=dtype, device=dev), requires_grad=False)
    weight.weight_loader = old.weight_loader  # type: ignore[attr-defined]
    cols = k // group if kind == Kind.INT4 else 1
    weight.staged = Staged(kind, torch.empty(n, cols, device=dev),  # type: ignore[attr-defined]
                           torch.empty(n, cols, device=dev) if kind == Kind.INT4 else None,
                           group, w4)
    module.weight = weight


#: a parameter's `weight_loader` (it is given the staged parts too: tensors of the same rows)
Loader = Callable[[Any, torch.Tensor, "str | int | None"], None]


def load_into(param: nn.Parameter, tensor: torch.Tensor | Int4Groups, loader: Loader,
              shard: str | int | None) -> tuple[str, float] | None:
    """A checkpoint tensor (float, or `Int4Groups`) into `param` by its loader: each part of a
    staged weight, or the tensor in the parameter's dtype. -> (kind, relative error of the
    weight as held) for a staged one, measured on a sample of rows."""
    staged: Staged | None = getattr(param, "staged", None)
    if staged is None:
        full = tensor.dequantize() if isinstance(tensor, Int4Groups) else tensor
        loader(param, full.to(param.dtype), shard)
        return None
    if staged.kind == Kind.INT4:
        if not isinstance(tensor, Int4Groups) or tensor.group != staged.group:
            raise ValueError("expected 4-bit groups of "
                             f"{staged.group} (got {type(tensor).__name__})")
        loader(param, tensor.q, shard)
        loader(staged.scale, tensor.scale, shard)
        assert staged.zero is not None
        loader(staged.zero, tensor.zero, shard)
        rows = _sample_rows(tensor.q.shape[0])
        exact = Int4Groups(tensor.q[rows], tensor.scale[rows], tensor.zero[rows], tensor.group)
        if staged.w4:  # W4A16: scales and zeros in fp16
            words = pack_w4(exact)
            w4 = w4_format(words)
            assert w4 is not None
            held = unpack_w4(words, w4)
        else:  # torch's CPU kernels: scales and zeros in bf16
            held = Int4Groups(exact.q, _bf16(exact.scale), _bf16(exact.zero),
                              exact.group).dequantize()
        return Kind.INT4.value, _rel_error(held, exact.dequantize())
    full = tensor.dequantize() if isinstance(tensor, Int4Groups) else tensor
    q = quantize_int8_rows(full)
    fmt = int_format(q)
    assert isinstance(fmt, Int8Format)
    loader(param, q, shard)
    loader(staged.scale, fmt.scale.float()[:, None], shard)
    rows = _sample_rows(q.shape[0])
    return Kind.INT8.value, _rel_error(q[rows].float() * fmt.scale[rows].float()[:, None],
                                       full[rows].float())


def _sample_rows(n: int) -> slice:
    """About 256 rows spread over n: enough for an error's size, cheap at load."""
    return slice(0, n, max(1, n // 256))


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def _rel_error(held: torch.Tensor, exact: torch.Tensor) -> float:
    """||held - exact|| / ||exact||."""
    return float((held - exact).norm() / exact.norm().clamp_min(1e-30))


def pack(model: nn.Module, dtype: torch.dtype) -> None:
    """Every staged weight as the products run it (model dtype `dtype`): the W4A16 layout
    where staged for it, else torch's packed CPU ones."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        staged: Staged | None = getattr(weight, "staged", None)
        if staged is None:
            continue
        assert isinstance(weight, torch.Tensor)
        q = weight.data
        if staged.w4:
            assert staged.zero is not None
            words = pack_w4(Int4Groups(q, staged.scale, staged.zero, staged.group))
            w4 = w4_format(words)
            assert w4 is not None
            module.weight = nn.Parameter(words, requires_grad=False)
            attach_w4(module.weight, w4)
            continue
        if staged.kind == Kind.INT4:
            assert staged.zero is not None
            packed = pack_int4(Int4Groups(q, staged.scale, staged.zero, staged.group), dtype)
            fmt: Int4Format | Int8Format | None = int_format(packed)
            assert fmt is not None
        else:
            packed, fmt = q, Int8Format(staged.scale[:, 0].to(torch.bfloat16), dtype)
        module.weight = nn.Parameter(packed, requires_grad=False)
        attach_int(module.weight, fmt)


def weight_stats(model: nn.Module) -> tuple[int, int]:
    """(parameters, bytes) of the model's weights as held: an integer weight counts its
    logical size and its bytes with its scales."""
    params = nbytes = 0
    for p in model.parameters():
        fmt = int_format(p)
        nbytes += p.numel() * p.element_size()
        if (w4 := w4_format(p)) is not None:
            params += p.shape[0] * w4.k
            nbytes += w4.scales.numel() * w4.scales.element_size()
            continue
        if fmt is None:
            params += p.numel()
            continue
        extra = fmt.scale_zero if isinstance(fmt, Int4Format) else fmt.scale
        nbytes += extra.numel() * extra.element_size()
        params += fmt.n * p.shape[1] * 2 if isinstance(fmt, Int4Format) else p.numel()
    return params, nbytes


# ---- 4-bit safetensors checkpoints: AWQ (GEMM layout) and GPTQ ------------------------------

#: AWQ packs output columns 8 to an int32 in this order: nibble i holds column _AWQ_ORDER[i]
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_INT4_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def _awq_columns(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's [rows, N / 8] int32 -> [rows, N] uint8, columns in order."""
    nib = nibbles(packed)
    cols = torch.empty_like(nib)
    cols[..., list(_AWQ_ORDER)] = nib
    return cols.flatten(-2)


def _groups_from(q_kn: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                 group: int) -> Int4Groups:
    """q [K, N], zeros and scales [K / group, N] (w = (q - zero) * scale, as both formats
    store them) -> `Int4Groups` [N, K]: scale s, zero (8 - z) s (exact in fp32)."""
    s = scales.float()
    return Int4Groups(q_kn.t().contiguous(), s.t().contiguous(),
                      ((8 - zeros.float()) * s).t().contiguous(), group)


def awq_groups(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               group: int) -> Int4Groups:
    """AWQ's GEMM layout: qweight [K, N / 8] and qzeros [K / group, N / 8] int32 (columns
    packed in `_AWQ_ORDER`), scales [K / group, N]."""
    return _groups_from(_awq_columns(qweight), _awq_columns(qzeros), scales, group)


def gptq_groups(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor, group: int, zero_offset: int) -> Int4Groups:
    """GPTQ: qweight [K / 8, N] int32 (8 consecutive input rows to an int32, in order),
    qzeros [K / group, N / 8] (columns in order; stored zero - `zero_offset`), scales
    [K / group, N]; g_idx [K] must be each row's own group (no act-order)."""
    k = qweight.shape[0] * 8
    if not torch.equal(g_idx.long(), torch.arange(k) // group):
        raise ValueError("g_idx is not row // group_size (an act-order checkpoint: "
                         "desc_act is not read)")
    q_kn = nibbles(qweight).permute(0, 2, 1).reshape(k, -1)
    zeros = nibbles(qzeros).flatten(-2).to(torch.int16) + zero_offset
    return _groups_from(q_kn, zeros, scales, group)


def int4_checkpoint_names(names: set[str]) -> dict[str, Kind]:
    """The `X.weight` of every linear a 4-bit checkpoint stores as `X.qweight`."""
    return {n.removesuffix(".qweight") + ".weight": Kind.INT4
            for n in names if n.endswith(".qweight")}


def int4_checkpoint_tensors(tensors: Iterator[tuple[str, Any, Path]], quant: Int4Quant,
                            origin: Path) -> Iterator[tuple[str, Any, Path]]:
    """A 4-bit checkpoint's tensors, each linear's parts (met in any order) as one `X.weight`
    `Int4Groups`; every other tensor as it is."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    need = {"qweight", "qzeros", "scales"} | ({"g_idx"} if quant.method == "gptq" else set())
    for name, tensor, source in tensors:
        base, _, part = name.rpartition(".")
        if part not in _INT4_PARTS:
            yield name, tensor, source
            continue
        got = parts.setdefault(base, {})
        got[part] = tensor
        if need <= set(got):
            del parts[base]
            yield f"{base}.weight", _groups_of(got, quant, source, base), source
    if parts:
        base, got = next(iter(parts.items()))
        raise ModelLoadError(origin, f"{base}: no {', '.join(sorted(need - set(got)))} "
                                           f"beside its {', '.join(sorted(got))}")


def _groups_of(got: dict[str, torch.Tensor], quant: Int4Quant, source: Path,
               base: str) -> Int4Groups:
    try:
        if quant.method == "awq":
            return awq_groups(got["qweight"], got["qzeros"], got["scales"], quant.group)
        return gptq_groups(got["qweight"], got["qzeros"], got["scales"], got["g_idx"],
                           quant.group, quant.zero_offset)
    except (ValueError, RuntimeError) as e:
        raise ModelLoadError(source, f"{base}: {e}") from None
