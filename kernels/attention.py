"""Paged attention in plain torch, written the obvious way: the formulas that
tests/test_attention_ref.py holds to a dense float64 computation, and that the kernels' own
references (`decode_attention_ref`, `extend_attention_ref`, which the CPU executor runs) are
tested against. Also the shared page helpers (`gather_pages`, `decode_gather_index`) and the
FP8 scale check.

Cache layout, per layer: k_cache / v_cache of shape [num_pages, page_size, kv_heads, head_dim].
A request's tokens live in the pages its page table lists, in order; token i of the request sits
in page page_table[i // page_size] at offset i % page_size.

A step's batch is flat: rows (requests) one after another, decode rows (one new token) first,
then extend rows (a chunk of prompt, attending to the row's cached prefix and causally to itself).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_kv_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None) -> None:
    """FP8 caches carry fp32 scales [pages, page_size, kv_heads], strided alike; others none.
    Host metadata only (no device reads: safe under graph capture)."""
    if k_cache.dtype == torch.float8_e4m3fn:
        assert k_scale is not None and v_scale is not None, "fp8 KV needs k_scale and v_scale"
        assert k_scale.shape == k_cache.shape[:3] and v_scale.shape == v_cache.shape[:3]
        assert k_scale.dtype == torch.float32 and v_scale.dtype == torch.float32
        assert k_scale.stride() == v_scale.stride()
    else:
        assert k_scale is None and v_scale is None, "scales are for fp8 KV only"


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Store new K/V [T, kv_heads, head_dim] at flat slots (page * page_size + offset)."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def gather_pages(cache: torch.Tensor, page_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one request: [length, kv_heads, head_dim]."""
    page_size = cache.shape[1]
    pages = page_table[: (length + page_size - 1) // page_size]
    return cache[pages].flatten(0, 1)[:length]


def decode_gather_index(page_tables: torch.Tensor, seq_lens: torch.Tensor,
                        page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat cache slots [B, L] of each decode row's tokens (L = longest row) and the mask of the
    real ones. The same for every layer of a step: compute it once."""
    max_len = int(seq_lens.max())
    pos = torch.arange(max_len, device=page_tables.device)
    n_pages = (max_len + page_size - 1) // page_size
    tables = page_tables[:, :n_pages]
    slots = tables[:, pos // page_size] * page_size + pos % page_size
    return slots, pos[None, :] < seq_lens[:, None]


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slots: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per row. q [B, H, D]; slots/valid [B, L] from decode_gather_index.
    Returns [B, H, D]."""
    _b, h, d = q.shape
    kv_heads = k_cache.shape[2]
    k = k_cache.view(-1, kv_heads, d)[slots]  # [B, L, KVH, D]
    v = v_cache.view(-1, kv_heads, d)[slots]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
        attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=h != kv_heads)
    return out[:, :, 0, :]


def extend_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         page_table: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
    """One row of n new tokens, the last n of its `seq_len` cached tokens (K/V already written).
    Causal: new token i (position seq_len - n + i) sees positions <= its own. q [n, H, D]."""
    n, h, _ = q.shape
    kv_heads = k_cache.shape[2]
    k = gather_pages(k_cache, page_table, seq_len).transpose(0, 1)[None].to(q.dtype)
    v = gather_pages(v_cache, page_table, seq_len).transpose(0, 1)[None].to(q.dtype)
    mask = None
    if n != seq_len:  # a cached prefix: the causal diagonal is offset by its length
        q_pos = torch.arange(seq_len - n, seq_len, device=q.device)
        mask = (torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None])[None, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
        enable_gqa=h != kv_heads)
    return out[0].transpose(0, 1)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        page_tables: torch.Tensor, seq_lens: list[int], q_lens: list[int],
                        num_decode_rows: int, scale: float,
                        decode_index: tuple[torch.Tensor, torch.Tensor] | None = None
                        ) -> torch.Tensor:
    """Attention for a flat mixed batch. q [T, H, D]; row r owns q_lens[r] consecutive tokens;
    the first `num_decode_rows` rows have q_len 1 and are batched together (pass their
    `decode_gather_index` to reuse it across layers)."""
    out = torch.empty_like(q)
    nd = num_decode_rows
    if nd:
        if decode_index is None:
            decode_index = decode_gather_index(
                page_tables[:nd], torch.tensor(seq_lens[:nd], device=q.device), k_cache.shape[1])
        out[:nd] = decode_attention_ref(q[:nd], k_cache, v_cache, *decode_index, scale)
    start = nd
    for r in range(nd, len(q_lens)):
        n = q_lens[r]
        out[start:start + n] = extend_attention_ref(
            q[start:start + n], k_cache, v_cache, page_tables[r], seq_lens[r], scale)
        start += n
    return out
