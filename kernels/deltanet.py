"""Gated DeltaNet (Qwen3.5's linear-attention layers): the causal conv, the gated delta rule over
each request's state slot, and the gated RMSNorm after it. The Triton kernels; their plain-torch
references (`*_ref`: the CPU executor, and what the kernels are tested against) sit beside
them in kernels/deltanet_ref.py.

The math is transformers' `qwen3_5` GatedDeltaNet, its rounding order included:
- causal depthwise conv1d (kernel K, no bias) over [conv state | the row's inputs], summed in
  fp32 and rounded to the model dtype, then SiLU (in fp32, rounded again), as HF's conv in the
  weight dtype followed by its activation;
- q, k, v split from the conv output ([q | k | v], Hk key heads of dk, Hv value heads of dv;
  each key head serves Hv/Hk consecutive value heads); q and k L2-normalised in fp32
  (x * rsqrt(sum x^2 + 1e-6)), q scaled by dk**-0.5;
- beta = sigmoid(b) (rounded to b's dtype, as HF's `b.sigmoid()`), g = -exp(a_log) *
  softplus(a + dt_bias) in fp32;
- per token, in fp32: S *= exp(g); S += k (beta (v - k S)); o = q S, with S [dk, dv] per value
  head; o rounded to the model dtype.

States: `conv_state [S, C, K-1]` holds a slot's last K-1 conv inputs (model dtype, oldest
first), `ssm_state [S, Hv, dk, dv]` its delta-rule state (fp32). A call's rows (as a step's:
the first `num_decode` rows one token each, then extend rows delimited by `cu_q_lens`) each
continue from their slot's states and leave them at the row's end. Prefix caching: with
`boundary_conv/boundary_ssm`, a row that crosses a multiple p of `page_size` (start < p <= end)
also writes the states after position p - 1 (the last such p) into the boundary tensors at its
slot. A row whose slot is negative is padding: it reads and writes no state, its output is 0.

The Triton op (`gated_delta`), graph-safe (grids from shapes and host ints, no host reads):
- Decode rows: `_recurrent_kernel`, ONE launch, one program per (row, value head, block of
  BV value columns). The state slice [dk, BV] fp32 stays in registers; each program redoes the
  conv of its key head's q/k channels (2 dk channels x K taps: cheap) and does the whole step:
  conv update, SiLU, L2 norms, gates, delta rule, output, boundary copy. Why blocks of dv: a
  decode step is memory-bound on the state (2 MB per row and layer at Qwen3.5-4B's shapes) and
  at batch 1 (row, head) gives only 32 programs for 132 SMs; BV = 16 gives 256. The q/k conv
  state of a key head is read by all its G * dv/BV programs, so the last of them to finish
  (an int32 counter per (row, key head), left zero) shifts it in; each program shifts its own
  value channels.
- Extend rows (the chunked form, chunks of CHUNK = 64, the UT transform): `_conv_kernel`
  (varlen causal conv + SiLU continuing each row's conv state, into a workspace),
  `_chunk_prep_kernel` (per 64-token block and value head, in parallel: everything that does
  not depend on the state, including (I + L)^-1 by forward substitution in fp32),
  `_chunk_rule_kernel` (per row, value head and value block: the chunks in order, the state in
  registers, 4 dots per chunk; then the conv state). Chunks are the extend tokens' own 64-token
  blocks cut at row ends, so the prep needs no per-row plan from the host. A page boundary
  inside a chunk gets its state from that chunk's quantities (no split of the row).
  `chunked=False` runs the extend rows token by token in `_recurrent_kernel` instead.
- Known limits: the chunked path keeps fp32 workspaces of ~74 KB per token (W, QG, KD, U, P at
  Qwen3.5-4B's shapes: ~300 MB for a 4096-token step) besides the conv output; a 1-token
  extend row (a decode row of an extend graph) costs a whole chunk in the rule kernel; the
  rule and prep kernels spill a few hundred bytes per thread (ptxas, sm_90); dots in TF32.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from arle_kernels.deltanet_ref import L2_EPS, Keep, kept_out
from arle_kernels.jit import gdc_launch_dependents, gdc_wait, jit_varying, pdl_enabled, pdl_launch

# ---------------------------------------------------------------------------------------------
# Triton: pieces shared by the kernels
# ---------------------------------------------------------------------------------------------

@triton.jit
def _inv_sqrt(ss, eps):
    """1 / sqrt(ss + eps), IEEE-rounded (Triton's default `/` and sqrt are approximate)."""
    one = tl.zeros_like(ss) + 1.0  # the operands of div_rn must be fp32 tensors
    return tl.div_rn(one, tl.sqrt_rn(ss + eps))


@triton.jit
def _silu_rounded(acc, dtype: tl.constexpr):
    """The conv's fp32 sum rounded to the model dtype, SiLU in fp32 rounded again (HF's conv
    in the weight dtype, then its activation), back in fp32."""
    y = acc.to(dtype).to(tl.float32)
    return tl.div_rn(y, 1.0 + tl.exp(-y)).to(dtype).to(tl.float32)


@triton.jit
def _gates(a, b, neg_a, dt_bias, B_DTYPE: tl.constexpr):
    """(g, beta) in fp32: g = -exp(a_log) * softplus(a + dt_bias) (torch's softplus: the input
    above 20, else log1p(exp(x)), here with the log1p correction for tiny exp(x)); beta =
    sigmoid(b) rounded to b's dtype."""
    x = a.to(tl.float32) + dt_bias
    u = tl.exp(x)
    w = 1.0 + u
    sp = tl.where(x > 20.0, x, tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0))))
    bf = b.to(tl.float32)
    beta = tl.div_rn(tl.zeros_like(bf) + 1.0, 1.0 + tl.exp(-bf)).to(B_DTYPE).to(tl.float32)
    return neg_a * sp, beta


