"""Exp(1) noise for seeded sampling: a Triton kernel (its plain-torch
reference in kernels/noise_ref.py).

A seeded row's noise depends only on (seed, offset), never on the row or the batch, so a seeded
request draws the same tokens wherever it lands. The two executors draw different streams:
`exponential_noise` (CUDA) runs Philox on the device, `exponential_noise_ref` (the CPU sampler's
stream) a torch generator per row seeded with `mix_seed(seed, offset)`. A seed reproduces its
tokens on the same kind of device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 1024


@triton.jit
def _exponential_noise_kernel(seed_ptr, offset_ptr, out_ptr, vocab, stride_out,
                              BLOCK: tl.constexpr):
    """Program (b, j): columns [j*BLOCK, (j+1)*BLOCK) of row b. Philox-4x32 keyed by the row's
    64-bit seed, counter (column, offset low 32 bits, offset high 32 bits, 0): a function of
    (seed, offset, column) only. E = -log(u), u uniform in (0, 1)."""
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(seed_ptr + b).to(tl.int64)
    offset = tl.load(offset_ptr + b).to(tl.int64)
    zero = cols.to(tl.uint32) * 0
    off_lo = zero + (offset & 0xFFFFFFFF).to(tl.uint32)
    off_hi = zero + ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32)
    bits, _, _, _ = tl.philox(seed, cols.to(tl.uint32), off_lo, off_hi, zero)
    u = tl.uint_to_uniform_float(bits)  # [0, 1 - 2^-24]
    # NOTE: u == 0 (odds 2^-31) is lifted to 2^-32, so E stays finite (<= 22.2) and > 0
    noise = -tl.log(tl.maximum(u, 2.3283064365386963e-10))
    tl.store(out_ptr + b * stride_out + cols, noise.to(out_ptr.dtype.element_ty),
             mask=cols < vocab)


def exponential_noise(seeds: Tensor, offsets: Tensor, vocab: int,
                      out_dtype: torch.dtype = torch.float32) -> Tensor:
    """Per-row Exp(1) noise [B, vocab]: row b depends only on (seeds[b], offsets[b]) (int
    tensors [B], on the device), not on b or the batch. One launch, a 2-D grid over column
    blocks; reads no device tensor on the host (safe to capture in a CUDA graph).

    NOTE: not the same stream as `exponential_noise_ref` (Philox here, torch's generator there):
    the same seed samples differently on the CPU and the GPU executors."""
    assert seeds.shape == offsets.shape and seeds.dim() == 1
    b = seeds.shape[0]
    out = torch.empty(b, vocab, dtype=out_dtype, device=seeds.device)
    if b == 0 or vocab == 0:
        return out
    grid = (b, triton.cdiv(vocab, _BLOCK))
    _exponential_noise_kernel[grid](seeds, offsets, out, vocab, out.stride(0),
                                    BLOCK=_BLOCK, num_warps=4)
    return out


