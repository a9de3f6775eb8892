"""A hybrid model (Qwen3.5: Gated DeltaNet + gated attention) through the engine on the CPU:
its recurrent state carries from chunk to chunk, is restored from the prefix cache's snapshots,
survives preemption, and every slot, page and snapshot comes back. Outputs are compared
between engine settings (and with transformers where the test says), never hard-coded."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from conftest import assert_all_pages_back, cancel_mid_stream, run, run_many, tokens_of
from helpers import arle_env
from model_dirs import write_qwen3_5_dir

from arle.engine.async_engine import AsyncEngine
from arle.engine.request import Delta, GenerateRequest, SamplingParams
from arle.model.loader import LoadedModel, load_model

PAGE = 16


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = tmp_path_factory.mktemp("qwen3_5")
    write_qwen3_5_dir(path, seed=3, vocab_size=259)  # = the tokenizer's: outputs feed back
    return load_model(path, "float32")


def prompt(n: int, seed: int) -> list[int]:
    """n byte tokens of printable text (the tiny models' tokenizer is one token per byte)."""
    return [32 + (seed * 31 + i * 7) % 90 for i in range(n)]


def logprobs(deltas: list[Delta]) -> list[float]:
    return [lp.logprob for d in deltas for lp in d.logprobs or []]


def assert_close(a: list[float], b: list[float], tol: float = 1e-4) -> None:
    assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) <= tol


def trace(deltas: list[Delta]) -> dict[str, Any]:
    last = deltas[-1].trace
    assert last is not None
    return last


async def test_chunked_prefill_is_unchunked(hybrid: LoadedModel, make_engine: Any) -> None:
    """Chunks of 1, 7, 16 and 64 tokens (the state carried between steps; rows that start and
    end off page boundaries) give the logprobs of one whole prefill."""
    ids = prompt(150, 1)
    whole = await run(make_engine(hybrid), ids, max_tokens=12, ignore_eos=True, logprobs=0)
    for chunk in (1, 7, 16, 64):
        engine = make_engine(hybrid, chunked_prefill_size=chunk)
        got = await run(engine, ids, max_tokens=12, ignore_eos=True, logprobs=0)
        assert tokens_of(got) == tokens_of(whole), chunk
        assert_close(logprobs(got), logprobs(whole))
        assert_all_pages_back(engine)


async def test_batch_invariance(hybrid: LoadedModel, make_engine: Any) -> None:
    """Requests in one batch (mixed prefill and decode rows, each on its own state slot) give
    what each gives alone."""
    prompts = [prompt(20 + 13 * i, i) for i in range(6)]
    alone = []
    for p in prompts:
        alone.append(await run(make_engine(hybrid), p, max_tokens=10, ignore_eos=True,
                               logprobs=0))
    engine = make_engine(hybrid, max_running_requests=4, chunked_prefill_size=32)
    together = await run_many(engine, prompts, max_tokens=10, ignore_eos=True, logprobs=0)
    for a, t in zip(alone, together, strict=True):
        assert tokens_of(t) == tokens_of(a)
        assert_close(logprobs(t), logprobs(a))
    assert_all_pages_back(engine)


async def test_a_prefix_hit_restores_the_state_and_changes_nothing(hybrid: LoadedModel,
                                                                   make_engine: Any) -> None:
    """Turn 2 of a conversation (turn 1's prompt and answer, then more) reuses turn 1: its KV
    pages and the recurrent state at their end, from the snapshot taken when turn 1's request
    ended; it answers as a cold run does. (Token ids, not text: a random model's bytes need
    not decode to text that encodes back to them.)"""
    turn1 = prompt(61, 11)
    warm = make_engine(hybrid)
    first = await run(warm, turn1, max_tokens=24, ignore_eos=True)
    turn2 = turn1 + tokens_of(first) + prompt(30, 12)
    hit = await run(warm, turn2, max_tokens=12, ignore_eos=True, logprobs=0)
    cold = await run(make_engine(hybrid, enable_prefix_cache=False), turn2, max_tokens=12,
                     ignore_eos=True, logprobs=0)
    prefix = trace(hit)["prefix"]
    # turn 1 computed 61 + 23 positions (its last token was sampled, not fed back): the last
    # page boundary it reached is 80
    assert prefix["state_restored"] and prefix["matched_tokens"] == 80, prefix
    assert not trace(cold)["prefix"]["state_restored"]
    assert tokens_of(hit) == tokens_of(cold)
    assert_close(logprobs(hit), logprobs(cold))
    assert_all_pages_back(warm)


