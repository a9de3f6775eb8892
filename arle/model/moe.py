"""Mixture-of-experts MLPs (Qwen3-MoE; Qwen3.5-MoE adds a shared expert).

A router (an unquantized linear) scores the experts per token; `ops.fused_moe` picks each
token's top-k, weighs them (softmax in fp32, renormalised where the config says) and sums their
SwiGLU MLPs. The experts' weights are stacked: `w13` [E, 2I, H] (each expert's gate rows, then
its up rows) and `w2` [E, H, I], loaded from checkpoints that store experts one by one
(`experts.{e}.gate_proj.weight`, ...) or, as transformers 5 may save them, as two 3-D tensors
(`experts.gate_up_proj`, `experts.down_proj`: `unfuse_experts`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from arle.model.config import ModelConfig
from arle.model.layers import MLP
from arle.model.parallel import (
    FP8,
    ReplicatedLinear,
    TPGroup,
    expand_scale_rows,
    fp8_block,
    new_scale,
    new_weight,
    scale_layout,
)
from arle_kernels.ops import Ops
from arle_kernels.split_sums import SplitSums

#: w13's shard of expert e: 2e (gate) or 2e + 1 (up); w2's: e
GATE, UP = 0, 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Experts(nn.Module):
    """E SwiGLU experts stacked: `w13` [E, 2I/tp, H], `w2` [E, H, I/tp] (this rank's slice of
    the intermediate size). Built inside `fp8_weights(block)`, both are FP8 with fp32 scales
    `w13_scale` / `w2_scale` and `block` the rows x columns each scale covers."""

    w13_scale: nn.Parameter | None
    w2_scale: nn.Parameter | None

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TPGroup) -> None:
        super().__init__()
        assert intermediate % tp.size == 0, "the expert size must divide by the TP size"
        self.tp = tp
        self.num_experts = num_experts
        self.inter = intermediate // tp.size
        ckpt = fp8_block()
        #: the checkpoint's block, None for weights in the compute dtype
        self.ckpt_block = ckpt
        fp8 = ckpt is not None
        self.w13 = new_weight((num_experts, 2 * self.inter, hidden), fp8)
        self.w2 = new_weight((num_experts, hidden, self.inter), fp8)
        self.w13_scale = self.w2_scale = None
        self.block: tuple[int, int] | None = None
        if ckpt is not None:
            if tp.size > 1 and self.inter % ckpt[1]:
                raise ValueError(f"an FP8 split of {self.inter} expert columns is not a whole "
                                 f"number of {ckpt[1]}-column blocks")
            # gate and up stacked: a grid of block rows only where gate ends on a block
            # boundary; else one scale row per weight row, for w2 too (one block for both)
            self.block = scale_layout([self.inter, self.inter], ckpt, tp.size == 1)
            bn, bk = self.block
            self.w13_scale = new_scale((num_experts, _cdiv(2 * self.inter, bn), _cdiv(hidden, bk)))
            self.w2_scale = new_scale((num_experts, _cdiv(hidden, bn), _cdiv(self.inter, bk)))
        for p in self.parameters():
            p.weight_loader = self.load_expert  # type: ignore[attr-defined]

    def hf_weights(self, prefix: str) -> dict[str, tuple[nn.Parameter, str | int | None]]:
        """Checkpoint names (experts one by one) -> (parameter, shard): see GATE / UP."""
        out: dict[str, tuple[nn.Parameter, str | int | None]] = {}
        for e in range(self.num_experts):
            for name, param, scale, shard in (
                    ("gate_proj", self.w13, self.w13_scale, 2 * e + GATE),
                    ("up_proj", self.w13, self.w13_scale, 2 * e + UP),
                    ("down_proj", self.w2, self.w2_scale, e)):
                out[f"{prefix}{e}.{name}.weight"] = (param, shard)
                if scale is not None:
                    out[f"{prefix}{e}.{name}.weight_scale_inv"] = (scale, shard)
        return out

    def load_expert(self, param: nn.Parameter, loaded: torch.Tensor,
                    shard: str | int | None = None) -> None:
        """One expert's gate / up / down weight (or its scale grid) into the stacks."""
        if not isinstance(shard, int):
            raise ValueError(f"expert weights need an int shard id, not {shard!r}")
        rank, n = self.tp.rank, self.inter
        if param is self.w13 or param is self.w13_scale:
            e, half = divmod(shard, 2)
            if param is self.w13:
                _copy(param.data[e].narrow(0, half * n, n), loaded.narrow(0, rank * n, n))
            else:
                self._load_w13_scale(param.data[e], loaded, half)
        elif param is self.w2:
            _copy(param.data[shard], loaded.narrow(1, rank * n, n))
        elif param is self.w2_scale:
            assert self.ckpt_block is not None and self.block is not None
            bn, bk = self.ckpt_block
            if self.block[0] == 1:
                loaded = expand_scale_rows(loaded, bn, self.w2.shape[1])
            cols = param.shape[2]
            _copy(param.data[shard], loaded.narrow(1, rank * n // bk, cols)
                  if self.tp.size > 1 else loaded)
        else:
            raise ValueError("not a parameter of these experts")

    def _load_w13_scale(self, dst: torch.Tensor, loaded: torch.Tensor, half: int) -> None:
        assert self.ckpt_block is not None and self.block is not None
        bn = self.ckpt_block[0]
        n, whole = self.inter, self.inter * self.tp.size
        if loaded.shape != (_cdiv(whole, bn), dst.shape[1]):
            raise ValueError(f"scale shape {tuple(loaded.shape)} does not fit {whole} rows of "
                             f"blocks {self.ckpt_block} ({dst.shape[1]} column blocks)")
        if self.block[0] == 1:
            part = expand_scale_rows(loaded, bn, whole).narrow(0, self.tp.rank * n, n)
            _copy(dst.narrow(0, half * n, n), part)
        else:
            rows = _cdiv(n, bn)
            part = loaded.narrow(0, self.tp.rank * rows, rows) if self.tp.size > 1 else loaded
            _copy(dst.narrow(0, half * rows, rows), part)

    def quantized_weights(self) -> list[nn.Parameter]:
        """The FP8 weights this module holds (each with its scales), for the loader."""
        return [self.w13, self.w2] if self.w13.dtype == FP8 else []

    def unquantize(self, dtype: torch.dtype) -> None:
        """Hold the experts in `dtype` instead (a checkpoint that stores them unquantized)."""
        for name in ("w13", "w2"):
            old = getattr(self, name)
            new = nn.Parameter(torch.empty(old.shape, dtype=dtype, device=old.device),
                               requires_grad=False)
            new.weight_loader = self.load_expert  # type: ignore[attr-defined]
            setattr(self, name, new)
        self.w13_scale = self.w2_scale = None
        self.ckpt_block = self.block = None


def _copy(dst: torch.Tensor, loaded: torch.Tensor) -> None:
    if dst.shape != loaded.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} does not fit {tuple(dst.shape)}")
    dst.copy_(loaded)


