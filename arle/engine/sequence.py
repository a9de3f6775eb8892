"""The engine's per-request state (the caller's view is arle.engine.request)."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import Any

from arle.engine.cache import RequestCache
from arle.engine.request import Delta, FinishReason, SamplingParams, TokenLogprob
from arle.engine.speculative import RequestSpec


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Timeline:
    """Wall-clock marks (time.perf_counter) the engine takes anyway; the trace is built from them."""

    created: float = field(default_factory=time.perf_counter)
    tokenized: float = 0.0
    admitted: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0
    tokenize_us: float = 0.0
    queue_depth: int = 0
    # step phase time attributed to this request, in microseconds
    admission_us: float = 0.0
    prefill_us: float = 0.0
    decode_us: float = 0.0
    emit_us: float = 0.0
    # what this request's steps held
    prefill_tokens: int = 0
    decode_tokens: int = 0
    batch_width: int = 0  # widest step (rows) this request was part of


@dataclass(eq=False)
class Sequence:
    """One request inside the engine.

    Token accounting (NOTE: the CPU learns a sampled token one step after it is scheduled):
      - `tokens`: prompt + outputs the CPU knows.
      - `num_scheduled`: positions whose K/V is computed or queued on the device.
      - `num_inflight`: launched steps not yet processed that include this request.
      - `num_sampled`: sampling events scheduled (outputs known + in flight).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_total_tokens: int  # prompt + outputs may not exceed it (context length)
    eos_ids: frozenset[int]
    route: str = "engine"
    stream: bool = True
    prompt_bytes: int = 0
    queue: asyncio.Queue[Delta | BaseException] = field(default_factory=asyncio.Queue)

    status: Status = Status.WAITING
    tokens: list[int] = field(default_factory=list)
    num_scheduled: int = 0
    num_inflight: int = 0
    num_sampled: int = 0
    #: length of the sequence the current (re)admission must prefill before decoding.
    prefill_target: int = 0
    cache: RequestCache | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    matched_tokens: int = -1  # prefix-cache hit at first admission (-1: not admitted yet)
    #: a hybrid model's first admission started from a cached state snapshot
    state_restored: bool = False
    #: of `matched_tokens`, those whose pages came back from the host KV tier
    host_hit_tokens: int = 0
    num_preemptions: int = 0
    timeline: Timeline = field(default_factory=Timeline)
    #: output processing state (detokenizer, stop matcher), owned by the engine
    output_state: Any = None
    #: the grammar matcher of a constrained request (arle.engine.grammar); the executor
    #: advances it, in step order
    grammar: Any = None
    #: prompt scoring (`params.prompt_logprobs`): the next position whose logits are to score
    #: the token after it (positions before it are scored or scheduled to be), and the scores
    #: of prompt tokens 1.. known so far; handed out with the first delta (`None` after).
    score_next: int = 0
    prompt_scores: list[TokenLogprob] | None = None
    #: speculative decoding (arle.engine.speculative): the request's drafting (None: it never
    #: drafts); a verify row of it is in flight (its next input is not known yet); its next
    #: row carries its input id (after a verify step the device's token buffer may not).
    spec: RequestSpec | None = None
    verifying: bool = False
    needs_input: bool = False

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt_ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_scores = []

    @property
    def scoring(self) -> bool:
        """Prompt positions are still to be scored (their logits must be computed, not
        taken from the prefix cache, which keeps K/V only)."""
        return self.prompt_scores is not None and self.score_next < self.num_prompt - 1

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def in_prefill(self) -> bool:
        return self.num_scheduled < self.prefill_target

    @property
    def sample_limit(self) -> int:
        """The most output tokens the request may have (max_tokens, the context)."""
        return min(self.params.max_tokens, self.max_total_tokens - self.num_prompt)

    def wants_more_samples(self) -> bool:
        """Whether scheduling another sampling step can still produce a token we keep."""
        return not self.finished and self.num_sampled < self.sample_limit
