"""The CPU executor: the model with the kernels' torch references, one worker thread.

The same path as the CUDA executor's eager steps: `launch` flattens the plan with `pack_step`
on the caller's thread and returns an awaitable at once; the step runs on a single worker
thread (the CPU's "stream": steps run in launch order), so the event loop schedules step N+1
while step N computes. Sampled ids go to a per-slot token buffer that the decode rows of the
next step read, so no step waits for the host to learn the previous step's tokens.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

import torch

from arle.executor.base import StepOutput
from arle.executor.distributed import TPRanks, peer_inputs, rank_memory
from arle.executor.paged import KVCache, StatePool, StepInputs
from arle.executor.plan import StepPlan
from arle.executor.sampler import logprobs_of, prompt_scores_of
from arle.executor.step import StepState, eager_forward, run_step_body
from arle.logging import get_logger
from arle.model.decoder import DecoderLM
from arle.threads import ThreadGovernor, torch_thread
from arle_kernels.ops import ops_for

log = get_logger("arle.executor")


class CPUExecutor:
    #: rank 0 of a tensor-parallel group: the other ranks (None: one rank)
    ranks: TPRanks | None = None
    #: host-tier copies run in the step (one thread: nothing to overlap them with)
    overlaps_restores = False

    def __init__(self, model: DecoderLM, num_pages: int, page_size: int, num_slots: int,
                 kv_dtype: torch.dtype, max_positions: int, seed: int = 0,
                 num_snapshots: int = 0, spec: tuple[int, int] = (0, 0),
                 governed: bool = False, host_kv_bytes: int = 0) -> None:
        model.ops = ops_for(torch.device("cpu"))
        self.model = model
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots
        self.tp = model.tp
        kv = KVCache.for_model(model.rank_config, num_pages, page_size, kv_dtype,
                               torch.device("cpu"))
        self.dev = StepState.build(model, kv, num_slots, num_snapshots, max_positions, seed,
                                   kv_dtype, spec, host_kv_bytes)
        self.kv_pool = self.dev.pool_info()
        # NOTE: one worker thread: steps run in launch order, as on a CUDA stream.
        self._worker = torch_thread()
        #: the torch thread count follows the cores this process gets (`ThreadGovernor`);
        #: None: fixed (--threads, or a TP rank)
        self.governor = (ThreadGovernor(torch.get_num_threads())
                         if governed and model.tp.size == 1 and torch.get_num_threads() > 1
                         else None)

    @property
    def state(self) -> StatePool | None:
        return self.dev.state

    def launch(self, plan: StepPlan) -> Awaitable[StepOutput]:
        """Flatten the plan here (the caller's thread); run it on the worker thread."""
        inputs = StepInputs.of(plan, self.kv_pool.page_size)
        if self.ranks is not None:
            return asyncio.wrap_future(self._worker.submit(self._run_group, inputs))
        return asyncio.wrap_future(self._worker.submit(self.run_step, inputs))

    def _run_group(self, inputs: StepInputs) -> StepOutput:
        """Rank 0 of a TP group: the step to the other ranks, then run it with them."""
        assert self.ranks is not None
        return self.ranks.run(peer_inputs(inputs), lambda: self.run_step(inputs))

    def run_step(self, inputs: StepInputs) -> StepOutput:
        """One step, on the calling thread (the worker thread; a TP rank's main thread)."""
        t0, cpu0 = time.perf_counter(), time.process_time()
        meta = torch.tensor(inputs.packed.meta, dtype=torch.int32)
        copy_s = 0.0
        if inputs.kv_offloads or inputs.kv_restores:  # (timed only where there are copies)
            t_copy = time.perf_counter()
            self.dev.copy_pages(inputs.kv_offloads, inputs.kv_restores)
            copy_s = time.perf_counter() - t_copy
        out, scored = run_step_body(self.dev, inputs, meta, inputs.sampling,
                                    lambda: eager_forward(self.dev, inputs, meta, num_splits=1))
        scores = (prompt_scores_of(scored, inputs.packed.segment("score_targets"),
                                   inputs.score_rows) if scored is not None else [])
        if out is None:
            return StepOutput([], [], self._timed(t0, cpu0), scores, copy_s=copy_s)
        if inputs.grammars:
            self.dev.grammar_masks.sampled(inputs.grammars, out.token_ids)
        tokens, logprobs = out.token_ids.tolist(), logprobs_of(out, inputs.want_logprobs)
        return StepOutput(tokens, logprobs, self._timed(t0, cpu0), scores,
                          out.drafts.tolist() if out.drafts is not None else [], copy_s)

    def _timed(self, t0: float, cpu0: float) -> float:
        """The step's seconds; the governor told of them (it may change the threads)."""
        wall = time.perf_counter() - t0
        if self.governor is not None:
            threads = self.governor.record(wall, time.process_time() - cpu0)
            if threads is not None:
                torch.set_num_threads(threads)
                log.info("cpu_threads", threads=threads, of=self.governor.max,
                         why="cores shared" if threads < self.governor.max else "trying all")
        return wall

    def rank_info(self) -> dict[str, Any]:
        """This rank's memory: weights, KV pool, recurrent state pool (`arle warmup`)."""
        return rank_memory(self.tp, "cpu", self.model, self.kv_pool.num_pages,
                           self.kv_pool.bytes, self.state.nbytes if self.state is not None else 0)

    def close(self) -> None:
        # The thread is shared (see torch_thread): wait for this executor's steps, keep it.
        # NOTE: a TP group stops after the last step, on the same thread
        ranks = self.ranks
        self._worker.submit(ranks.close if ranks is not None else lambda: None).result()
        if self.governor is not None:  # the thread is shared: leave it as it was found
            self._worker.submit(torch.set_num_threads, self.governor.max).result()
        self.dev.grammar_masks.close()
