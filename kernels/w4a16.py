"""4-bit weights on the GPU (W4A16: AWQ and GPTQ checkpoints): a Triton GEMV for decode rows and
a GEMM for prefill chunks, both dequantizing the weight in registers, beside the plain-torch
reference (`w4_linear_ref`) they are tested against.

Layout (`pack_w4`, from the loaders' `Int4Groups`): the weight is int32 [N, K / 8], word w of
row n holding q[n, 8w + j] in bits 4j..4j+3 (0..15); per `group` consecutive columns of a
row a scale and an offset, [N, K / group] in fp16: w = q * scale + offset (offset = zero -
8 scale of `Int4Groups`' w = (q - 8) scale + zero). Half a byte a weight plus 4 bytes a group:
at group 128, 0.53 bytes a weight against bf16's 2.

The weight tensor carries its format (`attach_w4`), as an FP8 weight its scales: the products
(`arle_kernels.linear`) see only the weight.

- `_w4_gemv_kernel`: program (block of BN output rows, split of K): all M (<= GEMV_MAX_ROWS)
  rows of x against its rows, the weight words read once, unpacked by shifts, scaled per
  group, summed in fp32 (FMA, no tensor cores: the step is bound by the weight's bytes).
  Splits of K write fp32 partial sums that one reduce adds (K is long beside N at decode
  shapes, so N's blocks alone leave SMs idle).
- `_w4_gemm_kernel`: program (BM x BN tile): K in BK steps, the weight tile dequantized to
  x's dtype and multiplied on tensor cores (tl.dot), fp32 accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from arle_kernels.jit import jit_varying
from arle_kernels.quant import Int4Groups

#: most rows of x the GEMV takes (more: the GEMM)
GEMV_MAX_ROWS = 8
#: the K tile of both kernels: group sizes up to it are whole within a tile, larger ones
#: (256) span several tiles
BLOCK_K = 128


@dataclass(frozen=True)
class W4Format:
    """What a packed weight [N, K / 8] int32 needs beside its words."""

    scale: Tensor  # [N, K / group] fp16
    offset: Tensor  # [N, K / group] fp16
    group: int

    @property
    def k(self) -> int:
        return self.scale.shape[1] * self.group


def attach_w4(weight: Tensor, fmt: W4Format) -> Tensor:
    weight.w4_format = fmt  # type: ignore[attr-defined]
    return weight


def w4_format(weight: Tensor) -> W4Format | None:
    return getattr(weight, "w4_format", None)


def pack_w4(w: Int4Groups) -> Tensor:
    """The GPU layout of a loader's 4-bit groups (module docstring), on w's device, its format
    attached. K must be a multiple of 8 and of the group."""
    n, k = w.q.shape
    assert k % 8 == 0 and k % w.group == 0, (n, k, w.group)
    nib = w.q.to(torch.int32).view(n, k // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=w.q.device)
    words = (nib << shifts).sum(dim=-1, dtype=torch.int32)
    scale = w.scale.float()
    fmt = W4Format(scale.to(torch.float16), (w.zero.float() - 8 * scale).to(torch.float16),
                   w.group)
    return attach_w4(words.contiguous(), fmt)


def nibbles(words: Tensor) -> Tensor:
    """int32 [..., C] -> uint8 [..., C, 8]: nibble i is bits 4i..4i+3 (AWQ's, GPTQ's and our
    words)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    return ((words[..., None] >> shifts) & 15).to(torch.uint8)


def unpack_w4(words: Tensor, fmt: W4Format, dtype: torch.dtype = torch.float32) -> Tensor:
    """The weight [N, K] in `dtype` (q * scale + offset in fp32)."""
    n = words.shape[0]
    q = nibbles(words).view(n, -1).float()
    g = fmt.group
    w = q.view(n, -1, g) * fmt.scale.float()[..., None] + fmt.offset.float()[..., None]
    return w.view(n, -1).to(dtype)


def w4_linear_ref(x: Tensor, weight: Tensor, fmt: W4Format, bias: Tensor | None = None
                  ) -> Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] in x's dtype, in fp32."""
    y = x.float() @ unpack_w4(weight, fmt).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Triton
# ---------------------------------------------------------------------------------------------

