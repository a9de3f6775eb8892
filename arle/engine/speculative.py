"""Speculative decoding's host side: n-gram drafts (prompt lookup) from a request's own
tokens, and the rule that decides when a request drafts (docs/speculative.md).

A request drafts only when all its tokens are known on the host (no step of it in flight):
its verify row carries its last token and the drafts as input ids. The forward samples at
each of the row's last K + 1 positions exactly as a decode step would (the same parameters,
the output offset of that position: a seeded request draws the same noise). The request
keeps the drafts that equal the sample before them, and the first sample that differs (or the
one after the last draft): `accepted`.

NOTE (exactness): an n-gram draft is one token for certain (q = a point mass), and then this is
the rejection sampling of Leviathan et al.: the sample at a position equals the draft with
probability p(draft), and when it does not, it is a draw from p without the draft,
renormalised. The output distribution is the target's exactly; greedy rows keep the argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from arle.config import EngineConfig


@dataclass(frozen=True)
class SpecConfig:
    """The drafting rule; `DEVICE_RULES` holds each device's (docs/speculative.md)."""

    #: most drafts per verify row (--num-speculative-tokens; the device's when not given)
    num_tokens: int = 4
    #: what a verify row of k drafts costs beyond a decode row, in decode steps:
    #: verify_cost + draft_cost * k; it pays when it keeps more drafts than that on average
    verify_cost: float = 0.0
    draft_cost: float = 0.125
    #: a step's tokens (decode rows + drafts) up to which drafts are added
    step_tokens: int = 72
    #: n-gram lengths looked up, longest first
    min_n: int = 2
    max_n: int = 4
    #: most verify rows in one step (a hybrid model keeps K + 1 recurrent states for each)
    max_rows: int = 8
    #: output tokens a request stops drafting for when its drafts stop paying (doubled each
    #: time it happens again, up to 64)
    backoff: int = 8
    #: a verify row's tokens (its last token and the drafts) come in whole blocks of this many
    #: once it has one (fewer drafts, never more): each block costs a read of the weights
    row_block: int = 1


#: CPU: scripts/bench_speculative.py on the default model (int4 weights), 2 cores: a verify
#: step with 8 drafts costs 2.84x a decode step at batch 1 (0.23 of a step per draft; its
#: tokens get their decode rows' attention bits, so that it stays exact; the figures are of
#: 48-token chats, where they attend token by token: past 64 keys they share one q K^T and one
#: softmax, and cost less, `attend_run`). A step past 48 tokens
#: leaves the packed int4 kernels for the bf16 expansion (arle_kernels.quant,
#: PACKED_MAX_ROWS): at batch 8 with 8 drafts each (72 tokens) 5.1x, so drafts stop at 48.
#: The packed matmuls take rows 4 at a time, each 4 a read of the weights: 3 drafts cost 1.51x
#: a decode step, 4 1.87x, 7 2.29x, 8 2.83x: a row's tokens come in blocks of 4 (7 drafts where
#: 8 are asked: edit 1.60x speculation off, quote 2.20x, chat 1.77x, where 8 drafts gave 1.50x,
#: 2.08x, 1.59x; a shorter row after a rejection measured slower on the edit task). A wrong
#: row costs that much, so a draft needs a 3-token match (edit 1.72x against 1.58x with 2,
#: quote 2.05x against 2.18x, chat 1.78x against 1.74x; bench_speculative.py, rounds 3).
#: CUDA: the same bench on an H100, random Qwen3-4B, graphs: a verify step of 1-4 drafts
#: costs 1.19-1.20x a decode step at batch 1 (1.08-1.22x at batch 8), almost all of it fixed
#: (the extend step's launches); the hybrid Qwen3.5-4B 1.94-2.06x at batch 1 (its verify rows
#: keep a recurrent state per position): HYBRID_RULES. Random Qwen3-30B-A3B-FP8 (commit 0aa3fc0):
#: 3.02-3.03x at batch 1 for K = 1-4 (1.5-2.2x at batch 8): its verify steps replay a 32-token
#: extend graph, the smallest, whose padding rows route to experts too, and each real token
#: reads its own 8 experts: MOE_RULES.
DEVICE_RULES = {"cpu": SpecConfig(num_tokens=8, draft_cost=0.23, step_tokens=48,
                                  row_block=4, min_n=3),
                "cuda": SpecConfig(num_tokens=4, verify_cost=0.19, draft_cost=0.01,
                                   step_tokens=64)}
