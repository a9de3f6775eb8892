"""The CUDA executor: the model with Triton kernels on its own stream, overlapped with the loop.

One step, in three threads:
- the event loop (`launch` -> `prepare`): flattens the plan into one int32 array in pinned
  memory: positions, cache slots, page tables, ... (no device work, no torch kernels);
- the launcher thread (`_enqueue`): one host-to-device copy of that array (on a copy-in
  stream, which runs ahead: step N+1's copy overlaps step N), then the whole step on
  `self.stream` (a CUDA graph replay for decode-only batches, eager kernels otherwise) and
  sampling, then a device-to-host copy of the sampled ids into pinned memory (on a copy-out
  stream) followed by an event. No copy sits between two steps' kernels on `self.stream`. It
  returns as soon as the work is queued: it never waits for the GPU;
- the waiter thread (`_wait`): blocks on that event (a blocking-sync event: the thread sleeps,
  no spinning) and hands the ids to the loop.
The sampled ids also go to `token_buffer[slot]` on the device, where the next step's decode rows
read their input: step N+1 is queued before the host has seen step N's tokens.

NOTE (stream order): every device-side state change (KV writes, token buffer, penalty counts)
happens in `_enqueue`, in launch order, on one stream; the copy streams only move a step's
inputs in and its outputs out, ordered against it by events. Nothing here synchronises a
stream.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
from torch import nn

from arle.engine.request import SamplingParams
from arle.errors import ArleError
from arle.executor.base import KVPoolInfo, StepOutput
from arle.executor.cpu import torch_thread
from arle.executor.paged import (
    FP8_KV,
    DeviceStep,
    ExtendGraphShape,
    KVCache,
    PackedStep,
    PagedAttention,
    StepInputs,
    extend_graph_block,
    step_views,
)
from arle.executor.plan import StepPlan
from arle.executor.sampler import (
    PenaltyState,
    SampleOutput,
    SamplingBatch,
    logprobs_of,
    sample,
    sample_into,
)
from arle.logging import get_logger
from arle.model.decoder import DecoderLayer, DecoderLM
from arle_kernels.decode_attention import (
    MERGE_O_WITH_LSE_MAX_BATCH,
    PRELOAD_MAX_BATCH,
    pick_num_splits,
)
from arle_kernels.extend_attention import block_tokens
from arle_kernels.gemv import row_classes
from arle_kernels.jit import compile_ahead
from arle_kernels.noise import exponential_noise
from arle_kernels.ops import ops_for

log = get_logger("arle.executor.cuda")

#: What torch.cuda.graph_pool_handle() returns (graphs captured with one share memory)
_PoolHandle = Any
_T = TypeVar("_T")

#: The profile run samples with the most memory-hungry path (a sort over the vocabulary).
_PROFILE_PARAMS = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, logprobs=5)


@contextlib.contextmanager
def _two_layers(model: DecoderLM) -> Iterator[None]:
    """Inside, `model` runs its first two layers only. NOTE: enough for a pass that builds
    kernel variants: layer 0 (no residual yet) and layer 1 launch every variant the others do
    (one set of shapes, dtypes and alignments)."""
    layers = model.layers
    model.layers = nn.ModuleList(list(layers)[:2])
    try:
        yield
    finally:
        model.layers = layers


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
    #: Steps with prefill rows up to this many tokens (and EXTEND_GRAPH_ROWS rows) replay a
    #: CUDA graph too; 0: they run eagerly. Needs cuda_graph_max_bs > 0.
    extend_graph_max_tokens: int = 2048
    seed: int = 0


@dataclass
class HostStep:
    """A step ready for the launcher: its inputs and their packed array in pinned memory."""

    inputs: StepInputs
    meta: torch.Tensor  # inputs.packed.meta, pinned
    graph_bs: int  # > 0: replay the graph of this batch size (rows padded to it)
    extend_tokens: int = 0  # > 0: replay the extend graph of this many tokens

    @property
    def layout(self) -> PackedStep:
        return self.inputs.packed


class DecodeGraphs:
    """Decode-only steps captured as CUDA graphs, one per batch size of a ladder.

    NOTE: the graphs read their inputs from static buffers: `meta` [4, max_bs] (decode slots,
    positions, cache slots, sequence lengths) and `page_table` [max_bs, max_pages]. A step
    copies its (padded) rows into their top-left corner; padded rows write no K/V (slot -1)
    and attend to one token of page 0.
    """

    def __init__(self, max_bs: int, max_pages: int, device: torch.device) -> None:
        self.sizes = [bs for bs in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160,
                                    192, 224, 256, 320, 384, 448, 512) if bs < max_bs] + [max_bs]
        self.max_bs = max_bs
        self.meta = torch.zeros(4, max_bs, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(max_bs, max_pages, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.num_splits: dict[int, int] = {}
        self.capture_s = 0.0

    def size_for(self, n: int) -> int:
        return next(bs for bs in self.sizes if bs >= n)

    def load(self, packed: PackedStep, meta: torch.Tensor, bs: int) -> None:
        """Copy a packed graph step (`pack_step(..., graph_bs=bs)`, `meta` on the device) into
        the static buffers: the [4, bs] block in one copy, then the page-table corner."""
        start = packed.offsets["decode_slots"][0]
        self.meta[:, :bs].copy_(meta[start:start + 4 * bs].view(4, bs))
        start, mp = packed.offsets["page_table"][0], packed.max_pages
        self.page_table[:bs, :mp].copy_(meta[start:start + bs * mp].view(bs, mp))

    def step(self, bs: int) -> DeviceStep:
        """The graph's inputs as a step: views of the static buffers (decode rows only).
        NOTE: its input_ids are the rows' slots: the model reads the ids from the token buffer
        there (`Decoder.forward`'s id_source), in the embedding kernel."""
        slots, positions, kv_slots, seq_lens = self.meta[:, :bs]
        return DeviceStep(input_ids=slots, positions=positions, kv_slots=kv_slots,
                          seq_lens=seq_lens, cu_q_lens=seq_lens[:0],
                          page_table=self.page_table[:bs], num_decode=bs, max_q_len=1,
                          num_splits=self.num_splits[bs])


#: Token counts of the extend graphs (the ladder, up to extend_graph_max_tokens).
EXTEND_GRAPH_TOKENS: tuple[int, ...] = (32, 64, 128, 256, 384, 512, 640, 768, 1024, 1280, 1536,
                                        2048)
#: Rows an extend graph takes (steps with more run eagerly): the decode rows of 63 requests
#: beside a prefill.
EXTEND_GRAPH_ROWS = 64


class ExtendGraphs:
    """Steps with prefill rows (prefills and mixed batches) captured as CUDA graphs, one per
    token count of a ladder, padded to the next. Eager, such a step is bound by the host: ~400
    launches at 20-70 us each on the H200 machine's CPU (`bench_gpu.py launch`) against ~10 ms
    of GPU work for 512 tokens of a 4B model.

    NOTE: every row runs as an extend row (a decode row is one new token), so a graph is fixed
    by its token count alone; the extend kernel walks a (row, token block) list, so padding
    rows cost no programs. Each graph reads a static block of its own (`ExtendGraphShape`
    layout) and one shared page table, and writes its logits into one shared buffer: steps
    replay one at a time, in stream order, and sampling reads the logits right after."""

    def __init__(self, max_tokens: int, rows: int, block_t: int, max_pages: int, vocab: int,
                 pad_slot: int, device: torch.device) -> None:
        self.sizes = [t for t in EXTEND_GRAPH_TOKENS if t < max_tokens] + [max_tokens]
        self.rows = rows
        self.shapes = {t: ExtendGraphShape(t, rows, block_t) for t in self.sizes}
        # NOTE: filled with padding (no rows, no token blocks, no K/V writes): what warm-up and
        # capture run on
        self.blocks = {t: torch.tensor(extend_graph_block([], 1, pad_slot, shape)[0],
                                       dtype=torch.int32, device=device)
                       for t, shape in self.shapes.items()}
        self.page_table = torch.zeros(rows, max_pages, dtype=torch.int32, device=device)
        self.logits = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_s = 0.0

    def size_for(self, num_tokens: int, num_rows: int) -> int:
        """The graph a step of that many tokens and rows replays; 0: none (run it eagerly)."""
        if num_rows > self.rows or num_tokens > self.sizes[-1]:
            return 0
        return next(t for t in self.sizes if t >= num_tokens)

    def load(self, packed: PackedStep, meta: torch.Tensor, t: int) -> None:
        """Copy a packed step (`pack_step(..., extend=self.shapes[t])`, on the device) into
        graph t's static block (one copy) and the page table's corner."""
        start, n = packed.offsets["extend_graph"]
        self.blocks[t].copy_(meta[start:start + n])
        start, mp = packed.offsets["page_table"][0], packed.max_pages
        rows = packed.num_rows
        self.page_table[:rows, :mp].copy_(meta[start:start + rows * mp].view(rows, mp))

    def step(self, t: int, token_buffer: torch.Tensor, pad_slot: int
             ) -> tuple[DeviceStep, torch.Tensor]:
        """Graph t's inputs as a step (views of its static block; decode rows' ids gathered
        from the token buffer) and the sampling rows' token indices."""
        offsets, _ = self.shapes[t].layout
        block = self.blocks[t]

        def seg(name: str) -> torch.Tensor:
            start, n = offsets[name]
            return block[start:start + n]

        tok_slots = seg("tok_slots")
        ids = torch.where(tok_slots == pad_slot, seg("input_ids"), token_buffer[tok_slots])
        step = DeviceStep(ids, seg("positions"), seg("kv_slots"), seg("seq_lens"),
                          seg("cu_q_lens"), self.page_table, num_decode=0, max_q_len=t,
                          num_splits=1, extend_blocks=seg("extend_blocks"))
        return step, seg("sample_index")


class CUDAExecutor:
    """The model on one NVIDIA GPU: one step in three threads (module docstring).

    Start-up, in order: the profile step's scratch cache stands in for the KV pool while one
    pass builds every Triton variant start-up will run (`_build_ahead`); the profile step runs
    and its peak memory sizes the pool (`--mem-fraction-static`); the decode and extend graphs
    are captured (without graphs, the eager variants run once); `startup_info` keeps what each
    phase measured."""

    def __init__(self, model: DecoderLM, config: CUDAExecutorConfig) -> None:
        cfg = model.config
        self.model, self.config = model, config
        self.device = next(model.parameters()).device
        self.page_size = config.page_size
        self.num_slots = config.num_slots
        self.pad_slot = config.num_slots  # token_buffer has one spare entry for graph padding
        self.stream = torch.cuda.Stream(self.device)
        # NOTE: a step's copies in and out run on streams of their own, so no copy sits between
        # two steps' kernels on `self.stream` (see `_copy_in`, `_copy_out`)
        self.copy_in_stream = torch.cuda.Stream(self.device)
        self.copy_out_stream = torch.cuda.Stream(self.device)
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        model.ops = ops_for(self.device)
        self.rotary = model.rotary_table(config.max_model_len + 1)
        self.token_buffer = torch.zeros(config.num_slots + 1, dtype=torch.int32,
                                        device=self.device)
        self.penalties = PenaltyState(config.num_slots, cfg.vocab_size, self.device)
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.max_pages = -(-(config.max_model_len + 1) // config.page_size)

        # NOTE: the weights, the rotary table and the token buffer were written on the default
        # stream; everything after runs on ours.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.graphs: DecodeGraphs | None = None
        self.extend_graphs: ExtendGraphs | None = None
        with torch.cuda.stream(self.stream):
            weights = torch.cuda.memory_allocated(self.device)
            t0 = time.perf_counter()
            # NOTE: until the pool is sized (after the profile), the profile's scratch cache
            # stands in for it: the builds below depend on its layout, not on its page count
            self.kv = self._scratch_cache()
            profile = self._prefill_step(config.max_batched_tokens, _PROFILE_PARAMS,
                                         min(self.num_slots, config.max_batched_tokens))
            buffers = torch.cuda.memory_allocated(self.device)
            self._make_graph_buffers()
            buffers = torch.cuda.memory_allocated(self.device) - buffers
            decode_runs: dict[int, Callable[[], torch.Tensor]] = {}
            extend_runs: dict[int, Callable[[], None]] = {}
            if self.graphs is not None:
                decode_runs = self._decode_runs(self.graphs)
            if self.extend_graphs is not None:
                extend_runs = self._extend_runs(self.extend_graphs)
            eager_above = self._eager_decode_above()
            eager = (() if eager_above is None
                     else (functools.partial(self._build_eager_variants, eager_above),))
            prefills = self._eager_prefill_runs()
            built = self._build_ahead(profile, *prefills, *decode_runs.values(),
                                      *extend_runs.values(), *eager,
                                      self._build_sampler_variants)
            # NOTE: the graphs' static buffers are not the profile step's: the reserve has them
            peak = self._peak_memory(profile) - buffers
            for run in prefills:  # for real, on the scratch cache
                run()
            del self.kv, profile, prefills
            torch.cuda.empty_cache()
            profile_s = time.perf_counter() - t0 - built["seconds"]
            total = torch.cuda.get_device_properties(self.device).total_memory
            per_token = cfg.kv_bytes_per_token(torch.finfo(config.kv_dtype).bits // 8,
                                               4 if config.kv_dtype == FP8_KV else 0)
            graph_reserve = self._graph_reserve(peak - weights)
            budget = int(total * config.mem_fraction_static) - peak - graph_reserve
            tokens = config.kv_cache_tokens or budget // per_token
            num_pages = max(tokens // config.page_size, 2)
            if config.kv_cache_tokens is None and budget < 2 * config.page_size * per_token:
                raise ArleError(
                    f"no memory left for the KV cache: weights {weights / 2**30:.1f} GiB + "
                    f"activations {(peak - weights) / 2**30:.1f} GiB exceed "
                    f"--mem-fraction-static {config.mem_fraction_static} of "
                    f"{total / 2**30:.1f} GiB")
            self.kv = KVCache.allocate(cfg.num_layers, num_pages, config.page_size,
                                       cfg.num_kv_heads, cfg.head_dim, config.kv_dtype,
                                       self.device)
        fmt = "fp8e4m3" if config.kv_dtype == FP8_KV else str(config.kv_dtype).removeprefix(
            "torch.")
        self.kv_pool = KVPoolInfo(num_pages, config.page_size, self.kv.nbytes, fmt)
        log.info("memory_plan", total_gb=round(total / 1e9, 2), weights_gb=round(weights / 1e9, 2),
                 activation_peak_gb=round((peak - weights) / 1e9, 2),
                 graph_reserve_gb=round(graph_reserve / 1e9, 2),
                 mem_fraction_static=config.mem_fraction_static, profile_s=round(profile_s, 2))
        log.info(f"KV pool: {num_pages * config.page_size} tokens, {num_pages} pages @ "
                 f"{config.page_size}, {self.kv.nbytes / 1e9:.2f} GB, format {fmt}")

        if self.graphs is not None:
            pool = torch.cuda.graph_pool_handle()
            self._capture(self.graphs, decode_runs, pool)
            if self.extend_graphs is not None:
                self._capture_extend(self.extend_graphs, extend_runs, pool)
        if eager_above is not None:
            self._build_eager_variants(eager_above)
        self._build_sampler_variants()
        #: What start-up measured, for `arle warmup` and the model info.
        self.startup_info = {
            "memory_plan": {"total_bytes": total, "weights_bytes": weights,
                            "activation_peak_bytes": peak - weights,
                            "graph_reserve_bytes": graph_reserve,
                            "kv_pool_bytes": self.kv.nbytes, "kv_format": fmt,
                            "mem_fraction_static": config.mem_fraction_static,
                            "profile_s": round(profile_s, 3)},
            "kernels_built_ahead": built,
            "cuda_graphs": ({"batch_sizes": self.graphs.sizes,
                             "capture_s": round(self.graphs.capture_s, 3)}
                            if self.graphs is not None else None),
            "extend_graphs": ({"tokens": self.extend_graphs.sizes,
                               "rows": self.extend_graphs.rows,
                               "capture_s": round(self.extend_graphs.capture_s, 3)}
                              if self.extend_graphs is not None else None),
        }
        self._launcher = torch_thread()
        self._waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="arle-wait")

    # ---- start-up ------------------------------------------------------------------------
    def _build_ahead(self, *passes: Callable[[], object]) -> dict[str, float]:
        """Run the start-up passes with their launches turned into compiles (`compile_ahead`):
        the Triton kernel variants they take are built side by side, on every core, before the
        passes run for real (from a cold cache they are most of the time to ready). Returns the
        seconds, the variants built and how many of them worker processes compiled.
        The model runs cut to two layers (`_two_layers`): the pass is host work that the builds
        share the interpreter with, and the other layers would only repeat it.
        NOTE: nothing is computed, so a pass here must be one that runs again after."""
        t0 = time.perf_counter()
        with (torch.inference_mode(), torch.cuda.stream(self.stream),
              compile_ahead() as builds, _two_layers(self.model)):
            for run in passes if builds.on else ():
                run()
        built = {"seconds": round(time.perf_counter() - t0, 3), "variants": builds.variants,
                 "in_processes": builds.in_processes}
        log.info("kernels_built_ahead", **built)
        return built

    def _scratch_cache(self) -> KVCache:
        """A KV cache for the profile step: one full prefill chunk."""
        cfg = self.model.config
        pages = -(-self.config.max_batched_tokens // self.page_size) + 1
        return KVCache.allocate(cfg.num_layers, pages, self.page_size, cfg.num_kv_heads,
                                cfg.head_dim, self.config.kv_dtype, self.device)

    def _prefill_step(self, n: int, params: SamplingParams, rows: int) -> Callable[[], None]:
        """One prefill chunk of n tokens at positions 0..n-1, on `self.kv` (the scratch cache,
        every page in its page table), `rows` of its tokens sampling with `params`. At
        `max_batched_tokens`, every slot sampling with _PROFILE_PARAMS: the largest step, what
        the memory plan measures (`_peak_memory`)."""
        cfg = self.model.config
        ids = torch.randint(0, cfg.vocab_size, (n,), dtype=torch.int32, device=self.device)
        slots = torch.arange(n, dtype=torch.int32, device=self.device)
        # NOTE: a chunk may be longer than the model's context (max_batched_tokens above
        # max_model_len); the rope kernel reads the rotary table at each position unchecked
        pos = slots % self.rotary.shape[0]
        table = torch.arange(self.kv.k.shape[1], dtype=torch.int32, device=self.device)[None]
        step = DeviceStep(ids, pos, slots, torch.tensor([n], dtype=torch.int32, device=self.device),
                          torch.tensor([0, n], dtype=torch.int32, device=self.device), table,
                          num_decode=0, max_q_len=n, num_splits=1)
        batch = SamplingBatch.build([params] * rows, [0] * rows, self.device)

        def run() -> None:
            with torch.inference_mode():
                hidden = self.model(ids, PagedAttention(self.kv, step, self.rotary, self.model))
                sample(self.model.logits(hidden[:rows]), batch, generator=self.generator)
        return run

    def _eager_prefill_runs(self) -> list[Callable[[], None]]:
        """Without extend graphs (one running request, or no graphs), prefill steps run
        eagerly at any length: one short prefill per variant class their kernels compile by
        row count (the GEMVs' `row_classes` above one row, which also give the glue kernels a
        count that is neither 1 nor a multiple of 16; longer chunks take cuBLAS and the
        profile step's variants), one row sampling greedily. So no prompt builds a variant
        mid-request (seen on the H200 from a cold cache: a 1 s compile before the first
        token)."""
        if self.extend_graphs is not None:
            return []
        greedy = SamplingParams(temperature=0.0)
        return [self._prefill_step(n, greedy, 1) for n in row_classes()[1:]]

    def _peak_memory(self, run: Callable[[], None]) -> int:
        """The peak of allocated memory while run() runs (what is allocated now included)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        run()
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def _make_graph_buffers(self) -> None:
        """The decode and extend graphs' static buffers, as the config asks (none: eager)."""
        config = self.config
        if config.cuda_graph_max_bs <= 0:
            return
        self.graphs = DecodeGraphs(min(config.cuda_graph_max_bs, config.num_slots),
                                   self.max_pages, self.device)
        if config.extend_graph_max_tokens > 0:
            self.extend_graphs = ExtendGraphs(
                min(config.extend_graph_max_tokens, config.max_batched_tokens),
                min(EXTEND_GRAPH_ROWS, config.num_slots), self._block_t(), self.max_pages,
                self.model.config.vocab_size, self.pad_slot, self.device)

    def _graph_reserve(self, activations: int) -> int:
        """Memory the graphs keep: the decode graphs' logits and a margin for their activations;
        the extend graphs' activations (the profile step's, scaled to their largest token
        count) and shared logits."""
        c = self.config
        if c.cuda_graph_max_bs <= 0:
            return 0
        vocab = self.model.config.vocab_size
        bs = min(c.cuda_graph_max_bs, self.num_slots)
        reserve = bs * vocab * 4 * 2 + (512 << 20)
        if c.extend_graph_max_tokens > 0:
            tokens = min(c.extend_graph_max_tokens, c.max_batched_tokens)
            reserve += (activations * tokens // c.max_batched_tokens
                        + min(EXTEND_GRAPH_ROWS, self.num_slots) * vocab * 4)
        return reserve

    def _block_t(self) -> int:
        cfg = self.model.config
        return block_tokens(cfg.head_dim, cfg.num_heads // cfg.num_kv_heads,
                            self.config.kv_dtype == FP8_KV)

    def _decode_runs(self, graphs: DecodeGraphs) -> dict[int, Callable[[], torch.Tensor]]:
        """One decode forward per batch size of the ladder, on the static buffers, which now
        hold padding everywhere: slot, position 0, no K/V write, one token of context. Each
        returns its logits (the graph's output once captured: `_capture`)."""
        for row, value in enumerate((self.pad_slot, 0, -1, 1)):
            graphs.meta[row].fill_(value)
        cfg = self.model.config
        runs: dict[int, Callable[[], torch.Tensor]] = {}
        for bs in graphs.sizes:
            graphs.num_splits[bs] = pick_num_splits(bs, cfg.num_kv_heads,
                                                    self.config.max_model_len, self.num_sms)

            def run(bs: int = bs) -> torch.Tensor:
                return self._forward_decode(graphs.step(bs))

            runs[bs] = run
        return runs

    def _capture(self, graphs: DecodeGraphs, runs: dict[int, Callable[[], torch.Tensor]],
                 pool: _PoolHandle) -> None:
        """Capture one decode graph per batch size (`_decode_runs`), largest first (they share
        one pool)."""
        t0 = time.perf_counter()
        with torch.inference_mode(), torch.cuda.stream(self.stream):
            for bs in reversed(graphs.sizes):
                graphs.graphs[bs], graphs.logits[bs] = self._record(runs[bs], pool)
        self.stream.synchronize()
        graphs.capture_s = time.perf_counter() - t0
        log.info("cuda_graphs_captured", batch_sizes=graphs.sizes,
                 seconds=round(graphs.capture_s, 2))

    def _extend_runs(self, graphs: ExtendGraphs) -> dict[int, Callable[[], None]]:
        """One extend forward per token count of the ladder, on its static block's padding."""
        return {t: functools.partial(self._forward_extend, graphs, t) for t in graphs.sizes}

    def _capture_extend(self, graphs: ExtendGraphs, runs: dict[int, Callable[[], None]],
                        pool: _PoolHandle) -> None:
        """Capture one extend graph per token count (`_extend_runs`), largest first, in the
        decode graphs' pool (steps replay one at a time). Each runs once eagerly first: cuBLAS's
        choices for its shapes are made outside the capture."""
        t0 = time.perf_counter()
        with torch.inference_mode(), torch.cuda.stream(self.stream):
            for t in reversed(graphs.sizes):
                graphs.graphs[t], _ = self._record(runs[t], pool)
        self.stream.synchronize()
        graphs.capture_s = time.perf_counter() - t0
        log.info("extend_graphs_captured", tokens=graphs.sizes, rows=graphs.rows,
                 seconds=round(graphs.capture_s, 2))

    def _record(self, run: Callable[[], _T], pool: _PoolHandle) -> tuple[torch.cuda.CUDAGraph, _T]:
        """run() once eagerly (buffers made on first use and cuBLAS's choices are made outside
        the capture; the kernels were built ahead, `_build_ahead`), then captured as a graph in
        `pool`, on the executor's stream. Returns the graph and what the captured run returned
        (its output buffers, which each replay rewrites)."""
        run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=self.stream):
            out = run()
        return graph, out

    def _forward_extend(self, graphs: ExtendGraphs, t: int) -> None:
        step, sample_index = graphs.step(t, self.token_buffer, self.pad_slot)
        hidden = self.model(step.input_ids, PagedAttention(self.kv, step, self.rotary, self.model))
        graphs.logits.copy_(self.model.logits(hidden[sample_index]))

    def _eager_decode_above(self) -> int | None:
        """Decode steps of more rows than this run eagerly: 0 without graphs, the largest
        graph's batch where the graphs stop short of the most running requests
        (`--cuda-graph-max-bs`), None where a graph takes every decode step."""
        g = self.graphs
        if g is None:
            return 0
        return g.max_bs if g.max_bs < self.num_slots - 1 else None

    def _build_eager_variants(self, above: int = 0) -> None:
        """For decode steps of more than `above` rows, which run eagerly (`_eager_decode_above`),
        build now (not mid-serving, where a compile stalls every request) the kernel variants
        eager steps pick by their size, which the warm-up passes may not all reach (with
        graphs up to 2 rows, before this ran above them too, a GPU test of staggered arrivals
        once saw decode attention and its merge built mid-serving):
        the decode kernel's split counts (1..32 by batch size, a power of two, each
        its own merge-kernel variant, and one more at one row) with and without its first
        block loaded before the PDL wait (up to PRELOAD_MAX_BATCH rows), and the GEMVs' row
        classes (`row_classes`: 1, 2: FMA; 3..16 and, with TMA, 17..32: tensor cores, every
        linear layer with TMA, else gate_up + SiLU·up and lm_head, which runs at 3+ rows only
        once 3 rows sample in one step).
        On zeros and page 0; the outputs are thrown away."""
        cfg = self.model.config
        # each (split count, preload, merge variant) variant, at the fewest rows that pick it
        rows_for = {(pick_num_splits(b, cfg.num_kv_heads, self.config.max_model_len,
                                     self.num_sms), b <= PRELOAD_MAX_BATCH,
                     b <= MERGE_O_WITH_LSE_MAX_BATCH): b
                    for b in range(self.num_slots, above, -1)}
        k, v, ks, vs = self.kv.layer(0)
        dtype = self.model.embed_tokens.weight.dtype
        layer = cast(DecoderLayer, self.model.layers[0])
        attn = layer.self_attn.num_heads * layer.self_attn.head_dim  # this rank's
        with torch.inference_mode(), torch.cuda.stream(self.stream):
            for (n, _, _), b in sorted(rows_for.items()):
                q = torch.zeros(b, cfg.num_heads, cfg.head_dim, dtype=dtype, device=self.device)
                table = torch.zeros(b, 1, dtype=torch.int32, device=self.device)
                seq_lens = torch.ones(b, dtype=torch.int32, device=self.device)
                self.model.ops.decode_attention(q, k, v, table, seq_lens, 1.0, n, k_scale=ks,
                                                v_scale=vs)
            ops, norm = self.model.ops, layer.post_attention_layernorm
            for rows in row_classes():
                x = torch.zeros(rows, cfg.hidden_size, dtype=dtype, device=self.device)
                # the linear layers as the decoder runs them, each result taken by its consumer
                # (split sums included); no K/V is written (slots -1)
                no_slots = torch.full((rows,), -1, dtype=torch.int32, device=self.device)
                ops.qk_norm_rope_store_kv(
                    layer.self_attn.qkv_proj.forward_unreduced(x), torch.zeros_like(no_slots),
                    self.rotary, *layer.self_attn.qk_norm_weights(), cfg.rms_norm_eps,
                    layer.self_attn.num_heads, layer.self_attn.num_kv_heads, k, v, no_slots,
                    ks, vs)
                attn_out = torch.zeros(rows, attn, dtype=dtype, device=self.device)
                for y in (layer.self_attn.o_proj.forward_unreduced(attn_out),
                          layer.mlp(x, ops)):
                    ops.add_rms_norm(y, x.clone(), norm.weight, norm.eps)
                self.model.logits(x)
        self.stream.synchronize()

    def _build_sampler_variants(self) -> None:
        """The sampler's kernels, built now: the greedy pick's (kernels/greedy.py) for the
        logits steps give it, the decode graphs' (the model's dtype) and the other steps'
        (fp32), into the token buffer's spare entry; and the seeded rows' noise (a request
        with a `seed`: no start-up step has one; a GPU test saw it built mid-request)."""
        vocab = self.model.config.vocab_size
        slots = torch.full((1,), self.pad_slot, dtype=torch.int32, device=self.device)
        with torch.inference_mode(), torch.cuda.stream(self.stream):
            for dtype in {self.model.embed_tokens.weight.dtype, torch.float32}:
                logits = torch.zeros(1, vocab, dtype=dtype, device=self.device)
                self.model.ops.greedy_pick(logits, slots, self.token_buffer)
            zero = torch.zeros(1, dtype=torch.int64, device=self.device)
            exponential_noise(zero, zero, vocab)
        self.stream.synchronize()

    def _forward_decode(self, step: DeviceStep) -> torch.Tensor:
        """A decode graph's forward: step.input_ids are the rows' slots in the token buffer."""
        backend = PagedAttention(self.kv, step, self.rotary, self.model)
        hidden = self.model(step.input_ids, backend, id_source=self.token_buffer)
        # NOTE: in the model's dtype: the greedy pick reads it as is, `sample` upcasts
        return self.model.logits(hidden, upcast=False)

    # ---- the event loop's thread ----------------------------------------------------------
    def launch(self, plan: StepPlan) -> Awaitable[StepOutput]:
        host = self.prepare(plan)
        queued = self._launcher.submit(self._enqueue, host)
        return self._result(queued)

    async def _result(self, queued: concurrent.futures.Future[tuple[torch.cuda.Event, _Pending]]
                      ) -> StepOutput:
        event, pending = await asyncio.wrap_future(queued)
        return await asyncio.wrap_future(self._waiter.submit(self._wait, event, pending))

    def prepare(self, plan: StepPlan) -> HostStep:
        """Flatten the plan on the loop's thread into one pinned int32 array (`pack_step`)."""
        rows = plan.rows
        nd = plan.num_decode_rows
        graph_bs = extend_t = 0
        if self.graphs is not None and nd == len(rows) and nd <= self.graphs.max_bs:
            graph_bs = self.graphs.size_for(nd)
        elif self.extend_graphs is not None:
            extend_t = self.extend_graphs.size_for(plan.num_tokens, len(rows))
        shape = self.extend_graphs.shapes[extend_t] if self.extend_graphs and extend_t else None
        inputs = StepInputs.of(plan, self.page_size, graph_bs, self.pad_slot, shape)
        return HostStep(inputs, torch.tensor(inputs.packed.meta, dtype=torch.int32).pin_memory(),
                        graph_bs, extend_t)

    # ---- the launcher thread: queue the step, never wait -----------------------------------
    def _enqueue(self, h: HostStep) -> tuple[torch.cuda.Event, _Pending]:
        start = torch.cuda.Event(enable_timing=True)
        with torch.inference_mode():
            meta, batch = self._copy_in(h)
            with torch.cuda.stream(self.stream):
                start.record(self.stream)
                for new_slot in h.inputs.new_slots:
                    self.penalties.start_slot(*new_slot)
                if h.graph_bs:
                    logits = self._replay(h, meta)
                elif h.extend_tokens:
                    logits = self._replay_extend(h, meta)
                else:
                    nd = h.layout.num_decode
                    step, decode_slots = step_views(h.layout, meta, self._num_splits(nd))
                    if nd:
                        step.input_ids[:nd] = self.token_buffer[decode_slots]
                    backend = PagedAttention(self.kv, step, self.rotary, self.model)
                    hidden = self.model(step.input_ids, backend)
                    index = h.layout.view(meta, "sample_index")
                    logits = self.model.logits(hidden[index]) if index.numel() else hidden[:0]
                out = None
                if batch is not None:
                    slots = h.layout.view(meta, "sample_slots")
                    out = sample_into(logits, batch, slots, self.penalties, self.token_buffer,
                                      self.generator, self.model.ops.greedy_pick)
            pending = _Pending(start, h.inputs.want_logprobs)
            event = torch.cuda.Event(enable_timing=True, blocking=True)
            pending.out = self._copy_out(out, event)
        return event, pending

    def _copy_in(self, h: HostStep) -> tuple[torch.Tensor, SamplingBatch | None]:
        """The step's packed array (and, unless the batch takes the greedy pick, which reads
        none, its sampling parameters) onto the device, on the copy-in stream. That stream
        never waits for the model, so step N+1's copy runs while step N computes; ours waits
        for it by an event that has long passed when step N+1 starts."""
        batch = h.inputs.sampling
        with torch.cuda.stream(self.copy_in_stream):
            meta = h.meta.to(self.device, non_blocking=True)
            moved = [meta]
            if batch is not None and batch.reads_tensors:
                batch = batch.to(self.device)
                moved += batch.tensors()
        self.stream.wait_stream(self.copy_in_stream)
        for t in moved:  # NOTE: made on the copy-in stream, read on ours: no reuse before
            t.record_stream(self.stream)
        return meta, batch

    def _copy_out(self, out: SampleOutput | None, event: torch.cuda.Event) -> _Copied | None:
        """The sampled ids (and logprobs) into pinned memory on the copy-out stream, after the
        step's kernels; `event` marks the step done. NOTE: not on ours, where the copy would
        wait for the step and step N+1's kernels for the copy."""
        self.copy_out_stream.wait_stream(self.stream)
        with torch.cuda.stream(self.copy_out_stream):
            copied = _Copied.of(out, self.copy_out_stream) if out is not None else None
            event.record(self.copy_out_stream)
        return copied

    def _replay(self, h: HostStep, meta: torch.Tensor) -> torch.Tensor:
        g = self.graphs
        assert g is not None
        g.load(h.layout, meta, h.graph_bs)
        g.graphs[h.graph_bs].replay()
        return g.logits[h.graph_bs][: h.layout.num_decode]

    def _replay_extend(self, h: HostStep, meta: torch.Tensor) -> torch.Tensor:
        g = self.extend_graphs
        assert g is not None
        g.load(h.layout, meta, h.extend_tokens)
        g.graphs[h.extend_tokens].replay()
        return g.logits[: len(h.layout.sample_rows)]

    def _num_splits(self, num_decode: int) -> int:
        """The decode kernel's split count: the one the graph of that batch size was captured
        with. NOTE: eager steps then compile no variant the capture did not (a first-use
        compile stalls every request for a second or more)."""
        if not num_decode:
            return 1
        g = self.graphs
        if g is not None and num_decode <= g.max_bs:
            return g.num_splits[g.size_for(num_decode)]
        return pick_num_splits(num_decode, self.model.config.num_kv_heads,
                               self.config.max_model_len, self.num_sms)

    # ---- the waiter thread -----------------------------------------------------------------
    @staticmethod
    def _wait(event: torch.cuda.Event, pending: _Pending) -> StepOutput:
        event.synchronize()  # NOTE: a blocking-sync event: the thread sleeps, the GIL is free
        exec_s = pending.start.elapsed_time(event) / 1e3
        if pending.out is None:
            return StepOutput([], [], exec_s)
        out = pending.out.host()
        return StepOutput(out.token_ids.tolist(), logprobs_of(out, pending.want_logprobs),
                          exec_s)

    def close(self) -> None:
        self._launcher.submit(lambda: None).result()
        self._waiter.shutdown(wait=True)
        torch.cuda.synchronize(self.device)


@dataclass
class _Copied:
    """A sample's tensors, copied (non-blocking) into pinned host memory."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None
    top_logprobs: torch.Tensor | None

    @classmethod
    def of(cls, out: SampleOutput, stream: torch.cuda.Stream) -> _Copied:
        """Copies queued on `stream` (the current one), which did not make `out`."""
        def copy(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            t.record_stream(stream)  # NOTE: its memory is not reused before the copy ran
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)

        ids = copy(out.token_ids)
        assert ids is not None
        return cls(ids, copy(out.logprobs), copy(out.top_ids), copy(out.top_logprobs))

    def host(self) -> SampleOutput:
        return SampleOutput(self.token_ids, self.logprobs, self.top_ids, self.top_logprobs)


@dataclass
class _Pending:
    start: torch.cuda.Event  # recorded when the step's work began on the stream
    want_logprobs: list[int | None]
    out: _Copied | None = None

