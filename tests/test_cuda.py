"""The CUDA path end to end: Triton model vs transformers, the engine on the GPU (graphs,
overlap, batch invariance up to near-ties, FP8 KV quality, an idle engine's CPU use).

Skipped without a CUDA GPU (CI has none): these run on the lent H200 through `device`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run
from gpu_checks import assert_same_up_to_near_ties, greedy_with_margins
from helpers import arle_env, assert_within_bf16, load_script, require_smollm2_gguf
from model_dirs import GPU_SHAPE, hf_config, write_model_dir

from arle.model.loader import LoadedModel, load_model
from arle_kernels.ops import ops_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

#: scripts/check_gpu_parity.py: its prompts, transformers' model and the comparison
PARITY = load_script("check_gpu_parity")
teacher_forced_logits = PARITY.teacher_forced_logits


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3-gpu")
    write_model_dir(path, hf_config("Qwen3ForCausalLM", **GPU_SHAPE), seed=3)
    return path


@pytest.fixture(scope="module")
def gpu_model(gpu_model_dir: Path) -> LoadedModel:
    return load_model(gpu_model_dir, "bfloat16", "cuda")


def _prompt(n: int, seed: int, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _assert_fp8_kv_close(fp8: torch.Tensor, bf16: torch.Tensor, where: object) -> None:
    """FP8 KV's logits against bf16 KV's: top-1 agreement >= 95%, KL < 0.02."""
    m = PARITY.compare(fp8, bf16)
    assert m["top1"] >= 0.95 and m["kl_mean"] < 0.02, (where, m)


def test_teacher_forced_logits_match_transformers(gpu_model_dir: Path,
                                                   gpu_model: LoadedModel) -> None:
    """arle bf16 (Triton) against transformers fp32 on the same weights must be no worse than
    transformers bf16 is against its own fp32: prefill in one chunk, in chunks of 37 (extend
    over a cached prefix), and token by token (the decode kernel)."""
    ids = _prompt(300, 0)
    ref, hf16 = (PARITY.hf_logits(PARITY.hf_model(gpu_model_dir, dtype), [ids])[0]
                 for dtype in (torch.float32, torch.bfloat16))
    hf_bf16 = PARITY.compare(hf16, ref)
    for chunk in (None, 37, 1):
        assert_within_bf16(teacher_forced_logits(gpu_model.model, ids, chunk_size=chunk), ref,
                           hf_bf16, min(hf_bf16["top1"] - 0.02, 0.97), chunk)


def test_fp8_kv_quality(gpu_model: LoadedModel) -> None:
    """FP8 (e4m3, per token-head scales) KV against bf16 KV, teacher-forced."""
    ids = _prompt(400, 1)
    bf16 = teacher_forced_logits(gpu_model.model, ids)
    for chunk in (None, 1):
        _assert_fp8_kv_close(teacher_forced_logits(gpu_model.model, ids, chunk_size=chunk,
                                                   kv_dtype=torch.float8_e4m3fn), bf16, chunk)


async def test_engine_batch_invariance_graphs_and_overlap(gpu_model: LoadedModel,
                                                          make_engine: Any) -> None:
    prompts = [_prompt(n, 10 + i) for i, n in enumerate([5, 17, 33, 64, 100, 129, 250, 400] * 2)]
    engine = make_engine(gpu_model, max_running_requests=32)
    assert engine.executor.graphs is not None  # type: ignore[attr-defined]
    alone = [(await greedy_with_margins(engine, [p], 24))[0] for p in prompts[:4]]
    batched = await greedy_with_margins(engine, prompts, 24)
    for a, b in zip(alone, batched, strict=False):
        assert_same_up_to_near_ties(a, b)
    eager = make_engine(gpu_model, max_running_requests=32, cuda_graph=False, overlap=False)
    for a, b in zip(batched, await greedy_with_margins(eager, prompts, 24), strict=True):
        assert_same_up_to_near_ties(a, b)
    engine.cache.check()
    eager.cache.check()


async def test_engine_prefix_hit_and_sampling_on_gpu(gpu_model: LoadedModel,
                                                     make_engine: Any) -> None:
    engine = make_engine(gpu_model, max_running_requests=8)
    prompt = _prompt(200, 5)
    first = await run(engine, prompt, max_tokens=8, logprobs=1)
    second = await run(engine, prompt, max_tokens=8, logprobs=1)
    assert second[-1].usage is not None and second[-1].usage.cached_tokens >= 192
    toks = [t for d in first for t in d.token_ids]
    assert toks == [t for d in second for t in d.token_ids]
    seeded = [await run(engine, prompt, max_tokens=16, temperature=1.0, top_p=0.9, top_k=50,
                        seed=7, repetition_penalty=1.1) for _ in range(2)]
    assert ([t for d in seeded[0] for t in d.token_ids]
            == [t for d in seeded[1] for t in d.token_ids])
    engine.cache.check()


async def test_sampled_batches_same_with_and_without_overlap(gpu_model: LoadedModel,
                                                             make_engine: Any) -> None:
    """Eight seeded, penalised requests with logprobs, decoding together: with overlap, step
    N+1's inputs and sampling parameters are copied in (on the copy-in stream) while step N
    runs, and step N's ids and logprobs are copied out on the copy-out stream. Without
    overlap each step is launched after the last one's results arrived. The batches are the
    same (one prefill step, then batches of 8 in the same graph), so every token and logprob
    must be too: a copy ordered wrong reads another step's inputs or an unwritten output."""
    prompts = [_prompt(24, 40 + i) for i in range(8)]
    params = {"max_tokens": 24, "ignore_eos": True, "temperature": 0.9, "top_p": 0.95,
              "top_k": 40, "repetition_penalty": 1.2, "presence_penalty": 0.3, "logprobs": 3}
    got = []
    for overlap in (True, False):
        engine = make_engine(gpu_model, max_running_requests=8, overlap=overlap)
        # NOTE: the engine's loop starts once all eight wait (tokenizing in threads, they
        # would otherwise arrive in a different order of steps in each run)
        start_loop, engine._ensure_loop = engine._ensure_loop, lambda: None
        tasks = [asyncio.create_task(run(engine, p, seed=100 + i, **params))
                 for i, p in enumerate(prompts)]
        while len(engine.scheduler.waiting) < len(prompts):
            await asyncio.sleep(0.001)
        engine._ensure_loop = start_loop
        start_loop()
        outs = await asyncio.gather(*tasks)
        got.append([[(lp.token_id, lp.logprob, lp.top) for d in out for lp in d.logprobs or []]
                    for out in outs])
        engine.cache.check()
    assert all(len(r) == 24 for r in got[0])
    assert len({tuple(t for t, _, _ in r) for r in got[0]}) == 8  # eight different streams
    assert got[0] == got[1]


