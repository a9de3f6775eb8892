"""Batched next-token sampling: one call per step on the logits of the rows that sample.

Order per row: penalties -> greedy rows take the argmax; the others go through
temperature -> top-k -> top-p -> min-p -> an exponential race (argmax of probs / q, q ~ Exp(1)).

NOTE: `sample` never reads a tensor value on the host (no `.item()`, `.tolist()`, or branching on
tensor contents), so on CUDA it queues kernels without a sync. The only Python branches are on
host-side flags that `SamplingBatch.build` computes from the requests' parameters, to skip work no
row needs.

The race is what makes seeded requests reproducible: a seeded row's noise depends only on
(seed, offset), so it draws the same tokens whatever batch or row it lands in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor

from arle.executor.grammar import apply_token_bitmask
from arle.sampling import SamplingParams, TokenLogprob
from arle_kernels.greedy_ref import GreedyPick, greedy_pick_ref
from arle_kernels.noise_ref import mix_seed

_MASK63 = (1 << 63) - 1


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters as tensors on the logits' device, built once per step."""

    temperature: Tensor  # [B] float32; 0 => greedy for that row
    top_p: Tensor  # [B] float32 in (0, 1]
    top_k: Tensor  # [B] int64; 0 => disabled
    min_p: Tensor  # [B] float32; 0 => disabled
    repetition_penalty: Tensor  # [B] float32; 1 => off
    frequency_penalty: Tensor  # [B] float32; 0 => off
    presence_penalty: Tensor  # [B] float32; 0 => off
    seeds: Tensor  # [B] int64; -1 => unseeded (the executor's generator)
    offsets: Tensor  # [B] int64; index of the token being sampled within the request's output
    #: Max over rows of the requested top-N: 0 = only the chosen token's logprob, -1 = none.
    num_logprobs: int
    # Host-side flags, to skip work. The top-k/p, min-p and seed flags only look at sampling rows:
    # a greedy row's values there never matter.
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_penalty: bool
    any_seeded: bool
    #: (row, seed, offset) of each non-greedy seeded row, on the host, for the CPU noise loop.
    seeded_rows: tuple[tuple[int, int, int], ...] = ()

    @property
    def size(self) -> int:
        return self.temperature.shape[0]

    @property
    def takes_greedy_pick(self) -> bool:
        """Every row greedy, no penalty, no logprobs: the argmax is all there is to do."""
        return not self.reads_tensors and self.num_logprobs < 0

    @property
    def reads_tensors(self) -> bool:
        """Whether sampling reads the per-row tensors (greedy rows without penalties read
        none: they may stay on the host)."""
        return not (self.all_greedy and not self.any_penalty)

    def _tensor_fields(self) -> dict[str, Tensor]:
        return {f.name: v for f in fields(self) if isinstance(v := getattr(self, f.name), Tensor)}

    def tensors(self) -> list[Tensor]:
        """The per-row parameter tensors."""
        return list(self._tensor_fields().values())

    def to(self, device: torch.device) -> SamplingBatch:
        """A copy with the per-row tensors on `device` (non-blocking copies from pinned memory,
        on the current stream)."""
        moved: dict[str, Any] = {name: t.pin_memory().to(device, non_blocking=True)
                                 for name, t in self._tensor_fields().items()}
        return replace(self, **moved)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        offsets: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> SamplingBatch:
        if len(params) != len(offsets):
            raise ValueError(f"{len(params)} params but {len(offsets)} offsets")

        def f32(values: list[float]) -> Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def i64(values: list[int]) -> Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        # NOTE: seeds are folded to 63 bits so they fit an int64 tensor; the host tuple uses the
        # same folded value, so tensor and loop agree.
        seeds = [-1 if p.seed is None else p.seed & _MASK63 for p in params]
        sampling = [p for p in params if not p.greedy]
        seeded_rows = tuple(
            (row, seed, offset)
            for row, (p, seed, offset) in enumerate(zip(params, seeds, offsets, strict=True))
            if seed >= 0 and not p.greedy
        )
        return cls(
            temperature=f32([p.temperature for p in params]),
            top_p=f32([p.top_p for p in params]),
            top_k=i64([max(p.top_k, 0) for p in params]),  # -1 and 0 both mean "off"
            min_p=f32([p.min_p for p in params]),
            repetition_penalty=f32([p.repetition_penalty for p in params]),
            frequency_penalty=f32([p.frequency_penalty for p in params]),
            presence_penalty=f32([p.presence_penalty for p in params]),
            seeds=i64(seeds),
            offsets=i64(list(offsets)),
            num_logprobs=max((-1 if p.logprobs is None else p.logprobs for p in params),
                             default=-1),
            all_greedy=not sampling,
            any_top_k=any(p.top_k > 0 for p in sampling),
            any_top_p=any(p.top_p < 1.0 for p in sampling),
            any_min_p=any(p.min_p > 0.0 for p in sampling),
            any_penalty=any(p.has_penalties for p in params),
            any_seeded=bool(seeded_rows),
            seeded_rows=seeded_rows,
        )


