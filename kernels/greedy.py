"""Greedy sampling on the GPU: each row's argmax, written where the next step reads it.

`greedy_pick(logits, slots, token_buffer)` returns the argmax of each row of `logits` [B, V]
(int64, as `torch.argmax`: the first maximal index; a NaN counts as the maximum, the first NaN
wins) and writes it, as int32, into `token_buffer[slots[row]]` (the decode rows' input of the
next step). Two small kernels, no host sync:

- `_argmax_chunks_kernel`, grid (B, S): program (r, s) takes chunk s of row r (`chunk` logits),
  BLOCK at a time; each lane keeps the first maximum it sees, then the lanes' maxima reduce to
  the chunk's (value, first index) and its first NaN. S is sized from B so that the grid fills
  the SMs: a step's logits (B x 151936) are read by hundreds of programs, not B; and a chunk is
  at most `_MAX_STEPS` loop steps, since the steps' loads wait one after the other (at 8 rows
  a program took 5 steps, and the kernel 6.8 us for 2.4 MB; H200).
- `_argmax_finish_kernel`, grid (B,): the row's S partials in chunk order: the first NaN if any,
  else the largest value's first index.

Why: torch's argmax + cast + index write are three launches (and the logits had first been
upcast to fp32 by a fourth); on the H200 at 8 rows that was ~20 us of a 3 ms decode step
(`scripts/profile_step.py`). This reads the logits in their own dtype (bf16 -> fp32 is exact and
keeps the order, so the pick is the same).

NOTE: the grid and the partials' size depend only on host ints (B, V): safe in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from arle_kernels.jit import jit_varying

#: "no index" in the partials (larger than any index: a vocabulary is smaller)
_NONE = tl.constexpr(2**31 - 1)
#: logits a program reads per loop step (4 warps x 32 lanes x 8)
_BLOCK = 1024
#: programs the first pass aims for at least (~2 per SM of an H200; any count is correct)
_TARGET_PROGRAMS = 256
#: loop steps a first-pass program takes at most (more rows: more programs, not longer ones)
_MAX_STEPS = 2


# NOTE: the sizes change with the batch and are not specialised (see jit_varying): one variant
# per logits dtype, built at warm-up (a mid-serving compile stalls every request)
@jit_varying("stride_row", "V", "S", "chunk")
def _argmax_chunks_kernel(logits_ptr, stride_row, V, val_ptr, idx_ptr, nan_ptr, S, chunk,
                          BLOCK: tl.constexpr):
    """Chunk s of row r: its largest value, that value's first index, and its first NaN index
    (_NONE when none) into the partials [B, S]."""
    r = tl.program_id(0)
    s = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    row = logits_ptr + r.to(tl.int64) * stride_row
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], _NONE, tl.int32)
    nan_i = tl.full([BLOCK], _NONE, tl.int32)
    lo = s * chunk
    for k in range(0, chunk, BLOCK):
        idx = lo + k + offs
        valid = idx < V
        v = tl.load(row + idx, mask=valid, other=float("-inf")).to(tl.float32)
        is_nan = v != v
        nan_i = tl.minimum(nan_i, tl.where(valid & is_nan, idx, _NONE))
        # NOTE: a lane sees increasing indices: strictly greater keeps its first maximum, and its
        # first valid element is taken whatever it is (a row of -inf has argmax 0)
        take = valid & ~is_nan & ((v > best_v) | (best_i == _NONE))
        best_v = tl.where(take, v, best_v)
        best_i = tl.where(take, idx, best_i)
    m = tl.max(best_v, 0)
    first = tl.min(tl.where((best_v == m) & (best_i < _NONE), best_i, _NONE), 0)
    tl.store(val_ptr + r * S + s, m)
    tl.store(idx_ptr + r * S + s, first)
    tl.store(nan_ptr + r * S + s, tl.min(nan_i, 0))


@jit_varying("S", "slots_ptr")
def _argmax_finish_kernel(val_ptr, idx_ptr, nan_ptr, S, slots_ptr, token_buffer_ptr, out_ptr,
                          S_PAD: tl.constexpr):
    """Row r's S partials, in chunk order, to its argmax: into out[r] and
    token_buffer[slots[r]]."""
    r = tl.program_id(0)
    offs = tl.arange(0, S_PAD)
    live = offs < S
    v = tl.load(val_ptr + r * S + offs, mask=live, other=float("-inf"))
    i = tl.load(idx_ptr + r * S + offs, mask=live, other=_NONE)
    n = tl.load(nan_ptr + r * S + offs, mask=live, other=_NONE)
    first_nan = tl.min(n, 0)
    m = tl.max(v, 0)
    pick = tl.min(tl.where((v == m) & (i < _NONE), i, _NONE), 0)
    pick = tl.where(first_nan < _NONE, first_nan, pick)
    tl.store(out_ptr + r, pick.to(tl.int64))
    slot = tl.load(slots_ptr + r)
    tl.store(token_buffer_ptr + slot, pick.to(token_buffer_ptr.dtype.element_ty))


def _chunk(rows: int, vocab: int, block: int = _BLOCK) -> int:
    """Logits per first-pass program: a multiple of BLOCK, about TARGET_PROGRAMS programs
    in all, or more where a program would take over `_MAX_STEPS` steps."""
    per_row = -(-_TARGET_PROGRAMS // max(rows, 1))
    per_program = -(-vocab // per_row)
    return min(-(-per_program // block), _MAX_STEPS) * block


def greedy_pick(logits: Tensor, slots: Tensor, token_buffer: Tensor, *,
                block: int = _BLOCK) -> Tensor:
    """argmax of each row of logits [B, V] (any float dtype, last dim contiguous) as int64 [B];
    also written into token_buffer[slots] (int32 [B] slots into an int32 buffer). block: the
    first pass's logits per loop step (tests pass small ones)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and slots.shape == (rows,) and slots.dtype == torch.int32
    assert slots.is_contiguous()
    assert token_buffer.dtype == torch.int32 and vocab < _NONE.value
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    chunk = _chunk(rows, vocab, block)
    s = -(-vocab // chunk)
    val = torch.empty(rows, s, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, s, dtype=torch.int32, device=logits.device)
    nan = torch.empty(rows, s, dtype=torch.int32, device=logits.device)
    _argmax_chunks_kernel[(rows, s)](logits, logits.stride(0), vocab, val, idx, nan, s, chunk,
                                     BLOCK=block, num_warps=4)
    # NOTE: S_PAD bounds a row's chunks at any batch (chunks of one block): one variant
    _argmax_finish_kernel[(rows,)](val, idx, nan, s, slots, token_buffer, out,
                                   S_PAD=triton.next_power_of_2(-(-vocab // block)),
                                   num_warps=4)
    return out


__all__ = ["greedy_pick"]
