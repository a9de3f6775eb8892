"""Tests for the batched sampler: greedy, seeding, distributions, penalties, logprobs, state."""

from __future__ import annotations

import math

import pytest
import torch

from arle.engine.request import SamplingParams
from arle.executor.sampler import (
    PenaltyState,
    SamplingBatch,
    apply_penalties,
    sample,
    sample_into,
)

P = SamplingParams


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))]


def gen(seed: int, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device).manual_seed(seed)


def batch_of(params: list[SamplingParams], offsets: list[int] | None = None,
             device: str = "cpu") -> SamplingBatch:
    return SamplingBatch.build(params, offsets if offsets is not None else [0] * len(params),
                               device)


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def assert_matches_distribution(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    """Tokens never fall where probs == 0, and their frequencies pass a chi-square test."""
    n = tokens.numel()
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    support = probs > 0
    assert observed[~support].sum() == 0, "sampled a token outside the allowed set"
    expected = n * probs[support].double()
    stat = float(((observed[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    if df > 0:
        assert stat < chi2_critical(df), f"chi2 {stat:.1f} with df {df}"


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax_with_lowest_index_on_ties() -> None:
    logits = torch.randn(16, 100, generator=gen(0))
    logits[3] = torch.tensor([1.0, 3.0, 3.0, 0.0] * 25)  # ties: the first max (index 1) wins
    out = sample(logits, batch_of([P(temperature=0.0)] * 16))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.token_ids[3] == 1
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None and out.top_ids is None


def test_greedy_rows_unaffected_by_other_rows_params() -> None:
    logits = torch.randn(8, 64, generator=gen(1))
    greedy_rows = [0, 2, 5]
    others = [
        P(temperature=0.7, top_k=3, logprobs=5),
        P(temperature=1.3, top_p=0.3, seed=7, repetition_penalty=1.5),
        P(temperature=0.5, min_p=0.4, frequency_penalty=1.0, presence_penalty=-0.5),
        P(temperature=2.0, top_k=2, top_p=0.5, min_p=0.1, seed=3),
        P(temperature=1.0),
    ]
    it = iter(others)
    # Loose filters on greedy rows, so sampling them instead would often miss the argmax.
    params = [P(temperature=0.0, top_k=10 * r, top_p=0.95) if r in greedy_rows
              else next(it) for r in range(8)]
    counts = torch.randint(0, 3, (8, 64), generator=gen(2))  # greedy rows' penalties are neutral
    mask = torch.rand(8, 64, generator=gen(3)) < 0.3
    for g in range(5):
        out = sample(logits, batch_of(params), token_counts=counts, prompt_mask=mask,
                     generator=gen(g))
        assert torch.equal(out.token_ids[greedy_rows], logits[greedy_rows].argmax(dim=-1))


# ---------------------------------------------------------------- seeding


def _seeded_sequence(position: int, batch_size: int, steps: int, seed: int = 1234,
                     executor_seed: int = 0, device: str = "cpu") -> list[int]:
    """Sample `steps` tokens for one seeded request placed at `position` among random rows.
    (On CUDA the seeded noise comes from a Philox kernel, on the CPU from a generator per row.)"""
    target = P(temperature=0.9, top_k=30, seed=seed)
    fillers = [P(temperature=1.0), P(temperature=0.5, seed=99), P(temperature=0.0),
               P(temperature=1.5, top_p=0.7, seed=5)]
    noise = gen(executor_seed + 1000)
    executor_gen = gen(executor_seed, device)
    tokens = []
    for step in range(steps):
        row_logits = 0.5 * torch.randn(50, generator=gen(10_000 + step))
        logits = torch.randn(batch_size, 50, generator=noise)
        logits[position] = row_logits
        params = [fillers[(r + step) % len(fillers)] for r in range(batch_size)]
        params[position] = target
        offsets = [step + 7 * r for r in range(batch_size)]
        offsets[position] = step
        out = sample(logits.to(device), batch_of(params, offsets, device),
                     generator=executor_gen)
        tokens.append(int(out.token_ids[position]))
    return tokens


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_is_independent_of_batch_and_position(device: str) -> None:
    alone = _seeded_sequence(position=0, batch_size=1, steps=30, device=device)
    assert len(set(alone)) > 5  # a real random sequence, not a constant
    for position, size, executor_seed in ((3, 5, 1), (0, 9, 2), (8, 9, 3)):
        assert _seeded_sequence(position, size, 30, executor_seed=executor_seed,
                                device=device) == alone


@pytest.mark.parametrize("device", DEVICES)
def test_different_seeds_give_different_sequences(device: str) -> None:
    a = _seeded_sequence(position=0, batch_size=1, steps=40, seed=1, device=device)
    b = _seeded_sequence(position=0, batch_size=1, steps=40, seed=2, device=device)
    # ~30 plausible tokens per step: chance agreement is a few percent per step.
    assert sum(x != y for x, y in zip(a, b, strict=True)) > 25


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_follow_the_distribution(device: str) -> None:
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3, -1.0])
    n = 4000
    params = [P(temperature=0.8, seed=s) for s in range(n)]  # one draw per seed
    out = sample(logits.expand(n, -1).to(device), batch_of(params, device=device),
                 generator=gen(0, device))
    assert_matches_distribution(out.token_ids.cpu(), torch.softmax(logits / 0.8, dim=-1))


def test_unseeded_rows_are_random() -> None:
    logits = torch.zeros(200, 10)
    batch = batch_of([P(temperature=1.0)] * 200)
    a = sample(logits, batch, generator=gen(1)).token_ids
    b = sample(logits, batch, generator=gen(2)).token_ids
    assert len(set(a.tolist())) > 5
    assert (a != b).sum() > 100
    assert torch.equal(a, sample(logits, batch, generator=gen(1)).token_ids)  # same gen state
    assert sample(logits, batch).token_ids.shape == (200,)  # the global generator works too


# ---------------------------------------------------------------- distributions


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies_match_softmax(temperature: float) -> None:
    logits = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.2, -0.3, 0.8, -2.0])
    n = 20_000
    out = sample(logits.expand(n, -1), batch_of([P(temperature=temperature)] * n),
                 generator=gen(42))
    assert_matches_distribution(out.token_ids, torch.softmax(logits / temperature, dim=-1))


def _reference_filtered_probs(logits: torch.Tensor, temperature: float, top_k: int,
                              top_p: float, min_p: float) -> torch.Tensor:
    """Straightforward reference: softmax, keep top k, renormalise, keep the nucleus,
    renormalise, keep tokens >= min_p * max, renormalise. Also checks that no decision is a
    near-tie, so float rounding in the sampler cannot legitimately differ."""
    probs = [float(p) for p in torch.softmax(logits.double() / temperature, dim=-1)]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep = order[:top_k] if top_k > 0 else order
    total = sum(probs[i] for i in keep)
    if top_p < 1.0:
        nucleus, mass = [], 0.0
        for i in keep:
            nucleus.append(i)
            mass += probs[i] / total
            assert abs(mass - top_p) > 1e-3, "test logits too close to the top-p border"
            if mass >= top_p:
                break
        keep = nucleus
    pmax = max(probs[i] for i in keep)
    for i in keep:
        assert abs(probs[i] - min_p * pmax) > 1e-4, "test logits too close to the min-p border"
    keep = [i for i in keep if probs[i] >= min_p * pmax]
    out = torch.zeros(len(probs), dtype=torch.float64)
    for i in keep:
        out[i] = probs[i]
    return out / out.sum()


FILTER_CASES = [  # (temperature, top_k, top_p, min_p)
    (1.0, 5, 1.0, 0.0),
    (0.7, 0, 0.6, 0.0),
    (1.0, 0, 1.0, 0.2),
    (0.8, 8, 0.8, 0.1),
    (1.5, 12, 0.5, 0.0),
    (1.2, 3, 0.95, 0.3),
]


def test_top_k_top_p_min_p_against_reference() -> None:
    """Several filter settings in ONE batch: each row group must follow its own reference."""
    logits = torch.randn(20, generator=gen(7)) * 1.5
    per_case = 4000
    params, refs = [], []
    for temperature, top_k, top_p, min_p in FILTER_CASES:
        params += [P(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)] * per_case
        refs.append(_reference_filtered_probs(logits, temperature, top_k, top_p, min_p))
    # Interleave the groups so each row's neighbours have other parameters.
    n_cases = len(FILTER_CASES)
    perm = torch.arange(n_cases * per_case).view(n_cases, per_case).t().reshape(-1)
    params = [params[i] for i in perm.tolist()]
    out = sample(logits.expand(len(params), -1), batch_of(params), generator=gen(3))
    for case, ref in enumerate(refs):
        tokens = out.token_ids[(perm // per_case) == case]  # perm[i]: original index of row i
        assert_matches_distribution(tokens, ref)
        assert (ref > 0).sum() < 20  # every case really filters something


def test_top_k_never_leaves_top_k() -> None:
    logits = torch.randn(4000, 100, generator=gen(11))
    ks = torch.randint(1, 6, (4000,), generator=gen(12))
    params = [P(temperature=3.0, top_k=int(k)) for k in ks]
    out = sample(logits, batch_of(params), generator=gen(13))
    rank = (logits > logits.gather(1, out.token_ids[:, None])).sum(dim=1)  # 0 = best
    assert (rank < ks).all()
    assert (rank == ks - 1).any()  # and it does reach the k-th


def test_top_p_never_leaves_nucleus() -> None:
    logits = torch.randn(2000, 30, generator=gen(21)) * 2
    top_p = 0.5
    out = sample(logits, batch_of([P(temperature=1.0, top_p=top_p)] * 2000), generator=gen(22))
    probs = torch.softmax(logits.double(), dim=-1)
    for row in range(2000):
        nucleus, mass = set(), 0.0
        for i in sorted(range(30), key=lambda i: -float(probs[row, i])):
            nucleus.add(i)
            mass += float(probs[row, i])
            if mass >= top_p:
                break
        assert int(out.token_ids[row]) in nucleus


def test_min_p_never_below_threshold() -> None:
    logits = torch.randn(2000, 30, generator=gen(31)) * 2
    out = sample(logits, batch_of([P(temperature=0.7, min_p=0.3)] * 2000), generator=gen(32))
    probs = torch.softmax(logits.double() / 0.7, dim=-1)
    chosen = probs.gather(1, out.token_ids[:, None]).squeeze(1)
    assert (chosen >= 0.3 * probs.max(dim=1).values - 1e-6).all()
    assert (chosen < probs.max(dim=1).values).any()  # not degenerate greedy


# ---------------------------------------------------------------- penalties


def _reference_penalties(logits: torch.Tensor, counts: torch.Tensor, mask: torch.Tensor,
                         rep: list[float], freq: list[float], pres: list[float]) -> torch.Tensor:
    out = logits.clone()
    for b in range(logits.shape[0]):
        for v in range(logits.shape[1]):
            x = float(logits[b, v])
            c = int(counts[b, v])
            if c > 0 or bool(mask[b, v]):
                x = x / rep[b] if x > 0 else x * rep[b]
            x -= freq[b] * c
            if c > 0:
                x -= pres[b]
            out[b, v] = x
    return out


def _random_penalty_case(seed: int, rows: int = 6, vocab: int = 40):
    g = gen(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    counts = torch.randint(0, 4, (rows, vocab), generator=g) * (
        torch.rand(rows, vocab, generator=g) < 0.3)
    mask = torch.rand(rows, vocab, generator=g) < 0.2
    rep = [0.5 + 1.5 * float(x) for x in torch.rand(rows, generator=g)]
    freq = [4 * float(x) - 2 for x in torch.rand(rows, generator=g)]
    pres = [4 * float(x) - 2 for x in torch.rand(rows, generator=g)]
    rep[0], freq[0], pres[0] = 1.0, 0.0, 0.0  # one neutral row
    params = [P(temperature=0.0, repetition_penalty=r, frequency_penalty=f, presence_penalty=p)
              for r, f, p in zip(rep, freq, pres, strict=True)]
    return logits, counts, mask, rep, freq, pres, params


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_penalties_match_reference(seed: int) -> None:
    logits, counts, mask, rep, freq, pres, params = _random_penalty_case(seed)
    batch = batch_of(params)
    assert batch.any_penalty
    got = apply_penalties(logits, batch, counts, mask)
    ref = _reference_penalties(logits, counts, mask, rep, freq, pres)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[0], logits[0])  # neutral row is bit-identical
    # End to end: greedy rows take the argmax of the penalized logits.
    out = sample(logits, batch, token_counts=counts, prompt_mask=mask)
    assert torch.equal(out.token_ids, ref.argmax(dim=-1))


def test_penalties_require_state() -> None:
    with pytest.raises(ValueError):
        sample(torch.zeros(1, 4), batch_of([P(presence_penalty=1.0)]))


def test_penalty_state_drives_sampling_like_a_reference_loop() -> None:
    """Greedy decoding with a frequency penalty, counts kept on device by PenaltyState."""
    vocab = 6
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.0, -1.0, 1.0]])
    state = PenaltyState(max_slots=4, vocab_size=vocab)
    state.init_slot(2, [5])
    slots = torch.tensor([2])
    batch = batch_of([P(temperature=0.0, frequency_penalty=0.6, repetition_penalty=1.2)])
    ref_counts = [0] * vocab
    tokens = []
    for _ in range(8):
        counts, mask = state.gather(slots)
        tok = sample(logits, batch, token_counts=counts, prompt_mask=mask).token_ids
        state.update(slots, tok)
        tokens.append(int(tok))
        # Reference step in plain Python.
        scores = []
        for v, x in enumerate(logits[0].tolist()):
            if ref_counts[v] > 0 or v == 5:
                x = x / 1.2 if x > 0 else x * 1.2
            scores.append(x - 0.6 * ref_counts[v])
        best = max(range(vocab), key=lambda v: (scores[v], -v))
        assert best == tokens[-1]
        ref_counts[best] += 1
    assert len(set(tokens)) >= 3  # the penalty really moves the choice around


