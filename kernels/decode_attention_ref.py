"""Paged decode attention (one query token a row) in plain torch: the CPU executor's,
and the reference kernels/decode_attention.py's kernels are tested against."""

from __future__ import annotations

import functools
import itertools
import threading

import torch
import torch.nn.functional as F

#: elements of one gathered K (or V) chunk in `decode_attention_ref`, heads expanded: 256 MiB
#: of fp32
REF_CHUNK_ELEMENTS = 1 << 26


def _row_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, pages: list[int], length: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """A row's first `length` keys and values [L, KVH, D] on its `pages`: a view of the cache
    where the pages are consecutive (no copy), else gathered into the same shape."""
    kvh, d = k_cache.shape[2:]
    if pages[-1] - pages[0] == len(pages) - 1 and all(
            b - a == 1 for a, b in itertools.pairwise(pages)):
        k, v = (c[pages[0]:pages[0] + len(pages)] for c in (k_cache, v_cache))
    else:
        index = torch.tensor(pages)
        k, v = (c[index] for c in (k_cache, v_cache))
    return k.view(-1, kvh, d)[:length], v.view(-1, kvh, d)[:length]


def _attend_in_place(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     page_table: list[list[int]], seq_lens: list[int], rows: list[int],
                     scale: float, out: torch.Tensor) -> None:
    """`decode_attention_ref` of `rows`, one row at a time, each on its pages (`_row_kv`).
    NOTE: a row's numbers depend on its tokens alone, not on where its pages lie (page
    allocation differs with speculation on) nor on the rows beside it.
    (2-core CPU, 9 heads of 64: a row in place costs 38 us at 64 tokens against 69 in a
    gather, 0.5 ms at 6,144 against 2.1.)"""
    ps, kvh, d = k_cache.shape[1:]
    h = q.shape[1]
    for row in rows:
        length = seq_lens[row]
        if length == 0:
            out[row] = 0
            continue
        k, v = _row_kv(k_cache, v_cache, page_table[row][:-(-length // ps)], length)
        qg = q[row].to(k_cache.dtype).view(kvh, h // kvh, d)
        probs = torch.softmax(torch.matmul(qg, k.permute(1, 2, 0)) * scale, dim=-1)
        out[row] = torch.matmul(probs, v.transpose(0, 1)).view(h, d)


#: a verify row's tokens share one q K^T and one softmax (`attend_run`) where its first token
#: has this many keys or more: below it torch's softmax and the BLAS take other code paths by
#: length (measured: rows of 1-15 keys differ from their decode rows in the last bit)
RUN_MIN_KEYS = 64


def attend_run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: list[int],
               first: int, scale: float, out: torch.Tensor) -> None:
    """`decode_attention_ref` of n rows that are one request's consecutive tokens on `pages`
    (row i attends to `first` + i keys; a verify row): q K^T and the softmax once for all n,
    each token's later keys masked, then P V token by token. NOTE (exactness): a token gets
    the bits its decode row gets (`_attend_in_place`): the scores are the same dot products
    of 64-or-so terms, the masked keys add exact zeros to the softmax's sum, and P V runs on
    the row's own keys alone (over more keys, zeros included, the BLAS blocks the sum
    differently). `run_is_exact` checks it on this machine before the engine relies on it.
    (2-core CPU, 9 heads of 64, 8 tokens at 500 keys: 0.30 ms a layer against 0.74.)"""
    n, h, d = q.shape
    kvh = k_cache.shape[2]
    g, last = h // kvh, first + n - 1
    k, v = _row_kv(k_cache, v_cache, pages, last)
    qg = q.to(k_cache.dtype).view(n, kvh, g, d).transpose(0, 1).reshape(kvh, n * g, d)
    scores = torch.matmul(qg, k.permute(1, 2, 0)) * scale  # [KVH, n * g, last]
    scores.masked_fill_(_later_keys(first, n, g), float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(kvh, n, g, last)
    vt = v.transpose(0, 1)
    for i in range(n):
        out[i] = torch.matmul(probs[:, i, :, :first + i], vt[:, :first + i]).view(h, d)


@functools.lru_cache(maxsize=64)
def _later_keys(first: int, n: int, group: int) -> torch.Tensor:
    """`attend_run`'s mask [n * group, first + n - 1]: True at the keys past each token's own.
    NOTE: kept, not remade: every layer of a step asks for the same one."""
    ends = torch.arange(first, first + n).repeat_interleave(group)
    return torch.arange(first + n - 1) >= ends[:, None]


@functools.cache
def run_is_exact(kv_heads: int, group: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether `attend_run` gives every token its decode row's bits on this machine's BLAS,
    for this head shape: random rows of a few lengths from RUN_MIN_KEYS, both ways (a few ms,
    once a process). Where not, verify rows attend row by row."""
    gen = torch.Generator().manual_seed(0)
    ps = 16
    for first, n in ((RUN_MIN_KEYS, 9), (100, 4), (257, 8), (1021, 5)):
        pages = -(-(first + n) // ps)
        k, v = (torch.randn(pages, ps, kv_heads, head_dim, generator=gen, dtype=dtype)
                for _ in range(2))
        q = torch.randn(n, kv_heads * group, head_dim, generator=gen, dtype=dtype)
        run, rows = torch.empty_like(q), torch.empty_like(q)
        attend_run(q, k, v, list(range(pages)), first, head_dim ** -0.5, run)
        _attend_in_place(q, k, v, [list(range(pages))] * n, list(range(first, first + n)),
                         list(range(n)), head_dim ** -0.5, rows)
        if not torch.equal(run, rows):
            return False
    return True


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         num_splits: int, *, k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, in fp32 (float64 if q is float64). A cache in that dtype (the CPU
    engine's): each row's pages read in place, one row at a time (`_attend_in_place`); else a
    chunk of rows at once (one gather of their tokens, one masked SDPA), fp8 caches
    dequantised with their per-(token, KV head) scales. `num_splits` is accepted and ignored
    (splitting does not change the math). A row of length 0 gives zeros, as the kernel does.
    Reads seq_lens on the host: not for graphs."""
    b, h, d = q.shape
    kvh = k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    if b == 0:
        return out
    math_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if k_scale is None and k_cache.dtype == math_dtype:
        # NOTE: one row at a time, whatever the batch: a verify row's tokens attend as decode
        # rows (extend_attention_ref), and speculation stays exact only if a token's numbers
        # do not depend on the rows beside it (a batched SDPA pads and masks them)
        _attend_in_place(q, k_cache, v_cache, page_table[:b].tolist(), seq_lens[:b].tolist(),
                         list(range(b)), scale, out)
        return out
    slots, valid, ragged, empty_rows = _gather_index(page_table[:b], seq_lens[:b],
                                                     k_cache.shape[1])

    def tokens(cache: torch.Tensor, cache_scale: torch.Tensor | None, part: slice
               ) -> torch.Tensor:
        x = cache.view(-1, kvh, d)[slots[part]].to(math_dtype)  # [B, L, KVH, D]
        if cache_scale is not None:
            x = x * cache_scale.view(-1, kvh)[slots[part]].to(math_dtype)[..., None]
        # NOTE: past a row's end the gather reads other requests' (or unwritten) slots: zero
        # them, or a NaN there would poison the row through 0 * NaN in P @ V.
        if ragged:
            x = torch.where(valid[part, :, None, None], x, 0.0)
        return x.transpose(1, 2)  # [B, KVH, L, D]

    # rows in chunks: the gathered K and V (heads expanded for GQA) of long rows at a large
    # batch would not fit in memory at once
    rows = max(1, REF_CHUNK_ELEMENTS // (slots.shape[1] * h * d))
    for lo in range(0, b, rows):
        part = slice(lo, lo + rows)
        mask = valid[part, None, None, :] if ragged else None
        res = F.scaled_dot_product_attention(
            q[part, :, None, :].to(math_dtype), tokens(k_cache, k_scale, part),
            tokens(v_cache, v_scale, part), attn_mask=mask, scale=scale,
            enable_gqa=h != kvh)[:, :, 0, :]
        if empty_rows is not None:
            res = torch.where(empty_rows[part, None, None], 0.0, res)
        out[part] = res
    return out


_MEMO = threading.local()


def _gather_index(page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor, bool, torch.Tensor | None]:
    """The rows' token slots [B, L] and mask, whether rows differ in length, and the rows of
    length 0 (None if none). Every layer of a step asks for the same rows: the last answer is
    kept (per thread) and reused while the same page table and lengths come back."""
    last = getattr(_MEMO, "last", None)
    if (last is not None and last[2] == page_size and last[0].shape == page_table.shape
            and last[1].shape == seq_lens.shape and last[0].device == page_table.device
            and torch.equal(last[0], page_table) and torch.equal(last[1], seq_lens)):
        return last[3]
    lens = seq_lens.long().to(page_table.device)
    # NOTE: a row of length 0 attends to one slot (a row all masked out would give NaN); its
    # output is replaced by zeros
    gathered = lens.clamp(min=1)
    pos = torch.arange(int(gathered.max()), device=page_table.device)
    slots = page_table.long()[:, pos // page_size] * page_size + pos % page_size
    valid = pos[None, :] < gathered[:, None]
    empty = lens == 0
    result = (slots, valid, not bool(valid.all()), empty if bool(empty.any()) else None)
    _MEMO.last = (page_table.clone(), seq_lens.clone(), page_size, result)
    return result