#: (verify_cost, draft_cost) of a hybrid model, by device
HYBRID_RULES = {"cuda": (0.90, 0.04)}
#: (verify_cost, draft_cost) of a mixture-of-experts model, by device
MOE_RULES = {"cuda": (2.0, 0.01)}


def spec_config(config: EngineConfig, hybrid: bool = False, moe: bool = False
                ) -> SpecConfig | None:
    """The drafting rule of an engine config (its device filled in) and model (hybrid: Gated
    DeltaNet layers; moe: expert MLPs; both: the costlier rule); None: speculation off."""
    if config.speculative == "off":
        return None
    rule = DEVICE_RULES.get(config.device, DEVICE_RULES["cpu"])
    costs = [rules[config.device] for kind, rules in ((hybrid, HYBRID_RULES), (moe, MOE_RULES))
             if kind and config.device in rules]
    if costs:
        verify_cost, draft_cost = max(costs)
        rule = replace(rule, verify_cost=verify_cost, draft_cost=draft_cost)
    return replace(rule, num_tokens=config.num_speculative_tokens or rule.num_tokens)


class NgramIndex:
    """A request's tokens as an int32 array, grown with them (`update` copies only the new
    ones), searched for earlier occurrences of their last n tokens. NOTE: a search, not a
    table: 4 bytes a token and a few vectorised compares a step (tens of microseconds at 32k
    tokens), where a table of every n-gram took 12 MiB and 0.4 s of the event loop to build
    for a 32k-token prompt."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._tokens = np.empty(256, dtype=np.int32)
        self._size = 0
        #: (tokens searched, where the continuation starts; -1: none): one search per length,
        #: however often the engine asks (it asks before and at each step)
        self._found = (-1, -1)

    def update(self, tokens: Sequence[int]) -> None:
        """Append the tokens past the ones it has (the list only grows)."""
        n = len(tokens)
        if n > self._tokens.shape[0]:
            grown = np.empty(max(n, 2 * self._tokens.shape[0]), dtype=np.int32)
            grown[:self._size] = self._tokens[:self._size]
            self._tokens = grown
        self._tokens[self._size:n] = tokens[self._size:n]
        self._size = n

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
        `tokens` (max_n down to min_n tokens) seen before; [] if none was."""
        self.update(tokens)
        end = self._size
        if self._found[0] != end:
            self._found = (end, self._search())
        j = self._found[1]
        return self._tokens[j:min(j + k, end)].tolist() if j >= 0 else []

    def _search(self) -> int:
        """Where the continuation of the latest earlier occurrence of the longest suffix
        starts (-1: no suffix of min_n tokens or more occurred before)."""
        a, end = self._tokens, self._size
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            suffix = a[end - n:end]
            # NOTE: starts j < end - n: occurrences that end before the suffix does
            starts = np.flatnonzero(a[:end - n] == suffix[0])
            for i in range(1, n):
                starts = starts[a[starts + i] == suffix[i]]
            if starts.size:
                return int(starts[-1]) + n
        return -1


@dataclass
class RequestSpec:
    """One request's drafting: its n-gram index, what it drafted and kept (the trace's `spec`
    block), and the step-aside state."""

    index: NgramIndex
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    #: mean accepted drafts per verify step, recent steps weighted most (None: no verify yet)
    recent: float | None = None
    #: no drafts until the request has this many output tokens
    resume_at: int = 0
    backoff: int = 0
    #: `--speculative mtp`: the MTP head's drafts from the request's last step (valid for
    #: its next step only)
    next_drafts: list[int] = field(default_factory=list)

    def trace(self) -> dict[str, int]:
        return {"drafted": self.drafted, "accepted": self.accepted,
                "verify_steps": self.verify_steps}