async def test_extend_graphs_match_eager(gpu_model: LoadedModel, make_engine: Any) -> None:
    """Prefills and mixed steps replayed from the extend graphs (padded to a token count of
    the ladder, every row an extend row) give what eager steps give: the same first tokens (up
    to near-ties) and logprobs within bf16 noise; a prompt past the largest graph runs
    eagerly."""
    graphs = make_engine(gpu_model, max_running_requests=8, max_batched_tokens=4096,
                         chunked_prefill_size=4096)
    ex = graphs.executor
    assert ex.extend_graphs is not None and ex.extend_graphs.sizes[-1] == 2048
    replays: list[int] = []
    replay = ex._replay_extend

    def counted(h: Any, meta: Any) -> Any:
        replays.append(h.extend_tokens)
        return replay(h, meta)

    ex._replay_extend = counted
    eager = make_engine(gpu_model, max_running_requests=8, max_batched_tokens=4096,
                        chunked_prefill_size=4096, cuda_graph=False)
    prompts = [_prompt(n, 90 + n) for n in (5, 100, 700, 3000)]
    for p in prompts:
        assert_same_up_to_near_ties((await greedy_with_margins(graphs, [p], 3))[0],
                              (await greedy_with_margins(eager, [p], 3))[0])
    # concurrent: decode rows beside prefills in one step (mixed), replayed too
    a = await greedy_with_margins(graphs, prompts[:3], 8)
    b = await greedy_with_margins(eager, prompts[:3], 8)
    for x, y in zip(a, b, strict=True):
        assert_same_up_to_near_ties(x, y)
    # 5, 100, 700 tokens (+ a decode row or two) -> 32, 128, 768; 3000 ran eagerly
    assert {32, 128, 768} <= set(replays) and max(replays) <= 1024
    graphs.cache.check()
    eager.cache.check()


