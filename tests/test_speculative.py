"""Speculative decoding on the CPU: verify rows give the tokens and logprobs of speculation off
(dense, hybrid and MoE models; chunked prefill, prefix hits, preemption, cancellation, stops
inside an accepted run), seeded sampling draws the same tokens, unseeded sampling keeps the
target's distribution (a chi-square test), and every page, slot and state comes back.

Drafts come from an oracle where a test needs them on random-weight models (whose outputs
rarely repeat themselves): the spec-off run's tokens, with every few drafts made wrong, so that
verify rows accept some drafts and reject others at every position. The n-gram lookup itself
is tested on its own and on the default model's text."""

from __future__ import annotations

import asyncio
import io
import math
import random
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    assert_all_pages_back,
    cancel_mid_stream,
    run,
    run_many,
    run_together,
    tokens_of,
)
from helpers import (
    Oracle,
    load_script,
    require_smollm2_gguf,
    run_interpreter_check,
    with_oracle,
)
from model_dirs import hf_config, write_model_dir, write_qwen3_5_dir

from arle.engine.async_engine import AsyncEngine
from arle.engine.request import Delta, GenerateRequest, SamplingParams
from arle.engine.speculative import (
    DEVICE_RULES,
    Drafter,
    MTPDrafter,
    NgramIndex,
    RequestSpec,
    SpecConfig,
    accepted_drafts,
    whole_blocks,
)
from arle.model.loader import LoadedModel, load_model
from arle.server.metrics import ServerMetrics

MODELS = ("dense", "hybrid", "moe")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoadedModel]:
    root = tmp_path_factory.mktemp("spec")
    write_model_dir(root / "dense", hf_config("Qwen3ForCausalLM"), seed=1)
    write_model_dir(root / "moe", hf_config("Qwen3MoeForCausalLM"), seed=2)
    write_qwen3_5_dir(root / "hybrid", seed=3, vocab_size=259)
    return {name: load_model(root / name, "float32") for name in MODELS}


def prompt(n: int, seed: int) -> list[int]:
    return [32 + (seed * 31 + i * 7) % 90 for i in range(n)]


def logprobs(deltas: list[Delta]) -> list[float]:
    return [x for d in deltas for lp in d.logprobs or []
            for x in (lp.logprob, *(a[1] for a in lp.top))]


def spec_of(deltas: list[Delta]) -> dict[str, int]:
    trace = deltas[-1].trace
    assert trace is not None and trace["spec"] is not None
    return dict(trace["spec"])


def assert_same(got: list[list[Delta]], want: list[list[Delta]]) -> None:
    """Tokens equal; logprobs (the chosen token's and the top 2) within fp32 rounding: a
    verify row's linears run over more rows than a decode step's."""
    for g, w in zip(got, want, strict=True):
        assert tokens_of(g) == tokens_of(w)
        a, b = logprobs(g), logprobs(w)
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("name", MODELS)
async def test_greedy_equals_off(models: dict[str, LoadedModel], make_engine: Any, name: str,
                                 k: int) -> None:
    """A batch of requests: chunked prefills (16-token chunks), two with a shared prefix, run
    twice (the second time their prompts hit the prefix cache)."""
    loaded = models[name]
    shared = prompt(40, 9)
    prompts = [prompt(23, 1), prompt(57, 2), shared + prompt(5, 3), shared + prompt(9, 4)]
    params = {"max_tokens": 30, "ignore_eos": True, "logprobs": 2}
    off = make_engine(loaded, chunked_prefill_size=16)
    want = await run_many(off, prompts, **params)
    on = with_oracle(make_engine(loaded, chunked_prefill_size=16, speculative="ngram",
                                 num_speculative_tokens=k), prompts,
                     [tokens_of(d) for d in want])
    for _ in range(2):
        got = await run_many(on, prompts, **params)
        assert_same(got, want)
    assert all(d[-1].trace and d[-1].trace["prefix"]["matched_tokens"] >= 32 for d in got[2:])
    spec = [spec_of(d) for d in got]
    assert all(0 < s["accepted"] < s["drafted"] for s in spec), spec
    assert on.stats["spec_accepted_tokens"] > 0
    on.cache.check([])


