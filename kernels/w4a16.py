"""4-bit weights on the GPU (W4A16: AWQ and GPTQ checkpoints): the Triton GEMM for prefill, and
the dispatch to kernels/gemv.py's 4-bit GEMV (`_gemv_w4_kernel`) for decode rows.

The layout and the plain-torch reference (`w4_linear_ref`) the kernels are tested against
live in kernels/w4a16_ref.py.

Layout (`pack_w4`, from the loaders' `Int4Groups`): the weight is int32 words [N, K / 8] in
runs of 4 words (one 16-byte load) holding 32 columns: nibble j (bits 4j..4j+3) of a run's
word i is the run's column 4j + i, so each nibble of a thread's 4 words meets 4 contiguous
values of x (the GEMV's loads of x and W then share one register layout). Per `group`
consecutive columns of a row a scale and a zero, fp16, in one tensor [N, 2, K / group]:
w = (q - 8) scale + zero, as `Int4Groups` has it. Half a byte a weight plus 4 bytes a group:
at group 128, 0.53 bytes a weight against bf16's 2. The group is a multiple of 32 (a run lies
in one group).

The weight tensor carries its format (`attach_w4`), as an FP8 weight its scales: the products
(`arle_kernels.linear`) see only the weight.

- GEMV (1-2 rows, `use_w4_gemv`): kernels/gemv.py's `gemv_w4`, the FMA GEMVs' tiles and
  epilogue (split K, bias, the fused gate_up's activation), each nibble masked in place
  into an fp32 denormal in registers (`_nibble_product`).
- `_w4_gemm_kernel` (3 to DEQUANT_ROWS - 1 rows): program (BM x BN tile, split of K): K in BK
  steps, the weight tile on tensor cores (tl.dot) with x's columns gathered in the words'
  order, fp32 accumulation; the tile is q - 8 made by bits, the group's scale and zero
  applied after the dot where a step lies in one group, else dequantized in fp32; K split
  where the tiles leave SMs idle.
- Prefill chunks (DEQUANT_ROWS rows and more): `_w4_dequant_kernel` writes the weight in x's
  dtype and cuBLAS multiplies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from arle_kernels.gemv import (
    W4_CENTRED,
    centred_nibbles,
    fill_splits,
    gemv_w4,
    reduce_splits,
    use_w4_gemv,
)
from arle_kernels.jit import jit_varying
from arle_kernels.w4a16_ref import W4Format, w4_layout_ok

#: the GEMM's K tile: groups up to it are whole within a tile, larger ones (256) span several
BLOCK_K = 128


# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------

@triton.jit
def _load_tile(w_ptr, s_ptr, offs_n, nmask, k0, K, stride_wn, stride_sn,
               BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr):
    """The weight tile [BN, BK] at columns k0.., fp32 (0 past K), in the words' order: its
    words [BN, BK / 8], nibbles by shifts, then each run's group's scale and zero (s_ptr's
    rows [2, K / G]). Position 8w + j holds the nibble j of word w (`_tile_columns`)."""
    offs_w = k0 // 8 + tl.arange(0, BK // 8)
    words = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_w[None, :],
                    mask=nmask[:, None] & (offs_w < K // 8)[None, :], other=0)
    shifts = tl.arange(0, 8) * 4
    q = ((words[:, :, None] >> shifts[None, None, :]) & 0xF).to(tl.float32)
    NR: tl.constexpr = BK // 32  # runs in the tile
    gidx = (k0 + tl.arange(0, NR) * 32) // G
    sp = offs_n[:, None] * stride_sn + gidx[None, :]
    smask = nmask[:, None] & (gidx < K // G)[None, :]
    s = tl.load(s_ptr + sp, mask=smask, other=0.0).to(tl.float32)
    z = tl.load(s_ptr + K // G + sp, mask=smask, other=0.0).to(tl.float32)
    w = (tl.reshape(q, (BN, NR, 32)) - 8.0) * s[:, :, None] + z[:, :, None]
    return tl.reshape(w, (BN, BK))


@triton.jit
def _load_centred(w_ptr, offs_n, nmask, k0, K, stride_wn, BN: tl.constexpr, BK: tl.constexpr,
                  MAGIC: tl.constexpr, CENTRE: tl.constexpr, dtype: tl.constexpr):
    """`_load_tile`'s nibbles as q - 8 in dtype (exact), unscaled, by bits alone
    (kernels/gemv.py's `centred_nibbles`): no fp32 tile for 16-bit x."""
    offs_w = k0 // 8 + tl.arange(0, BK // 8)
    words = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_w[None, :],
                    mask=nmask[:, None] & (offs_w < K // 8)[None, :], other=0)
    shifts = tl.arange(0, 8) * 4
    q = centred_nibbles(words[:, :, None] >> shifts[None, None, :], MAGIC, CENTRE, dtype)
    return tl.reshape(q, (BN, BK))


@triton.jit
def _tile_columns(BK: tl.constexpr):
    """The column (from the tile's first) at each position of `_load_tile`'s order: position
    32 r + 8 i + j is the run r's word i, nibble j, column 32 r + 4 j + i."""
    p = tl.arange(0, BK)
    t = p % 32
    return p - t + 4 * (t % 8) + t // 8


@triton.jit
def _w4_dequant_kernel(w_ptr, s_ptr, y_ptr, N, K, stride_wn, stride_sn, stride_yn,
                       G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Program (BN rows, BK columns): the weight tile dequantized (`_load_tile`), put back in
    column order, stored in y's dtype."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * BK
    nmask = offs_n < N
    w = _load_tile(w_ptr, s_ptr, offs_n, nmask, k0, K, stride_wn, stride_sn, BN, BK, G)
    # position 32 r + 8 i + j -> column 32 r + 4 j + i
    w = tl.reshape(tl.permute(tl.reshape(w, (BN, BK // 32, 4, 8)), (0, 1, 3, 2)), (BN, BK))
    offs_k = k0 + tl.arange(0, BK)
    ptrs = y_ptr + offs_n[:, None].to(tl.int64) * stride_yn + offs_k[None, :]
    tl.store(ptrs, w.to(y_ptr.dtype.element_ty), mask=nmask[:, None] & (offs_k < K)[None, :])


@jit_varying("M", "stride_xm", "stride_ym", "stride_ys")
def _w4_gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, k_per_split,
                    stride_xm, stride_wn, stride_sn, stride_ym, stride_ys,
                    G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    HAS_BIAS: tl.constexpr, MAGIC: tl.constexpr, CENTRE: tl.constexpr,
                    PARTIAL: tl.constexpr = False):
    """Program (BM x BN tile of y, split of K): x's tile (its columns in the words' order)
    times the weight tile, on tensor cores, fp32 accumulation; + bias; y in x's dtype.
    - A K step inside one group (G a multiple of BK): the dot takes q - 8 exact in x's dtype
      (`_load_centred`), the group's scale and zero come after, in fp32: scale * sum x (q - 8)
      + zero * sum x. So the weight is never rounded, and its tile costs a few integer ops.
    - Smaller groups: the tile dequantized in fp32 (`_load_tile`), rounded to x's dtype.
    PARTIAL (split K): y is fp32 [splits, M, N] (stride_ys between splits) and takes the
    split's sums, no bias. NOTE: k_per_split is a multiple of BK."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mmask = offs_m < M
    nmask = offs_n < N
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    cols = _tile_columns(BK)
    k_lo = pid_k * k_per_split
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BK):
        offs_k = k0 + cols
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mmask[:, None] & (offs_k < K)[None, :], other=0.0)
        if G % BK == 0:
            q = _load_centred(w_ptr, offs_n, nmask, k0, K, stride_wn, BN, BK, MAGIC, CENTRE,
                              dtype)
            s_ptrs = s_ptr + offs_n * stride_sn + k0 // G
            s = tl.load(s_ptrs, mask=nmask, other=0.0).to(tl.float32)
            z = tl.load(s_ptrs + K // G, mask=nmask, other=0.0).to(tl.float32)
            # NOTE: sum x by the tensor cores too (x times ones, already in each column's
            # place): a row sum across lanes costs more shuffles than the MMA
            xsum = tl.dot(x, tl.full([BK, BN], 1.0, dtype))
            acc += tl.dot(x, tl.trans(q)) * s[None, :] + xsum * z[None, :]
        else:
            w = _load_tile(w_ptr, s_ptr, offs_n, nmask, k0, K, stride_wn, stride_sn, BN, BK, G)
            acc = tl.dot(x, tl.trans(w.to(dtype)), acc)
    out_mask = mmask[:, None] & nmask[None, :]
    if PARTIAL:
        ptrs = y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(ptrs, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(ptrs, acc.to(dtype), mask=out_mask)


#: GEMM tiles (rows x weight rows) and warps: for prefill chunks, and for up to 16 rows (at 8
#: rows on an H100, `bench_kernels.py w4`: qkv 32 us against 46, gate_up 79 against 115)
GEMM_TILE = (64, 64, 4)
GEMM_TILE_FEW_ROWS = (16, 64, 4)
#: rows from which a product dequantizes the weight to x's dtype and takes cuBLAS's GEMM (the
#: weight's bf16 copy, written and read once, costs less than the GEMM's gathers of x: AWQ
#: Qwen3-4B on an H100, a decode step of 32 rows 29.1 ms in the GEMM, of 64 dequantized 8.8);
#: the dequantizing kernel's tile (rows, columns)
DEQUANT_ROWS = 16
DEQUANT_TILE = (32, 256)


def w4_linear(x: Tensor, weight: Tensor, fmt: W4Format, bias: Tensor | None = None) -> Tensor:
    """`w4_linear_ref` in Triton: kernels/gemv.py's 4-bit GEMV where it takes the rows
    (`use_w4_gemv`), the GEMM below DEQUANT_ROWS, else the weight dequantized for cuBLAS.
    x [M, K] fp16/bf16 -> [M, N] in x's dtype. Graph-safe (no host reads)."""
    m, k = x.shape
    assert k == fmt.k and w4_layout_ok(k, fmt.group), (x.shape, fmt.k, fmt.group)
    x = x.contiguous()
    if use_w4_gemv(m):
        return gemv_w4(x, weight, (fmt.scales, fmt.group), bias)
    if m < DEQUANT_ROWS:
        return w4_gemm(x, weight, fmt, bias)
    return F.linear(x, w4_dequant(weight, fmt, x.dtype), bias)


def w4_dequant(weight: Tensor, fmt: W4Format, dtype: torch.dtype) -> Tensor:
    """`unpack_w4` in Triton: the weight [N, K] in `dtype`, a new tensor."""
    n, k = weight.shape[0], fmt.k
    y = torch.empty(n, k, dtype=dtype, device=weight.device)
    bn, bk = DEQUANT_TILE
    _w4_dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        weight, fmt.scales, y, n, k, weight.stride(0), fmt.scales.stride(0), y.stride(0),
        G=fmt.group, BN=bn, BK=bk, num_warps=4)
    return y


def w4_gemm(x: Tensor, weight: Tensor, fmt: W4Format, bias: Tensor | None = None,
            tile: tuple[int, int, int] | None = None, split: int | None = None) -> Tensor:
    """`w4_linear` through the GEMM at any rows, in `tile` (BM, BN, warps; by default by the
    rows) and `split` splits of K (by default where the tiles leave SMs idle, splits of >= 4
    K tiles: at 8 rows qkv makes 96 tiles of 16 x 64 for 132 SMs), partial sums added by
    kernels/gemv.py's reduce."""
    m, k = x.shape
    n = weight.shape[0]
    bm, bn, warps = tile or (GEMM_TILE_FEW_ROWS if m <= 16 else GEMM_TILE)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = split or fill_splits(tiles, triton.cdiv(k, BLOCK_K), 4)
    per = triton.cdiv(triton.cdiv(k, BLOCK_K), split) * BLOCK_K
    split = triton.cdiv(k, per)  # no empty splits
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    dst = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    _w4_gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), split)](
        x, weight, fmt.scales, bias if bias is not None else x, dst, m, n, k, per,
        x.stride(0), weight.stride(0), fmt.scales.stride(0), dst.stride(-2),
        dst.stride(0) if split > 1 else 0, G=fmt.group, BM=bm, BN=bn, BK=BLOCK_K,
        HAS_BIAS=bias is not None, PARTIAL=split > 1, num_warps=warps, num_stages=3,
        MAGIC=W4_CENTRED[x.dtype][0], CENTRE=W4_CENTRED[x.dtype][1])
    if split > 1:
        reduce_splits(dst, bias, y)
    return y


def w4_silu_mul(x: Tensor, gate_up: Tensor, fmt: W4Format) -> Tensor | None:
    """silu(x gate^T) * (x up^T) for a 4-bit gate_up = [gate; up] in one GEMV launch (its
    epilogue takes the activation) where the GEMV takes the rows (`use_w4_gemv`); None
    otherwise (the caller's GEMM and activation)."""
    if not use_w4_gemv(x.shape[0]):
        return None
    assert x.shape[1] == fmt.k and w4_layout_ok(fmt.k, fmt.group)
    return gemv_w4(x.contiguous(), gate_up, (fmt.scales, fmt.group), glu=True)
