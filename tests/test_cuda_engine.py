"""The new model families through the CUDA engine (graphs, overlapped steps) and `arle serve` on
the GPU: Qwen3.5 (hybrid), Qwen3-MoE in bf16 and in block FP8. Batched against alone and eager,
preemption, cancellation while steps are in flight, FP8 KV, a client that disconnects. Outputs
are compared between engine settings up to bf16 near-ties, never hard-coded.

Skipped without a CUDA GPU (CI has none): these run on the lent H200 through `device`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from conftest import assert_all_pages_back, run, tokens_of
from gpu_checks import assert_same_up_to_near_ties, greedy_with_margins
from helpers import load_script, with_oracle
from model_dirs import (
    MOE_GPU_SHAPE,
    QWEN3_5_GPU_SHAPE,
    hf_config,
    write_fp8_model_dir,
    write_model_dir,
    write_qwen3_5_dir,
)
from moe_checks import SMALL_KV
from served import arle_server

from arle.engine.request import GenerateRequest, SamplingParams
from arle.model.loader import LoadedModel, load_model
from arle_kernels.moe import MOE_W8A8_MIN_TOKENS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FAMILIES = ("qwen3.5", "moe", "moe_fp8")


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3.5":
        write_qwen3_5_dir(path, seed=3, **QWEN3_5_GPU_SHAPE)
    elif request.param == "moe":
        write_model_dir(path, hf_config("Qwen3MoeForCausalLM", **MOE_GPU_SHAPE), seed=6)
    else:
        write_fp8_model_dir(path, hf_config("Qwen3MoeForCausalLM", **MOE_GPU_SHAPE),
                            tmp_path_factory.mktemp("twin"), (128, 128), seed=6)
    return path


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> LoadedModel:
    return load_model(model_dir, "bfloat16", "cuda")


@pytest.fixture(scope="module")
def tie(loaded: LoadedModel) -> float:
    """The top-2 margin under which two runs may pick different tokens: twice the largest
    logit gap between the model's two paths over one prompt, the whole prompt in one chunk
    against one token at a time (FP8: W8A8 GEMMs against W8A16 GEMVs; Qwen3.5: Gated
    DeltaNet's chunked form against its recurrence; a request alone, in a batch or resumed
    after a preemption takes either), and at least bf16's rounding (0.2, see
    `assert_same_up_to_near_ties`).
    NOTE: the prompt is long enough for the MoE layers' W8A8 path too (MOE_W8A8_MIN_TOKENS)."""
    forced = load_script("check_gpu_parity").teacher_forced_logits
    ids = prompt(2 * MOE_W8A8_MIN_TOKENS, 99)
    gap = (forced(loaded.model, ids) - forced(loaded.model, ids, chunk_size=1)).abs().max()
    return max(0.2, 2 * gap.item())


