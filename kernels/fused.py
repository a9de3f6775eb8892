"""The memory-bound glue of a decoder layer, fused: Triton kernels (their torch
references beside them in kernels/fused_ref.py).

Each op is a Triton wrapper `<op>(...)` (the CUDA executor) beside a plain-torch `<op>_ref(...)` in
fused_ref.py
with the same signature (the CPU executor, and what the kernels are tested against). The refs
*are* the model's semantics, HF's rounding order included:

- `rms_norm`: statistics and normalisation in fp32. The weight's dtype says how it scales:
  a weight in x's dtype (HF Llama/Qwen3) multiplies the normalised value rounded to x's dtype
  (two roundings); an fp32 weight (Qwen3.5's zero-centred norms, stored as 1 + w at load)
  multiplies it in fp32 and the product is rounded once (HF's `Qwen3_5RMSNorm`). With x in
  fp32 the two coincide. The same rule holds for every norm here (q/k norms included).
- `add_rms_norm`: r = x + residual rounded to the dtype (torch's bf16 add), y = rms_norm(r).
  NOTE: both versions write r into `residual` in place and return it as the second output.
- `silu_and_mul`: silu(gate) in fp32 rounded to the dtype, times up rounded again (HF's
  `act(gate) * up` in bf16).
- `qk_norm_rope_store_kv`: per-head RMSNorm of q and k (Qwen3; skipped for Llama), neox rotary
  (halves) in fp32 with fp32 cos/sin rounded once to the dtype, on the first `rotary_dim`
  dims of each head (the rotary table's width; Qwen3.5 turns a quarter, the rest pass
  through), K/V stored at flat cache slots (FP8 caches: quantised per (token, KV head)), q
  returned.

`add_rms_norm`'s x and `qk_norm_rope_store_kv`'s qkv may also be a linear layer's `SplitSums`
(kernels/split_sums.py): the kernel sums the slots, rounds as the linear would have, and
leaves them zero, so the GEMV needs no reduce kernel of its own.

The kernels compute the same function up to fp32 rounding inside (reduction order, FMA
contraction, Triton's approximate exp; sqrt and division are IEEE): an intermediate may round
the other way, rarely, which moves a bf16 result by an ulp of that intermediate (<= 2 ulps).

Launches: one per op, one program per token row (two for `qk_norm_rope_store_kv`: q, and k/v;
a 2-D grid over column blocks for the purely elementwise silu). The wrappers read no
device tensor on the host and size grids from shapes only, so all of them are safe to capture
in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from arle_kernels.attention import check_kv_scales
from arle_kernels.jit import gdc_launch_dependents, gdc_wait, pdl_enabled, pdl_launch
from arle_kernels.split_sums import SplitSums, consumed

# A norm row up to this many elements is held in registers (one read); longer rows loop twice.
_MAX_NORM_BLOCK = 8192
_SILU_BLOCK = 1024


# ---------------------------------------------------------------------------------------------
# RMSNorm and residual add + RMSNorm
# ---------------------------------------------------------------------------------------------

@triton.jit
def _sum_slots(ptrs, mask, stride_s, SLOTS: tl.constexpr):
    """A `SplitSums` block: its SLOTS fp32 slots (stride_s apart) summed in slot order."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, SLOTS):
        x += tl.load(ptrs + s * stride_s, mask=mask, other=0.0)
    return x


@triton.jit
def _zero_slots(ptrs, mask, stride_s, SLOTS: tl.constexpr):
    """Zeros into a `SplitSums` block's slots, once it is summed.
    NOTE: only after a `tl.debug_barrier()` that follows every `_sum_slots` of the program: the
    stores may take another register layout than the loads (and a small tile is held by
    several threads), so without it a warp ahead zeroes what another has yet to read."""
    for s in tl.static_range(SLOTS):
        tl.store(ptrs + s * stride_s, tl.zeros(ptrs.shape, tl.float32), mask=mask)


@triton.jit
def _take_slots(ptrs, mask, stride_s, SLOTS: tl.constexpr):
    """A `SplitSums` block summed, and its slots left zero."""
    x = _sum_slots(ptrs, mask, stride_s, SLOTS)
    tl.debug_barrier()
    _zero_slots(ptrs, mask, stride_s, SLOTS)
    return x