@triton.jit
def _window(x_row, stride_x, cs_row, stride_cc, stride_ck, i, ch, cmask, taps, tmask,
            KM1: tl.constexpr):
    """Conv inputs [channels, taps] at row-relative positions i + tap - KM1 of the sequence
    [conv state (K-1 entries) | the row's tokens]: negative positions from the slot's conv
    state, the rest from mixed_qkv (x_row: the row's first token). In the state's dtype."""
    m = i + taps - KM1
    in_x = tmask & (m >= 0)
    in_s = tmask & (m < 0)
    xv = tl.load(x_row + (m[None, :] * stride_x + ch[:, None]),
                 mask=cmask[:, None] & in_x[None, :], other=0.0)
    sv = tl.load(cs_row + (ch[:, None] * stride_cc + (m + KM1)[None, :] * stride_ck),
                 mask=cmask[:, None] & in_s[None, :], other=0.0)
    return tl.where(in_x[None, :], xv.to(cs_row.dtype.element_ty), sv)


@triton.jit
def _store_conv_state(x_row, stride_x, cs_ptr, bcs_ptr, cs_off, stride_cc, stride_ck, n, snap,
                      ch, cmask, taps, KM1: tl.constexpr, BOUNDARY: tl.constexpr):
    """Channels ch of the slot's conv state (cs_off: its slot's offset) after the row's n
    tokens, and (BOUNDARY, snap > 0) into the boundary tensor after its first snap tokens.
    NOTE: the window reads the old state (a row shorter than K-1 keeps some of it): every
    load is done before any store (the barrier), as a tile's loads and stores may be held by
    different threads."""
    wmask = taps < KM1
    new = _window(x_row, stride_x, cs_ptr + cs_off, stride_cc, stride_ck, n, ch, cmask, taps,
                  wmask, KM1)
    if BOUNDARY:  # snap <= 0 (no boundary) is stored nowhere; read at 0, inside the state
        bnd = _window(x_row, stride_x, cs_ptr + cs_off, stride_cc, stride_ck,
                      tl.maximum(snap, 0), ch, cmask, taps, wmask, KM1)
    tl.debug_barrier()
    offs = cs_off + ch[:, None] * stride_cc + taps[None, :] * stride_ck
    mask = cmask[:, None] & wmask[None, :]
    tl.store(cs_ptr + offs, new, mask=mask)
    if BOUNDARY:
        # NOTE: the scalar test spelled out at the tile's shape (the interpreter refuses a
        # mask broadcast from a scalar)
        tl.store(bcs_ptr + offs, bnd, mask=mask & ((tl.zeros_like(offs) + snap) > 0))


@triton.jit
def _keep_conv(x_row, stride_x, cs_row, kc_row, stride_cc, stride_ck, n, ch, cmask, taps,
               KM1: tl.constexpr):
    """Channels ch of the conv state after the row's first n tokens, into kc_row (a kept
    entry's [C, K-1], the conv state's strides). Reads the slot's old state, which is written
    only after the row's last token."""
    wmask = taps < KM1
    w = _window(x_row, stride_x, cs_row, stride_cc, stride_ck, n, ch, cmask, taps, wmask, KM1)
    tl.store(kc_row + ch[:, None] * stride_cc + taps[None, :] * stride_ck, w,
             mask=cmask[:, None] & wmask[None, :])


@triton.jit
def _token_rows(cu_ptr, e, num_rows, steps):
    """The row of each extend token e (< cu[num_rows]): the last j < num_rows with cu[j] <= e
    (empty rows share their cu entry with the next row), by binary search in `steps` =
    ceil(log2(num_rows)) halvings."""
    lo = tl.zeros_like(e)
    hi = lo + num_rows
    for _ in range(steps):
        mid = (lo + hi) // 2
        go = tl.load(cu_ptr + mid) <= e
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return lo


# ---------------------------------------------------------------------------------------------
# Triton: the recurrent kernel (decode rows; extend rows token by token)
# ---------------------------------------------------------------------------------------------

@jit_varying("x_ptr", "a_ptr", "b_ptr", "slots_ptr", "seq_lens_ptr", "cu_ptr", "keep_ptr",
             "row0", "tok_base")
