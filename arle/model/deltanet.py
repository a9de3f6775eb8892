"""Qwen3.5's Gated DeltaNet layer (a linear-attention token mixer), as transformers'
`Qwen3_5GatedDeltaNet` computes it.

x -> in_proj_qkv (q | k | v, before the conv), in_proj_z (the output gate), in_proj_b / in_proj_a
(per value head: beta = sigmoid(b), the decay from a) -> the causal conv, SiLU, L2 norms, gates
and the delta rule over the request's state slot (`backend.gated_delta`: the executor owns the
slots) -> RMSNorm gated by silu(z) per value head (`ops.gated_rms_norm`) -> out_proj.

Weights as the checkpoints name them (`linear_attn.in_proj_qkv.weight`, `conv1d.weight`,
`dt_bias`, `A_log`, `norm.weight`, `out_proj.weight`); the four input projections run as two
GEMMs (`in_proj_qkvz`, `in_proj_ba`), and the conv's weight is kept as [channels, kernel].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from arle.model.config import ModelConfig
from arle.model.layers import AttentionBackend, HFShards, RMSNorm
from arle.model.parallel import MergedColumnParallelLinear, RowParallelLinear, TPGroup
from arle_kernels.split_sums import SplitSums


class QKVZLinear(MergedColumnParallelLinear):
    """in_proj_qkv and in_proj_z in one GEMM: [q | k | v | z] per row. The checkpoint's
    in_proj_qkv (shard "qkv") is q, k and v stacked: its loader splits it, so each part takes
    this rank's heads (tensor parallel) like a projection of its own."""

    def __init__(self, hidden: int, parts: dict[str | int, int], tp: TPGroup) -> None:
        self.qkv_parts = {k: parts[k] for k in ("q", "k", "v")}
        super().__init__(hidden, parts, tp=tp)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor,
                   shard: str | int | None = None) -> None:
        if shard != "qkv":
            return super().load_shard(param, loaded, shard)
        if loaded.shape[0] != sum(self.qkv_parts.values()):
            raise ValueError(f"in_proj_qkv has {loaded.shape[0]} rows, not "
                             f"{sum(self.qkv_parts.values())}")
        parts = loaded.split(list(self.qkv_parts.values()))
        for key, part in zip(self.qkv_parts, parts, strict=True):
            super().load_shard(param, part, key)

    def load_scale(self, param: nn.Parameter, loaded: torch.Tensor,
                   shard: str | int | None = None) -> None:
        """An FP8 in_proj_qkv's scale grid, split as its rows are (q and k must fill whole
        blocks: a block straddling two parts cannot be split)."""
        if shard != "qkv":
            return super().load_scale(param, loaded, shard)
        assert self.ckpt_block is not None
        bn = self.ckpt_block[0]
        sizes = list(self.qkv_parts.values())
        grid = [-(-n // bn) for n in sizes]
        if any(n % bn for n in sizes[:-1]) or loaded.dim() != 2 or loaded.shape[0] != sum(grid):
            raise ValueError(f"in_proj_qkv's scale grid {tuple(loaded.shape)} does not split "
                             f"into q, k, v blocks ({sizes} rows, blocks of {bn})")
        for key, part in zip(self.qkv_parts, loaded.split(grid), strict=True):
            super().load_scale(param, part, key)


class ConvWeight(nn.Module):
    """The depthwise causal conv's weight, [channels, kernel] (checkpoints: [channels, 1,
    kernel]); channels are q | k | v, each this rank's heads."""

    def __init__(self, parts: list[int], kernel: int, tp: TPGroup) -> None:
        super().__init__()
        self.parts, self.tp = parts, tp
        self.weight = nn.Parameter(torch.empty(sum(parts) // tp.size, kernel),
                                   requires_grad=False)
        self.weight.weight_loader = self.load  # type: ignore[attr-defined]

    def load(self, param: nn.Parameter, loaded: torch.Tensor,
             shard: str | int | None = None) -> None:
        w = loaded.squeeze(1) if loaded.dim() == 3 else loaded
        if w.shape != (sum(self.parts), param.shape[1]):
            raise ValueError(f"conv weight shape {tuple(loaded.shape)} does not fit "
                             f"({sum(self.parts)}, 1, {param.shape[1]})")
        mine = [p.chunk(self.tp.size)[self.tp.rank] for p in w.split(self.parts)]
        param.data.copy_(torch.cat(mine))


def _head_loader(tp: TPGroup) -> Callable[..., None]:
    """A per-value-head vector's loader: this rank's heads."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard: str | int | None = None) -> None:
        part = loaded.chunk(tp.size)[tp.rank] if tp.size > 1 else loaded
        if part.shape != param.shape:
            raise ValueError(f"shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
        param.data.copy_(part)
    return load


class GatedDeltaNet(nn.Module):
    HF_SHARDS: ClassVar[HFShards] = {
        "in_proj_qkvz": (("in_proj_qkv", "qkv"), ("in_proj_z", "z")),
        "in_proj_ba": (("in_proj_b", "b"), ("in_proj_a", "a")),
    }

    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup) -> None:
        super().__init__()
        la = cfg.linear_attention
        assert la is not None, "a Gated DeltaNet layer needs the linear_attention config"
        #: NOTE: the state slot's entry: the layer's index among the linear layers
        self.layer = cfg.linear_layers.index(layer)
        hk, hv, dk, dv = la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim
        assert hk % tp.size == 0 and hv % tp.size == 0, "heads must divide by the TP size"
        self.num_k_heads, self.num_v_heads = hk // tp.size, hv // tp.size
        self.head_v_dim = dv
        qkv: dict[str | int, int] = {"q": hk * dk, "k": hk * dk, "v": hv * dv}
        self.conv_dim = sum(qkv.values()) // tp.size  # this rank's channels
        self.in_proj_qkvz = QKVZLinear(cfg.hidden_size, {**qkv, "z": hv * dv}, tp)
        self.in_proj_ba = MergedColumnParallelLinear(cfg.hidden_size, {"b": hv, "a": hv}, tp=tp)
        self.conv1d = ConvWeight(list(qkv.values()), la.conv_kernel, tp)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads), requires_grad=False)
        for p in (self.dt_bias, self.A_log):
            p.weight_loader = _head_loader(tp)  # type: ignore[attr-defined]
        # NOTE: the gated norm's weight multiplies as it is (not zero-centred: HF's
        # Qwen3_5RMSNormGated), in the model's dtype
        self.norm = RMSNorm(dv, cfg.rms_norm_eps)
        self.out_proj = RowParallelLinear(hv * dv, cfg.hidden_size, tp=tp)

    def forward(self, x: torch.Tensor, backend: AttentionBackend) -> torch.Tensor | SplitSums:
        t = x.shape[0]
        qkvz = self.in_proj_qkvz(x)
        ba = self.in_proj_ba(x)
        hv, dv = self.num_v_heads, self.head_v_dim
        # NOTE: mixed_qkv, b and a are column slices of their GEMM's output (strided rows)
        core = backend.gated_delta(self.layer, qkvz[:, :self.conv_dim], ba[:, hv:], ba[:, :hv],
                                   self.conv1d.weight, self.A_log, self.dt_bias)
        z = qkvz[:, self.conv_dim:].reshape(t * hv, dv)  # (a copy: rows of another width)
        out = backend.ops.gated_rms_norm(core.reshape(t * hv, dv), z, self.norm.weight,
                                         self.norm.eps)
        return self.out_proj.forward_unreduced(out.view(t, hv * dv))
