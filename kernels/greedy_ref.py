"""Greedy sampling in plain torch: the CPU executor's pick, and the reference
kernels/greedy.py's kernels are tested against."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

#: (logits, slots, token_buffer) -> each row's argmax, also written at token_buffer[slots]
GreedyPick = Callable[[Tensor, Tensor, Tensor], Tensor]


def greedy_pick_ref(logits: Tensor, slots: Tensor, token_buffer: Tensor) -> Tensor:
    """The reference: torch.argmax (in fp32), written into token_buffer[slots]."""
    ids = logits.float().argmax(dim=-1)
    token_buffer[slots] = ids.to(token_buffer.dtype)
    return ids