@pytest.mark.parametrize("name", ["dense", "hybrid"])
async def test_preemption_and_cancellation(models: dict[str, LoadedModel], make_engine: Any,
                                           name: str) -> None:
    """A pool too small for all requests at once: requests are preempted (some with a verify
    row in flight) and recomputed; their tokens are speculation off's. A request cancelled
    while it verifies gives everything back."""
    loaded = models[name]
    prompts = [prompt(40, 20 + i) for i in range(6)]
    params = {"max_tokens": 50, "ignore_eos": True, "logprobs": 0}
    want = await run_many(make_engine(loaded), prompts, **params)
    tight = with_oracle(make_engine(loaded, kv_cache_tokens=320, max_model_len=160,
                                    speculative="ngram", num_speculative_tokens=3),
                        prompts, [tokens_of(d) for d in want])
    got = await run_many(tight, prompts, **params)
    assert tight.scheduler.num_preemptions > 0
    assert_same(got, want)
    assert_all_pages_back(tight)

    engine = make_engine(loaded, speculative="ngram", num_speculative_tokens=4)
    endless = prompt(30, 5)
    engine.scheduler.drafter = Oracle(engine.scheduler.drafter.config,  # type: ignore[union-attr]
                                      {tuple(endless): [7] * 100000}, wrong=0)
    req = GenerateRequest(prompt=endless,
                          params=SamplingParams(max_tokens=100000, ignore_eos=True,
                                                temperature=0.0))
    await cancel_mid_stream(engine, req, timeout=60)
    assert engine.stats["spec_verify_steps"] > 0
    assert_all_pages_back(engine)


async def test_runs_end_inside_an_accepted_run(models: dict[str, LoadedModel],
                                               make_engine: Any) -> None:
    """Drafts all right, 8 a row: max_tokens and a stop token end a request in the middle of
    what one verify row accepted; the tokens after are dropped, the pages come back."""
    loaded = models["dense"]
    ids = prompt(30, 6)
    full = tokens_of(await run(make_engine(loaded), ids, max_tokens=40, ignore_eos=True))
    engine = with_oracle(make_engine(loaded, speculative="ngram", num_speculative_tokens=8),
                         [ids], [full], wrong=0)
    got = await run(engine, ids, max_tokens=11, ignore_eos=True)
    assert tokens_of(got) == full[:11] and got[-1].finish_reason == "length"
    stop = full[13]
    first = full.index(stop)
    got = await run(engine, ids, max_tokens=40, stop_token_ids=(stop,), ignore_eos=True)
    assert tokens_of(got) == full[:first + 1] and got[-1].stop_reason == stop
    assert spec_of(got)["accepted"] >= first - 1
    assert_all_pages_back(engine)


async def test_seeded_sampling_draws_the_same_tokens(models: dict[str, LoadedModel],
                                                      make_engine: Any) -> None:
    """Each sampled position draws the noise of its output offset: a seeded request's tokens
    are speculation off's, whatever the drafts."""
    for name in ("dense", "hybrid"):
        loaded = models[name]
        prompts = [prompt(20, 30 + i) for i in range(3)]
        params = {"max_tokens": 24, "ignore_eos": True, "temperature": 0.9, "seed": 5}
        want = await run_many(make_engine(loaded), prompts, **params)
        on = with_oracle(make_engine(loaded, speculative="ngram", num_speculative_tokens=4),
                         prompts, [tokens_of(d) for d in want])
        got = await run_many(on, prompts, **params)
        assert [tokens_of(d) for d in got] == [tokens_of(d) for d in want]
        assert on.stats["spec_accepted_tokens"] > 0


#: chi-square's 0.999 quantiles by degrees of freedom: a correct sampler fails one run in a
#: thousand
CHI2_999 = (10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32)


def chi_square_passes(counts: dict[int, int], probs: dict[int, float]) -> bool:
    """Pearson's test of `counts` against `probs`, cells expecting fewer than 5 draws pooled."""
    n = sum(counts.values())
    assert set(counts) <= set(probs), "a token outside the target's support"
    cells: list[tuple[int, float]] = []
    pooled = (0, 0.0)
    for t, p in probs.items():
        if n * p < 5:
            pooled = (pooled[0] + counts.get(t, 0), pooled[1] + n * p)
        else:
            cells.append((counts.get(t, 0), n * p))
    if pooled[1] > 0:
        cells.append(pooled)
    stat = sum((c - e) ** 2 / e for c, e in cells)
    assert len(cells) >= 3, "too few draws for a test"
    return stat < CHI2_999[len(cells) - 2]


