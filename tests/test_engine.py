"""The async engine end to end on the CPU: batching, chunking, prefix cache, preemption,
cancellation, stops, seeds. Outputs are compared between engine settings, never hard-coded."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch
from conftest import assert_all_pages_back, cancel_mid_stream, run, run_many, text_of, tokens_of
from helpers import load_script

from arle.config import EngineConfig
from arle.engine.request import GenerateRequest, SamplingParams
from arle.errors import InvalidRequestError, OverloadedError
from arle.executor.base import StepOutput
from arle.model.loader import LoadedModel

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def mixed_prompts(n: int) -> list[str]:
    words = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while", "seven", "cats", "watch"]
    return [" ".join(words[: 2 + (i * 5) % 11]) + f" and number {i}" * (1 + i % 4)
            for i in range(n)]


async def test_default_model_answers(smol, make_engine):
    engine = make_engine(smol)
    deltas = await run(engine, messages=QUESTION, max_tokens=32)
    assert "Paris" in text_of(deltas)
    last = deltas[-1]
    assert last.finish_reason == "stop" and last.stop_reason == "eos"
    assert last.usage is not None and last.usage.completion_tokens == len(tokens_of(deltas))
    assert_all_pages_back(engine)


@pytest.mark.slow
async def test_batch_invariance_greedy(smol, make_engine):
    """A greedy request gives the same tokens alone and inside 16 mixed-length requests."""
    engine = make_engine(smol)
    prompts = mixed_prompts(16)
    alone = [tokens_of(await run(engine, p, max_tokens=12, ignore_eos=True)) for p in prompts[:3]]
    together = await run_many(engine, prompts, max_tokens=12, ignore_eos=True)
    for a, t in zip(alone, together[:3], strict=False):
        assert a == tokens_of(t)
    assert_all_pages_back(engine)


async def test_chunked_prefill_matches_unchunked(tiny, make_engine):
    prompt = list(range(100, 400))  # 300 tokens: 19 pages, chunks cross page boundaries
    whole = make_engine(tiny, chunked_prefill_size=512, enable_prefix_cache=False)
    chunked = make_engine(tiny, chunked_prefill_size=37, enable_prefix_cache=False)
    a = await run(whole, prompt, max_tokens=16, ignore_eos=True, logprobs=0)
    b = await run(chunked, prompt, max_tokens=16, ignore_eos=True, logprobs=0)
    assert tokens_of(a) == tokens_of(b)
    lp_a = [lp.logprob for d in a for lp in d.logprobs or []]
    lp_b = [lp.logprob for d in b for lp in d.logprobs or []]
    assert len(lp_a) == 16
    torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), atol=1e-4, rtol=0)
    assert b[-1].trace["scheduler"]["prefill_tokens"] == 300


async def test_prefix_cache_hit_equals_miss_and_skips_prefill(tiny, make_engine):
    engine = make_engine(tiny)
    system = list(range(1000, 1000 + 200))
    first = await run(engine, [*system, 5, 6, 7], max_tokens=10, ignore_eos=True)
    second = await run(engine, [*system, 5, 6, 7], max_tokens=10, ignore_eos=True)
    other = await run(engine, [*system, 9, 9], max_tokens=10, ignore_eos=True)
    cold = make_engine(tiny, enable_prefix_cache=False)
    other_cold = await run(cold, [*system, 9, 9], max_tokens=10, ignore_eos=True)
    assert tokens_of(first) == tokens_of(second)
    assert tokens_of(other) == tokens_of(other_cold)
    t1, t2, t3 = first[-1].trace, second[-1].trace, other[-1].trace
    assert t1["prefix"]["matched_tokens"] == 0
    assert t2["prefix"]["matched_tokens"] == 192  # 12 full pages of the 203-token prompt
    assert t2["scheduler"]["prefill_tokens"] == 203 - 192
    assert t3["prefix"]["matched_tokens"] == 192
    assert second[-1].usage.cached_tokens == 192
    assert_all_pages_back(engine)


async def test_multi_turn_reuses_previous_turn(smol, make_engine):
    engine = make_engine(smol)
    turn1 = await run(engine, messages=QUESTION, max_tokens=16)
    history = [*QUESTION, {"role": "assistant", "content": text_of(turn1)},
               {"role": "user", "content": "And of Italy?"}]
    turn2 = await run(engine, messages=history, max_tokens=8)
    prompt1 = turn1[-1].usage.prompt_tokens
    assert turn2[-1].trace["prefix"]["matched_tokens"] >= (prompt1 // 16) * 16


async def test_completion_and_cancellation_return_every_page(tiny, make_engine):
    engine = make_engine(tiny)
    await run_many(engine, mixed_prompts(8), max_tokens=20)
    assert_all_pages_back(engine)

    def holds_pages() -> None:
        assert engine.cache.num_available < engine.cache.num_pages or engine.scheduler.running

    req = GenerateRequest(prompt=list(range(50, 90)),
                          params=SamplingParams(max_tokens=100000, ignore_eos=True))
    await cancel_mid_stream(engine, req, check=holds_pages)
    assert_all_pages_back(engine)  # returned at once, not after the next step
    # the engine still serves
    assert len(tokens_of(await run(engine, "hello", max_tokens=3, ignore_eos=True))) == 3


async def test_page_exhaustion_preempts_and_finishes_everything(tiny, make_engine):
    prompts = [list(range(200 + 7 * i, 240 + 7 * i)) for i in range(8)]  # 40 tokens each
    roomy = make_engine(tiny)
    expected = [tokens_of(d) for d in await run_many(roomy, prompts, max_tokens=60,
                                                     ignore_eos=True)]
    # 24 pages = 384 tokens for 8 requests that grow to 100 tokens each.
    tight = make_engine(tiny, kv_cache_tokens=384, max_model_len=200)
    got = [tokens_of(d) for d in await run_many(tight, prompts, max_tokens=60, ignore_eos=True)]
    assert tight.scheduler.num_preemptions > 0
    assert got == expected
    assert_all_pages_back(tight)


async def test_64_concurrent_requests_finish(tiny, make_engine):
    engine = make_engine(tiny, max_running_requests=16)
    results = await run_many(engine, mixed_prompts(64), max_tokens=8, ignore_eos=True)
    assert [len(tokens_of(r)) for r in results] == [8] * 64
    assert all(r[-1].finish_reason == "length" for r in results)
    assert_all_pages_back(engine)


async def test_stop_string_across_tokens(smol, make_engine):
    engine = make_engine(smol)
    base = await run(engine, "The history of France", max_tokens=40, ignore_eos=True)
    pieces = [d.text for d in base]
    full = "".join(pieces)
    # a stop string that starts inside one token's text and ends inside a later one
    i = next(k for k in range(3, len(pieces) - 2) if len(pieces[k]) >= 2 and pieces[k + 1])
    start = sum(len(p) for p in pieces[:i]) + 1
    stop = full[start:start + len(pieces[i]) + 1]
    stopped = await run(engine, "The history of France", max_tokens=40, ignore_eos=True,
                        stop=(stop,))
    assert text_of(stopped) == full[: full.index(stop)]
    assert stopped[-1].finish_reason == "stop" and stopped[-1].stop_reason == stop


async def test_utf8_never_broken(tiny, make_engine):
    """Random byte-level tokens split multi-byte characters: no delta may carry U+FFFD unless
    the decoded whole does, and the stream adds up to the decoded whole."""
    engine = make_engine(tiny)
    tok = engine.tokenizer
    emoji = tok.encode("家族 👨‍👩‍👧 ü")
    results = await run_many(engine, [emoji] * 6, max_tokens=30, temperature=1.5, seed=None,
                             ignore_eos=True)
    for deltas in results:
        whole = tok.decode(tokens_of(deltas))
        assert text_of(deltas) == whole
        if "\ufffd" not in whole:
            assert all("\ufffd" not in d.text for d in deltas)


async def test_seeds_reproducible_alone_and_in_batch(tiny, make_engine):
    engine = make_engine(tiny)
    params = {"max_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    alone = tokens_of(await run(engine, "seeded", seed=1234, **params))
    again = tokens_of(await run(engine, "seeded", seed=1234, **params))
    batch = await asyncio.gather(
        run(engine, "noise one", **params), run(engine, "seeded", seed=1234, **params),
        run(engine, "noise two", seed=7, **params))
    other = tokens_of(await run(engine, "seeded", seed=4321, **params))
    assert alone == again == tokens_of(batch[1])
    assert other != alone


async def _until(condition, seconds: float = 10.0) -> None:
    """Wait (polling every millisecond) until condition() holds; fail after `seconds`."""
    deadline = time.perf_counter() + seconds
    while not condition():
        assert time.perf_counter() < deadline, "condition not reached"
        await asyncio.sleep(0.001)


async def test_overloaded_queue_is_refused(tiny, make_engine):
    engine = make_engine(tiny, max_waiting_requests=1, max_running_requests=1)
    long_running = asyncio.create_task(run(engine, "a", max_tokens=200, ignore_eos=True))
    # NOTE: each request tokenizes in a thread first: wait for the states, not fixed sleeps
    # (a first run in a fresh process once missed them)
    await _until(lambda: len(engine.scheduler.running) == 1)
    waiting = asyncio.create_task(run(engine, "b", max_tokens=2))
    await _until(lambda: len(engine.scheduler.waiting) == 1)
    assert not long_running.done()
    with pytest.raises(OverloadedError, match="overloaded"):
        await run(engine, "c", max_tokens=2)
    await asyncio.gather(long_running, waiting)
    assert_all_pages_back(engine)


async def test_context_length_and_bad_requests(tiny, make_engine):
    engine = make_engine(tiny, max_model_len=64)
    deltas = await run(engine, list(range(100, 150)), max_tokens=100, ignore_eos=True)
    assert deltas[-1].finish_reason == "length" and deltas[-1].stop_reason == "context"
    assert deltas[-1].usage.total_tokens == 64
    with pytest.raises(InvalidRequestError, match=r"70 tokens.*64"):
        await run(engine, list(range(100, 170)))
    with pytest.raises(InvalidRequestError, match="top_p"):
        await run(engine, "x", top_p=1.5)
    with pytest.raises(InvalidRequestError, match="temperature"):
        await run(engine, "x", temperature=float("nan"))
    with pytest.raises(InvalidRequestError, match="token ids"):
        await run(engine, [1, 2, 10**9])
    assert_all_pages_back(engine)


async def test_logprobs_match_a_direct_forward(tiny, make_engine):
    teacher_forced_logits = load_script("check_gpu_parity").teacher_forced_logits

    engine = make_engine(tiny)
    prompt = list(range(300, 340))
    deltas = await run(engine, prompt, max_tokens=5, ignore_eos=True, logprobs=3)
    out = tokens_of(deltas)
    lps = [lp for d in deltas for lp in d.logprobs or []]
    ref = torch.log_softmax(teacher_forced_logits(tiny.model, prompt + out), -1)
    for i, lp in enumerate(lps):
        row = ref[len(prompt) - 1 + i]
        assert lp.token_id == out[i] == int(row.argmax())
        assert abs(lp.logprob - float(row[out[i]])) < 1e-4
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()


async def test_failed_step_fails_its_requests_and_engine_goes_on(tiny, make_engine):
    engine = make_engine(tiny)
    real = engine.executor.launch
    calls = {"n": 0}

    def flaky(plan):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return real(plan)

    engine.executor.launch = flaky  # type: ignore[method-assign]
    deltas = await run(engine, "boom", max_tokens=5, ignore_eos=True)
    assert deltas[-1].finish_reason == "error" and "injected" in deltas[-1].error
    assert len(tokens_of(await run(engine, "fine", max_tokens=4, ignore_eos=True))) == 4
    assert_all_pages_back(engine)


async def test_undecodable_token_fails_its_request_only(tiny, make_engine):
    """A sampled id its detokenizer rejects (here 2**62, injected into one row of the third
    step's output) fails that request with an error naming it; the request beside it, and the
    next one, finish. Before, the exception ended the engine's loop: both waited forever."""
    engine = make_engine(tiny)
    real = engine.executor.launch
    calls = {"n": 0}

    def corrupt(plan):
        handle = real(plan)
        calls["n"] += 1
        if calls["n"] != 3:
            return handle

        async def out():
            o = await handle
            return StepOutput([2**62] + o.token_ids[1:], o.logprobs, o.exec_s)
        return out()

    engine.executor.launch = corrupt  # type: ignore[method-assign]
    a, b = await asyncio.wait_for(run_many(engine, ["one", "two"], max_tokens=8,
                                           ignore_eos=True), 30)
    failed = [d for d in (a, b) if d[-1].finish_reason == "error"]
    assert len(failed) == 1 and f"token {2**62}" in failed[0][-1].error
    other = b if failed[0] is a else a
    assert other[-1].finish_reason == "length" and len(tokens_of(other)) == 8
    engine.executor.launch = real  # type: ignore[method-assign]
    assert len(tokens_of(await run(engine, "three", max_tokens=4, ignore_eos=True))) == 4
    assert_all_pages_back(engine)


async def test_loop_error_fails_every_request_and_engine_goes_on(tiny, make_engine):
    """An error outside a step (here the scheduler, once) fails the running requests with
    an error naming it, logged, instead of leaving them waiting; the next request runs."""
    engine = make_engine(tiny)
    real = engine.scheduler.schedule
    calls = {"n": 0}

    def broken():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected scheduler bug")
        return real()

    engine.scheduler.schedule = broken  # type: ignore[method-assign]
    deltas = await asyncio.wait_for(run(engine, "boom", max_tokens=8, ignore_eos=True), 30)
    assert deltas[-1].finish_reason == "error"
    assert "engine loop failed" in deltas[-1].error and "injected" in deltas[-1].error
    assert len(tokens_of(await run(engine, "fine", max_tokens=4, ignore_eos=True))) == 4
    assert_all_pages_back(engine)


async def test_idle_engine_uses_no_cpu(tiny, make_engine):
    engine = make_engine(tiny)
    await run(engine, "warm", max_tokens=2)
    t0 = time.process_time()
    await asyncio.sleep(0.5)
    assert time.process_time() - t0 < 0.1  # a busy-wait would burn ~0.5 s


@pytest.mark.parametrize("running, extend_tokens", [(1, 0), (8, 2048)])
def test_one_running_request_takes_no_extend_graphs(tiny: LoadedModel,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    running: int, extend_tokens: int) -> None:
    """The CUDA executor's config from the engine's: with one running request (`arle complete`,
    `arle chat`) one decode graph and no extend graphs (a prefill step comes once a request);
    with more, the extend graphs' ladder. Checked on the CPU: the config, not the executor."""
    import arle.executor.cuda as cuda_executor
    from arle.engine.build import _cuda_executor

    seen: list[Any] = []
    monkeypatch.setattr(cuda_executor, "CUDAExecutor", lambda model, config: seen.append(config))
    config = EngineConfig(max_running_requests=running).for_device("cuda")
    _cuda_executor(config, tiny, 256, running + 1)
    assert seen[0].extend_graph_max_tokens == extend_tokens
    assert seen[0].cuda_graph_max_bs == running
