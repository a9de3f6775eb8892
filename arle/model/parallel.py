"""Tensor-parallel-ready linear layers (column / row split). World size is 1 today.

Each parameter carries a `weight_loader(param, loaded, shard)` that copies this rank's slice of a
full checkpoint tensor, so multi-GPU needs a process group and an all-reduce, not a rewrite.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from arle_kernels.gemv import gemv, gemv_silu_mul, gemv_split_sums, use_gemv
from arle_kernels.split_sums import SplitSums


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:  # pragma: no cover - multi-GPU comes later
            torch.distributed.all_reduce(x)
        return x


SINGLE = TPGroup()


def _on_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """On CUDA with few rows (decode), our Triton GEMV where it streams the weights faster
    than cuBLAS (`use_gemv`)."""
    return x.is_cuda and use_gemv(x.shape[0], weight.shape[0], weight.shape[1])


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias): the GEMV where `_on_gemv`, else cuBLAS."""
    return gemv(x, weight, bias) if _on_gemv(x, weight) else F.linear(x, weight, bias)


def linear_unreduced(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | SplitSums:
    """`linear` (no bias) for a consumer that takes `SplitSums` (`ops.add_rms_norm`,
    `ops.qk_norm_rope_store_kv`): where the GEMV splits K, its partial sums are left for that
    consumer to add (no reduce kernel); otherwise y."""
    return gemv_split_sums(x, weight) if _on_gemv(x, weight) else F.linear(x, weight)


def linear_silu_and_mul(x: torch.Tensor, gate_up: torch.Tensor,
                        silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) for gate_up = [gate; up] (an MLP's projection and its
    activation). Where `linear` takes the GEMV, one kernel does both (the activation in its
    epilogue: no gate_up round trip, one launch less per layer); else linear + silu_and_mul."""
    if x.is_cuda and use_gemv(x.shape[0], gate_up.shape[0], gate_up.shape[1], glu=True):
        return gemv_silu_mul(x, gate_up)
    return silu_and_mul(linear(x, gate_up))


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


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split across ranks: the output stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TPGroup = SINGLE) -> None:
        super().__init__()
        assert out_features % tp.size == 0, "output features must divide by the TP size"
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features // tp.size, in_features),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features // tp.size), requires_grad=False)
                     if bias else None)
        for p in self.parameters():
            _set_loader(p, self.load_shard)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor,
                   shard: str | int | None = None) -> None:
        n = param.shape[0]
        _copy(param.data, loaded.narrow(0, self.tp.rank * n, n) if self.tp.size > 1 else loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def forward_unreduced(self, x: torch.Tensor) -> torch.Tensor | SplitSums:
        """forward, possibly as `SplitSums` for a consumer that takes them (no bias only)."""
        return linear_unreduced(x, self.weight) if self.bias is None else self(x)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one GEMM (gate+up, or q+k+v)."""

    def __init__(self, in_features: int, sizes: dict[str | int, int], bias: bool = False,
                 tp: TPGroup = SINGLE) -> None:
        self.shard_sizes = {k: v // tp.size for k, v in sizes.items()}
        super().__init__(in_features, sum(sizes.values()), bias, tp)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor,
                   shard: str | int | None = None) -> None:
        if shard is None:
            raise ValueError("merged projection needs a shard id")
        offset = 0
        for key, size in self.shard_sizes.items():
            if key == shard:
                part = loaded.narrow(0, self.tp.rank * size, size) if self.tp.size > 1 else loaded
                _copy(param.data.narrow(0, offset, size), part)
                return
            offset += size
        raise ValueError(f"unknown shard {shard!r}")


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split: each rank holds a partial sum, then all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TPGroup = SINGLE) -> None:
        super().__init__()
        assert in_features % tp.size == 0, "input features must divide by the TP size"
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp.size),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        _set_loader(self.weight, self.load_shard)
        if self.bias is not None:
            _set_loader(self.bias, load_whole)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor,
                   shard: str | int | None = None) -> None:
        n = param.shape[1]
        _copy(param.data, loaded.narrow(1, self.tp.rank * n, n) if self.tp.size > 1 else loaded)

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


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split by vocabulary range across ranks (world size 1: the whole table). A
    weight holder: the lookup is `ops.embed` (the model's forward), the projection `linear`."""

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        assert tp.size == 1, "vocab-parallel embedding with TP > 1 is not written yet"
        self.weight = nn.Parameter(torch.empty(vocab_size, dim), requires_grad=False)
        _set_loader(self.weight, load_whole)