async def test_a_shared_prefix_is_reused_from_a_chunk_snapshot(hybrid: LoadedModel,
                                                               make_engine: Any) -> None:
    """A long shared document, then different questions: the second request restores the
    state where a prefill chunk of the first ended inside the document."""
    doc = prompt(200, 7)
    engine = make_engine(hybrid, chunked_prefill_size=64)
    first = await run(engine, doc + prompt(9, 8), max_tokens=4, ignore_eos=True)
    second = await run(engine, doc + prompt(11, 9), max_tokens=6, ignore_eos=True, logprobs=0)
    cold = await run(make_engine(hybrid, enable_prefix_cache=False), doc + prompt(11, 9),
                     max_tokens=6, ignore_eos=True, logprobs=0)
    assert trace(first)["prefix"]["matched_tokens"] == 0
    prefix = trace(second)["prefix"]
    assert prefix["state_restored"] and prefix["matched_tokens"] == 192, prefix  # 3 chunks
    assert_close(logprobs(second), logprobs(cold))
    assert_all_pages_back(engine)


async def test_without_snapshots_nothing_is_reused(hybrid: LoadedModel, make_engine: Any
                                                   ) -> None:
    """KV without the state at its end is of no use: with no snapshot budget, no prefix hit."""
    engine = make_engine(hybrid, state_snapshots=0)
    ids = prompt(80, 4)
    await run(engine, ids, max_tokens=3, ignore_eos=True)
    again = await run(engine, ids + [65, 66], max_tokens=3, ignore_eos=True)
    assert trace(again)["prefix"]["matched_tokens"] == 0
    assert_all_pages_back(engine)


async def test_preemption_under_page_pressure_gives_the_same_tokens(hybrid: LoadedModel,
                                                                    make_engine: Any) -> None:
    prompts = [prompt(40, 20 + i) for i in range(6)]
    roomy = make_engine(hybrid)
    expected = [tokens_of(d) for d in await run_many(roomy, prompts, max_tokens=50,
                                                     ignore_eos=True)]
    tight = make_engine(hybrid, kv_cache_tokens=320, max_model_len=160)
    got = [tokens_of(d) for d in await run_many(tight, prompts, max_tokens=50, ignore_eos=True)]
    assert tight.scheduler.num_preemptions > 0
    assert got == expected
    assert_all_pages_back(tight)


async def test_few_slots_queue_and_finish(hybrid: LoadedModel, make_engine: Any) -> None:
    """Admission needs a free state slot: 2 slots for 8 requests, each finishes as alone."""
    prompts = [prompt(25, 40 + i) for i in range(8)]
    alone = [tokens_of(await run(make_engine(hybrid), p, max_tokens=8, ignore_eos=True))
             for p in prompts[:2]]
    engine = make_engine(hybrid, max_running_requests=2)
    got = [tokens_of(d) for d in await run_many(engine, prompts, max_tokens=8, ignore_eos=True)]
    assert got[:2] == alone and all(len(g) == 8 for g in got)
    assert_all_pages_back(engine)


async def test_cancellation_returns_every_page_slot_and_snapshot(hybrid: LoadedModel,
                                                                 make_engine: Any) -> None:
    engine: AsyncEngine = make_engine(hybrid)
    req = GenerateRequest(prompt=prompt(70, 3),
                          params=SamplingParams(max_tokens=100000, ignore_eos=True))
    await cancel_mid_stream(engine, req, timeout=60)
    assert_all_pages_back(engine)  # pages, slots, and snapshots each free or on one node
    assert len(tokens_of(await run(engine, prompt(10, 5), max_tokens=3, ignore_eos=True))) == 3


async def test_the_state_pool_is_sized_per_slot(hybrid: LoadedModel, make_engine: Any) -> None:
    """One entry per slot plus the graphs' spare, as many boundary copies, the snapshots."""
    engine = make_engine(hybrid, max_running_requests=3, state_snapshots=5)
    state = engine.executor.state
    cfg = hybrid.config
    assert state is not None and cfg.linear_attention is not None
    slots = engine.executor.num_slots + 1
    assert state.conv.shape[:2] == state.boundary_conv.shape[:2] == (len(cfg.linear_layers), slots)
    assert state.snap_ssm.shape[1] == 5 and engine.cache.num_snapshots == 5
    assert state.slot_bytes == cfg.state_bytes_per_slot(4)  # fp32 model: fp32 conv state


def test_piped_arle_chat_reuses_the_first_turn(hybrid: LoadedModel, tmp_path: Any) -> None:
    """`arle chat` from a Qwen3.5 directory: two turns answer, and the second starts from the
    first turn's cached pages and recurrent state (its status line's prefix)."""
    env = arle_env(XDG_DATA_HOME=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "arle", "chat", "-m", str(hybrid.path), "--temperature", "0",
         "--max-tokens", "12"],
        input="Tell me about the sea and the ships on it.\nAnd in winter?\n", env=env,
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    status = [line for line in proc.stderr.splitlines() if " tokens · " in line]
    assert len(status) == 2 and "prefix 0/" in status[0], status
    assert int(status[1].split("prefix ")[1].split("/")[0]) >= PAGE, status
