"""The CUDA executor: the model with Triton kernels on its own stream, overlapped with the loop.

One step, in three threads:
- the event loop (`launch` -> `prepare`): flattens the plan into one int32 array in pinned
  memory: positions, cache slots, page tables, ... (no device work, no torch kernels);
- the launcher thread (`_enqueue`): one host-to-device copy of that array (on a copy-in
  stream, which runs ahead: step N+1's copy overlaps step N), then the whole step on
  `self.stream` (a CUDA graph replay for decode-only batches, eager kernels otherwise) and
  sampling, then a device-to-host copy of the sampled ids into pinned memory (on a copy-out
  stream) followed by an event. No copy sits between two steps' kernels on `self.stream`. It
  returns as soon as the work is queued: it never waits for the GPU (but in a step with grammar
  rows, for the previous grammar step's tokens, after queuing the forward:
  arle.executor.grammar);
- the waiter thread (`_wait`): blocks on that event (a blocking-sync event: the thread sleeps,
  no spinning) and hands the ids to the loop.
The sampled ids also go to `token_buffer[slot]` on the device, where the next step's decode rows
read their input: step N+1 is queued before the host has seen step N's tokens.

NOTE (stream order): every device-side state change (KV writes, token buffer, penalty counts)
happens in `_enqueue`, in launch order, on one stream; the copy streams only move a step's
inputs in and its outputs out, ordered against it by events. Nothing here synchronises a
stream.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from arle.executor.base import StepOutput
from arle.executor.cuda_startup import CUDAExecutorConfig, start_up
from arle.executor.distributed import TPRanks, peer_inputs, rank_memory
from arle.executor.paged import FP8_KV, PackedStep, StatePool, StepInputs
from arle.executor.plan import StepPlan
from arle.executor.sampler import (
    SampleOutput,
    SamplingBatch,
    ScoreOutput,
    logprobs_of,
    prompt_scores_of,
)
from arle.executor.step import Forward, eager_forward, run_step_body
from arle.model.decoder import DecoderLM
from arle.threads import torch_thread
from arle_kernels.ops import ops_for

__all__ = ["FP8_KV", "CUDAExecutor", "CUDAExecutorConfig"]


@dataclass
class HostStep:
    """A step ready for the launcher: its inputs and their packed array in pinned memory."""

    inputs: StepInputs
    meta: torch.Tensor  # inputs.packed.meta, pinned
    graph_bs: int  # > 0: replay the graph of this batch size (rows padded to it)
    extend_tokens: int = 0  # > 0: replay the extend graph of this many tokens

    @property
    def layout(self) -> PackedStep:
        return self.inputs.packed


class CUDAExecutor:
    """The model on one NVIDIA GPU: one step in three threads (module docstring).

    Built in two phases: the device state a step touches (streams, the token buffer, the
    penalty counts, the rotary table), then `start_up` (cuda_startup.py): the memory plan and
    the KV pool, the graphs, every kernel variant built ahead.

    Tensor parallel (`model.tp`): the model's all-reduces run inside the graphs (NCCL's
    all_reduce is capturable); the lm_head's gather to rank 0, the sampling there and the ids'
    broadcast run eagerly after them, on the stream (`sample_on_first_rank`, as on the CPU).
    NOTE: not run on GPUs yet (docs/parallel.md says what is untested)."""

    #: rank 0 of a tensor-parallel group: the other ranks (None: one GPU)
    ranks: TPRanks | None = None
    #: host-tier restores no row of their step reads run beside it (`_copy_pages`)
    overlaps_restores = True

    def __init__(self, model: DecoderLM, config: CUDAExecutorConfig) -> None:
        self.model, self.config = model, config
        self.tp = model.tp
        self.device = next(model.parameters()).device
        self.num_slots = config.num_slots
        self.num_snapshots = config.num_snapshots
        self.stream = torch.cuda.Stream(self.device)
        # NOTE: a step's copies in and out run on streams of their own, so no copy sits between
        # two steps' kernels on `self.stream` (see `_copy_in`, `_copy_out`)
        self.copy_in_stream = torch.cuda.Stream(self.device)
        self.copy_out_stream = torch.cuda.Stream(self.device)
        #: the host KV tier's restores that no row of their step reads (`_copy_pages`), and
        #: the event the next step waits for
        self.tier_stream = torch.cuda.Stream(self.device)
        self._restored: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        model.ops = ops_for(self.device)
        started = start_up(model, config, self.stream)
        self.dev = started.dev
        self.graphs, self.extend_graphs = started.graphs, started.extend_graphs
        #: the decode kernel's split count for a step of n decode rows
        self.num_splits_for = started.splits
        #: What start-up measured, for `arle warmup` and the model info.
        self.startup_info = started.report
        self.kv_pool = self.dev.pool_info()
        self._launcher = torch_thread()
        self._waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="arle-wait")

    @property
    def state(self) -> StatePool | None:
        return self.dev.state

    # ---- the event loop's thread ----------------------------------------------------------
    def launch(self, plan: StepPlan) -> Awaitable[StepOutput]:
        host = self.prepare(plan)
        if self.ranks is not None:
            queued = self._launcher.submit(self._enqueue_group, host)
        else:
            queued = self._launcher.submit(self._enqueue, host)
        return self._result(queued)

    async def _result(self, queued: concurrent.futures.Future[tuple[torch.cuda.Event, _Pending]]
                      ) -> StepOutput:
        event, pending = await asyncio.wrap_future(queued)
        return await asyncio.wrap_future(self._waiter.submit(self._wait, event, pending))

    def prepare(self, plan: StepPlan) -> HostStep:
        """Flatten the plan on the loop's thread into one pinned int32 array (`pack_step`)."""
        rows = plan.rows
        nd = plan.num_decode_rows
        graph_bs = extend_t = 0
        # NOTE: a step that scores prompt tokens runs eagerly: the graphs keep the logits of
        # the sampled positions only, and the MTP head reads every token's hidden state
        eager = plan.mtp or any(r.score_targets for r in rows)
        if self.graphs is not None and nd == len(rows) and nd <= self.graphs.max_bs \
                and not plan.mtp:
            graph_bs = self.graphs.size_for(nd)
        elif self.extend_graphs is not None and not eager:
            extend_t = self.extend_graphs.size_for(plan.num_tokens, len(rows),
                                                   sum(r.num_samples for r in rows))
        shape = self.extend_graphs.shapes[extend_t] if self.extend_graphs and extend_t else None
        inputs = StepInputs.of(plan, self.config.page_size, graph_bs, self.dev.pad_slot, shape)
        return HostStep(inputs, torch.tensor(inputs.packed.meta, dtype=torch.int32).pin_memory(),
                        graph_bs, extend_t)

    # ---- the launcher thread: queue the step, never wait -----------------------------------
    def _enqueue_group(self, h: HostStep) -> tuple[torch.cuda.Event, _Pending]:
        """Rank 0 of a TP group: the step to the other ranks, then queue it with them."""
        assert self.ranks is not None
        return self.ranks.run((peer_inputs(h.inputs), h.graph_bs, h.extend_tokens),
                              lambda: self._enqueue(h))

    def run_step(self, message: tuple[StepInputs, int, int]) -> None:
        """A TP rank > 0: queue the step rank 0 sent (`_enqueue_group`); nothing waits for
        it (the next step's collectives keep the ranks in step)."""
        inputs, graph_bs, extend_tokens = message
        meta = torch.tensor(inputs.packed.meta, dtype=torch.int32).pin_memory()
        self._enqueue(HostStep(inputs, meta, graph_bs, extend_tokens))

    def rank_info(self) -> dict[str, Any]:
        """This rank's memory plan (`arle warmup`)."""
        return {**rank_memory(self.tp, self.device, self.model, self.kv_pool.num_pages,
                              self.kv_pool.bytes,
                              self.state.nbytes if self.state is not None else 0),
                "memory_plan": self.startup_info.get("memory_plan")}

    def _enqueue(self, h: HostStep) -> tuple[torch.cuda.Event, _Pending]:
        """The step body (arle.executor.step) queued on our stream between its copy in and
        its copy out; returns the event that marks it done, never waiting for it."""
        start = torch.cuda.Event(enable_timing=True)
        with torch.inference_mode():
            meta, batch = self._copy_in(h)
            with torch.cuda.stream(self.stream):
                start.record(self.stream)
                copies = self._copy_pages(h.inputs)
                out, scored = run_step_body(self.dev, h.inputs, meta, batch,
                                            lambda: self._forward(h, meta))
            pending = _Pending(start, h.inputs.want_logprobs, copies=copies)
            event = torch.cuda.Event(enable_timing=True, blocking=True)
            pending.out, pending.scores = self._copy_out(out, scored, event)
            if scored is not None:
                pending.score_targets = h.layout.segment("score_targets")
                pending.score_rows = h.inputs.score_rows
            grammars = h.inputs.grammars if batch is not None else []
            if grammars and pending.out is not None:
                # consumed by the next grammar step's mask job, once the copy is done
                self.dev.grammar_masks.sampled(grammars, pending.out.token_ids, event.synchronize)
        return event, pending

    def _copy_pages(self, inputs: StepInputs) -> list[tuple[torch.cuda.Event, torch.cuda.Event]]:
        """The host tier's copies: the last step's restores waited for, then this step's
        offloads on our stream (its kernels may write the pages they read); its restores on
        the tier stream, beside its kernels, where no row of it reads them
        (`kv_restores_overlap`: the next step waits for them), else on ours. -> the timing
        events of the copies done by the end of this step (the tier's of the step before)."""
        done = []
        if self._restored is not None:
            self.stream.wait_event(self._restored[1])
            done.append(self._restored)
            self._restored = None
        offloads, restores = inputs.kv_offloads, inputs.kv_restores
        overlap = inputs.kv_restores_overlap and bool(restores)
        if offloads or (restores and not overlap):
            done.append(_timed(self.stream, lambda: self.dev.copy_pages(
                offloads, [] if overlap else restores)))
        if overlap:
            # NOTE: after the offloads: a restore may write a page one of them reads
            self.tier_stream.wait_stream(self.stream)
            self._restored = _timed(self.tier_stream, lambda: self.dev.copy_pages([], restores))
        return done

    def _forward(self, h: HostStep, meta: torch.Tensor) -> Forward:
        """The step's forward: a graph's replay where one fits the step, else eager."""
        if h.graph_bs:
            return Forward(self._replay(h, meta))
        if h.extend_tokens:
            return Forward(self._replay_extend(h, meta))
        return eager_forward(self.dev, h.inputs, meta, self.num_splits_for(h.layout.num_decode))

    def _copy_in(self, h: HostStep) -> tuple[torch.Tensor, SamplingBatch | None]:
        """The step's packed array (and, unless the batch takes the greedy pick, which reads
        none, its sampling parameters) onto the device, on the copy-in stream. That stream
        never waits for the model, so step N+1's copy runs while step N computes; ours waits
        for it by an event that has long passed when step N+1 starts."""
        batch = h.inputs.sampling
        with torch.cuda.stream(self.copy_in_stream):
            meta = h.meta.to(self.device, non_blocking=True)
            moved = [meta]
            if batch is not None and batch.reads_tensors:
                batch = batch.to(self.device)
                moved += batch.tensors()
        self.stream.wait_stream(self.copy_in_stream)
        for t in moved:  # NOTE: made on the copy-in stream, read on ours: no reuse before
            t.record_stream(self.stream)
        return meta, batch

    def _copy_out(self, out: SampleOutput | None, scored: ScoreOutput | None,
                  event: torch.cuda.Event) -> tuple[_Copied | None, ScoreOutput | None]:
        """The sampled ids (and logprobs, and prompt scores) into pinned memory on the
        copy-out stream, after the step's kernels; `event` marks the step done. NOTE: not on
        ours, where the copy would wait for the step and step N+1's kernels for the copy."""
        self.copy_out_stream.wait_stream(self.stream)
        with torch.cuda.stream(self.copy_out_stream):
            stream = self.copy_out_stream
            copied = _Copied.of(out, stream) if out is not None else None
            scores = None
            if scored is not None:
                logprobs = _to_host(scored.logprobs, stream)
                assert logprobs is not None
                scores = ScoreOutput(logprobs, _to_host(scored.top_ids, stream),
                                     _to_host(scored.top_logprobs, stream))
            event.record(self.copy_out_stream)
        return copied, scores

    def _replay(self, h: HostStep, meta: torch.Tensor) -> torch.Tensor:
        g = self.graphs
        assert g is not None
        g.load(h.layout, meta, h.graph_bs)
        g.graphs[h.graph_bs].replay()
        return g.logits[h.graph_bs][: h.layout.num_decode]

    def _replay_extend(self, h: HostStep, meta: torch.Tensor) -> torch.Tensor:
        g = self.extend_graphs
        assert g is not None
        g.load(h.layout, meta, h.extend_tokens)
        g.graphs[h.extend_tokens].replay()
        return g.logits[: len(h.layout.sample_rows)]

    # ---- the waiter thread -----------------------------------------------------------------
    @staticmethod
    def _wait(event: torch.cuda.Event, pending: _Pending) -> StepOutput:
        event.synchronize()  # NOTE: a blocking-sync event: the thread sleeps, the GIL is free
        exec_s = pending.start.elapsed_time(event) / 1e3
        copy_s = sum(a.elapsed_time(b) for a, b in pending.copies) / 1e3
        scores = (prompt_scores_of(pending.scores, pending.score_targets, pending.score_rows)
                  if pending.scores is not None else [])
        if pending.out is None:
            return StepOutput([], [], exec_s, scores, copy_s=copy_s)
        out = pending.out.host()
        return StepOutput(out.token_ids.tolist(), logprobs_of(out, pending.want_logprobs),
                          exec_s, scores,
                          out.drafts.tolist() if out.drafts is not None else [], copy_s)

    def close(self) -> None:
        self._launcher.submit(lambda: None).result()
        self._waiter.shutdown(wait=True)
        self.dev.grammar_masks.close()
        torch.cuda.synchronize(self.device)


