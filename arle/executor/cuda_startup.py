"""The CUDA executor's start-up, a function of the model and the config: the profile step, the
memory plan, the graphs' capture, and every Triton kernel variant built before the first request.
It returns what it built (`Started`): the step state on the KV pool, the graphs, a report.

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
from typing import Any

import torch
from torch import nn

from arle.errors import ArleError
from arle.executor.cuda_graphs import EXTEND_GRAPH_ROWS, DecodeGraphs, ExtendGraphs, graph_reserve
from arle.executor.paged import FP8_KV, DeviceStep, KVCache, host_tier, kv_format
from arle.executor.sampler import SamplingBatch, sample
from arle.executor.step import StepState, attention_backend
from arle.logging import get_logger
from arle.model.config import ModelConfig
from arle.model.decoder import DecoderLM
from arle.model.moe import Experts
from arle.sampling import SamplingParams
from arle_kernels.decode_attention import (
    MERGE_O_WITH_LSE_MAX_BATCH,
    PRELOAD_MAX_BATCH,
    pick_num_splits,
)
from arle_kernels.extend_attention import block_tokens
from arle_kernels.fp8 import fp8_row_classes
from arle_kernels.gemv import row_classes
from arle_kernels.jit import compile_ahead
from arle_kernels.linear_ref import fp8_scale_of
from arle_kernels.moe import moe_token_classes
from arle_kernels.noise import exponential_noise

log = get_logger("arle.executor.cuda")

#: The profile run samples with the most memory-hungry path (a sort over the vocabulary).
PROFILE_PARAMS = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=5)


@dataclass(frozen=True)
class CUDAExecutorConfig:
    page_size: int
    num_slots: int
    max_batched_tokens: int
    max_model_len: int
    kv_dtype: torch.dtype
    #: Share of the GPU's memory for weights, activations and the KV pool (as SGLang's).
    mem_fraction_static: float = 0.85
    #: KV pool size in tokens; None: what the memory plan leaves.
    kv_cache_tokens: int | None = None
    #: Largest decode batch captured as a CUDA graph; 0 disables graphs.
    cuda_graph_max_bs: int = 256
    #: Steps with prefill rows up to this many tokens (and `extend_graph_rows` rows) replay a
    #: CUDA graph too; 0: they run eagerly. Needs cuda_graph_max_bs > 0.
    extend_graph_max_tokens: int = 2048
    seed: int = 0
    #: A hybrid model's state snapshots for the prefix cache.
    num_snapshots: int = 0
    #: Speculative decoding: the verify rows, and positions each, whose recurrent states a
    #: step keeps (`StatePool.for_model`)
    spec: tuple[int, int] = (0, 0)
    #: the host KV tier's bytes (pinned host memory; 0: none)
    host_kv_bytes: int = 0

    @property
    def extend_graph_rows(self) -> int:
        """Rows, and sampled positions, an extend graph takes: one per slot, plus each verify
        row's drafts (a step past them runs eagerly, at ~10x a replay). At most
        EXTEND_GRAPH_ROWS."""
        rows, positions = self.spec
        drafts = min(rows, self.num_slots) * max(positions - 1, 0)
        return min(EXTEND_GRAPH_ROWS, self.num_slots + drafts)

    @property
    def max_pages(self) -> int:
        """Pages in one request's page table at the longest context (and its next token)."""
        return -(-(self.max_model_len + 1) // self.page_size)


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


@dataclass(frozen=True)
class DecodeSplits:
    """The decode kernel's split count for a step of n decode rows: the one the graph of that
    batch size was captured with, else the kernel's pick. NOTE: eager steps then compile no
    variant the capture did not (a first-use compile stalls every request for a second or
    more)."""

    num_kv_heads: int
    max_model_len: int
    num_sms: int
    graphs: DecodeGraphs | None

    def pick(self, n: int) -> int:
        return pick_num_splits(n, self.num_kv_heads, self.max_model_len, self.num_sms)

    def __call__(self, n: int) -> int:
        if not n:
            return 1
        g = self.graphs
        if g is not None and n <= g.max_bs:
            return g.num_splits[g.size_for(n)]
        return self.pick(n)


@dataclass(frozen=True)
class Started:
    """What start-up built: the step state on the KV pool, the graphs (None: eager), the
    decode kernel's split counts, and what each phase measured (`arle warmup`, model info)."""

    dev: StepState
    graphs: DecodeGraphs | None
    extend_graphs: ExtendGraphs | None
    splits: DecodeSplits
    report: dict[str, Any]


def start_up(model: DecoderLM, config: CUDAExecutorConfig, stream: torch.cuda.Stream
             ) -> Started:
    """The step state, the KV pool, the graphs and every kernel variant the executor will
    launch, on `stream`."""
    device = next(model.parameters()).device
    # NOTE: the weights were written on the default stream; everything after runs on ours
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        scratch = StepState.build(model, scratch_cache(model, config, device), config.num_slots,
                                  config.num_snapshots, config.max_model_len + 1, config.seed,
                                  next(model.parameters()).dtype, config.spec)
        graphs, extend_graphs = graph_buffers(scratch, config)
        splits = DecodeSplits(model.rank_config.num_kv_heads, config.max_model_len,
                              torch.cuda.get_device_properties(device).multi_processor_count,
                              graphs)
        plan, built, profile_s = profile(scratch, config, graphs, extend_graphs, splits)
        kv = KVCache.for_model(model.rank_config, plan.num_pages, config.page_size,
                               config.kv_dtype, device)
        host_kv, host_states = host_tier(kv, scratch.state, config.host_kv_bytes)
        dev = replace(scratch, kv=kv, host_kv=host_kv, host_states=host_states)
        del scratch
    report = memory_report(plan, kv, config, profile_s)
    capture(dev, graphs, extend_graphs, splits, stream)
    return Started(dev, graphs, extend_graphs, splits, {
        "memory_plan": report, "kernels_built_ahead": built,
        "cuda_graphs": ({"batch_sizes": graphs.sizes, "capture_s": round(graphs.capture_s, 3)}
                        if graphs is not None else None),
        "extend_graphs": ({"tokens": extend_graphs.sizes, "rows": extend_graphs.rows,
                           "capture_s": round(extend_graphs.capture_s, 3)}
                          if extend_graphs is not None else None)})


def profile(dev: StepState, config: CUDAExecutorConfig, graphs: DecodeGraphs | None,
            extend_graphs: ExtendGraphs | None, splits: DecodeSplits
            ) -> tuple[MemoryPlan, dict[str, float], float]:
    """On the scratch cache (`dev.kv`): every variant built ahead, the profile step's peak
    and the memory plan it leaves. -> (the plan, what build_ahead built, the profile's
    seconds). NOTE: nothing here outlives the call but numbers, so the scratch cache is
    freed when the caller drops `dev`."""
    model, device = dev.model, dev.kv.k.device
    states = dev.state.nbytes if dev.state is not None else 0
    buffers = sum(g.nbytes for g in (graphs, extend_graphs) if g is not None)
    weights = torch.cuda.memory_allocated(device) - states - dev.kv.nbytes - buffers
    t0 = time.perf_counter()
    largest = prefill_step(dev, config.max_batched_tokens, PROFILE_PARAMS,
                           min(config.num_slots, config.max_batched_tokens))
    decode_runs, extend_runs = graph_runs(dev, graphs, extend_graphs, splits)
    above = eager_decode_above(graphs, config.num_slots)
    eager = (() if above is None
             else (functools.partial(build_eager_decode_variants, dev, splits, above),))
    prefills = eager_prefill_runs(dev, config, extend_graphs)
    built = build_ahead(model, *prefills, largest, *decode_runs.values(), *extend_runs.values(),
                        *eager, functools.partial(build_sampler_variants, dev))
    # NOTE: the graphs' static buffers are not the profile step's: the reserve has them
    peak = peak_memory(largest, device) - buffers
    for run in prefills:  # for real, on the scratch cache
        run()
    profile_s = time.perf_counter() - t0 - built["seconds"]
    plan = plan_memory(model, config, weights, states, peak)
    # NOTE: TP: every rank's pool has the pages of the smallest plan (rank 0's cache
    # manager hands out page ids every rank's pool must hold)
    return replace(plan, num_pages=model.tp.all_min(plan.num_pages, device)), built, profile_s


def capture(dev: StepState, graphs: DecodeGraphs | None, extend_graphs: ExtendGraphs | None,
            splits: DecodeSplits, stream: torch.cuda.Stream) -> None:
    """On the KV pool: the graphs captured, the eager decode steps' and the sampler's
    variants built."""
    torch.cuda.empty_cache()  # the scratch cache's and the profile step's memory
    decode_runs, extend_runs = graph_runs(dev, graphs, extend_graphs, splits)
    if graphs is not None:
        pool = torch.cuda.graph_pool_handle()
        graphs.capture(decode_runs, pool, stream)
        if extend_graphs is not None:
            extend_graphs.capture(extend_runs, pool, stream)
    with torch.cuda.stream(stream):
        above = eager_decode_above(graphs, dev.num_slots)
        if above is not None:
            build_eager_decode_variants(dev, splits, above)
        build_sampler_variants(dev)
    stream.synchronize()


def memory_report(plan: MemoryPlan, kv: KVCache, config: CUDAExecutorConfig, profile_s: float
                  ) -> dict[str, Any]:
    """The memory plan, logged, and as the report gives it."""
    fmt = kv_format(config.kv_dtype)
    log.info("memory_plan", total_gb=round(plan.total_bytes / 1e9, 2),
             weights_gb=round(plan.weights_bytes / 1e9, 2),
             state_pool_gb=round(plan.state_pool_bytes / 1e9, 2),
             activation_peak_gb=round(plan.activation_peak_bytes / 1e9, 2),
             graph_reserve_gb=round(plan.graph_reserve_bytes / 1e9, 2),
             mem_fraction_static=config.mem_fraction_static, profile_s=round(profile_s, 2))
    log.info(f"KV pool: {plan.num_pages * config.page_size} tokens, {plan.num_pages} pages @ "
             f"{config.page_size}, {kv.nbytes / 1e9:.2f} GB, format {fmt}")
    memory = {k: v for k, v in asdict(plan).items() if k != "num_pages"}
    return {**memory, "kv_pool_bytes": kv.nbytes, "kv_format": fmt,
            "mem_fraction_static": config.mem_fraction_static, "profile_s": round(profile_s, 3)}


def graph_buffers(dev: StepState, config: CUDAExecutorConfig
                  ) -> tuple[DecodeGraphs | None, ExtendGraphs | None]:
    """The decode and extend graphs' static buffers, as the config asks (None: eager)."""
    if config.cuda_graph_max_bs <= 0:
        return None, None
    device, cfg = dev.kv.k.device, dev.model.rank_config
    graphs = DecodeGraphs(min(config.cuda_graph_max_bs, config.num_slots), config.max_pages,
                          device, dev.pad_slot if dev.state is not None else None)
    if config.extend_graph_max_tokens <= 0:
        return graphs, None
    block_t = block_tokens(cfg.head_dim, cfg.num_heads // cfg.num_kv_heads,
                           config.kv_dtype == FP8_KV)
    # NOTE: the logits buffer is this rank's vocabulary range (TP: gathered after)
    return graphs, ExtendGraphs(
        min(config.extend_graph_max_tokens, config.max_batched_tokens),
        config.extend_graph_rows, block_t, config.max_pages,
        dev.model.lm_head.weight.shape[0], dev.pad_slot, device,
        keeps=dev.state is not None and dev.state.spec_ssm is not None)


def graph_runs(dev: StepState, graphs: DecodeGraphs | None, extend_graphs: ExtendGraphs | None,
               splits: DecodeSplits
               ) -> tuple[dict[int, Callable[[], torch.Tensor]], dict[int, Callable[[], None]]]:
    """Each graph's forward on `dev` (what build_ahead runs, then capture records)."""
    decode = (graphs.runs(functools.partial(forward_decode, dev), splits.pick, dev.pad_slot)
              if graphs is not None else {})
    extend = (extend_graphs.runs(functools.partial(forward_extend, dev, extend_graphs))
              if extend_graphs is not None else {})
    return decode, extend


def forward_decode(dev: StepState, step: DeviceStep) -> torch.Tensor:
    """A decode graph's forward: step.input_ids are the rows' slots in the token buffer."""
    hidden = dev.model(step.input_ids, attention_backend(dev, step), id_source=dev.token_buffer)
    # NOTE: in the model's dtype: the greedy pick reads it as is, `sample` upcasts
    return dev.model.logits(hidden, upcast=False)


def forward_extend(dev: StepState, graphs: ExtendGraphs, t: int) -> None:
    """Extend graph t's forward; its logits go to the graphs' shared buffer."""
    step, sample_index = graphs.step(t, dev.token_buffer, dev.pad_slot)
    hidden = dev.model(step.input_ids, attention_backend(dev, step))
    graphs.logits[:len(sample_index)].copy_(dev.model.logits(hidden[sample_index]))


def eager_decode_above(graphs: DecodeGraphs | None, num_slots: int) -> int | None:
    """Decode steps of more rows than this run eagerly: 0 without graphs, the largest graph's
    batch where the graphs stop short of the most running requests (`--cuda-graph-max-bs`),
    None where a graph takes every decode step."""
    if graphs is None:
        return 0
    return graphs.max_bs if graphs.max_bs < num_slots - 1 else None


def scratch_cache(model: DecoderLM, config: CUDAExecutorConfig, device: torch.device
                  ) -> KVCache:
    """A KV cache for the profile step: one full prefill chunk."""
    pages = -(-config.max_batched_tokens // config.page_size) + 1
    return KVCache.for_model(model.rank_config, pages, config.page_size, config.kv_dtype, device)


def prefill_step(dev: StepState, n: int, params: SamplingParams, rows: int
                 ) -> Callable[[], None]:
    """One prefill chunk of n tokens at positions 0..n-1, on `dev.kv` (the scratch cache,
    every page in its page table), `rows` of its tokens sampling with `params`. At
    `max_batched_tokens`, every slot sampling with PROFILE_PARAMS: the largest step, what the
    memory plan measures."""
    model, device = dev.model, dev.kv.k.device
    ids = torch.randint(0, model.config.vocab_size, (n,), dtype=torch.int32, device=device)
    slots = torch.arange(n, dtype=torch.int32, device=device)
    # NOTE: a chunk may be longer than the model's context (max_batched_tokens above
    # max_model_len); the rope kernel reads the rotary table at each position unchecked
    pos = slots % dev.rotary.shape[0]
    table = torch.arange(dev.kv.k.shape[1], dtype=torch.int32, device=device)[None]
    step = DeviceStep(ids, pos, slots, torch.tensor([n], dtype=torch.int32, device=device),
                      torch.tensor([0, n], dtype=torch.int32, device=device), table,
                      num_decode=0, max_q_len=n, num_splits=1,
                      slots=torch.full((1,), dev.pad_slot, dtype=torch.int32, device=device))
    batch = SamplingBatch.build([params] * rows, [0] * rows, device)

    def run() -> None:
        with torch.inference_mode():
            hidden = model(ids, attention_backend(dev, step))
            sample(model.logits(hidden[:rows]), batch, generator=dev.generator)
    return run


def eager_prefill_runs(dev: StepState, config: CUDAExecutorConfig,
                       extend_graphs: ExtendGraphs | None) -> list[Callable[[], None]]:
    """Without extend graphs (one running request, or no graphs), prefill steps run eagerly at
    any length: one short prefill per variant class their kernels compile by row count
    (`token_classes` above one row: the GEMVs' also give the glue kernels a count that is
    neither 1 nor a multiple of 16), one row sampling greedily. So no prompt builds a variant
    mid-request."""
    if extend_graphs is not None:
        return []
    greedy = SamplingParams(temperature=0.0)
    return [prefill_step(dev, n, greedy, 1)
            for n in token_classes(dev.model, config.max_batched_tokens) if n > 1]


def build_ahead(model: DecoderLM, *passes: Callable[[], object]) -> dict[str, float]:
    """Run the start-up passes with their launches turned into compiles (`compile_ahead`): the
    Triton kernel variants they take are built side by side, on every core, before the passes
    run for real (from a cold cache they are most of the time to ready). Returns the seconds,
    the variants built and how many of them worker processes compiled.
    The model runs cut to a few layers (`variant_layers`): the pass is host work that the
    builds share the interpreter with, and the other layers would only repeat it.
    NOTE: nothing is computed, so a pass here must be one that runs again after. On the
    current stream."""
    t0 = time.perf_counter()
    with torch.inference_mode(), compile_ahead() as builds, variant_layers_only(model):
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


def plan_memory(model: DecoderLM, config: CUDAExecutorConfig, weights: int, states: int,
                peak: int) -> MemoryPlan:
    """The KV pool's pages: `--mem-fraction-static` of the GPU, less the weights, the state
    pool and the profile step's activation peak (`peak` counts all three) and the graphs'
    reserve; or `--kv-cache-tokens` where given."""
    m, device = model.rank_config, next(model.parameters()).device
    total = torch.cuda.get_device_properties(device).total_memory
    per_token = m.kv_bytes_per_token(torch.finfo(config.kv_dtype).bits // 8,
                                     4 if config.kv_dtype == FP8_KV else 0)
    graphs = config.cuda_graph_max_bs > 0
    reserve = graph_reserve(
        min(config.cuda_graph_max_bs, config.num_slots) if graphs else 0,
        min(config.extend_graph_max_tokens, config.max_batched_tokens),
        config.extend_graph_rows, m.vocab_size, peak - weights - states,
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
    free, _ = torch.cuda.mem_get_info(device)
    check_fits(pages * config.page_size * per_token, reserve, free,
               total - free - torch.cuda.memory_reserved(device), config.mem_fraction_static)
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


def build_eager_decode_variants(dev: StepState, splits: DecodeSplits, above: int = 0) -> None:
    """Build now, for decode steps of more than `above` rows (which run eagerly:
    `eager_decode_above`), the kernel variants eager steps pick by their size, which the
    warm-up passes may not all reach: the decode kernel's split counts (each its own merge
    variant) with and without its first block loaded before the PDL wait (up to
    PRELOAD_MAX_BATCH rows), and a whole decode step at one row count per class the other
    kernels compile by (`token_classes`). On padding rows (no K/V written, no recurrent
    state); the outputs are thrown away. On the current stream."""
    m, model, device = dev.model.rank_config, dev.model, dev.kv.k.device
    # each (split count, preload, merge variant) variant, at the fewest rows that pick it
    rows_for = {(splits.pick(b), b <= PRELOAD_MAX_BATCH, b <= MERGE_O_WITH_LSE_MAX_BATCH): b
                for b in range(dev.num_slots, above, -1)}
    k, v, ks, vs = dev.kv.layer(0)
    dtype = model.embed_tokens.weight.dtype
    with torch.inference_mode():
        for (n, _, _), b in sorted(rows_for.items()):
            q = torch.zeros(b, m.num_heads, m.head_dim, dtype=dtype, device=device)
            table = torch.zeros(b, 1, dtype=torch.int32, device=device)
            seq_lens = torch.ones(b, dtype=torch.int32, device=device)
            model.ops.decode_attention(q, k, v, table, seq_lens, 1.0, n, k_scale=ks, v_scale=vs)
        for b in token_classes(model, dev.num_slots):
            if b > above:
                step = padding_decode_step(dev, b, splits(b))
                model.logits(model(step.input_ids, attention_backend(dev, step)))


def padding_decode_step(dev: StepState, rows: int, num_splits: int) -> DeviceStep:
    """A decode step of `rows` padding rows, as a graph's: token 0 at position 0 with one
    token of context on page 0, no K/V written, no recurrent state (slot -1)."""
    def full(value: int, *shape: int) -> torch.Tensor:
        return torch.full(shape, value, dtype=torch.int32, device=dev.kv.k.device)

    return DeviceStep(input_ids=full(0, rows), positions=full(0, rows), kv_slots=full(-1, rows),
                      seq_lens=full(1, rows), cu_q_lens=full(0, 1), page_table=full(0, rows, 1),
                      num_decode=rows, max_q_len=1, num_splits=num_splits,
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


def build_sampler_variants(dev: StepState) -> None:
    """The sampler's kernels, built now: the greedy pick's (kernels/greedy.py) for the logits
    steps give it, the decode graphs' (the model's dtype) and the other steps' (fp32), into
    the token buffer's spare entry; and the seeded rows' noise (a request with a `seed`: no
    start-up step has one). On the current stream."""
    model, device = dev.model, dev.kv.k.device
    vocab = model.config.vocab_size
    slots = torch.full((1,), dev.pad_slot, dtype=torch.int32, device=device)
    with torch.inference_mode():
        for dtype in {model.embed_tokens.weight.dtype, torch.float32}:
            logits = torch.zeros(1, vocab, dtype=dtype, device=device)
            model.ops.greedy_pick(logits, slots, dev.token_buffer)
        zero = torch.zeros(1, dtype=torch.int64, device=device)
        exponential_noise(zero, zero, vocab)
