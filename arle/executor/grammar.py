"""Constrained decoding on the executor's side: the token masks of a step's grammar rows.

A grammar row is a sampling row whose request carries a matcher (an `llguidance.LLMatcher`, made
by arle.engine.grammar). Per step:
- before sampling, each grammar row's matcher writes the set of tokens it allows next into one
  row of a bitmask (int32 words, bit i of word w: token 32 * w + i), every other row allows all;
- the sampler applies the bitmask on the logits' device (`apply_token_bitmask`);
- after sampling, the row's token is consumed by its matcher, which must happen before the
  matcher's next mask is filled.

NOTE (overlap): the token of step N is consumed lazily, by the job that fills step N+1's masks,
on a thread of its own: the executor starts that job before running step N+1's forward, so the
host waits for step N's tokens and fills the masks while the device computes. Steps with no
grammar row never start a job and never wait: requests without a grammar cost nothing.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

#: (index of the row among the step's sampling rows, its matcher)
GrammarRows = Sequence[tuple[int, Any]]


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits: Tensor, bitmask: Tensor) -> Tensor:
    """`logits` [B, V] with every token the row's bitmask [B, W] (int32, on the same device)
    disallows set to -inf; a new tensor. Token ids past 32 * W (a vocabulary padded beyond the
    tokenizer's) are disallowed. Device ops only: no host sync."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)
    vocab = logits.shape[-1]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return logits.masked_fill(~allowed[:, :vocab], -math.inf)


class GrammarMasks:
    """The bitmask jobs of one executor (one per executor: its steps run in launch order)."""

    def __init__(self, vocab_size: int, pin_memory: bool = False) -> None:
        self.words = bitmask_words(vocab_size)
        self.pin_memory = pin_memory
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="arle-grammar")
        self._lock = threading.Lock()
        #: steps whose grammar rows' tokens are not consumed yet: (rows, ids on the host once
        #: `ready` returned, ready)
        self._pending: list[tuple[GrammarRows, Tensor, Callable[[], None] | None]] = []

    def start(self, rows: GrammarRows, batch_size: int) -> concurrent.futures.Future[Tensor]:
        """Start filling the bitmask [batch_size, W] of a step whose grammar rows are `rows`
        (on the host; pinned on CUDA). The earlier steps' tokens are consumed first."""
        return self._pool.submit(self._fill, rows, batch_size)

    def sampled(self, rows: GrammarRows, token_ids: Tensor,
                ready: Callable[[], None] | None = None) -> None:
        """A step's grammar rows were sampled into `token_ids` (host memory; readable once
        `ready` returns). Consumed by the next `start`'s job."""
        with self._lock:
            self._pending.append((rows, token_ids, ready))

    def _fill(self, rows: GrammarRows, batch_size: int) -> Tensor:
        self._consume_pending()
        bitmask = torch.full((batch_size, self.words), -1, dtype=torch.int32,
                             pin_memory=self.pin_memory)
        for index, matcher in rows:
            # NOTE: a matcher in error (it cannot happen while its masks are applied) leaves
            # its row unconstrained rather than failing the step.
            if not matcher.is_error():
                row = bitmask[index]
                matcher.unsafe_compute_mask_ptr(row.data_ptr(), self.words * 4)
        return bitmask

    def _consume_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for rows, token_ids, ready in pending:
            if ready is not None:
                ready()
            ids = token_ids.tolist()
            for index, matcher in rows:
                # NOTE: a stopped matcher belongs to a request that ended one step earlier (the
                # row of the overlapped step): its token is dropped by the engine too.
                if not matcher.is_stopped() and not matcher.is_error():
                    matcher.consume_token(ids[index])

    def close(self) -> None:
        self._pool.shutdown(wait=True)
