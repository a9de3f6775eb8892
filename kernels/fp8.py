"""Block-scaled FP8 linear layers (the format of the Qwen FP8 releases): torch references, and
Triton kernels beside them.

Format: `weight` [N, K] float8_e4m3fn and `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] float32;
the real weight is `weight * scale` per (bn, bk) block, edge blocks partial.

- `fp8_dequant_ref`: the dequantised weight (fp32 products, then the asked dtype), as
  transformers dequantises an FP8 checkpoint on a machine without a GPU.
- `fp8_linear_ref`: x @ dequant(weight)^T (+ bias) through F.linear, in x's dtype.
"""

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


def fp8_linear_ref(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, block: tuple[int, int],
                   bias: Tensor | None = None) -> Tensor:
    """x [M, K] @ (weight * scale per block)^T (+ bias) -> [M, N] in x's dtype."""
    return F.linear(x, fp8_dequant_ref(weight, weight_scale_inv, block, x.dtype), bias)
