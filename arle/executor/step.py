"""The step body both executors run, device-neutral: the new requests' starts, the forward, the
prompt scores, the sampling rows' logits and their sample, the states' saves, in that order.

The CPU executor runs it on its worker thread. The CUDA executor runs it inside its stream and
adds only what is CUDA's around it: the copies in and out, the events, and a graph replay in
place of `eager_forward` where one fits the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from arle.executor.distributed import sample_on_first_rank
from arle.executor.grammar import GrammarMasks
from arle.executor.paged import (
    DeviceStep,
    KVCache,
    PagedAttention,
    StatePool,
    StepInputs,
    step_views,
)
from arle.executor.sampler import (
    PenaltyState,
    SampleOutput,
    SamplingBatch,
    ScoreOutput,
    sample_into,
    score_positions,
)
from arle.model.decoder import DecoderLM


@dataclass(frozen=True)
class StepState:
    """What a step reads and writes on its device: the model, its caches and the per-slot state.
    Each executor holds one; the CUDA executor's start-up builds its own (`cuda_startup`)."""

    model: DecoderLM
    kv: KVCache
    state: StatePool | None
    rotary: Tensor
    #: each request slot's last sampled id: the next step's decode rows read their input here.
    #: NOTE: one spare entry past the slots (`pad_slot`): graph padding and start-up's profile
    #: step write there
    token_buffer: Tensor
    penalties: PenaltyState
    generator: torch.Generator
    grammar_masks: GrammarMasks

    @classmethod
    def build(cls, model: DecoderLM, kv: KVCache, num_slots: int, num_snapshots: int,
              max_positions: int, seed: int, dtype: torch.dtype,
              spec: tuple[int, int] = (0, 0)) -> StepState:
        """Zeroed per-slot state for `num_slots` requests beside `kv`, on its device
        (`dtype`: the model's activations', which the recurrent states take; spec: the verify
        rows and positions whose recurrent states a step keeps, `StatePool.for_model`)."""
        device = kv.k.device
        cfg = model.config
        return cls(
            model=model, kv=kv,
            state=StatePool.for_model(model.rank_config, num_slots + 1, num_snapshots,
                                      dtype, device, spec),
            rotary=model.rotary_table(max_positions),
            token_buffer=torch.zeros(num_slots + 1, dtype=torch.int32, device=device),
            penalties=PenaltyState(num_slots, cfg.vocab_size, device),
            generator=torch.Generator(device).manual_seed(seed),
            grammar_masks=GrammarMasks(cfg.vocab_size, pin_memory=device.type == "cuda"))

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    @property
    def num_slots(self) -> int:
        return self.token_buffer.shape[0] - 1

    @property
    def pad_slot(self) -> int:
        """The token buffer's spare entry (and the state pool's), past the slots: no
        request's."""
        return self.num_slots


@dataclass
class Forward:
    """A forward's result: the sampling rows' logits, and the prompt scores (None: none)."""

    logits: Tensor
    scored: ScoreOutput | None = None


def attention_backend(dev: StepState, step: DeviceStep) -> PagedAttention:
    """The model's attention (and recurrent state) for one step."""
    return PagedAttention(dev.kv, step, dev.rotary, dev.model, dev.state, dev.page_size)


def eager_forward(dev: StepState, inputs: StepInputs, meta: Tensor, num_splits: int) -> Forward:
    """The forward without a graph: the decode rows' inputs from the token buffer, the model
    over the step's tokens, the prompt scores, the sampling rows' logits."""
    layout = inputs.packed
    step, decode_slots = step_views(layout, meta, num_splits)
    if layout.num_decode:
        step.input_ids[: layout.num_decode] = dev.token_buffer[decode_slots]
    hidden = dev.model(step.input_ids, attention_backend(dev, step))
    scored = None
    if layout.num_scores:
        scored = score_positions(hidden[layout.view(meta, "score_index")],
                                 layout.view(meta, "score_targets"), inputs.score_top,
                                 dev.model.logits)
    index = layout.view(meta, "sample_index")
    return Forward(dev.model.logits(hidden[index]) if index.numel() else hidden[:0], scored)


def run_step_body(dev: StepState, inputs: StepInputs, meta: Tensor,
                  batch: SamplingBatch | None, forward: Callable[[], Forward]
                  ) -> tuple[SampleOutput | None, ScoreOutput | None]:
    """One step on `dev`, queued in device order (`meta`: the packed array on the device,
    `batch`: the sampling rows' parameters, on the device where they are read there). ->
    (the sample, None where no row samples or on a TP rank > 0; the prompt scores), both
    still on the device: each executor brings them to the host its own way."""
    # NOTE: the grammar rows' masks are filled on their own thread while the forward runs.
    masks = (dev.grammar_masks.start(inputs.grammars, batch.size)
             if inputs.grammars and batch is not None else None)
    for new_slot in inputs.new_slots:
        dev.penalties.start_slot(*new_slot)
    inputs.start_states(dev.state)
    fwd = forward()
    inputs.save_states(dev.state)
    layout = inputs.packed
    if not layout.sample_rows:
        return None, fwd.scored
    slots = layout.view(meta, "sample_slots")

    def sample(full: Tensor) -> SampleOutput:
        assert batch is not None
        # NOTE: the step's only wait for the host, and only in steps with grammar rows
        bitmask = (masks.result().to(full.device, non_blocking=True)
                   if masks is not None else None)
        return sample_into(full, batch, slots, dev.penalties, dev.token_buffer, dev.generator,
                           dev.model.ops.greedy_pick, bitmask)

    tp = dev.model.tp
    if tp.size == 1:
        return sample(fwd.logits), fwd.scored
    # NOTE: TP: rank 0 samples the gathered logits; the others learn the ids (None here)
    return sample_on_first_rank(tp, fwd.logits, dev.model.config.vocab_size, slots,
                                dev.token_buffer, sample), fwd.scored
