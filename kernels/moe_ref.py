"""The MoE MLP (routing, experts, bf16 or block FP8) in plain torch: the CPU executor's,
and the references kernels/moe.py's kernels are tested against."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from arle_kernels.fp8_ref import fp8_dequant_groups_ref, fp8_dequant_ref, quantize_fp8_groups_ref

#: (x [M, K], group) -> (FP8 values, scales [M, ceil(K/group)]): kernels/fp8.py's activation
#: quantisation, the ref's or the kernel's
Quantize = Callable[[Tensor, int], tuple[Tensor, Tensor]]


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
    return pair_out.view(t, k, x.shape[1]).float().sum(dim=1).to(x.dtype)


def fused_moe_ref(x: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor, top_k: int,
                  renormalize: bool, w13_scale: Tensor | None = None,
                  w2_scale: Tensor | None = None,
                  block: tuple[int, int] | None = None) -> Tensor:
    """The MoE MLP of x [T, H] given its router logits [T, E]: -> [T, H] in x's dtype."""
    weights, ids = moe_route_ref(router_logits, top_k, renormalize)
    return moe_experts_ref(x, weights, ids, w13, w2, w13_scale, w2_scale, block)


def moe_experts_w8a8_ref(x: Tensor, weights: Tensor, ids: Tensor, w13: Tensor, w2: Tensor,
                         w13_scale: Tensor, w2_scale: Tensor, block: tuple[int, int],
                         quantize: Quantize = quantize_fp8_groups_ref) -> Tensor:
    """`moe_experts_ref` as the W8A8 kernels compute it: x and the intermediate quantised per
    row and bk-column group by `quantize` (kernels/fp8.py), each projection summed in fp32 and
    rounded once to x's dtype."""
    t, k = ids.shape
    gk = block[1]
    flat = ids.reshape(-1)
    xq = fp8_dequant_groups_ref(*quantize(x, gk), gk)
    h = x.new_zeros(t * k, w2.shape[2])
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero()[:, 0]
        w = fp8_dequant_ref(w13[e], w13_scale[e], block)
        gate, up = F.linear(xq[pairs // k], w).to(x.dtype).chunk(2, dim=-1)
        h[pairs] = F.silu(gate) * up
    hq = fp8_dequant_groups_ref(*quantize(h, gk), gk)
    pair_out = x.new_zeros(t * k, x.shape[1])
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero()[:, 0]
        out = F.linear(hq[pairs], fp8_dequant_ref(w2[e], w2_scale[e], block)).to(x.dtype)
        pair_out[pairs] = out * weights.reshape(-1)[pairs, None].to(x.dtype)
    return pair_out.view(t, k, x.shape[1]).float().sum(dim=1).to(x.dtype)


def moe_align_ref(ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """The (token, expert) pairs grouped by expert, each group padded to a multiple of block_m:
    (sorted pair ids [max_blocks * block_m] int32, each block's expert [max_blocks] int32).

    Pair p = t * top_k + j (ids flattened). Within an expert, pairs in ascending order;
    padding slots hold T * top_k (no pair); blocks past the last group hold expert -1 (the
    kernel leaves their slots unwritten: nothing reads them).
    max_blocks (`moe_max_blocks`) depends on shapes only, so the buffers do too."""
    flat = ids.reshape(-1).long()
    pairs, tk = flat.numel(), ids.shape[-1]
    max_blocks = moe_max_blocks(ids.shape[0], tk, num_experts, block_m)
    sorted_ids = torch.full((max_blocks * block_m,), pairs, dtype=torch.int32)
    block_expert = torch.full((max_blocks,), -1, dtype=torch.int32)
    pos = 0
    for e, count in enumerate(torch.bincount(flat, minlength=num_experts).tolist()):
        sorted_ids[pos:pos + count] = (flat == e).nonzero()[:, 0].to(torch.int32)
        blocks = -(-count // block_m)
        block_expert[pos // block_m:pos // block_m + blocks] = e
        pos += blocks * block_m
    return sorted_ids.to(ids.device), block_expert.to(ids.device)


def moe_max_blocks(num_tokens: int, top_k: int, num_experts: int, block_m: int) -> int:
    """The most blocks the pairs of num_tokens tokens can take: each expert used rounds its
    group up by < one block, and at most min(E, pairs) experts are used. Where block_m >=
    num_tokens (the GEMV), an expert's group (at most one pair per token) is one block."""
    pairs = num_tokens * top_k
    used = min(num_experts, pairs)
    if block_m >= num_tokens:
        return used
    return pairs // block_m + used
