"""The host KV tier (`--kv-host-cache-gb`) end to end on the CPU: a small device pool and a host
pool (both CPU tensors, the same code path as CUDA's device and pinned host memory). Many
conversations come back to their prefixes after the device pool has evicted them: their pages
come back from the host, and every answer equals an engine whose device pool holds everything.
The page invariant of both tiers is checked after each test (`make_engine`)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import torch
from conftest import cancel_mid_stream, run, tokens_of

from arle.engine.async_engine import AsyncEngine
from arle.engine.request import GenerateRequest, SamplingParams
from arle.model.loader import LoadedModel

#: the tiny models' KV bytes a page: 2 layers x 2 KV heads x 16 dims x (K, V) x fp32 x 16 tokens
TINY_PAGE_BYTES = 2 * 2 * 16 * 2 * 4 * 16


def conversations(vocab: int, n: int, seed: int) -> list[list[int]]:
    """n conversations' first prompts: one of 3 shared system prompts (40-70 tokens), then a
    user turn of its own."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, vocab) for _ in range(rng.randrange(40, 70))] for _ in range(3)]
    return [rng.choice(systems) + [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 20))]
            for _ in range(n)]


async def chat(engine: AsyncEngine, firsts: list[list[int]], turns: int, wave: int,
               seed: int, cancel: bool = False, max_tokens: int = 6
               ) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Each conversation's answers, turn after turn (its prompt: everything so far plus a new
    user turn), `wave` conversations at a time in a random order; and every request's trace.
    cancel: one extra request is cancelled mid-stream in each turn (not compared)."""
    rng = random.Random(seed)
    history = [list(f) for f in firsts]
    answers: list[list[int]] = [[] for _ in firsts]
    traces: list[dict[str, Any]] = []
    for turn in range(turns):
        order = list(range(len(firsts)))
        rng.shuffle(order)
        for i in range(0, len(order), wave):
            group = order[i:i + wave]
            outs = await asyncio.gather(*(run(engine, history[c], max_tokens=max_tokens,
                                              ignore_eos=True) for c in group))
            for c, deltas in zip(group, outs, strict=True):
                ids = tokens_of(deltas)
                answers[c] += ids
                history[c] += ids + [5 + (turn * 7 + c) % 50, 9]
                trace = deltas[-1].trace
                assert trace is not None
                traces.append(trace)
        if cancel:
            req = GenerateRequest(prompt=history[0] + [11, 12, 13],
                                  params=SamplingParams(max_tokens=1000, ignore_eos=True))
            await cancel_mid_stream(engine, req)
    return answers, traces


def small_pool(make_engine: Any, loaded: LoadedModel, host_pages: int = 0) -> AsyncEngine:
    """The tiny model over a device pool of 20 pages, 4 requests at a time, with a host tier of
    `host_pages` pages (0: none)."""
    return make_engine(loaded, kv_cache_tokens=320, max_running_requests=4,
                       kv_host_cache_gb=host_pages * TINY_PAGE_BYTES / 2**30)


async def test_host_tier_answers_equal_an_unbounded_pool(tiny: LoadedModel,
                                                         make_engine: Any) -> None:
    """12 conversations x 3 turns over a device pool of 20 pages (a few conversations' worth;
    4 requests of 30 new tokens outgrow it: preemptions), a cancellation each turn: the answers
    of a pool that evicts nothing, and the returning conversations' prefixes found on the
    host."""
    firsts = conversations(tiny.config.vocab_size, 12, seed=1)
    roomy = make_engine(tiny, kv_cache_tokens=8192)
    want, _ = await chat(roomy, firsts, turns=3, wave=4, seed=2, max_tokens=30)
    tiered = small_pool(make_engine, tiny, host_pages=400)
    assert tiered.cache.num_host_pages == 400
    got, traces = await chat(tiered, firsts, turns=3, wave=4, seed=2, cancel=True,
                             max_tokens=30)
    assert got == want
    assert tiered.scheduler.num_preemptions > 0
    host_hits = sum(t["prefix"]["host_hit_tokens"] for t in traces)
    # (restores also serve re-admissions after preemption, which traces do not count)
    assert 0 < host_hits <= tiered.cache.stats["restored_pages"] * 16
    assert tiered.cache.stats["offloaded_pages"] > 0
    assert all(t["prefix"]["device_hit_tokens"] + t["prefix"]["host_hit_tokens"]
               + t["prefix"]["computed_tokens"] == t["prompt_tokens"] for t in traces)
    # without the tier the same pool recomputes those prefixes
    plain = small_pool(make_engine, tiny)
    again, plain_traces = await chat(plain, firsts, turns=3, wave=4, seed=2, max_tokens=30)
    assert again == want
    computed = [sum(t["prefix"]["computed_tokens"] for t in ts) for ts in (traces, plain_traces)]
    assert computed[0] < computed[1], computed


async def test_a_full_host_tier_drops_its_oldest_pages(tiny: LoadedModel,
                                                       make_engine: Any) -> None:
    """A host tier of 4 pages under the same load: it fills, drops its least recently used
    leaves, and the answers stay right."""
    firsts = conversations(tiny.config.vocab_size, 10, seed=4)
    want, _ = await chat(make_engine(tiny, kv_cache_tokens=8192), firsts, turns=3, wave=4,
                         seed=5)
    small = small_pool(make_engine, tiny, host_pages=4)
    got, _ = await chat(small, firsts, turns=3, wave=4, seed=5)
    assert got == want
    assert small.cache.num_host_pages == 4
    from arle.diagnostics import memory_plan  # what `arle warmup` reports

    assert memory_plan(small)["kv_host_tier"] == {"pages": 4, "bytes": 4 * TINY_PAGE_BYTES,
                                                  "tokens": 64}
    assert small.cache.stats["offloaded_pages"] > 4  # more than it holds: some dropped
    snap = small.snapshot()
    assert snap["kv_host_pages_total"] == 4 and snap["kv_offloaded_pages"] > 4
    from arle.server.metrics import ServerMetrics

    text = ServerMetrics(small.snapshot).prometheus_text().decode()
    assert "arle_kv_host_pages_total 4.0" in text
    offloaded = f"arle_kv_host_offloaded_pages_total {float(snap['kv_offloaded_pages'])}"
    assert offloaded in text, text
    moved = (snap["kv_offloaded_pages"] + snap["kv_restored_pages"]) * TINY_PAGE_BYTES
    assert f"arle_kv_host_copy_bytes_total {float(moved)}" in text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("arle_kv_host_copy")}
    seconds = snap["kv_host_copy_us"] / 1e6
    assert seconds > 0 and values["arle_kv_host_copy_seconds_total"] == pytest.approx(seconds)
    assert values["arle_kv_host_copy_bandwidth_bytes"] == pytest.approx(moved / seconds)


async def test_hybrid_host_tier_answers_equal_an_unbounded_pool(make_engine: Any,
                                                                tmp_path: Any) -> None:
    """Qwen3.5 (Gated DeltaNet layers): a host hit needs the node's state snapshot too. With
    3 device snapshots for 6 conversations, snapshots move to the host tier (with their pages,
    or as the device's run out) and returning turns start from them there; the answers equal
    a pool that evicts nothing."""
    from model_dirs import write_qwen3_5_dir

    from arle.diagnostics import memory_plan
    from arle.executor.paged import StatePool
    from arle.model.loader import load_model
    from arle.server.metrics import ServerMetrics

    write_qwen3_5_dir(tmp_path, seed=3, vocab_size=259)
    hybrid = load_model(tmp_path, "float32")
    firsts = conversations(259, 6, seed=7)
    want, _ = await chat(make_engine(hybrid, kv_cache_tokens=8192), firsts, turns=3, wave=3,
                         seed=8)
    cfg = hybrid.model.rank_config
    pages, snapshots = 16, 3
    state = StatePool.for_model(cfg, 1, 1, hybrid.model.dtype, torch.device("cpu"))
    assert state is not None
    # the host tier 8x the device's pools: 128 pages and 24 snapshots (`host_tier` splits it)
    device = pages * cfg.kv_bytes_per_token(4) * 16 + snapshots * state.slot_bytes
    tiered = make_engine(hybrid, kv_cache_tokens=pages * 16, max_running_requests=3,
                         kv_host_cache_gb=8 * device / 2**30, state_snapshots=snapshots)
    assert tiered.cache.num_host_snapshots == 8 * snapshots
    assert memory_plan(tiered)["kv_host_tier"]["snapshots"] == 8 * snapshots
    got, traces = await chat(tiered, firsts, turns=3, wave=3, seed=8)
    assert got == want
    stats = tiered.cache.stats
    assert stats["offloaded_pages"] > 0 and stats["offloaded_snapshots"] > 0
    assert stats["host_snapshot_hits"] > 0
    assert sum(t["prefix"]["host_hit_tokens"] for t in traces) > 0
    text = ServerMetrics(tiered.snapshot).prometheus_text().decode()
    assert f"arle_kv_host_snapshot_hits_total {float(stats['host_snapshot_hits'])}" in text


async def test_restored_prefixes_wait_a_step_beside_the_others(tiny: LoadedModel,
                                                               make_engine: Any) -> None:
    """Where the executor copies host pages back beside a step (CUDA: `overlaps_restores`,
    forced here), a request whose prefix comes back from the host gets its first row a step
    later when the step has other rows: no row of the step that restores the pages reads
    them, and the answers are unchanged."""
    from dataclasses import replace

    firsts = conversations(tiny.config.vocab_size, 10, seed=11)
    want, _ = await chat(make_engine(tiny, kv_cache_tokens=8192), firsts, turns=3, wave=4,
                         seed=12)
    tiered = small_pool(make_engine, tiny, host_pages=400)
    tiered.scheduler.config = replace(tiered.scheduler.config, overlap_restores=True)
    seen: list[tuple[set[int], list[set[int]]]] = []
    launch = tiered.executor.launch

    def spy(plan: Any) -> Any:
        if plan.kv_restores and plan.kv_restores_overlap:
            seen.append(({d for _, d in plan.kv_restores}, [set(r.pages) for r in plan.rows]))
        return launch(plan)

    tiered.executor.launch = spy  # type: ignore[method-assign]
    got, _ = await chat(tiered, firsts, turns=3, wave=4, seed=12)
    assert got == want
    assert seen, "no restore ran beside a step"
    for restored, tables in seen:
        assert all(not restored & table for table in tables)


@pytest.mark.parametrize("run_pages", [1, 2, 64])
@pytest.mark.parametrize("fp8", [False, True])
def test_batched_copies_equal_page_by_page(run_pages: int, fp8: bool, monkeypatch: Any) -> None:
    """`HostKV.copy` moves runs of consecutive host pages (at most `COPY_RUN_BYTES` a run) in
    one gather or scatter each: the pools end as copying one page at a time in order leaves
    them, for offloads in any order, a host page offloaded twice in one step (the later copy
    holds), and restores. FP8 pages move as bytes, their scales beside them."""
    from arle.executor import paged
    from arle.executor.paged import FP8_KV, HostKV, KVCache

    dtype = FP8_KV if fp8 else torch.float32
    kv = KVCache.allocate(3, 12, 4, 2, 8, dtype, torch.device("cpu"))
    monkeypatch.setattr(paged, "COPY_RUN_BYTES", run_pages * kv.k[:, 0].nbytes)
    gen = torch.Generator().manual_seed(0)
    tensors = [t for t in (kv.k, kv.v, kv.k_scale, kv.v_scale) if t is not None]
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    host = HostKV.beside(kv, 9 * kv.nbytes // 12)
    assert host is not None and host.num_pages == 9 and (host.k_scale is not None) == fp8
    hosted = [t for t in (host.k, host.v, host.k_scale, host.v_scale) if t is not None]
    for t in hosted:
        t.view(torch.uint8).zero_()
    offloads = [(9, 2), (1, 3), (7, 4), (2, 8), (5, 2), (0, 0), (3, 7)]  # host page 2 twice
    restores = [(4, 10), (3, 1), (8, 6), (0, 11)]

    def raw(ts: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t.view(torch.uint8).clone() for t in ts]

    want_host, want_kv = raw(hosted), raw(tensors)
    for d, h in offloads:
        for ht, dt in zip(want_host, want_kv, strict=True):
            ht[h] = dt[:, d]
    for h, d in restores:
        for ht, dt in zip(want_host, want_kv, strict=True):
            dt[:, d] = ht[h]
    host.copy(kv, offloads, restores)
    for got, want in zip(raw(hosted + tensors), want_host + want_kv, strict=True):
        assert torch.equal(got, want)