def prompt(n: int, seed: int) -> list[int]:
    """n ids of the tiny models' byte tokenizer (outputs of any id decode: the model vocab)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


PROMPTS = [prompt(n, 10 + i) for i, n in enumerate([5, 17, 33, 64, 100, 129, 250, 400])]


async def test_batched_with_graphs_and_overlap_matches_eager(loaded: LoadedModel, tie: float,
                                                             make_engine: Any) -> None:
    """8 requests at once through the graphs with overlapped steps: each as alone, and as an
    eager engine without overlap gives them, up to bf16 near-ties."""
    engine = make_engine(loaded, max_running_requests=16)
    assert engine.executor.graphs is not None
    alone = [(await greedy_with_margins(engine, [p], 24))[0] for p in PROMPTS[:3]]
    batched = await greedy_with_margins(engine, PROMPTS, 24)
    for a, b in zip(alone, batched, strict=False):
        assert_same_up_to_near_ties(a, b, tie)
    eager = make_engine(loaded, max_running_requests=16, cuda_graph=False, overlap=False)
    for a, b in zip(batched, await greedy_with_margins(eager, PROMPTS, 24), strict=True):
        assert_same_up_to_near_ties(a, b, tie)
    assert_all_pages_back(engine)
    assert_all_pages_back(eager)


async def test_preemption_under_page_pressure(loaded: LoadedModel, tie: float,
                                              make_engine: Any) -> None:
    """A pool too small for 6 requests at once: requests are preempted and resumed (a hybrid
    model's state from scratch), each still gives its tokens, every page comes back."""
    prompts = [prompt(40, 20 + i) for i in range(6)]
    roomy = make_engine(loaded)
    expected = await greedy_with_margins(roomy, prompts, 50)
    tight = make_engine(loaded, kv_cache_tokens=320, max_model_len=160)
    got = await greedy_with_margins(tight, prompts, 50)
    assert tight.scheduler.num_preemptions > 0
    for a, b in zip(expected, got, strict=True):
        assert_same_up_to_near_ties(a, b, tie)
    assert_all_pages_back(tight)


async def test_cancellation_while_steps_are_in_flight(loaded: LoadedModel,
                                                      make_engine: Any) -> None:
    """Two of four long streams cancelled mid-decode (overlapped graph steps running): the
    others finish whole, every page, slot and snapshot comes back, the engine serves on."""
    engine = make_engine(loaded)
    started = [asyncio.Event() for _ in range(4)]

    async def consume(i: int, n: int) -> int:
        req = GenerateRequest(prompt=prompt(60, 30 + i),
                              params=SamplingParams(max_tokens=n, ignore_eos=True))
        count = 0
        async for d in engine.generate(req):
            count += len(d.token_ids)
            if count >= 5:
                started[i].set()
        return count

    tasks = [asyncio.create_task(consume(i, 100_000 if i % 2 else 64)) for i in range(4)]
    for ev in started:
        await asyncio.wait_for(ev.wait(), 60)
    for t in tasks[1::2]:
        t.cancel()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    assert done[0] == done[2] == 64
    assert all(isinstance(d, asyncio.CancelledError) for d in done[1::2])
    assert_all_pages_back(engine)
    assert len(tokens_of(await run(engine, prompt(10, 5), max_tokens=3, ignore_eos=True))) == 3


async def test_fp8_kv_through_the_engine(loaded: LoadedModel, tie: float,
                                         make_engine: Any) -> None:
    """FP8 KV: batched as alone (up to near-ties), and close to bf16 KV: the first tokens of
    at least half the prompts agree (a random MoE's routing flips on small perturbations; the
    FP8 KV parity check bounds the logits themselves)."""
    engine = make_engine(loaded, kv_cache_dtype="fp8_e4m3", max_running_requests=16)
    assert engine.executor.dev.kv.k.dtype == torch.float8_e4m3fn
    alone = [(await greedy_with_margins(engine, [p], 16))[0] for p in PROMPTS[:3]]
    batched = await greedy_with_margins(engine, PROMPTS, 16)
    for a, b in zip(alone, batched, strict=False):
        assert_same_up_to_near_ties(a, b, tie)
    bf16 = await greedy_with_margins(make_engine(loaded, max_running_requests=16), PROMPTS, 16)
    agree = sum(a[0][0] == b[0][0] for a, b in zip(batched, bf16, strict=True))
    assert agree >= 4, agree
    assert_all_pages_back(engine)


def _engine_stats(url: str) -> dict[str, Any]:
    r = httpx.get(url + "/v1/stats", timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json()["engine"])


def _pages_back(e: dict[str, Any]) -> bool:
    return (e["running"] == 0 and e["waiting"] == 0
            and e["kv_pages_free"] + e["kv_pages_evictable"] == e["kv_pages_total"])


async def test_speculation_matches_off(loaded: LoadedModel, tie: float,
                                       make_engine: Any) -> None:
    """Verify rows on the GPU (eager steps; a hybrid model's per-position states through the
    Triton recurrence, restored at the next step), drafts right and wrong (an oracle: the off
    run's tokens, every third one off): speculation off's tokens up to bf16 near-ties, every
    page back."""
    prompts = PROMPTS[:4]
    want = await greedy_with_margins(make_engine(loaded, max_running_requests=8), prompts, 24)
    on = with_oracle(make_engine(loaded, max_running_requests=8, speculative="ngram",
                                 num_speculative_tokens=3),
                     prompts, [[t for t, _ in w] for w in want])
    for a, b in zip(want, await greedy_with_margins(on, prompts, 24), strict=True):
        assert_same_up_to_near_ties(a, b, tie)
    assert on.stats["spec_accepted_tokens"] > 0
    assert_all_pages_back(on)


async def test_mtp_head_matches_off(model_dir: Path, loaded: LoadedModel, tie: float,
                                    make_engine: Any) -> None:
    """Qwen3.5's MTP head drafting on the GPU (its pass and chain through the Triton kernels,
    every step eager): speculation off's tokens up to bf16 near-ties, every page back."""
    if loaded.model.config.mtp_layers == 0:
        pytest.skip("the model has no MTP head")
    head = load_model(model_dir, "bfloat16", "cuda", mtp=True)
    prompts = PROMPTS[:4]
    want = await greedy_with_margins(make_engine(loaded, max_running_requests=8), prompts, 24)
    on = make_engine(head, max_running_requests=8, speculative="mtp", num_speculative_tokens=3)
    for a, b in zip(want, await greedy_with_margins(on, prompts, 24), strict=True):
        assert_same_up_to_near_ties(a, b, tie)
    assert on.stats["spec_verify_steps"] > 0
    assert_all_pages_back(on)


def test_served_with_fp8_kv_survives_a_disconnect(model_dir: Path, tmp_path: Path) -> None:
    """`arle serve --kv-cache-dtype fp8_e4m3` on the GPU: a stream whose client goes away
    mid-decode is aborted and its pages come back within a second; the server answers after."""
    args = ["--model", str(model_dir), "--served-model-name", "m", "--device", "cuda",
            "--kv-cache-dtype", "fp8_e4m3", "--max-model-len", "2048", *SMALL_KV]
    with arle_server(args, tmp_path / "serve.log", timeout_s=300) as server:
        body = {"model": "m", "prompt": "a long story", "max_tokens": 1500,
                "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=server.url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                for _ in range(8):
                    next(lines)
                assert _engine_stats(server.url)["running"] == 1
            t0 = time.monotonic()
            while not _pages_back(_engine_stats(server.url)):
                assert time.monotonic() - t0 < 3, "the aborted stream's pages"
                time.sleep(0.02)
            r = http.post("/v1/completions", json={"model": "m", "prompt": "after", "max_tokens": 8,
                                                   "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8_e4m3"])
async def test_host_kv_tier_on_the_gpu(loaded: LoadedModel, tie: float, make_engine: Any,
                                       kv_dtype: str) -> None:
    """Six 120-token conversations over a 20-page device pool with a host tier (pinned
    memory, its copies on the executor's streams, restores beside other steps): their second
    turns find their prefixes on the host (a hybrid model's snapshots too) and answer as a
    pool that evicts nothing does, up to bf16 near-ties; every page comes back. FP8 KV stays
    FP8 on the host, its scales beside it."""
    firsts = [prompt(120, 40 + i) for i in range(6)]
    seconds = [f + prompt(20, 60 + i) for i, f in enumerate(firsts)]
    roomy = make_engine(loaded, max_running_requests=2, kv_cache_dtype=kv_dtype)
    tiered = make_engine(loaded, max_running_requests=2, kv_cache_tokens=320,
                         kv_host_cache_gb=0.5, state_snapshots=2, kv_cache_dtype=kv_dtype)
    assert tiered.cache.num_host_pages > 48
    host = tiered.executor.dev.host_kv
    assert host is not None and host.k.dtype == tiered.executor.dev.kv.k.dtype
    assert (host.k_scale is not None) == (kv_dtype == "fp8_e4m3")
    for engine in (roomy, tiered):
        await greedy_with_margins(engine, firsts, 8)
    want = await greedy_with_margins(roomy, seconds, 16)
    got = await greedy_with_margins(tiered, seconds, 16)
    for a, b in zip(want, got, strict=True):
        assert_same_up_to_near_ties(a, b, tie)
    stats = tiered.cache.stats
    assert stats["offloaded_pages"] > 0 and stats["host_hit_tokens"] > 0, stats
    if tiered.executor.state is not None:
        assert stats["host_snapshot_hits"] > 0, stats
    assert tiered.snapshot()["kv_host_copy_us"] > 0
    assert_all_pages_back(tiered)
