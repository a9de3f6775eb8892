"""The two implementations of a decoder layer's kernels, chosen once per executor.

`REFERENCE` is plain torch (the CPU executor, and what every kernel is tested against);
`triton_ops()` is the Triton kernels (the CUDA executor). Both compute the same function: the
model and its attention backend call `ops.<op>` and never know which they got.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from arle_kernels import (
    decode_attention_ref,
    deltanet_ref,
    embed_ref,
    extend_attention_ref,
    fused_ref,
    greedy_ref,
    linear_ref,
    moe_ref,
)
from arle_kernels.split_sums import SplitSums


class QKNormRopeStoreKV(Protocol):
    """-> q [T, H, D] normed and rotated; k (normed, rotated) and v written to their slots."""

    def __call__(self, qkv: Tensor | SplitSums, positions: Tensor, cos_sin: Tensor,
                 q_norm: Tensor | None, k_norm: Tensor | None, eps: float, num_heads: int,
                 num_kv_heads: int, k_cache: Tensor, v_cache: Tensor, kv_slots: Tensor,
                 k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> Tensor: ...


class DecodeAttention(Protocol):
    """Paged attention of the decode rows (one query token each): q [B, H, D] -> [B, H, D]."""

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                 seq_lens: Tensor, scale: float, num_splits: int, *,
                 k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                 out: Tensor | None = None) -> Tensor: ...


class ExtendAttention(Protocol):
    """Paged attention of the extend rows' new tokens: q [T, H, D] -> [T, H, D]."""

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                 cu_q_lens: Tensor, seq_lens: Tensor, scale: float, max_q_len: int, *,
                 k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                 out: Tensor | None = None, blocks: Tensor | None = None) -> Tensor: ...


class FusedMoE(Protocol):
    """The MoE MLP of x [T, H] given its router logits [T, E] -> [T, H] (kernels/moe.py)."""

    def __call__(self, x: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor, top_k: int,
                 renormalize: bool, w13_scale: Tensor | None = None,
                 w2_scale: Tensor | None = None,
                 block: tuple[int, int] | None = None) -> Tensor: ...


class GatedDelta(Protocol):
    """A Gated DeltaNet layer's [T, Hv, dv], its states updated per slot
    (kernels/deltanet.py)."""

    def __call__(self, mixed_qkv: Tensor, a: Tensor, b: Tensor, conv_weight: Tensor,
                 a_log: Tensor, dt_bias: Tensor, conv_state: Tensor, ssm_state: Tensor,
                 slots: Tensor, seq_lens: Tensor, cu_q_lens: Tensor, num_decode: int,
                 max_q_len: int, num_k_heads: int, page_size: int,
                 boundary_conv: Tensor | None = None,
                 boundary_ssm: Tensor | None = None, *,
                 keep: deltanet_ref.Keep | None = None) -> Tensor: ...


@dataclass(frozen=True)
class Ops:
    #: (x, weight, bias) -> x weight^T + bias, by the weight's format (kernels/linear.py)
    linear: Callable[[Tensor, Tensor, Tensor | None], Tensor]
    #: (x, weight) -> linear's y, or its split sums for a consumer that takes them
    linear_unreduced: Callable[[Tensor, Tensor], Tensor | SplitSums]
    #: (x, gate_up) -> silu(x gate^T) * (x up^T)
    linear_silu_and_mul: Callable[[Tensor, Tensor], Tensor]
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    #: (x, residual, weight, eps) -> (normed, x + residual); may update `residual` in place;
    #: x may be a linear layer's SplitSums (as qk_norm_rope_store_kv's qkv)
    add_rms_norm: Callable[[Tensor | SplitSums, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    silu_and_mul: Callable[[Tensor], Tensor]
    qk_norm_rope_store_kv: QKNormRopeStoreKV
    decode_attention: DecodeAttention
    extend_attention: ExtendAttention
    greedy_pick: greedy_ref.GreedyPick
    #: (weight, ids, source) -> weight's rows ids (or source[ids]: a decode graph's ids are
    #: its rows' slots into the token buffer)
    embed: Callable[[Tensor, Tensor, Tensor | None], Tensor]
    fused_moe: FusedMoE
    #: fused_moe's arguments -> its y, or its top-k sum left as SplitSums for add_rms_norm
    fused_moe_unreduced: Callable[..., Tensor | SplitSums]
    gated_delta: GatedDelta
    #: (x, z, weight, eps) -> Qwen3.5's RMSNorm gated by silu(z)
    gated_rms_norm: Callable[[Tensor, Tensor, Tensor, float], Tensor]


REFERENCE = Ops(
    linear=linear_ref.linear_ref,
    linear_unreduced=linear_ref.linear_ref,
    linear_silu_and_mul=linear_ref.linear_silu_and_mul_ref,
    rms_norm=fused_ref.rms_norm_ref,
    add_rms_norm=fused_ref.add_rms_norm_ref,
    silu_and_mul=fused_ref.silu_and_mul_ref,
    qk_norm_rope_store_kv=fused_ref.qk_norm_rope_store_kv_ref,
    decode_attention=decode_attention_ref.decode_attention_ref,
    extend_attention=extend_attention_ref.extend_attention_ref,
    greedy_pick=greedy_ref.greedy_pick_ref,
    embed=embed_ref.embed_ref,
    fused_moe=moe_ref.fused_moe_ref,
    fused_moe_unreduced=moe_ref.fused_moe_ref,
    gated_delta=deltanet_ref.gated_delta_ref,
    gated_rms_norm=deltanet_ref.gated_rms_norm_ref,
)


@functools.cache
def triton_ops() -> Ops:
    # NOTE: imported here, not at the top: the CPU executor never loads Triton (its import
    # alone is ~70 MB of resident memory)
    from arle_kernels import (
        decode_attention,
        deltanet,
        embed,
        extend_attention,
        fused,
        greedy,
        linear,
        moe,
    )

    return Ops(
        linear=linear.linear,
        linear_unreduced=linear.linear_unreduced,
        linear_silu_and_mul=linear.linear_silu_and_mul,
        rms_norm=fused.rms_norm,
        add_rms_norm=fused.add_rms_norm,
        silu_and_mul=fused.silu_and_mul,
        qk_norm_rope_store_kv=fused.qk_norm_rope_store_kv,
        decode_attention=decode_attention.decode_attention,
        extend_attention=extend_attention.extend_attention,
        greedy_pick=greedy.greedy_pick,
        embed=embed.embed,
        fused_moe=moe.fused_moe,
        fused_moe_unreduced=moe.fused_moe_unreduced,
        gated_delta=deltanet.gated_delta,
        gated_rms_norm=deltanet.gated_rms_norm,
    )


def ops_for(device: torch.device) -> Ops:
    """The kernels a model on `device` runs: Triton's on CUDA, the torch references elsewhere."""
    return triton_ops() if device.type == "cuda" else REFERENCE