async def target(engine: AsyncEngine, ids: list[int], temperature: float) -> dict[int, float]:
    """The sampling distribution at the position after `ids`: top 8 (top_k) at `temperature`,
    from the raw logprobs speculation off reports."""
    deltas = await run(engine, ids, max_tokens=1, ignore_eos=True, logprobs=8)
    lp = deltas[0].logprobs
    assert lp is not None and lp[0] is not None
    weights = {t: math.exp(x / temperature) for t, x in lp[0].top}
    total = sum(weights.values())
    return {t: w / total for t, w in weights.items()}


async def test_sampling_keeps_the_target_distribution(models: dict[str, LoadedModel],
                                                      make_engine: Any) -> None:
    """Unseeded requests of three tokens. The first comes from the prefill; after the likeliest
    first token d1, each request verifies the two likeliest next ones (d2, d3): the second token
    (d2 accepted, or resampled without it) and the third after an accepted d2 (sampled in the
    verify row itself) follow the target's distributions."""
    loaded = models["dense"]
    temperature = 0.8
    ids = prompt(12, 40)
    off = make_engine(loaded)
    d1, d2, d3 = tokens_of(await run(off, ids, max_tokens=3, ignore_eos=True))
    p2 = await target(off, [*ids, d1], temperature)
    p3 = await target(off, [*ids, d1, d2], temperature)
    on = make_engine(loaded, speculative="ngram", num_speculative_tokens=2,
                     max_running_requests=6, max_waiting_requests=4000)
    on.scheduler.drafter = Oracle(on.scheduler.drafter.config,  # type: ignore[union-attr]
                                  {tuple(ids): [d1, d2, d3]}, wrong=0)
    draws = await run_many(on, [ids] * 3000, max_tokens=3, ignore_eos=True,
                           temperature=temperature, top_k=8)
    seconds: dict[int, int] = {}
    thirds: dict[int, int] = {}
    for d in draws:
        t = tokens_of(d)
        if t[0] == d1:
            seconds[t[1]] = seconds.get(t[1], 0) + 1
            if t[1] == d2:
                thirds[t[2]] = thirds.get(t[2], 0) + 1
    assert chi_square_passes(seconds, p2)
    assert chi_square_passes(thirds, p3)
    accepted, drafted = on.stats["spec_accepted_tokens"], on.stats["spec_draft_tokens"]
    assert 0 < accepted < drafted


async def test_rows_that_never_draft(models: dict[str, LoadedModel], make_engine: Any) -> None:
    """Penalties count every sampled token and a grammar advances on each: such requests
    decode one token a step (their trace has no spec block); the others draft beside them."""
    loaded = models["dense"]
    ids = prompt(20, 50)
    full = tokens_of(await run(make_engine(loaded), ids, max_tokens=20, ignore_eos=True))
    engine = with_oracle(make_engine(loaded, speculative="ngram"), [ids], [full], wrong=0)
    penalized, plain = await asyncio.gather(
        run(engine, ids, max_tokens=20, ignore_eos=True, repetition_penalty=1.3),
        run(engine, ids, max_tokens=20, ignore_eos=True))
    assert penalized[-1].trace and penalized[-1].trace["spec"] is None
    assert tokens_of(plain) == full and spec_of(plain)["accepted"] > 0


async def test_low_acceptance_steps_aside(models: dict[str, LoadedModel],
                                          make_engine: Any) -> None:
    """Drafts that are always wrong: the request stops drafting after a few verify rows, and
    comes back to try again less and less often (8 drafts cost 1 decode step on the CPU: 4
    verify rows each time, 8, 16, 32, 64 tokens apart)."""
    loaded = models["dense"]
    ids = prompt(20, 60)
    engine = make_engine(loaded, speculative="ngram")
    engine.scheduler.drafter = Oracle(engine.scheduler.drafter.config,  # type: ignore[union-attr]
                                      {tuple(ids): [0] * 200}, wrong=0)
    got = await run(engine, ids, max_tokens=120, ignore_eos=True)
    spec = spec_of(got)
    assert spec["accepted"] == 0 and 0 < spec["verify_steps"] <= 16, spec