@triton.jit
def _load_tile(w_ptr, s_ptr, o_ptr, offs_n, nmask, k0, K, stride_wn, stride_sn,
               BN: tl.constexpr, BK: tl.constexpr, G: tl.constexpr):
    """The weight tile [BN, BK] at columns k0.., fp32 (0 past K): its words [BN, BK / 8],
    nibbles by shifts (nibble j of word w is column 8w + j), then each group's scale and
    offset."""
    offs_w = k0 // 8 + tl.arange(0, BK // 8)
    words = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_w[None, :],
                    mask=nmask[:, None] & (offs_w < K // 8)[None, :], other=0)
    shifts = tl.arange(0, 8) * 4
    q = ((words[:, :, None] >> shifts[None, None, :]) & 0xF).to(tl.float32)
    GT: tl.constexpr = G if G < BK else BK  # columns of one group inside the tile
    NG: tl.constexpr = BK // GT
    gidx = (k0 + tl.arange(0, NG) * GT) // G
    sp = offs_n[:, None] * stride_sn + gidx[None, :]
    smask = nmask[:, None] & (gidx < K // G)[None, :]
    s = tl.load(s_ptr + sp, mask=smask, other=0.0).to(tl.float32)
    o = tl.load(o_ptr + sp, mask=smask, other=0.0).to(tl.float32)
    w = tl.reshape(q, (BN, NG, GT)) * s[:, :, None] + o[:, :, None]
    return tl.reshape(w, (BN, BK))


@jit_varying("M", "stride_xm", "stride_ym", "k_per_split")
def _w4_gemv_kernel(x_ptr, w_ptr, s_ptr, o_ptr, y_ptr, M, N, K, k_per_split,
                    stride_xm, stride_wn, stride_sn, stride_ym, stride_ys,
                    G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Program (block of BN rows of W, split of K): y[split][m, n] = sum over its K of
    x[m, k] w[n, k], fp32 (module docstring)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < N
    offs_m = tl.arange(0, BM)
    mmask = offs_m < M
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BK):
        w = _load_tile(w_ptr, s_ptr, o_ptr, offs_n, nmask, k0, K, stride_wn, stride_sn, BN, BK,
                       G)
        offs_k = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mmask[:, None] & (offs_k < K)[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    ptrs = y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(ptrs, acc, mask=mmask[:, None] & nmask[None, :])


@jit_varying("M", "stride_xm", "stride_ym")
def _w4_gemm_kernel(x_ptr, w_ptr, s_ptr, o_ptr, b_ptr, y_ptr, M, N, K,
                    stride_xm, stride_wn, stride_sn, stride_ym,
                    G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    HAS_BIAS: tl.constexpr):
    """Program (BM x BN tile of y): x's tile times the weight tile dequantized to x's dtype, on
    tensor cores, fp32 accumulation; + bias; y in x's dtype."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mmask = offs_m < M
    nmask = offs_n < N
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        w = _load_tile(w_ptr, s_ptr, o_ptr, offs_n, nmask, k0, K, stride_wn, stride_sn, BN, BK,
                       G)
        offs_k = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mmask[:, None] & (offs_k < K)[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w.to(dtype)), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(ptrs, acc.to(dtype), mask=mmask[:, None] & nmask[None, :])


@dataclass(frozen=True)
class W4Tile:
    """A GEMV program's work: block_n rows of W, block_k columns a step, num_warps warps."""

    block_n: int = 16
    block_k: int = BLOCK_K
    num_warps: int = 4


#: the GEMV's tile. NOTE: on an H100 it streamed 0.24 TB/s at Qwen3-4B's shapes (1 KB of
#: words a program a step, ~3 programs an SM): `scripts/bench_kernels.py w4` sweeps others
GEMV_TILE = W4Tile()
#: the programs the GEMV aims for (H100/H200: 132 SMs, a few programs each in flight)
GEMV_PROGRAMS = 528
#: GEMM tiles (rows x weight rows) and warps
GEMM_TILE = (64, 64, 4)


def _splits(n_blocks: int, k: int, block_k: int = BLOCK_K) -> int:
    """K splits of the GEMV: enough programs to fill the GPU, each at least 4 K tiles."""
    want = max(1, GEMV_PROGRAMS // n_blocks)
    return max(1, min(want, k // (4 * block_k)))


def _whole_groups(group: int, block_k: int) -> bool:
    """A K tile holds whole groups, or a group whole tiles (`_load_tile`'s scale lookup)."""
    return group % 8 == 0 and (group % block_k == 0 or block_k % group == 0)


def w4_linear(x: Tensor, weight: Tensor, fmt: W4Format, bias: Tensor | None = None,
              tile: W4Tile = GEMV_TILE) -> Tensor:
    """`w4_linear_ref` in Triton: the GEMV (in `tile`s) up to GEMV_MAX_ROWS rows, else the
    GEMM. x [M, K] fp16/bf16 (contiguous rows) -> [M, N] in x's dtype. Graph-safe (no host
    reads)."""
    m, k = x.shape
    n = weight.shape[0]
    assert k == fmt.k and k % 8 == 0, (x.shape, fmt.k)
    assert _whole_groups(fmt.group, BLOCK_K) and _whole_groups(fmt.group, tile.block_k)
    x = x.contiguous()
    if m <= GEMV_MAX_ROWS:
        bk = tile.block_k
        blocks = triton.cdiv(n, tile.block_n)
        splits = _splits(blocks, k, bk)
        per = triton.cdiv(triton.cdiv(k, splits), bk) * bk
        splits = triton.cdiv(k, per)
        part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
        _w4_gemv_kernel[(blocks, splits)](
            x, weight, fmt.scale, fmt.offset, part, m, n, k, per, x.stride(0),
            weight.stride(0), fmt.scale.stride(0), part.stride(1), part.stride(0),
            G=fmt.group, BM=max(2, triton.next_power_of_2(m)), BN=tile.block_n, BK=bk,
            num_warps=tile.num_warps)
        y = part.sum(dim=0) if splits > 1 else part[0]
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)
    bm, bn, warps = GEMM_TILE
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _w4_gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, weight, fmt.scale, fmt.offset, bias if bias is not None else x, y, m, n, k,
        x.stride(0), weight.stride(0), fmt.scale.stride(0), y.stride(0), G=fmt.group, BM=bm,
        BN=bn, BK=BLOCK_K, HAS_BIAS=bias is not None, num_warps=warps, num_stages=3)
    return y
