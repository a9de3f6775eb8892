"""Mixture-of-experts MLP (transformers' `qwen3_moe` router + experts): the Triton kernels (their
torch references beside them in kernels/moe_ref.py).

`fused_moe(x, router_logits, w13, w2, top_k, renormalize, w13_scale, w2_scale, block)`:
- route: softmax of the logits in fp32 over the experts, the top_k by torch.topk, divided by
  their sum when `renormalize`, cast to the logits' dtype;
- each (token, chosen expert) pair: gate | up = x @ w13[e]^T (w13 is [gate; up], [E, 2I, H]),
  silu(gate) * up in x's dtype (HF's two roundings), @ w2[e]^T ([E, H, I]), times the
  pair's weight in x's dtype;
- a token's output: the sum over its top_k pairs in fp32 (in top-k order), in x's dtype, as
  transformers' default `grouped_mm` experts do.
FP8 weights (float8_e4m3fn, with per-(bn, bk)-block scales [E, ceil(N/bn), ceil(K/bk)]) are
dequantised to x's dtype first (kernels/fp8.py's rule).

The Triton version (`fused_moe` = routing + `_moe_experts`), as vLLM's and SGLang's:
- `moe_route`: one kernel, softmax + top-k (equal probabilities: the lowest expert, the set
  torch.topk picks on CUDA) + renormalise; ids int32.
- `moe_align`: one program sorts the pairs p = token * top_k + j into per-expert groups, each
  padded to block_m, and names each block's expert (-1 past the last group).
  `moe_route_align`: both in one program, for 2..ROUTE_ALIGN_MAX_TOKENS tokens (small decode
  batches, where a launch costs more than the routing's work).
- `_moe_mma_kernel`: the grouped GEMM over those blocks on tensor cores (bf16; FP8 weights
  dequantised in registers, W8A16; or FP8 x FP8 with activations quantised per token and bk
  columns, W8A8), silu(gate) * up in the gate_up projection's epilogue and the routing
  weight in down's; `_moe_gemv_kernel`: the same contract for a few tokens with FMAs, one
  block per expert, so each chosen expert's weights are read once for all its rows; W
  streamed as kernels/gemv.py's GEMV streams it (16-byte runs a thread, FP8 at its exact
  values, each run's sum times its block's scale).
- the per-pair outputs [T * top_k, H] summed over top_k by torch (fp32 accumulation); up to
  MAX_ROWS tokens `fused_moe_unreduced` leaves the sum to the next norm (split-sum slots).
  So an FP8 decode batch of 3..16 tokens runs route + align, gate_up and down, each
  projection after its activations' FP8 pass: five launches.
- one token (decode at batch 1): no align (its pairs are blocks of their own, the kernels read
  each pair's expert from the ids); down writes each pair's weighted row to its slot, or
  (`fused_moe`) sums the top-k in its epilogue (each pair's output rounded and weighted as
  above, summed in fp32 in top-k order, rounded once): route, gate_up, down: three launches,
  chained by PDL (down loads its first chunk of W while gate_up runs).
`pick_moe_config` chooses the kind and tiles from the token count (a small table; never tuned
while serving). Buffers and grids come from shapes: no host reads, safe to capture.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from arle_kernels.fp8 import (
    dequant_tile,
    quantize_fp8_groups,
)
from arle_kernels.fused import silu_mul
from arle_kernels.gemv import RUN_BYTES, load_chunk, load_run_sums, load_weight_runs, run_sums
from arle_kernels.jit import gdc_launch_dependents, gdc_wait, jit_varying, pdl_enabled, pdl_launch
from arle_kernels.moe_ref import moe_max_blocks
from arle_kernels.split_sums import MAX_ROWS, SplitSums, slot_buffer

#: tokens up to which the FMA GEMV runs; beyond, tensor cores (H200, Qwen3-30B-A3B's experts,
#: `bench_kernels.py moe`: bf16 at 2 tokens 59 us against 69, at 4 137 against 101; FP8 at 2
#: tokens 51 against 54)
MOE_GEMV_MAX_TOKENS = 2
#: tokens up to which `moe_route` runs one token a program on one warp
ROUTE_ONE_WARP_MAX_TOKENS = 4
#: tokens up to which the routing and the align are one launch (`moe_route_align`). Its one
#: program routes 16 tokens at a time, serially: on an H100 (`bench_kernels.py moe --chosen`,
#: the layer against its experts alone, so the routing's share) it saved 2.5 us at 8 and 2.2
#: at 16 tokens against moe_route's own launch, and cost 0.7 more at 32, 6 more at 64
ROUTE_ALIGN_MAX_TOKENS = 16


# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------

@triton.jit
def _route_rows(logits_ptr, weights_ptr, ids_ptr, offs_t, T, E, stride_lt,
                TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORM: tl.constexpr,
                E_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """Tokens offs_t [BLOCK_T] (< T stored): softmax over the E logits in fp32, the TOP_K largest
    probabilities one at a time (on equal ones the lowest expert first, as torch.topk on CUDA),
    divided by their sum when RENORM, stored in the logits' dtype."""
    experts = tl.arange(0, E_PAD)
    slots = tl.arange(0, K_PAD)
    rows = tl.minimum(offs_t, T - 1).to(tl.int64)
    logits = tl.load(logits_ptr + rows[:, None] * stride_lt + experts[None, :],
                     mask=experts[None, :] < E, other=-float("inf")).to(tl.float32)
    num = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = tl.div_rn(num, tl.sum(num, axis=1)[:, None])
    picked = tl.zeros([BLOCK_T, K_PAD], tl.float32)
    picked_ids = tl.zeros([BLOCK_T, K_PAD], tl.int32)
    total = tl.zeros([BLOCK_T], tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)
        pick = tl.min(tl.where(probs == best[:, None], experts[None, :], E_PAD), axis=1)
        # NOTE: a picked expert drops to -1: below any probability, above the padding's -inf
        probs = tl.where(experts[None, :] == pick[:, None], -1.0, probs)
        picked = tl.where(slots[None, :] == j, best[:, None], picked)
        picked_ids = tl.where(slots[None, :] == j, pick[:, None], picked_ids)
        total += best
    if RENORM:
        picked = tl.div_rn(picked, total[:, None])
    out = offs_t[:, None] * TOP_K + slots[None, :]
    mask = (offs_t < T)[:, None] & (slots < TOP_K)[None, :]
    tl.store(weights_ptr + out, picked.to(weights_ptr.dtype.element_ty), mask=mask)
    tl.store(ids_ptr + out, picked_ids, mask=mask)


