"""The CPU executor: the torch model with plain-torch paged attention, one worker thread.

It follows the same protocol the CUDA executor will: `launch` snapshots the plan into tensors on
the caller's thread and returns an awaitable at once; the step runs on a single worker thread
(the CPU's "stream": steps run in launch order), so the event loop schedules step N+1 while
step N computes. Sampled ids go to a per-slot token buffer that decode rows of the next step
read, so no step waits for the host to learn the previous step's tokens.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Awaitable
from dataclasses import dataclass

import torch

from arle.executor.base import KVPoolInfo, StepOutput
from arle.executor.plan import StepPlan
from arle.executor.sampler import PenaltyState, SamplingBatch, logprobs_of, sample
from arle.model.decoder import DecoderLM
from arle_kernels.attention import decode_gather_index, paged_attention_ref

_TORCH_THREAD: concurrent.futures.ThreadPoolExecutor | None = None


def torch_thread() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that runs heavy CPU torch work: model loading and every step.

    NOTE: each thread that enters an OpenMP parallel region gets its own team of worker threads,
    which spin while idle. Two teams on a 2-core machine fight for the cores: a SmolLM2 decode
    step measured 26 ms with all torch work on one thread and 46 ms with loading on another.
    Light torch calls (building small tensors) on other threads start no parallel region.
    """
    global _TORCH_THREAD
    if _TORCH_THREAD is None:
        _TORCH_THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="arle-torch")
    return _TORCH_THREAD


@dataclass
class StepTensors:
    """Everything one step reads, snapshotted from the plan at launch."""

    input_ids: torch.Tensor  # [T]; -1 where a decode row reads the token buffer
    decode_slots: torch.Tensor  # [num_decode_rows]
    positions: torch.Tensor  # [T]
    kv_slots: torch.Tensor  # [T] flat cache slot each new token's K/V goes to
    page_tables: torch.Tensor  # [R, max_pages]
    seq_lens: list[int]
    q_lens: list[int]
    num_decode_rows: int
    sample_index: torch.Tensor  # [S] token index of each sampling row's last token
    sample_slots: torch.Tensor  # [S]
    sampling: SamplingBatch | None
    want_logprobs: list[int | None]  # per sampling row
    new_slots: list[tuple[int, list[int], int, bool]]  # slot, tokens, num_prompt, penalized


class TorchPagedAttention:
    """The model's attention backend on the CPU: the torch references of the CUDA kernels
    (q/k norm + rotary + K/V store, then paged attention)."""

    def __init__(self, kv: torch.Tensor, step: StepTensors, rotary: torch.Tensor,
                 model: DecoderLM) -> None:
        cfg = model.config
        self.kv, self.step, self.rotary = kv, step, rotary
        self.store = model.ops.qk_norm_rope_store_kv
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.eps, self.scale = cfg.rms_norm_eps, cfg.head_dim ** -0.5
        nd = step.num_decode_rows
        # NOTE: the decode rows' gather index is the same for every layer: build it once.
        self.decode_index = decode_gather_index(
            step.page_tables[:nd], torch.tensor(step.seq_lens[:nd]), kv.shape[3]) if nd else None

    def attend(self, layer: int, qkv: torch.Tensor, q_norm: torch.Tensor | None,
               k_norm: torch.Tensor | None) -> torch.Tensor:
        k_cache, v_cache = self.kv[layer, 0], self.kv[layer, 1]
        s = self.step
        q = self.store(qkv, s.positions, self.rotary, q_norm, k_norm, self.eps, self.num_heads,
                       self.num_kv_heads, k_cache, v_cache, s.kv_slots)
        out = paged_attention_ref(q, k_cache, v_cache, s.page_tables, s.seq_lens, s.q_lens,
                                  s.num_decode_rows, self.scale, self.decode_index)
        return out.view(q.shape[0], -1)


