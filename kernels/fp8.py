"""Block-scaled FP8 linear layers (the format of the Qwen FP8 releases): the Triton kernels (the
format's torch code and references beside them in kernels/fp8_ref.py).

Format: `weight` [N, K] float8_e4m3fn and `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] float32;
the real weight is `weight * scale` per (bn, bk) block, edge blocks partial.

In kernels/fp8_ref.py:
- `fp8_dequant_ref`: the dequantised weight (fp32 products, then the asked dtype), as
  transformers dequantises an FP8 checkpoint on a machine without a GPU.
- `fp8_linear_ref`: x @ dequant(weight)^T (+ bias) through F.linear, in x's dtype.
- `quantize_fp8_groups(_ref)`: a W8A8 GEMM's activations, per row and bk-column group.

`fp8_linear` (Triton) picks a kernel by row count (`_pick_fp8_config`, shapes only): up to
GEMV_MAX_M rows kernels/gemv.py's GEMVs, which stream W as they do bf16 weights (W8A16, W read
once: the FMA GEMV scales each run's sum, the tensor-core one dequantises each tile in
registers); a W8A16 tensor-core GEMM up to W8A16_MAX_M rows;
W8A8 beyond (FP8 x FP8 dots, each K step scaled by the activation's and the weight's block
scales). `fp8_silu_mul` runs an MLP's gate_up with its activation in the FMA GEMV's epilogue.
Graph-safe: no host reads of device tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from arle_kernels.fp8_ref import FP8
from arle_kernels.gemv import (
    MMA_MAX_M,
    USE_GEMV_MAX_M,
    GemvConfig,
    dequant_tile,
    fp8_gemv_config,
    gemv_fp8,
    gemv_fp8_silu_mul,
)
from arle_kernels.jit import jit_varying
from arle_kernels.split_sums import SplitSums

# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------

@jit_varying("M")
def _quant_groups_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm,
                         GROUP: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Program (i, g): columns [g*GROUP, (g+1)*GROUP) of rows [i*ROWS, (i+1)*ROWS), each row's
    group quantised with one scale."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    lanes = tl.arange(0, BLOCK)
    offs = tl.program_id(1) * GROUP + lanes
    mask = (rows < M)[:, None] & ((lanes < GROUP) & (offs < K))[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_xm + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    # NOTE: IEEE divisions (div_rn), as torch's: the scale and the quotients are the ref's
    scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10), 448.0)  # FP8_MIN_AMAX, MAX
    q = tl.clamp(tl.div_rn(x, scale[:, None]), -448.0, 448.0)
    tl.store(q_ptr + r64 * stride_qm + offs[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows * stride_sm + tl.program_id(1), scale, mask=rows < M)


def quantize_fp8_groups(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """quantize_fp8_groups_ref on the GPU: one program per group of 8 rows' columns."""
    m, k = x.shape
    assert x.stride(1) == 1
    groups = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    scale = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m > 0:
        rows = 8
        _quant_groups_kernel[(triton.cdiv(m, rows), groups)](
            x, q, scale, m, k, x.stride(0), q.stride(0), scale.stride(0), GROUP=group,
            BLOCK=triton.next_power_of_2(group), ROWS=rows, num_warps=4)
    return q, scale


@dataclass(frozen=True)
class Fp8Config:
    """One FP8 GEMM launch on tensor cores: `kind` "w8a16" (weights dequantised in registers)
    or "w8a8" (x quantised per row and bk columns first); the tile; num_warps / num_stages.
    NOTE: block_k divides the weight's bk, so one K step meets one scale per column."""

    kind: str
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


#: rows up to which kernels/gemv.py's kernels run (W read once, in registers)
GEMV_MAX_M = MMA_MAX_M
#: rows up to which weights are dequantised in registers (memory-bound: no activation
#: quantisation pass); beyond, W8A8 on FP8 tensor cores
W8A16_MAX_M = 64


def _pick_fp8_config(m: int, n: int, k: int, block: tuple[int, int]) -> GemvConfig | Fp8Config:
    """The launch for an [m, k] x [n, k]^T FP8 linear, from shapes only (never mid-serving
    tuning): a small table by row class."""
    bk = block[1]
    if m <= GEMV_MAX_M:
        return fp8_gemv_config(m, n, k, bk)
    if m <= W8A16_MAX_M:
        block_m = max(16, triton.next_power_of_2(m))
        return Fp8Config("w8a16", block_m, 64, min(bk, 128), num_warps=4, num_stages=3)
    block_m = 64 if m <= 256 else 128
    return Fp8Config("w8a8", block_m, 128, min(bk, 128), num_warps=8 if block_m == 128 else 4,
                     num_stages=3)


def fp8_row_classes(n: int, k: int, block: tuple[int, int], max_rows: int) -> tuple[int, ...]:
    """One row count per launch configuration `_pick_fp8_config` gives up to max_rows (the
    kernels compile per config): what a warm-up runs to build every FP8 linear variant."""
    seen: dict[GemvConfig | Fp8Config, int] = {}
    for m in range(1, max_rows + 1):
        seen.setdefault(_pick_fp8_config(m, n, k, block), m)
    return tuple(seen.values())