@dataclass
class SampleOutput:
    token_ids: Tensor  # [B] int64
    #: [B] float32: log-softmax of the *unmodified* logits (before penalties and temperature) at
    #: the chosen id, as OpenAI/vLLM report. None when no row asked for logprobs.
    logprobs: Tensor | None = None
    top_ids: Tensor | None = None  # [B, N] int64, best first; None when N == 0
    top_logprobs: Tensor | None = None  # [B, N] float32
    #: `--speculative mtp`: the MTP head's drafts [C, K] for each row that chains them, after
    #: the row's last accepted position (arle.executor.step.mtp_drafts)
    drafts: Tensor | None = None


def sample(
    logits: Tensor,
    batch: SamplingBatch,
    *,
    token_counts: Tensor | None = None,
    prompt_mask: Tensor | None = None,
    generator: torch.Generator | None = None,
    bitmask: Tensor | None = None,
) -> SampleOutput:
    """Pick one token per row of `logits` [B, V].

    `token_counts` [B, V] (int) and `prompt_mask` [B, V] (bool) are needed only when
    `batch.any_penalty` (see `PenaltyState.gather`). `generator` drives the unseeded rows.
    `bitmask` [B, W] (int32, arle.executor.grammar): the tokens each row may pick; the
    logprobs stay those of the unmodified logits.
    """
    if logits.dim() != 2 or logits.shape[0] != batch.size:
        raise ValueError(f"logits {tuple(logits.shape)} do not match a batch of {batch.size}")
    raw = logits.float()  # NOTE: may alias the caller's tensor: nothing below writes into it
    x = raw
    if batch.any_penalty:
        if token_counts is None or prompt_mask is None:
            raise ValueError("batch has penalties: pass token_counts and prompt_mask")
        x = apply_penalties(x, batch, token_counts, prompt_mask)
    if bitmask is not None:
        x = apply_token_bitmask(x, bitmask)

    if batch.all_greedy:
        token_ids = x.argmax(dim=-1)
    else:
        sampled = _sample_random(x, batch, generator)
        token_ids = torch.where(batch.temperature == 0, x.argmax(dim=-1), sampled)

    out = SampleOutput(token_ids=token_ids)
    if batch.num_logprobs >= 0:
        logprobs = raw.log_softmax(dim=-1)
        out.logprobs = logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
        n = min(batch.num_logprobs, logprobs.shape[-1])
        if n > 0:
            out.top_logprobs, out.top_ids = logprobs.topk(n, dim=-1)  # sorted, best first
    return out