@triton.jit
def _load_row(x_row, r_row, offs, mask, HAS_RESIDUAL: tl.constexpr, stride_s,
              SLOTS: tl.constexpr):
    """x's block in fp32; with a residual, x + residual rounded to the dtype (stored back into
    the residual row) in fp32. SLOTS > 0: x is a `SplitSums` row (taken: summed, rounded to
    the residual's dtype as the linear's output is, and zeroed)."""
    if HAS_RESIDUAL:  # loaded first: in flight with x's loads (the slots' barrier waits)
        r = tl.load(r_row + offs, mask=mask, other=0.0)
    if SLOTS > 0:
        x = _take_slots(x_row + offs, mask, stride_s, SLOTS).to(r_row.dtype.element_ty)
    else:
        x = tl.load(x_row + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
        tl.store(r_row + offs, x, mask=mask)
    return x.to(tl.float32)


@triton.jit
def _inv_rms(sum_sq, n, eps):
    """1 / sqrt(mean square + eps), IEEE-rounded (Triton's default `/` and sqrt are approximate)."""
    zero = tl.zeros_like(sum_sq)  # the operands of div_rn must be fp32 tensors
    return tl.div_rn(zero + 1.0, tl.sqrt_rn(tl.div_rn(sum_sq, zero + n) + eps))


@triton.jit
def _scale_row(x, inv_rms, w, dtype: tl.constexpr, W_FP32: tl.constexpr):
    """The normalised row times the weight, in `dtype`. W_FP32 (a zero-centred norm's 1 + w):
    scaled in fp32, rounded once (HF's Qwen3_5RMSNorm); else HF Llama's rounding: the
    normalised value rounded to the dtype, times the weight rounded again."""
    if W_FP32:
        return (x * inv_rms * w).to(dtype)
    return ((x * inv_rms).to(dtype).to(tl.float32) * w.to(tl.float32)).to(dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, n, stride_x, stride_r, stride_y, stride_s, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr,
                     SLOTS: tl.constexpr, W_FP32: tl.constexpr, PDL: tl.constexpr):
    """One program per row. NUM_BLOCKS == 1 (n <= BLOCK): the row stays in registers, read once.
    Otherwise pass 1 accumulates the sum of squares block by block (and writes x + residual),
    pass 2 re-reads the row (from L2) and writes y. SLOTS > 0 (with a residual): x is a
    `SplitSums` with that many slots (stride_s apart)."""
    if PDL:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = r_ptr + row * stride_r
    y_row = y_ptr + row * stride_y
    dtype = y_ptr.dtype.element_ty
    if NUM_BLOCKS == 1:
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)  # a weight: safe before the wait
        if PDL:
            gdc_wait()
        x = _load_row(x_row, r_row, offs, mask, HAS_RESIDUAL, stride_s, SLOTS)
        inv_rms = _inv_rms(tl.sum(x * x, 0), n, eps)
        tl.store(y_row + offs, _scale_row(x, inv_rms, w, dtype, W_FP32), mask=mask)
    else:
        if PDL:
            gdc_wait()
        acc = tl.zeros([BLOCK], tl.float32)
        for i in range(NUM_BLOCKS):
            offs = i * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            x = _load_row(x_row, r_row, offs, mask, HAS_RESIDUAL, stride_s, SLOTS)
            acc += x * x
        inv_rms = _inv_rms(tl.sum(acc, 0), n, eps)
        # NOTE: pass 2 reads back the summed row pass 1 wrote (same program, same offsets);
        # the barrier makes those writes visible to every thread of the program.
        tl.debug_barrier()
        for i in range(NUM_BLOCKS):
            offs = i * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            if HAS_RESIDUAL:
                x = tl.load(r_row + offs, mask=mask, other=0.0).to(tl.float32)
            else:
                x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + offs, mask=mask, other=0.0)
            tl.store(y_row + offs, _scale_row(x, inv_rms, w, dtype, W_FP32), mask=mask)