class Drafter:
    """Drafts for the scheduler's verify rows (n-gram lookup); learns from each verify step's
    result."""

    #: the model's MTP head runs over every step (`MTPDrafter`)
    chains = False

    def __init__(self, config: SpecConfig) -> None:
        self.config = config

    def start(self) -> RequestSpec:
        return RequestSpec(NgramIndex(self.config.min_n, self.config.max_n))

    def propose(self, spec: RequestSpec, tokens: Sequence[int], num_output: int,
                room: int) -> list[int]:
        """The drafts of the request's next verify row (at most `room`); [] while it steps
        aside."""
        k = whole_blocks(min(self.config.num_tokens, room), self.config.row_block)
        if k < 1 or num_output < spec.resume_at:
            return []
        return self.lookup(spec, tokens, num_output, k)

    def lookup(self, spec: RequestSpec, tokens: Sequence[int], num_output: int,
               k: int) -> list[int]:
        """Up to k drafts after `tokens` (the prompt, then `num_output` outputs)."""
        return spec.index.propose(tokens, k)

    def would_draft(self, spec: RequestSpec, tokens: Sequence[int], num_output: int) -> bool:
        """Whether the request is likely to draft at its next step (its tokens so far)."""
        return bool(self.propose(spec, tokens, num_output, 1))

    def verified(self, spec: RequestSpec, drafts: int, accepted: int, num_output: int) -> None:
        """A verify row kept `accepted` of its `drafts`: count them, and step aside when the
        recent mean falls below what the drafts cost (`draft_cost` each)."""
        c = self.config
        spec.drafted += drafts
        spec.accepted += accepted
        spec.verify_steps += 1
        # NOTE: a request starts from the best case: its first rejection alone does not send
        # it aside
        before = c.num_tokens if spec.recent is None else spec.recent
        spec.recent = 0.5 * before + 0.5 * accepted
        if spec.recent < c.verify_cost + c.draft_cost * drafts:
            spec.backoff = min(2 * spec.backoff or c.backoff, 64)
            spec.resume_at = num_output + spec.backoff
            spec.recent = None


class MTPDrafter(Drafter):
    """Drafts from the model's multi-token prediction head: each step of a drafting request
    chains `num_tokens` of them on the device after its last accepted token (arle.executor.
    step.mtp_drafts), which its next verify row checks."""

    #: the head runs over every step, and each drafting row chains this many drafts
    chains = True

    def lookup(self, spec: RequestSpec, tokens: Sequence[int], num_output: int,
               k: int) -> list[int]:
        drafts, spec.next_drafts = spec.next_drafts[:k], []  # NOTE: good for one step
        return drafts

    def would_draft(self, spec: RequestSpec, tokens: Sequence[int], num_output: int) -> bool:
        return num_output >= spec.resume_at  # its step in flight brings new drafts


def make_drafter(config: EngineConfig, hybrid: bool = False, moe: bool = False
                 ) -> Drafter | None:
    """The drafter of an engine config (its device filled in); None: speculation off."""
    spec = spec_config(config, hybrid, moe)
    if spec is None:
        return None
    return MTPDrafter(spec) if config.speculative == "mtp" else Drafter(spec)


def whole_blocks(k: int, block: int) -> int:
    """The most drafts, at most k, whose row (its last token and the drafts) is whole blocks
    of `block` tokens; k where the row is shorter than one block."""
    return k if k + 1 < block else (k + 1) // block * block - 1


def accepted_drafts(drafts: Sequence[int], sampled: Sequence[int]) -> int:
    """How many drafts a verify row keeps: the leading ones equal to the sample at the
    position before them (sampled[i] is the sample after the row's last token and i drafts)."""
    n = 0
    while n < len(drafts) and sampled[n] == drafts[n]:
        n += 1
    return n
