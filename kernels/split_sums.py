"""A linear layer's output left unreduced: split-K partial sums that the next kernel adds up.

At 3-32 rows the GEMV splits K over programs to give every SM work (o_proj and down in four,
qkv in two), and the partial sums must be added before anyone reads y. A separate reduce kernel
costs a launch and ~1.5 us of a decode step's critical path per linear layer. Instead, with
`gemv_split_sums` (kernels/gemv.py) the programs of splits 2s and 2s + 1 (of an odd count, the
last split alone) add their fp32 tiles into slot s of a buffer that holds zeros, and the kernel
that reads y next (`add_rms_norm`, `qk_norm_rope_store_kv`, kernels/fused.py) sums the slots
itself, in slot order, rounds the sum to the model dtype as the reduce would, and writes the
zeros back.

- Deterministic: a slot takes at most two adds onto zero, and 0 + a + b == 0 + b + a in fp32,
  whichever program arrives first. Slots are summed in a fixed order.
- One buffer per (device, slots, N), MAX_ROWS rows, allocated zeroed on first use (an eager
  warm-up run, before any CUDA-graph capture) and kept: graphs replay into the same memory.
- NOTE: the invariant: between uses a buffer holds zeros. One result per (slots, N) is
  pending at a time (its consumer runs before the next producer of that shape: true of a
  decoder layer's o_proj -> norm -> ... -> down -> norm). A producer that finds its buffer
  still pending (a step that failed between the two) zeroes it first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

#: rows a slot buffer holds: the most the GEMV takes (kernels/gemv.py's MAX_M is this)
MAX_ROWS = 32

_BUFFERS: dict[tuple[torch.device, int, int], Tensor] = {}
_PENDING: set[tuple[torch.device, int, int]] = set()


@dataclass(frozen=True)
class SplitSums:
    """y [M, N] as fp32 partial sums: `slots` [S, M, N] (a view of a kept buffer); y is their
    sum over S in order, rounded to `dtype`. Read it once, through a consumer that zeroes it."""

    slots: Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.slots.shape[1:]


def slot_buffer(device: torch.device, slots: int, rows: int, n: int) -> Tensor:
    """The zeroed slots [slots, rows, n] for a producer to add into (see the module's NOTE)."""
    assert 1 <= rows <= MAX_ROWS, f"split sums hold up to {MAX_ROWS} rows, not {rows}"
    key = (device, slots, n)
    buf = _BUFFERS.get(key)
    if buf is None:
        assert device.type != "cuda" or not torch.cuda.is_current_stream_capturing(), (
            "split-sum buffers are made by an eager run before CUDA-graph capture")
        buf = _BUFFERS[key] = torch.zeros(slots, MAX_ROWS, n, dtype=torch.float32, device=device)
    elif key in _PENDING:
        buf.zero_()  # left by a step that failed before its consumer ran
    _PENDING.add(key)
    return buf[:, :rows]


def consumed(sums: SplitSums) -> None:
    """Mark sums read (its consumer's launch zeroes them on the device)."""
    _PENDING.discard((sums.slots.device, sums.slots.shape[0], sums.slots.shape[2]))


def take(x: Tensor | SplitSums) -> Tensor:
    """The reference consumer: y in its dtype (slots summed in order, then rounded), the slots
    left zero. A plain tensor is returned as it is."""
    if isinstance(x, Tensor):
        return x
    total = x.slots[0].clone()
    for s in range(1, x.slots.shape[0]):
        total += x.slots[s]
    x.slots.zero_()
    consumed(x)
    return total.to(x.dtype)


__all__ = ["MAX_ROWS", "SplitSums", "consumed", "slot_buffer", "take"]
