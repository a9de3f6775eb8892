"""The CUDA executor's start-up: the profile step, the memory plan, the graphs' capture, and
every Triton kernel variant built before the first request.

`start_up` runs the phases in order:
1. the profile step's scratch cache stands in for the KV pool (a kernel variant depends on the
   cache's layout, not on its size);
2. one pass builds, side by side, every variant start-up and serving will run (`build_ahead`);
3. the profile step (the largest step, every slot sampling) measures the activation peak, and
   the KV pool takes what `--mem-fraction-static` leaves (`plan_memory`);
4. the decode and extend graphs are captured; eager decode steps above the graphs and the
   sampler get their variants built.
NOTE: no variant may be built after start-up: a build mid-serving stalls every request.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from arle.errors import ArleError
from arle.executor.cuda_graphs import EXTEND_GRAPH_ROWS, graph_reserve
from arle.executor.paged import FP8_KV, DeviceStep, KVCache, kv_format
from arle.executor.sampler import SamplingBatch, sample
from arle.logging import get_logger
from arle.model.config import ModelConfig
from arle.model.decoder import DecoderLM
from arle.model.moe import Experts
from arle.model.parallel import fp8_scale_of
from arle.sampling import SamplingParams
from arle_kernels.decode_attention import (
    MERGE_O_WITH_LSE_MAX_BATCH,
    PRELOAD_MAX_BATCH,
    pick_num_splits,
)
from arle_kernels.fp8 import fp8_row_classes
from arle_kernels.gemv import row_classes
from arle_kernels.jit import compile_ahead
from arle_kernels.moe import moe_token_classes
from arle_kernels.noise import exponential_noise

if TYPE_CHECKING:
    from arle.executor.cuda import CUDAExecutor

log = get_logger("arle.executor.cuda")

#: The profile run samples with the most memory-hungry path (a sort over the vocabulary).
PROFILE_PARAMS = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=5)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes of the GPU's memory, by use, and the KV pool's pages."""

    total_bytes: int
    weights_bytes: int
    #: a hybrid model's recurrent states: slots, their boundary copies, snapshots
    state_pool_bytes: int
    activation_peak_bytes: int
    graph_reserve_bytes: int
    num_pages: int


def start_up(ex: CUDAExecutor) -> dict[str, Any]:
    """Make `ex` ready to step: its KV pool (`ex.kv`), its graphs, every kernel variant it
    will launch. Returns what each phase measured (`ex.startup_info`)."""
    config = ex.config
    with torch.cuda.stream(ex.stream):
        states = ex.state.nbytes if ex.state is not None else 0
        weights = torch.cuda.memory_allocated(ex.device) - states
        t0 = time.perf_counter()
        ex.kv = scratch_cache(ex)
        profile = prefill_step(ex, config.max_batched_tokens, PROFILE_PARAMS,
                               min(ex.num_slots, config.max_batched_tokens))
        before = torch.cuda.memory_allocated(ex.device)
        ex.make_graph_buffers()
        buffers = torch.cuda.memory_allocated(ex.device) - before
        decode_runs = (ex.graphs.runs(ex.forward_decode, ex.pick_num_splits, ex.pad_slot)
                       if ex.graphs is not None else {})
        extend_runs = (ex.extend_graphs.runs(ex.forward_extend)
                       if ex.extend_graphs is not None else {})
        eager_above = ex.eager_decode_above()
        eager = (() if eager_above is None
                 else (functools.partial(build_eager_decode_variants, ex, eager_above),))
        prefills = eager_prefill_runs(ex)
        built = build_ahead(ex, profile, *prefills, *decode_runs.values(),
                            *extend_runs.values(), *eager,
                            functools.partial(build_sampler_variants, ex))
        # NOTE: the graphs' static buffers are not the profile step's: the reserve has them
        peak = peak_memory(profile, ex.device) - buffers
        for run in prefills:  # for real, on the scratch cache
            run()
        del ex.kv, profile, prefills
        torch.cuda.empty_cache()
        profile_s = time.perf_counter() - t0 - built["seconds"]
        plan = plan_memory(ex, weights, states, peak)
        # NOTE: TP: every rank's pool has the pages of the smallest plan (rank 0's cache
        # manager hands out page ids every rank's pool must hold)
        plan = replace(plan, num_pages=ex.model.tp.all_min(plan.num_pages, ex.device))
        m = ex.model.rank_config
        ex.kv = KVCache.for_model(m, plan.num_pages, config.page_size, config.kv_dtype,
                                  ex.device)
    fmt = kv_format(config.kv_dtype)
    log.info("memory_plan", total_gb=round(plan.total_bytes / 1e9, 2),
             weights_gb=round(weights / 1e9, 2), state_pool_gb=round(states / 1e9, 2),
             activation_peak_gb=round(plan.activation_peak_bytes / 1e9, 2),
             graph_reserve_gb=round(plan.graph_reserve_bytes / 1e9, 2),
             mem_fraction_static=config.mem_fraction_static, profile_s=round(profile_s, 2))
    log.info(f"KV pool: {plan.num_pages * config.page_size} tokens, {plan.num_pages} pages @ "
             f"{config.page_size}, {ex.kv.nbytes / 1e9:.2f} GB, format {fmt}")

    if ex.graphs is not None:
        pool = torch.cuda.graph_pool_handle()
        ex.graphs.capture(decode_runs, pool, ex.stream)
        if ex.extend_graphs is not None:
            ex.extend_graphs.capture(extend_runs, pool, ex.stream)
    if eager_above is not None:
        build_eager_decode_variants(ex, eager_above)
    build_sampler_variants(ex)
    memory = {k: v for k, v in asdict(plan).items() if k != "num_pages"}
    return {
        "memory_plan": {**memory, "kv_pool_bytes": ex.kv.nbytes, "kv_format": fmt,
                        "mem_fraction_static": config.mem_fraction_static,
                        "profile_s": round(profile_s, 3)},
        "kernels_built_ahead": built,
        "cuda_graphs": ({"batch_sizes": ex.graphs.sizes,
                         "capture_s": round(ex.graphs.capture_s, 3)}
                        if ex.graphs is not None else None),
        "extend_graphs": ({"tokens": ex.extend_graphs.sizes, "rows": ex.extend_graphs.rows,
                           "capture_s": round(ex.extend_graphs.capture_s, 3)}
                          if ex.extend_graphs is not None else None),
    }


