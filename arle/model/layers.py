"""The layers every model family shares: the attention backend's interface, RMSNorm, full
attention (gated or not) and the dense MLP. `decoder.py` assembles them, with the Gated
DeltaNet mixer (`deltanet.py`) and the experts (`moe.py`), which build on them too.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch
from torch import nn

from arle.model.config import ModelConfig
from arle.model.parallel import MergedColumnParallelLinear, RowParallelLinear, TPGroup
from arle_kernels.ops import Ops
from arle_kernels.split_sums import SplitSums

#: merged projection -> the checkpoint's projections it holds, as (name, shard id)
HFShards = dict[str, tuple[tuple[str, "str | int"], ...]]


class AttentionBackend(Protocol):
    """One step's attention, set up by the executor: q/k norms and rotary at the step's
    positions, this step's K/V into the paged cache, then attention over each row's pages.
    `layer` is the layer's index among the full-attention layers (its KV cache entry)."""

    #: the model's kernels (a mixer's glue beside what the backend does: the gated norm)
    ops: Ops

    def attend(self, layer: int, qkv: torch.Tensor | SplitSums, q_norm: torch.Tensor | None,
               k_norm: torch.Tensor | None) -> torch.Tensor:
        """qkv [T, (H + 2 KVH) * D] (or its SplitSums) -> attention output [T, H * D]."""
        ...

    def gated_delta(self, layer: int, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    conv_weight: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
                    ) -> torch.Tensor:
        """A Gated DeltaNet layer's recurrence over this step's rows (`layer`: its index among
        the linear layers, its entry in each request's state slot): the causal conv of
        mixed_qkv [T, conv_dim] continuing the slot's conv state, SiLU, q/k L2-normalised,
        beta = sigmoid(b), g = -exp(a_log) * softplus(a + dt_bias) (a, b [T, value heads]),
        and the delta rule from the slot's recurrent state. Leaves both states at each row's
        end. -> [T, value heads * value head dim], in mixed_qkv's dtype."""
        ...