@pytest.mark.parametrize("extra", [{}, {"frequency_penalty": 0.5}, {"logprobs": 0},
                                   {"temperature": 0.7}], ids=["greedy", "penalty", "logprobs",
                                                              "sampled"])
def test_sample_into_takes_the_greedy_pick_only_when_it_suffices(extra: dict) -> None:
    """A batch of plain greedy rows goes to `greedy` (the executor's kernel), anything else
    through `sample`; either way the tokens land at the rows' slots in the token buffer."""
    logits = torch.randn(3, 40, generator=gen(4))
    slots = torch.tensor([5, 1, 3], dtype=torch.int32)
    calls = []

    def greedy(lg: torch.Tensor, sl: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        calls.append(lg.shape)
        ids = lg.float().argmax(-1)
        buf[sl] = ids.int()
        return ids

    state = PenaltyState(max_slots=8, vocab_size=40)
    for slot in (5, 1, 3):
        state.init_slot(slot, [0])
    params = [P(**({"temperature": 0.0} | extra)), P(temperature=0.0), P(temperature=0.0)]
    buf = torch.full((8,), -1, dtype=torch.int32)
    out = sample_into(logits, batch_of(params), slots, state, buf, gen(0), greedy)
    assert calls == ([logits.shape] if not extra else [])
    assert buf[slots.long()].tolist() == out.token_ids.tolist()
    if "temperature" not in extra and "frequency_penalty" not in extra:
        assert out.token_ids.tolist() == logits.argmax(-1).tolist()


# ---------------------------------------------------------------- logprobs


def test_logprobs_use_raw_logits_and_top_n_is_sorted() -> None:
    logits = torch.randn(5, 40, generator=gen(51)) * 2
    counts = torch.randint(0, 3, (5, 40), generator=gen(52))
    mask = torch.zeros(5, 40, dtype=torch.bool)
    params = [P(temperature=0.0, logprobs=3, frequency_penalty=1.0),
              P(temperature=1.4, top_k=10, logprobs=0),
              P(temperature=0.6, top_p=0.5, logprobs=None, presence_penalty=2.0),
              P(temperature=1.0, seed=4, logprobs=5),
              P(temperature=0.3, min_p=0.2)]
    batch = batch_of(params)
    assert batch.num_logprobs == 5
    out = sample(logits, batch, token_counts=counts, prompt_mask=mask, generator=gen(53))
    assert out.logprobs is not None and out.top_ids is not None and out.top_logprobs is not None
    ref = torch.log_softmax(logits.double(), dim=-1)
    torch.testing.assert_close(out.logprobs.double(),
                               ref.gather(1, out.token_ids[:, None]).squeeze(1))
    order = ref.argsort(dim=-1, descending=True)[:, :5]
    assert torch.equal(out.top_ids, order)
    torch.testing.assert_close(out.top_logprobs.double(), ref.gather(1, order))
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    assert out.logprobs.dtype == torch.float32


def test_logprobs_only_chosen_or_none() -> None:
    logits = torch.randn(2, 10, generator=gen(61))
    chosen_only = sample(logits, batch_of([P(temperature=0.0, logprobs=0), P(temperature=0.0)]))
    assert chosen_only.logprobs is not None and chosen_only.top_ids is None
    assert sample(logits, batch_of([P(temperature=0.0)] * 2)).logprobs is None


# ---------------------------------------------------------------- batch building


def test_build_flags_and_normalisation() -> None:
    params = [P(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2, seed=3),
              P(temperature=1.0, top_k=-1, seed=11, logprobs=2),
              P(temperature=0.5, presence_penalty=0.5)]
    b = SamplingBatch.build(params, [4, 7, 0], "cpu")
    assert b.top_k.tolist() == [5, 0, 0]
    assert b.seeds.tolist() == [3, 11, -1]
    assert b.offsets.tolist() == [4, 7, 0]
    assert b.num_logprobs == 2
    # Flags ignore greedy rows' filter/seed values (they never matter) but not their penalties.
    assert not b.all_greedy and not b.any_top_k and not b.any_top_p and not b.any_min_p
    assert b.any_penalty and b.any_seeded and b.seeded_rows == ((1, 11, 7),)
    assert b.temperature.dtype == torch.float32 and b.top_k.dtype == torch.int64
    with pytest.raises(ValueError):
        SamplingBatch.build(params, [0], "cpu")


def test_batch_rules_and_tensors() -> None:
    """What the CUDA executor decides from a batch: whether it takes the one-pass greedy pick,
    whether its per-row tensors must reach the device, and which tensors those are."""
    plain = batch_of([P(temperature=0.0)] * 2)
    assert plain.takes_greedy_pick and not plain.reads_tensors
    with_logprobs = batch_of([P(temperature=0.0, logprobs=1)])
    assert not with_logprobs.takes_greedy_pick and not with_logprobs.reads_tensors
    penalised = batch_of([P(temperature=0.0, repetition_penalty=1.2)])
    assert not penalised.takes_greedy_pick and penalised.reads_tensors
    sampled = batch_of([P(temperature=0.7)])
    assert not sampled.takes_greedy_pick and sampled.reads_tensors
    tensors = sampled.tensors()
    assert len(tensors) == 9 and all(isinstance(t, torch.Tensor) for t in tensors)
    assert any(t is sampled.temperature for t in tensors)
    assert any(t is sampled.offsets for t in tensors)


def test_empty_batch() -> None:
    b = batch_of([])
    assert b.all_greedy and b.num_logprobs == -1
    assert sample(torch.zeros(0, 7), b).token_ids.shape == (0,)


# ---------------------------------------------------------------- PenaltyState


def test_penalty_state_counts_masks_and_slot_reuse() -> None:
    state = PenaltyState(max_slots=8, vocab_size=10, initial_rows=1)
    state.init_slot(3, [1, 2, 2])
    state.init_slot(5, [])
    state.init_slot(6, [9])  # forces a second growth; earlier rows must survive it
    assert len(state) == 3 and 3 in state and 0 not in state
    assert state.counts.shape[0] <= 1 + 2 * len(state)  # sized by penalized slots, not max_slots

    # Slot 0 is not tracked: it rides along and must read back as "nothing seen".
    state.update(torch.tensor([3, 5, 0]), torch.tensor([4, 4, 7]))
    state.update(torch.tensor([3, 5, 0]), torch.tensor([4, 9, 7]))
    counts, mask = state.gather(torch.tensor([3, 5, 0, 6]))
    expect = torch.zeros(4, 10, dtype=torch.int32)
    expect[0, 4] = 2
    expect[1, 4] = 1
    expect[1, 9] = 1
    assert torch.equal(counts, expect)
    expect_mask = torch.zeros(4, 10, dtype=torch.bool)
    expect_mask[0, [1, 2]] = True
    expect_mask[3, 9] = True
    assert torch.equal(mask, expect_mask)

    # Free slot 3; a new request in slot 1 reuses its row and must start clean.
    rows_before = state.counts.shape[0]
    state.free_slot(3)
    state.free_slot(3)  # idempotent
    assert 3 not in state
    state.init_slot(1, [0])
    assert state.counts.shape[0] == rows_before
    counts, mask = state.gather(torch.tensor([1, 3, 5]))
    assert counts[0].sum() == 0 and mask[0].nonzero().flatten().tolist() == [0]
    assert counts[1].sum() == 0 and not mask[1].any()  # freed slot reads as untracked
    assert int(counts[2, 4]) == 1 and int(counts[2].sum()) == 2  # slot 5 untouched
    state.update(torch.tensor([1, 3]), torch.tensor([2, 2]))
    counts, _ = state.gather(torch.tensor([1, 3]))
    assert int(counts[0, 2]) == 1 and int(counts[1].sum()) == 0
