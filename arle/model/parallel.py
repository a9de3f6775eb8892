"""Tensor-parallel layers: column / row split linears, the vocab-parallel embedding, and
`TPGroup`, this rank's place in the group (size 1: one device, no collective is ever called).

Each parameter carries a `weight_loader(param, loaded, shard)` that copies this rank's slice of a
full checkpoint tensor: every rank reads the same checkpoint and keeps its slice.

Block-scaled FP8 weights are a property of a linear, not of a model: a linear built inside
`fp8_weights(block)` holds `weight` float8_e4m3fn and `weight_scale_inv` fp32 (one scale per
block of the weight; the checkpoint's names), and the device's products (`ops_for`,
arle_kernels/linear.py) run such a weight through the FP8 kernels. The loader decides which
linears stay FP8 (on CUDA) and `unquantize`s the rest; on the CPU it dequantises the
checkpoint instead (arle/model/loader.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from arle_kernels.linear_ref import attach_fp8_scale, fp8_scale_of
from arle_kernels.ops import ops_for
from arle_kernels.split_sums import SplitSums


@dataclass(frozen=True)
class TPGroup:
    """This rank among `size` tensor-parallel ranks. `group`: the torch.distributed process
    group of the model's collectives (NCCL on GPUs, gloo on CPUs; None: the default group).

    NOTE: size 1 short-circuits every method: one device runs no collective at all."""

    rank: int = 0
    size: int = 1
    group: Any = field(default=None, compare=False, repr=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (the partial sums of a row-parallel linear)."""
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank (in place)."""
        if self.size > 1:
            torch.distributed.broadcast(x, src=0, group=self.group)
        return x

    def all_min(self, value: int, device: torch.device) -> int:
        """The smallest of the ranks' values (one rank: its own)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def gather_columns(self, x: torch.Tensor, width: int) -> torch.Tensor | None:
        """Every rank's x [rows, n] side by side on rank 0, cut to `width` columns (the
        vocab-parallel logits, the padding past the vocabulary dropped); None on the others."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        torch.distributed.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1)[:, :width] if parts is not None else None


SINGLE = TPGroup()

FP8 = torch.float8_e4m3fn
#: (rows, columns) of the weight one scale covers, while `fp8_weights` is active
_FP8_BLOCK: tuple[int, int] | None = None


@contextmanager
def fp8_weights(block: tuple[int, int]) -> Iterator[None]:
    """Linears (and expert stacks) built inside hold FP8 weights with per-`block` scales."""
    global _FP8_BLOCK
    old, _FP8_BLOCK = _FP8_BLOCK, block
    try:
        yield
    finally:
        _FP8_BLOCK = old


def fp8_block() -> tuple[int, int] | None:
    """The block of the `fp8_weights` being built, or None (weights in the compute dtype)."""
    return _FP8_BLOCK


def scale_layout(sizes: list[int], block: tuple[int, int], whole: bool) -> tuple[int, int]:
    """The block of a weight whose rows are `sizes` shards stacked (merged projections, gate and
    up of an expert), for a rank holding `whole` shards (no TP split) or slices of them.

    A scale grid of `block` rows fits where every shard starts on a block boundary: all shards
    but the last (whole) are multiples of it. Else one scale row per weight row (block (1, bk)),
    each row taking its shard's block scale: exact as well, and the same kernels run it."""
    bn, bk = block
    inner = sizes if not whole else sizes[:-1]
    return block if all(n % bn == 0 for n in inner) else (1, bk)


