"""Decode-time linear layers y = x @ W^T for a few rows (M <= 64): Triton kernels and references.

At decode a step reads every weight once and does ~M FLOPs per byte, so a linear layer is bound
by how fast W streams from HBM. Two kernels share one wrapper, one split-K reduction and one
epilogue; W [N, K] row-major (as nn.Linear stores it), fp32 accumulation, y in x's dtype.

- `_gemv_kernel` (M <= 2, CUDA cores): each program owns BLOCK_N output columns for all M rows,
  so W is read once per step; x (a few KB) is re-read by every program, from L1/L2. It walks K
  in BLOCK_K chunks with 16-byte vector loads (runs of 8 bf16 per lane) and sums across lanes
  once, after the loop. At M = 1 a program is one warp and one output row: N programs keep
  enough loads in flight on all 132 SMs without splitting K.
- `_gemm_tc_kernel` (3 <= M <= 64, tensor cores): the same walk with the operands swapped,
  y^T tile [BLOCK_N, M_PAD] = W tile [BLOCK_N, BLOCK_K] @ x^T tile [BLOCK_K, M_PAD] (M padded to
  >= 16 for tl.dot), so the FMAs that grow with M cost nothing and W streams as in the GEMV.
- When N gives too few programs, K is split over programs that write fp32 partials, and
  `_split_reduce_kernel` sums them in a fixed order (deterministic: no atomics).

Fused prologues remove a decode step's small kernels (one launch each per layer):
- `add_rms_norm_linear`: y = RMSNorm(x + residual) @ W^T, and the new residual. The norm's
  1/rms is a per-row scalar, so it is factored out of the sum: the loop accumulates W (s * g)
  and s^2 together, and the end multiplies by 1/rms. It needs whole rows in one program (no
  split K); program 0 writes the new residual.
- `silu_and_mul_linear`: y = (silu(gate) * up) @ W^T, the product formed as the tile loads, with
  HF's roundings (the same operand as `silu_and_mul`).

One config per (M, N, K, prologue), picked by `_pick_config` (no autotune). The wrappers read no
device tensor on the host and size their grid from shapes only, so they are safe to capture in a
CUDA graph. `use_gemv(m, n, k)` says when to call them instead of cuBLAS; `bench_gemv()` measures
both (`python -c "from arle_kernels.gemv import bench_gemv; bench_gemv()"`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from arle_kernels.fused import _inv_rms, add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref
from arle_kernels.fused import silu_and_mul as _silu_and_mul
from arle_kernels.fused import silu_and_mul_ref as _silu_and_mul_ref

#: rows up to this many run through the kernels (beyond it cuBLAS's GEMM is the right tool)
MAX_M = 64
#: the CUDA-core GEMV up to this many rows, the tensor-core kernel above
GEMV_MAX_M = 2
#: use_gemv's bound on M (from bench_gemv on the H200: see use_gemv)
USE_GEMV_MAX_M = 64
_NUM_SMS = 132  # H200; only shapes the choice of split (a guess elsewhere is still correct)

# the prologue applied to x as it loads (a constexpr of the kernels)
NONE, RMS, ADD_RMS, SILU = 0, 1, 2, 3


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters: BLOCK_N outputs per program, BLOCK_K elements of K per loop step,
    split_k programs along K (1: no split), num_warps / num_stages, and which kernel
    (tensor_cores: `_gemm_tc_kernel`, else `_gemv_kernel`).

    NOTE: for the GEMV on a GPU, block_k should be 8 * 32 * num_warps times a power of two: then
    the x and W tiles get the same register layout (see the kernel). Any power of two >= 8 is
    correct; the tensor-core kernel needs block_n and block_k >= 16."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1
    split_k: int = 1
    tensor_cores: bool = False


@triton.jit
def _load(ptr, mask, EVEN_K: tl.constexpr, evict: tl.constexpr):
    if EVEN_K:
        return tl.load(ptr, eviction_policy=evict)
    return tl.load(ptr, mask=mask, other=0.0, eviction_policy=evict)


@triton.jit
def _operand(x_ptr, r_ptr, g_ptr, ro_ptr, x_offs, r_offs, k_offs, k_ok, store_r, K,
             PROLOGUE: tl.constexpr, EVEN_K: tl.constexpr):
    """One tile of the linear layer's input in fp32, after the prologue, and its squares (the
    RMS statistics; unused otherwise). Offsets are element offsets of the tile: x_offs / r_offs
    into x and the residual (row * stride + k), k_offs the k index (for the norm weight)."""
    if PROLOGUE == 3:  # SILU: x is [gate | up], K columns each; HF rounds silu(gate), then the product
        gate = _load(x_ptr + x_offs, k_ok, EVEN_K, "evict_last")
        up = _load(x_ptr + x_offs + K, k_ok, EVEN_K, "evict_last")
        g = gate.to(tl.float32)
        act = tl.div_rn(g, 1.0 + tl.exp(-g)).to(gate.dtype)
        a = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype).to(tl.float32)
        return a, a
    x = _load(x_ptr + x_offs, k_ok, EVEN_K, "evict_last")
    if PROLOGUE == 2:  # ADD_RMS: the residual stream x + residual, rounded as `h = h + f(h)`
        r = _load(r_ptr + r_offs, k_ok, EVEN_K, "evict_last")
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(ro_ptr + r_offs, x, mask=store_r & k_ok)
    xf = x.to(tl.float32)
    if PROLOGUE == 0:
        return xf, xf
    # RMS / ADD_RMS: s * g now, times 1 / rms(s) after the loop
    gw = _load(g_ptr + k_offs, k_ok, EVEN_K, "evict_last")
    return xf * gw.to(tl.float32), xf * xf


@triton.jit
def _epilogue(y, offs_m, offs_n, M, N, K, ss, eps, b_ptr, y_ptr, pid_k, stride_ym, stride_ys,
              PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr):
    """y [M_PAD, BLOCK_N] fp32 sums -> 1 / rms (RMS prologues; ss: the rows' sums of squares,
    [M_PAD, 1]), then the fp32 partial (PARTIAL) or y + bias in y's dtype."""
    if PROLOGUE == 1 or PROLOGUE == 2:
        y = y * _inv_rms(ss, K, eps)
    out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if PARTIAL:
        y_ptrs = y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, y, mask=out_mask)
    else:
        if HAS_BIAS:
            b = tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0)
            y += b.to(tl.float32)[None, :]
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["M", "stride_ys"])  # rows change every step: one variant
def _gemv_kernel(x_ptr, r_ptr, g_ptr, ro_ptr, w_ptr, b_ptr, y_ptr, M, N, K, k_per_split,
                 stride_xm, stride_rm, stride_wn, stride_ym, stride_ys, eps,
                 PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                 EVEN_K: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """Program (j, s): columns [j*BLOCK_N, (j+1)*BLOCK_N) of y for all M rows, summed over
    K range [s*k_per_split, (s+1)*k_per_split).

    Not PARTIAL: adds the bias and stores y in its dtype. PARTIAL (split K): y is an fp32
    buffer [splits, M, N] (stride_ys between splits) that takes the program's partial sums.
    NOTE: k_per_split is a multiple of BLOCK_K; EVEN_K means K is too, and every split is
    full (no masks at all).
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, M_PAD)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # A K chunk is viewed as [BLOCK_K // 8, 8]: a thread owns runs of 8 contiguous elements
    # (one 16-byte bf16 load) and sums its products over a run at once, in registers; lanes and
    # warps span BLOCK_K // 8, and the sum across them happens once, after the loop.
    # NOTE: the x and W tiles are both 4-D with this same [BLOCK_K // 8, 8] tail, so Triton
    # gives them one register layout and the broadcast multiply moves no data between threads.
    kk = (tl.arange(0, BLOCK_K // 8) * 8)[:, None] + tl.arange(0, 8)[None, :]
    kk = kk[None, None, :, :]  # [1, 1, BLOCK_K // 8, 8]
    # NOTE: padded rows (m >= M) and columns (n >= N) re-read the last valid row of x / W, so
    # no load needs a mask for them; their sums are never stored.
    rows_x = tl.minimum(offs_m, M - 1)[:, None, None, None]
    rows_w = tl.minimum(offs_n, N - 1).to(tl.int64)
    x_offs = rows_x * stride_xm + kk  # [M_PAD, 1, BK/8, 8]
    r_offs = rows_x * stride_rm + kk
    store_r = (offs_m < tl.where(pid_n == 0, M, 0))[:, None, None, None]  # program 0's rows
    w_ptrs = w_ptr + rows_w[None, :, None, None] * stride_wn + kk  # [1, BLOCK_N, BK/8, 8]
    k_lo = pid_k * k_per_split
    acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
    ss = tl.zeros([M_PAD, 1, BLOCK_K // 8], dtype=tl.float32)
    # NOTE: the last split may run past K (whole chunks of masked loads: no memory traffic)
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        k_ok = k0 + kk < K
        # W is streamed once: evict it first from L2, keep x (read by every program)
        w = _load(w_ptrs + k0, k_ok, EVEN_K, "evict_first")
        x, sq = _operand(x_ptr, r_ptr, g_ptr, ro_ptr, x_offs + k0, r_offs + k0, kk + k0, k_ok,
                         store_r, K, PROLOGUE, EVEN_K)
        if PROLOGUE == 1 or PROLOGUE == 2:
            ss += tl.sum(sq, axis=3)
        acc += tl.sum(x * w.to(tl.float32), axis=3)
    _epilogue(tl.sum(acc, axis=2), offs_m, offs_n, M, N, K, tl.sum(ss, axis=2), eps, b_ptr,
              y_ptr, pid_k, stride_ym, stride_ys, PROLOGUE, HAS_BIAS, PARTIAL)


@triton.jit(do_not_specialize=["M", "stride_ys"])  # rows change every step: one variant
def _gemm_tc_kernel(x_ptr, r_ptr, g_ptr, ro_ptr, w_ptr, b_ptr, y_ptr, M, N, K, k_per_split,
                    stride_xm, stride_rm, stride_wn, stride_ym, stride_ys, eps,
                    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                    EVEN_K: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """`_gemv_kernel`'s contract on tensor cores: acc [BLOCK_N, M_PAD] += W tile @ x tile^T."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, M_PAD)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)[None, :]
    rows_x = tl.minimum(offs_m, M - 1)[:, None]  # NOTE: padding re-reads valid rows (no masks)
    rows_w = tl.minimum(offs_n, N - 1).to(tl.int64)[:, None]
    x_offs = rows_x * stride_xm + kk  # [M_PAD, BLOCK_K]
    r_offs = rows_x * stride_rm + kk
    store_r = (offs_m < tl.where(pid_n == 0, M, 0))[:, None]  # program 0 writes the residual
    w_ptrs = w_ptr + rows_w * stride_wn + kk  # [BLOCK_N, BLOCK_K]
    k_lo = pid_k * k_per_split
    acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    ss = tl.zeros([M_PAD, BLOCK_K], dtype=tl.float32)
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        k_ok = k0 + kk < K
        w = _load(w_ptrs + k0, k_ok, EVEN_K, "evict_first")
        x, sq = _operand(x_ptr, r_ptr, g_ptr, ro_ptr, x_offs + k0, r_offs + k0, kk + k0, k_ok,
                         store_r, K, PROLOGUE, EVEN_K)
        if PROLOGUE == 1 or PROLOGUE == 2:
            ss += sq
        acc = tl.dot(w, tl.trans(x.to(w.dtype)), acc)
    _epilogue(tl.trans(acc), offs_m, offs_n, M, N, K, tl.sum(ss, axis=1)[:, None], eps, b_ptr,
              y_ptr, pid_k, stride_ym, stride_ys, PROLOGUE, HAS_BIAS, PARTIAL)


@triton.jit
def _split_reduce_kernel(p_ptr, b_ptr, y_ptr, N, splits, stride_ps, stride_pm, stride_ym,
                         HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (j, m): y[m, j*BLOCK : (j+1)*BLOCK] = the fp32 partials summed over splits
    0, 1, 2, ... in that order (so the result is deterministic), plus the bias, in y's dtype."""
    m = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(p_ptr + s * stride_ps + m * stride_pm + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


_REDUCE_BLOCK = 1024
#: the tensor-core kernel's block shape and pipeline depth (bench_gemv's sweep on the H200)
TC_CONFIG = GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4, tensor_cores=True)


def _pick_config(m: int, n: int, k: int, whole_rows: bool = False) -> GemvConfig:
    """One config per shape family, from sweeps on the H200 (CUDA-graph timings, Qwen3-4B's
    shapes; see use_gemv for the numbers):

    - M = 1: one warp per output row, 4 runs of 8 per lane (BLOCK_K 1024): thousands of small
      programs keep every SM's memory pipe full, and the final sum is a warp shuffle.
    - M = 2: two rows per program; for few rows (N < 4096, o_proj / down) 2-4 warps share a row's
      K range, else one warp.
    - M >= 3: the tensor-core kernel, TC_CONFIG.
    - split K only when N gives too few programs (fewer than 2 per SM for the GEMV, 1 for the
      tensor-core kernel): each split at least 2 BLOCK_K chunks. whole_rows (an RMS prologue
      needs each row's whole sum of squares): never split; the tensor-core kernel narrows
      BLOCK_N instead.
    """
    m_pad = triton.next_power_of_2(max(m, 1))
    if m_pad == 1:
        cfg = GemvConfig(block_n=1, block_k=1024, num_warps=1)
    elif m_pad == 2 and n >= 4096:
        cfg = GemvConfig(block_n=2, block_k=512, num_warps=1)
    elif m_pad == 2:
        cfg = GemvConfig(block_n=2, block_k=1024, num_warps=2) if k < 8192 else \
            GemvConfig(block_n=2, block_k=2048, num_warps=4)
    else:
        cfg = TC_CONFIG
        while whole_rows and triton.cdiv(n, cfg.block_n) < _NUM_SMS and cfg.block_n > 16:
            cfg = replace(cfg, block_n=cfg.block_n // 2)
    programs = triton.cdiv(n, cfg.block_n)
    wanted = _NUM_SMS if cfg.tensor_cores else 2 * _NUM_SMS
    if programs < wanted and not whole_rows:
        chunks = triton.cdiv(k, cfg.block_k)
        split = min(max(1, chunks // 2), triton.cdiv(2 * wanted, programs))
        cfg = replace(cfg, split_k=split)
    return cfg


def _check(x: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor | None, k: int) -> None:
    assert x.dim() == 2 and weight.dim() == 2, "x: [M, K], weight: [N, K]"
    assert weight.shape[1] == k, f"K mismatch: x {tuple(x.shape)}, W {tuple(weight.shape)}"
    assert x.stride(1) == 1 and weight.stride(1) == 1, "x and weight: last dim contiguous"
    assert x.dtype == weight.dtype, "x and weight must share a dtype"
    assert x.shape[0] <= MAX_M, f"gemv is for M <= {MAX_M} rows (use F.linear)"
    if bias is not None:
        assert bias.shape == (weight.shape[0],) and bias.stride(0) == 1, "bias: [N]"
    if out is not None:
        assert out.shape == (x.shape[0], weight.shape[0]) and out.dtype == x.dtype, "out: [M, N]"
        assert out.stride(1) == 1, "out: last dim contiguous"


def _launch(x: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor | None,
            cfg: GemvConfig, prologue: int = NONE, residual: Tensor | None = None,
            norm_weight: Tensor | None = None, eps: float = 0.0) -> tuple[Tensor, Tensor]:
    """Run `cfg` (the public functions pick it; tests and tuning pass their own) with a
    prologue; returns (y, the new residual: x + residual for ADD_RMS, else x)."""
    k = x.shape[1] // 2 if prologue == SILU else x.shape[1]
    _check(x, weight, bias, out, k)
    m, n = x.shape[0], weight.shape[0]
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    r, g, r_out = x, x, x  # dummy pointers where the prologue reads none
    if prologue in (RMS, ADD_RMS):
        assert norm_weight is not None and norm_weight.shape == (k,), "norm weight: [K]"
        assert cfg.split_k == 1, "an RMS prologue needs whole rows (no split K)"
        g = norm_weight
    if prologue == ADD_RMS:
        assert residual is not None and residual.shape == x.shape and residual.stride(1) == 1
        r, r_out = residual, torch.empty_like(residual)
    if m == 0 or n == 0 or k == 0:
        assert m == 0 or n == 0 or prologue == NONE, "empty K with a prologue"
        if k == 0 and m and n:
            y.zero_() if bias is None else y.copy_(bias.expand(m, n))
        return y, r_out
    # NOTE: every split's K range is a whole number of BLOCK_K chunks (the kernels rely on it)
    chunks = triton.cdiv(k, cfg.block_k)
    k_per_split = triton.cdiv(chunks, max(1, min(cfg.split_k, chunks))) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)  # no empty splits
    has_bias = bias is not None
    b = bias if bias is not None else y  # a dummy pointer when there is no bias
    m_pad = triton.next_power_of_2(m)
    meta = {"PROLOGUE": prologue, "HAS_BIAS": has_bias, "PARTIAL": splits > 1,
            "EVEN_K": k % k_per_split == 0,
            "M_PAD": max(16, m_pad) if cfg.tensor_cores else m_pad,
            "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
            "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    kernel = _gemm_tc_kernel if cfg.tensor_cores else _gemv_kernel
    grid = (triton.cdiv(n, cfg.block_n), splits)
    if splits == 1:
        kernel[grid](x, r, g, r_out, weight, b, y, m, n, k, k_per_split, x.stride(0),
                     r.stride(0), weight.stride(0), y.stride(0), 0, eps, **meta)
        return y, r_out
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    kernel[grid](x, r, g, r_out, weight, b, part, m, n, k, k_per_split, x.stride(0),
                 r.stride(0), weight.stride(0), part.stride(1), part.stride(0), eps, **meta)
    _split_reduce_kernel[(triton.cdiv(n, _REDUCE_BLOCK), m)](
        part, b, y, n, splits, part.stride(0), part.stride(1), y.stride(0), HAS_BIAS=has_bias,
        BLOCK=_REDUCE_BLOCK, num_warps=4)
    return y, r_out


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
         out: Tensor | None = None) -> Tensor:
    """y = x @ weight^T (+ bias): x [M, K] (M <= MAX_M), weight [N, K], bias [N] or None, all in
    one dtype (last dims contiguous); fp32 accumulation; y [M, N] in x's dtype, written into
    `out` when given (a view with a row stride is fine) and returned."""
    cfg = _pick_config(x.shape[0], weight.shape[0], x.shape[1])
    return _launch(x, weight, bias, out, cfg)[0]


def gemv_ref(x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
             out: Tensor | None = None) -> Tensor:
    """The reference: F.linear in fp32, cast to x's dtype (into `out` when given)."""
    b = bias.float() if bias is not None else None
    y = F.linear(x.float(), weight.float(), b).to(x.dtype)
    return y if out is None else out.copy_(y)


def use_gemv(m: int, n: int, k: int) -> bool:
    """Whether a linear layer of m rows and an [n, k] weight should use these kernels over
    F.linear (cuBLAS).

    Measured on the H200 (triton 3.6, bf16, per call back to back in a CUDA graph), Qwen3-4B's
    qkv / o_proj / gate_up / down / lm_head: at M = 1 the GEMV takes 10.0 / 7.0 / 24.6 / 13.8 /
    170 us against cuBLAS's 11.1 / 10.3 / 28.6 / 17.3 / 179 (a decode step's linears: 2.16 ms
    against 2.60 ms); at M = 2 it wins on each shape with its M = 2 configs. At M >= 3 the
    CUDA-core GEMV lost (its FMAs grow with M), so the tensor-core kernel takes over there
    (see docs/benchmarks for its sweep against cuBLAS).
    """
    return 1 <= m <= USE_GEMV_MAX_M


# ---- the fused prologues, and how a decoder layer calls them ----------------------------------

def add_rms_norm_linear(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float,
                        weight: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(RMSNorm(x + residual) @ weight^T + bias, x + residual); residual None: the norm of x
    alone, and x is the residual. Few rows on CUDA: one kernel; else the norm kernel, then cuBLAS."""
    m, n, k = x.shape[0], weight.shape[0], x.shape[1]
    if x.is_cuda and use_gemv(m, n, k):
        cfg = _pick_config(m, n, k, whole_rows=True)
        if residual is None:
            return _launch(x, weight, bias, None, cfg, RMS, None, norm_weight, eps)
        return _launch(x, weight, bias, None, cfg, ADD_RMS, residual, norm_weight, eps)
    if residual is None:
        h, residual = rms_norm(x, norm_weight, eps), x
    else:
        h, residual = add_rms_norm(x, residual, norm_weight, eps)
    return F.linear(h, weight, bias), residual


def add_rms_norm_linear_ref(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float,
                            weight: Tensor, bias: Tensor | None = None
                            ) -> tuple[Tensor, Tensor]:
    if residual is None:
        h, residual = rms_norm_ref(x, norm_weight, eps), x
    else:
        h, residual = add_rms_norm_ref(x, residual, norm_weight, eps)
    return F.linear(h, weight, bias), residual


def silu_and_mul_linear(gate_up: Tensor, weight: Tensor) -> Tensor:
    """(silu(gate) * up) @ weight^T for gate_up = [gate | up]. Few rows on CUDA: one kernel;
    else the SiLU kernel, then cuBLAS."""
    m, n, k = gate_up.shape[0], weight.shape[0], weight.shape[1]
    if gate_up.is_cuda and use_gemv(m, n, k):
        return _launch(gate_up, weight, None, None, _pick_config(m, n, k), SILU)[0]
    return F.linear(_silu_and_mul(gate_up), weight)


def silu_and_mul_linear_ref(gate_up: Tensor, weight: Tensor) -> Tensor:
    return F.linear(_silu_and_mul_ref(gate_up), weight)


# ---------------------------------------------------------------------------------------------
# Benchmark (H200): gemv against F.linear (cuBLAS) on Qwen3-4B's decode shapes
# ---------------------------------------------------------------------------------------------

#: (N, K) of Qwen3-4B's linear layers, bf16
BENCH_SHAPES: dict[str, tuple[int, int]] = {
    "qkv": (6144, 2560), "o_proj": (2560, 4096), "gate_up": (19456, 2560),
    "down": (2560, 9728), "lm_head": (151936, 2560),
}


def _time_us(fn: Callable[[Tensor, Tensor], object], x: Tensor, weights: list[Tensor],
             graph: bool = True) -> float:
    """Median microseconds of one fn(x, W), W rotating over `weights` (together several times
    L2's 50 MB, so L2 serves none of them).

    graph: as a decode step runs it, back to back in a CUDA graph (no CPU launch cost): a graph
    of `calls` calls replayed 7 times. Otherwise eager, one call at a time, with triton's
    do_bench (which clears L2 before each call; a small kernel then also pays its CPU launch).
    """
    from triton.testing import do_bench

    turn = itertools.count()

    def call() -> object:
        return fn(x, weights[next(turn) % len(weights)])

    if not graph:
        return float(do_bench(call, warmup=10, rep=50, return_mode="median")) * 1e3
    call()  # compile and warm up outside the capture
    calls = max(32, 2 * len(weights))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            call()
    times = []
    for _ in range(8):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del g
    return sorted(times[1:])[3]  # the median of the last 7 (the first warms up)


def bench_gemv(shapes: dict[str, tuple[int, int]] | None = None,
               ms: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
               dtype: torch.dtype = torch.bfloat16) -> list[dict[str, object]]:
    """Time gemv and F.linear (cuBLAS) for each shape and M; print a table and return its rows.

    Times are medians per call: `graph` columns back to back in a CUDA graph (the decode
    setting: what to decide on), `eager` with triton's do_bench (one call at a time, L2
    cleared, the CPU launch included). GB/s = weight bytes / graph time. Needs a CUDA GPU."""
    assert torch.cuda.is_available(), "bench_gemv needs a CUDA GPU"
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict[str, object]] = []
    print(f"{'shape':8} {'M':>2} {'N':>6} {'K':>5} | graph us: {'gemv':>6} {'cuBLAS':>6} | "
          f"GB/s: {'gemv':>5} {'cuBLAS':>6} | speedup | eager us: {'gemv':>6} {'cuBLAS':>6} | "
          f"use config")
    for name, (n, k) in (shapes or BENCH_SHAPES).items():
        w_bytes = n * k * torch.finfo(dtype).bits // 8
        copies = max(2, -(-400_000_000 // w_bytes))  # a copy comes back after ~400 MB
        weights = [(torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5).to(dtype)
                   for _ in range(copies)]
        for m in ms:
            x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
            g_us, c_us = _time_us(gemv, x, weights), _time_us(F.linear, x, weights)
            g_eager = _time_us(gemv, x, weights, graph=False)
            c_eager = _time_us(F.linear, x, weights, graph=False)
            cfg = _pick_config(m, n, k)
            row: dict[str, object] = {
                "shape": name, "m": m, "n": n, "k": k, "gemv_us": g_us, "cublas_us": c_us,
                "gemv_gbs": w_bytes / g_us / 1e3, "cublas_gbs": w_bytes / c_us / 1e3,
                "speedup": c_us / g_us, "gemv_eager_us": g_eager, "cublas_eager_us": c_eager,
                "use_gemv": use_gemv(m, n, k), "config": cfg}
            rows.append(row)
            print(f"{name:8} {m:>2} {n:>6} {k:>5} | {g_us:16.1f} {c_us:6.1f} | "
                  f"{w_bytes / g_us / 1e3:11.0f} {w_bytes / c_us / 1e3:6.0f} | {c_us / g_us:7.2f} | "
                  f"{g_eager:16.1f} {c_eager:6.1f} | {'yes' if row['use_gemv'] else 'no ':3} "
                  f"n{cfg.block_n} k{cfg.block_k} w{cfg.num_warps} s{cfg.split_k}")
        del weights
        torch.cuda.empty_cache()
    return rows


#: block_n, block_k, num_warps, num_stages of the tensor-core kernel tried by sweep_tc
TC_SWEEP = ((64, 128, 4, 4), (64, 256, 4, 3), (32, 256, 4, 4), (128, 128, 4, 4),
            (32, 128, 4, 6), (64, 64, 4, 8), (128, 64, 8, 6))


def sweep_tc(ms: tuple[int, ...] = (8, 32, 64), dtype: torch.dtype = torch.bfloat16
             ) -> list[dict[str, object]]:
    """Time the tensor-core kernel's candidate configs (TC_SWEEP, split K by _pick_config's rule)
    on Qwen3-4B's shapes against cuBLAS, in CUDA graphs; print the best per shape and M."""
    assert torch.cuda.is_available(), "sweep_tc needs a CUDA GPU"
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict[str, object]] = []
    for name, (n, k) in BENCH_SHAPES.items():
        w_bytes = n * k * torch.finfo(dtype).bits // 8
        copies = max(2, -(-400_000_000 // w_bytes))
        weights = [(torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5).to(dtype)
                   for _ in range(copies)]
        for m in ms:
            x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
            c_us = _time_us(F.linear, x, weights)
            timed = []
            for bn, bk, warps, stages in TC_SWEEP:
                base = GemvConfig(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages,
                                  tensor_cores=True)
                programs = triton.cdiv(n, bn)
                split = 1
                if programs < _NUM_SMS:
                    split = min(max(1, triton.cdiv(k, bk) // 2), triton.cdiv(2 * _NUM_SMS, programs))
                cfg = replace(base, split_k=split)
                try:
                    us = _time_us(lambda x_, w_, c=cfg: _launch(x_, w_, None, None, c), x, weights)
                except Exception as e:  # a config that does not compile (shared memory)
                    print(f"{name} M={m} {cfg}: {type(e).__name__}")
                    continue
                timed.append((us, cfg))
            timed.sort(key=lambda t: t[0])
            best_us, best = timed[0]
            row: dict[str, object] = {"shape": name, "m": m, "cublas_us": c_us, "best_us": best_us,
                                      "best": best, "speedup": c_us / best_us,
                                      "all": [(round(u, 1), c) for u, c in timed]}
            rows.append(row)
            print(f"{name:8} M={m:>2} cuBLAS {c_us:7.1f} us ({w_bytes / c_us / 1e3:5.0f} GB/s) | "
                  f"best {best_us:7.1f} us ({w_bytes / best_us / 1e3:5.0f} GB/s) x{c_us / best_us:.2f}"
                  f" n{best.block_n} k{best.block_k} w{best.num_warps} st{best.num_stages}"
                  f" s{best.split_k} | " + " ".join(f"{u:.0f}" for u, _ in timed))
        del weights
        torch.cuda.empty_cache()
    return rows