class CPUExecutor:
    def __init__(self, model: DecoderLM, num_pages: int, page_size: int, num_slots: int,
                 kv_dtype: torch.dtype, max_positions: int, seed: int = 0) -> None:
        cfg = model.config
        self.model = model
        self.page_size = page_size
        self.num_slots = num_slots
        self.kv = torch.zeros(cfg.num_layers, 2, num_pages, page_size, cfg.num_kv_heads,
                              cfg.head_dim, dtype=kv_dtype)
        self.kv_pool = KVPoolInfo(num_pages, page_size,
                                  self.kv.numel() * self.kv.element_size(),
                                  str(kv_dtype).removeprefix("torch."))
        self.rotary = model.rotary_table(max_positions)
        self.token_buffer = torch.zeros(num_slots, dtype=torch.long)
        self.penalties = PenaltyState(num_slots, cfg.vocab_size, "cpu")
        self.generator = torch.Generator().manual_seed(seed)
        # NOTE: one worker thread: steps run in launch order, as on a CUDA stream.
        self._worker = torch_thread()

    # ---- the caller's thread -------------------------------------------------------------
    def launch(self, plan: StepPlan) -> Awaitable[StepOutput]:
        tensors = self.prepare(plan)
        future = self._worker.submit(self._run, tensors)
        return asyncio.wrap_future(future)

    def prepare(self, plan: StepPlan) -> StepTensors:
        ps = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        kv_slots: list[int] = []
        sample_index: list[int] = []
        sample_rows = []
        for row in plan.rows:
            ids.extend(row.input_ids if row.input_ids is not None else [-1])
            pos = range(row.start, row.seq_len)
            positions.extend(pos)
            kv_slots.extend(row.pages[p // ps] * ps + p % ps for p in pos)
            if row.sample:
                sample_index.append(len(ids) - 1)
                sample_rows.append(row)
        max_pages = max(-(-r.seq_len // ps) for r in plan.rows)
        tables = torch.zeros(len(plan.rows), max_pages, dtype=torch.long)
        for i, row in enumerate(plan.rows):
            n = -(-row.seq_len // ps)
            tables[i, :n] = torch.tensor(row.pages[:n], dtype=torch.long)
        nd = plan.num_decode_rows
        sampling = (SamplingBatch.build([r.params for r in sample_rows],
                                        [r.sample_offset for r in sample_rows],
                                        torch.device("cpu")) if sample_rows else None)
        return StepTensors(
            input_ids=torch.tensor(ids, dtype=torch.long),
            decode_slots=torch.tensor([r.slot for r in plan.rows[:nd]], dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            kv_slots=torch.tensor(kv_slots, dtype=torch.long),
            page_tables=tables,
            seq_lens=[r.seq_len for r in plan.rows],
            q_lens=[r.num_tokens for r in plan.rows],
            num_decode_rows=nd,
            sample_index=torch.tensor(sample_index, dtype=torch.long),
            sample_slots=torch.tensor([r.slot for r in sample_rows], dtype=torch.long),
            sampling=sampling,
            want_logprobs=[r.params.logprobs for r in sample_rows],
            new_slots=[(n.slot, n.token_ids, n.num_prompt, n.params.has_penalties)
                       for n in plan.new_slots],
        )

    # ---- the worker thread (device order) -------------------------------------------------
    def _run(self, s: StepTensors) -> StepOutput:
        t0 = time.perf_counter()
        for new_slot in s.new_slots:
            self.penalties.start_slot(*new_slot)
        input_ids = s.input_ids
        if s.num_decode_rows:
            input_ids = input_ids.clone()
            input_ids[: s.num_decode_rows] = self.token_buffer[s.decode_slots]
        hidden = self.model(input_ids, TorchPagedAttention(self.kv, s, self.rotary, self.model))
        if s.sampling is None:
            return StepOutput([], [], time.perf_counter() - t0)
        logits = self.model.logits(hidden[s.sample_index])
        counts = mask = None
        if s.sampling.any_penalty:
            counts, mask = self.penalties.gather(s.sample_slots)
        out = sample(logits, s.sampling, token_counts=counts, prompt_mask=mask,
                     generator=self.generator)
        self.token_buffer[s.sample_slots] = out.token_ids
        self.penalties.update(s.sample_slots, out.token_ids)
        return StepOutput(out.token_ids.tolist(), logprobs_of(out, s.want_logprobs),
                          time.perf_counter() - t0)

    def close(self) -> None:
        # The thread is shared (see torch_thread): wait for this executor's steps, keep it.
        self._worker.submit(lambda: None).result()


def teacher_forced_logits(model: DecoderLM, token_ids: list[int], page_size: int = 16,
                          chunk_size: int | None = None) -> torch.Tensor:
    """Logits [T, vocab] at every position of `token_ids`, through the same paged-attention path
    the engine uses, prefilled in chunks of `chunk_size` (default: one chunk). For parity checks
    against other implementations."""
    cfg = model.config
    n = len(token_ids)
    num_pages = -(-n // page_size)
    kv = torch.zeros(cfg.num_layers, 2, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim,
                     dtype=model.embed_tokens.weight.dtype)
    # NOTE: pages in reverse order, so a wrong page-table lookup cannot pass by accident.
    pages = list(range(num_pages - 1, -1, -1))
    table = torch.tensor([pages])
    chunk = chunk_size or n
    rotary = model.rotary_table(n)
    out = []
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        pos = torch.arange(start, end)
        step = StepTensors(
            input_ids=torch.tensor(token_ids[start:end]), decode_slots=torch.empty(0, dtype=torch.long),
            positions=pos, kv_slots=table[0, pos // page_size] * page_size + pos % page_size,
            page_tables=table, seq_lens=[end], q_lens=[end - start], num_decode_rows=0,
            sample_index=torch.empty(0, dtype=torch.long), sample_slots=torch.empty(0, dtype=torch.long),
            sampling=None, want_logprobs=[], new_slots=[])
        backend = TorchPagedAttention(kv, step, rotary, model)
        out.append(model.logits(model(step.input_ids, backend)))
    return torch.cat(out)
