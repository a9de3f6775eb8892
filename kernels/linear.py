"""A linear layer's product y = x W^T (+ b) on CUDA, by the weight's format: our GEMV where it
streams the weights faster than cuBLAS (`use_gemv`), cuBLAS otherwise; block-scaled FP8
weights through the FP8 kernels; 4-bit weights through the W4A16 kernels (kernels/w4a16.py).
The torch references beside it (kernels/linear_ref.py) are the CPU's products, integer weights
through torch's packed kernels (kernels/quant.py). `ops_for` picks one family.

A block-scaled FP8 weight carries its scales (`attach_fp8_scale`): the products see only the
weight.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from arle_kernels.fp8 import fp8_linear, fp8_linear_unreduced, fp8_silu_mul
from arle_kernels.fp8_ref import FP8
from arle_kernels.fused import silu_and_mul
from arle_kernels.gemv import gemv, gemv_silu_mul, gemv_split_sums, use_gemv
from arle_kernels.linear_ref import fp8_scale_of
from arle_kernels.split_sums import SplitSums
from arle_kernels.w4a16 import w4_linear, w4_silu_mul
from arle_kernels.w4a16_ref import w4_format


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    if (w4 := w4_format(weight)) is not None:
        return w4_linear(x, weight, w4, bias)
    if weight.dtype == FP8:
        return fp8_linear(x, weight, *fp8_scale_of(weight), bias)
    if use_gemv(x.shape[0], weight.shape[0], weight.shape[1]):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_unreduced(x: Tensor, weight: Tensor) -> Tensor | SplitSums:
    """`linear` (no bias) for a consumer that takes `SplitSums` (`add_rms_norm`,
    `qk_norm_rope_store_kv`): where the GEMV splits K, its partial sums are left for that
    consumer to add (no reduce kernel); otherwise y."""
    if w4_format(weight) is not None:
        return linear(x, weight)
    if weight.dtype == FP8:
        return fp8_linear_unreduced(x, weight, *fp8_scale_of(weight))
    if use_gemv(x.shape[0], weight.shape[0], weight.shape[1]):
        return gemv_split_sums(x, weight)
    return F.linear(x, weight)


def linear_silu_and_mul(x: Tensor, gate_up: Tensor) -> Tensor:
    """`linear_silu_and_mul_ref`: where `linear` takes a GEMV (bf16, FP8 or 4-bit), one kernel
    does both (the activation in its epilogue: no gate_up round trip, one launch less per
    layer); otherwise the linear, then `silu_and_mul`."""
    w4 = w4_format(gate_up)
    fused: Tensor | None = None
    if w4 is not None:
        fused = w4_silu_mul(x, gate_up, w4)
    elif gate_up.dtype == FP8:
        fused = fp8_silu_mul(x, gate_up, *fp8_scale_of(gate_up))
    elif use_gemv(x.shape[0], gate_up.shape[0], gate_up.shape[1], glu=True):
        fused = gemv_silu_mul(x, gate_up)
    return fused if fused is not None else silu_and_mul(linear(x, gate_up))