def expand_scale_rows(scale: torch.Tensor, bn: int, rows: int) -> torch.Tensor:
    """Block scales [ceil(rows/bn), kb] as one scale row per weight row [rows, kb]."""
    return scale.repeat_interleave(bn, dim=-2).narrow(-2, 0, rows)


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias) by the kernels of x's device (`ops_for`: the one place that
    picks them)."""
    return ops_for(x.device).linear(x, weight, bias)


def linear_unreduced(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | SplitSums:
    """`linear` (no bias), possibly as split sums for a consumer that takes them."""
    return ops_for(x.device).linear_unreduced(x, weight)


WeightLoader = Callable[[nn.Parameter, torch.Tensor, "str | int | None"], None]


def _copy(dst: torch.Tensor, loaded: torch.Tensor) -> None:
    if dst.shape != loaded.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} does not fit {tuple(dst.shape)}")
    dst.copy_(loaded)


def load_whole(param: nn.Parameter, loaded: torch.Tensor, shard: str | int | None = None) -> None:
    """The loader of parameters every rank holds whole (norms, ...)."""
    _copy(param.data, loaded)


def _set_loader(param: nn.Parameter, loader: Callable[..., None]) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


@runtime_checkable
class HoldsFp8(Protocol):
    """A module whose weights may be FP8 (built inside `fp8_weights`)."""

    def quantized_weights(self) -> list[nn.Parameter]:
        """Its FP8 weights (each with its scales; none when it holds the compute dtype)."""
        ...

    def unquantize(self, dtype: torch.dtype) -> None:
        """Hold the weights in `dtype` instead (a checkpoint that stores them unquantized)."""
        ...


def new_weight(shape: tuple[int, ...], fp8: bool) -> nn.Parameter:
    """An empty weight: FP8, or the default (compute) dtype."""
    return nn.Parameter(torch.empty(shape, dtype=FP8) if fp8 else torch.empty(shape),
                        requires_grad=False)


def new_scale(shape: tuple[int, ...]) -> nn.Parameter:
    """An empty fp32 scale grid of an FP8 weight."""
    return nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Linear(nn.Module):
    """What column and row linears share: the weight [out, in] (FP8 with its scales when built
    inside `fp8_weights`) and how a checkpoint scale grid lands in this rank's."""

    weight_scale_inv: nn.Parameter | None

    def __init__(self, out_rows: int, in_cols: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        block = fp8_block()
        #: the checkpoint's block, None for a weight in the compute dtype
        self.ckpt_block = block
        self.weight = new_weight((out_rows, in_cols), block is not None)
        self.weight_scale_inv = None
        if block is not None:
            layout = self._scale_layout(block)
            self.weight_scale_inv = new_scale((_cdiv(out_rows, layout[0]),
                                               _cdiv(in_cols, layout[1])))
            _set_loader(self.weight_scale_inv, self.load_scale)
            attach_fp8_scale(self.weight, self.weight_scale_inv, layout)
        _set_loader(self.weight, self.load_shard)

    def _scale_layout(self, block: tuple[int, int]) -> tuple[int, int]:
        raise NotImplementedError

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor,
                   shard: str | int | None = None) -> None:
        raise NotImplementedError

    def load_scale(self, param: nn.Parameter, loaded: torch.Tensor,
                   shard: str | int | None = None) -> None:
        raise NotImplementedError

    def quantized_weights(self) -> list[nn.Parameter]:
        """The FP8 weights this module holds (each with its scales), for the loader."""
        return [self.weight] if self.weight.dtype == FP8 else []

    def unquantize(self, dtype: torch.dtype) -> None:
        """Hold the weight in `dtype` instead (a checkpoint that stores it unquantized)."""
        self.weight = nn.Parameter(torch.empty(self.weight.shape, dtype=dtype,
                                               device=self.weight.device), requires_grad=False)
        _set_loader(self.weight, self.load_shard)
        self.weight_scale_inv = None
        self.ckpt_block = None


