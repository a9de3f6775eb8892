"""Paged extend (prefill) attention for variable-length batches, Triton, flash-attention-2 style.

Each row r of the batch owns q_len = cu_q_lens[r+1] - cu_q_lens[r] new tokens, the last q_len of
its seq_len cached tokens (their K/V are already in the cache). New token i sits at position
seq_len - q_len + i and attends to every position <= its own: the cached prefix (a chunk of an
earlier prefill, or a prefix-cache hit) and, causally, the new tokens before it. All K/V are read
from the pages: token j of a row sits in page page_table[r, j // page_size] at offset
j % page_size.

Layout of the work, `_extend_kernel`, grid (cdiv(max_q_len, BLOCK_T), KVH, R):
- One program per (block of BLOCK_T new tokens, KV head, row). Its tile stacks the G = H // KVH
  query heads that share the KV head into the M dimension: tile row m is token t0 + m // G, query
  head kvh * G + m % G (BLOCK_M = BLOCK_T * G, rounded down; rows past BLOCK_T * G are padding).
  Why: each K/V tile then serves all G heads of its group, and a short row (a few new tokens, as
  in chunked prefill's tail or speculative verification) fills G times more of the tile than with
  one head per program. For long prompts it costs nothing: the FLOPs per K/V byte loaded are
  BLOCK_M either way, and the causal diagonal is finer (BLOCK_T tokens, not BLOCK_M).
- Programs whose token block starts past the row's q_len return at once (the grid is sized by
  the longest row). The token blocks are visited last-first (program 0 takes the last block):
  the blocks near the end of a long row see the most keys, so starting them first shortens the
  tail of the launch.
- The program walks the row's keys in blocks of BLOCK_N tokens: first [0, full_end), the keys
  every token of the tile sees (positions <= the tile's first query position), with no mask
  at all; then [full_end, kv_end), the diagonal, with the causal mask and bounds checks. Blocks
  wholly above the diagonal are never visited: kv_end is one past the tile's last query position.
- Per key block: gather the block's page ids from the page table (one per token: the loads hit
  the same few ids, cached), load K [BLOCK_N, D] and V in the cache's dtype, S = Q K^T in fp32,
  online softmax in fp32 with exp2 (scores pre-scaled by scale * log2(e)), acc += P V with P in
  q's dtype. Dot operands are in q's dtype (bf16 on the GPU; under the interpreter tests use
  fp16/fp32 since bf16 tl.dot is wrong there).

FP8 KV (torch.float8_e4m3fn) carries one fp32 scale per (token, KV head): dequantised = stored *
scale. K goes to q's dtype unscaled (exact: e4m3 fits bf16/fp16) and its scales multiply the
score columns in fp32 (S[:, n] *= k_scale[n]); V is dequantised in fp32 and rounded once to q's
dtype (the tile is converted anyway before P @ V; scaling P by v_scale instead was slower, and
would push small probabilities times small scales into fp16's subnormals).

Weak spot: a row of few new tokens after a long prefix gets only KVH programs (memory-bound,
far from the bandwidth): such rows want a split-KV (decode-style) kernel.

Block sizes come from a small rule (`_pick_config`), one compiled variant per (dtype, D, G,
rule branch): no autotuning, so compile time at server start stays small.

With a block list (`blocks`, planned on the host by `plan_blocks`) the grid is (N, KVH) instead:
program i takes the list's (row, token block) pair i, longest work first, and pairs of row -1
(padding) return at once. A CUDA graph of a padded batch (the executor's extend graphs) uses it:
its grid is fixed by the list's length, and rows past the step's own cost no programs.

NOTE: the wrapper never reads a device tensor on the host and its grid depends only on host ints
(max_q_len, KVH, rows, or the block list's length), so it can be captured in a CUDA graph.
NOTE: requires head_dim and page_size powers of two (head_dim >= 16), the last dim of q, out and
the caches contiguous, and the V cache (and v_scale) strided like the K cache (and k_scale).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from arle_kernels.extend_attention_ref import check_rows
from arle_kernels.jit import gdc_launch_dependents, gdc_wait, jit_varying, pdl_enabled, pdl_launch

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_block(
    acc, l_i, m_i, q, q_pos, start, seq_len,
    pt_row, k_ptr, v_ptr, ks_ptr, vs_ptr, kvh, qk_scale,
    stride_kp, stride_kt, stride_kh, stride_sp, stride_st, stride_sh,
    offs_n, offs_d,
    PAGE: tl.constexpr, IS_FP8: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr,
):
    """One key block [start, start + BLOCK_N) into the running (acc, l_i, m_i) of the tile.
    MASKED: the diagonal part (causal mask, positions past seq_len never loaded)."""
    pos = start + offs_n
    if MASKED:
        in_seq = pos < seq_len
        page = tl.load(pt_row + pos // PAGE, mask=in_seq, other=0)
    else:
        page = tl.load(pt_row + pos // PAGE)
    page = page.to(tl.int64)  # NOTE: page * stride can pass 2**31 on a large cache
    off = pos % PAGE
    kv_off = (page * stride_kp + off * stride_kt + kvh * stride_kh)[:, None] + offs_d[None, :]
    k_ptrs = k_ptr + kv_off  # NOTE: the V cache has the K cache's strides (checked on launch)
    v_ptrs = v_ptr + kv_off
    k = tl.load(k_ptrs, mask=in_seq[:, None], other=0.0) if MASKED else tl.load(k_ptrs)

    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
    if IS_FP8:
        s_off = page * stride_sp + off * stride_st + kvh * stride_sh
        if MASKED:
            ks = tl.load(ks_ptr + s_off, mask=in_seq, other=0.0)
            vs = tl.load(vs_ptr + s_off, mask=in_seq, other=0.0)
        else:
            ks = tl.load(ks_ptr + s_off)
            vs = tl.load(vs_ptr + s_off)
        s = s * (ks * qk_scale)[None, :]
    else:
        s = s * qk_scale
    if MASKED:
        # NOTE: the causal mask also hides the zero-filled keys past seq_len from every stored
        # row (q_pos < seq_len). A row has a finite running max by here (position 0 is in the
        # first block it sees), so a block masked out for a whole row adds exp2(-inf) = 0.
        s = tl.where(pos[None, :] <= q_pos[:, None], s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)

    v = tl.load(v_ptrs, mask=in_seq[:, None], other=0.0) if MASKED else tl.load(v_ptrs)
    v = (v.to(tl.float32) * vs[:, None]).to(q.dtype) if IS_FP8 else v.to(q.dtype)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(q.dtype), v, acc, input_precision=PRECISION)
    return acc, l_i, m_new


# NOTE: the extend rows' views start after the decode rows (any alignment), and the page
# table's width changes every step: not specialised (see jit_varying)
@jit_varying("page_table_ptr", "cu_q_lens_ptr", "seq_lens_ptr", "blocks_ptr", "stride_pt")
def _extend_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, o_ptr,
    page_table_ptr, cu_q_lens_ptr, seq_lens_ptr, blocks_ptr,
    qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_kt, stride_kh,
    stride_sp, stride_st, stride_sh,
    stride_pt,
    G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_FP8: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr, USE_BLOCKS: tl.constexpr,
):
    """One (token block, KV head, row): BLOCK_T new tokens x the G query heads of the KV head,
    against the row's keys up to the tile's last query position. USE_BLOCKS: program (i, kvh)
    takes the (row, token block) pair i of `blocks` (row -1: nothing to do)."""
    if PDL:
        gdc_launch_dependents()
    BLOCK_T = BLOCK_M // G
    kvh = tl.program_id(1)
    if USE_BLOCKS:
        row = tl.load(blocks_ptr + 2 * tl.program_id(0))
        qb = tl.load(blocks_ptr + 2 * tl.program_id(0) + 1)
        if row < 0:
            return
    else:
        qb = tl.num_programs(0) - 1 - tl.program_id(0)  # last token blocks (most keys) first
        row = tl.program_id(2)

    q_start = tl.load(cu_q_lens_ptr + row)
    q_len = tl.load(cu_q_lens_ptr + row + 1) - q_start
    t0 = qb * BLOCK_T
    if t0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + row)
    prefix = seq_len - q_len
    if PDL:  # the lengths above are metadata; q and the K/V just stored are not
        gdc_wait()

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    tok = t0 + offs_m // G  # the tile row's token, within the row's new tokens
    head = kvh * G + offs_m % G
    row_ok = (offs_m < BLOCK_T * G) & (tok < q_len)
    q_pos = prefix + tok
    q_off = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    pt_row = page_table_ptr + row.to(tl.int64) * stride_pt

    # NOTE: every key < full_end is visible to every token of the tile (the first token sits at
    # prefix + t0) and lies inside the row (prefix + t0 < seq_len): no masks there
    full_end = (prefix + t0 + 1) // BLOCK_N * BLOCK_N
    kv_end = prefix + tl.minimum(t0 + BLOCK_T, q_len)
    for start in range(0, full_end, BLOCK_N):
        start = tl.multiple_of(start, BLOCK_N)
        acc, l_i, m_i = _attend_block(
            acc, l_i, m_i, q, q_pos, start, seq_len,
            pt_row, k_ptr, v_ptr, ks_ptr, vs_ptr, kvh, qk_scale,
            stride_kp, stride_kt, stride_kh, stride_sp, stride_st, stride_sh, offs_n, offs_d,
            PAGE, IS_FP8, False, PRECISION)
    for start in range(full_end, kv_end, BLOCK_N):
        start = tl.multiple_of(start, BLOCK_N)
        acc, l_i, m_i = _attend_block(
            acc, l_i, m_i, q, q_pos, start, seq_len,
            pt_row, k_ptr, v_ptr, ks_ptr, vs_ptr, kvh, qk_scale,
            stride_kp, stride_kt, stride_kh, stride_sp, stride_st, stride_sh, offs_n, offs_d,
            PAGE, IS_FP8, True, PRECISION)

    acc = acc / l_i[:, None]
    o_off = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(o_ptr + o_off[:, None] + offs_d[None, :], acc.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def _pick_config(head_dim: int, group: int, is_fp8: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) by a small rule, the best tried on long
    causal rows: BLOCK_M 64 on one warpgroup (twice the programs of BLOCK_M 128 fill the SMs
    better, and the diagonal is finer); FP8 KV: BLOCK_N 128 (its tiles are half the bytes);
    D 256: BLOCK_M 128, 8 warps, 2 stages."""
    block_m = max(64, 1 << (group - 1).bit_length())  # at least one token per tile
    if head_dim > 128:
        return max(block_m, 128), 64, 8, 2
    if is_fp8:
        return block_m, 128, 4, 3
    return block_m, 64, 4, 3