async def test_pdl_changes_no_bit(gpu_model: LoadedModel, make_engine: Any) -> None:
    """Programmatic dependent launch lets each kernel start while the one before it ends; a
    wait placed wrong would read a half-written tensor. The same requests, one at a time (so
    every step is the same batch), give the same tokens and the same logprobs, to the bit,
    with PDL on and off: prefill chunks (eager kernels) and decode (CUDA graphs)."""
    from arle_kernels.jit import pdl_enabled, set_pdl

    if not pdl_enabled():
        pytest.skip("no PDL here (compute capability < 9.0, or an old Triton)")
    prompts = [_prompt(n, 70 + n) for n in (9, 100, 300)]
    results = []
    try:
        for pdl in (False, True):
            set_pdl(pdl)
            engine = make_engine(gpu_model, max_running_requests=8)
            got = []
            for p in prompts:
                deltas = await run(engine, p, max_tokens=20, ignore_eos=True, logprobs=2)
                got.append([(lp.token_id, lp.top) for d in deltas for lp in d.logprobs or []])
            results.append(got)
            engine.cache.check()
    finally:
        set_pdl(None)
    assert len(results[1][0]) == 20 and results[0] == results[1]


async def test_idle_engine_sleeps(gpu_model: LoadedModel, make_engine: Any) -> None:
    engine = make_engine(gpu_model, max_running_requests=8)
    await run(engine, _prompt(20, 2), max_tokens=4)
    t0 = time.process_time()
    await asyncio.sleep(1.0)
    assert time.process_time() - t0 < 0.1


# NOTE: the small graphs, then no graphs first: then no test before them in this process built
# their variants (the small graphs' model has a head dim of its own: its attention variants are
# its own; the GEMVs' are keyed on their tiles, shared by every model here)
@pytest.mark.parametrize("graph_bs", [2, 0, None], ids=["small_graphs", "eager", "graphs"])
async def test_no_kernel_builds_after_warm_up(tmp_path: Path, make_engine: Any,
                                              graph_bs: int | None) -> None:
    """After the serve warm-up, staggered arrivals (mixed steps with every count of decode
    rows, page tables of every width, several prefills per step) build no new Triton variant:
    each would stall every request for up to seconds mid-serving. Without graphs, with graphs
    for every batch size, and with graphs for 1-2 rows only (`--cuda-graph-max-bs 2`: larger
    steps run eagerly). A model of its own head shape (head dim 64, 32 for the small graphs;
    8 query heads per KV head), so no earlier test built its variants. (Seen on the H200:
    eager lm_head at 3..16 rows built its tensor-core variant mid-serving.)"""
    from arle.diagnostics import Phase, warmup_passes
    from arle_kernels.jit import watch_compiles

    # NOTE: a vocabulary >= 32768, so lm_head takes the tensor-core GEMV at 3..16 rows
    write_model_dir(tmp_path, hf_config("Qwen3ForCausalLM", **{
        **GPU_SHAPE, "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 1,
        "head_dim": 32 if graph_bs == 2 else 64, "vocab_size": 32768}), seed=4)
    # the small graphs: 24 requests 0.2 ms apart with room for 32, so most steps run eagerly,
    # at up to 24 rows
    small = graph_bs == 2
    engine = make_engine(load_model(tmp_path, "bfloat16", "cuda"),
                         max_running_requests=32 if small else 16,
                         kv_cache_tokens=32768, cuda_graph=graph_bs != 0,
                         cuda_graph_max_bs=graph_bs or None)
    phases: list[Phase] = []
    assert await warmup_passes(engine, phases), phases
    built: list[str] = []
    stop = watch_compiles(built.append)
    if stop is None:
        pytest.skip("this Triton has no jit_cache_hook to watch builds with")
    try:
        async def late(i: int) -> None:
            await asyncio.sleep((0.0002 if small else 0.003) * i)
            await run(engine, _prompt(7 + 37 * i, 50 + i), max_tokens=12 + i, ignore_eos=True)
        await asyncio.gather(*(late(i) for i in range(24)))
    finally:
        stop()
    assert not built, f"{len(built)} variants built after warm-up: {built[:3]}"
    engine.cache.check()


