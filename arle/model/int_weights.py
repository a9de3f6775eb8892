"""Which weights of a quantized checkpoint stay integer on the CPU, and how they load.

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

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import nn

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


def module_kind(kinds: list[Kind]) -> Kind:
    """The format of a module whose checkpoint tensors are `kinds`."""
    if not kinds or Kind.FLOAT in kinds:
        return Kind.FLOAT
    return Kind.INT4 if all(k == Kind.INT4 for k in kinds) else Kind.INT8


def hold(model: nn.Module, kinds: dict[str, Kind], group: int) -> dict[str, int]:
    """Make the modules whose checkpoint weights (`kinds`, by checkpoint name) are all
    quantized hold staged integer weights. -> how many modules of each kind."""
    names_of: dict[int, list[str]] = {}
    for name, (param, _) in model.weight_targets().items():  # type: ignore[operator]
        names_of.setdefault(id(param), []).append(name)
    counts = {k.value: 0 for k in Kind}
    for module in model.modules():
        if not isinstance(module, _Linear | VocabParallelEmbedding):
            continue
        kind = module_kind([kinds.get(n, Kind.FLOAT) for n in names_of.get(id(module.weight), [])])
        counts[kind.value] += 1
        if kind != Kind.FLOAT:
            _stage(module, kind, group)
    return counts


def _stage(module: _Linear | VocabParallelEmbedding, kind: Kind, group: int) -> None:
    old = module.weight
    n, k = old.shape
    dtype = torch.uint8 if kind == Kind.INT4 else torch.int8
    weight = nn.Parameter(torch.empty(n, k, dtype=dtype), requires_grad=False)
    weight.weight_loader = old.weight_loader  # type: ignore[attr-defined]
    cols = k // group if kind == Kind.INT4 else 1
    weight.staged = Staged(kind, torch.empty(n, cols),  # type: ignore[attr-defined]
                           torch.empty(n, cols) if kind == Kind.INT4 else None, group)
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
        held = Int4Groups(exact.q, _bf16(exact.scale), _bf16(exact.zero), exact.group)
        return Kind.INT4.value, _rel_error(held.dequantize(), exact.dequantize())
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
    """Every staged weight as the products run it (model dtype `dtype`)."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        staged: Staged | None = getattr(weight, "staged", None)
        if staged is None:
            continue
        assert isinstance(weight, torch.Tensor)
        q = weight.data
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
        if fmt is None:
            params += p.numel()
            continue
        extra = fmt.scale_zero if isinstance(fmt, Int4Format) else fmt.scale
        nbytes += extra.numel() * extra.element_size()
        params += fmt.n * p.shape[1] * 2 if isinstance(fmt, Int4Format) else p.numel()
    return params, nbytes
