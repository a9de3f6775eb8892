"""Mixture-of-experts MLP (transformers' `qwen3_moe` router + experts): torch references, and
Triton kernels beside them.

`fused_moe(x, router_logits, w13, w2, top_k, renormalize, w13_scale, w2_scale, block)`:
- route: softmax of the logits in fp32 over the experts, the top_k by torch.topk, divided by
  their sum when `renormalize`, cast to the logits' dtype;
- each (token, chosen expert) pair: gate | up = x @ w13[e]^T (w13 is [gate; up], [E, 2I, H]),
  silu(gate) * up in x's dtype (HF's two roundings), @ w2[e]^T ([E, H, I]), times the
  pair's weight in x's dtype;
- a token's output: the sum over its top_k pairs in fp32 (in top-k order), in x's dtype, as
  transformers' default `grouped_mm` experts do.
FP8 weights (float8_e4m3fn, with per-(bn, bk)-block scales [E, ceil(N/bn), ceil(K/bk)]) are
dequantised to x's dtype first (kernels/fp8.py's rule).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from arle_kernels.fp8 import fp8_dequant_ref


def moe_route_ref(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """(weights [T, top_k] in the logits' dtype, expert ids [T, top_k] int64): transformers'
    Qwen3MoeTopKRouter after its linear."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def _expert_weight(w: Tensor, scale: Tensor | None, block: tuple[int, int] | None, e: int,
                   dtype: torch.dtype) -> Tensor:
    if scale is None:
        return w[e]
    assert block is not None, "FP8 expert weights need their block size"
    return fp8_dequant_ref(w[e], scale[e], block, dtype)


def moe_experts_ref(x: Tensor, weights: Tensor, ids: Tensor, w13: Tensor, w2: Tensor,
                    w13_scale: Tensor | None = None, w2_scale: Tensor | None = None,
                    block: tuple[int, int] | None = None) -> Tensor:
    """The experts of routed tokens: x [T, H], weights / ids [T, k] -> [T, H] in x's dtype."""
    t, k = ids.shape
    flat_ids = ids.reshape(-1)
    pair_out = x.new_zeros(t * k, x.shape[1])
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()  # NOTE: a host read
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        gate_up = F.linear(x[pairs // k], _expert_weight(w13, w13_scale, block, e, x.dtype))
        gate, up = gate_up.chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, _expert_weight(w2, w2_scale, block, e, x.dtype))
        pair_out[pairs] = h * weights.reshape(-1)[pairs, None].to(x.dtype)
    return pair_out.view(t, k, -1).float().sum(dim=1).to(x.dtype)


def fused_moe_ref(x: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor, top_k: int,
                  renormalize: bool, w13_scale: Tensor | None = None,
                  w2_scale: Tensor | None = None,
                  block: tuple[int, int] | None = None) -> Tensor:
    """The MoE MLP of x [T, H] given its router logits [T, E]: -> [T, H] in x's dtype."""
    weights, ids = moe_route_ref(router_logits, top_k, renormalize)
    return moe_experts_ref(x, weights, ids, w13, w2, w13_scale, w2_scale, block)
