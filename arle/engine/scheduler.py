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
from arle.engine.speculative import Drafter
from arle.executor.plan import NewSlot, Row, StepPlan


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int
    max_batched_tokens: int
    chunked_prefill_size: int
    max_waiting_requests: int
    #: the executor copies host-tier pages back beside the step that plans them (CUDA: on a
    #: stream of its own): a request whose prefix comes back from the host then waits one step
    #: for its pages, where the step has other rows, and that step does not wait for the copy
    overlap_restores: bool = False


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheManager,
                 drafter: Drafter | None = None) -> None:
        self.config = config
        self.cache = cache
        #: speculative decoding's drafts (None: off)
        self.drafter = drafter
        #: (slot, entry, index) a verify step kept, owed to the next step (`verified`)
        self._restores: dict[Sequence, tuple[int, int, int]] = {}
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
        self._restores.pop(seq, None)
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
        others = bool(decode_rows or prefill_rows)
        new_slots, admitted_rows, deferred = self._admit(budget, others)
        rows = decode_rows + prefill_rows + admitted_rows
        if not rows:
            return None
        saves_after = self._commit(rows)
        self._step_ids += 1
        offloads, restores, snapshot_offloads = self.cache.take_copies()
        plan = StepPlan(self._step_ids, rows, new_slots, saves_before=self.cache.take_saves(),
                        saves_after=saves_after, state_restores=list(self._restores.values()),
                        mtp=self.drafter is not None and self.drafter.chains,
                        kv_offloads=offloads, kv_restores=restores,
                        snapshot_offloads=snapshot_offloads,
                        kv_restores_overlap=deferred)
        self._restores.clear()
        plan.schedule_us = (time.perf_counter() - t0) * 1e6
        return plan

    def _decode_rows(self, budget: int) -> list[Row]:
        """A row for each running request past its prefill, oldest first (with drafts to
        verify, where it has them); when pages run out the newest running request is
        preempted."""
        rows: list[Row] = []
        tokens = verifies = 0
        ready = [s for s in self.running if not s.in_prefill and s.wants_more_samples()]
        room = self.drafter.config.step_tokens - len(ready) if self.drafter else 0
        for seq in ready:
            # NOTE: a request preempted earlier in this loop is WAITING now (victims are the
            # newest, so never one that already has a row)
            if seq.status is not Status.RUNNING or seq.verifying:
                continue  # verifying: its next input is not known until its step is back
            if tokens >= budget:
                break
            if not self._grow(seq):
                continue
            drafts = self._drafts(seq, min(room, budget - tokens - 1), verifies)
            rows.append(self._decode_row(seq, drafts, verifies))
            tokens += rows[-1].num_tokens
            room -= len(drafts)
            verifies += bool(drafts)
        # NOTE: a step's decode rows come first (`StepPlan.rows`); verify rows are extend rows
        return [r for r in rows if r.is_decode] + [r for r in rows if not r.is_decode]

    def _grow(self, seq: Sequence) -> bool:
        """Pages for the request's next token, preempting the newest requests until they
        fit; False if the request itself was preempted."""
        rc = seq.cache
        assert rc is not None
        while not self.cache.grow(rc, seq.num_scheduled + 1):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _drafts(self, seq: Sequence, room: int, verifies: int) -> list[int]:
        """The drafts the request verifies in its next row (at most `room`; [] where it does
        not draft, or the step has its most verify rows), the pages for them taken."""
        if (self.drafter is None or seq.spec is None or seq.num_inflight
                or verifies >= self.drafter.config.max_rows):
            return []
        room = min(room, seq.sample_limit - seq.num_sampled - 1)
        drafts = self.drafter.propose(seq.spec, seq.tokens, seq.num_output, room)
        assert seq.cache is not None
        if drafts and not self.cache.grow(seq.cache, seq.num_scheduled + 1 + len(drafts)):
            return []
        return drafts

    def _decode_row(self, seq: Sequence, drafts: list[int], entry: int) -> Row:
        """A decode row (its input on the device), or, with drafts or after a verify step, a
        verify row: its input id and the drafts (a hybrid model keeps its states at `entry`)."""
        rc = seq.cache
        assert rc is not None
        row = Row(slot=rc.slot, start=seq.num_scheduled, num_tokens=1, input_ids=None,
                  sample=True, sample_offset=seq.num_sampled, pages=rc.pages, params=seq.params,
                  owner=seq, grammar=seq.grammar)
        if drafts or seq.needs_input:
            # NOTE: no step of the request is in flight: its last token is the one past its
            # scheduled positions
            assert len(seq.tokens) == seq.num_scheduled + 1
            row.input_ids = [seq.tokens[-1], *drafts]
            row.num_tokens, row.verify, row.spec = len(row.input_ids), True, len(drafts)
            if drafts and self.cache.hybrid:
                row.spec_entry = entry
        self._chain(seq, row)
        return row

    def _chain(self, seq: Sequence, row: Row) -> None:
        """`--speculative mtp`: a drafting request's sampling row chains the MTP head's drafts
        after it, where the pages for their positions can be had."""
        d = self.drafter
        if d is None or not d.chains or seq.spec is None:
            return
        assert seq.cache is not None
        row.mtp_drafts = d.config.num_tokens
        if not self.cache.grow(seq.cache, row.table_len):
            row.mtp_drafts = 0

    def wants_step_back(self) -> bool:
        """Whether a request would draft once its step in flight is back (the engine then
        waits for it before the next step: drafts need the request's last token)."""
        d = self.drafter
        if d is None:
            return False
        if any(s.verifying for s in self.running):
            return True
        if len(self.running) >= d.config.step_tokens:
            return False  # NOTE: no step has room for drafts: keep the overlap
        return any(s.spec is not None and s.num_inflight and not s.in_prefill
                   and d.would_draft(s.spec, s.tokens, s.num_output) for s in self.running)

    def verified(self, seq: Sequence, row: Row, accepted: int) -> None:
        """A verify row kept its first `accepted` drafts: the drafter learns it, and the
        positions past them go back (their pages, the samples counted; a hybrid model's state
        comes back, in the next step, from where the step kept it)."""
        assert self.drafter is not None and seq.spec is not None
        self.drafter.verified(seq.spec, row.spec, accepted, seq.num_output + accepted + 1)
        seq.verifying = False
        seq.num_sampled -= row.spec - accepted
        rc = seq.cache
        if rc is None or seq.status is not Status.RUNNING:
            return  # preempted meanwhile: recomputed from its tokens
        seq.needs_input = True
        end = row.seq_len - row.spec + accepted  # positions before it hold accepted K/V
        seq.num_scheduled = end
        self.cache.shrink(rc, end + 1)
        if rc.boundary > end:  # its state there saw a rejected draft: take no snapshot of it
            rc.boundary = rc.saved
        if row.spec_entry >= 0 and accepted < row.spec:
            self._restores[seq] = (rc.slot, row.spec_entry, accepted)

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

    def _admit(self, budget: int, others: bool) -> tuple[list[NewSlot], list[Row], bool]:
        """Waiting requests in order (no overtaking, so no starvation) while slots, pages and
        budget last: their new slots and first prefill chunks (`others`: the step has rows
        already). -> also whether every request whose pages come back from the host tier
        waits for the next step (`overlap_restores`), so none of this step's rows reads them."""
        new_slots: list[NewSlot] = []
        rows: list[Row] = []
        deferred = True
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
            seq.needs_input = False  # the prefill's sample goes to the token buffer
            if seq.matched_tokens < 0:
                seq.matched_tokens = seq.num_scheduled
                seq.host_hit_tokens = rc.restored * self.cache.page_size
                seq.state_restored = rc.restore is not None or rc.restore_host is not None
                seq.timeline.admitted = time.perf_counter()
            self.running.append(seq)
            new_slots.append(NewSlot(rc.slot, list(seq.tokens), seq.num_prompt, seq.params,
                                     rc.restore, rc.restore_host))
            if rc.restored and self.config.overlap_restores and (others or rows):
                continue  # its first chunk goes next step (`_running_prefill_rows`)
            deferred = deferred and not rc.restored
            rows.append(self._prefill_row(seq, budget))
            budget -= rows[-1].num_tokens
        return new_slots, rows, deferred

    def _commit(self, rows: list[Row]) -> list[tuple[int, int]]:
        """Advance each row's request past its tokens, publish finished prompt pages, and
        return the state snapshots (slot, snapshot) the prefill rows' page boundaries take."""
        saves_after = []
        for row in rows:
            seq = row.owner
            rc = seq.cache
            seq.num_scheduled += row.num_tokens
            seq.num_inflight += 1
            seq.num_sampled += row.num_samples
            if row.verify:
                seq.verifying, seq.needs_input = row.spec > 0, False
            if rc is None:
                continue
            self.cache.reached(rc, row.start, row.num_tokens)
            if row.is_prefill:
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
                  owner=seq, grammar=seq.grammar,
                  next_id=-1 if done else seq.tokens[start + n])
        if done:
            self._chain(seq, row)
        if seq.scoring:
            # position p's logits score prompt token p + 1 (the last prompt position samples)
            lo, hi = max(start, seq.score_next), min(start + n, seq.num_prompt - 1)
            if hi > lo:
                row.score_targets, row.score_from = seq.tokens[lo + 1:hi + 1], lo - start
                seq.score_next = hi
        return row
