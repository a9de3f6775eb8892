"""Prompt scoring (`SamplingParams.prompt_logprobs`): the prompt's own logprobs from the prefill
that serves the request, against transformers on the same weights, for any chunking, with the
prefix cache and with preemption."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
import transformers
from conftest import run
from helpers import require_smollm2_gguf

from arle.engine.async_engine import AsyncEngine
from arle.engine.request import Delta, TokenLogprob
from arle.model.loader import LoadedModel

pytestmark = pytest.mark.slow

TEXT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France, and "
        "Berlin is the capital of Germany. One, two, three, four, five, six, seven.")


@pytest.fixture(scope="module")
def hf_smol() -> Any:
    """transformers' own GGUF loader and Llama code, fp32."""
    path = require_smollm2_gguf()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def hf_scores(model: Any, ids: list[int], top: int) -> list[tuple[float, list[int]]]:
    """Per prompt token 1..: (its logprob, the top ids) from transformers' full forward."""
    with torch.no_grad():
        lp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    out = []
    for p in range(len(ids) - 1):
        out.append((lp[p, ids[p + 1]].item(), lp[p].topk(top).indices.tolist()))
    return out


def prompt_lps(deltas: list[Delta]) -> list[TokenLogprob | None]:
    got = [d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None]
    assert len(got) == 1, "the prompt's logprobs come once, with the first delta"
    return got[0]


def assert_matches(ours: list[TokenLogprob | None], ref: list[tuple[float, list[int]]],
                   ids: list[int], top: int) -> None:
    assert len(ours) == len(ids) and ours[0] is None
    for p, (lp, (ref_lp, ref_top)) in enumerate(zip(ours[1:], ref, strict=True)):
        assert lp is not None and lp.token_id == ids[p + 1]
        assert abs(lp.logprob - ref_lp) < 1e-3, (p, lp.logprob, ref_lp)
        assert len(lp.top) == top
        # NOTE: near-ties may swap between two fp32 implementations: compare as sets of the
        # first top-1 and check the order of the values
        assert lp.top[0][0] == ref_top[0] or abs(lp.top[0][1] - lp.top[1][1]) < 1e-3
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


@pytest.mark.parametrize("chunk", [7, 64, 2048])
async def test_prompt_logprobs_match_transformers_for_any_chunking(
        smol: LoadedModel, hf_smol: Any, make_engine: Any, chunk: int) -> None:
    ids = smol.tokenizer.encode(TEXT)
    ref = hf_scores(hf_smol, ids, 3)
    engine: AsyncEngine = make_engine(smol, chunked_prefill_size=chunk, max_batched_tokens=2048,
                                      page_size=16)
    deltas = await run(engine, ids, max_tokens=2, prompt_logprobs=3)
    assert_matches(prompt_lps(deltas), ref, ids, 3)


async def test_scoring_skips_the_cache_for_the_part_it_scores(
        smol: LoadedModel, hf_smol: Any, make_engine: Any) -> None:
    ids = smol.tokenizer.encode(TEXT)
    ref = hf_scores(hf_smol, ids, 2)
    engine: AsyncEngine = make_engine(smol, page_size=16)
    first = await run(engine, ids, max_tokens=1)
    assert first[-1].usage is not None and first[-1].usage.cached_tokens == 0
    # The prompt's pages are cached now; a scoring request recomputes them (no logits there).
    scored = await run(engine, ids, max_tokens=1, prompt_logprobs=2)
    assert scored[-1].usage is not None and scored[-1].usage.cached_tokens == 0
    assert_matches(prompt_lps(scored), ref, ids, 2)
    # ... and a plain request after it still reuses them.
    again = await run(engine, ids, max_tokens=1)
    assert again[-1].usage is not None
    assert again[-1].usage.cached_tokens == (len(ids) - 1) // 16 * 16 > 0
    assert all(d.prompt_logprobs is None for d in again)


async def test_scoring_in_a_batch_with_other_requests(
        smol: LoadedModel, hf_smol: Any, make_engine: Any) -> None:
    """Scored rows beside decode rows and unscored prefill rows of other requests."""
    tok = smol.tokenizer
    texts = [TEXT, "Hello there, how are you doing today? I am fine.", "1 2 3 4 5 6 7 8 9"]
    ids = [tok.encode(t) for t in texts]
    engine: AsyncEngine = make_engine(smol, chunked_prefill_size=16, page_size=16)
    results = await asyncio.gather(
        run(engine, ids[1], max_tokens=20),
        run(engine, ids[0], max_tokens=3, prompt_logprobs=0),
        run(engine, ids[2], max_tokens=5, prompt_logprobs=1))
    assert all(d.prompt_logprobs is None for d in results[0])
    assert_matches(prompt_lps(results[2]), hf_scores(hf_smol, ids[2], 1), ids[2], 1)
    # prompt_logprobs=0: the prompt tokens' own logprobs, no alternatives
    ours, ref = prompt_lps(results[1]), hf_scores(hf_smol, ids[0], 1)
    assert len(ours) == len(ids[0]) and ours[0] is None
    for lp, (ref_lp, _) in zip(ours[1:], ref, strict=True):
        assert lp is not None and lp.top == () and abs(lp.logprob - ref_lp) < 1e-3


async def test_scores_survive_preemption_mid_prefill(tiny: LoadedModel,
                                                     make_engine: Any) -> None:
    """A long scoring prompt, prefilled in small chunks while seven short requests decode in
    a pool too small for all: it is preempted before its prefill ends, recomputed, and its
    scores come out whole and as in a roomy pool (no position scored twice or skipped)."""
    short = [list(range(300 + 11 * i, 324 + 11 * i)) for i in range(7)]  # 24 tokens each
    long = list(range(1000, 1180))  # 180 tokens

    async def serve(engine: AsyncEngine) -> list[Delta]:
        others = [asyncio.ensure_future(run(engine, p, max_tokens=80, ignore_eos=True))
                  for p in short]
        await asyncio.sleep(0)  # the short ones are queued first
        scored = await run(engine, long, max_tokens=3, prompt_logprobs=1)
        await asyncio.gather(*others)
        return scored

    expected = await serve(make_engine(tiny, chunked_prefill_size=4))
    # 33 pages: all eight fit at admission (7 x 2 + 12, and a page per running request spare),
    # and the short ones' third pages; their fourth, before the long prompt's 45 chunks are
    # done, do not
    tight = make_engine(tiny, kv_cache_tokens=33 * 16, max_model_len=200, chunked_prefill_size=4)
    got = await serve(tight)
    assert got[-1].trace is not None
    sched = got[-1].trace["scheduler"]
    # preempted before its first token (all its decodes came after), some prompt recomputed
    assert sched["preemptions"] > 0 and sched["decode_tokens"] == 2
    assert len(long) < sched["prefill_tokens"] < 2 * len(long)
    a, b = prompt_lps(expected), prompt_lps(got)
    assert len(a) == len(b) == len(long) and a[0] is None and b[0] is None
    for x, y in zip(a[1:], b[1:], strict=True):
        assert x is not None and y is not None and x.token_id == y.token_id
        assert abs(x.logprob - y.logprob) < 1e-4 and x.top[0][0] == y.top[0][0]