class ColumnParallelLinear(_Linear):
    """y = x W^T with W's output rows split across ranks: the output stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TPGroup = SINGLE) -> None:
        assert out_features % tp.size == 0, "output features must divide by the TP size"
        super().__init__(out_features // tp.size, in_features, tp)
        self.bias = (nn.Parameter(torch.empty(out_features // tp.size), requires_grad=False)
                     if bias else None)
        if self.bias is not None:
            _set_loader(self.bias, self.load_shard)

    def _shard_rows(self, shard: str | int | None) -> tuple[int, int]:
        """(first row in this rank's weight, rows) of a checkpoint shard."""
        return 0, self.weight.shape[0]

    def _source_rows(self, shard: str | int | None) -> tuple[int, int]:
        """(first row of this rank's slice in the checkpoint shard, the shard's rows)."""
        n = self._shard_rows(shard)[1]
        return self.tp.rank * n, n * self.tp.size

    def _scale_layout(self, block: tuple[int, int]) -> tuple[int, int]:
        return scale_layout([self.weight.shape[0]], block, self.tp.size == 1)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor,
                   shard: str | int | None = None) -> None:
        n = param.shape[0]
        _copy(param.data, loaded.narrow(0, self.tp.rank * n, n) if self.tp.size > 1 else loaded)

    def load_scale(self, param: nn.Parameter, loaded: torch.Tensor,
                   shard: str | int | None = None) -> None:
        """A checkpoint shard's scale grid [ceil(rows/bn), ceil(in/bk)] into this rank's."""
        assert self.ckpt_block is not None
        bn = self.ckpt_block[0]
        offset, n = self._shard_rows(shard)
        start, whole = self._source_rows(shard)
        if loaded.shape != (_cdiv(whole, bn), param.shape[1]):
            raise ValueError(f"scale shape {tuple(loaded.shape)} does not fit {whole} rows of "
                             f"blocks {self.ckpt_block} ({param.shape[1]} column blocks)")
        if fp8_scale_of(self.weight)[1][0] == 1:  # one scale row per weight row
            part = expand_scale_rows(loaded, bn, whole).narrow(0, start, n)
            _copy(param.data.narrow(0, offset, n), part)
        else:
            if n != whole and (start % bn or n % bn):
                raise ValueError(f"a TP slice of {n} rows at row {start} is not a whole "
                                 f"number of {bn}-row FP8 blocks")
            part = loaded.narrow(0, start // bn, _cdiv(n, bn)) if n != whole else loaded
            _copy(param.data.narrow(0, offset // bn, part.shape[0]), part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def forward_unreduced(self, x: torch.Tensor) -> torch.Tensor | SplitSums:
        """forward, possibly as `SplitSums` for a consumer that takes them (no bias only)."""
        return linear_unreduced(x, self.weight) if self.bias is None else self(x)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one GEMM (gate+up, or q+k+v).

    replicas[key]: how many ranks hold the same slice of that projection (K and V of a model
    with fewer KV heads than ranks: each rank keeps one head, shared by tp / kv_heads ranks)."""

    def __init__(self, in_features: int, sizes: dict[str | int, int], bias: bool = False,
                 tp: TPGroup = SINGLE, replicas: Mapping[str | int, int] | None = None) -> None:
        rep = replicas or {}
        for key, size in sizes.items():
            assert (size * rep.get(key, 1)) % tp.size == 0, f"{key}: {size} rows do not split"
        #: this rank's rows of each projection, and where they start in the checkpoint's
        self.shard_sizes = {k: v * rep.get(k, 1) // tp.size for k, v in sizes.items()}
        self.source_starts = {k: tp.rank // rep.get(k, 1) * self.shard_sizes[k] for k in sizes}
        self.source_sizes = dict(sizes)
        super().__init__(in_features, sum(self.shard_sizes.values()) * tp.size, bias, tp)

    def _shard_rows(self, shard: str | int | None) -> tuple[int, int]:
        if shard is None:
            raise ValueError("merged projection needs a shard id")
        offset = 0
        for key, size in self.shard_sizes.items():
            if key == shard:
                return offset, size
            offset += size
        raise ValueError(f"unknown shard {shard!r}")

    def _source_rows(self, shard: str | int | None) -> tuple[int, int]:
        self._shard_rows(shard)  # checks the shard id
        assert shard is not None
        return self.source_starts[shard], self.source_sizes[shard]

    def _scale_layout(self, block: tuple[int, int]) -> tuple[int, int]:
        return scale_layout(list(self.shard_sizes.values()), block, self.tp.size == 1)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor,
                   shard: str | int | None = None) -> None:
        offset, size = self._shard_rows(shard)
        start, whole = self._source_rows(shard)
        part = loaded.narrow(0, start, size) if size != whole else loaded
        _copy(param.data.narrow(0, offset, size), part)


class RowParallelLinear(_Linear):
    """y = x W^T with W's input columns split: each rank holds a partial sum, then all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TPGroup = SINGLE) -> None:
        assert in_features % tp.size == 0, "input features must divide by the TP size"
        super().__init__(out_features, in_features // tp.size, tp)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        if self.bias is not None:
            _set_loader(self.bias, load_whole)

    def _scale_layout(self, block: tuple[int, int]) -> tuple[int, int]:
        k = self.weight.shape[1]
        if self.tp.size > 1 and k % block[1]:
            raise ValueError(f"an FP8 row-parallel split of {k} columns is not a whole number "
                             f"of {block[1]}-column blocks")
        return block

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor,
                   shard: str | int | None = None) -> None:
        n = param.shape[1]
        _copy(param.data, loaded.narrow(1, self.tp.rank * n, n) if self.tp.size > 1 else loaded)

    #: a scale grid splits by its column blocks as the weight by its columns
    load_scale = load_shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight)
        y = self.tp.all_reduce(y)
        # NOTE: the bias is added once, after the reduction, not on every rank.
        return y + self.bias if self.bias is not None else y

    def forward_unreduced(self, x: torch.Tensor) -> torch.Tensor | SplitSums:
        """forward, possibly as `SplitSums` for a consumer that takes them (one rank, no
        bias only: an all-reduce or a bias needs y itself)."""
        if self.bias is None and self.tp.size == 1:
            return linear_unreduced(x, self.weight)
        return self(x)


class ReplicatedLinear(nn.Module):
    """y = x W^T with W whole on every rank, never quantized: small projections whose output
    every rank needs (a MoE router's gate, the shared expert's gate)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        _set_loader(self.weight, load_whole)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by vocabulary range across ranks: rank r holds rows
    [r * n, (r + 1) * n), n = ceil(vocab / tp), zero rows past the vocabulary. A weight holder
    for the lm_head projection (`linear`, then `TPGroup.gather_columns`) and the lookup
    (`lookup`: each rank looks up the ids in its range, the others give zeros, all-reduced)."""

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.rows = _cdiv(vocab_size, tp.size)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, dim), requires_grad=False)
        _set_loader(self.weight, load_whole if tp.size == 1 else self.load_rows)

    def load_rows(self, param: nn.Parameter, loaded: torch.Tensor,
                  shard: str | int | None = None) -> None:
        """This rank's vocabulary range of the checkpoint's table (zeros past its end)."""
        if loaded.shape != (self.vocab_size, param.shape[1]):
            raise ValueError(f"shape {tuple(loaded.shape)} does not fit "
                             f"({self.vocab_size}, {param.shape[1]})")
        n = max(0, min(self.rows, self.vocab_size - self.start))
        param.data.zero_()
        param.data[:n].copy_(loaded.narrow(0, self.start, n))

    def lookup(self, embed: Callable[..., torch.Tensor], ids: torch.Tensor,
               source: torch.Tensor | None = None) -> torch.Tensor:
        """The embeddings of ids (or of source[ids]) with `embed` (the kernels' `ops.embed`)."""
        if self.tp.size == 1:
            return embed(self.weight, ids, source)
        if source is not None:
            ids = source[ids.long()]
        local = ids.long() - self.start
        outside = (local < 0) | (local >= self.rows)
        # NOTE: ids outside this rank's range read row 0 and are zeroed: the rank holding
        # them adds their row in the all-reduce
        y = embed(self.weight, local.masked_fill(outside, 0))
        y.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(y)