def _launch(q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
            cu_q_lens: Tensor, seq_lens: Tensor, scale: float, max_q_len: int,
            k_scale: Tensor | None, v_scale: Tensor | None, out: Tensor | None,
            block_m: int, block_n: int, num_warps: int, num_stages: int,
            blocks: Tensor | None = None) -> Tensor:
    """The launch with explicit block sizes (tests use small ones to cross many blocks under the
    interpreter; the benchmark tries others). blocks: see `extend_attention`.
    NOTE: runs once per layer per step: keep the host work small (stride tuples, no helpers)."""
    t, h, d = q.shape
    _pages, page_size, kv_heads, d_k = k_cache.shape
    rows = seq_lens.shape[0]
    group = h // kv_heads
    kst = k_cache.stride()
    if d_k != d or h % kv_heads or v_cache.shape != k_cache.shape or v_cache.stride() != kst:
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, k/v cache {tuple(k_cache.shape)} "
                         f"{tuple(v_cache.shape)} (the same strides: {kst} {v_cache.stride()})")
    if d < 16 or d & (d - 1) or page_size & (page_size - 1):
        raise ValueError(f"head_dim ({d}) and page_size ({page_size}) must be powers of two, "
                         "head_dim >= 16")
    check_rows(page_table, cu_q_lens, seq_lens)
    if block_m < group:
        raise ValueError(f"BLOCK_M ({block_m}) must hold the {group} heads of a group")
    is_fp8 = k_cache.dtype == torch.float8_e4m3fn
    if is_fp8:
        if k_scale is None or v_scale is None or k_scale.stride() != v_scale.stride():
            raise ValueError("an fp8 KV cache needs k_scale and v_scale, with the same strides")
        ks, vs, sst = k_scale, v_scale, k_scale.stride()
    else:
        ks, vs, sst = k_cache, v_cache, (0, 0, 0)  # unused by the kernel (IS_FP8 False)
    if out is None:
        out = torch.empty_like(q)
    qst, ost = q.stride(), out.stride()
    if qst[2] != 1 or ost[2] != 1 or kst[3] != 1:
        raise ValueError("q, out and the caches need a contiguous last dim")
    if t == 0 or rows == 0 or max_q_len <= 0:
        return out
    block_t = block_m // group
    grid = ((blocks.shape[0] // 2, kv_heads, 1) if blocks is not None
            else (-(-max_q_len // block_t), kv_heads, rows))
    pdl = pdl_enabled()
    _extend_kernel[grid](
        q, k_cache, v_cache, ks, vs, out,
        page_table, cu_q_lens, seq_lens, blocks if blocks is not None else cu_q_lens,
        scale * _LOG2E,
        qst[0], qst[1], ost[0], ost[1],
        kst[0], kst[1], kst[2],
        sst[0], sst[1], sst[2],
        page_table.stride(0),
        G=group, D=d, PAGE=page_size, BLOCK_M=block_m, BLOCK_N=block_n,
        IS_FP8=is_fp8, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PDL=pdl,
        USE_BLOCKS=blocks is not None, num_warps=num_warps, num_stages=num_stages,
        **pdl_launch(pdl),
    )
    return out


def extend_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor,
                     cu_q_lens: Tensor, seq_lens: Tensor, scale: float, max_q_len: int, *,
                     k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                     out: Tensor | None = None, blocks: Tensor | None = None) -> Tensor:
    """q [T, H, D] (rows' new tokens back to back); cu_q_lens [R+1] int32 (device; row r owns
    q[cu[r]:cu[r+1]]); seq_lens [R] int32 (device; cached prefix + new tokens); page_table
    [R, max_pages] int32. Token i of row r is at position seq_len - q_len + i and sees positions
    <= its own. max_q_len: host int, the longest q_len (sizes the grid). k_scale/v_scale
    [num_pages, page_size, KVH] fp32 for an fp8 cache. Returns [T, H, D] (`out` if given).

    blocks: the work as a list instead (CUDA graphs of padded batches): int32 [2 * N], N pairs
    (row, token block of `block_tokens(...)` tokens) from `plan_blocks`, padded with row -1;
    the grid is N programs per KV head, whatever the rows' lengths (max_q_len is unused)."""
    block_m, block_n, num_warps, num_stages = _pick_config(
        q.shape[2], q.shape[1] // k_cache.shape[2], k_cache.dtype == torch.float8_e4m3fn)
    return _launch(q, k_cache, v_cache, page_table, cu_q_lens, seq_lens, scale, max_q_len,
                   k_scale, v_scale, out, block_m, block_n, num_warps, num_stages, blocks)


def block_tokens(head_dim: int, group: int, is_fp8: bool) -> int:
    """New tokens per program (BLOCK_T) of the config `extend_attention` picks."""
    return _pick_config(head_dim, group, is_fp8)[0] // group