def test_ngram_lookup() -> None:
    """The longest suffix (max_n down to min_n) seen before, its latest occurrence, the tokens
    after it; never the suffix itself."""
    index = NgramIndex(2, 3)
    tokens = [1, 2, 3, 9, 1, 2, 4, 7, 2, 3, 5, 1, 2]
    assert index.propose(tokens, 3) == [4, 7, 2]  # (1, 2) last followed by 4
    assert index.propose([*tokens, 3], 3) == [9, 1, 2]  # (1, 2, 3): only at the start
    assert index.propose([*tokens, 3, 8], 3) == []  # (3, 8) and (2, 3, 8) never seen
    assert NgramIndex(2, 3).propose([5, 5, 5], 4) == [5]  # the run so far
    assert NgramIndex(2, 3).propose([1, 2], 4) == []
    grown = NgramIndex(2, 3)  # grown token by token: as built at once
    for n in range(1, len(tokens) + 1):
        grown.propose(tokens[:n], 2)
    assert grown.propose([*tokens, 3], 2) == NgramIndex(2, 3).propose([*tokens, 3], 2)


def brute_force_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The lookup's definition, searched position by position."""
    end = len(tokens)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        for j in range(end - n - 1, -1, -1):
            if tokens[j:j + n] == tokens[end - n:]:
                return tokens[j + n:j + n + k]
    return []


def test_ngram_lookup_is_its_definition() -> None:
    """On random token streams of a small vocabulary (many repeats), grown as a request
    grows (past the array's first 256 entries): every step's drafts are the brute-force
    search's."""
    rng = random.Random(0)
    for vocab in (3, 8, 40):
        index, tokens = NgramIndex(2, 4), []
        for _ in range(400):
            tokens.append(rng.randrange(vocab))
            assert index.propose(tokens, 5) == brute_force_lookup(tokens, 5, 2, 4)


def test_accepted_drafts_and_the_rule() -> None:
    assert accepted_drafts([4, 5, 6], [4, 5, 9, 1]) == 2
    assert accepted_drafts([4, 5, 6], [4, 5, 6, 1]) == 3
    assert accepted_drafts([4], [3, 4]) == 0
    drafter = Drafter(SpecConfig(num_tokens=4, draft_cost=0.25, backoff=8))
    spec = drafter.start()
    for accepted, num_output in ((4, 5), (0, 6), (0, 7)):  # recent mean 4, 2, 1: >= 4 * 0.25
        drafter.verified(spec, 4, accepted, num_output)
    assert spec.resume_at == 0
    drafter.verified(spec, 4, 0, num_output=8)  # 0.5 < 1: aside for 8 tokens
    assert spec.resume_at == 8 + 8
    assert drafter.propose(spec, [1, 2, 1, 2], num_output=15, room=4) == []
    assert drafter.propose(spec, [1, 2, 1, 2], num_output=16, room=4) == [1, 2]
    for n in range(3):  # from the best case again: 2, 1, 0.5; aside for 16 tokens
        drafter.verified(spec, 4, 0, num_output=20 + n)
    assert spec.resume_at == 22 + 16
    # a verify row's fixed cost (a hybrid model's on CUDA): one-draft rows that keep none go
    # aside at the third (recent 2, 1, 0.5 < 0.78), where the per-draft cost alone took eight
    for fixed, aside_at in ((0.75, 3), (0.0, 8)):
        drafter = Drafter(SpecConfig(num_tokens=4, verify_cost=fixed, draft_cost=0.03))
        spec = drafter.start()
        steps = 0
        while spec.resume_at == 0:
            steps += 1
            drafter.verified(spec, 1, 0, num_output=steps)
        assert steps == aside_at


def test_cpu_verify_rows_come_in_blocks_of_four() -> None:
    """The CPU's packed matmuls read the weights once per 4 rows: a verify row's tokens (its
    last token and the drafts) are whole blocks of 4 once there is one; fewer drafts, never
    more than asked."""
    assert [whole_blocks(k, 4) for k in range(1, 10)] == [1, 2, 3, 3, 3, 3, 7, 7, 7]
    assert [whole_blocks(k, 1) for k in range(1, 10)] == list(range(1, 10))
    drafter = Drafter(DEVICE_RULES["cpu"])
    tokens = list(range(20)) * 2
    for room, want in ((8, 7), (6, 3), (2, 2)):
        assert drafter.propose(drafter.start(), tokens, 0, room) == list(range(want))