class RMSNorm(nn.Module):
    """A weight holder: the norm itself is `ops.rms_norm` / `ops.add_rms_norm` (fp32 statistics,
    scaled in the model dtype, as HF Llama/Qwen do).

    zero_centered (Qwen3.5): checkpoints store w and the norm scales by 1 + w in fp32 with one
    rounding at the end (HF's Qwen3_5RMSNorm). The weight holds 1 + w, made at load, in fp32:
    the ops scale by an fp32 weight in fp32 before they round (arle_kernels.fused)."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False) -> None:
        super().__init__()
        self.eps = eps
        dtype = torch.float32 if zero_centered else None  # None: the model's (default) dtype
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        if zero_centered:
            self.weight.weight_loader = load_one_plus  # type: ignore[attr-defined]


def load_one_plus(param: nn.Parameter, loaded: torch.Tensor, shard: str | int | None = None
                  ) -> None:
    """A zero-centred norm's checkpoint weight w in as 1 + w (fp32, as HF's `1.0 + w.float()`)."""
    if loaded.shape != param.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(1.0 + loaded.float())


def kv_replicas(num_kv_heads: int, tp: int) -> dict[str | int, int]:
    """Ranks sharing each KV head where there are fewer KV heads than ranks (each rank keeps
    one: `tp / kv_heads` ranks hold the same), for the k and v projections."""
    n = tp // num_kv_heads if num_kv_heads < tp else 1
    return {"k": n, "v": n}


class QKVGateLinear(MergedColumnParallelLinear):
    """Gated attention's q, k, v and output gate in one GEMM, each row [q | k | v | gate]: the
    backend reads q, k, v as one block of the row, the gate follows. The checkpoint's q_proj
    (shard "q") holds query and gate interleaved per head ([heads, 2, head_dim] rows, HF's
    `view(..., -1, head_dim * 2).chunk(2)`): its loader takes them apart."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool, tp: TPGroup) -> None:
        self.head_dim = head_dim
        super().__init__(hidden, {"q": num_heads * head_dim, "k": num_kv_heads * head_dim,
                                  "v": num_kv_heads * head_dim, "gate": num_heads * head_dim},
                         bias=bias, tp=tp, replicas=kv_replicas(num_kv_heads, tp.size))

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor,
                   shard: str | int | None = None) -> None:
        if shard != "q":
            return super().load_shard(param, loaded, shard)
        d = self.head_dim
        if loaded.shape[0] % (2 * d):
            raise ValueError(f"q_proj with {loaded.shape[0]} rows is not query | gate per head")
        pairs = loaded.reshape(-1, 2, d, *loaded.shape[1:])  # [heads, (query, gate), D, ...]
        for i, key in enumerate(("q", "gate")):
            super().load_shard(param, pairs[:, i].reshape(-1, *loaded.shape[1:]), key)

    def load_scale(self, param: nn.Parameter, loaded: torch.Tensor,
                   shard: str | int | None = None) -> None:
        """An FP8 q_proj's scale grid, taken apart as its rows are: whole blocks of a head's
        query rows, then of its gate rows (a block straddling the two cannot be split)."""
        if shard != "q":
            return super().load_scale(param, loaded, shard)
        assert self.ckpt_block is not None
        bn, d = self.ckpt_block[0], self.head_dim
        if d % bn or loaded.dim() != 2 or loaded.shape[0] % (2 * d // bn):
            raise ValueError(f"q_proj's scale grid {tuple(loaded.shape)} does not split into "
                             f"query and gate blocks (head dim {d}, blocks of {bn} rows)")
        pairs = loaded.reshape(-1, 2, d // bn, loaded.shape[1])
        for i, key in enumerate(("q", "gate")):
            super().load_scale(param, pairs[:, i].reshape(-1, loaded.shape[1]), key)


class Attention(nn.Module):
    """Full attention over the paged KV cache; with `attn_output_gate` (Qwen3.5) the query
    projection also gives a gate per head: o_proj(attention * sigmoid(gate))."""

    HF_SHARDS: ClassVar[HFShards] = {"qkv_proj": (("q_proj", "q"), ("k_proj", "k"),
                                                  ("v_proj", "v"))}

    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup) -> None:
        super().__init__()
        #: NOTE: the KV cache's entry: the layer's index among the full-attention layers
        self.layer = cfg.attention_layers.index(layer)
        self.num_heads = cfg.num_heads // tp.size
        self.num_kv_heads = max(1, cfg.num_kv_heads // tp.size)
        self.head_dim = cfg.head_dim
        d = cfg.head_dim
        self.gated = cfg.attn_output_gate
        self.qkv_width = (self.num_heads + 2 * self.num_kv_heads) * d  # this rank's q, k, v
        self.qkv_proj = (
            QKVGateLinear(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, d,
                          cfg.attention_bias, tp) if self.gated else
            MergedColumnParallelLinear(
                cfg.hidden_size,
                {"q": cfg.num_heads * d, "k": cfg.num_kv_heads * d, "v": cfg.num_kv_heads * d},
                bias=cfg.attention_bias, tp=tp, replicas=kv_replicas(cfg.num_kv_heads, tp.size)))
        # Llama/Qwen3 `attention_bias` covers o_proj too; Qwen2's q/k/v biases do not.
        o_bias = cfg.attention_bias and cfg.architecture != "Qwen2ForCausalLM"
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, bias=o_bias, tp=tp)
        zc = cfg.norm_zero_centered
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, zc) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, zc) if cfg.qk_norm else None

    def qk_norm_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The per-head q / k RMSNorm weights (Qwen3), or None, None."""
        return (self.q_norm.weight if self.q_norm is not None else None,
                self.k_norm.weight if self.k_norm is not None else None)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor | SplitSums, torch.Tensor | None]:
        """(q | k | v [T, qkv_width] for `backend.attend`, the output gate [T, H * D] or
        None). NOTE: ungated, qkv may stay split sums: the backend's q/k norm + rope adds them
        up (arle_kernels.split_sums); gated, both are column slices of one GEMM's output."""
        if not self.gated:
            return self.qkv_proj.forward_unreduced(x), None
        y = self.qkv_proj(x)
        return y[:, :self.qkv_width], y[:, self.qkv_width:]

    def forward(self, x: torch.Tensor, backend: AttentionBackend) -> torch.Tensor | SplitSums:
        # NOTE: the output may stay split sums: the next add_rms_norm adds them up
        qkv, gate = self.project(x)
        attn = backend.attend(self.layer, qkv, *self.qk_norm_weights())
        if gate is not None:  # in the model's dtype, as HF: sigmoid rounded, then the product
            attn = attn * torch.sigmoid(gate)
        return self.o_proj.forward_unreduced(attn)


class MLP(nn.Module):
    HF_SHARDS: ClassVar[HFShards] = {"gate_up_proj": (("gate_proj", 0), ("up_proj", 1))}

    def __init__(self, cfg: ModelConfig, tp: TPGroup, intermediate_size: int | None = None
                 ) -> None:
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, {0: inter, 1: inter}, tp=tp)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, tp=tp)

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor | SplitSums:
        return self.down_proj.forward_unreduced(
            ops.linear_silu_and_mul(x, self.gate_up_proj.weight))