@dataclass
class _Copied:
    """A sample's tensors, copied (non-blocking) into pinned host memory."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None
    drafts: torch.Tensor | None

    @classmethod
    def of(cls, out: SampleOutput, stream: torch.cuda.Stream) -> _Copied:
        """Copies queued on `stream` (the current one), which did not make `out`."""
        ids = _to_host(out.token_ids, stream)
        assert ids is not None
        return cls(ids, _to_host(out.logprobs, stream), _to_host(out.top_ids, stream),
                   _to_host(out.top_logprobs, stream), _to_host(out.drafts, stream))

    def host(self) -> SampleOutput:
        return SampleOutput(self.token_ids, self.logprobs, self.top_ids, self.top_logprobs,
                            self.drafts)


def _to_host(t: torch.Tensor | None, stream: torch.cuda.Stream) -> torch.Tensor | None:
    """A non-blocking copy of `t` into pinned memory, queued on `stream` (the current one)."""
    if t is None:
        return None
    t.record_stream(stream)  # NOTE: its memory is not reused before the copy ran
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


@dataclass
class _Pending:
    start: torch.cuda.Event  # recorded when the step's work began on the stream
    want_logprobs: list[int | None]
    out: _Copied | None = None
    #: prompt scores in pinned memory, their target ids and (positions, top N) per row
    scores: ScoreOutput | None = None
    score_targets: list[int] = field(default_factory=list)
    score_rows: list[tuple[int, int]] = field(default_factory=list)
    #: (start, end) events of host-tier copies done when this step is (`_copy_pages`)
    copies: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)


def _timed(stream: torch.cuda.Stream, work: Callable[[], None]
           ) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """work() queued on `stream` between two timing events (the second marks it done)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        work()
        end.record(stream)
    return start, end

