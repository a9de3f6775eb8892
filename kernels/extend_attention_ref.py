"""Paged extend attention (prefill chunks, verify rows) in plain torch: the CPU
executor's, the reference kernels/extend_attention.py's kernel is tested against, and the
host-side planning and argument checks both share."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from arle_kernels.decode_attention_ref import (
    RUN_MIN_KEYS,
    attend_run,
    decode_attention_ref,
    run_is_exact,
)


def plan_blocks(q_lens: list[int], seq_lens: list[int], block_t: int, capacity: int
                ) -> list[int]:
    """The (row, token block) pairs of rows with q_lens new tokens, most keys first (they take
    longest: start them first), flattened and padded with (-1, 0) to `capacity` pairs. Plain
    Python, for the host side of a step."""
    pairs = [(min(seq_len, seq_len - q + (qb + 1) * block_t), row, qb)
             for row, (q, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True))
             for qb in range(-(-q // block_t))]
    assert len(pairs) <= capacity, f"{len(pairs)} token blocks > capacity {capacity}"
    pairs.sort(reverse=True)
    flat = [v for _, row, qb in pairs for v in (row, qb)]
    return flat + [-1, 0] * (capacity - len(pairs))


def _dequant(cache: Tensor, cache_scale: Tensor | None, pages: Tensor, offs: Tensor,
             dtype: torch.dtype) -> Tensor:
    """Tokens at (pages, offs) of a cache, [L, KVH, D] in `dtype` (fp8: stored * scale in fp32)."""
    x = cache[pages, offs]
    if cache_scale is not None:
        return (x.float() * cache_scale[pages, offs][..., None]).to(dtype)
    return x.to(dtype)


#: the longest extend row (over a cached prefix) the reference runs as decode rows: a verify
#: row of speculative decoding has at most 9 tokens (8 drafts)
DECODE_LIKE_MAX_Q = 16


def check_rows(page_table: Tensor, cu_q_lens: Tensor, seq_lens: Tensor) -> None:
    """The rows' arguments agree: a length and a page-table row a row, rows + 1 offsets (the
    kernel's contract, which its reference holds callers to too)."""
    rows = seq_lens.shape[0]
    if cu_q_lens.shape[0] != rows + 1 or page_table.shape[0] != rows:
        raise ValueError(f"cu_q_lens needs rows + 1 entries and page_table one row per row "
                         f"({rows} rows: {cu_q_lens.shape[0]} offsets, page table "
                         f"{tuple(page_table.shape)})")


def _runs(q: Tensor, k_cache: Tensor, k_scale: Tensor | None, out: Tensor, first: int) -> bool:
    """Whether a verify row whose first token has `first` keys attends as one run
    (`attend_run`: its decode rows' bits, in fewer products)."""
    _, h, d = q.shape
    kvh = k_cache.shape[2]
    return (first >= RUN_MIN_KEYS and k_scale is None and q.dtype == k_cache.dtype == out.dtype
            and q.dtype in (torch.float32, torch.float64)
            and run_is_exact(kvh, h // kvh, d, q.dtype))


def extend_attention_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                         cu_q_lens: Tensor, seq_lens: Tensor, scale: float, max_q_len: int, *,
                         k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                         out: Tensor | None = None, blocks: Tensor | None = None) -> Tensor:
    """Plain torch, one SDPA per row, K/V gathered (and fp8 dequantised) in q's dtype; a
    short row over a cached prefix token by token through `decode_attention_ref`. Same
    arguments as `extend_attention` (max_q_len and blocks are unused; this one reads the
    lengths on the host). Pass q in fp32 for a higher-precision reference."""
    _t, h, _d = q.shape
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    check_rows(page_table, cu_q_lens, seq_lens)
    if out is None:
        out = torch.empty_like(q)
    cu = cu_q_lens.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        start, end = cu[r], cu[r + 1]
        n = end - start
        if n == 0:
            continue
        if n <= DECODE_LIKE_MAX_Q and n != seq_len and k_cache.is_contiguous() and \
                v_cache.is_contiguous():
            # NOTE: a short row over a cached prefix (a verify row of speculative decoding)
            # attends token by token as decode rows do: its tokens then get the decode step's
            # numbers to the bit, and greedy speculation the tokens of speculation off
            first = seq_len - n + 1
            if _runs(q, k_cache, k_scale, out, first):
                run_pages = page_table[r, :-(-seq_len // page_size)].tolist()
                attend_run(q[start:end], k_cache, v_cache, run_pages, first, scale,
                           out[start:end])
                continue
            lens = torch.arange(first, seq_len + 1, dtype=torch.int32)
            out[start:end] = decode_attention_ref(
                q[start:end], k_cache, v_cache, page_table[r:r + 1].expand(n, -1), lens,
                scale, 1, k_scale=k_scale, v_scale=v_scale).to(out.dtype)
            continue
        pos = torch.arange(seq_len, device=q.device)
        pages = page_table[r, pos // page_size].long()
        offs = pos % page_size
        k = _dequant(k_cache, k_scale, pages, offs, q.dtype).transpose(0, 1)[None]
        v = _dequant(v_cache, v_scale, pages, offs, q.dtype).transpose(0, 1)[None]
        mask = None
        if n != seq_len:  # a cached prefix: the causal diagonal is offset by its length
            q_pos = torch.arange(seq_len - n, seq_len, device=q.device)
            mask = pos[None, :] <= q_pos[:, None]  # [n, seq_len]
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1)[None], k, v, attn_mask=mask, is_causal=mask is None,
            scale=scale, enable_gqa=h != kv_heads)
        out[start:end] = o[0].transpose(0, 1).to(out.dtype)
    return out