def _recurrent_kernel(x_ptr, a_ptr, b_ptr, w_ptr, alog_ptr, dtb_ptr, cs_ptr, ss_ptr,
                      slots_ptr, seq_lens_ptr, cu_ptr, out_ptr, bcs_ptr, bss_ptr, cnt_ptr,
                      keep_ptr, kc_ptr, ks_ptr, row0, tok_base, page_size, scale, eps,
                      stride_x, stride_a, stride_b, stride_w, stride_cs, stride_cc, stride_ck,
                      stride_ss, stride_sh, stride_sk, stride_ot, stride_oh,
                      stride_ke, stride_ki, stride_se, stride_si,
                      HK: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      K: tl.constexpr, KP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      NV: tl.constexpr, VARLEN: tl.constexpr, BOUNDARY: tl.constexpr,
                      KEEP: tl.constexpr, PDL: tl.constexpr):
    """Program (row, value head, block of BV value columns): the whole step of that slice of the
    row, token by token, the state slice [dk, BV] in registers. VARLEN: extend rows (row j's
    tokens tok_base + cu[j] ..), else decode rows (row i is token i). Each program writes the
    conv state of its own value channels; the q/k channels of a key head are read by all G * NV
    programs of the head, so the last of them to finish (a counter per (row, key head), reset
    by that program) writes them. PDL: before `gdc_wait`, only the step's metadata and the
    weights are read (jit.py's rule); the inputs and the states after it. KEEP (extend rows):
    only the rows with a keep entry (`Keep`) run, each also storing the state after each token
    i at [entry, i]: its ssm slice and its own value channels' conv window; the first program
    of each key head also stores its q/k channels' (read before the counter, as the others'
    reads are)."""
    if PDL:
        gdc_launch_dependents()
    pid_r = tl.program_id(0)
    hv = tl.program_id(1)
    bv = tl.program_id(2)
    row = row0 + pid_r
    slot = tl.load(slots_ptr + row).to(tl.int64)
    entry = -1
    if KEEP:
        entry = tl.load(keep_ptr + row).to(tl.int64)
        if entry < 0:
            return  # not a kept row: the step's other launch ran it
    if VARLEN:
        c0 = tl.load(cu_ptr + pid_r)
        n = tl.load(cu_ptr + pid_r + 1) - c0
        tok0 = (tok_base + c0).to(tl.int64)
        if n == 0:
            return
    else:
        n = 1
        tok0 = pid_r.to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    offs_v = bv * BV + tl.arange(0, BV)
    vmask = offs_v < DV
    out_row = out_ptr + tok0 * stride_ot + hv * stride_oh
    if slot < 0:  # padding: no state read or written
        if PDL:
            gdc_wait()
        for i in range(n):
            tl.store(out_row + i * stride_ot + offs_v, tl.zeros([BV], dtype), mask=vmask)
        return
    kh = hv // G
    offs_k = tl.arange(0, BK)
    kmask = offs_k < DK
    q_ch = kh * DK + offs_k
    k_ch = HK * DK + q_ch
    v_ch = 2 * HK * DK + hv * DV + offs_v
    taps = tl.arange(0, KP)
    tmask = taps < K
    wq = tl.load(w_ptr + q_ch[:, None] * stride_w + taps[None, :],
                 mask=kmask[:, None] & tmask[None, :], other=0.0).to(tl.float32)
    wk = tl.load(w_ptr + k_ch[:, None] * stride_w + taps[None, :],
                 mask=kmask[:, None] & tmask[None, :], other=0.0).to(tl.float32)
    wv = tl.load(w_ptr + v_ch[:, None] * stride_w + taps[None, :],
                 mask=vmask[:, None] & tmask[None, :], other=0.0).to(tl.float32)
    neg_a = -tl.exp(tl.load(alog_ptr + hv).to(tl.float32))
    dtb = tl.load(dtb_ptr + hv).to(tl.float32)
    end = tl.load(seq_lens_ptr + row)
    if PDL:
        gdc_wait()
    x_row = x_ptr + tok0 * stride_x
    cs_off = slot * stride_cs
    cs_row = cs_ptr + cs_off
    s_base = slot * stride_ss + hv * stride_sh
    s_off = offs_k[:, None] * stride_sk + offs_v[None, :]
    smask = kmask[:, None] & vmask[None, :]
    s = tl.load(ss_ptr + s_base + s_off, mask=smask, other=0.0)
    snap = end // page_size * page_size - (end - n)  # tokens before the boundary (> 0: one)
    for i in range(n):
        q = tl.sum(_window(x_row, stride_x, cs_row, stride_cc, stride_ck, i, q_ch, kmask, taps,
                           tmask, K - 1).to(tl.float32) * wq, 1)
        k = tl.sum(_window(x_row, stride_x, cs_row, stride_cc, stride_ck, i, k_ch, kmask, taps,
                           tmask, K - 1).to(tl.float32) * wk, 1)
        v = tl.sum(_window(x_row, stride_x, cs_row, stride_cc, stride_ck, i, v_ch, vmask, taps,
                           tmask, K - 1).to(tl.float32) * wv, 1)
        q = _silu_rounded(q, dtype)
        k = _silu_rounded(k, dtype)
        v = _silu_rounded(v, dtype)
        q = q * _inv_sqrt(tl.sum(q * q, 0), eps) * scale
        k = k * _inv_sqrt(tl.sum(k * k, 0), eps)
        t = tok0 + i
        g, beta = _gates(tl.load(a_ptr + t * stride_a + hv), tl.load(b_ptr + t * stride_b + hv),
                         neg_a, dtb, b_ptr.dtype.element_ty)
        s = s * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], 0)) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], 0)
        tl.store(out_row + i * stride_ot + offs_v, o.to(dtype), mask=vmask)
        if BOUNDARY:  # noqa: SIM102 (a compile-time if, then a runtime one)
            if i + 1 == snap:
                tl.store(bss_ptr + s_base + s_off, s, mask=smask)
        if KEEP:
            kept = entry * stride_se + i * stride_si + hv * stride_sh
            tl.store(ks_ptr + kept + s_off, s, mask=smask)
            kc_row = kc_ptr + entry * stride_ke + i * stride_ki
            _keep_conv(x_row, stride_x, cs_row, kc_row, stride_cc, stride_ck, i + 1, v_ch, vmask,
                       taps, K - 1)
            if (hv % G == 0) & (bv == 0):
                _keep_conv(x_row, stride_x, cs_row, kc_row, stride_cc, stride_ck, i + 1, q_ch,
                           kmask, taps, K - 1)
                _keep_conv(x_row, stride_x, cs_row, kc_row, stride_cc, stride_ck, i + 1, k_ch,
                           kmask, taps, K - 1)
    tl.store(ss_ptr + s_base + s_off, s, mask=smask)
    _store_conv_state(x_row, stride_x, cs_ptr, bcs_ptr, cs_off, stride_cc, stride_ck, n, snap,
                      v_ch, vmask, taps, K - 1, BOUNDARY)
    # NOTE: the barrier puts every thread's reads of the q/k state before thread 0's release
    # (the counter); the acquire side's barrier puts the last program's writes after it.
    tl.debug_barrier()
    cnt = cnt_ptr + row * HK + kh
    if tl.atomic_add(cnt, 1, sem="acq_rel") == G * NV - 1:
        tl.debug_barrier()
        _store_conv_state(x_row, stride_x, cs_ptr, bcs_ptr, cs_off, stride_cc, stride_ck, n,
                          snap, q_ch, kmask, taps, K - 1, BOUNDARY)
        _store_conv_state(x_row, stride_x, cs_ptr, bcs_ptr, cs_off, stride_cc, stride_ck, n,
                          snap, k_ch, kmask, taps, K - 1, BOUNDARY)
        tl.store(cnt, 0)


