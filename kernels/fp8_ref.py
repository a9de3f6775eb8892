"""Block-scaled FP8 weights in plain torch: the format's constants, dequantisation and
quantisation, and the references kernels/fp8.py's kernels are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

FP8 = torch.float8_e4m3fn


#: the largest finite e4m3fn value; activations are scaled so that their amax lands on it
FP8_MAX = 448.0


#: an all-zero group still gets a positive scale (no 0 / 0)
FP8_MIN_AMAX = 1e-10


def expand_block_scale(scale: Tensor, block: tuple[int, int], n: int, k: int) -> Tensor:
    """Per-block scales [..., ceil(n/bn), ceil(k/bk)] repeated to one per element [..., n, k]
    (edge blocks cut to the weight's size)."""
    bn, bk = block
    full = scale.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return full[..., :n, :k]


def fp8_dequant_ref(weight: Tensor, scale_inv: Tensor, block: tuple[int, int],
                    dtype: torch.dtype = torch.float32) -> Tensor:
    """weight [..., N, K] (float8_e4m3fn) times its block scale [..., ceil(N/bn), ceil(K/bk)],
    in fp32, returned in `dtype`. Leading dims (experts) are batched."""
    n, k = weight.shape[-2:]
    bn, bk = block
    assert scale_inv.shape[-2:] == (-(-n // bn), -(-k // bk)), (weight.shape, scale_inv.shape)
    scale = expand_block_scale(scale_inv.float(), block, n, k)
    return (weight.float() * scale).to(dtype)


def quantize_fp8_blocks(weight: Tensor, block: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """weight [N, K] as block-scaled FP8, the layout of Qwen's -FP8 releases: (weight / scale
    as e4m3fn [N, K], scale [ceil(N/bn), ceil(K/bk)] float32), scale = max(amax |w|, 1e-10) /
    448 over each block (edge blocks partial); `fp8_dequant_ref` is its inverse up to e4m3's
    rounding. Plain torch on weight's device (a GPU quantizes a layer's weights in ms)."""
    n, k = weight.shape
    bn, bk = block
    gn, gk = -(-n // bn), -(-k // bk)
    w = F.pad(weight.float(), (0, gk * bk - k, 0, gn * bn - n)).view(gn, bn, gk, bk)
    scale = w.abs().amax(dim=(1, 3)).clamp_min(FP8_MIN_AMAX) / FP8_MAX
    q = (w / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(gn * bn, gk * bk)[:n, :k].contiguous(), scale


def fp8_linear_ref(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, block: tuple[int, int],
                   bias: Tensor | None = None) -> Tensor:
    """x [M, K] @ (weight * scale per block)^T (+ bias) -> [M, N] in x's dtype."""
    return F.linear(x, fp8_dequant_ref(weight, weight_scale_inv, block, x.dtype), bias)


def quantize_fp8_groups_ref(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """Per-(row, `group`-column) FP8 of x [M, K] (a W8A8 GEMM's activations): (x / scale as
    e4m3fn [M, K], scale [M, ceil(K/group)] float32) with scale = max(amax |x|, 1e-10) / 448
    over each group (the last one partial)."""
    m, k = x.shape
    groups = -(-k // group)
    xf = F.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = xf.abs().amax(dim=-1).clamp_min(FP8_MIN_AMAX) / FP8_MAX
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(m, -1)[:, :k].contiguous(), scale


def fp8_dequant_groups_ref(q: Tensor, scale: Tensor, group: int) -> Tensor:
    """quantize_fp8_groups_ref's inverse: q.float() * its group's scale, [M, K] float32."""
    return q.float() * scale.repeat_interleave(group, dim=-1)[:, :q.shape[1]]


def fp8_linear_w8a8_ref(x: Tensor, weight: Tensor, weight_scale_inv: Tensor,
                        block: tuple[int, int], bias: Tensor | None = None) -> Tensor:
    """`fp8_linear_ref` with x quantised as the W8A8 GEMM quantises it (per row and bk-column
    group), products summed in fp32: what that kernel computes, up to fp32 rounding."""
    q, scale = quantize_fp8_groups_ref(x, block[1])
    y = F.linear(fp8_dequant_groups_ref(q, scale, block[1]),
                 fp8_dequant_ref(weight, weight_scale_inv, block),
                 bias.float() if bias is not None else None)
    return y.to(x.dtype)
