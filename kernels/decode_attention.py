"""Paged decode attention (one query token per row), Triton, split-KV ("flash-decoding").

Layout of the work:
- Pass 1, `_decode_split_kernel`, grid (B, KVH, num_splits): one program per (row, KV head,
  split of the row's context). It handles *all* the G = H // KVH query heads sharing that KV head
  (GQA) as the rows of one tile, padded to G_PAD >= 16 rows so `tl.dot` applies; the K/V of the
  split are read once for the whole group. It walks its split in blocks of BLOCK_N tokens,
  gathering each token's page from the page table (token i sits in page page_table[i // page_size]
  at offset i % page_size; the cache's strides are constexprs and, where a block holds whole
  pages, a block starts on a page boundary: a thread's slots are then constants, and a token's
  address is its page times a constant plus a constant), with an online softmax in fp32
  (exp2, scores pre-scaled by scale * log2(e)). It writes the split's normalised output
  [B, H, S, D] and its log-sum-exp [B, H, S] (natural log of sum_j exp(scale * q.k_j)), both
  fp32. A split with no tokens writes lse = -inf and zeros. Under PDL with few rows (PRELOAD)
  a program loads its first block's page numbers and K/V before `gdc_wait`, while the kernel
  before it still runs: all but the row's newest token, which that kernel writes this step and
  which is added after the wait.
- Pass 2, `_merge_kernel`, grid (B, H): weights each split by exp(lse - max lse) and writes the
  row's [D] output in q's dtype. With num_splits == 1 pass 1 writes the output directly and
  pass 2 is skipped (one launch).

NOTE: the grid depends only on host ints (B, KVH, num_splits): each program derives its split's
token range from seq_lens *in the kernel* (split length = cdiv(cdiv(seq_len, S), BLOCK_N) *
BLOCK_N), so the wrapper never reads a device tensor and is safe to capture in a CUDA graph.
Any num_splits is correct for any seq_len; it only changes speed. Under a graph, pick it for the
longest context the graph will see (empty splits cost a program that writes -inf and exits).
A row with seq_len 0 (a padding row of a graph batch) gets zeros.

FP8 KV (torch.float8_e4m3fn) carries one fp32 scale per (token, KV head): dequantised = stored *
scale. The kernel converts the fp8 tiles to q's dtype (exact: e4m3 fits bf16 and fp16) and
applies the scales where they are cheap: on the score columns (s[:, n] *= k_scale[n]) and on
the probabilities before P @ V (p[:, n] * v_scale[n]); the softmax sum uses the unscaled p.

Performance (Qwen3-4B, batch 1: 8 KV heads, D 128, bf16 KV): a step reads seq_len * 8 * 128 * 2
* 2 = 4 KiB per token per layer, 147 KB per token over 36 layers: 0.6 GB at 4K context (7% of
the 8.05 GB of weights), 4.8 GB at 32K (FP8 KV halves it). At short context what matters is the
launch count (2 kernels per layer, 1 with a single split) and filling the 132 SMs: 8 programs
per layer would leave most idle, hence the splits (`pick_num_splits`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from arle_kernels.attention import check_kv_scales
from arle_kernels.jit import gdc_launch_dependents, gdc_wait, jit_varying, pdl_enabled, pdl_launch

_LOG2E = 1.4426950408889634
#: up to this many rows the split kernel loads its first block before `gdc_wait` (PRELOAD);
#: at more rows its extra registers cost programs per SM, and that cost more than it hid
PRELOAD_MAX_BATCH = 16
#: up to this many rows the merge loads every split's o with its lse (`_merge_kernel`'s
#: O_WITH_LSE): at one row the merge is a few programs' latency, and one round trip beats two
MERGE_O_WITH_LSE_MAX_BATCH = 1


@triton.jit
def _block(n0, end, pt_row, kvh, STRIDE_P: tl.constexpr, STRIDE_S: tl.constexpr,
           STRIDE_H: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr,
           BLOCK_N: tl.constexpr):
    """The block of tokens [n0, n0 + BLOCK_N): which are the split's (< end), their pages (from
    the page table) and slots, and their K/V offsets [BLOCK_N, D] (K and V share a layout)."""
    offs_b = tl.arange(0, BLOCK_N)
    offs_n = n0 + offs_b
    mask_n = offs_n < end
    if BLOCK_N % PAGE_SIZE == 0:
        # NOTE: n0 is a multiple of BLOCK_N (split starts are), so a token's slot in its page
        # is a constant of the thread and its page index the block's first plus a constant
        page_idx = n0 // PAGE_SIZE + offs_b // PAGE_SIZE
        in_page = offs_b % PAGE_SIZE
    else:
        page_idx = offs_n // PAGE_SIZE
        in_page = offs_n % PAGE_SIZE
    page = tl.load(pt_row + page_idx, mask=mask_n, other=0)
    offs = (page.to(tl.int64) * STRIDE_P + (in_page * STRIDE_S + kvh * STRIDE_H))[:, None] \
        + tl.arange(0, D)[None, :]
    return offs_n, mask_n, page, in_page, offs


@triton.jit
def _attend(q, k, v, mask_n, page, in_page, kvh, ks_ptr, vs_ptr, stride_sp, stride_ss,
            stride_sh, qk_scale, m_i, l_i, acc, IS_FP8: tl.constexpr, PRECISION: tl.constexpr):
    """One block of BLOCK_N tokens (K and V [BLOCK_N, D]: one layout, so one set of addresses;
    mask_n: which are the split's) into the online softmax: the new running max, sum and
    unnormalised output."""
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)  # [G_PAD, BLOCK_N] fp32
    if IS_FP8:
        s_off = page * stride_sp + in_page * stride_ss + kvh * stride_sh
        k_sc = tl.load(ks_ptr + s_off, mask=mask_n, other=0.0)
        s = s * k_sc[None, :]
    s = tl.where(mask_n[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IS_FP8:
        v_sc = tl.load(vs_ptr + s_off, mask=mask_n, other=0.0)
        p = p * v_sc[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return m_new, l_i, acc


# NOTE: what changes from step to step is not specialised (see jit_varying): the split count,
# the strides it sets, the page table's width and the views' alignment.
@jit_varying("page_table_ptr", "seq_lens_ptr", "num_splits", "stride_pt", "stride_ob",
             "stride_oh", "stride_lb", "stride_lh")
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, page_table_ptr, seq_lens_ptr,
    o_ptr, lse_ptr,
    qk_scale, num_splits, group,
    stride_qb, stride_qh,
    stride_sp, stride_ss, stride_sh,
    stride_pt,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    STRIDE_P: tl.constexpr, STRIDE_S: tl.constexpr, STRIDE_H: tl.constexpr,
    D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, G_PAD: tl.constexpr,
    IS_FP8: tl.constexpr, SINGLE: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
    PRELOAD: tl.constexpr,
):
    """One (row, KV head, split): the G query heads of the KV head against the split's tokens.
    SINGLE: write the final output (o_ptr is `out`, in q's dtype) and no lse. PRELOAD (PDL,
    bf16/fp16 KV): the first block's history is loaded before the wait (module docstring)."""
    if PDL:
        gdc_launch_dependents()
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    mask_g = offs_g < group
    heads = kvh * group + offs_g
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([G_PAD], tl.float32)  # running sum of exp2
    acc = tl.zeros([G_PAD, D], tl.float32)
    pt_row = page_table_ptr + b * stride_pt
    # NOTE: start is a multiple of BLOCK_N and every block holds >= 1 real token (n0 < end), so
    # each block's row max is finite and no exp2(-inf - -inf) appears.
    first = start
    if PRELOAD:
        # NOTE: before the wait, the first block's history: every token but the newest (which
        # the kernel before writes this step) is as earlier steps left it; the newest is
        # added after the wait (the masked-out entries are zeros)
        offs_n, mask_n, page, in_page, offs = _block(
            start, end, pt_row, kvh, STRIDE_P, STRIDE_S, STRIDE_H, D, PAGE_SIZE, BLOCK_N)
        old = mask_n & (offs_n < seq_len - 1)
        k = tl.load(k_ptr + offs, mask=old[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=old[:, None], other=0.0)
        gdc_wait()
        new = mask_n & (offs_n == seq_len - 1)
        k += tl.load(k_ptr + offs, mask=new[:, None], other=0.0)
        v += tl.load(v_ptr + offs, mask=new[:, None], other=0.0)
    elif PDL:
        # NOTE: seq_lens and the page table are the step's metadata; q and this step's K/V
        # (just stored by the previous kernel) are read only after the wait
        gdc_wait()
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None], other=0.0)  # [G_PAD, D]
    if PRELOAD:
        if start < end:
            m_i, l_i, acc = _attend(q, k, v, mask_n, page, in_page, kvh, ks_ptr, vs_ptr,
                                    stride_sp, stride_ss, stride_sh, qk_scale, m_i, l_i, acc,
                                    IS_FP8, PRECISION)
        first = start + BLOCK_N
    for n0 in range(first, end, BLOCK_N):
        offs_n, mask_n, page, in_page, offs = _block(
            n0, end, pt_row, kvh, STRIDE_P, STRIDE_S, STRIDE_H, D, PAGE_SIZE, BLOCK_N)
        # masked lanes read nothing (fp8 needs other=0.0); V is loaded with K, before it is
        # needed, so the two loads are in flight together
        k = tl.load(k_ptr + offs, mask=mask_n[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=mask_n[:, None], other=0.0)
        m_i, l_i, acc = _attend(q, k, v, mask_n, page, in_page, kvh, ks_ptr, vs_ptr,
                                stride_sp, stride_ss, stride_sh, qk_scale, m_i, l_i, acc,
                                IS_FP8, PRECISION)

    has_tokens = l_i > 0.0  # False only for an empty split (or seq_len 0)
    l_safe = tl.where(has_tokens, l_i, 1.0)
    o = acc / l_safe[:, None]
    o_rows = o_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    if SINGLE:
        tl.store(o_rows, o.to(o_ptr.dtype.element_ty), mask=mask_g[:, None])
    else:
        tl.store(o_rows + split * stride_os, o, mask=mask_g[:, None])
        # log2 units -> natural log (* ln 2)
        lse = tl.where(has_tokens, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=mask_g)


@jit_varying("num_splits", "stride_pb", "stride_ph", "stride_lb", "stride_lh")
def _merge_kernel(
    o_part_ptr, lse_ptr, out_ptr, num_splits,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    D: tl.constexpr, S_PAD: tl.constexpr, PDL: tl.constexpr, O_WITH_LSE: tl.constexpr = False,
):
    """One (row, query head): out = sum_s w_s * o_s / sum_s w_s, w_s = exp(lse_s - max lse).
    Splits with lse = -inf weigh 0; a row with no tokens at all gets zeros.
    O_WITH_LSE: every split's o is loaded with lse (one round trip to memory, not two; an
    empty split's o is zeros), for few rows (`MERGE_O_WITH_LSE_MAX_BATCH`)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D)
    in_range = offs_s < num_splits
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=in_range,
                  other=float("-inf"))
    if O_WITH_LSE:
        o = tl.load(o_part_ptr + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps
                    + offs_d[None, :], mask=in_range[:, None], other=0.0)
    live = lse > float("-inf")
    m = tl.max(lse, 0)
    m = tl.where(m > float("-inf"), m, 0.0)
    w = tl.where(live, tl.exp(lse - m), 0.0)
    if not O_WITH_LSE:
        o = tl.load(o_part_ptr + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps
                    + offs_d[None, :], mask=live[:, None], other=0.0)  # [S_PAD, D]
    den = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(den > 0.0, den, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty))


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           page_table: torch.Tensor, seq_lens: torch.Tensor, num_splits: int,
           k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
           out: torch.Tensor | None) -> None:
    """Shape/dtype checks on host metadata only (no device reads: graph safe)."""
    b, h, d = q.shape
    _pages, _page_size, kvh, dk = k_cache.shape
    assert q.dtype in (torch.bfloat16, torch.float16, torch.float32), f"q dtype {q.dtype}"
    assert v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype
    assert v_cache.stride() == k_cache.stride(), "K and V caches share one layout"
    assert dk == d and d >= 16 and d & (d - 1) == 0, f"head dim {d}: a power of two >= 16"
    assert h % kvh == 0, f"{h} query heads over {kvh} KV heads"
    assert page_table.dtype == torch.int32 and page_table.dim() == 2 and page_table.shape[0] >= b
    assert seq_lens.dtype == torch.int32 and seq_lens.shape[0] >= b
    assert page_table.stride(1) == 1 and seq_lens.stride(0) == 1
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert 1 <= num_splits <= 64, f"num_splits {num_splits}"
    check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    if out is not None:
        assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1


def default_config(batch: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the split kernel.

    NOTE: few configs (each is a compile at start-up): 4 warps, 2 stages; 64-token blocks
    (4 pages of 16), halved at D 256 to keep K+V tiles x 2 stages in shared memory and at
    batch 1, where the splits are short and the step is latency. The best in decode steps of
    the engine's graphs (`scripts/bench_kernels.py decode` times the others)."""
    return (32 if head_dim > 128 or batch == 1 else 64, 4, 2)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     num_splits: int, *, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None,
                     out: torch.Tensor | None = None,
                     config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """q [B, H, D]; page_table [B, max_pages] int32; seq_lens [B] int32 (device, each >= 1;
    a 0 gives zeros). Returns [B, H, D] in q.dtype (written into `out` if given).
    config: (BLOCK_N, num_warps, num_stages) of the split kernel, for tuning sweeps."""
    _check(q, k_cache, v_cache, page_table, seq_lens, num_splits, k_scale, v_scale, out)
    b, h, d = q.shape
    _pages, page_size, kvh, _ = k_cache.shape
    if out is None:
        out = torch.empty(b, h, d, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    group = h // kvh
    is_fp8 = k_cache.dtype == torch.float8_e4m3fn
    block_n, warps, stages = config if config is not None else default_config(b, d)
    g_pad = max(16, triton.next_power_of_2(group))
    # fp32 inputs (tests, parity runs) must not silently drop to tf32 on the GPU
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    ks = k_scale if k_scale is not None else k_cache  # dummies: never read unless IS_FP8
    vs = v_scale if v_scale is not None else v_cache
    s_strides = ks.stride()[:3] if is_fp8 else (0, 0, 0)
    single = num_splits == 1
    pdl = pdl_enabled()
    o_strides: tuple[int, ...]
    l_strides: tuple[int, ...]
    if single:
        o_part, lse = out, out  # lse unused
        o_strides = (out.stride(0), out.stride(1), 0)
        l_strides = (0, 0)
    else:
        o_part = torch.empty(b, h, num_splits, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(b, h, num_splits, dtype=torch.float32, device=q.device)
        o_strides = o_part.stride()[:3]
        l_strides = lse.stride()[:2]
    _decode_split_kernel[(b, kvh, num_splits)](
        q, k_cache, v_cache, ks, vs, page_table, seq_lens, o_part, lse,
        scale * _LOG2E, num_splits, group,
        q.stride(0), q.stride(1),
        *s_strides,
        page_table.stride(0),
        *o_strides, *l_strides,
        STRIDE_P=k_cache.stride(0), STRIDE_S=k_cache.stride(1), STRIDE_H=k_cache.stride(2),
        D=d, PAGE_SIZE=page_size, BLOCK_N=block_n, G_PAD=g_pad,
        IS_FP8=is_fp8, SINGLE=single, PRECISION=precision, PDL=pdl,
        PRELOAD=pdl and not is_fp8 and b <= PRELOAD_MAX_BATCH,
        num_warps=warps, num_stages=stages, **pdl_launch(pdl),
    )
    if not single:
        _merge_kernel[(b, h)](
            o_part, lse, out, num_splits,
            *o_part.stride()[:3], *lse.stride()[:2], out.stride(0), out.stride(1),
            D=d, S_PAD=triton.next_power_of_2(num_splits), PDL=pdl,
            O_WITH_LSE=b <= MERGE_O_WITH_LSE_MAX_BATCH,
            num_warps=4 if d <= 128 else 8, num_stages=1, **pdl_launch(pdl),
        )
    return out


def pick_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132) -> int:
    """Splits of the context per (row, KV head): double them while the grid is under ~2 waves of
    the SMs and each split keeps >= 64 tokens; a power of two, at most 32."""
    splits = 1
    while (splits < 32 and batch * num_kv_heads * splits < 2 * num_sms
           and max_seq_len >= 64 * 2 * splits):
        splits *= 2
    return splits


__all__ = ["MERGE_O_WITH_LSE_MAX_BATCH", "PRELOAD_MAX_BATCH", "decode_attention",
           "default_config", "pick_num_splits"]