# NOTE: KV head counts no other test uses (3 and 5), so the attention variants (the cache's
# strides are constexprs) are this test's own, whatever ran before it in this process
@pytest.mark.parametrize("kv_heads", [3, 5], ids=["graphs", "eager"])
async def test_start_up_builds_its_variants_ahead(tmp_path: Path, make_engine: Any,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  kv_heads: int) -> None:
    """The executor's one build pass (`cuda_startup.build_ahead`: the model cut to two layers, against the
    profile's scratch cache, before the KV pool is sized) takes every Triton variant that
    start-up's real passes then run: the profile step, each graph's warm-up and capture (or,
    without graphs, the eager variants) and the greedy pick. A miss would be built later, on
    the launching thread, one after another."""
    import arle.executor.cuda_startup as cuda_startup
    from arle_kernels.jit import watch_compiles

    write_model_dir(tmp_path, hf_config("Qwen3ForCausalLM", **{
        **GPU_SHAPE, "head_dim": 64, "num_attention_heads": 2 * kv_heads,
        "num_key_value_heads": kv_heads}), seed=5)
    loaded = load_model(tmp_path, "bfloat16", "cuda")
    inside = False
    build_ahead = cuda_startup.compile_ahead

    @contextlib.contextmanager
    def tracked(workers: int | None = None) -> Iterator[bool]:
        nonlocal inside
        with build_ahead(workers) as on:
            inside = True
            try:
                yield on
            finally:
                inside = False

    monkeypatch.setattr(cuda_startup, "compile_ahead", tracked)
    ahead: list[str] = []
    late: list[str] = []
    stop = watch_compiles(lambda kernel: (ahead if inside else late).append(kernel))
    if stop is None:
        pytest.skip("this Triton has no jit_cache_hook to watch builds with")
    try:
        make_engine(loaded, max_running_requests=16, kv_cache_tokens=8192,
                    cuda_graph=kv_heads == 3, serving=True)
    finally:
        stop()
    assert any("_decode_split_kernel" in k for k in ahead), ahead
    assert not late, f"{len(late)} variants built after the build pass: {late[:3]}"