def sample_into(logits: Tensor, batch: SamplingBatch, slots: Tensor, penalties: PenaltyState,
                token_buffer: Tensor, generator: torch.Generator | None,
                greedy: GreedyPick = greedy_pick_ref, bitmask: Tensor | None = None
                ) -> SampleOutput:
    """Sample one token per row (row i belongs to request slot `slots[i]`) and record it where
    the next step needs it: `token_buffer[slot]` (the decode rows' input) and the slot's
    penalty counts. All on the logits' device, no host sync. A batch of greedy rows with no
    penalty and no logprobs takes `greedy` (the executor's kernel: the argmax and the write in
    one pass, on the logits in their own dtype), after the grammar rows' `bitmask` if any."""
    if batch.takes_greedy_pick:
        if bitmask is not None:
            logits = apply_token_bitmask(logits, bitmask)
        out = SampleOutput(token_ids=greedy(logits, slots, token_buffer))
    else:
        counts = mask = None
        if batch.any_penalty:
            counts, mask = penalties.gather(slots)
        out = sample(logits, batch, token_counts=counts, prompt_mask=mask, generator=generator,
                     bitmask=bitmask)
        token_buffer[slots] = out.token_ids.to(token_buffer.dtype)
    if len(penalties):  # NOTE: slots without penalties map to the sentinel row: a no-op
        penalties.update(slots, out.token_ids)
    return out


def logprobs_of(out: SampleOutput, want: list[int | None]) -> list[TokenLogprob | None]:
    """Per row, what it asked for: the chosen token's logprob and its top `want` alternatives
    (None where it asked for nothing). Reads `out` on the host."""
    if all(w is None for w in want) or out.logprobs is None:
        return []
    ids = out.token_ids.tolist()
    chosen = out.logprobs.tolist()
    top_ids = out.top_ids.tolist() if out.top_ids is not None else None
    top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    result: list[TokenLogprob | None] = []
    for i, w in enumerate(want):
        if w is None:
            result.append(None)
            continue
        top = (tuple(zip(top_ids[i][:w], top_lp[i][:w], strict=False))
               if w and top_ids and top_lp else ())
        result.append(TokenLogprob(ids[i], chosen[i], top))
    return result


#: Scored positions per lm_head block: the [block, V] fp32 logits stay small however long the
#: prompt chunk (a 2048-token chunk of a 150k vocabulary would be 1.2 GB at once).
SCORE_BLOCK = 256


@dataclass
class ScoreOutput:
    """Prompt scores, per scored position: the log-softmax of the raw logits at the prompt's
    next token and (N > 0) the top N alternatives, best first."""

    logprobs: Tensor  # [P] float32
    top_ids: Tensor | None = None  # [P, N] int64
    top_logprobs: Tensor | None = None  # [P, N] float32


def score_positions(hidden: Tensor, targets: Tensor, top_n: int,
                    logits_of: Callable[[Tensor], Tensor]) -> ScoreOutput:
    """Score prompt tokens from the hidden states of the positions before them, in blocks of
    SCORE_BLOCK positions. On the device, no host sync (the block loop is over a host count)."""
    lps: list[Tensor] = []
    ids: list[Tensor] = []
    tops: list[Tensor] = []
    for i in range(0, hidden.shape[0], SCORE_BLOCK):
        lp = logits_of(hidden[i:i + SCORE_BLOCK]).float().log_softmax(dim=-1)
        lps.append(lp.gather(-1, targets[i:i + SCORE_BLOCK, None].long()).squeeze(-1))
        if top_n > 0:
            top, idx = lp.topk(min(top_n, lp.shape[-1]), dim=-1)
            tops.append(top)
            ids.append(idx)
    return ScoreOutput(torch.cat(lps), torch.cat(ids) if ids else None,
                       torch.cat(tops) if tops else None)


def prompt_scores_of(out: ScoreOutput, targets: list[int], rows: list[tuple[int, int]]
                     ) -> list[list[TokenLogprob]]:
    """Split the scores by row ((positions, top N asked) each, in order). Reads `out` on the
    host."""
    chosen = out.logprobs.tolist()
    top_ids = out.top_ids.tolist() if out.top_ids is not None else None
    top_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    result: list[list[TokenLogprob]] = []
    i = 0
    for count, want in rows:
        scores = []
        for j in range(i, i + count):
            top = (tuple(zip(top_ids[j][:want], top_lp[j][:want], strict=False))
                   if want and top_ids and top_lp else ())
            scores.append(TokenLogprob(targets[j], chosen[j], top))
        result.append(scores)
        i += count
    return result


