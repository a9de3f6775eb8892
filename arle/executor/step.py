"""The step body both executors run, device-neutral: the new requests' starts, the forward, the
prompt scores, the sampling rows' logits and their sample, the states' saves, in that order.

The CPU executor runs it on its worker thread. The CUDA executor runs it inside its stream and
adds only what is CUDA's around it: the copies in and out, the events, and a graph replay in
place of `eager_forward` where one fits the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from arle.executor.base import KVPoolInfo
from arle.executor.distributed import sample_on_first_rank
from arle.executor.grammar import GrammarMasks
from arle.executor.paged import (
    DeviceStep,
    HostKV,
    HostStates,
    KVCache,
    PackedStep,
    PagedAttention,
    StatePool,
    StepInputs,
    host_tier,
    kv_format,
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
    #: the host tier's K/V pages and state snapshots (None: no tier; `host_tier`)
    host_kv: HostKV | None = None
    host_states: HostStates | None = None

    @classmethod
    def build(cls, model: DecoderLM, kv: KVCache, num_slots: int, num_snapshots: int,
              max_positions: int, seed: int, dtype: torch.dtype,
              spec: tuple[int, int] = (0, 0), host_kv_bytes: int = 0) -> StepState:
        """Zeroed per-slot state for `num_slots` requests beside `kv`, on its device
        (`dtype`: the model's activations', which the recurrent states take; spec: the verify
        rows and positions whose recurrent states a step keeps, `StatePool.for_model`)."""
        device = kv.k.device
        cfg = model.config
        state = StatePool.for_model(model.rank_config, num_slots + 1, num_snapshots, dtype,
                                    device, spec)
        host_kv, host_states = host_tier(kv, state, host_kv_bytes)
        return cls(
            model=model, kv=kv, state=state,
            rotary=model.rotary_table(max_positions),
            token_buffer=torch.zeros(num_slots + 1, dtype=torch.int32, device=device),
            penalties=PenaltyState(num_slots, cfg.vocab_size, device),
            generator=torch.Generator(device).manual_seed(seed),
            grammar_masks=GrammarMasks(cfg.vocab_size, pin_memory=device.type == "cuda"),
            host_kv=host_kv, host_states=host_states)

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    def copy_pages(self, offloads: list[tuple[int, int]], restores: list[tuple[int, int]]
                   ) -> None:
        """Host-tier page copies (`CacheManager.take_copies`): the offloads, then the
        restores."""
        if offloads or restores:
            assert self.host_kv is not None
            self.host_kv.copy(self.kv, offloads, restores)

    def pool_info(self) -> KVPoolInfo:
        """The KV pool and host tier as the engine sizes its cache manager by them."""
        kv, host, states = self.kv, self.host_kv, self.host_states
        return KVPoolInfo(kv.k.shape[1], kv.page_size, kv.nbytes, kv_format(kv.k.dtype),
                          host.num_pages if host else 0, host.nbytes if host else 0,
                          states.num_snapshots if states else 0,
                          states.nbytes if states else 0)

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
    """A forward's result: the sampling rows' logits, and the prompt scores (None: none); an
    eager forward's also every token's final hidden state and the step (the MTP head reads
    them)."""

    logits: Tensor
    scored: ScoreOutput | None = None
    hidden: Tensor | None = None
    step: DeviceStep | None = None


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
    return Forward(dev.model.logits(hidden[index]) if index.numel() else hidden[:0], scored,
                   hidden, step)


def mtp_drafts(dev: StepState, packed: PackedStep, meta: Tensor, fwd: Forward,
               sampled: Tensor) -> Tensor | None:
    """The MTP head over the step's tokens (each with the id after it: the sample where the
    step samples it), writing its KV entry; then, for each row that chains drafts, from its
    last accepted position (its verify row's outcome, found here as the engine finds it)
    `packed.mtp_drafts` greedy drafts, each chained from the head's own output one position
    further. -> [rows, K] on the device (None: no row chains)."""
    head, model = dev.model.mtp, dev.model
    assert head is not None and fwd.hidden is not None and fwd.step is not None
    step, sample_at = fwd.step, packed.view(meta, "sample_index").long()
    ids = packed.view(meta, "mtp_ids").long()
    ids[sample_at] = sampled
    x = head(model.embed(ids), fwd.hidden, attention_backend(dev, step), model.ops)
    chains = packed.view(meta, "mtp_rows").long().view(-1, 3)
    if not chains.numel():
        return None
    rows, first, spec = chains.unbind(1)
    pick = sample_at[first + _accepted(step.input_ids.long(), sampled, sample_at, first, spec,
                                       packed.max_spec)]
    h, draft = x[pick], model.logits(x[pick]).argmax(-1)
    drafts = [draft]
    table, positions = step.page_table[rows], step.positions[pick].long()
    for j in range(1, packed.mtp_drafts):
        h = head(model.embed(draft), h, attention_backend(dev, _chain_step(
            table, positions + j, dev.page_size)), model.ops)
        draft = model.logits(h).argmax(-1)
        drafts.append(draft)
    return torch.stack(drafts, dim=1)


def _accepted(ids: Tensor, sampled: Tensor, sample_at: Tensor, first: Tensor, spec: Tensor,
              width: int) -> Tensor:
    """Per row, the drafts its verify row keeps (`arle.engine.speculative.accepted_drafts`
    on the device): the leading drafts (the input id after a sampled position) equal to the
    sample there. Rows without drafts keep 0."""
    if not width:
        return torch.zeros_like(first)
    j = torch.arange(width, device=first.device)
    at = (first[:, None] + j).clamp(max=sampled.shape[0] - 1)
    after = ids[(sample_at[at] + 1).clamp(max=ids.shape[0] - 1)]
    kept = (sampled[at] == after) & (j < spec[:, None])
    return kept.long().cumprod(dim=1).sum(dim=1)


def _chain_step(table: Tensor, positions: Tensor, page_size: int) -> DeviceStep:
    """One token a row at `positions` (decode rows over the rows' page tables `table`): the
    MTP head's chained drafts."""
    page = table.gather(1, (positions // page_size)[:, None]).squeeze(1).long()
    n = positions.shape[0]
    return DeviceStep(positions, positions.int(), (page * page_size + positions % page_size).int(),
                      (positions + 1).int(), table.new_zeros(1), table, n, 1, 1)


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
    inputs.start_states(dev.state, dev.host_states)
    fwd = forward()
    inputs.save_states(dev.state)
    out = _sample(dev, inputs, meta, batch, fwd, masks)
    if inputs.packed.has_mtp:  # NOTE: one device (`load_model` refuses the head with TP)
        sampled = out.token_ids if out is not None else meta.new_zeros(0, dtype=torch.long)
        drafts = mtp_drafts(dev, inputs.packed, meta, fwd, sampled)
        if out is not None:
            out.drafts = drafts
    return out, fwd.scored


def _sample(dev: StepState, inputs: StepInputs, meta: Tensor, batch: SamplingBatch | None,
            fwd: Forward, masks: Any) -> SampleOutput | None:
    """The sampling rows' tokens, into the token buffer (None: no row samples, or a TP rank
    > 0)."""
    layout = inputs.packed
    if not layout.sample_rows:
        return None
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
        return sample(fwd.logits)
    # NOTE: TP: rank 0 samples the gathered logits; the others learn the ids (None here)
    return sample_on_first_rank(tp, fwd.logits, dev.model.config.vocab_size, slots,
                                dev.token_buffer, sample)