def _norm_launch(n: int) -> tuple[int, int, int]:
    """(BLOCK, NUM_BLOCKS, num_warps) for rows of n elements: the whole row in one block up to
    _MAX_NORM_BLOCK, ~16 elements (two 16-byte bf16 vectors) per thread, 1..16 warps.
    NOTE: NUM_BLOCKS is a compile-time constant: one variant per row length (a model has ~2)."""
    block = min(triton.next_power_of_2(n), _MAX_NORM_BLOCK)
    return block, triton.cdiv(n, block), max(1, min(16, block // 512))


def _check_norm(x: Tensor, weight: Tensor) -> None:
    assert x.dim() == 2 and x.stride(1) == 1, "x: [T, N], last dim contiguous"
    assert weight.shape == (x.shape[1],) and weight.stride(0) == 1, "weight: [N]"
    assert weight.dtype in (x.dtype, torch.float32), (
        "the weight is in x's dtype (HF Llama multiplies in it) or fp32 (scaled in fp32)")


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """y = (rms_norm_fp32(x)).to(x.dtype) * weight, or (rms_norm_fp32(x) * weight).to(x.dtype)
    for an fp32 weight. x [T, N] (last dim contiguous)."""
    _check_norm(x, weight)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    t, n = x.shape
    if t == 0:
        return y
    block, num_blocks, warps = _norm_launch(n)
    pdl = pdl_enabled()
    _rms_norm_kernel[(t,)](x, x, weight, y, n, x.stride(0), 0, y.stride(0), 0, eps,
                           HAS_RESIDUAL=False, BLOCK=block, NUM_BLOCKS=num_blocks, SLOTS=0,
                           W_FP32=weight.dtype == torch.float32, PDL=pdl, num_warps=warps,
                           **pdl_launch(pdl))
    return y


def add_rms_norm(x: Tensor | SplitSums, residual: Tensor, weight: Tensor,
                 eps: float) -> tuple[Tensor, Tensor]:
    """r = x + residual (rounded to the dtype), y = rms_norm(r). Returns (y, r). x may be a
    linear layer's `SplitSums` (summed here, and left zero).

    NOTE: r is written into `residual` in place, and `residual` itself is returned as r."""
    _check_norm(residual, weight)
    sums = x if isinstance(x, SplitSums) else None
    xs = x.slots if isinstance(x, SplitSums) else x
    assert (sums.dtype if sums is not None else xs.dtype) == residual.dtype
    assert residual.shape == xs.shape[-2:] and xs.stride(-1) == 1
    y = torch.empty_like(residual, memory_format=torch.contiguous_format)
    t, n = residual.shape
    if t == 0:
        return y, residual
    block, num_blocks, warps = _norm_launch(n)
    pdl = pdl_enabled()
    _rms_norm_kernel[(t,)](xs, residual, weight, y, n, xs.stride(-2), residual.stride(0),
                           y.stride(0), xs.stride(0) if sums is not None else 0, eps,
                           HAS_RESIDUAL=True, BLOCK=block, NUM_BLOCKS=num_blocks,
                           SLOTS=xs.shape[0] if sums is not None else 0,
                           W_FP32=weight.dtype == torch.float32, PDL=pdl, num_warps=warps,
                           **pdl_launch(pdl))
    if sums is not None:
        consumed(sums)
    return y, residual


# ---------------------------------------------------------------------------------------------
# SiLU(gate) * up
# ---------------------------------------------------------------------------------------------

@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up for gate / up in the model dtype, with HF's two roundings to it (the
    activation, then the product). Also the epilogue of the GEMV's gate_up projection."""
    dtype = gate.dtype
    g = gate.to(tl.float32)
    act = tl.div_rn(g, 1.0 + tl.exp(-g)).to(dtype)
    return (act.to(tl.float32) * up.to(tl.float32)).to(dtype)


@triton.jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, inter, stride_gu, stride_out, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    """Program (row, j): columns [j*BLOCK, (j+1)*BLOCK) of out = silu(gate) * up for one row of
    gate_up = [gate | up], with HF's two roundings to the dtype."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gu_row = gu_ptr + row * stride_gu
    gate = tl.load(gu_row + offs, mask=mask, other=0.0)
    up = tl.load(gu_row + inter + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + offs, silu_mul(gate, up), mask=mask)


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """gate_up [T, 2I] (gate first) -> silu(gate) * up [T, I]."""
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    grid = (t, triton.cdiv(inter, _SILU_BLOCK))
    pdl = pdl_enabled()
    _silu_and_mul_kernel[grid](gate_up, out, inter, gate_up.stride(0), out.stride(0),
                               BLOCK=_SILU_BLOCK, PDL=pdl, num_warps=4, **pdl_launch(pdl))
    return out


# ---------------------------------------------------------------------------------------------
# q/k norm + rotary + K/V store into the paged cache
# ---------------------------------------------------------------------------------------------

@triton.jit
def _head_cols(N_HEADS: tl.constexpr, BLOCK_HEADS: tl.constexpr, D: tl.constexpr,
               START: tl.constexpr, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    """Offsets and mask of columns [START, START + WIDTH) of N_HEADS consecutive heads,
    [BLOCK_HEADS, BLOCK_W] in the [heads, D] layout."""
    heads = tl.arange(0, BLOCK_HEADS)
    cols = tl.arange(0, BLOCK_W)
    offs = heads[:, None] * D + START + cols[None, :]
    mask = (heads < N_HEADS)[:, None] & (cols < WIDTH)[None, :]
    return offs, mask


@triton.jit
def _load_block(ptrs, mask, stride_s, SLOTS: tl.constexpr, dtype: tl.constexpr):
    """A block of a qkv row in `dtype`: loaded, or (SLOTS > 0) summed from its `SplitSums`
    (whose slots the caller then zeroes: `_zero_slots`)."""
    if SLOTS > 0:
        x = _sum_slots(ptrs, mask, stride_s, SLOTS).to(dtype)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0).to(dtype)
    return x


@triton.jit
def _norm_rope(x1, x2, xp, w_ptr, eps, cos, sin, D: tl.constexpr, HALF: tl.constexpr,
               ROT: tl.constexpr, PASS: tl.constexpr, BLOCK_HALF: tl.constexpr,
               BLOCK_PASS: tl.constexpr, HAS_NORM: tl.constexpr, W_FP32: tl.constexpr):
    """Heads given as three pieces: the rotary halves x1 / x2 [heads, BLOCK_HALF] and the
    pass-through dims xp [heads, BLOCK_PASS] (zeros past PASS). Optional per-head RMSNorm over
    all D dims, then neox rotary on the halves; the three pieces in x1's dtype."""
    dtype = x1.dtype
    cols = tl.arange(0, BLOCK_HALF)
    pcols = tl.arange(0, BLOCK_PASS)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if HAS_NORM:
        xpf = xp.to(tl.float32)
        sum_sq = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1) + tl.sum(xpf * xpf, 1)
        inv_rms = _inv_rms(sum_sq, D, eps)[:, None]
        w1 = tl.load(w_ptr + cols, mask=cols < HALF, other=0.0)[None, :]
        w2 = tl.load(w_ptr + HALF + cols, mask=cols < HALF, other=0.0)[None, :]
        wp = tl.load(w_ptr + ROT + pcols, mask=pcols < PASS, other=0.0)[None, :]
        # NOTE: rounded to the dtype as the ref (HF's RMSNorm), before the fp32 rotary
        x1 = _scale_row(x1, inv_rms, w1, dtype, W_FP32).to(tl.float32)
        x2 = _scale_row(x2, inv_rms, w2, dtype, W_FP32).to(tl.float32)
        xp = _scale_row(xpf, inv_rms, wp, dtype, W_FP32)
    o1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype)
    o2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype)
    return o1, o2, xp.to(dtype)