def test_hybrid_and_moe_engines_draft_by_their_own_rules(models: dict[str, LoadedModel],
                                                         make_engine: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine of Gated DeltaNet layers takes its device's HYBRID_RULES, one of expert MLPs
    its MOE_RULES (CUDA's, measured there; here CPU entries stand in for them), a dense one
    the device's rule."""
    import arle.engine.speculative as speculative

    monkeypatch.setitem(speculative.HYBRID_RULES, "cpu", (0.5, 0.07))
    monkeypatch.setitem(speculative.MOE_RULES, "cpu", (2.0, 0.01))
    for name, want in (("hybrid", (0.5, 0.07)), ("moe", (2.0, 0.01)), ("dense", (0.0, 0.23))):
        drafter = make_engine(models[name], speculative="ngram").scheduler.drafter
        assert drafter is not None
        assert (drafter.config.verify_cost, drafter.config.draft_cost) == want, name


def test_warmup_reports_the_rule(models: dict[str, LoadedModel], make_engine: Any) -> None:
    from arle.diagnostics import memory_plan

    plan = memory_plan(make_engine(models["dense"], speculative="ngram"))
    assert plan["speculative"]["method"] == "ngram"
    assert plan["speculative"]["num_tokens"] == 8  # the CPU's default
    assert memory_plan(make_engine(models["dense"]))["speculative"] is None


def test_metrics_show_the_acceptance_rate() -> None:
    snap = {"running": 0, "waiting": 0, "kv_pages_total": 4, "kv_pages_free": 4,
            "kv_pages_cached": 0, "preemptions": 0, "spec_draft_tokens": 40,
            "spec_accepted_tokens": 30, "spec_verify_steps": 10}
    text = ServerMetrics(lambda: snap).prometheus_text().decode()
    assert "arle_spec_acceptance_rate 0.75" in text
    assert "arle_spec_draft_tokens_total 40.0" in text


async def test_ngram_drafts_on_the_default_model(smol: LoadedModel, make_engine: Any) -> None:
    """Real text: an edit task copies most of its prompt; n-gram drafts are accepted and the
    answer is speculation off's."""
    require_smollm2_gguf()
    messages = [{"role": "user", "content": load_script("bench_speculative").TASKS["edit"]}]
    want = await run(make_engine(smol), messages=messages, max_tokens=60, logprobs=0)
    got = await run(make_engine(smol, speculative="ngram", num_speculative_tokens=4),
                    messages=messages, max_tokens=60, logprobs=0)
    assert_same([got], [want])
    spec = spec_of(got)
    assert spec["accepted"] > 10, spec


async def test_int4_default_model_equals_off(make_engine: Any) -> None:
    """The default model as the CPU runs it (int4 and int8 weights, bf16 products): a batch
    of the three benchmark tasks, speculation on (K = 8) against off, the same tokens and
    logprobs. It holds because a verify row's tokens get their decode rows' attention bits
    (kernels/extend_attention_ref.py: token by token, or one run from 64 keys), and the
    packed kernels give a row the same numbers whatever the rows beside it; a batched, padded attention flipped near-ties here. The
    prefills are not row-invariant: a long step runs bf16-expanded weights, a short one
    (PACKED_MAX_ROWS) the packed kernel. So the three requests arrive together in both engines
    (`run_together`), and the prefix cache is off (a prefix one request computed in another's
    step would carry that step's numbers)."""
    loaded = load_model(require_smollm2_gguf(), "auto")
    tasks = load_script("bench_speculative").TASKS
    prompts = [loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": tasks[t]}])) for t in ("edit", "quote", "chat")]
    params = {"max_tokens": 100, "ignore_eos": True, "logprobs": 1}
    # NOTE: a fixed thread count (no governor): a bf16 GEMM's sums follow its threads
    fixed = {"enable_prefix_cache": False, "num_threads": torch.get_num_threads()}
    want = await run_together(make_engine(loaded, **fixed), prompts, **params)
    got = await run_together(make_engine(loaded, speculative="ngram", num_speculative_tokens=8,
                                         **fixed), prompts, **params)
    assert_same(got, want)
    assert sum(spec_of(d)["accepted"] for d in got) > 50


def test_flags_on_every_command() -> None:
    """--speculative and --num-speculative-tokens on complete, chat, serve and warmup; K out
    of [1, 8] is refused before anything loads."""
    from typer.testing import CliRunner

    from arle.cli.app import app

    for command in ("complete", "chat", "serve", "warmup"):
        out = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output
        assert "--speculative" in out and "--num-speculative-tokens" in out, command
    bad = CliRunner().invoke(app, ["complete", "x", "--num-speculative-tokens", "9"])
    assert bad.exit_code == 2 and "--num-speculative-tokens" in bad.output


async def test_chat_status_line_shows_tokens_per_step(smol: LoadedModel,
                                                      make_engine: Any) -> None:
    from arle.chat.backends import EngineBackend
    from arle.chat.session import ChatSession

    out = io.StringIO()
    engine = make_engine(smol, speculative="ngram")
    session = ChatSession(EngineBackend(engine), out=out, color=False,
                          settings={"temperature": 0.0, "max_tokens": 80})
    await session.run_piped([load_script("bench_speculative").TASKS["quote"]])
    stats = session.last_stats
    assert stats is not None and stats.tokens_per_step is not None
    assert stats.tokens_per_step > 1.5
    assert f"{stats.tokens_per_step:.2f} tok/step" in out.getvalue()


def interp_check_hybrid_verify() -> None:
    """Under TRITON_INTERPRET=1: a hybrid model's verify rows through the Triton kernels (each
    token's recurrence a one-token call on the slot's state, its state kept; the next step
    restoring the last accepted one) give the greedy tokens of the torch references without
    speculation."""
    import tempfile

    from arle.config import EngineConfig
    from arle.engine.build import engine_from_loaded
    from arle_kernels.ops import triton_ops

    async def tokens(engine: AsyncEngine, ids: list[int]) -> list[int]:
        try:
            return tokens_of(await run(engine, ids, max_tokens=10, ignore_eos=True))
        finally:
            await engine.close()

    with tempfile.TemporaryDirectory() as tmp:
        write_qwen3_5_dir(Path(tmp), seed=3, vocab_size=259)
        loaded = load_model(tmp, "float32")
    ids = prompt(21, 7)
    config = EngineConfig(kv_cache_tokens=256, max_running_requests=2)
    want = asyncio.run(tokens(engine_from_loaded(config, loaded), ids))
    engine = engine_from_loaded(replace(config, speculative="ngram", num_speculative_tokens=3),
                                loaded)
    engine.executor.dev.model.ops = triton_ops()  # type: ignore[attr-defined]
    with_oracle(engine, [ids], [want])
    assert asyncio.run(tokens(engine, ids)) == want
    assert 0 < engine.stats["spec_accepted_tokens"] < engine.stats["spec_draft_tokens"]


@pytest.mark.slow
def test_hybrid_verify_rows_through_the_triton_kernels() -> None:
    run_interpreter_check("test_speculative", "interp_check_hybrid_verify")


# ---- --speculative mtp: Qwen3.5's multi-token prediction head -------------------------------

@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3.5 in the published layout, with its MTP head (`write_mtp_head`)."""
    path = tmp_path_factory.mktemp("mtp") / "qwen3_5"
    write_qwen3_5_dir(path, seed=3, vocab_size=259)
    return path


class Recorder(MTPDrafter):
    """The MTP drafter, keeping each request's tokens and the drafts it verifies next, and
    drafting whatever they cost (the random head's drafts are nearly all rejected)."""

    def __init__(self, config: SpecConfig) -> None:
        super().__init__(replace(config, verify_cost=0.0, draft_cost=0.0))
        self.seen: list[tuple[list[int], list[int]]] = []

    def lookup(self, spec: RequestSpec, tokens: Sequence[int], num_output: int,
               k: int) -> list[int]:
        drafts = super().lookup(spec, tokens, num_output, k)
        if drafts:
            self.seen.append((list(tokens), drafts))
        return drafts


def mtp_engine(loaded: LoadedModel, make_engine: Any, k: int, **config: Any) -> AsyncEngine:
    engine: AsyncEngine = make_engine(loaded, speculative="mtp", num_speculative_tokens=k,
                                      **config)
    drafter = engine.scheduler.drafter
    assert drafter is not None
    engine.scheduler.drafter = Recorder(drafter.config)
    return engine


def hf_mtp_drafts(path: Path, tokens: list[int], k: int) -> list[int]:
    """The head's k greedy drafts after `tokens` by transformers' own layers: the text model's
    final hidden states, then per draft, over the whole sequence (positions 0 .. n - 2 read
    the next token and the model's state; later ones the previous draft and the head's own
    output): the norms, fc, a `Qwen3_5DecoderLayer` (full attention) loaded with
    `mtp.layers.0.*`, the final norm, the model's lm_head."""
    import json

    import transformers
    from safetensors.torch import load_file
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q

    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa").eval()
    text = hf.model.language_model
    cfg = text.config
    weights = {n.removeprefix("mtp."): t for n, t in load_file(path / "mtp.safetensors").items()}
    full = json.loads((path / "config.json").read_text())["text_config"]["layer_types"].index(
        "full_attention")
    layer = q.Qwen3_5DecoderLayer(cfg, full).eval()
    layer.load_state_dict({n.removeprefix("layers.0."): t for n, t in weights.items()
                           if n.startswith("layers.0.")})

    def norm(name: str) -> Any:
        m = q.Qwen3_5RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        m.weight.data.copy_(weights[f"{name}.weight"])
        return m

    norm_e, norm_h, norm_out = norm("pre_fc_norm_embedding"), norm("pre_fc_norm_hidden"), norm(
        "norm")
    with torch.no_grad():
        hidden = text(input_ids=torch.tensor([tokens])).last_hidden_state[0, :-1]
        nexts, drafts = list(tokens[1:]), []
        for _ in range(k):
            e = norm_e(text.embed_tokens(torch.tensor([nexts])))
            x = torch.cat([e, norm_h(hidden[None])], dim=-1) @ weights["fc.weight"].T
            positions = torch.arange(len(nexts))[None]
            x = norm_out(layer(x, position_embeddings=text.rotary_emb(x, positions),
                               position_ids=positions))[0, -1]
            drafts.append(int(hf.lm_head(x).argmax()))
            nexts.append(drafts[-1])
            hidden = torch.cat([hidden, x[None]])
    return drafts


async def test_mtp_drafts_are_the_heads_by_transformers(mtp_dir: Path, make_engine: Any
                                                        ) -> None:
    """The drafts each verify row checks are the head's greedy chain after the request's
    tokens, as transformers' layers compute it (after the prefill, and after verify steps
    that rejected drafts: the head's cache written at accepted positions only)."""
    engine = mtp_engine(load_model(mtp_dir, "float32", mtp=True), make_engine, k=3)
    await run(engine, prompt(30, 8), max_tokens=10, ignore_eos=True)
    recorder = engine.scheduler.drafter
    assert isinstance(recorder, Recorder) and len(recorder.seen) >= 4
    for tokens, drafts in recorder.seen[:4]:
        assert drafts == hf_mtp_drafts(mtp_dir, tokens, len(drafts)), len(tokens)


@pytest.mark.parametrize("k", [1, 3, 8])
async def test_mtp_greedy_equals_off(mtp_dir: Path, make_engine: Any, k: int) -> None:
    """The head drafting for a batch with chunked prefills, a prefix hit, a pool too small for
    all (preemption) and a cancellation: speculation off's tokens and logprobs."""
    plain, with_head = load_model(mtp_dir, "float32"), load_model(mtp_dir, "float32", mtp=True)
    shared = prompt(40, 9)
    prompts = [prompt(23, 1), prompt(57, 2), shared + prompt(5, 3), shared + prompt(9, 4)]
    params = {"max_tokens": 30, "ignore_eos": True, "logprobs": 2}
    config = {"chunked_prefill_size": 16, "kv_cache_tokens": 256, "max_model_len": 128}
    want = await run_many(make_engine(plain, **config), prompts, **params)
    engine = mtp_engine(with_head, make_engine, k, **config)
    for _ in range(2):  # the second time, the shared prefix hits
        assert_same(await run_many(engine, prompts, **params), want)
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats["spec_verify_steps"] > 0
    req = GenerateRequest(prompt=prompts[1], params=SamplingParams(
        max_tokens=100, ignore_eos=True, temperature=0.0))
    await cancel_mid_stream(engine, req, timeout=60)
    assert_all_pages_back(engine)


def test_mtp_needs_a_head(models: dict[str, LoadedModel]) -> None:
    """A model without the head is refused by name, and an engine needs the head loaded."""
    from arle.config import EngineConfig
    from arle.engine.build import engine_from_loaded
    from arle.errors import ArleError, ModelLoadError

    with pytest.raises(ModelLoadError, match="multi-token prediction head"):
        load_model(models["dense"].path, "float32", mtp=True)
    with pytest.raises(ArleError, match="MTP head"):
        engine_from_loaded(EngineConfig(speculative="mtp"), models["hybrid"])


def interp_check_mtp() -> None:
    """Under TRITON_INTERPRET=1: the MTP head's pass and chained drafts through the Triton
    kernels (attention over the head's KV entry, one-token chain steps over gathered page
    tables) give the drafts and tokens of the torch references."""
    import tempfile

    from arle.config import EngineConfig
    from arle.engine.build import engine_from_loaded
    from arle_kernels.ops import triton_ops

    async def drafted(engine: AsyncEngine, ids: list[int]) -> tuple[list[int], Any]:
        drafter = engine.scheduler.drafter
        assert drafter is not None
        recorder = engine.scheduler.drafter = Recorder(drafter.config)
        try:
            return tokens_of(await run(engine, ids, max_tokens=5, ignore_eos=True)), \
                recorder.seen
        finally:
            await engine.close()

    with tempfile.TemporaryDirectory() as tmp:
        write_qwen3_5_dir(Path(tmp), seed=3, vocab_size=259)
        loaded = load_model(tmp, "float32", mtp=True)
    ids = prompt(12, 7)
    config = EngineConfig(kv_cache_tokens=256, max_running_requests=2, speculative="mtp",
                          num_speculative_tokens=2)
    want = asyncio.run(drafted(engine_from_loaded(config, loaded), ids))
    engine = engine_from_loaded(config, loaded)
    engine.executor.dev.model.ops = triton_ops()  # type: ignore[attr-defined]
    got = asyncio.run(drafted(engine, ids))
    assert got == want and len(want[1]) >= 2


@pytest.mark.slow
def test_mtp_through_the_triton_kernels() -> None:
    run_interpreter_check("test_speculative", "interp_check_mtp")


async def test_serve_with_ngram_speculation(smol: LoadedModel, make_engine: Any,
                                            tmp_path: Path) -> None:
    """`arle serve --speculative ngram`: an OpenAI client's streamed answers (n = 2) are
    speculation off's; the request trace has its spec block and /metrics the acceptance."""
    import httpx
    import openai
    from served import arle_server

    text = load_script("bench_speculative").TASKS["quote"]
    messages = [{"role": "user", "content": text}]
    want = await run(make_engine(smol), messages=messages, max_tokens=60)
    with arle_server(["--speculative", "ngram", "--served-model-name", "m"],
                     tmp_path / "serve.log", timeout_s=300) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x")
        stream = client.chat.completions.create(
            model="m", messages=messages, max_tokens=60, temperature=0.0, n=2, stream=True)
        answers = ["", ""]
        for chunk in stream:
            for choice in chunk.choices:
                answers[choice.index] += choice.delta.content or ""
        metrics = httpx.get(f"{server.url}/metrics").text
        traces = [e for e in server.events() if e.get("event") == "request_trace"
                  and e.get("route") == "/v1/chat/completions"]
    assert answers == ["".join(d.text for d in want)] * 2
    assert all(t["spec"]["accepted"] > 0 for t in traces) and len(traces) == 2
    rate = next(line for line in metrics.splitlines()
                if line.startswith("arle_spec_acceptance_rate "))
    assert 0 < float(rate.split()[1]) <= 1


@pytest.mark.parametrize("spec", [(8, 5), (8, 2)])
def test_verify_steps_fit_the_extend_graphs(spec: tuple[int, int]) -> None:
    """A CUDA step of 8 verify rows of K drafts samples 8 (K + 1) positions: its extend graph
    takes them, where one sized by the slots alone sent it eager (measured on an H100: a verify
    step at batch 8 then cost 8-13x a decode step, against 1.2x at batch 1 with a graph).
    The buffers are built on the CPU; only `size_for` is asked."""
    from arle.executor.cuda_graphs import EXTEND_GRAPH_ROWS, ExtendGraphs
    from arle.executor.cuda_startup import CUDAExecutorConfig

    rows, positions = spec
    base = CUDAExecutorConfig(page_size=16, num_slots=9, max_batched_tokens=2048,
                              max_model_len=256, kv_dtype=torch.bfloat16)

    def graph(config: CUDAExecutorConfig) -> int:
        graphs = ExtendGraphs(config.extend_graph_max_tokens, config.extend_graph_rows, 16,
                              config.max_pages, 32, 0, torch.device("cpu"))
        return graphs.size_for(rows * positions, rows, rows * positions)

    assert graph(replace(base, spec=spec)) > 0
    assert graph(base) == 0  # the slots alone: eager
    # NOTE: never past EXTEND_GRAPH_ROWS (each row costs the graph a page-table row and logits)
    assert replace(base, num_slots=250, spec=spec).extend_graph_rows == EXTEND_GRAPH_ROWS