def scratch_cache(ex: CUDAExecutor) -> KVCache:
    """A KV cache for the profile step: one full prefill chunk."""
    m = ex.model.rank_config
    pages = -(-ex.config.max_batched_tokens // ex.page_size) + 1
    return KVCache.for_model(m, pages, ex.page_size, ex.config.kv_dtype, ex.device)


def prefill_step(ex: CUDAExecutor, n: int, params: SamplingParams, rows: int
                 ) -> Callable[[], None]:
    """One prefill chunk of n tokens at positions 0..n-1, on `ex.kv` (the scratch cache, every
    page in its page table), `rows` of its tokens sampling with `params`. At
    `max_batched_tokens`, every slot sampling with PROFILE_PARAMS: the largest step, what the
    memory plan measures."""
    model, device = ex.model, ex.device
    ids = torch.randint(0, model.config.vocab_size, (n,), dtype=torch.int32, device=device)
    slots = torch.arange(n, dtype=torch.int32, device=device)
    # NOTE: a chunk may be longer than the model's context (max_batched_tokens above
    # max_model_len); the rope kernel reads the rotary table at each position unchecked
    pos = slots % ex.rotary.shape[0]
    table = torch.arange(ex.kv.k.shape[1], dtype=torch.int32, device=device)[None]
    step = DeviceStep(ids, pos, slots, torch.tensor([n], dtype=torch.int32, device=device),
                      torch.tensor([0, n], dtype=torch.int32, device=device), table,
                      num_decode=0, max_q_len=n, num_splits=1,
                      slots=torch.full((1,), ex.pad_slot, dtype=torch.int32, device=device))
    batch = SamplingBatch.build([params] * rows, [0] * rows, device)

    def run() -> None:
        with torch.inference_mode():
            hidden = model(ids, ex.backend(step))
            sample(model.logits(hidden[:rows]), batch, generator=ex.generator)
    return run


def eager_prefill_runs(ex: CUDAExecutor) -> list[Callable[[], None]]:
    """Without extend graphs (one running request, or no graphs), prefill steps run eagerly at
    any length: one short prefill per variant class their kernels compile by row count
    (`token_classes` above one row: the GEMVs' also give the glue kernels a count that is
    neither 1 nor a multiple of 16), one row sampling greedily. So no prompt builds a variant mid-request."""
    if ex.extend_graphs is not None:
        return []
    greedy = SamplingParams(temperature=0.0)
    return [prefill_step(ex, n, greedy, 1)
            for n in token_classes(ex.model, ex.config.max_batched_tokens) if n > 1]


def build_ahead(ex: CUDAExecutor, *passes: Callable[[], object]) -> dict[str, float]:
    """Run the start-up passes with their launches turned into compiles (`compile_ahead`): the
    Triton kernel variants they take are built side by side, on every core, before the passes
    run for real (from a cold cache they are most of the time to ready). Returns the seconds,
    the variants built and how many of them worker processes compiled.
    The model runs cut to a few layers (`variant_layers`): the pass is host work that the
    builds share the interpreter with, and the other layers would only repeat it.
    NOTE: nothing is computed, so a pass here must be one that runs again after."""
    t0 = time.perf_counter()
    with (torch.inference_mode(), torch.cuda.stream(ex.stream),
          compile_ahead() as builds, variant_layers_only(ex.model)):
        for run in passes if builds.on else ():
            run()
    built = {"seconds": round(time.perf_counter() - t0, 3), "variants": builds.variants,
             "in_processes": builds.in_processes}
    log.info("kernels_built_ahead", **built)
    return built


def variant_layers(cfg: ModelConfig) -> list[int]:
    """Layers that launch every kernel variant the model's layers do: 0 (no residual yet), 1,
    and the first of each other kind (mixer and MLP) there is (one set of shapes, dtypes and
    alignments per kind)."""
    chosen: dict[tuple[bool, bool], int] = {}
    for i in range(cfg.num_layers):
        chosen.setdefault((cfg.is_linear(i), cfg.is_moe(i)), i)
    return sorted({*range(min(2, cfg.num_layers)), *chosen.values()})


@contextlib.contextmanager
def variant_layers_only(model: DecoderLM) -> Iterator[None]:
    """Inside, `model` runs `variant_layers` only: enough for a pass that builds kernel
    variants."""
    layers = model.layers
    model.layers = nn.ModuleList(layers[i] for i in variant_layers(model.config))
    try:
        yield
    finally:
        model.layers = layers


def peak_memory(run: Callable[[], None], device: torch.device) -> int:
    """The peak of allocated memory while run() runs (what is allocated now included)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def plan_memory(ex: CUDAExecutor, weights: int, states: int, peak: int) -> MemoryPlan:
    """The KV pool's pages: `--mem-fraction-static` of the GPU, less the weights, the state
    pool and the profile step's activation peak (`peak` counts all three) and the graphs'
    reserve; or `--kv-cache-tokens` where given."""
    config, m = ex.config, ex.model.rank_config
    total = torch.cuda.get_device_properties(ex.device).total_memory
    per_token = m.kv_bytes_per_token(torch.finfo(config.kv_dtype).bits // 8,
                                     4 if config.kv_dtype == FP8_KV else 0)
    graphs = config.cuda_graph_max_bs > 0
    reserve = graph_reserve(
        min(config.cuda_graph_max_bs, ex.num_slots) if graphs else 0,
        min(config.extend_graph_max_tokens, config.max_batched_tokens),
        min(EXTEND_GRAPH_ROWS, ex.num_slots), m.vocab_size, peak - weights - states,
        config.max_batched_tokens)
    budget = int(total * config.mem_fraction_static) - peak - reserve
    if config.kv_cache_tokens is None and budget < 2 * config.page_size * per_token:
        raise ArleError(
            f"no memory left for the KV cache: weights {weights / 2**30:.1f} GiB + "
            f"recurrent states {states / 2**30:.1f} GiB + "
            f"activations {(peak - weights - states) / 2**30:.1f} GiB exceed "
            f"--mem-fraction-static {config.mem_fraction_static} of {total / 2**30:.1f} GiB")
    tokens = config.kv_cache_tokens or budget // per_token
    pages = max(tokens // config.page_size, 2)
    free, _ = torch.cuda.mem_get_info(ex.device)
    check_fits(pages * config.page_size * per_token, reserve, free,
               total - free - torch.cuda.memory_reserved(ex.device), config.mem_fraction_static)
    return MemoryPlan(total, weights, states, peak - weights - states, reserve, pages)


def check_fits(kv: int, reserve: int, free: int, others: int, fraction: float) -> None:
    """Refuse, with what to change, a KV pool (plus the graphs' reserve) past the memory free
    now: `--mem-fraction-static` is a share of the whole GPU (as SGLang's), so memory other
    processes hold is not the engine's to plan with."""
    if kv + reserve <= free:
        return
    gib = 2**30
    raise ArleError(
        f"the KV cache ({kv / gib:.1f} GiB) and the CUDA graphs' reserve "
        f"({reserve / gib:.1f} GiB) do not fit in the {free / gib:.1f} GiB free on the GPU "
        f"(other processes hold {max(others, 0) / gib:.1f} GiB): lower --mem-fraction-static "
        f"(now {fraction}) or set --kv-cache-tokens")


def build_eager_decode_variants(ex: CUDAExecutor, above: int = 0) -> None:
    """Build now, for decode steps of more than `above` rows (which run eagerly:
    `ex.eager_decode_above()`), the kernel variants eager steps pick by their size, which the
    warm-up passes may not all reach: the decode kernel's split counts (each its own merge
    variant) with and without its first block loaded before the PDL wait (up to
    PRELOAD_MAX_BATCH rows), and a whole decode step at one row count per class the other
    kernels compile by (`token_classes`). On padding rows (no K/V written, no recurrent
    state); the outputs are thrown away."""
    m, model, device = ex.model.rank_config, ex.model, ex.device
    # each (split count, preload, merge variant) variant, at the fewest rows that pick it
    rows_for = {(pick_num_splits(b, m.num_kv_heads, ex.config.max_model_len, ex.num_sms),
                 b <= PRELOAD_MAX_BATCH, b <= MERGE_O_WITH_LSE_MAX_BATCH): b
                for b in range(ex.num_slots, above, -1)}
    k, v, ks, vs = ex.kv.layer(0)
    dtype = model.embed_tokens.weight.dtype
    with torch.inference_mode(), torch.cuda.stream(ex.stream):
        for (n, _, _), b in sorted(rows_for.items()):
            q = torch.zeros(b, m.num_heads, m.head_dim, dtype=dtype, device=device)
            table = torch.zeros(b, 1, dtype=torch.int32, device=device)
            seq_lens = torch.ones(b, dtype=torch.int32, device=device)
            model.ops.decode_attention(q, k, v, table, seq_lens, 1.0, n, k_scale=ks, v_scale=vs)
        for b in token_classes(model, ex.num_slots):
            if b > above:
                step = padding_decode_step(ex, b)
                model.logits(model(step.input_ids, ex.backend(step)))
    ex.stream.synchronize()


def padding_decode_step(ex: CUDAExecutor, rows: int) -> DeviceStep:
    """A decode step of `rows` padding rows, as a graph's: token 0 at position 0 with one
    token of context on page 0, no K/V written, no recurrent state (slot -1)."""
    def full(value: int, *shape: int) -> torch.Tensor:
        return torch.full(shape, value, dtype=torch.int32, device=ex.device)

    return DeviceStep(input_ids=full(0, rows), positions=full(0, rows), kv_slots=full(-1, rows),
                      seq_lens=full(1, rows), cu_q_lens=full(0, 1), page_table=full(0, rows, 1),
                      num_decode=rows, max_q_len=1, num_splits=ex.num_splits_for(rows),
                      slots=full(-1, rows))


def token_classes(model: DecoderLM, limit: int) -> list[int]:
    """Row counts up to `limit`, one per launch configuration the model's kernels pick by
    row count (they compile per configuration): the GEMVs', the FP8 linears', the experts'."""
    moe = model.config.moe
    experts, fp8 = set(), set()  # NOTE: each distinct shape once (the layers repeat them)
    for module in model.modules():
        if isinstance(module, Experts) and moe is not None:
            e, inter2, hidden = module.w13.shape
            experts.add((e, hidden, inter2 // 2, module.block))
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dtype == torch.float8_e4m3fn:
            fp8.add((*weight.shape, fp8_scale_of(weight)[1]))
    classes = set(row_classes())
    for e, hidden, inter, block in experts:
        assert moe is not None
        classes.update(moe_token_classes(moe.experts_per_token, e, hidden, inter, block, limit))
    for n, k, block in fp8:
        classes.update(fp8_row_classes(n, k, block, limit))
    return sorted(c for c in classes if c <= limit)


def build_sampler_variants(ex: CUDAExecutor) -> None:
    """The sampler's kernels, built now: the greedy pick's (kernels/greedy.py) for the logits
    steps give it, the decode graphs' (the model's dtype) and the other steps' (fp32), into
    the token buffer's spare entry; and the seeded rows' noise (a request with a `seed`: no
    start-up step has one)."""
    model, device = ex.model, ex.device
    vocab = model.config.vocab_size
    slots = torch.full((1,), ex.pad_slot, dtype=torch.int32, device=device)
    with torch.inference_mode(), torch.cuda.stream(ex.stream):
        for dtype in {model.embed_tokens.weight.dtype, torch.float32}:
            logits = torch.zeros(1, vocab, dtype=dtype, device=device)
            model.ops.greedy_pick(logits, slots, ex.token_buffer)
        zero = torch.zeros(1, dtype=torch.int64, device=device)
        exponential_noise(zero, zero, vocab)
    ex.stream.synchronize()
