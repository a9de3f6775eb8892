"""A planned step, as the executor sees it: plain data, built by the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from arle.sampling import SamplingParams


@dataclass(kw_only=True)
class Row:
    """One request's part of a step (built with keywords). A decode row (`is_decode`: no
    input_ids) reads its one input token on the device, from the slot the previous step's
    sample was written to; a prefill row carries its tokens."""

    slot: int
    start: int  # position of the row's first token
    num_tokens: int
    input_ids: list[int] | None
    sample: bool  # sample from the row's last token
    sample_offset: int  # index within the request's outputs of the sampled token (seeds use it)
    pages: list[int]  # the request's page table (the executor snapshots what it needs)
    params: SamplingParams
    #: NOTE: the engine's own request object; executors never read it.
    owner: Any = None
    #: The request's grammar matcher (arle.executor.grammar) when its output is constrained.
    grammar: Any = None
    #: Prompt scoring: the row's tokens from index `score_from` on each score the prompt token
    #: after them, these ids (their logits give its logprob); None: nothing to score.
    score_targets: list[int] | None = None
    score_from: int = 0
    #: A decoding request's row with its input ids given (speculative decoding: its last
    #: token, then the drafts): it shares no page, as a decode row.
    verify: bool = False
    #: Drafts: the row's last `spec` input ids; it samples at its last spec + 1 tokens.
    spec: int = 0
    #: Hybrid models: the entry of the state pool's `spec_*` buffers where a verify row's
    #: recurrent state after each of its sampled positions is kept (-1: none).
    spec_entry: int = -1
    #: `--speculative mtp`: the drafts the MTP head chains after the row's last accepted
    #: position (0: none; its page table covers the positions they take), and the token after
    #: a prefill chunk that does not sample (the head reads it at the chunk's last position)
    mtp_drafts: int = 0
    next_id: int = -1

    @property
    def is_decode(self) -> bool:
        return self.input_ids is None

    @property
    def seq_len(self) -> int:
        return self.start + self.num_tokens

    @property
    def table_len(self) -> int:
        """Positions the row's page table covers: its own, and the MTP chain's after them."""
        return self.seq_len + max(self.mtp_drafts - 1, 0)

    @property
    def is_prefill(self) -> bool:
        """A prompt chunk (not a decoding request's row)."""
        return self.input_ids is not None and not self.verify

    @property
    def num_samples(self) -> int:
        """The tokens the row samples at."""
        return self.spec + 1 if self.sample else 0


@dataclass(frozen=True)
class NewSlot:
    """A request starts on `slot` this step: reset that slot's device state (penalty counts;
    a hybrid model's recurrent state: zeroed, or copied from snapshot `restore`)."""

    slot: int
    token_ids: list[int]  # prompt (+ outputs when recomputing after preemption)
    num_prompt: int
    params: SamplingParams
    restore: int | None = None
    #: the host tier's snapshot to restore instead (None: `restore`)
    restore_host: int | None = None


@dataclass
class StepPlan:
    step_id: int
    rows: list[Row]  # decode rows first, then prefill rows
    new_slots: list[NewSlot] = field(default_factory=list)
    #: (slot, snapshot): a hybrid model's state at the slot's last page boundary, copied into
    #: the snapshot. NOTE (order on the device): `saves_before` (requests released since the
    #: last step: their slot may be reused in this one), the new slots' starts (which may
    #: restore one of those), the rows, then `saves_after` (boundaries this step's prefill rows
    #: reached).
    saves_before: list[tuple[int, int]] = field(default_factory=list)
    saves_after: list[tuple[int, int]] = field(default_factory=list)
    #: (slot, entry, index): a hybrid model's state kept by the last verify step at its
    #: sampled position `index` (`Row.spec_entry`) back into the slot, before anything else
    state_restores: list[tuple[int, int, int]] = field(default_factory=list)
    #: the model's MTP head runs over the step's tokens (`--speculative mtp`)
    mtp: bool = False
    #: the host KV tier's page copies, before anything else: (device page, host page)
    #: offloads, then (host page, device page) restores (`CacheManager.take_copies`)
    kv_offloads: list[tuple[int, int]] = field(default_factory=list)
    kv_restores: list[tuple[int, int]] = field(default_factory=list)
    #: no row of this step reads the restored pages: their copy may run beside its kernels
    #: (the next step waits for it)
    kv_restores_overlap: bool = False
    #: (device snapshot, host snapshot): a hybrid model's state snapshots moving to the host
    #: tier, before the step's saves (which may reuse those entries)
    snapshot_offloads: list[tuple[int, int]] = field(default_factory=list)
    schedule_us: float = 0.0

    @property
    def num_decode_rows(self) -> int:
        return sum(1 for r in self.rows if r.is_decode)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)
