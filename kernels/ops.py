"""The two implementations of a decoder layer's kernels, chosen once per executor.

`REFERENCE` is plain torch (the CPU executor, and what every kernel is tested against);
`triton_ops()` is the Triton kernels (the CUDA executor). Both compute the same function: the
model and its attention backend call `ops.<op>` and never know which they got.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from arle_kernels import decode_attention, deltanet, embed, extend_attention, fused, greedy, moe
from arle_kernels.split_sums import SplitSums


@dataclass(frozen=True)
class Ops:
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    #: (x, residual, weight, eps) -> (normed, x + residual); may update `residual` in place;
    #: x may be a linear layer's SplitSums (as qk_norm_rope_store_kv's qkv)
    add_rms_norm: Callable[[Tensor | SplitSums, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    silu_and_mul: Callable[[Tensor], Tensor]
    qk_norm_rope_store_kv: Callable[..., Tensor]
    #: paged attention of the decode rows (one query token each) and of the extend rows
    decode_attention: Callable[..., Tensor]
    extend_attention: Callable[..., Tensor]
    greedy_pick: greedy.GreedyPick
    #: (weight, ids, source) -> weight's rows ids (or source[ids]: a decode graph's ids are
    #: its rows' slots into the token buffer)
    embed: Callable[[Tensor, Tensor, Tensor | None], Tensor]
    #: (x, router_logits, w13, w2, top_k, renormalize, w13_scale, w2_scale, block) -> the MoE
    #: MLP's output (kernels/moe.py)
    fused_moe: Callable[..., Tensor]
    #: (mixed_qkv, a, b, conv_weight, a_log, dt_bias, conv_state, ssm_state, slots, seq_lens,
    #: cu_q_lens, num_decode, max_q_len, num_k_heads, page_size, boundary_conv, boundary_ssm)
    #: -> a Gated DeltaNet layer's [T, Hv, dv], states updated per slot (kernels/deltanet.py)
    gated_delta: Callable[..., Tensor]
    #: (x, z, weight, eps) -> Qwen3.5's RMSNorm gated by silu(z)
    gated_rms_norm: Callable[[Tensor, Tensor, Tensor, float], Tensor]


REFERENCE = Ops(
    rms_norm=fused.rms_norm_ref,
    add_rms_norm=fused.add_rms_norm_ref,
    silu_and_mul=fused.silu_and_mul_ref,
    qk_norm_rope_store_kv=fused.qk_norm_rope_store_kv_ref,
    decode_attention=decode_attention.decode_attention_ref,
    extend_attention=extend_attention.extend_attention_ref,
    greedy_pick=greedy.greedy_pick_ref,
    embed=embed.embed_ref,
    fused_moe=moe.fused_moe_ref,
    gated_delta=deltanet.gated_delta_ref,
    gated_rms_norm=deltanet.gated_rms_norm_ref,
)


def triton_ops() -> Ops:
    return Ops(
        rms_norm=fused.rms_norm,
        add_rms_norm=fused.add_rms_norm,
        silu_and_mul=fused.silu_and_mul,
        qk_norm_rope_store_kv=fused.qk_norm_rope_store_kv,
        decode_attention=decode_attention.decode_attention,
        extend_attention=extend_attention.extend_attention,
        greedy_pick=greedy.greedy_pick,
        embed=embed.embed,
        fused_moe=moe.fused_moe,
        gated_delta=deltanet.gated_delta,
        gated_rms_norm=deltanet.gated_rms_norm,
    )


def ops_for(device: torch.device) -> Ops:
    """The kernels a model on `device` runs: Triton's on CUDA, the torch references elsewhere."""
    return triton_ops() if device.type == "cuda" else REFERENCE