@jit_varying("M")
def _fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K,
                     stride_am, stride_asm, stride_wn, stride_wsn, stride_ym,
                     A8: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_N: tl.constexpr,
                     GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Program (j, i): tile [i*BLOCK_M.., j*BLOCK_N..] of y = a @ dequant(W)^T (+ bias).
    A8: a is FP8 with per-(row, GROUP_K) scales `as` and each K step's dot is scaled by both
    scales (W8A8); else a is in y's dtype and W's tile is dequantised to it (W8A16)."""
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    rows = tl.minimum(offs_m, M - 1).to(tl.int64)
    cols = tl.minimum(offs_n, N - 1).to(tl.int64)
    a_ptrs = a_ptr + rows[:, None] * stride_am + kk[None, :]
    w_ptrs = w_ptr + cols[None, :] * stride_wn + kk[:, None]  # [BLOCK_K, BLOCK_N]: W^T
    ws_ptrs = ws_ptr + (cols // GROUP_N) * stride_wsn
    as_ptrs = as_ptr + rows * stride_asm
    dtype = y_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = kk < K - k0
        a = tl.load(a_ptrs + k0, mask=k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=k_ok[:, None], other=0.0)
        ws = tl.load(ws_ptrs + k0 // GROUP_K)
        if A8:
            s = tl.load(as_ptrs + k0 // GROUP_K)
            acc += tl.dot(a, w) * s[:, None] * ws[None, :]
        else:
            acc = tl.dot(a, dequant_tile(w, ws[None, :], dtype), acc,
                         input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols).to(tl.float32)[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(dtype), mask=mask)


def _launch_fp8_linear(x: Tensor, weight: Tensor, weight_scale_inv: Tensor,
                       block: tuple[int, int], bias: Tensor | None, cfg: GemvConfig | Fp8Config,
                       sums: bool = False) -> Tensor | SplitSums:
    if isinstance(cfg, GemvConfig):
        return gemv_fp8(x, weight, (weight_scale_inv, block), bias, cfg, sums=sums)
    m, k = x.shape
    n = weight.shape[0]
    bn, bk = block
    assert weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    assert weight_scale_inv.shape == (triton.cdiv(n, bn), triton.cdiv(k, bk))
    assert weight_scale_inv.stride(1) == 1
    assert bk % cfg.block_k == 0, "a K step must stay inside one scale block"
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    b = bias if bias is not None else y  # a dummy pointer when there is no bias
    ws = weight_scale_inv
    a, a_scale = quantize_fp8_groups(x, bk) if cfg.kind == "w8a8" else (x, ws)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))
    _fp8_gemm_kernel[grid](a, a_scale, weight, ws, b, y, m, n, k, a.stride(0),
                           a_scale.stride(0), weight.stride(0), ws.stride(0), y.stride(0),
                           A8=cfg.kind == "w8a8", HAS_BIAS=bias is not None, GROUP_N=bn,
                           GROUP_K=bk, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                           BLOCK_K=cfg.block_k,
                           PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


def fp8_linear(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, block: tuple[int, int],
               bias: Tensor | None = None) -> Tensor:
    """fp8_linear_ref on the GPU: kernels/gemv.py's GEMVs for up to GEMV_MAX_M rows, the W8A16
    tensor-core GEMM up to W8A16_MAX_M rows, W8A8 beyond (x quantised per row and bk columns:
    the last bits of x's precision traded for FP8 tensor cores, as SGLang and vLLM do). Reads
    no device tensor on the host; the tile depends on shapes only (graph-safe)."""
    cfg = _pick_fp8_config(x.shape[0], weight.shape[0], x.shape[1], block)
    y = _launch_fp8_linear(x, weight, weight_scale_inv, block, bias, cfg)
    assert isinstance(y, Tensor)
    return y


def fp8_linear_unreduced(x: Tensor, weight: Tensor, weight_scale_inv: Tensor,
                         block: tuple[int, int]) -> Tensor | SplitSums:
    """fp8_linear (no bias), left as `SplitSums` where the GEMV splits K (as gemv_split_sums:
    for a consumer that sums the slots)."""
    cfg = _pick_fp8_config(x.shape[0], weight.shape[0], x.shape[1], block)
    return _launch_fp8_linear(x, weight, weight_scale_inv, block, None, cfg, sums=True)


def fp8_silu_mul(x: Tensor, gate_up: Tensor, weight_scale_inv: Tensor,
                 block: tuple[int, int]) -> Tensor | None:
    """silu(x gate^T) * (x up^T) for an FP8 gate_up = [gate; up] in one GEMV launch (the
    activation in its epilogue: no [M, 2N] round trip, no `silu_and_mul` launch) where the
    FMA GEMV takes the rows (up to USE_GEMV_MAX_M); None otherwise (the caller's fp8_linear,
    then the activation)."""
    if x.shape[0] > USE_GEMV_MAX_M:
        return None
    return gemv_fp8_silu_mul(x, gate_up, (weight_scale_inv, block))
