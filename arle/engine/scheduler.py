"""What runs next: admission, chunked prefill, decode rows, preemption.

The scheduler builds one `StepPlan` per step under a token budget: a decode row (one token) for
every running request past its prefill, then prefill chunks of running requests, then newly
admitted requests, all flattened into one batch by the executor.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

from arle.engine.cache import CacheManager
from arle.engine.sequence import Sequence, Status
from arle.executor.plan import NewSlot, Row, StepPlan


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int
    max_batched_tokens: int
    chunked_prefill_size: int
    max_waiting_requests: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheManager) -> None:
        self.config = config
        self.cache = cache
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # in admission order: the newest is preempted first
        self._step_ids = 0
        self.num_preemptions = 0

    # ---- queue ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a request out (finished or aborted) and give back what it holds."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s.wants_more_samples() for s in self.running)

    def _release(self, seq: Sequence) -> None:
        if seq.cache is not None:
            # NOTE: pages may still be read or written by a launched step. That is safe: any new
            # owner of these pages runs in a later step, which the device runs after it.
            valid = min(len(seq.tokens), seq.num_scheduled)
            self.cache.release(seq.cache, seq.tokens, valid)
            seq.cache = None

    def _preempt(self, seq: Sequence) -> None:
        """Free a running request's pages; it is recomputed later from its tokens."""
        self.running.remove(seq)
        self._release(seq)
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """The next step under the token budget: decode rows, prefill chunks of running
        requests, then admission; None when nothing can run."""
        t0 = time.perf_counter()
        budget = self.config.max_batched_tokens
        decode_rows = self._decode_rows(budget)
        budget -= len(decode_rows)
        prefill_rows = self._running_prefill_rows(budget)
        budget -= sum(r.num_tokens for r in prefill_rows)
        new_slots, admitted_rows = self._admit(budget)
        rows = decode_rows + prefill_rows + admitted_rows
        if not rows:
            return None
        saves_after = self._commit(rows)
        self._step_ids += 1
        plan = StepPlan(self._step_ids, rows, new_slots, saves_before=self.cache.take_saves(),
                        saves_after=saves_after)
        plan.schedule_us = (time.perf_counter() - t0) * 1e6
        return plan

    def _decode_rows(self, budget: int) -> list[Row]:
        """A row for each running request past its prefill, oldest first; when pages run out
        the newest running request is preempted."""
        rows: list[Row] = []
        for seq in list(self.running):
            # NOTE: a request preempted earlier in this loop is WAITING now (victims are the
            # newest, so never one that already has a row).
            if seq.status is not Status.RUNNING or seq.in_prefill or not seq.wants_more_samples():
                continue
            if len(rows) >= budget:
                break
            rc = seq.cache
            assert rc is not None
            while not self.cache.grow(rc, seq.num_scheduled + 1):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            rows.append(Row(slot=rc.slot, start=seq.num_scheduled, num_tokens=1, input_ids=None,
                            sample=True, sample_offset=seq.num_sampled, pages=rc.pages,
                            params=seq.params, owner=seq, grammar=seq.grammar))
        return rows

    def _running_prefill_rows(self, budget: int) -> list[Row]:
        """The next prefill chunk of each running request whose prompt is not done yet."""
        rows: list[Row] = []
        for seq in self.running:
            if budget < 1:
                break
            if seq.in_prefill:
                rows.append(self._prefill_row(seq, budget))
                budget -= rows[-1].num_tokens
        return rows

    def _admit(self, budget: int) -> tuple[list[NewSlot], list[Row]]:
        """Waiting requests in order (no overtaking, so no starvation) while slots, pages and
        budget last: their new slots and first prefill chunks."""
        new_slots: list[NewSlot] = []
        rows: list[Row] = []
        while (self.waiting and budget > 0
               and len(self.running) < self.config.max_running_requests):
            seq = self.waiting[0]
            if seq.num_inflight:  # preempted while a step of it runs: wait for its tokens
                break
            # Keep a page per running request spare, so admission does not starve decodes.
            # NOTE: a cached prefix has K/V but no logits: a request that scores its prompt
            # matches the cache only up to the first position it still has to score.
            rc = self.cache.admit(seq.tokens, len(seq.tokens) + 1,
                                  headroom_pages=len(self.running),
                                  max_match=seq.score_next if seq.scoring else None)
            if rc is None:
                break
            self.waiting.popleft()
            seq.cache = rc
            seq.status = Status.RUNNING
            seq.num_scheduled = len(rc.shared) * self.cache.page_size
            seq.prefill_target = len(seq.tokens)
            seq.num_sampled = seq.num_output
            if seq.matched_tokens < 0:
                seq.matched_tokens = seq.num_scheduled
                seq.state_restored = rc.restore is not None
                seq.timeline.admitted = time.perf_counter()
            self.running.append(seq)
            new_slots.append(NewSlot(rc.slot, list(seq.tokens), seq.num_prompt, seq.params,
                                     rc.restore))
            rows.append(self._prefill_row(seq, budget))
            budget -= rows[-1].num_tokens
        return new_slots, rows

    def _commit(self, rows: list[Row]) -> list[tuple[int, int]]:
        """Advance each row's request past its tokens, publish finished prompt pages, and
        return the state snapshots (slot, snapshot) the prefill rows' page boundaries take."""
        saves_after = []
        for row in rows:
            seq = row.owner
            rc = seq.cache
            seq.num_scheduled += row.num_tokens
            seq.num_inflight += 1
            seq.num_sampled += row.sample
            if rc is None:
                continue
            self.cache.reached(rc, row.start, row.num_tokens)
            if not row.is_decode:
                # Share finished prompt pages at once (their K/V is queued before any reader's),
                # and a hybrid model's state at the last page boundary the chunk reached.
                self.cache.publish(rc, seq.tokens, seq.num_scheduled)
                snapshot = self.cache.snapshot(rc, seq.tokens, seq.num_scheduled)
                if snapshot is not None:
                    saves_after.append((rc.slot, snapshot))
        return saves_after

    def _prefill_row(self, seq: Sequence, budget: int) -> Row:
        n = min(seq.prefill_target - seq.num_scheduled, self.config.chunked_prefill_size, budget)
        start = seq.num_scheduled
        assert seq.cache is not None
        done = start + n == seq.prefill_target
        row = Row(slot=seq.cache.slot, start=start, num_tokens=n,
                  input_ids=seq.tokens[start:start + n], sample=done,
                  sample_offset=seq.num_output, pages=seq.cache.pages, params=seq.params,
                  owner=seq, grammar=seq.grammar)
        if seq.scoring:
            # position p's logits score prompt token p + 1 (the last prompt position samples)
            lo, hi = max(start, seq.score_next), min(start + n, seq.num_prompt - 1)
            if hi > lo:
                row.score_targets, row.score_from = seq.tokens[lo + 1:hi + 1], lo - start
                seq.score_next = hi
        return row