def apply_penalties(
    logits: Tensor, batch: SamplingBatch, token_counts: Tensor, prompt_mask: Tensor
) -> Tensor:
    """Repetition (prompt + output tokens, HF/vLLM style), then frequency and presence (output
    tokens only, OpenAI style). Rows with neutral values (1, 0, 0) come out bit-identical."""
    in_output = token_counts > 0
    seen = in_output | prompt_mask
    rep = batch.repetition_penalty[:, None]
    # Dividing a positive logit and multiplying a negative one both push the token down.
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return (logits
            - batch.frequency_penalty[:, None] * token_counts.to(logits.dtype)
            - batch.presence_penalty[:, None] * in_output.to(logits.dtype))


def apply_top_k_top_p(
    logits: Tensor, top_k: Tensor, top_p: Tensor, *, use_top_k: bool = True,
    use_top_p: bool = True,
) -> Tensor:
    """Set to -inf every logit outside the row's top k (0 = all) and then outside its nucleus:
    the smallest most-likely-first set whose (renormalised) probability reaches top_p.

    One sort serves both. Ties are ranked lowest id first (stable sort), so the kept set is a
    function of the row alone.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    if use_top_k:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
        rank = torch.arange(vocab, device=logits.device)
        sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], -math.inf)
    if use_top_p:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # NOTE: the first token always stays (mass_before 0 < top_p). top_p == 1 rows are
        # exempted outright: rounding could push mass_before past 1.0 on the tail.
        drop = (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability.

    p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p): no softmax needed. The ratio is
    unchanged by top-k/top-p's renormalisation (they always keep the top token), so this equals
    min-p relative to the max prob right after temperature. min_p = 0 gives log 0 = -inf: no-op.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log()[:, None]
    return logits.masked_fill(logits < threshold, -math.inf)


def _sample_random(x: Tensor, batch: SamplingBatch, generator: torch.Generator | None) -> Tensor:
    # Greedy rows run through with temperature 1 only to keep shapes uniform; `sample`
    # replaces their result by the argmax.
    temperature = batch.temperature.masked_fill(batch.temperature == 0, 1.0)
    x = x / temperature[:, None]
    if batch.any_top_k or batch.any_top_p:
        x = apply_top_k_top_p(x, batch.top_k, batch.top_p,
                              use_top_k=batch.any_top_k, use_top_p=batch.any_top_p)
    if batch.any_min_p:
        x = apply_min_p(x, batch.min_p)
    probs = x.softmax(dim=-1)
    q = torch.empty_like(probs).exponential_(generator=generator)
    if batch.any_seeded:
        if q.is_cuda:  # one counter-based (Philox) kernel for all rows: no host loop
            from arle_kernels.noise import exponential_noise  # Triton: CUDA only
            seeded = exponential_noise(batch.seeds.clamp(min=0), batch.offsets, q.shape[-1])
            q = torch.where((batch.seeds >= 0)[:, None], seeded, q)
        else:
            _fill_seeded_noise(q, batch.seeded_rows)
    # argmax_i p_i / q_i with q_i ~ Exp(1) picks i with probability p_i. NOTE: the clamp keeps a
    # (vanishingly rare) q == 0 from turning a masked 0/0 into NaN, which argmax would pick.
    return probs.div_(q.clamp_(min=torch.finfo(q.dtype).tiny)).argmax(dim=-1)


def _fill_seeded_noise(q: Tensor, seeded_rows: tuple[tuple[int, int, int], ...]) -> None:
    """Overwrite each seeded row's noise with Exp(1) draws that depend only on (seed, offset).

    A host loop with one generator per seeded row: fine on CPU, where seeded rows are few. On
    CUDA `arle_kernels.noise.exponential_noise` draws them in one kernel (another stream: a seed
    reproduces its tokens on the same kind of device).
    """
    vocab = q.shape[-1]
    for row, seed, offset in seeded_rows:
        gen = torch.Generator(device=q.device)
        gen.manual_seed(mix_seed(seed, offset))
        q[row] = torch.empty(vocab, dtype=q.dtype, device=q.device).exponential_(generator=gen)


class PenaltyState:
    """Per-slot output-token counts and prompt-token masks, kept on the device.

    Memory choice: one growable pair of buffers, `counts` [R, V] int32 and `prompt_mask` [R, V]
    bool, with one row per *penalized* live slot, plus a device table `slot -> row` (max_slots
    int64). Row 0 is a sentinel that stays all-zero: slots without penalties map to it, so
    `gather`/`update` can take any slots and run as pure device indexing, never asking the host
    which slots are penalized. The buffers double when full and never shrink, so memory is
    ~ (peak concurrent penalized requests + 1) x V x 5 bytes, not max_slots x V.
    """

    def __init__(self, max_slots: int, vocab_size: int, device: torch.device | str = "cpu",
                 initial_rows: int = 4) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        rows = max(initial_rows, 1) + 1  # + the sentinel
        self.counts = torch.zeros(rows, vocab_size, dtype=torch.int32, device=self.device)
        self.prompt_mask = torch.zeros(rows, vocab_size, dtype=torch.bool, device=self.device)
        self._slot_to_row = torch.zeros(max_slots, dtype=torch.int64, device=self.device)
        self._row_of: dict[int, int] = {}  # host mirror of the table, penalized slots only
        self._free_rows = list(range(rows - 1, 0, -1))  # pop() hands out low rows first

    def __len__(self) -> int:
        return len(self._row_of)

    def __contains__(self, slot: int) -> bool:
        return slot in self._row_of

    def init_slot(self, slot: int, prompt_ids: Sequence[int]) -> None:
        """Start tracking `slot` (a penalized request): no output yet, prompt tokens marked."""
        row = self._row_of.get(slot)
        if row is None:
            if not self._free_rows:
                self._grow()
            row = self._free_rows.pop()
            self._row_of[slot] = row
            self._slot_to_row[slot] = row
        self.counts[row].zero_()
        self.prompt_mask[row].zero_()
        if len(prompt_ids) > 0:
            self.prompt_mask[row, self._ids(prompt_ids)] = True

    def _ids(self, ids: Sequence[int]) -> Tensor:
        """Host ids on the device; on CUDA through pinned memory, so the stream never waits."""
        host = torch.tensor(list(ids), dtype=torch.int64)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def start_slot(self, slot: int, tokens: Sequence[int], num_prompt: int,
                   penalized: bool) -> None:
        """A request starts on `slot` (its tokens: prompt, then outputs when it is recomputed
        after preemption): forget the slot's previous owner, track it if it has penalties."""
        self.free_slot(slot)
        if penalized:
            self.init_slot(slot, tokens[:num_prompt])
            outputs = tokens[num_prompt:]
            if outputs:
                self.update(self._ids([slot] * len(outputs)), self._ids(outputs))

    def free_slot(self, slot: int) -> None:
        """Stop tracking `slot`; a no-op for slots never initialised. Its row is zeroed on reuse."""
        row = self._row_of.pop(slot, None)
        if row is not None:
            self._slot_to_row[slot] = 0
            self._free_rows.append(row)

    def gather(self, slots: Tensor) -> tuple[Tensor, Tensor]:
        """(counts [B, V] int32, prompt_mask [B, V] bool) for `slots` [B], for `sample`."""
        rows = self._slot_to_row[slots]
        return self.counts[rows], self.prompt_mask[rows]

    def update(self, slots: Tensor, token_ids: Tensor) -> None:
        """Count each slot's newly sampled token, on the device."""
        rows = self._slot_to_row[slots]
        # Untracked slots hit the sentinel row with a + 0, which keeps it zero.
        ones = (rows > 0).to(self.counts.dtype)
        self.counts.index_put_((rows, token_ids.to(torch.int64)), ones, accumulate=True)

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = 2 * old - 1  # double the usable rows (all but the sentinel)
        extra = new - old
        self.counts = torch.cat([self.counts, self.counts.new_zeros(extra, self.vocab_size)])
        self.prompt_mask = torch.cat(
            [self.prompt_mask, self.prompt_mask.new_zeros(extra, self.vocab_size)])
        self._free_rows.extend(range(new - 1, old - 1, -1))