@triton.jit
def _store_kv(cache_ptr, scale_ptr, x1, x2, xp, offs, mask, p_offs, p_mask, scale_offs,
              head_mask, HALF: tl.constexpr, FP8: tl.constexpr):
    """Store one token's KV heads, as pieces: halves x1 / x2 at cache offsets offs / offs +
    HALF, the pass-through dims xp at p_offs. FP8: one scale per head, max(amax |x|, 1e-6) /
    448, stored at scale_offs; values x / scale."""
    if FP8:
        a1 = x1.to(tl.float32)
        a2 = x2.to(tl.float32)
        ap = xp.to(tl.float32)  # zeros where masked: they leave amax alone
        amax = tl.maximum(tl.maximum(tl.max(tl.abs(a1), 1), tl.max(tl.abs(a2), 1)),
                          tl.max(tl.abs(ap), 1))
        scale = tl.div_rn(tl.maximum(amax, 1e-6), 448.0)  # FP8_MIN_AMAX, FP8_MAX
        tl.store(scale_ptr + scale_offs, scale, mask=head_mask)
        # NOTE: the clamp only guards a rounding of amax / scale a hair above 448
        a1 = tl.minimum(tl.maximum(tl.div_rn(a1, scale[:, None]), -448.0), 448.0)
        a2 = tl.minimum(tl.maximum(tl.div_rn(a2, scale[:, None]), -448.0), 448.0)
        ap = tl.minimum(tl.maximum(tl.div_rn(ap, scale[:, None]), -448.0), 448.0)
        tl.store(cache_ptr + offs, a1.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(cache_ptr + offs + HALF, a2.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(cache_ptr + p_offs, ap.to(cache_ptr.dtype.element_ty), mask=p_mask)
    else:
        tl.store(cache_ptr + offs, x1.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(cache_ptr + offs + HALF, x2.to(cache_ptr.dtype.element_ty), mask=mask)
        tl.store(cache_ptr + p_offs, xp.to(cache_ptr.dtype.element_ty), mask=p_mask)


@triton.jit
def _load_head_pieces(row, offs, mask, p_offs, p_mask, stride_s, SLOTS: tl.constexpr,
                      HALF: tl.constexpr, dtype: tl.constexpr):
    """A row's heads as (x1, x2, xp) in `dtype`; from a `SplitSums`, its slots left zero."""
    x1 = _load_block(row + offs, mask, stride_s, SLOTS, dtype)
    x2 = _load_block(row + offs + HALF, mask, stride_s, SLOTS, dtype)
    xp = _load_block(row + p_offs, p_mask, stride_s, SLOTS, dtype)
    if SLOTS > 0:
        tl.debug_barrier()  # see _zero_slots
        _zero_slots(row + offs, mask, stride_s, SLOTS)
        _zero_slots(row + offs + HALF, mask, stride_s, SLOTS)
        _zero_slots(row + p_offs, p_mask, stride_s, SLOTS)
    return x1, x2, xp


@triton.jit
def _qk_norm_rope_store_kv_kernel(
    qkv_ptr, pos_ptr, cs_ptr, qw_ptr, kw_ptr, slot_ptr, q_ptr,
    kc_ptr, vc_ptr, ks_ptr, vs_ptr,
    eps, page_size, stride_qkv, stride_cs,
    stride_cp, stride_co, stride_ch, stride_sp, stride_so, stride_sh, stride_s,
    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    PASS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    HAS_NORM: tl.constexpr, W_FP32: tl.constexpr, FP8: tl.constexpr, SLOTS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Two programs per token (t, part): part 0 its q heads (norm + rope -> q out), part 1,
    unless its slot is < 0, its k heads (norm + rope) and v heads into the cache at the slot.
    Every element of the token's qkv row is read once and q / k / v written once, each head
    as three pieces: the rotary halves [0, HALF) and [HALF, 2 HALF), and the PASS dims after
    them (partial rotary; none for full rotary).
    SLOTS > 0: qkv is a `SplitSums` with that many slots (stride_s apart); part 1 takes (and
    zeroes) its k / v columns even where it writes nothing (slot < 0).
    NOTE: two parts, so q's and k/v's chains of loads and stores run side by side (at batch 1
    the kernel is one token: its latency is the cost)."""
    if PDL:
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    # positions, slots and the rotary table are the step's metadata: safe before the wait
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    cs_row = cs_ptr + pos * stride_cs
    cos = tl.load(cs_row + cols, mask=cols < HALF, other=0.0)
    sin = tl.load(cs_row + HALF + cols, mask=cols < HALF, other=0.0)
    if PDL:
        gdc_wait()
    row = qkv_ptr + t * stride_qkv
    dtype = q_ptr.dtype.element_ty
    ROT: tl.constexpr = 2 * HALF

    if part == 0:
        offs, mask = _head_cols(H, BLOCK_H, D, 0, HALF, BLOCK_HALF)
        p_offs, p_mask = _head_cols(H, BLOCK_H, D, ROT, PASS, BLOCK_PASS)
        q1, q2, qp = _load_head_pieces(row, offs, mask, p_offs, p_mask, stride_s, SLOTS, HALF,
                                       dtype)
        q1, q2, qp = _norm_rope(q1, q2, qp, qw_ptr, eps, cos, sin, D, HALF, ROT, PASS,
                                BLOCK_HALF, BLOCK_PASS, HAS_NORM, W_FP32)
        q_row = q_ptr + t * (H * D)
        tl.store(q_row + offs, q1, mask=mask)
        tl.store(q_row + offs + HALF, q2, mask=mask)
        tl.store(q_row + p_offs, qp, mask=p_mask)
    elif (slot >= 0) | (SLOTS > 0):  # NOTE: slot -1 marks a padding row (CUDA graph)
        offs, mask = _head_cols(KVH, BLOCK_KVH, D, 0, HALF, BLOCK_HALF)
        p_offs, p_mask = _head_cols(KVH, BLOCK_KVH, D, ROT, PASS, BLOCK_PASS)
        k_row = row + H * D
        v_row = k_row + KVH * D
        # (taken even for a padding row: a SplitSums' slots must be left zero)
        k1, k2, kp = _load_head_pieces(k_row, offs, mask, p_offs, p_mask, stride_s, SLOTS,
                                       HALF, dtype)
        v1, v2, vp = _load_head_pieces(v_row, offs, mask, p_offs, p_mask, stride_s, SLOTS,
                                       HALF, dtype)
        if slot >= 0:
            k1, k2, kp = _norm_rope(k1, k2, kp, kw_ptr, eps, cos, sin, D, HALF, ROT, PASS,
                                    BLOCK_HALF, BLOCK_PASS, HAS_NORM, W_FP32)
            heads = tl.arange(0, BLOCK_KVH)
            page = slot // page_size
            in_page = slot % page_size
            base = page * stride_cp + in_page * stride_co + heads[:, None] * stride_ch
            c_offs = base + cols[None, :]
            cp_offs = base + ROT + tl.arange(0, BLOCK_PASS)[None, :]
            s_offs = page * stride_sp + in_page * stride_so + heads * stride_sh
            head_mask = heads < KVH
            _store_kv(kc_ptr, ks_ptr, k1, k2, kp, c_offs, mask, cp_offs, p_mask, s_offs,
                      head_mask, HALF, FP8)
            _store_kv(vc_ptr, vs_ptr, v1, v2, vp, c_offs, mask, cp_offs, p_mask, s_offs,
                      head_mask, HALF, FP8)


def _check_qk(qkv: Tensor, positions: Tensor, cos_sin: Tensor, q_norm: Tensor | None,
              k_norm: Tensor | None, num_heads: int, num_kv_heads: int, k_cache: Tensor,
              v_cache: Tensor, kv_slots: Tensor, k_scale: Tensor | None,
              v_scale: Tensor | None, dtype: torch.dtype) -> None:
    t, d = qkv.shape[0], k_cache.shape[-1]
    assert qkv.dim() == 2 and qkv.stride(1) == 1, "qkv: [T, (H + 2 KVH) * D], rows contiguous"
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * d, f"qkv width {qkv.shape[1]}"
    assert positions.shape == (t,) and kv_slots.shape == (t,)
    assert positions.stride(0) == 1 and kv_slots.stride(0) == 1
    assert cos_sin.dtype == torch.float32 and cos_sin.dim() == 2 and cos_sin.stride(1) == 1
    rot = cos_sin.shape[1]
    assert rot % 2 == 0 and 0 < rot <= d, f"rotary table width {rot}: cos | sin, at most {d}"
    assert (q_norm is None) == (k_norm is None), "q and k norms come together"
    for w in (q_norm, k_norm):
        assert w is None or (w.shape == (d,) and w.dtype in (dtype, torch.float32)
                             and w.stride(0) == 1)
    assert q_norm is None or k_norm is None or q_norm.dtype == k_norm.dtype
    assert k_cache.dim() == 4 and k_cache.shape[2] == num_kv_heads
    assert v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype
    assert v_cache.stride() == k_cache.stride() and k_cache.stride(3) == 1
    check_kv_scales(k_cache, v_cache, k_scale, v_scale)


def qk_norm_rope_store_kv(qkv: Tensor | SplitSums, positions: Tensor, cos_sin: Tensor,
                          q_norm: Tensor | None, k_norm: Tensor | None, eps: float,
                          num_heads: int, num_kv_heads: int,
                          k_cache: Tensor, v_cache: Tensor, kv_slots: Tensor,
                          k_scale: Tensor | None = None,
                          v_scale: Tensor | None = None) -> Tensor:
    """Per-head RMSNorm of q and k (if q_norm/k_norm are given; fp32 weights: scaled in fp32,
    see the module docstring), neox rotary on both over the first R dims of each head, K/V
    written into the paged caches at kv_slots (FP8: quantised, scales into k_scale/v_scale).

    qkv [T, (H + 2 KVH) * D]: q heads, k heads, v heads (rows may be strided). positions [T]
    (int, < len(cos_sin)). cos_sin [max_pos, R] float32: cos | sin of the R/2 rotary pairs per
    position; R = D (full rotary) or fewer (partial: dims R.. pass through).
    k_cache / v_cache [num_pages, page_size, KVH, D]; kv_slots [T] page * page_size + offset,
    < 0: do not write. Returns q [T, H, D] in qkv's dtype. qkv may be the qkv projection's
    `SplitSums` (summed here, and left zero)."""
    sums = qkv if isinstance(qkv, SplitSums) else None
    rows = qkv.slots[0] if isinstance(qkv, SplitSums) else qkv  # a [T, W] view for the checks
    dtype = sums.dtype if sums is not None else rows.dtype
    _check_qk(rows, positions, cos_sin, q_norm, k_norm, num_heads, num_kv_heads, k_cache,
              v_cache, kv_slots, k_scale, v_scale, dtype)
    t, d = rows.shape[0], k_cache.shape[-1]
    q = torch.empty(t, num_heads, d, dtype=dtype, device=rows.device)
    if t == 0:
        return q
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    # Unused pointer / stride arguments get harmless stand-ins (their branches compile away).
    ks = k_scale if k_scale is not None else k_cache
    vs = v_scale if v_scale is not None else v_cache
    s_strides = k_scale.stride() if k_scale is not None else (0, 0, 0)
    qw = q_norm if q_norm is not None else q
    kw = k_norm if k_norm is not None else q
    half = cos_sin.shape[1] // 2
    passed = d - 2 * half
    block_h = triton.next_power_of_2(num_heads)
    pdl = pdl_enabled()
    src = sums.slots if sums is not None else rows
    _qk_norm_rope_store_kv_kernel[(t, 2)](
        src, positions, cos_sin, qw, kw, kv_slots, q, k_cache, v_cache, ks, vs,
        eps, k_cache.shape[1], rows.stride(0), cos_sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *s_strides,
        src.stride(0) if sums is not None else 0,
        H=num_heads, KVH=num_kv_heads, D=d, HALF=half, PASS=passed, BLOCK_H=block_h,
        BLOCK_KVH=triton.next_power_of_2(num_kv_heads), BLOCK_HALF=triton.next_power_of_2(half),
        # (an empty, fully masked piece of width 1 where every dim rotates)
        BLOCK_PASS=triton.next_power_of_2(max(passed, 1)),
        HAS_NORM=q_norm is not None,
        W_FP32=q_norm is not None and q_norm.dtype == torch.float32, FP8=fp8,
        SLOTS=src.shape[0] if sums is not None else 0,
        PDL=pdl, num_warps=4 if block_h * d <= 4096 else 8, **pdl_launch(pdl))
    if sums is not None:
        consumed(sums)
    return q