@triton.jit
def _pdl_start(PDL: tl.constexpr):
    """A kernel that reads only what the kernels before it wrote: let the next one launch, and
    wait for the previous one."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@jit_varying("T")
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, T, E, stride_lt,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORM: tl.constexpr,
                  E_PAD: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    """Program i: tokens [i*BLOCK_T, (i+1)*BLOCK_T) (`_route_rows`)."""
    _pdl_start(PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    _route_rows(logits_ptr, weights_ptr, ids_ptr, offs_t, T, E, stride_lt, TOP_K, K_PAD,
                RENORM, E_PAD, BLOCK_T)


def _pdl() -> dict[str, Any]:
    """A launch's PDL constexpr and keyword (`pdl_enabled`)."""
    pdl = pdl_enabled()
    return {"PDL": pdl, **pdl_launch(pdl)}


def _route_buffers(router_logits: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """The routing's outputs (empty): weights in the logits' dtype, ids int32, [T, top_k]."""
    t, e = router_logits.shape
    assert router_logits.stride(1) == 1 and 0 < top_k <= e
    weights = torch.empty(t, top_k, dtype=router_logits.dtype, device=router_logits.device)
    return weights, torch.empty(t, top_k, dtype=torch.int32, device=router_logits.device)


def moe_route(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """moe_route_ref in one kernel; expert ids as int32."""
    t, e = router_logits.shape
    weights, ids = _route_buffers(router_logits, top_k)
    if t > 0:
        e_pad = triton.next_power_of_2(e)
        block_t, warps = _route_tile(t, e_pad)
        _route_kernel[(triton.cdiv(t, block_t),)](
            router_logits, weights, ids, t, e, router_logits.stride(0), TOP_K=top_k,
            K_PAD=triton.next_power_of_2(top_k), RENORM=renormalize, E_PAD=e_pad,
            BLOCK_T=block_t, num_warps=warps, **_pdl())
    return weights, ids


def _route_tile(num_tokens: int, e_pad: int) -> tuple[int, int]:
    """(tokens a program, warps) of `_route_kernel`. Up to ROUTE_ONE_WARP_MAX_TOKENS (decode):
    one token on one warp, so the 2 * TOP_K cross-expert max / min are warp shuffles (on 4
    warps each is a shared-memory round trip). Beyond: up to 16 tokens (2048 logits) on 4
    warps. NOTE: `moe_token_classes` splits its classes here too (a warm-up builds both)."""
    if num_tokens <= ROUTE_ONE_WARP_MAX_TOKENS:
        return 1, 1
    return _route_block_t(e_pad), 4


def _route_block_t(e_pad: int) -> int:
    """Tokens a routing step takes on 4 or more warps: up to 16, 2048 logits."""
    return max(1, min(16, 2048 // e_pad))


@triton.jit
def _align(ids_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_experts, max_blocks,
           E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
           BLOCKS_CHUNK: tl.constexpr):
    """One program: moe_align_ref's outputs. Counts per expert, groups padded to BLOCK_M and
    laid out in expert order (an exclusive cumsum), then each pair's slot: its group's start
    plus how many pairs of that expert precede it (a running count per expert and a cumsum of
    one-hot rows within a chunk). Each slot is written once: by its pair or as padding."""
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    # the padding slots of each group
    j = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + starts[:, None] + counts[:, None] + j[None, :], num_pairs,
             mask=counts[:, None] + j[None, :] < padded[:, None])
    # each block's expert: the number of groups that end at or before its first slot
    for b0 in range(0, max_blocks, BLOCKS_CHUNK):
        b = b0 + tl.arange(0, BLOCKS_CHUNK)
        e_of = tl.sum((ends[None, :] <= b[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(e_of < num_experts, e_of, -1),
                 mask=b < max_blocks)
    # each pair's slot, pairs in order within an expert
    running = starts
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
        onehot = (e[:, None] == experts[None, :]).to(tl.int32)
        before = tl.cumsum(onehot, axis=0) - onehot
        slot = tl.sum(onehot * (before + running[None, :]), axis=1)
        tl.store(sorted_ptr + slot, offs, mask=offs < num_pairs)
        running += tl.sum(onehot, axis=0)


@jit_varying("num_pairs", "max_blocks")
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_experts, max_blocks,
                  E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCKS_CHUNK: tl.constexpr, PDL: tl.constexpr):
    _pdl_start(PDL)
    _align(ids_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_experts, max_blocks, E_PAD,
           BLOCK_M, CHUNK, BLOCKS_CHUNK)


@jit_varying("T", "max_blocks")
def _route_align_kernel(logits_ptr, weights_ptr, ids_ptr, sorted_ptr, block_expert_ptr, T, E,
                        stride_lt, max_blocks, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                        RENORM: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, BLOCKS_CHUNK: tl.constexpr,
                        PDL: tl.constexpr):
    """One program: the routing, BLOCK_T tokens at a time (`_route_rows`), then the align of
    the ids it stored (`_align`).
    NOTE: the barrier between: the align's threads read ids that other threads wrote."""
    _pdl_start(PDL)
    for t0 in range(0, T, BLOCK_T):
        _route_rows(logits_ptr, weights_ptr, ids_ptr, t0 + tl.arange(0, BLOCK_T), T, E,
                    stride_lt, TOP_K, K_PAD, RENORM, E_PAD, BLOCK_T)
    tl.debug_barrier()
    _align(ids_ptr, sorted_ptr, block_expert_ptr, T * TOP_K, E, max_blocks, E_PAD, BLOCK_M,
           CHUNK, BLOCKS_CHUNK)


def _align_buffers(t: int, top_k: int, num_experts: int, block_m: int,
                   device: torch.device) -> tuple[Tensor, Tensor, dict[str, int]]:
    """moe_align's outputs (empty) and `_align`'s launch constants.
    NOTE: one chunk size per expert count (not per token count): one variant per block_m."""
    max_blocks = moe_max_blocks(t, top_k, num_experts, block_m)
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    e_pad = triton.next_power_of_2(num_experts)
    meta = {"E_PAD": e_pad, "BLOCK_M": block_m, "CHUNK": max(16, 16384 // e_pad),
            "BLOCKS_CHUNK": max(16, 4096 // e_pad), "num_warps": 8, **_pdl()}
    return sorted_ids, block_expert, meta


def moe_route_align(router_logits: Tensor, top_k: int, renormalize: bool,
                    block_m: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """moe_route then moe_align in one launch (one program: for a decode batch's few tokens,
    where a launch costs more than the work): weights, ids, sorted_ids, block_expert."""
    t, e = router_logits.shape
    assert t > 0
    weights, ids = _route_buffers(router_logits, top_k)
    sorted_ids, block_expert, meta = _align_buffers(t, top_k, e, block_m, ids.device)
    _route_align_kernel[(1,)](
        router_logits, weights, ids, sorted_ids, block_expert, t, e, router_logits.stride(0),
        block_expert.shape[0], TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
        RENORM=renormalize, BLOCK_T=_route_block_t(meta["E_PAD"]), **meta)
    return weights, ids, sorted_ids, block_expert


def moe_align(ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """moe_align_ref in one kernel (one program: a few microseconds for a decode step's pairs,
    a pass over all pairs per chunk of 128 for a prefill's). ids [T, top_k] int32."""
    t, top_k = ids.shape
    assert ids.dtype == torch.int32 and ids.is_contiguous()
    sorted_ids, block_expert, meta = _align_buffers(t, top_k, num_experts, block_m, ids.device)
    if block_expert.shape[0] > 0:
        _align_kernel[(1,)](ids, sorted_ids, block_expert, t * top_k, num_experts,
                            block_expert.shape[0], **meta)
    return sorted_ids, block_expert


@triton.jit
def _w_step(acc, a, a_scale, w_ptrs, ws_ptrs, k_ok, W8: tl.constexpr, A8: tl.constexpr,
            SWAP: tl.constexpr, PRECISION: tl.constexpr):
    """acc += a [BLOCK_M, BLOCK_K] @ one expert's W^T tile [BLOCK_K, BLOCK_N]: W in a's dtype,
    FP8 dequantised to it in registers (W8), or FP8 times FP8 scaled by both scales (A8).
    SWAP: the transposed product, acc^T [BLOCK_N, BLOCK_M] += W tile [BLOCK_N, BLOCK_K] @ a^T,
    so the weight's rows take the MMA's wide side (64 and more) and the pairs its narrow one;
    each element is scaled and rounded as unswapped.
    NOTE: one return: Triton checks every return's type, also in static ifs."""
    if SWAP:
        w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
        if A8:
            acc += tl.dot(w, tl.trans(a)) * a_scale[None, :] * tl.load(ws_ptrs)[:, None]
        else:
            if W8:
                w = dequant_tile(w, tl.load(ws_ptrs)[:, None], a.dtype)
            acc = tl.dot(w, tl.trans(a), acc, input_precision=PRECISION)
    else:
        w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        if A8:
            acc += tl.dot(a, w) * a_scale[:, None] * tl.load(ws_ptrs)[None, :]
        else:
            if W8:
                w = dequant_tile(w, tl.load(ws_ptrs)[None, :], a.dtype)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _pair_rows(sorted_ptr, expert_ptr, num_pairs, ROW_DIV: tl.constexpr, ROWS: tl.constexpr,
               DIRECT: tl.constexpr):
    """Program (j, b)'s ROWS pairs, their experts and the input row each reads (pair //
    ROW_DIV); padding (row_ok false) reads row 0: no masks.

    Sorted (moe_align): block b's slots, one expert for all of them (`live`, -1 past the last
    group), experts [1]. DIRECT (one token, no align): pairs b*ROWS.., each its own expert
    read from the routing's ids (expert_ptr), experts [ROWS]; `live` is the first one (>= 0).
    """
    b = tl.program_id(1)
    # NOTE: from L2 (".cg"): the down GEMV reads these before its PDL wait (`_moe_gemv_kernel`)
    if DIRECT:
        pairs = b * ROWS + tl.arange(0, ROWS)
        row_ok = pairs < num_pairs
        live = tl.load(expert_ptr + b * ROWS, cache_modifier=".cg")
        experts = tl.load(expert_ptr + pairs, mask=row_ok, other=0,
                          cache_modifier=".cg").to(tl.int64)
    else:
        pairs = tl.load(sorted_ptr + b * ROWS + tl.arange(0, ROWS), cache_modifier=".cg")
        row_ok = pairs < num_pairs
        live = tl.load(expert_ptr + b, cache_modifier=".cg")
        experts = tl.zeros([1], tl.int64) + live
    rows = tl.where(row_ok, pairs // ROW_DIV, 0).to(tl.int64)
    return live, experts, pairs, row_ok, rows


@triton.jit
def _pair_block(sorted_ptr, block_expert_ptr, ws_ptr, N, num_pairs, stride_wse, stride_wsn,
                ROW_DIV: tl.constexpr, GROUP_N: tl.constexpr, ROWS: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """The tensor-core kernel's start, for program (j, b): block b's expert (-1: past the
    last group) and pairs (`_pair_rows`), columns [j*BLOCK_N, (j+1)*BLOCK_N) (clamped to
    N - 1: no masks) and the scale pointers of those columns and of the up half's (GLU)."""
    expert, _, pairs, row_ok, rows = _pair_rows(sorted_ptr, block_expert_ptr, num_pairs,
                                                ROW_DIV, ROWS, False)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.minimum(offs_n, N - 1).to(tl.int64)
    e64 = expert.to(tl.int64)
    ws_ptrs = ws_ptr + e64 * stride_wse + (cols // GROUP_N) * stride_wsn
    up_ws_ptrs = ws_ptr + e64 * stride_wse + ((cols + N) // GROUP_N) * stride_wsn
    return expert, e64, pairs, row_ok, rows, offs_n, cols, ws_ptrs, up_ws_ptrs


@triton.jit
def _weighted(y, tw, dtype: tl.constexpr):
    """Rows y [R, BLOCK_N] (in dtype) times their routing weights tw [R] (in dtype), as
    transformers multiplies them: in fp32, rounded to dtype."""
    return (y.to(tl.float32) * tw.to(tl.float32)[:, None]).to(dtype)


@triton.jit
def _moe_epilogue(acc, acc_up, pairs, row_ok, offs_n, N, c_ptr, topw_ptr, stride_cm, stride_cs,
                  GLU: tl.constexpr, MUL_WEIGHT: tl.constexpr, SLOT_K: tl.constexpr):
    """Both kernels' end: the projection rounded to c's dtype, silu(gate) * up (GLU, HF's
    roundings) or times the pair's routing weight (MUL_WEIGHT), stored at row `pair` of c.
    SLOT_K > 0 (the down projection left as kernels/split_sums.py's `SplitSums`): c is fp32
    slots [SLOT_K, tokens, N] (stride_cs apart), and pair p's weighted row, in the routing
    weights' dtype (the model's), goes to slot p % SLOT_K of its token's row p // SLOT_K. The
    consumer's sum of the slots in order is the top-k sum, with no launch of its own."""
    dtype = c_ptr.dtype.element_ty
    if SLOT_K > 0:
        dtype = topw_ptr.dtype.element_ty
    y = acc.to(dtype)
    if GLU:
        y = silu_mul(y, acc_up.to(dtype))
    if MUL_WEIGHT:
        y = _weighted(y, tl.load(topw_ptr + pairs, mask=row_ok, other=0.0).to(dtype), dtype)
    p64 = pairs.to(tl.int64)
    rows = p64 * stride_cm
    if SLOT_K > 0:
        rows = (p64 % SLOT_K) * stride_cs + (p64 // SLOT_K) * stride_cm
    c_ptrs = c_ptr + rows[:, None] + offs_n[None, :]
    tl.store(c_ptrs, y.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n < N)[None, :])


@triton.jit
def _sum_pairs_epilogue(acc, pairs, row_ok, offs_n, N, c_ptr, topw_ptr, ROWS: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """The one-token down projection's end: each pair's y rounded to c's dtype and times its
    routing weight (`_weighted`), then the sum over the pairs in fp32, in top-k order, rounded
    once into c's row 0: what `pair_out.view(1, k, H).sum(dim=1)` gives (torch sums 16-bit
    tensors in fp32). NOTE: pair j is row j (DIRECT, one program row-block); a padding row
    adds an exact 0."""
    dtype = c_ptr.dtype.element_ty
    tw = tl.load(topw_ptr + pairs, mask=row_ok, other=0.0).to(dtype)
    y = tl.where(row_ok[:, None], _weighted(acc.to(dtype), tw, dtype).to(tl.float32), 0.0)
    total = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(ROWS):
        total += tl.sum(tl.where((pairs == j)[:, None], y, 0.0), axis=0)
    tl.store(c_ptr + offs_n, total.to(dtype), mask=offs_n < N)


@jit_varying("num_pairs")
def _moe_mma_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, c_ptr, topw_ptr, sorted_ptr, block_expert_ptr,
                    N, K, num_pairs, stride_am, stride_asm, stride_we, stride_wn, stride_wse,
                    stride_wsn, stride_cm, stride_cs,
                    ROW_DIV: tl.constexpr, GLU: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                    SLOT_K: tl.constexpr, W8: tl.constexpr, A8: tl.constexpr, GROUP_N: tl.constexpr,
                    GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, SWAP: tl.constexpr, PRECISION: tl.constexpr):
    """The grouped GEMM. Program (j, b): block b of the sorted pairs (BLOCK_M pairs of one
    expert, moe_align) times columns [j*BLOCK_N, (j+1)*BLOCK_N) of that expert's W^T, on
    tensor cores. A row of `a` is pair // ROW_DIV (the token, for the gate_up projection;
    the pair itself for down). GLU: W is [gate; up] (2N rows) and the program sums both
    halves' columns n and n + N, storing silu(gate) * up. Blocks past the last group (expert
    -1) do nothing: the grid is sized from shapes, the work from the routing.
    SWAP ("swap AB", for ~1 pair an expert): each step multiplies W's tile by a^T (`_w_step`),
    the sums are transposed back once, before the epilogue."""
    expert, e64, pairs, row_ok, rows, offs_n, cols, ws_ptrs, up_ws_ptrs = _pair_block(
        sorted_ptr, block_expert_ptr, ws_ptr, N, num_pairs, stride_wse, stride_wsn, ROW_DIV,
        GROUP_N, BLOCK_M, BLOCK_N)
    if expert < 0:
        return
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + kk[None, :]
    w_ptrs = w_ptr + e64 * stride_we
    if SWAP:
        w_ptrs += cols[:, None] * stride_wn + kk[None, :]  # W tile [BLOCK_N, BLOCK_K]
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        w_ptrs += cols[None, :] * stride_wn + kk[:, None]  # W^T tile [BLOCK_K, BLOCK_N]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = acc
    a_scale = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = kk < K - k0
        a = tl.load(a_ptrs + k0, mask=k_ok[None, :], other=0.0)
        if A8:
            a_scale = tl.load(as_ptr + rows * stride_asm + k0 // GROUP_K)
        acc = _w_step(acc, a, a_scale, w_ptrs + k0, ws_ptrs + k0 // GROUP_K, k_ok, W8, A8,
                      SWAP, PRECISION)
        if GLU:
            acc_up = _w_step(acc_up, a, a_scale, w_ptrs + N * stride_wn + k0,
                             up_ws_ptrs + k0 // GROUP_K, k_ok, W8, A8, SWAP, PRECISION)
    if SWAP:
        acc = tl.trans(acc)
        acc_up = tl.trans(acc_up)
    _moe_epilogue(acc, acc_up, pairs, row_ok, offs_n, N, c_ptr, topw_ptr, stride_cm, stride_cs,
                  GLU, MUL_WEIGHT, SLOT_K)


@jit_varying("num_pairs")
def _moe_gemv_kernel(x_ptr, w_ptr, ws_ptr, c_ptr, topw_ptr, sorted_ptr, expert_ptr,
                     N, K, num_pairs, stride_xm, stride_we, stride_wn, stride_wse, stride_wsn,
                     stride_cm, stride_cs,
                     ROW_DIV: tl.constexpr, GLU: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                     SLOT_K: tl.constexpr,
                     DIRECT: tl.constexpr, SUM_PAIRS: tl.constexpr, W8: tl.constexpr,
                     GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, M_PAD: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, RUN: tl.constexpr,
                     EVEN_K: tl.constexpr, PDL: tl.constexpr):
    """The decode MoE GEMV, `_moe_mma_kernel`'s contract for a few tokens, with FMAs.
    Program (j, b): columns [j*BLOCK_N, (j+1)*BLOCK_N) for M_PAD pairs (`_pair_rows`):
    - sorted (moe_align, M_PAD >= tokens): block b, all of one expert's pairs, so its W rows
      are read once for all of them;
    - DIRECT (one token, no align): pairs b*M_PAD.., each with its own expert's W rows; with
      SUM_PAIRS (the down projection: M_PAD >= top_k, one row-block) the pairs' outputs are
      weighted and summed into the token's row (`_sum_pairs_epilogue`).
    The layout streams W as kernels/gemv.py's `_gemv_kernel` does: a K chunk viewed as
    [BLOCK_K // RUN, RUN], RUN contiguous elements a thread (one 16-byte load: 16 FP8 or 8
    16-bit weights), each run's products summed in registers, the sum across lanes once after
    the loop; W evict_first, x evict_last (every program re-reads it).
    PDL: the gate_up projection (GLU) waits for the routing before it reads the pairs, and
    only then lets the down projection launch; so down, launched early, reads its pairs and
    experts (the routing's, finished by then) and its first chunk of W before it waits for
    gate_up's activations. NOTE: gate_up's wait is for the kernel before it, and so for every
    kernel before that (each waits for its own predecessor before it finishes): the routing
    included, wherever it ran."""
    if PDL:
        if GLU:
            gdc_wait()
        gdc_launch_dependents()
    live, experts, pairs, row_ok, rows = _pair_rows(sorted_ptr, expert_ptr, num_pairs,
                                                    ROW_DIV, M_PAD, DIRECT)
    if live < 0:
        return
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # NOTE: padded columns re-read row N - 1: no masks; their sums are never stored
    cols = tl.minimum(offs_n, N - 1).to(tl.int64)[None, :, None, None]
    starts = (tl.arange(0, BLOCK_K // RUN) * RUN)[:, None]
    kk = (starts + tl.arange(0, RUN)[None, :])[None, None, :, :]  # [1, 1, BK / RUN, RUN]
    starts = starts[None, None, :, :]  # [1, 1, BK / RUN, 1]
    e4 = experts[:, None, None, None]
    x_ptrs = x_ptr + rows[:, None, None, None] * stride_xm + kk  # [M_PAD, 1, BK / RUN, RUN]
    w_ptrs = w_ptr + e4 * stride_we + cols * stride_wn + kk  # [1 or M_PAD, BLOCK_N, .., RUN]
    ws_ptrs = ws_ptr + e4 * stride_wse + (cols // GROUP_N) * stride_wsn
    up_ptrs = w_ptrs + N * stride_wn
    up_ws_ptrs = ws_ptr + e4 * stride_wse + ((cols + N) // GROUP_N) * stride_wsn
    # the first chunk of W before the wait (down: before gate_up's activations exist)
    w, s = load_weight_runs(w_ptrs, ws_ptrs, 0, K, kk, starts, EVEN_K, W8, GROUP_K)
    if GLU:
        w_up, s_up = load_weight_runs(up_ptrs, up_ws_ptrs, 0, K, kk, starts, EVEN_K, W8,
                                      GROUP_K)
    if PDL and not GLU:
        gdc_wait()
    x = load_chunk(x_ptrs, 0, K, kk, EVEN_K, "evict_last").to(tl.float32)
    acc = run_sums(x, w, s, W8)  # [M_PAD, BLOCK_N, BLOCK_K // RUN]
    acc_up = acc  # GLU: up's sums; otherwise unused
    if GLU:
        acc_up = run_sums(x, w_up, s_up, W8)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        x = load_chunk(x_ptrs, k0, K, kk, EVEN_K, "evict_last").to(tl.float32)
        acc += load_run_sums(x, w_ptrs, ws_ptrs, k0, K, kk, starts, EVEN_K, W8, GROUP_K)
        if GLU:
            acc_up += load_run_sums(x, up_ptrs, up_ws_ptrs, k0, K, kk, starts, EVEN_K, W8,
                                    GROUP_K)
    if SUM_PAIRS:
        _sum_pairs_epilogue(tl.sum(acc, axis=2), pairs, row_ok, offs_n, N, c_ptr, topw_ptr,
                            M_PAD, BLOCK_N)
    else:
        _moe_epilogue(tl.sum(acc, axis=2), tl.sum(acc_up, axis=2), pairs, row_ok, offs_n, N,
                      c_ptr, topw_ptr, stride_cm, stride_cs, GLU, MUL_WEIGHT, SLOT_K)


@dataclass(frozen=True)
class MoeTile:
    """One projection's launch: BLOCK_N columns by BLOCK_K of K per step, num_warps /
    num_stages. Tensor cores: BLOCK_K divides the FP8 block's bk (one scale per column per
    step). The GEMV: any BLOCK_K (a scale per 16-element run)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class MoeConfig:
    """A MoE MLP's launches: `kind` "gemv" (`_moe_gemv_kernel`, block_m >= the tokens),
    "mma" (`_moe_mma_kernel`, weights in x's dtype or FP8 dequantised in registers) or "w8a8"
    (FP8 weights and activations); block_m, shared by both projections (one sort of the
    pairs); the gate_up and down tiles.
    NOTE: "gemv" with block_m 1 (one token) is the direct path: no align, each pair a block of
    its own expert, and the down projection sums the top-k in its epilogue (its tile's rows
    are the top_k pairs). `swap`: the tensor-core kinds multiply W's tile by the pairs'
    transposed rows (`_moe_mma_kernel`'s SWAP)."""

    kind: str
    block_m: int
    up: MoeTile
    down: MoeTile
    swap: bool = False


#: FP8 experts past the GEMV quantise activations too (FP8 x FP8 tensor cores, as the FP8
#: checkpoints' dynamic activation scheme has it; the GEMV keeps them exact). Up to
#: MOE_W8A8_MIN_TOKENS - 1 tokens (about one pair an expert) the product is swapped, the
#: weight's rows on the MMA's wide side: on an H100 (`bench_kernels.py moe`) 4 tokens 72 us
#: against 79 for W8A16 (the tile dequantised in registers), 8 tokens 113 against 129, 16 159
#: against 172, 64 251 against 264 (W8A16 swapped: 138-281, slower than either). From it,
#: prefill's pairs fill the 128-wide tiles the unswapped product takes.
MOE_W8A8_MIN_TOKENS = 65


def moe_gemv_tiles(m_pad: int, fp8: bool) -> tuple[MoeTile, MoeTile]:
    """The GEMV's (gate_up, down) tiles for up to m_pad tokens, as kernels/gemv.py's M = 1..2
    tiles: runs of 16 bytes.
    - gate_up (K = hidden): one warp a program, one column (gate and up rows), 4 runs a lane
      at one token, fewer as the rows of x a lane holds grow (x: m_pad x 4 // m_pad runs a
      lane);
    - down (K = inter, 768 for Qwen3-30B-A3B: 3 chunks of 256): at one token a program takes
      8 rows of one pair's expert on 2 warps (each lane a run of 4 rows a chunk, x's run
      shared by them); at 2..4 tokens one warp, two FP8 columns, so that a chunk's 32 runs
      cover the warp's lanes.
    NOTE: on an H100 (`bench_kernels.py moe1`, FP8, one token): gate_up 11.2 us, as level
    with 1024 columns a chunk or 4 rows on 4 warps (11.1); down into split-sum slots 6.4 us,
    against 18.3 for the 8 pairs in one program (a column a program) and 7.4-10.6 in other
    tiles; the pairs in one program at this tile 12.7 (`fused_moe`'s path).
    NOTE: accumulators per lane (fp32): rows x BLOCK_N x BLOCK_K / RUN / 32 / warps, at most
    4 (8 for bf16) but down's summed pairs at one token (8 x 8 x 16 / 64 = 16); gate_up holds
    two."""
    run = RUN_BYTES if fp8 else RUN_BYTES // 2  # elements (bf16 / fp16 weights)
    up = MoeTile(1, run * 32 * max(1, 4 // m_pad), num_warps=1, num_stages=1)
    if m_pad == 1:
        return up, MoeTile(8, 256, num_warps=2, num_stages=1)
    return up, MoeTile(2 if fp8 else 1, 256, num_warps=1, num_stages=1)


def pick_moe_config(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
                    block: tuple[int, int] | None) -> MoeConfig:
    """The launches for a step of num_tokens tokens, from shapes only (a small table by token
    class, no tuning while serving). block: the FP8 block (None: bf16 weights)."""
    bk = block[1] if block is not None else 128
    if num_tokens <= MOE_GEMV_MAX_TOKENS:
        m_pad = triton.next_power_of_2(max(1, num_tokens))
        return MoeConfig("gemv", m_pad, *moe_gemv_tiles(m_pad, block is not None))
    # rows per expert on average, the block that holds them (16..64)
    per_expert = -(-num_tokens * top_k // num_experts)
    block_m = min(64, max(16, triton.next_power_of_2(per_expert)))
    if block is not None and num_tokens >= MOE_W8A8_MIN_TOKENS:
        tile = MoeTile(128, min(bk, 128), num_warps=4, num_stages=4 if block_m == 64 else 3)
        return MoeConfig("w8a8", block_m, tile, tile)
    if block is not None:
        tile = MoeTile(128, min(bk, 128), num_warps=8, num_stages=3)
        return MoeConfig("w8a8", block_m, tile, tile, swap=True)
    tile = MoeTile(64 if block_m <= 32 else 128, 64, num_warps=4, num_stages=3)
    return MoeConfig("mma", block_m, tile, tile)


def moe_token_classes(top_k: int, num_experts: int, hidden: int, inter: int,
                      block: tuple[int, int] | None, max_tokens: int) -> tuple[int, ...]:
    """One token count per launch configuration `pick_moe_config` and the routing give up to
    max_tokens (the kernels compile per configuration): what a warm-up runs to build every
    MoE variant."""
    seen: dict[tuple[MoeConfig, tuple[int, int]], int] = {}
    for t in range(1, max_tokens + 1):
        cfg = pick_moe_config(t, top_k, num_experts, hidden, inter, block)
        seen.setdefault((cfg, routing_launch(t, cfg, num_experts)), t)
    return tuple(seen.values())


def _gemv_run(w: Tensor, tile: MoeTile, block: tuple[int, int] | None) -> int:
    """The GEMV's run: 16 bytes of w, at most BLOCK_K, and (FP8) dividing the block's bk so a
    run meets one scale."""
    run = min(RUN_BYTES // w.element_size(), tile.block_k)
    while block is not None and block[1] % run:
        run //= 2
    return run


def _launch_proj(a: Tensor, a_scale: Tensor | None, w: Tensor, w_scale: Tensor | None,
                 out: Tensor, topk_weights: Tensor, sorted_ids: Tensor, block_expert: Tensor,
                 num_pairs: int, row_div: int, glu: bool, block: tuple[int, int] | None,
                 cfg: MoeConfig, tile: MoeTile, direct_rows: int = 0) -> None:
    """One projection over the pairs into out [pairs, N]: sorted into blocks (moe_align), or
    direct_rows > 0 (one token, cfg a GEMV): block_expert is the routing's ids, each pair a
    block of its own (direct_rows 1), or all the pairs one block of direct_rows >= top_k rows
    whose outputs are summed into out [1, N]. out [top_k, tokens, N] fp32 (not glu): split-sum
    slots (`_moe_epilogue`'s SLOT_K)."""
    n, k = out.shape[-1], w.shape[2]
    slot_k, stride_cs = (out.shape[0], out.stride(0)) if out.dim() == 3 else (0, 0)
    bn, bk = block if block is not None else (1, 1)
    gemv = cfg.kind == "gemv"
    if w_scale is not None:
        assert gemv or bk % tile.block_k == 0, "a K step must stay inside one scale block"
        assert w_scale.stride(2) == 1 and w_scale.shape[1:] == (triton.cdiv(w.shape[1], bn),
                                                               triton.cdiv(k, bk))
    ws = w_scale if w_scale is not None else w  # a dummy pointer without scales
    blocks = block_expert.shape[0] if not direct_rows else triton.cdiv(num_pairs, direct_rows)
    grid = (triton.cdiv(n, tile.block_n), blocks)
    meta = {"ROW_DIV": row_div, "GLU": glu, "MUL_WEIGHT": not glu, "SLOT_K": slot_k,
            "W8": w_scale is not None,
            "GROUP_N": bn, "GROUP_K": bk, "BLOCK_N": tile.block_n, "BLOCK_K": tile.block_k,
            "num_warps": tile.num_warps, "num_stages": tile.num_stages}
    ws_strides = (ws.stride(0), ws.stride(1)) if w_scale is not None else (0, 0)
    if gemv:
        direct = direct_rows > 0
        _moe_gemv_kernel[grid](a, w, ws, out, topk_weights, sorted_ids, block_expert, n, k,
                               num_pairs, a.stride(0), w.stride(0), w.stride(1), *ws_strides,
                               out.stride(-2), stride_cs, DIRECT=direct,
                               SUM_PAIRS=direct and not glu and not slot_k,
                               M_PAD=direct_rows if direct else cfg.block_m,
                               RUN=_gemv_run(w, tile, block), EVEN_K=k % tile.block_k == 0,
                               **_pdl(), **meta)
        return
    a_s = a_scale if a_scale is not None else ws
    _moe_mma_kernel[grid](a, a_s, w, ws, out, topk_weights, sorted_ids, block_expert, n, k,
                          num_pairs, a.stride(0), a_s.stride(0), w.stride(0), w.stride(1),
                          *ws_strides, out.stride(-2), stride_cs, A8=cfg.kind == "w8a8",
                          BLOCK_M=cfg.block_m, SWAP=cfg.swap,
                          PRECISION="ieee" if a.dtype == torch.float32 else "tf32", **meta)


def _moe_experts(x: Tensor, weights: Tensor, ids: Tensor, w13: Tensor, w2: Tensor,
                 w13_scale: Tensor | None, w2_scale: Tensor | None,
                 block: tuple[int, int] | None, cfg: MoeConfig, sums: bool = False,
                 aligned: tuple[Tensor, Tensor] | None = None) -> Tensor | SplitSums:
    """moe_experts_ref on the GPU in `cfg`'s launches (`pick_moe_config`): the pairs sorted
    into per-expert blocks, the gate_up projection with silu(gate) * up in its epilogue, the
    down projection times the routing weights, the sum over top_k. sums: where the down
    projection can leave the top-k sum to its consumer (1..MAX_ROWS tokens, routing weights
    in x's dtype), its split-sum slots (`_moe_epilogue`'s SLOT_K) rather than y; aligned:
    moe_align's outputs for ids at cfg.block_m, where they were made with the routing
    (`moe_route_align`). Reads no device tensor on the host: buffers and grids come from
    shapes (graph-safe)."""
    t, h = x.shape
    top_k = ids.shape[1]
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    assert w13.shape[2] == h and w2.shape == (num_experts, h, inter)
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    assert w13.dtype == w2.dtype and w13.dtype in (x.dtype, torch.float8_e4m3fn), (
        f"experts in {w13.dtype} / {w2.dtype} for activations in {x.dtype}: the weights are "
        "the activations' dtype or FP8")
    fp8 = w13_scale is not None
    assert fp8 == (w2_scale is not None) == (block is not None), "FP8: both scales and block"
    if cfg.kind == "gemv":
        assert cfg.block_m >= t, "the GEMV takes each expert's pairs in one block"
    if t == 0:
        return x.new_empty(0, h)
    pairs = t * top_k
    ids = ids.to(torch.int32).contiguous()  # (moe_route's already are: no copy)
    weights = weights.contiguous()
    if cfg.kind == "gemv" and cfg.block_m == 1:
        return _one_token_experts(x, weights, ids, w13, w2, w13_scale, w2_scale, block, cfg,
                                  sums)
    sorted_ids, block_expert = aligned or moe_align(ids, num_experts, cfg.block_m)
    w8a8 = cfg.kind == "w8a8"
    assert not w8a8 or fp8
    group = block[1] if block is not None else 0
    a, a_scale = quantize_fp8_groups(x, group) if w8a8 else (x, None)
    inter_out = x.new_empty(pairs, inter)
    common = (weights, sorted_ids, block_expert, pairs)
    _launch_proj(a, a_scale, w13, w13_scale, inter_out, *common, row_div=top_k, glu=True,
                 block=block, cfg=cfg, tile=cfg.up)
    a, a_scale = quantize_fp8_groups(inter_out, group) if w8a8 else (inter_out, None)
    if sums and t <= MAX_ROWS and weights.dtype == x.dtype:
        slots = slot_buffer(x.device, top_k, t, h)
        _launch_proj(a, a_scale, w2, w2_scale, slots, *common, row_div=1, glu=False,
                     block=block, cfg=cfg, tile=cfg.down)
        return SplitSums(slots, x.dtype)
    pair_out = x.new_empty(pairs, h)
    _launch_proj(a, a_scale, w2, w2_scale, pair_out, *common, row_div=1, glu=False,
                 block=block, cfg=cfg, tile=cfg.down)
    # NOTE: the top-k sum in fp32, rounded once (torch's reduction of a 16-bit tensor)
    return pair_out.view(t, top_k, h).sum(dim=1)


def _one_token_experts(x: Tensor, weights: Tensor, ids: Tensor, w13: Tensor, w2: Tensor,
                       w13_scale: Tensor | None, w2_scale: Tensor | None,
                       block: tuple[int, int] | None, cfg: MoeConfig,
                       sums: bool = False) -> Tensor | SplitSums:
    """One token's experts in two launches: no align (pair j is a block of its own, expert
    ids[0, j]: the kernels read the ids), gate_up per pair, then down per pair into split-sum
    slots (sums, routing weights in x's dtype: the top-k sum left to the consumer), or down
    over all top_k pairs with their weighted sum in the epilogue, into the token's row. No
    per-pair buffer, no torch sum. NOTE: right for any ids, repeated experts too (each pair
    reads its own)."""
    top_k = ids.shape[1]
    inter_out = x.new_empty(top_k, w2.shape[2])
    _launch_proj(x, None, w13, w13_scale, inter_out, weights, ids, ids, top_k, row_div=top_k,
                 glu=True, block=block, cfg=cfg, tile=cfg.up, direct_rows=1)
    down = partial(_launch_proj, inter_out, None, w2, w2_scale, topk_weights=weights,
                   sorted_ids=ids, block_expert=ids, num_pairs=top_k, row_div=1, glu=False,
                   block=block, cfg=cfg, tile=cfg.down)
    if sums and weights.dtype == x.dtype:
        slots = slot_buffer(x.device, top_k, 1, x.shape[1])
        down(out=slots, direct_rows=1)
        return SplitSums(slots, x.dtype)
    out = x.new_empty(1, x.shape[1])
    down(out=out, direct_rows=triton.next_power_of_2(top_k))
    return out


def _fused_moe(x: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor, top_k: int,
               renormalize: bool, w13_scale: Tensor | None, w2_scale: Tensor | None,
               block: tuple[int, int] | None, sums: bool) -> Tensor | SplitSums:
    """Routing, then the experts: up to ROUTE_ALIGN_MAX_TOKENS tokens (one token excepted: it
    needs no align) the routing and the align in one launch."""
    t = x.shape[0]
    cfg = pick_moe_config(t, top_k, w13.shape[0], x.shape[1], w2.shape[2], block)
    aligned = None
    if _route_aligns(t, cfg):
        weights, ids, sorted_ids, block_expert = moe_route_align(router_logits, top_k,
                                                                 renormalize, cfg.block_m)
        aligned = (sorted_ids, block_expert)
    else:
        weights, ids = moe_route(router_logits, top_k, renormalize)
    return _moe_experts(x, weights, ids, w13, w2, w13_scale, w2_scale, block, cfg, sums,
                        aligned)


def _route_aligns(num_tokens: int, cfg: MoeConfig) -> bool:
    """Whether the routing and the align are one launch (`moe_route_align`): 2 (the one-token
    path has no align) to ROUTE_ALIGN_MAX_TOKENS tokens."""
    return 2 <= num_tokens <= ROUTE_ALIGN_MAX_TOKENS and not (cfg.kind == "gemv"
                                                              and cfg.block_m == 1)


def routing_launch(num_tokens: int, cfg: MoeConfig, num_experts: int) -> tuple[int, int]:
    """`fused_moe`'s routing launch at num_tokens: `_route_tile`'s, or (0, 0) for the routing
    fused with the align (its variants follow cfg.block_m)."""
    if _route_aligns(num_tokens, cfg):
        return 0, 0
    return _route_tile(num_tokens, triton.next_power_of_2(num_experts))


def fused_moe_unreduced(x: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor, top_k: int,
                        renormalize: bool, w13_scale: Tensor | None = None,
                        w2_scale: Tensor | None = None, block: tuple[int, int] | None = None,
                        ) -> Tensor | SplitSums:
    """fused_moe_ref on the GPU (routing, then `_moe_experts`), its top-k sum left as
    `SplitSums` where it can be, for a consumer that takes them (`add_rms_norm`)."""
    return _fused_moe(x, router_logits, w13, w2, top_k, renormalize, w13_scale, w2_scale,
                      block, sums=True)


def fused_moe(x: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor, top_k: int,
              renormalize: bool, w13_scale: Tensor | None = None,
              w2_scale: Tensor | None = None, block: tuple[int, int] | None = None) -> Tensor:
    """fused_moe_ref on the GPU: routing, then `_moe_experts`."""
    y = _fused_moe(x, router_logits, w13, w2, top_k, renormalize, w13_scale, w2_scale, block,
                   sums=False)
    assert isinstance(y, Tensor)
    return y