class SparseMoE(nn.Module):
    """A MoE layer's MLP: the router `gate`, the routed `experts` and, where the config has one,
    a `shared_expert` whose output is scaled by sigmoid(`shared_expert_gate`(x)) and added (as
    transformers' Qwen3_5MoeSparseMoeBlock). Parameter names are the checkpoint's."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None, "a MoE layer needs the config's moe fields"
        self.tp = tp
        self.top_k = moe.experts_per_token
        self.renormalize = moe.norm_topk_prob
        self.gate = ReplicatedLinear(cfg.hidden_size, moe.num_experts)
        self.experts = Experts(moe.num_experts, cfg.hidden_size, moe.intermediate_size, tp)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, tp, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1)

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor | SplitSums:
        """The MLP's output; on one rank without a shared expert it may be left as SplitSums
        (the top-k sum, for the next `add_rms_norm`)."""
        ex = self.experts
        args = (x, self.gate(x), ex.w13, ex.w2, self.top_k, self.renormalize, ex.w13_scale,
                ex.w2_scale, ex.block)
        if self.tp.size == 1 and self.shared_expert is None:
            return ops.fused_moe_unreduced(*args)
        y = self.tp.all_reduce(ops.fused_moe(*args))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            mlp = self.shared_expert
            shared = mlp.down_proj(ops.linear_silu_and_mul(x, mlp.gate_up_proj.weight))
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return y


#: transformers 5's stacked experts: `<layer>.mlp.experts.gate_up_proj` [E, 2I, H] (each
#: expert's gate rows, then its up rows) and `.down_proj` [E, H, I]
_FUSED = re.compile(r"(.*\.experts\.)(gate_up_proj|down_proj)$")


def unfuse_experts(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]] | None:
    """A stacked expert tensor as the one-by-one tensors it holds (views), or None if `name`
    is not one."""
    m = _FUSED.match(name)
    if m is None or tensor.dim() != 3:
        return None
    prefix, kind = m.groups()
    if tensor.dtype == FP8:
        raise ValueError(f"{name}: FP8 experts stacked in one tensor are not read (store them "
                         "one by one, with their weight_scale_inv)")

    def split() -> Iterator[tuple[str, torch.Tensor]]:
        for e, w in enumerate(tensor.unbind(0)):
            if kind == "down_proj":
                yield f"{prefix}{e}.down_proj.weight", w
            else:
                gate, up = w.chunk(2, dim=0)
                yield f"{prefix}{e}.gate_proj.weight", gate
                yield f"{prefix}{e}.up_proj.weight", up

    return split()