# ---------------------------------------------------------------------------------------------
# Triton: the chunked extend path (varlen conv, chunk prep, chunked rule)
# ---------------------------------------------------------------------------------------------

@jit_varying("x_ptr", "slots_ptr", "cu_ptr", "tok_base", "num_rows", "steps")
def _conv_kernel(x_ptr, w_ptr, cs_ptr, slots_ptr, cu_ptr, y_ptr, tok_base, num_rows, steps, C,
                 stride_x, stride_w, stride_cs, stride_cc, stride_ck, stride_y,
                 K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Program (block of BT extend tokens, block of BC channels): the causal conv + SiLU of
    those tokens, each continuing its row's conv state (no state is written here: the rule
    kernel does, once every read is done). Tokens past the rows are skipped."""
    e = tl.program_id(0) * BT + tl.arange(0, BT)
    valid = e < tl.load(cu_ptr + num_rows)
    j = _token_rows(cu_ptr, e, num_rows, steps)
    i = e - tl.load(cu_ptr + j)
    slot = tl.load(slots_ptr + j)
    ch = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = ch < C
    acc = tl.zeros([BT, BC], tl.float32)
    for d in tl.static_range(K):
        m = i + d - (K - 1)
        in_x = valid & (m >= 0)
        in_s = valid & (m < 0) & (slot >= 0)
        xv = tl.load(x_ptr + ((tok_base + e + d - (K - 1))[:, None] * stride_x + ch[None, :]),
                     mask=in_x[:, None] & cmask[None, :], other=0.0)
        sv = tl.load(cs_ptr + (slot[:, None] * stride_cs + ch[None, :] * stride_cc
                               + (m + K - 1)[:, None] * stride_ck),
                     mask=in_s[:, None] & cmask[None, :], other=0.0)
        w = tl.load(w_ptr + ch * stride_w + d, mask=cmask, other=0.0).to(tl.float32)
        acc += tl.where(in_x[:, None], xv.to(tl.float32), sv.to(tl.float32)) * w[None, :]
    y = _silu_rounded(acc, y_ptr.dtype.element_ty)
    tl.store(y_ptr + (e[:, None] * stride_y + ch[None, :]), y,
             mask=valid[:, None] & cmask[None, :])


@jit_varying("a_ptr", "b_ptr", "cu_ptr", "tok_base", "num_rows", "steps")
def _chunk_prep_kernel(y_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, cu_ptr, w_ptr, u_ptr, qg_ptr,
                       kd_ptr, p_ptr, g_ptr, tok_base, num_rows, steps, scale, eps,
                       stride_y, stride_a, stride_b, stride_wt, stride_wh, stride_ut,
                       stride_uh, stride_pt, stride_ph, stride_gt,
                       HK: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BK: tl.constexpr, BDV: tl.constexpr, BT: tl.constexpr,
                       DOT: tl.constexpr):
    """Program (block of BT extend tokens, value head): everything of the block's chunks that
    does not depend on the state, for `_chunk_rule_kernel`. The chunks are the rows' pieces
    of the extend tokens' BT-aligned blocks (a block may hold several rows' pieces; no term
    crosses rows). Per piece, with G the piece's cumulative g, D[i, j] = exp(G_i - G_j) for
    j <= i, and the UT transform A = (I + L)^-1, L[i, j] = beta_i (k_i . k_j) D[i, j] for
    j < i (inverted by forward substitution, fp32):
      W = A (beta exp(G) K)     U = A (beta V)     QG = exp(G) Q     KD = exp(G_last - G) K
      P = (Q K^T) * D (j <= i)  and G itself.
    Then a piece's corrections are U - W S and its outputs QG S + P (U - W S)."""
    blk = tl.program_id(0)
    hv = tl.program_id(1)
    r = tl.arange(0, BT)
    e = blk * BT + r
    valid = e < tl.load(cu_ptr + num_rows)
    j = _token_rows(cu_ptr, e, num_rows, steps)
    offs_k = tl.arange(0, BK)
    kmask = valid[:, None] & (offs_k < DK)[None, :]
    q_ch = (hv // G) * DK + offs_k
    t = tok_base + e
    g, beta = _gates(tl.load(a_ptr + t * stride_a + hv, mask=valid, other=0.0),
                     tl.load(b_ptr + t * stride_b + hv, mask=valid, other=0.0),
                     -tl.exp(tl.load(alog_ptr + hv).to(tl.float32)),
                     tl.load(dtb_ptr + hv).to(tl.float32), b_ptr.dtype.element_ty)
    g = tl.where(valid, g, 0.0)
    beta = tl.where(valid, beta, 0.0)
    same = (j[:, None] == j[None, :]) & valid[:, None] & valid[None, :]
    upto = same & (r[:, None] >= r[None, :])  # j <= i in i's piece
    gi = tl.sum(tl.where(upto, g[None, :], 0.0), 1)  # G: cumulative within the piece
    g_last = tl.sum(tl.where(same, g[None, :], 0.0), 1)  # the piece's total, per token
    decay = tl.exp(tl.where(upto, gi[:, None] - gi[None, :], 0.0))
    eg = tl.exp(gi)
    row_off = e[:, None] * stride_wt + offs_k[None, :]
    k = tl.load(y_ptr + (e[:, None] * stride_y + HK * DK + q_ch[None, :]), mask=kmask,
                other=0.0).to(tl.float32)
    k = k * _inv_sqrt(tl.sum(k * k, 1), eps)[:, None]
    q = tl.load(y_ptr + (e[:, None] * stride_y + q_ch[None, :]), mask=kmask,
                other=0.0).to(tl.float32)
    q = q * (_inv_sqrt(tl.sum(q * q, 1), eps) * scale)[:, None]
    p = tl.where(upto, tl.dot(q, tl.trans(k), input_precision=DOT) * decay, 0.0)
    tl.store(p_ptr + hv * stride_ph + (e[:, None] * stride_pt + r[None, :]), p,
             mask=valid[:, None])
    tl.store(qg_ptr + hv * stride_wh + row_off, q * eg[:, None], mask=kmask)
    tl.store(kd_ptr + hv * stride_wh + row_off, k * tl.exp(g_last - gi)[:, None], mask=kmask)
    tl.store(g_ptr + e * stride_gt + hv, gi, mask=valid)
    low = tl.where(upto & (r[:, None] > r[None, :]),
                   beta[:, None] * tl.dot(k, tl.trans(k), input_precision=DOT) * decay, 0.0)
    # row i of the inverse: e_i - sum_{j < i} L[i, j] A[j, :] (rows j < i already final)
    inv = tl.zeros([BT, BT], tl.float32)
    for i in range(BT):
        li = tl.sum(tl.where(r[:, None] == i, low, 0.0), 0)
        xi = tl.where(r == i, 1.0, 0.0) - tl.sum(li[:, None] * inv, 0)
        inv = tl.where(r[:, None] == i, xi[None, :], inv)
    w = tl.dot(inv, k * (beta * eg)[:, None], input_precision=DOT)
    tl.store(w_ptr + hv * stride_wh + row_off, w, mask=kmask)
    offs_v = tl.arange(0, BDV)
    vmask = valid[:, None] & (offs_v < DV)[None, :]
    v = tl.load(y_ptr + (e[:, None] * stride_y + 2 * HK * DK + hv * DV + offs_v[None, :]),
                mask=vmask, other=0.0).to(tl.float32)
    u = tl.dot(inv, v * beta[:, None], input_precision=DOT)
    tl.store(u_ptr + hv * stride_uh + (e[:, None] * stride_ut + offs_v[None, :]), u, mask=vmask)


@jit_varying("x_ptr", "slots_ptr", "seq_lens_ptr", "cu_ptr", "row0", "tok_base")
def _chunk_rule_kernel(x_ptr, y_ptr, cs_ptr, ss_ptr, w_ptr, u_ptr, qg_ptr, kd_ptr, p_ptr, g_ptr,
                       slots_ptr, seq_lens_ptr, cu_ptr, out_ptr, bcs_ptr, bss_ptr,
                       row0, tok_base, page_size, eps,
                       stride_x, stride_y, stride_cs, stride_cc, stride_ck, stride_ss,
                       stride_sh, stride_sk, stride_wt, stride_wh, stride_ut, stride_uh,
                       stride_pt, stride_ph, stride_gt, stride_ot, stride_oh,
                       HK: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       K: tl.constexpr, KP: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       BT: tl.constexpr, BOUNDARY: tl.constexpr, DOT: tl.constexpr):
    """Program (extend row, value head, block of BV value columns): the row's delta rule chunk
    by chunk (its pieces of the BT-aligned token blocks, `_chunk_prep_kernel`'s outputs), the
    state slice S [dk, BV] in registers:
      V' = U - W S        O = QG S + P V'        S = exp(G_last) S + KD^T V'
    and at a page boundary inside the chunk (after its token m) the state
    exp(G_m) S + (K exp(G_m - G) [j <= m])^T V' (K re-read from the conv output). Then the
    slot's conv state (this program's value channels; the q/k channels by the key head's
    first program: nothing reads the conv state any more)."""
    j = tl.program_id(0)
    hv = tl.program_id(1)
    bv = tl.program_id(2)
    row = row0 + j
    slot = tl.load(slots_ptr + row).to(tl.int64)
    c0 = tl.load(cu_ptr + j)
    c1 = tl.load(cu_ptr + j + 1)
    dtype = out_ptr.dtype.element_ty
    offs_v = bv * BV + tl.arange(0, BV)
    vmask = offs_v < DV
    r = tl.arange(0, BT)
    if slot < 0:  # padding: no state read or written
        for blk in range(c0 // BT, tl.cdiv(c1, BT)):
            e = blk * BT + r
            seg = (e >= c0) & (e < c1)
            tl.store(out_ptr + hv * stride_oh + ((tok_base + e)[:, None] * stride_ot
                                                 + offs_v[None, :]), tl.zeros([BT, BV], dtype),
                     mask=seg[:, None] & vmask[None, :])
        return
    n = c1 - c0
    if n == 0:
        return
    kh = hv // G
    offs_k = tl.arange(0, BK)
    kmask = offs_k < DK
    s_base = slot * stride_ss + hv * stride_sh
    s_off = offs_k[:, None] * stride_sk + offs_v[None, :]
    smask = kmask[:, None] & vmask[None, :]
    s = tl.load(ss_ptr + s_base + s_off, mask=smask, other=0.0)
    end = tl.load(seq_lens_ptr + row)
    snap = end // page_size * page_size - (end - n)  # tokens before the boundary (> 0: one)
    snap_e = tl.where(snap > 0, c0 + snap - 1, -1)  # the extend token that completes it
    for blk in range(c0 // BT, tl.cdiv(c1, BT)):
        e = blk * BT + r
        seg = (e >= c0) & (e < c1)
        rows_k = seg[:, None] & kmask[None, :]
        rows_v = seg[:, None] & vmask[None, :]
        wk_off = hv * stride_wh + (e[:, None] * stride_wt + offs_k[None, :])
        gi = tl.load(g_ptr + e * stride_gt + hv, mask=seg, other=0.0)
        w = tl.load(w_ptr + wk_off, mask=rows_k, other=0.0)
        u = tl.load(u_ptr + hv * stride_uh + (e[:, None] * stride_ut + offs_v[None, :]),
                    mask=rows_v, other=0.0)
        u = u - tl.dot(w, s, input_precision=DOT)
        qg = tl.load(qg_ptr + wk_off, mask=rows_k, other=0.0)
        p = tl.load(p_ptr + hv * stride_ph + (e[:, None] * stride_pt + r[None, :]),
                    mask=seg[:, None], other=0.0)
        o = tl.dot(qg, s, input_precision=DOT) + tl.dot(p, u, input_precision=DOT)
        tl.store(out_ptr + hv * stride_oh + ((tok_base + e)[:, None] * stride_ot
                                             + offs_v[None, :]), o.to(dtype), mask=rows_v)
        if BOUNDARY:  # noqa: SIM102 (a compile-time if, then a runtime one)
            if (snap_e >= blk * BT) & (snap_e < blk * BT + BT):
                k = tl.load(y_ptr + (e[:, None] * stride_y + HK * DK + kh * DK
                                     + offs_k[None, :]), mask=rows_k, other=0.0)
                k = k.to(tl.float32)
                k = k * _inv_sqrt(tl.sum(k * k, 1), eps)[:, None]
                g_m = tl.sum(tl.where(e == snap_e, gi, 0.0), 0)
                wm = tl.where(seg & (e <= snap_e), tl.exp(g_m - gi), 0.0)
                s_m = s * tl.exp(g_m) + tl.dot(tl.trans(k * wm[:, None]), u,
                                               input_precision=DOT)
                tl.store(bss_ptr + s_base + s_off, s_m, mask=smask)
        g_last = tl.min(tl.where(seg, gi, float("inf")), 0)  # g <= 0: G falls along the piece
        kd = tl.load(kd_ptr + wk_off, mask=rows_k, other=0.0)
        s = s * tl.exp(g_last) + tl.dot(tl.trans(kd), u, input_precision=DOT)
    tl.store(ss_ptr + s_base + s_off, s, mask=smask)
    x_row = x_ptr + (tok_base + c0).to(tl.int64) * stride_x
    cs_off = slot * stride_cs
    taps = tl.arange(0, KP)
    _store_conv_state(x_row, stride_x, cs_ptr, bcs_ptr, cs_off, stride_cc, stride_ck, n, snap,
                      2 * HK * DK + hv * DV + offs_v, vmask, taps, K - 1, BOUNDARY)
    if (hv % G == 0) & (bv == 0):
        _store_conv_state(x_row, stride_x, cs_ptr, bcs_ptr, cs_off, stride_cc, stride_ck, n,
                          snap, kh * DK + offs_k, kmask, taps, K - 1, BOUNDARY)
        _store_conv_state(x_row, stride_x, cs_ptr, bcs_ptr, cs_off, stride_cc, stride_ck, n,
                          snap, HK * DK + kh * DK + offs_k, kmask, taps, K - 1, BOUNDARY)


# ---------------------------------------------------------------------------------------------
# Triton: the gated RMSNorm
# ---------------------------------------------------------------------------------------------

@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, y_ptr, n_rows, d, stride_x, stride_z,
                           stride_y, eps, BR: tl.constexpr, BD: tl.constexpr,
                           W_FP32: tl.constexpr, PDL: tl.constexpr):
    """Program (block of BR rows): HF's rounding order (module docstring of the ref)."""
    if PDL:
        gdc_launch_dependents()
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    mask = (rows < n_rows)[:, None] & (cols < d)[None, :]
    rows64 = rows.to(tl.int64)[:, None]  # N * D may pass 2^31 (N: tokens x heads)
    w = tl.load(w_ptr + cols, mask=cols < d, other=0.0).to(tl.float32)  # a weight: before
    if PDL:
        gdc_wait()
    x = tl.load(x_ptr + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
    z = tl.load(z_ptr + rows64 * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dtype = x.dtype
    xf = x.to(tl.float32)
    ss = tl.sum(xf * xf, 1)
    inv = _inv_sqrt(tl.div_rn(ss, tl.zeros_like(ss) + d), eps)
    h = (xf * inv[:, None]).to(dtype).to(tl.float32) * w[None, :]
    if not W_FP32:
        h = h.to(dtype).to(tl.float32)
    y = h * tl.div_rn(z, 1.0 + tl.exp(-z))
    tl.store(y_ptr + rows64 * stride_y + cols[None, :], y.to(dtype), mask=mask)


def gated_rms_norm(x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x, z [N, D] (rows strided, last dim contiguous), weight [D] -> [N, D] in x's dtype."""
    n, d = x.shape
    assert z.shape == x.shape and x.stride(1) == 1 and z.stride(1) == 1, (x.shape, z.shape)
    assert weight.dtype in (x.dtype, torch.float32), (weight.dtype, x.dtype)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    bd = triton.next_power_of_2(d)
    br = max(1, min(16, 4096 // bd))
    pdl = pdl_enabled()
    _gated_rms_norm_kernel[(triton.cdiv(n, br),)](
        x, z, weight, y, n, d, x.stride(0), z.stride(0), y.stride(0), eps, BR=br, BD=bd,
        W_FP32=weight.dtype == torch.float32 and x.dtype != torch.float32, PDL=pdl,
        num_warps=4, **pdl_launch(pdl))
    return y


# ---------------------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------------------

#: the chunk of the extend path (tokens per UT transform)
CHUNK = 64
#: fp32 dots of the chunked path: TF32 on the tensor cores (10-bit mantissa; the state, the
#: decays and the inverse stay fp32)
DOT_PRECISION = "tf32"


@dataclass(frozen=True)
class Launch:
    """A kernel's block of value columns (0: unused) and its warps and pipeline stages.
    NOTE: chosen from ptxas's register and shared-memory reports for sm_90 at Qwen3.5's
    shapes (dk = dv = 128): none spills or only a few hundred bytes, and each fits H200's
    shared memory; the timing is for the GPU benchmarks (scripts/bench_kernels.py deltanet)."""

    block_v: int
    num_warps: int
    num_stages: int = 3


#: the recurrent kernel while (rows x value heads) < 64 (batch 1 has 32: more, smaller
#: programs), < 512, and beyond; measured at Qwen3.5-4B's shapes on the H200
#: (`bench_kernels.py deltanet --sweep`): batch 8 at 19.4 us on DECODE_MID against 25.8 on
#: DECODE_SMALL's launch
DECODE_SMALL = Launch(16, 4)
DECODE_MID = Launch(32, 4)
DECODE_LARGE = Launch(32, 8)
CONV = Launch(0, 4)
#: one stage: the chunk loops' loads pipelined kept several [64, 128] fp32 tiles in shared
#: memory, past what a block may have
PREP = Launch(0, 8, 1)
RULE = Launch(32, 8, 1)
#: tokens and channels per `_conv_kernel` program
CONV_TOKENS, CONV_CHANNELS = 32, 64


_counters: dict[torch.device, list[Tensor]] = {}
_counters_lock = threading.Lock()


def _counter_buffer(device: torch.device, n: int) -> Tensor:
    """Zeroed int32 counters (the recurrent kernel leaves them zero), at least n, one buffer per
    device made on first use. NOTE: a buffer outgrown is kept: a CUDA graph may hold it."""
    with _counters_lock:
        bufs = _counters.setdefault(device, [])
        if not bufs or bufs[-1].numel() < n:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("gated_delta: run it once eagerly at this batch size before "
                                   "capturing it (its counters are made on first use)")
            bufs.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
        return bufs[-1]


def _block_v(launch: Launch, dv: int) -> int:
    """The launch's value columns, never past dv's power of two (a dot needs 16)."""
    return min(launch.block_v, max(16, triton.next_power_of_2(dv)))


def gated_delta(mixed_qkv: Tensor, a: Tensor, b: Tensor, conv_weight: Tensor, a_log: Tensor,
                dt_bias: Tensor, conv_state: Tensor, ssm_state: Tensor, slots: Tensor,
                seq_lens: Tensor, cu_q_lens: Tensor, num_decode: int, max_q_len: int,
                num_k_heads: int, page_size: int, boundary_conv: Tensor | None = None,
                boundary_ssm: Tensor | None = None, *, keep: Keep | None = None,
                chunked: bool = True, block_v: int | None = None) -> Tensor:
    """`gated_delta_ref` in Triton: the decode rows by `_recurrent_kernel` (one launch), the
    extend rows by the chunked path (`_conv_kernel`, `_chunk_prep_kernel`,
    `_chunk_rule_kernel`; chunked=False: `_recurrent_kernel` token by token). keep: the kept
    rows leave those launches (slot -1) for one more `_recurrent_kernel` launch over the extend
    rows, token by token (KEEP), after them. Tokens of no row are left unwritten. Reads no
    device tensor on the host; grids from shapes and host ints (max_q_len unused): safe to
    capture in a CUDA graph once run eagerly (`_counter_buffer`). block_v: value columns per
    program (tests)."""
    t, c = mixed_qkv.shape
    hv, dk, dv = a.shape[1], ssm_state.shape[2], ssm_state.shape[3]
    hk, kw = num_k_heads, conv_weight.shape[1]
    assert c == 2 * hk * dk + hv * dv and hv % hk == 0, (c, hk, hv, dk, dv)
    assert conv_state.shape[1:] == (c, kw - 1) and ssm_state.dtype == torch.float32
    assert mixed_qkv.stride(1) == 1 and a.stride(1) == 1 and b.stride(1) == 1
    assert ssm_state.stride(3) == 1 and conv_weight.stride(1) == 1
    boundary = boundary_ssm is not None
    if boundary:
        assert boundary_conv is not None and boundary_ssm is not None
        assert boundary_conv.stride() == conv_state.stride()
        assert boundary_ssm.stride() == ssm_state.stride()
    bcs = boundary_conv if boundary_conv is not None else conv_state
    bss = boundary_ssm if boundary_ssm is not None else ssm_state
    all_slots = slots
    if keep is not None:
        assert keep.conv.stride()[2:] == conv_state.stride()[1:]
        assert keep.ssm.stride()[2:] == ssm_state.stride()[1:]
        slots = keep.others if keep.others is not None else kept_out(slots, keep.entries)
    rows = slots.shape[0]
    n_ext = rows - num_decode
    out = torch.empty(t, hv, dv, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    if t == 0:
        return out
    bk, kp = max(16, triton.next_power_of_2(dk)), triton.next_power_of_2(kw)
    consts = {"HK": hk, "G": hv // hk, "DK": dk, "DV": dv, "K": kw, "KP": kp, "BK": bk,
              "BOUNDARY": boundary}
    strides = (*conv_state.stride(), *ssm_state.stride()[:3])

    def recurrent(nrows: int, row0: int, varlen: bool, pdl: bool, kept: Keep | None = None
                  ) -> None:
        work = nrows * hv
        launch = DECODE_SMALL if work < 64 else DECODE_MID if work < 512 else DECODE_LARGE
        # the kept rows read their real slots; without them, the keep arguments are unused
        row_slots = slots
        keeps: tuple[object, ...] = (slots, conv_state, ssm_state, 0, 0, 0, 0)
        if kept is not None:  # a step's few verify rows, however many rows the grid spans
            launch = DECODE_SMALL
            row_slots = all_slots
            keeps = (kept.entries, kept.conv, kept.ssm, *kept.conv.stride()[:2],
                     *kept.ssm.stride()[:2])
        bv = block_v or _block_v(launch, dv)
        nv = triton.cdiv(dv, bv)
        _recurrent_kernel[(nrows, hv, nv)](
            mixed_qkv, a, b, conv_weight, a_log, dt_bias, conv_state, ssm_state, row_slots,
            seq_lens, cu_q_lens, out, bcs, bss,
            _counter_buffer(out.device, rows * hk), *keeps[:3], row0, num_decode, page_size,
            dk ** -0.5, L2_EPS, mixed_qkv.stride(0), a.stride(0), b.stride(0),
            conv_weight.stride(0), *strides, out.stride(0), out.stride(1), *keeps[3:],
            **consts, BV=bv, NV=nv, VARLEN=varlen, KEEP=kept is not None, PDL=pdl,
            num_warps=launch.num_warps, num_stages=launch.num_stages, **pdl_launch(pdl))

    if num_decode:
        recurrent(num_decode, 0, varlen=False, pdl=pdl_enabled())
    te = t - num_decode
    if n_ext <= 0 or te <= 0:
        return out
    if not chunked:
        recurrent(n_ext, num_decode, varlen=True, pdl=False)
    else:
        _chunked(mixed_qkv, a, b, conv_weight, a_log, dt_bias, conv_state, ssm_state, slots,
                 seq_lens, cu_q_lens, out, bcs, bss, num_decode, page_size, consts,
                 block_v or _block_v(RULE, dv))
    if keep is not None:
        recurrent(n_ext, num_decode, varlen=True, pdl=False, kept=keep)
    return out


def _chunked(mixed_qkv: Tensor, a: Tensor, b: Tensor, conv_weight: Tensor, a_log: Tensor,
             dt_bias: Tensor, conv_state: Tensor, ssm_state: Tensor, slots: Tensor,
             seq_lens: Tensor, cu_q_lens: Tensor, out: Tensor, bcs: Tensor, bss: Tensor,
             num_decode: int, page_size: int, consts: dict[str, int | bool], bv: int) -> None:
    """`gated_delta`'s extend rows by the chunked path: conv, prep, rule (module docstring)."""
    t, c = mixed_qkv.shape
    hv, dk, dv = a.shape[1], ssm_state.shape[2], ssm_state.shape[3]
    hk, kw = int(consts["HK"]), conv_weight.shape[1]
    n_ext, te = slots.shape[0] - num_decode, t - num_decode
    bk = max(16, triton.next_power_of_2(dk))
    strides = (*conv_state.stride(), *ssm_state.stride()[:3])
    dev = mixed_qkv.device
    y = torch.empty(te, c, dtype=mixed_qkv.dtype, device=dev)
    # the prep's outputs: W, QG, KD [te, Hv, dk], U [te, Hv, dv], P [te, Hv, CHUNK], G [te, Hv]
    wqk = torch.empty(3, te, hv, dk, dtype=torch.float32, device=dev)
    u = torch.empty(te, hv, dv, dtype=torch.float32, device=dev)
    p = torch.empty(te, hv, CHUNK, dtype=torch.float32, device=dev)
    gcum = torch.empty(te, hv, dtype=torch.float32, device=dev)
    steps = max(1, (n_ext - 1).bit_length())
    ext_slots = slots[num_decode:]
    tok_x = mixed_qkv[num_decode:]
    _conv_kernel[(triton.cdiv(te, CONV_TOKENS), triton.cdiv(c, CONV_CHANNELS))](
        tok_x, conv_weight, conv_state, ext_slots, cu_q_lens, y, 0, n_ext, steps, c,
        tok_x.stride(0), conv_weight.stride(0), *conv_state.stride(), y.stride(0),
        K=kw, BT=CONV_TOKENS, BC=CONV_CHANNELS, num_warps=CONV.num_warps,
        num_stages=CONV.num_stages)
    _chunk_prep_kernel[(triton.cdiv(te, CHUNK), hv)](
        y, a, b, a_log, dt_bias, cu_q_lens, wqk[0], u, wqk[1], wqk[2], p, gcum, num_decode,
        n_ext, steps, dk ** -0.5, L2_EPS, y.stride(0), a.stride(0), b.stride(0),
        wqk.stride(1), wqk.stride(2), u.stride(0), u.stride(1), p.stride(0), p.stride(1),
        gcum.stride(0), HK=hk, G=hv // hk, DK=dk, DV=dv, BK=bk,
        BDV=max(16, triton.next_power_of_2(dv)), BT=CHUNK, DOT=DOT_PRECISION,
        num_warps=PREP.num_warps, num_stages=PREP.num_stages)
    _chunk_rule_kernel[(n_ext, hv, triton.cdiv(dv, bv))](
        mixed_qkv, y, conv_state, ssm_state, wqk[0], u, wqk[1], wqk[2], p, gcum, slots,
        seq_lens, cu_q_lens, out, bcs, bss, num_decode, num_decode, page_size, L2_EPS,
        mixed_qkv.stride(0), y.stride(0), *strides, wqk.stride(1), wqk.stride(2), u.stride(0),
        u.stride(1), p.stride(0), p.stride(1), gcum.stride(0), out.stride(0), out.stride(1),
        **consts, BV=bv, BT=CHUNK, DOT=DOT_PRECISION, num_warps=RULE.num_warps,
        num_stages=RULE.num_stages)
