"""Token embedding lookup, y[r] = W[ids[r]], in one kernel: a Triton kernel (its
reference, `embed_ref`, in kernels/embed_ref.py).

A CUDA decode graph reads its rows' input ids from the token buffer, where the step before
wrote the sampled tokens: `embed(weight, slots, token_buffer)` takes y[r] = W[token_buffer[
slots[r]]]. In torch that was three launches at the head of every decode step (the int32
index cast to int64, the gather from the token buffer, and `F.embedding`'s index_select):
~12 us of a Qwen3-4B batch-8 step's critical path on the H200 (`bench_gpu.py decode`'s
kernel table), where this one kernel copies 8 rows of 5 KB.

- Program (r, j): row r, columns [j*BLOCK, (j+1)*BLOCK) of the hidden size.
- Under PDL it lets the next kernel (the first layer's norm) launch first thing and waits for
  the kernel before it only to read the ids (which that kernel may have written).
- NOTE: an id outside [0, V) gives a row of zeros, never a read outside W (the reference,
  `F.embedding`, raises: callers validate ids before a step).
- The grid depends only on host ints (rows, hidden size): safe to capture in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from arle_kernels.jit import gdc_launch_dependents, gdc_wait, jit_varying, pdl_enabled, pdl_launch

#: hidden-size columns a program copies (16-byte loads: 8 bf16 x 32 lanes x 4 warps)
_BLOCK = 1024


# NOTE: the ids' pointers move with the step's views (not specialised on alignment)
@jit_varying("ids_ptr", "source_ptr")
def _embed_kernel(ids_ptr, source_ptr, w_ptr, y_ptr, V, D, stride_w, stride_y,
                  HAS_SOURCE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Row r of y: W's row id, id = source[ids[r]] (HAS_SOURCE) or ids[r]."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    token = tl.load(ids_ptr + r)
    if HAS_SOURCE:
        token = tl.load(source_ptr + token)
    token = token.to(tl.int64)
    in_vocab = (token >= 0) & (token < V)
    row = tl.load(w_ptr + token * stride_w + offs, mask=offs < tl.where(in_vocab, D, 0),
                  other=0.0)
    tl.store(y_ptr + r.to(tl.int64) * stride_y + offs, row, mask=offs < D)


def embed(weight: Tensor, ids: Tensor, source: Tensor | None = None) -> Tensor:
    """weight [V, D] (rows contiguous); ids [T] int32/int64. Returns y [T, D] in weight's dtype:
    y[r] = weight[ids[r]], or weight[source[ids[r]]] when a source [S] of ids is given."""
    assert weight.dim() == 2 and weight.stride(1) == 1, "weight: [V, D], rows contiguous"
    assert ids.dim() == 1 and ids.dtype in (torch.int32, torch.int64) and ids.stride(0) == 1
    if source is not None:
        assert source.dim() == 1 and source.dtype in (torch.int32, torch.int64)
        assert source.stride(0) == 1
    vocab, dim = weight.shape
    y = torch.empty(ids.shape[0], dim, dtype=weight.dtype, device=weight.device)
    if ids.shape[0] == 0:
        return y
    pdl = pdl_enabled()
    _embed_kernel[(ids.shape[0], triton.cdiv(dim, _BLOCK))](
        ids, source if source is not None else ids, weight, y, vocab, dim, weight.stride(0),
        y.stride(0), HAS_SOURCE=source is not None, BLOCK=_BLOCK, PDL=pdl, num_warps=4,
        **pdl_launch(pdl))
    return y


__all__ = ["embed"]
