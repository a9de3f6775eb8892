"""A linear layer by its weight's format, in plain torch: the CPU executor's products,
and the reference kernels/linear.py's dispatch is tested against."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from arle_kernels.fp8_ref import FP8, fp8_linear_ref
from arle_kernels.fused_ref import silu_and_mul_ref
from arle_kernels.quant import int_format, int_linear
from arle_kernels.w4a16_ref import w4_format, w4_linear_ref


def fp8_scale_of(weight: Tensor) -> tuple[Tensor, tuple[int, int]]:
    """An FP8 weight's scales and the (rows, columns) block each covers."""
    return weight.fp8_scale, weight.fp8_block  # type: ignore[attr-defined]


def attach_fp8_scale(weight: Tensor, scale: Tensor, block: tuple[int, int]) -> None:
    """Let the products (which see the weight only) find its scales."""
    weight.fp8_scale = scale  # type: ignore[attr-defined]
    weight.fp8_block = block  # type: ignore[attr-defined]


def linear_ref(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    if (w4 := w4_format(weight)) is not None:
        return w4_linear_ref(x, weight, w4, bias)
    if (fmt := int_format(weight)) is not None:
        return int_linear(x, weight, fmt, bias)
    if weight.dtype == FP8:
        return fp8_linear_ref(x, weight, *fp8_scale_of(weight), bias)
    return F.linear(x, weight, bias)


def linear_silu_and_mul_ref(x: Tensor, gate_up: Tensor) -> Tensor:
    """silu(x @ gate^T) * (x @ up^T) for gate_up = [gate; up]."""
    return silu_and_mul_ref(linear_ref(x, gate_up))