async def test_start_up_reads_the_rotary_table_within_it(tmp_path: Path, make_engine: Any,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """A step's prefill chunk may be longer than the model's context: here 16384 tokens
    against 4096. Start-up's profile step (one chunk of that many) still gives the rope kernel,
    which reads the rotary table unchecked, only positions within the table. (Seen before: an
    illegal memory access at start-up, depending on what lay past the table.)"""
    import dataclasses

    import arle.executor.cuda as cuda_executor

    seen: list[tuple[int, int]] = []  # (largest position, table length) of each eager call

    def checked(device: torch.device) -> Any:
        ops = ops_for(device)

        def rope(qkv: Any, positions: torch.Tensor, cos_sin: torch.Tensor, *args: Any,
                 **kwargs: Any) -> Any:
            if not torch.cuda.is_current_stream_capturing():
                seen.append((int(positions.max()), cos_sin.shape[0]))
            return ops.qk_norm_rope_store_kv(qkv, positions, cos_sin, *args, **kwargs)
        return dataclasses.replace(ops, qk_norm_rope_store_kv=rope)

    monkeypatch.setattr(cuda_executor, "ops_for", checked)
    write_model_dir(tmp_path, hf_config("Qwen3ForCausalLM", **GPU_SHAPE), seed=7)
    make_engine(load_model(tmp_path, "bfloat16", "cuda"), max_batched_tokens=16384,
                cuda_graph=False)
    assert max(p for p, _ in seen) >= 4000, seen  # the long chunk was among them
    assert all(p < length for p, length in seen), [s for s in seen if s[0] >= s[1]][:3]


async def test_eager_decode_above_the_graphs_builds_nothing(tmp_path: Path,
                                                            make_engine: Any) -> None:
    """With graphs for 1-2 rows only (`--cuda-graph-max-bs 2`), decode steps of 3-32 rows run
    eagerly: start-up builds their decode-attention variants (each split count they pick, with
    and without the preload), so no batch size builds one mid-serving. No warm-up pass runs
    here, so only start-up can have built them; 6 KV heads, which no other test uses, so no
    test before this one in the process did."""
    from arle_kernels.jit import watch_compiles

    write_model_dir(tmp_path, hf_config("Qwen3ForCausalLM", **{
        **GPU_SHAPE, "hidden_size": 256, "num_attention_heads": 12, "num_key_value_heads": 6,
        "head_dim": 32}), seed=6)
    engine = make_engine(load_model(tmp_path, "bfloat16", "cuda"), max_running_requests=32,
                         cuda_graph=True, cuda_graph_max_bs=2)
    ex = engine.executor
    cfg = ex.model.config
    k, v, ks, vs = ex.dev.kv.layer(0)
    built: list[str] = []
    stop = watch_compiles(built.append)
    if stop is None:
        pytest.skip("this Triton has no jit_cache_hook to watch builds with")
    splits = set()
    try:
        for b in range(3, 33):
            splits.add(ex.num_splits_for(b))
            q = torch.zeros(b, cfg.num_heads, cfg.head_dim, dtype=torch.bfloat16, device="cuda")
            ex.model.ops.decode_attention(
                q, k, v, torch.zeros(b, 1, dtype=torch.int32, device="cuda"),
                torch.ones(b, dtype=torch.int32, device="cuda"), 1.0, ex.num_splits_for(b),
                k_scale=ks, v_scale=vs)
        torch.cuda.synchronize()
    finally:
        stop()
    assert len(splits) > 1, splits  # several variants to build, not one
    assert not built, f"{len(built)} variants built for eager decode steps: {built[:3]}"



def _forget_loaded_variants() -> None:
    """Drop the kernel variants this process holds in memory (not Triton's disk cache): the
    next use of each loads it again, which `watch_compiles` sees, whatever earlier tests ran."""
    import sys

    import triton

    for name, module in list(sys.modules.items()):
        if name.startswith("arle_kernels"):
            for obj in vars(module).values():
                if isinstance(obj, triton.runtime.JITFunction):
                    obj.device_caches.clear()


@pytest.mark.parametrize("ahead", [True, False], ids=["prefills_ahead", "without_them"])
async def test_one_request_engine_builds_nothing_after_start_up(
        tmp_path: Path, make_engine: Any, monkeypatch: pytest.MonkeyPatch, ahead: bool) -> None:
    """`arle complete` and `arle chat` run one request at a time: one decode graph, no extend
    graphs, no warm-up pass, so every prefill runs eagerly. Prompts of every row class and
    longer, a cached prefix, greedy and sampled, then build (or load) no kernel variant: each
    would stall the request (seen on the H200 from a cold cache: 1 s before the first token).
    Without start-up's short prefills (`eager_prefill_runs`) they do: what the test sees."""
    import arle.executor.cuda_startup as cuda_startup
    from arle_kernels.jit import watch_compiles

    if not ahead:
        monkeypatch.setattr(cuda_startup, "eager_prefill_runs", lambda *args: [])
    write_model_dir(tmp_path, hf_config("Qwen3ForCausalLM", **GPU_SHAPE), seed=8)
    loaded = load_model(tmp_path, "bfloat16", "cuda")
    _forget_loaded_variants()
    engine = make_engine(loaded, max_running_requests=1)
    ex = engine.executor
    assert ex.extend_graphs is None and ex.graphs is not None and ex.graphs.sizes == [1]
    built: list[str] = []
    stop = watch_compiles(built.append)
    if stop is None:
        pytest.skip("this Triton has no jit_cache_hook to watch builds with")
    try:
        for n in (1, 2, 5, 16, 20, 32, 40, 100, 333):
            await run(engine, _prompt(n, 60 + n), max_tokens=3, ignore_eos=True)
        prompt = _prompt(100, 7)
        for extra in ([], _prompt(21, 8)):  # then 96 of its tokens cached
            await run(engine, prompt + extra, max_tokens=3, ignore_eos=True)
        await run(engine, _prompt(30, 9), max_tokens=4, temperature=0.8, top_p=0.9, seed=1)
    finally:
        stop()
    if ahead:
        assert not built, f"{len(built)} variants built after start-up: {built[:3]}"
    else:
        assert built
    engine.cache.check()

# ---- the default model: trained weights (SmolLM2-135M-Instruct, Q4_1 GGUF) -----------------
# NOTE: what a user runs first (`make run` on a GPU machine takes the GPU), with shapes the
# random Qwen3 models above lack (Llama: no q/k norm, head dim 64, 3 query heads per KV head,
# hidden 576, tied embeddings) and real logit margins (a random model's top-1 caps near 94%).

@pytest.fixture(scope="module")
def smol_gpu() -> LoadedModel:
    return load_model(require_smollm2_gguf(), "bfloat16", "cuda")


@pytest.fixture(scope="module")
def smol_refs(smol_gpu: LoadedModel) -> tuple[list[list[int]], list[torch.Tensor],
                                              list[torch.Tensor]]:
    """The parity script's English prompts, and transformers' logits of each in fp32 (the
    reference) and in bf16 (its own rounding error: the scale arle's is held to)."""
    prompts = PARITY.text_prompts(smol_gpu)
    logits = []
    for dtype in (torch.float32, torch.bfloat16):
        hf = PARITY.hf_model(require_smollm2_gguf(), dtype)
        logits.append(PARITY.hf_logits(hf, prompts))
        del hf
    return prompts, logits[0], logits[1]


def test_default_model_logits_match_transformers(smol_gpu: LoadedModel, smol_refs: Any) -> None:
    """The same bound as the random Qwen3's above, on trained weights: arle bf16 (Triton)
    against transformers fp32 no worse than transformers bf16 is; prefill whole, in chunks of
    37, and token by token (decode attention, up to 8 splits on the ~800-token prompt)."""
    prompts, ref32, ref16 = smol_refs
    ref = torch.cat(ref32)
    hf_bf16 = PARITY.compare(torch.cat(ref16), ref)
    for chunk in (None, 37, 1):
        ours = torch.cat([teacher_forced_logits(smol_gpu.model, ids, chunk_size=chunk)
                          for ids in prompts])
        assert_within_bf16(ours, ref, hf_bf16, hf_bf16["top1"] - 0.01, chunk)


def test_default_model_fp8_kv_quality(smol_gpu: LoadedModel, smol_refs: Any) -> None:
    """FP8 KV on trained weights, on the GPU: the bound the CPU test holds the kernels' torch
    references to on this model (tests/test_fp8_kv.py), teacher-forced against bf16 KV."""
    prompts = smol_refs[0]
    for chunk in (None, 1):
        bf16 = torch.cat([teacher_forced_logits(smol_gpu.model, ids, chunk_size=chunk)
                          for ids in prompts])
        fp8 = torch.cat([teacher_forced_logits(smol_gpu.model, ids, chunk_size=chunk,
                                               kv_dtype=torch.float8_e4m3fn) for ids in prompts])
        _assert_fp8_kv_close(fp8, bf16, chunk)


async def test_default_model_greedy_matches_transformers(smol_gpu: LoadedModel, smol_refs: Any,
                                                         make_engine: Any) -> None:
    """The engine as it serves (graphs, overlap, the prompts decoding together) continues each
    prompt as transformers' fp32 `generate` does, up to a near-tie."""
    prompts = smol_refs[0]
    engine = make_engine(smol_gpu, max_running_requests=8)
    assert engine.executor.graphs is not None
    ours = await greedy_with_margins(engine, prompts, 32)
    hf = PARITY.hf_model(require_smollm2_gguf(), torch.float32)
    for ids, got in zip(prompts, ours, strict=True):
        out = hf.generate(torch.tensor([ids], device="cuda"), do_sample=False,
                          max_new_tokens=32, eos_token_id=None,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"),
                          pad_token_id=smol_gpu.tokenizer.pad_token_id)
        assert_same_up_to_near_ties(got, [(t, 0.0) for t in out[0, len(ids):].tolist()])
    engine.cache.check()


def test_make_run_answers_on_the_gpu() -> None:
    """`make run`'s command on a GPU machine (`--device auto` takes the GPU): the default
    model's answer, streamed to stdout, and the model loaded on CUDA (its log event)."""
    import json
    import subprocess
    import sys

    require_smollm2_gguf()
    env = arle_env()
    proc = subprocess.run([sys.executable, "-m", "arle", "complete",
                           "What is the capital of France?", "--max-tokens", "32",
                           "--log-format", "json",
                           # NOTE: the GPU suite runs 4 processes on one card: the default
                           # fraction (0.85 of the card) does not fit beside them
                           "--mem-fraction-static", "0.5"], env=env, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Paris" in proc.stdout, proc.stdout
    events = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    loaded = [e for e in events if e.get("event") == "model_loaded"]
    assert loaded and loaded[0]["device"] == "cuda", loaded
