"""The two implementations of a decoder layer's kernels, chosen once per executor.

`REFERENCE` is plain torch (the CPU executor, and what every kernel is tested against);
`triton_ops()` is the Triton kernels (the CUDA executor). Both compute the same function: the
model and its attention backend call `ops.<op>` and never know which they got.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from arle_kernels import decode_attention, extend_attention, fused, gemv


@dataclass(frozen=True)
class Ops:
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    #: (x, residual, weight, eps) -> (normed, x + residual); may update `residual` in place
    add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    #: (x, residual | None, norm weight, eps, W, bias) -> (norm(x + residual) W^T + bias,
    #: x + residual): a norm and the linear layer after it (one kernel for few rows on CUDA)
    add_rms_norm_linear: Callable[..., tuple[Tensor, Tensor]]
    #: (gate_up, W) -> (silu(gate) * up) W^T
    silu_and_mul_linear: Callable[[Tensor, Tensor], Tensor]
    qk_norm_rope_store_kv: Callable[..., Tensor]
    #: paged attention of the decode rows (one query token each) and of the extend rows
    decode_attention: Callable[..., Tensor]
    extend_attention: Callable[..., Tensor]


REFERENCE = Ops(fused.rms_norm_ref, fused.add_rms_norm_ref, gemv.add_rms_norm_linear_ref,
                gemv.silu_and_mul_linear_ref, fused.qk_norm_rope_store_kv_ref,
                decode_attention.decode_attention_ref,
                extend_attention.extend_attention_ref)


def triton_ops() -> Ops:
    return Ops(fused.rms_norm, fused.add_rms_norm, gemv.add_rms_norm_linear,
               gemv.silu_and_mul_linear, fused.qk_norm_rope_store_kv,
               decode_attention.decode_attention,
               extend_attention.extend_attention)


def ops_for(device: torch.device) -> Ops:
    """The kernels a model on `device` runs: Triton's on CUDA, the torch references elsewhere."""
    return triton_ops() if device.type == "cuda" else REFERENCE
