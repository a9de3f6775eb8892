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

import torch

from arle.executor.base import KVPoolInfo, StepOutput
from arle.executor.paged import (
    KVCache,
    PagedAttention,
    StatePool,
    StepInputs,
    kv_format,
    step_views,
)
from arle.executor.plan import StepPlan
from arle.executor.sampler import (
    PenaltyState,
    logprobs_of,
    prompt_scores_of,
    sample_into,
    score_positions,
)
from arle.model.decoder import DecoderLM
from arle.threads import torch_thread
from arle_kernels.ops import ops_for


class CPUExecutor:
    def __init__(self, model: DecoderLM, num_pages: int, page_size: int, num_slots: int,
                 kv_dtype: torch.dtype, max_positions: int, seed: int = 0,
                 num_snapshots: int = 0) -> None:
        cfg = model.config
        model.ops = ops_for(torch.device("cpu"))
        self.model = model
        self.page_size = page_size
        self.num_slots = num_slots
        self.kv = KVCache.for_model(cfg, num_pages, page_size, kv_dtype, torch.device("cpu"))
        self.kv_pool = KVPoolInfo(num_pages, page_size, self.kv.nbytes, kv_format(kv_dtype))
        self.num_snapshots = num_snapshots
        # NOTE: one spare state entry past the slots, as on CUDA (start-up's profile step)
        self.state = StatePool.for_model(cfg, num_slots + 1, num_snapshots, kv_dtype,
                                         torch.device("cpu"))
        self.rotary = model.rotary_table(max_positions)
        self.token_buffer = torch.zeros(num_slots, dtype=torch.int32)
        self.penalties = PenaltyState(num_slots, cfg.vocab_size, "cpu")
        self.generator = torch.Generator().manual_seed(seed)
        # NOTE: one worker thread: steps run in launch order, as on a CUDA stream.
        self._worker = torch_thread()

    def launch(self, plan: StepPlan) -> Awaitable[StepOutput]:
        """Flatten the plan here (the caller's thread); run it on the worker thread."""
        inputs = StepInputs.of(plan, self.page_size)
        return asyncio.wrap_future(self._worker.submit(self._run, inputs))

    def _run(self, inputs: StepInputs) -> StepOutput:
        t0 = time.perf_counter()
        for new_slot in inputs.new_slots:
            self.penalties.start_slot(*new_slot)
        inputs.start_states(self.state)
        packed = inputs.packed
        meta = torch.tensor(packed.meta, dtype=torch.int32)
        step, decode_slots = step_views(packed, meta, num_splits=1)
        if packed.num_decode:
            step.input_ids[: packed.num_decode] = self.token_buffer[decode_slots]
        hidden = self.model(step.input_ids, PagedAttention(self.kv, step, self.rotary, self.model,
                                                           self.state, self.page_size))
        inputs.save_states(self.state)
        scores = []
        if packed.num_scores:
            scored = score_positions(hidden[packed.view(meta, "score_index")],
                                     packed.view(meta, "score_targets"), inputs.score_top,
                                     self.model.logits)
            scores = prompt_scores_of(scored, packed.segment("score_targets"), inputs.score_rows)
        if inputs.sampling is None:
            return StepOutput([], [], time.perf_counter() - t0, scores)
        logits = self.model.logits(hidden[packed.view(meta, "sample_index")])
        out = sample_into(logits, inputs.sampling, packed.view(meta, "sample_slots"),
                          self.penalties, self.token_buffer, self.generator)
        return StepOutput(out.token_ids.tolist(), logprobs_of(out, inputs.want_logprobs),
                          time.perf_counter() - t0, scores)

    def close(self) -> None:
        # The thread is shared (see torch_thread): wait for this executor's steps, keep it.
        self._worker.submit(lambda: None).result()
