"""Decode-time linear layer y = x @ W^T for a few rows (GEMV): a Triton kernel and its reference.

At batch 1 a decode step reads every weight once and does ~1 FLOP per byte, so a linear layer
is bound by how fast W streams from HBM. This kernel is built for that: W [N, K] row-major (as
nn.Linear stores it), x [M, K] with M small (1..32), fp32 accumulation, output in x's dtype.
Three kernels share that contract: `_gemv_kernel` (FMAs, 1-2 rows), and on tensor cores
`_gemv_tma_kernel` (Hopper, 3..32 rows: tiles brought in by the copy engine) or elsewhere
`_gemv_mma_kernel` (cp.async, 3..16 rows); their docstrings say why and how.

- Each program owns BLOCK_N output columns for *all* M rows, so W is read exactly once per
  step whatever M is; x (a few KB) is re-read by every program, from L1/L2.
- It walks its K range in BLOCK_K chunks: a [BLOCK_N, BLOCK_K] tile of W per step, 16-byte
  vector loads along K (BLOCK_K = 8 bf16 x 32 lanes x warps x runs per lane). Each thread sums
  the products of its 8-element runs in registers into an fp32 accumulator; the sum across
  lanes and warps happens once, after the loop (no cross-thread traffic inside it).
- At M = 1 a program is one warp and one output row: N programs (2560..151936) keep enough
  loads in flight on all 132 SMs without splitting K. When N gives too few programs anyway
  (N < 264), K is split over programs that write fp32 partials, and a second small kernel
  sums them in a fixed order (deterministic: no atomics), adds the bias and casts.
- W does not depend on the kernel before it: under programmatic dependent launch the first
  chunk of W is loaded before `gdc_wait` (kernels/jit.py), while that kernel still runs. The
  tensor-core kernel on TMA loads nothing before its wait; for most layers it lets the next
  kernel launch only after its K loop (`_late_trigger`), or two chunks before its end where a
  norm comes next (`_trigger_ahead`).
- `gemv_silu_mul`: an MLP's gate_up projection with its activation in the epilogue. A program
  sums gate row n and up row n + N and stores silu(gate) * up (HF's roundings): one launch and
  no [M, 2N] round trip.

- `gemv_split_sums`: y left as `SplitSums` (kernels/split_sums.py) where the tensor-core
  kernel splits K: pairs of splits add their fp32 tiles atomically into zeroed slots and the
  next kernel (the norm, the rope) sums them, so no `_split_reduce_kernel` launch (the
  decoder's qkv, o_proj and down).

One config per (M, N, K), picked by `_pick_config` (no autotune). The wrapper reads no device
tensor on the host and sizes its grid from shapes only, so it is safe to capture in a CUDA graph.
`use_gemv(m, n, k, glu)` is the rule for when to call it instead of F.linear (cuBLAS);
`scripts/bench_kernels.py gemv` times both, `... sweep` the kernels' tiles.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from arle_kernels.fused import silu_mul
from arle_kernels.fused_ref import silu_and_mul_ref
from arle_kernels.jit import (
    gdc_launch_dependents,
    gdc_wait,
    hopper_gpu,
    jit_varying,
    pdl_enabled,
    pdl_launch,
)
from arle_kernels.split_sums import MAX_ROWS, SplitSums, slot_buffer
from arle_kernels.w4a16_ref import W4_RUN_COLS

#: rows up to this many run through the kernel (beyond it cuBLAS's GEMM is the right tool);
#: split sums' slot buffers hold as many
MAX_M = MAX_ROWS
#: rows up to which the FMA kernel beats cuBLAS on every layer (see use_gemv)
USE_GEMV_MAX_M = 2
#: rows the cp.async tensor-core kernel is taken for (swept at 8 and 16); with TMA, up to MAX_M
MMA_MAX_M = 16
#: the bytes of a thread's contiguous load of W in the FMA GEMVs (here and kernels/moe.py's)
RUN_BYTES = 16
#: the FMA kernel's run over an FP8 weight: 16 values, one 16-byte load
FP8_RUN = RUN_BYTES
#: an FP8 weight's block scales [ceil(N / bn), ceil(K / bk)] and its block (bn, bk)
Scale = tuple[Tensor, tuple[int, int]]
#: a 4-bit weight's scales and zeros [N, 2, K / group] (fp16) and its group
W4 = tuple[Tensor, int]
NUM_SMS = 132  # H100/H200; only shapes the choice of split (a guess elsewhere is still correct)


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters: BLOCK_N outputs per program, BLOCK_K elements of K per loop step,
    split_k programs along K (1: no split), and num_warps / num_stages.

    NOTE: on a GPU, block_k should be 8 * 32 * num_warps times a power of two: then the x and
    W tiles get the same register layout (see the kernel). Any power of two >= 8 is correct."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1
    split_k: int = 1
    mma: bool = False  # tensor cores (3..32 rows) rather than FMAs
    tma: bool = False  # with mma: tiles brought in by TMA (`_gemv_tma_kernel`, Hopper)
    stack: bool = False  # 4-bit: a program takes 2 x block_n rows, a thread one of each half

    @property
    def rows(self) -> int:
        """Rows of W (outputs) a program takes."""
        return self.block_n * (2 if self.stack else 1)


@triton.jit
def load_chunk(ptrs, k0, K, kk, EVEN_K: tl.constexpr, EVICT: tl.constexpr):
    """One BLOCK_K chunk of rows at ptrs (offsets k0 + kk); past K reads nothing (zeros)."""
    if EVEN_K:
        return tl.load(ptrs + k0, eviction_policy=EVICT)
    return tl.load(ptrs + k0, mask=k0 + kk < K, other=0.0, eviction_policy=EVICT)


@triton.jit
def load_weight_runs(w_ptrs, ws_ptrs, k0, K, kk, starts, EVEN_K: tl.constexpr,
                     SCALED: tl.constexpr, SCALE_K: tl.constexpr):
    """A chunk of W's runs ([.., BLOCK_K // RUN, RUN] at w_ptrs + k0), streamed (evict first)
    as stored, and SCALED (FP8) each run's block scale, one gathered per run at ws_ptrs ([..,
    1] beside the runs; `starts`: each run's first column); unscaled, 1.
    NOTE: RUN divides SCALE_K, so a run meets one scale; a block's runs share it (cached)."""
    # NOTE: one return per function: Triton checks every return's type, also in static ifs
    w = load_chunk(w_ptrs, k0, K, kk, EVEN_K, "evict_first")
    s = 1.0
    if SCALED:
        cols = k0 + starts
        if EVEN_K:
            s = tl.load(ws_ptrs + cols // SCALE_K)
        else:
            s = tl.load(ws_ptrs + cols // SCALE_K, mask=cols < K, other=0.0)
    return w, s


@triton.jit
def run_sums(x, w, s, SCALED: tl.constexpr):
    """x [.., BLOCK_K // RUN, RUN] (fp32) times a chunk of W's runs (`load_weight_runs`), each
    run's products summed in registers -> [.., BLOCK_K // RUN]. SCALED: the exact FP8 values
    are multiplied and each run's sum is scaled once, so a weight costs one conversion and one
    FMA (dequantising each weight first bounded the kernel on its conversions)."""
    sums = tl.sum(x * w.to(tl.float32), axis=3)
    if SCALED:
        sums = sums * tl.sum(s, axis=3)  # [.., 1] -> [..]
    return sums


@triton.jit
def load_run_sums(x, w_ptrs, ws_ptrs, k0, K, kk, starts, EVEN_K: tl.constexpr,
                  SCALED: tl.constexpr, SCALE_K: tl.constexpr):
    """One K chunk of a streamed GEMV: `load_weight_runs` then `run_sums` with x."""
    w, s = load_weight_runs(w_ptrs, ws_ptrs, k0, K, kk, starts, EVEN_K, SCALED, SCALE_K)
    return run_sums(x, w, s, SCALED)


@triton.jit
def dequant_tile(w, scale, dtype: tl.constexpr):
    """An FP8 weight tile times its (broadcast) block scale, in fp32, rounded to `dtype`: the
    weight kernels/fp8.py's reference dequantises, in registers (W8A16 on tensor cores).
    NOTE: the FMA GEMVs scale each run's sum instead (`run_sums`); on tensor cores, scaling
    each tile's dot after it measured slower on the H200 (MoE experts at 8 tokens: 119 us
    against 110, `bench_kernels.py moe`)."""
    return (w.to(tl.float32) * scale).to(dtype)


@triton.jit
def _load_w_tile(w_ptrs, ws_ptrs, k0, K, offs_k, EVEN_K: tl.constexpr, SCALED: tl.constexpr,
                 SCALE_K: tl.constexpr, dtype: tl.constexpr):
    """The tensor-core kernel's [BLOCK_N, BLOCK_K] tile of W; SCALED, dequantised to `dtype`
    with one scale a row (the tile lies inside one scale block along K)."""
    w = load_chunk(w_ptrs, k0, K, offs_k[None, :], EVEN_K, "evict_first")
    if SCALED:
        w = dequant_tile(w, tl.load(ws_ptrs + k0 // SCALE_K), dtype)
    return w


@triton.jit
def _program_tile(M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """Both GEMV kernels' start: let the next kernel launch (PDL), then this program's split
    index, row offsets and output columns."""
    if PDL:
        gdc_launch_dependents()
    offs_m = tl.arange(0, M_PAD)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    return tl.program_id(1), offs_m, offs_n


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, k_per_split,
                 stride_xm, stride_wn, stride_wsn, stride_ym, stride_ys,
                 HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, EVEN_K: tl.constexpr,
                 M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GLU: tl.constexpr, PDL: tl.constexpr, SCALED: tl.constexpr = False,
                 SCALE_N: tl.constexpr = 1, SCALE_K: tl.constexpr = 1, RUN: tl.constexpr = 8):
    """Program (j, s): columns [j*BLOCK_N, (j+1)*BLOCK_N) of y for all M rows, summed over
    K range [s*k_per_split, (s+1)*k_per_split).

    Not PARTIAL: adds the bias and stores y in its dtype. PARTIAL (split K): y is an fp32
    buffer [splits, M, N] (stride_ys between splits) that takes the program's partial sums.
    GLU: W is [gate; up] with 2N rows; the program also sums up's rows n + N and stores
    silu(gate) * up (never PARTIAL, no bias).
    SCALED: W is FP8 with block scales ws [ceil(N / SCALE_N), ceil(K / SCALE_K)]; each run's
    sum is scaled (`run_sums`).
    NOTE: k_per_split is a multiple of BLOCK_K; EVEN_K means K is too, and every split is
    full (no masks at all). A run (RUN elements: 16 bytes of W) never crosses a scale block.
    """
    pid_k, offs_m, offs_n = _program_tile(M_PAD, BLOCK_N, PDL)
    # A K chunk is viewed as [BLOCK_K // RUN, RUN]: a thread owns runs of RUN contiguous
    # elements (one 16-byte load of W) and sums its products over a run at once, in registers;
    # lanes and warps span BLOCK_K // RUN, and the sum across them happens once, after the loop.
    # NOTE: the x and W tiles are both 4-D with this same [BLOCK_K // RUN, RUN] tail, so Triton
    # gives them one register layout and the broadcast multiply moves no data between threads.
    starts = (tl.arange(0, BLOCK_K // RUN) * RUN)[:, None]
    kk = (starts + tl.arange(0, RUN)[None, :])[None, None, :, :]  # [1, 1, BK/RUN, RUN]
    starts = starts[None, None, :, :]  # [1, 1, BK/RUN, 1]: each run's first column
    # NOTE: padded rows (m >= M) and columns (n >= N) re-read the last valid row of x / W, so
    # no load needs a mask for them; their sums are never stored.
    rows_x = tl.minimum(offs_m, M - 1)
    rows_w = tl.minimum(offs_n, N - 1).to(tl.int64)
    x_ptrs = x_ptr + rows_x[:, None, None, None] * stride_xm + kk  # [M_PAD, 1, BK/RUN, RUN]
    w_ptrs = w_ptr + rows_w[None, :, None, None] * stride_wn + kk  # [1, BLOCK_N, BK/RUN, RUN]
    up_ptrs = w_ptrs + N * stride_wn  # GLU only
    # SCALED: each run's scale [1, BLOCK_N, BK/RUN, 1] (GLU: up's rows N.. have their own)
    ws_ptrs = ws_ptr + (rows_w // SCALE_N)[None, :, None, None] * stride_wsn
    up_ws_ptrs = ws_ptr + ((rows_w + N) // SCALE_N)[None, :, None, None] * stride_wsn
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)  # the last split may end past K
    # W is streamed once: evict it first from L2, keep x (read by every program).
    # NOTE: W does not depend on the previous kernel, so its first chunk is loaded before
    # waiting for that kernel (PDL); the loop starts one chunk later. The last split may run
    # past K (whole chunks of masked loads: no memory traffic).
    w, s = load_weight_runs(w_ptrs, ws_ptrs, k_lo, K, kk, starts, EVEN_K, SCALED, SCALE_K)
    if GLU:
        w_up, s_up = load_weight_runs(up_ptrs, up_ws_ptrs, k_lo, K, kk, starts, EVEN_K, SCALED,
                                      SCALE_K)
    if PDL:
        gdc_wait()
    x = load_chunk(x_ptrs, k_lo, K, kk, EVEN_K, "evict_last").to(tl.float32)
    acc = run_sums(x, w, s, SCALED)  # [M_PAD, BLOCK_N, BLOCK_K // RUN]
    acc_up = acc  # GLU: up's sums; otherwise unused
    if GLU:
        acc_up = run_sums(x, w_up, s_up, SCALED)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        x = load_chunk(x_ptrs, k0, K, kk, EVEN_K, "evict_last").to(tl.float32)
        acc += load_run_sums(x, w_ptrs, ws_ptrs, k0, K, kk, starts, EVEN_K, SCALED, SCALE_K)
        if GLU:
            acc_up += load_run_sums(x, up_ptrs, up_ws_ptrs, k0, K, kk, starts, EVEN_K, SCALED,
                                    SCALE_K)
    store_rows(tl.sum(acc, axis=2), tl.sum(acc_up, axis=2), offs_m, offs_n, pid_k, b_ptr,
               y_ptr, M, N, stride_ym, stride_ys, HAS_BIAS, PARTIAL, GLU)


@triton.jit
def store_rows(y, y_up, offs_m, offs_n, pid_k, b_ptr, y_ptr, M, N, stride_ym, stride_ys,
               HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, GLU: tl.constexpr):
    """The FMA GEMVs' epilogue: sums y [M_PAD, BLOCK_N] to y [M, N] (PARTIAL: fp32 into split
    pid_k's slice) with the bias, or silu(y) * y_up (GLU; y_up is ignored otherwise), in y's
    dtype."""
    out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if PARTIAL:
        y_ptrs = y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, y, mask=out_mask)
    else:
        dtype = y_ptr.dtype.element_ty
        if HAS_BIAS:
            b = tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0)
            y += b.to(tl.float32)[None, :]
        if GLU:
            y = silu_mul(y.to(dtype), y_up.to(dtype))
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, y.to(dtype), mask=out_mask)


@triton.jit
def load_w4_runs(w_ptrs, s_ptrs, k0, K, kw, cols, EVEN_K: tl.constexpr, GROUP: tl.constexpr):
    """A chunk of a 4-bit weight at column k0: its runs' words [.., R, W4_RUN] at word offsets
    kw (streamed), and each run's scale and zero [.., R, 1] (`cols`: each run's first column;
    s_ptrs at the row's scales, its zeros K / GROUP further). A run lies in one group."""
    # NOTE: k0 is a whole number of runs: the hint lets the words load in 16 bytes
    words = load_chunk(w_ptrs, tl.multiple_of(k0 // 8, 4), tl.multiple_of(K // 8, 4), kw,
                       EVEN_K, "evict_first").to(tl.uint32, bitcast=True)
    g = (k0 + cols) // GROUP
    if EVEN_K:
        s = tl.load(s_ptrs + g)
        z = tl.load(s_ptrs + K // GROUP + g)
    else:
        s = tl.load(s_ptrs + g, mask=k0 + cols < K, other=0.0)
        z = tl.load(s_ptrs + K // GROUP + g, mask=k0 + cols < K, other=0.0)
    return words, s, z


#: a float dtype -> (MAGIC, CENTRE): for a nibble q, q | MAGIC read as that float is
#: CENTRE - 8 + q (1024 + q in fp16, 128 + q in bf16, 2^23 + q in fp32), so q - 8 comes exact
#: from the bits, with no int-to-float conversion (a quarter-rate instruction)
W4_CENTRED = {torch.float16: (0x6400, 1032.0), torch.bfloat16: (0x4300, 136.0),
              torch.float32: (0x4B000000, 8388616.0)}


@triton.jit
def centred_nibbles(words, MAGIC: tl.constexpr, CENTRE: tl.constexpr, dtype: tl.constexpr):
    """Each word's low nibble q as the float q - 8 in dtype, exact (W4_CENTRED's rule)."""
    bits = (words & 0xF) | MAGIC
    if dtype.primitive_bitwidth == 16:
        bits = bits.to(tl.int16)
    return bits.to(dtype, bitcast=True) - CENTRE


#: the exponent that x's products with a nibble carry (`_nibble_product`): x is scaled up by
#: 2^(W4_SHIFT - 4J) and the nibble is the denormal q 2^(4J - 149), so each product is
#: x q 2^(W4_SHIFT - 149) in every nibble position. 88 keeps x exact up to |x| < 2^40 and
#: products normal (so exact) down to |x q| >= 2^-65, far past activations either way.
W4_SHIFT = tl.constexpr(88)


@triton.jit
def _w4_x_ptrs(x_ptr, row, stride_xm, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Row `row` of x: its pointers at nibble 0's columns of each run in a chunk, [1, BLOCK_N,
    R, P]: bf16 x as int32 pairs of columns (P = 2, `_x_slice`), else single columns (P = 4).
    NOTE: a row at a time, broadcast over the program's rows of W, x gets the words' register
    layout: each warp loads the x of its own rows (L1 hits). With x's own layout (or rows of x
    as a dimension) Triton moved x through shared memory every chunk (stmatrix, barriers)."""
    PAIRS: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    P: tl.constexpr = 2 if PAIRS else 4
    runs = tl.arange(0, BLOCK_K // 32)
    # NOTE: offsets in the loaded unit (a pair or a value), so Triton sees them contiguous
    offs = (runs[:, None] * (32 // (4 // P)) + tl.arange(0, P)[None, :])[None, None, :, :]
    if PAIRS:
        ptrs = x_ptr.to(tl.pointer_type(tl.int32)) + row * (stride_xm // 2) + offs
    else:
        ptrs = x_ptr + row * stride_xm + offs
    return tl.broadcast_to(ptrs, (1, BLOCK_N, BLOCK_K // 32, P))


@triton.jit
def _x_slice(x_ptrs, live, j: tl.constexpr):
    """x at nibble j's columns 4j + i of each run (x_ptrs at the chunk's nibble 0; zeros where
    not `live`), times 2^(W4_SHIFT - 4J) (J as `_nibble_product`), as fp32 [.., R, 2] at
    i = 0, 2 and at i = 1, 3.
    bf16 pairs are scaled as they become fp32: the shift goes into the exponent bits, one
    integer op a value (exact for normal x; a zero becomes 2^-127 in effect, nothing to a sum)."""
    J: tl.constexpr = j - 3 if j >= 5 else j
    SCALE: tl.constexpr = W4_SHIFT - 4 * J
    if x_ptrs.dtype.element_ty == tl.int32:
        p = tl.load(x_ptrs + 2 * j, mask=live, other=0, eviction_policy="evict_last")
        even = ((p << 16) + (SCALE << 23)).to(tl.float32, bitcast=True)
        odd = ((p & -65536) + (SCALE << 23)).to(tl.float32, bitcast=True)
    else:
        x = tl.load(x_ptrs + 4 * j, mask=live, other=0.0, eviction_policy="evict_last")
        x = x.to(tl.float32)
        x = x * (2.0 ** SCALE)
        even, odd = tl.split(tl.reshape(x, (x.shape[0], x.shape[1], x.shape[2], 2, 2)))
    return even, odd


@triton.jit
def _nibble_product(x, words, high, dot, j: tl.constexpr):
    """x from `_x_slice` times q: each product is x q 2^(W4_SHIFT - 149) (exact: powers of
    two). Nibble j becomes the fp32 q 2^(4J - 149) by one AND: it stays at bits 4J.. of a
    float whose exponent bits are zero (a denormal, which the FMA takes at full rate). Bits
    23.. are the exponent's, so nibbles 5-7 come from `high` (the words >> 12) at J = j - 3."""
    J: tl.constexpr = j - 3 if j >= 5 else j
    src = high if j >= 5 else words
    return tl.fma(x, (src & (0xF << (4 * J))).to(tl.float32, bitcast=True), dot)


@triton.jit
def _split_words(words):
    """A chunk's words [.., R, 4] -> those of i = 0, 2 and of i = 1, 3, each with its words
    >> 12 (`_nibble_product`'s `high`), [.., R, 2]."""
    even, odd = tl.split(tl.reshape(words, (words.shape[0], words.shape[1], words.shape[2], 2,
                                            2)))
    return even, odd, even >> 12, odd >> 12


@triton.jit
def _run_result(dot, xs, s, z):
    """Per run: (scale 2^(149 - W4_SHIFT)) * sum(dot) + (zero - 8 scale) * sum(xs)."""
    s = tl.sum(s, axis=3).to(tl.float32)
    return (tl.sum(dot, axis=3) * (s * (2.0 ** (149 - W4_SHIFT)))
            + xs * (tl.sum(z, axis=3).to(tl.float32) - 8.0 * s))


@triton.jit
def w4_run_sums(x_ptrs, k0, K, cols, words, s, z, words2, s2, z2, EVEN_K: tl.constexpr,
                TWO: tl.constexpr):
    """A chunk of 4-bit runs (`load_w4_runs`) times x (pointers from `_w4_x_ptrs`) ->
    [M_PAD, BLOCK_N, R]: per run, scale * sum x (q - 8) + zero * sum x, computed as
    (scale 2^(149 - W4_SHIFT)) * sum x q 2^(W4_SHIFT - 149) + (zero - 8 scale) * sum x;
    TWO: the same for a second chunk of runs (words2, s2, z2: other rows, or GLU's up) on the
    same x, whose loads, conversions and sum both share (else the second result is the first).
    Nibble j of a run's word i is the run's column 4j + i (kernels/w4a16.py's layout); x comes
    in the words' register layout, so no data moves between threads. A weight costs an AND and
    an FMA, its x value a conversion (with the scale, `_x_slice`) and an add."""
    PER: tl.constexpr = 2 if x_ptrs.dtype.element_ty == tl.int32 else 1  # values a load unit
    x_ptrs += k0 // PER
    # NOTE: a mask a run ([1, 1, R, 1]: a run lies wholly before or past K), so x's loads keep
    # their vectors; past K the words, scales and zeros load as 0 too. Moving the pointers
    # instead (tl.where) made Triton move x's products through shared memory
    live = True if EVEN_K else k0 + cols < K
    e, o, eh, oh = _split_words(words)
    e2, o2, eh2, oh2 = _split_words(words2)
    dot = tl.zeros(e.shape, tl.float32)
    dot2 = dot
    xs = tl.zeros(e.shape, tl.float32)
    for j in tl.static_range(8):
        xe, xo = _x_slice(x_ptrs, live, j)
        dot = _nibble_product(xo, o, oh, _nibble_product(xe, e, eh, dot, j), j)
        if TWO:
            dot2 = _nibble_product(xo, o2, oh2, _nibble_product(xe, e2, eh2, dot2, j), j)
        xs = tl.fma(xe + xo, 2.0 ** (4 * (j - 3 if j >= 5 else j) - W4_SHIFT), xs)  # unscaled
    xs = tl.sum(xs, axis=3)
    acc = _run_result(dot, xs, s, z)
    acc2 = acc
    if TWO:
        acc2 = _run_result(dot2, xs, s2, z2)
    return acc, acc2


@triton.jit
def _gemv_w4_kernel(x_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, k_per_split,
                    stride_xm, stride_wn, stride_wsn, stride_ym, stride_ys,
                    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, EVEN_K: tl.constexpr,
                    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GLU: tl.constexpr, PDL: tl.constexpr, GROUP: tl.constexpr,
                    STACK: tl.constexpr, PREFETCH: tl.constexpr):
    """`_gemv_kernel`'s contract for a 4-bit weight (W4A16, kernels/w4a16.py's layout): w_ptr
    int32 words [N (GLU: 2N), K / 8], ws_ptr fp16 scales and zeros [N, 2, K / GROUP].

    A K chunk is R = BLOCK_K / 32 runs of 4 words; a thread owns a run of each of its rows
    (one 16-byte load each) and sums its 32 products a row (`w4_run_sums`); lanes span the
    runs (or two rows' runs), warps further rows. A thread takes two rows of W on the same x
    (GLU: a gate row and its up row; STACK: a row and the row BLOCK_N on), which share x's
    loads, conversions and sums; rows of x (M <= MAX_W4_ROWS = 2) go one at a time.
    PREFETCH: the next chunk's words are loaded before this chunk's sums.
    The kernel was bound by its instructions and latency, not by DRAM (ncu, H100, qkv at one
    row before these rules: 12 instructions a weight, a warp issued every 1.45 cycles, DRAM
    22% busy): x is read in the words' layout (no shared memory), bf16 x converted and scaled
    by integer adds, each x value shared by two rows.
    NOTE: num_warps <= BLOCK_N * BLOCK_K / 1024 keeps every thread on its own run, so x and the
    words [1, BLOCK_N, R, 4] get one register layout (no conversions)."""
    pid_k, offs_m, offs_n = _program_tile(M_PAD, BLOCK_N, PDL)
    TWO: tl.constexpr = GLU or STACK
    if STACK:
        offs_n += tl.program_id(0) * BLOCK_N  # a program's rows: offs_n, then offs_n + BLOCK_N
    # NOTE: literals: a run is W4_RUN = 4 words, W4_RUN_COLS = 32 columns
    runs = tl.arange(0, BLOCK_K // 32)[:, None]
    kw = (runs * 4 + tl.arange(0, 4)[None, :])[None, None, :, :]  # [1, 1, R, 4]: word offsets
    cols = (runs * 32)[None, None, :, :]  # [1, 1, R, 1]: each run's first column
    rows_w = tl.minimum(offs_n, N - 1).to(tl.int64)  # padded rows re-read the last valid one
    # the second set of rows: GLU's up (N rows on), STACK's next BLOCK_N rows
    rows_2 = rows_w + N if GLU else tl.minimum(offs_n + BLOCK_N, N - 1).to(tl.int64)
    x0_ptrs = _w4_x_ptrs(x_ptr, 0, stride_xm, BLOCK_N, BLOCK_K)
    x1_ptrs = _w4_x_ptrs(x_ptr, tl.minimum(1, M - 1), stride_xm, BLOCK_N, BLOCK_K)
    w_ptrs = w_ptr + rows_w[None, :, None, None] * stride_wn + kw
    s_ptrs = ws_ptr + rows_w[None, :, None, None] * stride_wsn
    w2_ptrs = w_ptr + rows_2[None, :, None, None] * stride_wn + kw  # TWO only
    s2_ptrs = ws_ptr + rows_2[None, :, None, None] * stride_wsn
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)  # the last split may end past K
    # the first chunk of W before waiting for the kernel before (PDL), as `_gemv_kernel`
    words, s, z = load_w4_runs(w_ptrs, s_ptrs, k_lo, K, kw, cols, EVEN_K, GROUP)
    words2, s2, z2 = words, s, z
    if TWO:
        words2, s2, z2 = load_w4_runs(w2_ptrs, s2_ptrs, k_lo, K, kw, cols, EVEN_K, GROUP)
    if PDL:
        gdc_wait()
    # [1, BLOCK_N, R]: x's row 0 (acc), row 1 (acc1) against W's rows (acc*) and the second
    # set (acc2*)
    acc = tl.zeros((1, BLOCK_N, BLOCK_K // 32), tl.float32)
    acc2, acc1, acc21 = acc, acc, acc
    for k0 in range(k_lo, k_hi, BLOCK_K):
        # the next chunk's loads go out before this one's sums (the last chunk reloads itself)
        kn = tl.where(k0 + BLOCK_K < k_hi, k0 + BLOCK_K, k0)
        if PREFETCH:
            nw, ns, nz = load_w4_runs(w_ptrs, s_ptrs, kn, K, kw, cols, EVEN_K, GROUP)
            nw2, ns2, nz2 = nw, ns, nz
            if TWO:
                nw2, ns2, nz2 = load_w4_runs(w2_ptrs, s2_ptrs, kn, K, kw, cols, EVEN_K, GROUP)
        a, a2 = w4_run_sums(x0_ptrs, k0, K, cols, words, s, z, words2, s2, z2, EVEN_K, TWO)
        acc += a
        acc2 += a2
        if M_PAD == 2:
            a, a2 = w4_run_sums(x1_ptrs, k0, K, cols, words, s, z, words2, s2, z2, EVEN_K, TWO)
            acc1 += a
            acc21 += a2
        if PREFETCH:
            words, s, z, words2, s2, z2 = nw, ns, nz, nw2, ns2, nz2
        else:
            words, s, z = load_w4_runs(w_ptrs, s_ptrs, kn, K, kw, cols, EVEN_K, GROUP)
            if TWO:
                words2, s2, z2 = load_w4_runs(w2_ptrs, s2_ptrs, kn, K, kw, cols, EVEN_K, GROUP)
    y = _x_rows(tl.sum(acc, axis=2), tl.sum(acc1, axis=2), M_PAD)
    y2 = _x_rows(tl.sum(acc2, axis=2), tl.sum(acc21, axis=2), M_PAD)
    store_rows(y, y2, offs_m, offs_n, pid_k, b_ptr, y_ptr, M, N, stride_ym, stride_ys, HAS_BIAS,
               PARTIAL, GLU)
    if STACK:
        store_rows(y2, y2, offs_m, offs_n + BLOCK_N, pid_k, b_ptr, y_ptr, M, N, stride_ym,
                   stride_ys, HAS_BIAS, PARTIAL, False)


@triton.jit
def _x_rows(y0, y1, M_PAD: tl.constexpr):
    """Rows 0 and 1 of x's results ([1, BLOCK_N] each) as [M_PAD, BLOCK_N]."""
    y = y0
    if M_PAD == 2:
        y = tl.reshape(tl.permute(tl.join(y0, y1), (0, 2, 1)), (2, y0.shape[1]))
    return y


@triton.jit
def _store_transposed(acc, acc_up, offs_n, offs_m, pid_k, b_ptr, y_ptr, M, N, stride_ym,
                      stride_ys, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                      GLU: tl.constexpr, PAIRED: tl.constexpr):
    """The tensor-core kernels' epilogue: y^T tile acc [BLOCK_N, M_PAD] to y [M, N] (PARTIAL:
    fp32 into split pid_k's slice; PAIRED: added into slot pid_k // 2, see `SplitSums`) with
    the bias, or silu(acc) * acc_up (GLU), in y's dtype."""
    out_mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
    if PAIRED:
        # NOTE: at most two splits land in a slot that holds zeros: 0 + a + b == 0 + b + a in
        # fp32, so the slot is the same whichever program arrives first (deterministic)
        y_ptrs = y_ptr + (pid_k // 2) * stride_ys + offs_m[None, :] * stride_ym + offs_n[:, None]
        tl.atomic_add(y_ptrs, acc, mask=out_mask, sem="relaxed")
    elif PARTIAL:
        y_ptrs = y_ptr + pid_k * stride_ys + offs_m[None, :] * stride_ym + offs_n[:, None]
        tl.store(y_ptrs, acc, mask=out_mask)
    else:
        dtype = y_ptr.dtype.element_ty
        y = acc
        if HAS_BIAS:
            b = tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0)
            y += b.to(tl.float32)[:, None]
        if GLU:
            y = silu_mul(y.to(dtype), acc_up.to(dtype))
        y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
        tl.store(y_ptrs, y.to(dtype), mask=out_mask)


# NOTE: M and the partials' split stride (M x N) change with the batch: not specialised, so
# eager steps of 3..16 rows share one variant (see jit_varying)
@jit_varying("M", "stride_ys")
def _gemv_mma_kernel(x_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, k_per_split,
                     stride_xm, stride_wn, stride_wsn, stride_ym, stride_ys,
                     HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, EVEN_K: tl.constexpr,
                     M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GLU: tl.constexpr, PDL: tl.constexpr, PRECISION: tl.constexpr,
                     PAIRED: tl.constexpr = False, SCALED: tl.constexpr = False,
                     SCALE_N: tl.constexpr = 1, SCALE_K: tl.constexpr = 1):
    """`_gemv_kernel`'s contract (same arguments, same outputs) for 3..16 rows, on tensor cores:
    y^T [BLOCK_N, M_PAD] += W tile [BLOCK_N, BLOCK_K] @ x^T tile [BLOCK_K, M_PAD] ("swap AB":
    the weight's rows fill the MMA's 16+ rows, the few rows of x its narrow side, padded to 16).

    At 8 rows an FMA kernel does 8 multiply-adds per weight element and runs out of issue
    slots; one MMA does them all. W is still read once per step, by many small programs
    (1-4 warps), its first tile before `gdc_wait` as in `_gemv_kernel`.
    SCALED: FP8 W with block scales (`_gemv_kernel`'s), each tile dequantised in registers.
    NOTE: the config depends on (N, K) only, never on M, so a row's sum runs in the same order
    whatever else is in the batch (batch invariance). SCALED: BLOCK_K divides SCALE_K."""
    pid_k, offs_m, offs_n = _program_tile(M_PAD, BLOCK_N, PDL)
    offs_k = tl.arange(0, BLOCK_K)
    # NOTE: padded rows / columns re-read the last valid row of x / W: no masks for them
    rows_x = tl.minimum(offs_m, M - 1)
    rows_w = tl.minimum(offs_n, N - 1).to(tl.int64)
    w_ptrs = w_ptr + rows_w[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + rows_x[None, :] * stride_xm + offs_k[:, None]  # [BLOCK_K, M_PAD]: x^T
    up_ptrs = w_ptrs + N * stride_wn  # GLU only
    ws_ptrs = ws_ptr + (rows_w // SCALE_N)[:, None] * stride_wsn  # SCALED: [BLOCK_N, 1]
    up_ws_ptrs = ws_ptr + ((rows_w + N) // SCALE_N)[:, None] * stride_wsn
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)  # the last split may end past K
    acc = tl.zeros([BLOCK_N, M_PAD], tl.float32)
    acc_up = tl.zeros([BLOCK_N, M_PAD], tl.float32)
    dtype = x_ptr.dtype.element_ty
    w = _load_w_tile(w_ptrs, ws_ptrs, k_lo, K, offs_k, EVEN_K, SCALED, SCALE_K, dtype)
    if GLU:
        w_up = _load_w_tile(up_ptrs, up_ws_ptrs, k_lo, K, offs_k, EVEN_K, SCALED, SCALE_K, dtype)
    if PDL:
        gdc_wait()
    x = load_chunk(x_ptrs, k_lo, K, offs_k[:, None], EVEN_K, "evict_last")
    acc = tl.dot(w, x, acc, input_precision=PRECISION)
    if GLU:
        acc_up = tl.dot(w_up, x, acc_up, input_precision=PRECISION)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        w = _load_w_tile(w_ptrs, ws_ptrs, k0, K, offs_k, EVEN_K, SCALED, SCALE_K, dtype)
        x = load_chunk(x_ptrs, k0, K, offs_k[:, None], EVEN_K, "evict_last")
        acc = tl.dot(w, x, acc, input_precision=PRECISION)
        if GLU:
            w_up = _load_w_tile(up_ptrs, up_ws_ptrs, k0, K, offs_k, EVEN_K, SCALED, SCALE_K,
                                dtype)
            acc_up = tl.dot(w_up, x, acc_up, input_precision=PRECISION)
    _store_transposed(acc, acc_up, offs_n, offs_m, pid_k, b_ptr, y_ptr, M, N, stride_ym,
                      stride_ys, HAS_BIAS, PARTIAL, GLU, PAIRED)


# NOTE: M changes with the batch and is not specialised (one variant per M_PAD: 16, 32)
@jit_varying("M", "stride_ys")
def _gemv_tma_kernel(x_desc, w_desc, b_ptr, y_ptr, M, N, K, k_per_split, stride_ym, stride_ys,
                     HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, M_PAD: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GLU: tl.constexpr,
                     PDL: tl.constexpr, PRECISION: tl.constexpr, PAIRED: tl.constexpr = False,
                     LATE: tl.constexpr = True, AHEAD: tl.constexpr = 0):
    """`_gemv_mma_kernel`'s contract with the tiles brought in by the copy engine (TMA):
    y^T [BLOCK_N, M_PAD] += W tile [BLOCK_N, BLOCK_K] @ x^T tile [BLOCK_K, M_PAD], W and x read
    through tensor descriptors (x's rows past M and K's tail arrive as zeros: no masks, no
    index math), `num_stages` tiles in flight per program (Triton pipelines the TMA loads
    with barriers), and the MMA from shared memory (wgmma on a warpgroup at BLOCK_N >= 64,
    mma.sync below). No load before `gdc_wait`: the loop's pipeline starts after it.

    LATE (under PDL, `_late_trigger`): let the next kernel launch after the K loop, not first
    thing as the other kernels do. This kernel's programs hold 80-180 KB of shared memory; a
    next kernel launched early got resident only on the SMs with room left, lopsided, and its
    last wave then ran on a few SMs. Launched as this kernel's programs finish, its programs
    spread over every SM. AHEAD > 0 (`_trigger_ahead`): the late trigger fires that many chunks
    before the loop's end, so the next kernel's launch is hidden under the last chunks.
    NOTE: k_per_split is a multiple of BLOCK_K, so no chunk crosses into the next split."""
    if PDL and not LATE:
        gdc_launch_dependents()
    pid_k = tl.program_id(1)
    off_n = tl.program_id(0) * BLOCK_N
    offs_n = off_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_N, M_PAD], tl.float32)
    acc_up = tl.zeros([BLOCK_N, M_PAD], tl.float32)
    # the chunk at which a late trigger fires when AHEAD > 0 (the first, for short splits)
    k_trigger = k_lo + tl.maximum(tl.cdiv(k_hi - k_lo, BLOCK_K) - AHEAD, 0) * BLOCK_K
    if PDL:
        gdc_wait()
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if PDL and LATE and AHEAD > 0:  # noqa: SIM102 (a compile-time if, then a runtime one)
            if k0 == k_trigger:
                gdc_launch_dependents()
        x = x_desc.load([0, k0])  # [M_PAD, BLOCK_K]
        w = w_desc.load([off_n, k0])
        acc = tl.dot(w, x.T, acc, input_precision=PRECISION)
        if GLU:
            w_up = w_desc.load([off_n + N, k0])
            acc_up = tl.dot(w_up, x.T, acc_up, input_precision=PRECISION)
    if PDL and LATE and AHEAD == 0:
        gdc_launch_dependents()
    _store_transposed(acc, acc_up, offs_n, offs_m, pid_k, b_ptr, y_ptr, M, N, stride_ym,
                      stride_ys, HAS_BIAS, PARTIAL, GLU, PAIRED)


@triton.jit
def _split_reduce_kernel(p_ptr, b_ptr, y_ptr, N, splits, stride_ps, stride_pm, stride_ym,
                         HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (j, m): y[m, j*BLOCK : (j+1)*BLOCK] = the fp32 partials summed over splits
    0, 1, 2, ... in that order (so the result is deterministic), plus the bias, in y's dtype."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
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
#: shared memory the TMA kernel's stages may take (an H100/H200 SM has 227 KB for a program)
_TMA_SMEM = 200 * 1024
#: stages of the fused gate_up on TMA at 3..16 rows: at 108 KB two programs share an SM, so
#: all of a gate_up's tiles run in one wave (with `_late_trigger`: a next kernel launched
#: early would take that room)
_GLU_STAGES_16_ROWS = 3


def _pick_config(m: int, n: int, k: int, glu: bool = False) -> GemvConfig:
    """One config per shape family (tuned on Qwen3-4B's shapes, in CUDA graphs, on an H200):

    - M = 1: one warp per output row, 4 runs of 8 per lane (BLOCK_K 1024): thousands of small
      programs keep every SM's memory pipe full, and the final sum is a warp shuffle; two
      warps a row and BLOCK_K 2048 below 32768 rows, except the fused gate_up (qkv, o_proj,
      down: not lm_head).
    - M = 2: two rows per program; for few rows (N < 4096, o_proj / down) 2-4 warps share a row's
      K range, else one warp.
    - M = 3..32: the tensor-core kernel (`_mma_config`); glu: the fused gate_up.
    - split K only when N gives fewer than 2 programs per SM (N < 264 at M = 1): each split
      at least 2 BLOCK_K chunks, up to ~4 programs per SM.
    """
    m_pad = triton.next_power_of_2(max(m, 1))
    if m_pad > 2:
        return _mma_config(n, k, glu)
    if m_pad == 1:
        # below 32768 rows (qkv, o_proj, down) there are fewer programs: two warps a row keep
        # more loads in flight
        cfg = (GemvConfig(block_n=1, block_k=2048, num_warps=2) if not glu and n < 32768
               else GemvConfig(block_n=1, block_k=1024, num_warps=1))
    elif n >= 4096:
        cfg = GemvConfig(block_n=2, block_k=512, num_warps=1)
    else:
        cfg = GemvConfig(block_n=2, block_k=1024, num_warps=2) if k < 8192 else \
            GemvConfig(block_n=2, block_k=2048, num_warps=4)
    return _split_to_fill(cfg, n, k)


def fill_splits(programs: int, chunks: int, min_chunks: int) -> int:
    """Splits of K for a grid of `programs` (each `chunks` K tiles long): none once they fill
    the GPU (2 an SM), else up to ~4 programs an SM, each split at least `min_chunks` tiles."""
    if programs >= 2 * NUM_SMS:
        return 1
    return max(1, min(chunks // min_chunks, triton.cdiv(4 * NUM_SMS, programs)))


def _split_to_fill(cfg: GemvConfig, n: int, k: int) -> GemvConfig:
    """cfg with K split where its programs leave SMs idle (splits of >= 2 chunks)."""
    split = fill_splits(triton.cdiv(n, cfg.rows), triton.cdiv(k, cfg.block_k), 2)
    return replace(cfg, split_k=split)


def _mma_config(n: int, k: int, glu: bool) -> GemvConfig:
    """The tensor-core kernel's tile for 3..32 rows (the same at every M).

    On Hopper `_gemv_tma_kernel` (`_tma_config`): 64 rows a program on one warpgroup, BLOCK_K
    128, 4 TMA stages (6 for the fused gate_up, as many as fit and 3 at up to 16 rows:
    `_tma_stages`), K split while the grid has fewer programs than SMs.
    Elsewhere (and for rows TMA cannot read) `_gemv_mma_kernel` (`_cp_async_config`): glu and
    a wide N (>= 32768, lm_head) 32 rows a program, 2 warps, BLOCK_K 256; otherwise 64 rows on
    one warpgroup, BLOCK_K 128, 3 cp.async stages, K split while the grid stays within 2
    programs per SM. Both the best of tile sweeps at 8 and 16 rows.
    NOTE: a function of (N, K) only, never of M: a row's sum does not depend on the batch."""
    return _tma_config(n, k, glu) if tma_available() else _cp_async_config(n, k, glu)


def _tma_config(n: int, k: int, glu: bool) -> GemvConfig:
    """`_mma_config` on Hopper: the TMA kernel's tile and split (see there). K is split in
    powers of two (each split >= 8 chunks) only until the grid covers the SMs: a further split
    saves the GEMV less than it costs the consumer that sums the slots (`SplitSums`)."""
    tiles = triton.cdiv(n // 2 if glu else n, 64)
    split = 1
    while not glu and tiles * split < NUM_SMS and triton.cdiv(k, 128) >= 16 * split:
        split *= 2
    return GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=6 if glu else 4,
                      split_k=split, mma=True, tma=True)


def _cp_async_config(n: int, k: int, glu: bool) -> GemvConfig:
    """`_mma_config` elsewhere: the cp.async kernel's tile and split (see there)."""
    if glu or n >= 32768:
        return GemvConfig(block_n=32, block_k=256, num_warps=2, num_stages=1, mma=True)
    programs = triton.cdiv(n, 64)
    split = 1
    while 2 * split * programs <= 2 * NUM_SMS and triton.cdiv(k, 128) >= 4 * split:
        split *= 2
    return GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=3, split_k=split,
                      mma=True)


@functools.cache
def tma_available() -> bool:
    """Whether `_gemv_tma_kernel` can run: a Hopper-class GPU (`hopper_gpu`: the copy engine's
    tensor copies, wgmma) and a Triton with host tensor descriptors. Decided once per process."""
    if not hopper_gpu():
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


def _check(x: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor | None,
           scale: Scale | None = None, w4: W4 | None = None) -> None:
    assert x.dim() == 2 and weight.dim() == 2, "x: [M, K], weight: [N, K]"
    k = weight.shape[1] * (8 if w4 is not None else 1)
    assert x.shape[1] == k, f"K mismatch: x {tuple(x.shape)}, W {tuple(weight.shape)}"
    assert x.stride(1) == 1 and weight.stride(1) == 1, "x and weight: last dim contiguous"
    if w4 is not None:
        scales, group = w4
        assert weight.dtype == torch.int32 and scales.is_contiguous()
        assert scales.shape == (weight.shape[0], 2, k // group) and group % W4_RUN_COLS == 0
    elif scale is None:
        assert x.dtype == weight.dtype, "x and weight must share a dtype"
    else:
        ws, (bn, bk) = scale
        assert weight.dtype == torch.float8_e4m3fn and ws.stride(1) == 1
        assert ws.shape == (triton.cdiv(weight.shape[0], bn), triton.cdiv(x.shape[1], bk))
        assert bk % FP8_RUN == 0, "a run of FP8 weights lies inside one scale block"
    assert x.shape[0] <= MAX_M, f"gemv is for M <= {MAX_M} rows (use F.linear)"
    if bias is not None:
        assert bias.shape == (weight.shape[0],) and bias.stride(0) == 1, "bias: [N]"
    if out is not None:
        assert out.shape == (x.shape[0], weight.shape[0]) and out.dtype == x.dtype, "out: [M, N]"
        assert out.stride(1) == 1, "out: last dim contiguous"


def _launch(x: Tensor, weight: Tensor, bias: Tensor | None, out: Tensor | None,
            cfg: GemvConfig, glu: bool = False, sums: bool = False,
            scale: Scale | None = None, w4: W4 | None = None) -> Tensor | SplitSums:
    """Run `cfg` (gemv picks it; tests and tuning pass their own). glu: weight is [gate; up]
    and the result silu(x gate^T) * (x up^T), [M, N / 2] (no bias, no split K). sums: where
    the tensor-core kernel splits K (and there is no bias), the result is left as `SplitSums`
    (no reduce kernel); otherwise y. scale: weight is FP8 with these block scales (W8A16,
    no TMA: each tile is dequantised in registers). w4: weight is 4-bit words with these
    scales and group (`_gemv_w4_kernel`, FMA configs only)."""
    _check(x, weight, bias, None, scale, w4)
    m, k = x.shape
    n = weight.shape[0] // 2 if glu else weight.shape[0]
    if glu:
        assert weight.shape[0] % 2 == 0 and bias is None and cfg.split_k == 1, "glu: [gate; up]"
    if out is not None:
        assert out.shape == (m, n) and out.dtype == x.dtype and out.stride(1) == 1, "out: [M, N]"
    if m == 0 or n == 0 or k == 0:
        y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
        if glu or bias is None:
            return y.zero_()  # (glu: silu(0) * 0)
        return y.copy_(bias.expand(m, n))
    # NOTE: every split's K range is a whole number of BLOCK_K chunks (the kernel relies on it)
    chunks = triton.cdiv(k, cfg.block_k)
    k_per_split = triton.cdiv(chunks, max(1, min(cfg.split_k, chunks))) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)  # no empty splits
    has_bias = bias is not None
    paired = sums and cfg.mma and splits > 1 and not has_bias
    # split K: the programs write fp32 partials [splits, M, N], summed by _split_reduce_kernel,
    # or (paired) add pairs of them into the zeroed slots [ceil(splits / 2), M, N] of a
    # SplitSums (an odd count's last split alone in its slot), and then no y is made at all
    if paired:
        dst = y = slot_buffer(x.device, triton.cdiv(splits, 2), m, n)
    else:
        y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
        dst = y if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32,
                                                device=x.device)
    b = bias if bias is not None else y  # a dummy pointer when there is no bias
    pdl = pdl_enabled()
    meta = {"HAS_BIAS": has_bias, "PARTIAL": splits > 1,
            "M_PAD": triton.next_power_of_2(m), "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
            "GLU": glu, "PDL": pdl, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
            **pdl_launch(pdl)}
    grid = (triton.cdiv(n, cfg.rows), splits)
    dst_strides = (y.stride(0), 0) if splits == 1 else (dst.stride(1), dst.stride(0))
    if cfg.mma:  # tl.dot needs 16 rows; fp32 inputs (tests) must not drop to tf32
        meta.update(M_PAD=max(16, meta["M_PAD"]), PAIRED=paired,
                    PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    ws = weight  # a dummy pointer without scales
    if scale is not None:
        ws, (bn, bk) = scale
        assert not cfg.mma or bk % cfg.block_k == 0, "a tile lies inside one scale block"
        meta.update(SCALED=True, SCALE_N=bn, SCALE_K=bk)
        if not cfg.mma:
            meta.update(RUN=FP8_RUN)
    if w4 is not None:
        assert not cfg.mma and cfg.block_k % W4_RUN_COLS == 0
        ws, group = w4
        meta.update(GROUP=group, STACK=cfg.stack, PREFETCH=cfg.num_stages > 1, num_stages=1)
        assert not (cfg.stack and glu), "glu already pairs each gate row with its up row"
    if cfg.mma and cfg.tma and scale is None and _tma_ok(x, weight):
        _launch_tma(x, weight, b, dst, dst_strides, cfg, meta, grid, k_per_split)
    else:
        kernel = (_gemv_w4_kernel if w4 is not None else _gemv_mma_kernel if cfg.mma
                  else _gemv_kernel)
        kernel[grid](x, weight, ws, b, dst, m, n, k, k_per_split, x.stride(0), weight.stride(0),
                     ws.stride(0), *dst_strides, EVEN_K=k % k_per_split == 0, **meta)
    if paired:
        return SplitSums(dst, x.dtype)
    if splits > 1:
        reduce_splits(dst, bias, y)
    return y


def reduce_splits(partials: Tensor, bias: Tensor | None, y: Tensor) -> None:
    """y = the fp32 partial sums [splits, M, N] added in split order (deterministic) + bias,
    in y's dtype: one `_split_reduce_kernel` launch."""
    splits, m, n = partials.shape
    pdl = pdl_enabled()
    _split_reduce_kernel[(triton.cdiv(n, _REDUCE_BLOCK), m)](
        partials, bias if bias is not None else y, y, n, splits, partials.stride(0),
        partials.stride(1), y.stride(0), HAS_BIAS=bias is not None, BLOCK=_REDUCE_BLOCK,
        PDL=pdl, num_warps=4, **pdl_launch(pdl))


def _tma_ok(*tensors: Tensor) -> bool:
    """Whether TMA can read these: 16-byte aligned starts and row strides (else the
    `_gemv_mma_kernel` with cfg's tile takes the call)."""
    return all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
               for t in tensors)


def _launch_tma(x: Tensor, weight: Tensor, b: Tensor, dst: Tensor, dst_strides: tuple[int, int],
                cfg: GemvConfig, meta: dict[str, object], grid: tuple[int, int],
                k_per_split: int) -> None:
    """`_gemv_tma_kernel` into dst (y, or the partials): descriptors for x (its rows past M
    read as zeros) and W."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x.shape
    m_pad = int(meta["M_PAD"])  # type: ignore[call-overload]
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [m_pad, cfg.block_k])
    w_desc = TensorDescriptor(weight, list(weight.shape), [weight.stride(0), 1],
                              [cfg.block_n, cfg.block_k])
    glu = bool(meta["GLU"])
    late = _late_trigger(glu, weight.shape[0], k)
    meta = meta | {"num_stages": _tma_stages(cfg, glu, m_pad, x.element_size()), "LATE": late,
                   "AHEAD": _trigger_ahead(late, glu, m_pad)}
    n = dst.shape[-1]
    _gemv_tma_kernel[grid](x_desc, w_desc, b, dst, m, n, k, k_per_split, *dst_strides, **meta)


def _tma_stages(cfg: GemvConfig, glu: bool, m_pad: int, itemsize: int) -> int:
    """The TMA kernel's stages: cfg's, fewer where they would not fit in shared memory (the
    fused gate_up brings in two W tiles a stage), and `_GLU_STAGES_16_ROWS` for the fused
    gate_up at up to 16 rows. NOTE: stages change no sum's order (batch invariance holds)."""
    w_rows = cfg.block_n * (2 if glu else 1)
    stages = max(2, min(cfg.num_stages, _TMA_SMEM // ((w_rows + m_pad) * cfg.block_k * itemsize)))
    return min(stages, _GLU_STAGES_16_ROWS) if glu and m_pad <= 16 else stages


def _late_trigger(glu: bool, n: int, k: int) -> bool:
    """Whether `_gemv_tma_kernel` lets the next kernel launch only after its K loop (LATE): the
    fused gate_up and the layers that narrow (K > N: o_proj, down). The layers that widen
    (qkv, lm_head) let it launch first thing: after qkv come the rope and decode attention,
    which loads its K/V before its PDL wait and gains from starting early."""
    return glu or k > n


#: chunks before the K loop's end at which a late trigger fires, at up to 16 rows
_TRIGGER_AHEAD_16_ROWS = 2


def _trigger_ahead(late: bool, glu: bool, m_pad: int) -> int:
    """AHEAD of a late-trigger TMA GEMV: `_TRIGGER_AHEAD_16_ROWS` for o_proj and down at up to
    16 rows (a norm comes next: its launch is hidden under the last chunks), else 0 (after the
    loop). Not for the fused gate_up: down comes next, a TMA GEMV whose programs must land
    once gate_up's have left. Not at 32 rows, where the early launch cost more than it hid."""
    return _TRIGGER_AHEAD_16_ROWS if late and not glu and m_pad <= 16 else 0


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
         out: Tensor | None = None) -> Tensor:
    """y = x @ weight^T (+ bias): x [M, K] (M <= MAX_M), weight [N, K], bias [N] or None, all in
    one dtype (last dims contiguous); fp32 accumulation; y [M, N] in x's dtype, written into
    `out` when given (a view with a row stride is fine) and returned."""
    cfg = _pick_config(x.shape[0], weight.shape[0], x.shape[1])
    y = _launch(x, weight, bias, out, cfg)
    assert isinstance(y, Tensor)
    return y


def gemv_split_sums(x: Tensor, weight: Tensor) -> Tensor | SplitSums:
    """gemv's y = x @ weight^T (no bias), left as `SplitSums` where the config splits K
    (3..32 rows on tensor cores: one launch fewer, no reduce kernel);
    y otherwise. The caller hands it to a consumer that takes SplitSums (add_rms_norm,
    qk_norm_rope_store_kv), which sums the slots and leaves them zero."""
    cfg = _pick_config(x.shape[0], weight.shape[0], x.shape[1])
    return _launch(x, weight, None, None, cfg, sums=True)


def fp8_gemv_config(m: int, n: int, k: int, scale_k: int) -> GemvConfig:
    """The tile for an FP8 weight (`_launch` with a scale) at m <= MMA_MAX_M rows: the FMA
    kernel's tiles at 1..2 rows (its 16-byte runs hold 16 FP8 weights), the cp.async
    tensor-core kernel's at 3..MMA_MAX_M with BLOCK_K inside one scale block. A function of
    (N, K) only at 3.. rows, as `_mma_config`."""
    if m == 1:
        # NOTE: short K (qkv, gate_up): 4 rows a program, a warp a row, a warp's 32 runs a
        # chunk, so the warps share x's loads (staged through shared memory); long K (o_proj,
        # down): one row, 2 warps. On an H100 (`bench_kernels.py fp8`), against 4 rows in
        # each thread of one warp: Qwen3-4B's qkv 6.6 us against 8.1, gate_up (unfused) 19.8
        # against 22.4, Qwen3-30B-A3B's qkv 5.2 against 5.4
        if k >= 4096:
            return GemvConfig(block_n=1, block_k=2048, num_warps=2)
        return GemvConfig(block_n=4, block_k=32 * FP8_RUN, num_warps=4)
    if m == 2 and k >= 4096:
        # NOTE: 4 warps a row pair: o_proj 7.2 us against 7.9 with bf16's tile (H200)
        return GemvConfig(block_n=m, block_k=2048, num_warps=4)
    if m <= USE_GEMV_MAX_M:
        return _pick_config(m, n, k)
    assert m <= MMA_MAX_M
    cfg = _cp_async_config(n, k, False)
    return replace(cfg, block_k=min(cfg.block_k, scale_k))


def gemv_fp8(x: Tensor, weight: Tensor, scale: Scale, bias: Tensor | None = None,
             cfg: GemvConfig | None = None, sums: bool = False) -> Tensor | SplitSums:
    """y = x @ dequant(weight)^T (+ bias) for an FP8 weight with block scales scale = (ws,
    (bn, bk)) (kernels/fp8.py's format) and x of 1..MMA_MAX_M rows: each weight dequantised
    to x's dtype in registers, as fp8_linear_ref rounds it; `sums` as gemv_split_sums."""
    if cfg is None:
        cfg = fp8_gemv_config(x.shape[0], weight.shape[0], x.shape[1], scale[1][1])
    return _launch(x, weight, bias, None, cfg, sums=sums, scale=scale)


def gemv_fp8_silu_mul(x: Tensor, gate_up: Tensor, scale: Scale,
                      cfg: GemvConfig | None = None) -> Tensor:
    """`gemv_silu_mul` for an FP8 gate_up = [gate; up] with block scales (gemv_fp8's format)
    and x of 1..USE_GEMV_MAX_M rows, on the FMA GEMV: a program sums its gate rows and their
    up rows on one x (the scale grid is the stacked weight's: up's row n + N has its own) and
    stores silu(gate) * up, rounded as `silu_and_mul(gemv_fp8(x, gate_up))` rounds them.
    The tile: `fp8_glu_config`."""
    assert x.shape[0] <= USE_GEMV_MAX_M, "the FMA GEMV's rows"
    if cfg is None:
        cfg = fp8_glu_config(x.shape[0], gate_up.shape[0], x.shape[1], scale[1][1])
    y = _launch(x, gate_up, None, None, replace(cfg, split_k=1), glu=True, scale=scale)
    assert isinstance(y, Tensor)
    return y


def fp8_glu_config(m: int, n: int, k: int, scale_k: int) -> GemvConfig:
    """The fused FP8 gate_up's tile (n: gate and up rows): at one row and short K, 2 gate rows
    (each with its up row) a program on 2 warps, a warp a row; otherwise the unfused weight's
    (`fp8_gemv_config`). Each keeps the unfused tile's BLOCK_K and a warp a row, so a row's
    sum runs in the same order as unfused.
    NOTE: on an H100 (`bench_kernels.py fp8 --rows 1 2 --shapes 4b_gate_up`), Qwen3-4B's
    gate_up at one row: 17.7 us against 18.7 in the unfused tile (4 rows on 4 warps), 21.4 for
    that GEMV then `silu_and_mul`; at two rows the unfused tile was the best (21.8 us)."""
    if m == 1 and k < 4096:
        return GemvConfig(block_n=2, block_k=32 * FP8_RUN, num_warps=2)
    return fp8_gemv_config(m, n, k, scale_k)


def w4_gemv_config(m: int, n: int, k: int, glu: bool = False) -> GemvConfig:
    """The 4-bit GEMV's tile at m <= MAX_W4_ROWS rows of x against n rows of words (glu:
    [gate; up]). Each thread takes a run of two rows of W, which share its x's loads and
    conversions: a row and the row block_n on (`stack`), or glu's gate and up rows. Long K
    (o_proj, down): 4 warps, 2048 columns a chunk; at one row and K >= 8192 (down), 8 warps
    (two on a row's chunk: N = 2560 rows leave too few warps to hide the loads' latency) and
    the next chunk's words loaded ahead (num_stages 2: `PREFETCH`); short K: 8 warps, 1024
    columns, loaded ahead, or where W has many rows (gate_up) 2 warps on 512 columns (two rows
    a warp). K split as `_pick_config` splits it.
    NOTE: the best of `bench_kernels.py w4` at Qwen3-4B's shapes on an H100 (its tiles swept),
    at one row: qkv 5.6 us, o_proj 4.6, down 8.4, gate_up (unfused) 15.0; at two rows: 8.4,
    5.5, 12.1, 18.3 (a row a thread, 4 warps: 7.0, 6.1, 11.5, 19.4 at one row)."""
    if k >= 8192 and m == 1:
        cfg = GemvConfig(block_n=4, block_k=2048, num_warps=8, num_stages=2)
    elif k >= 4096:
        cfg = GemvConfig(block_n=4, block_k=2048, num_warps=4)
    elif n >= 16384:
        cfg = GemvConfig(block_n=4, block_k=512, num_warps=2, num_stages=2)
    else:
        cfg = GemvConfig(block_n=8, block_k=1024, num_warps=8, num_stages=2)
    return _split_to_fill(replace(cfg, stack=not glu), n // 2 if glu else n, k)


#: rows of x the 4-bit GEMV can take (`gemv_w4`) and takes (`use_w4_gemv`)
MAX_W4_ROWS = 2


def use_w4_gemv(m: int) -> bool:
    """Whether m rows against a 4-bit weight take the GEMV over kernels/w4a16.py's tensor-core
    GEMM: up to MAX_W4_ROWS. From 4 rows the GEMM (K split to fill the GPU) is faster at
    every Qwen3-4B shape, long K too. On an H100 (`bench_kernels.py w4`, commit 12ba687) at 4
    rows o_proj 17 us against 21, down 28 against 51; at 8 qkv 22 against 50, o_proj 19
    against 38, down 31 against 87."""
    return m <= MAX_W4_ROWS


def gemv_w4(x: Tensor, words: Tensor, w4: W4, bias: Tensor | None = None, *,
            glu: bool = False, cfg: GemvConfig | None = None) -> Tensor:
    """y = x @ W^T (+ bias) for a 4-bit weight (kernels/w4a16.py's words and w4 = (scales
    [N, 2, K / group], group)) and x of 1..MAX_W4_ROWS rows; glu: `gemv_silu_mul`'s product
    for words = [gate; up]."""
    assert x.shape[0] <= MAX_W4_ROWS
    if x.dtype == torch.bfloat16 and (x.data_ptr() % 4 or x.stride(0) % 2):
        x = torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x)  # NOTE: the
        # kernel reads bf16 x as int32 pairs (`_w4_x_ptrs`): a row must start 4-byte aligned
    if cfg is None:
        cfg = w4_gemv_config(x.shape[0], words.shape[0], x.shape[1], glu)
    if glu:
        cfg = replace(cfg, split_k=1, stack=False)
    y = _launch(x, words, bias, None, cfg, glu=glu, w4=w4)
    assert isinstance(y, Tensor)
    return y


def gemv_ref(x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
             out: Tensor | None = None) -> Tensor:
    """The reference: F.linear in fp32, cast to x's dtype (into `out` when given)."""
    b = bias.float() if bias is not None else None
    y = F.linear(x.float(), weight.float(), b).to(x.dtype)
    return y if out is None else out.copy_(y)


def gemv_silu_mul(x: Tensor, gate_up: Tensor, *, out: Tensor | None = None) -> Tensor:
    """silu(x @ gate^T) * (x @ up^T) for gate_up = [gate; up] ([2N, K], no bias): an MLP's
    gate_up projection and activation in one kernel, [M, N]. Gate and up are each rounded to
    x's dtype before the activation, as `silu_and_mul(gemv(x, gate_up))` rounds them."""
    cfg = replace(_pick_config(x.shape[0], gate_up.shape[0], x.shape[1], glu=True), split_k=1)
    y = _launch(x, gate_up, None, out, cfg, glu=True)
    assert isinstance(y, Tensor)
    return y


def gemv_silu_mul_ref(x: Tensor, gate_up: Tensor, *, out: Tensor | None = None) -> Tensor:
    y = silu_and_mul_ref(gemv_ref(x, gate_up))
    return y if out is None else out.copy_(y)


def row_classes() -> tuple[int, ...]:
    """One row count per kernel variant the GEMVs compile by M: the FMA kernel at 1 and 2
    rows, the tensor-core kernels at 3..16 (M_PAD 16) and, with TMA, 17..MAX_M (M_PAD 32):
    what a warm-up runs to build them all."""
    return (1, 2, 3, MMA_MAX_M + 1) if tma_available() else (1, 2, 3)


def use_gemv(m: int, n: int, k: int, glu: bool = False) -> bool:
    """Whether a linear layer of m rows and an [n, k] weight (glu: a gate_up with its
    activation) should use gemv over F.linear (cuBLAS).

    - 1..2 rows: always; the FMA kernel is faster than cuBLAS on every layer.
    - 3..32 rows on Hopper: always; the TMA kernel is level with cuBLAS or faster, and unlike
      cuBLAS's kernels it overlaps its neighbours under PDL. Past 32 rows cuBLAS's GEMM wins.
    - 3..16 rows elsewhere: only the fused gate_up and wide weights (N >= 32768, lm_head); the
      cp.async kernel loses where it must split K (o_proj, down).
    """
    if 1 <= m <= USE_GEMV_MAX_M:
        return True
    if MMA_MAX_M < m <= MAX_M:
        return tma_available()
    return USE_GEMV_MAX_M < m <= MMA_MAX_M and (glu or n >= 32768 or tma_available())
