"""The CUDA executor's graphs: decode-only steps by batch size, steps with prefill rows by
token count. Each kind owns its static input buffers, fills them from a packed step, and
captures one graph per size of its ladder; the executor replays them (`cuda.py`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from arle.executor.paged import DeviceStep, ExtendGraphShape, PackedStep, extend_graph_block
from arle.logging import get_logger

log = get_logger("arle.executor.cuda")

#: What torch.cuda.graph_pool_handle() returns (graphs captured with one share memory)
PoolHandle = Any
_T = TypeVar("_T")

#: Batch sizes of the decode graphs (up to the largest captured, which is always one).
DECODE_GRAPH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160,
                                       192, 224, 256, 320, 384, 448, 512)
#: Token counts of the extend graphs (the ladder, up to extend_graph_max_tokens).
EXTEND_GRAPH_TOKENS: tuple[int, ...] = (32, 64, 128, 256, 384, 512, 640, 768, 1024, 1280, 1536,
                                        2048)
#: Rows an extend graph takes (steps with more run eagerly): the decode rows of 255 requests
#: beside a prefill chunk, as `arle serve`'s mixed steps hold at its 256 running requests
#: (a CPU replay of the H100's c = 256 run: 115 of its 274 steps had more than 64 rows, and
#: an eager step costs about 10x a replay). NOTE: a graph of t tokens takes min(t, this) rows
#: (no step has more rows than tokens), so small graphs keep a small lm_head.
EXTEND_GRAPH_ROWS = 256


def record(run: Callable[[], _T], pool: PoolHandle, stream: torch.cuda.Stream
           ) -> tuple[torch.cuda.CUDAGraph, _T]:
    """run() once eagerly (buffers made on first use and cuBLAS's choices are made outside the
    capture; the kernels were built ahead at start-up), then captured as a graph in `pool`, on
    `stream`. Returns the graph and what the captured run returned (its output buffers, which
    each replay rewrites)."""
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = run()
    return graph, out


class DecodeGraphs:
    """Decode-only steps captured as CUDA graphs, one per batch size of a ladder.

    NOTE: the graphs read their inputs from static buffers: `meta` [4, max_bs] (decode slots,
    positions, cache slots, sequence lengths) and `page_table` [max_bs, max_pages]. A step
    copies its (padded) rows into their top-left corner; padded rows write no K/V (slot -1)
    and attend to one token of page 0.
    """

    def __init__(self, max_bs: int, max_pages: int, device: torch.device,
                 state_pad: int | None = None) -> None:
        self.sizes = [bs for bs in DECODE_GRAPH_SIZES if bs < max_bs] + [max_bs]
        #: a hybrid model's padding slot: its padding rows then touch no recurrent state
        self.state_pad = state_pad
        self.max_bs = max_bs
        self.meta = torch.zeros(4, max_bs, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(max_bs, max_pages, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.num_splits: dict[int, int] = {}
        self.capture_s = 0.0

    def size_for(self, n: int) -> int:
        return next(bs for bs in self.sizes if bs >= n)

    @property
    def nbytes(self) -> int:
        """The static input buffers' bytes (the captured graphs' outputs not counted)."""
        return _nbytes(self.meta, self.page_table)

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
        there (`DecoderLM.forward`'s id_source), in the embedding kernel."""
        slots, positions, kv_slots, seq_lens = self.meta[:, :bs]
        # NOTE: padding rows share one slot; as a recurrent state's slot that would be several
        # rows updating one state at once, so they get none (-1)
        state_slots = (slots if self.state_pad is None
                       else torch.where(slots == self.state_pad, -1, slots))
        return DeviceStep(input_ids=slots, positions=positions, kv_slots=kv_slots,
                          seq_lens=seq_lens, cu_q_lens=seq_lens[:0],
                          page_table=self.page_table[:bs], num_decode=bs, max_q_len=1,
                          num_splits=self.num_splits[bs], slots=state_slots)

    def runs(self, forward: Callable[[DeviceStep], torch.Tensor], num_splits: Callable[[int], int],
             pad_slot: int) -> dict[int, Callable[[], torch.Tensor]]:
        """One decode forward per batch size, on the static buffers, which now hold padding
        everywhere: slot, position 0, no K/V write, one token of context. Each returns its
        logits (the graph's output once captured). `num_splits(bs)`: the decode kernel's
        split count at that batch size, fixed for the graph's life."""
        for row, value in enumerate((pad_slot, 0, -1, 1)):
            self.meta[row].fill_(value)
        for bs in self.sizes:
            self.num_splits[bs] = num_splits(bs)

        def run(bs: int) -> Callable[[], torch.Tensor]:
            return lambda: forward(self.step(bs))
        return {bs: run(bs) for bs in self.sizes}

    def capture(self, runs: dict[int, Callable[[], torch.Tensor]], pool: PoolHandle,
                stream: torch.cuda.Stream) -> None:
        """Capture one graph per batch size (`runs`), largest first: they share one pool."""
        t0 = time.perf_counter()
        with torch.inference_mode(), torch.cuda.stream(stream):
            for bs in reversed(self.sizes):
                self.graphs[bs], self.logits[bs] = record(runs[bs], pool, stream)
        stream.synchronize()
        self.capture_s = time.perf_counter() - t0
        log.info("cuda_graphs_captured", batch_sizes=self.sizes, seconds=round(self.capture_s, 2))


class ExtendGraphs:
    """Steps with prefill rows (prefills and mixed batches) captured as CUDA graphs, one per
    token count of a ladder, padded to the next. Eager, such a step is bound by the host (a
    few hundred kernel launches against a few ms of GPU work).

    NOTE: every row runs as an extend row (a decode row is one new token), so a graph is fixed
    by its token count alone; the extend kernel walks a (row, token block) list, so padding
    rows cost no programs. Each graph reads a static block of its own (`ExtendGraphShape`
    layout) and one shared page table, and writes its logits into one shared buffer: steps
    replay one at a time, in stream order, and sampling reads the logits right after.
    Speculative decoding's verify rows are extend rows sampling at each of their tokens: a step
    replays a graph while its samples fit the `rows` logits. keeps: a hybrid model's verify rows
    keep their states after each token (`DeviceStep.keep`), so its graphs run that launch too."""

    def __init__(self, max_tokens: int, rows: int, block_t: int, max_pages: int, vocab: int,
                 pad_slot: int, device: torch.device, keeps: bool = False) -> None:
        self.sizes = [t for t in EXTEND_GRAPH_TOKENS if t < max_tokens] + [max_tokens]
        self.rows, self.keeps = rows, keeps
        self.shapes = {t: ExtendGraphShape(t, min(t, rows), block_t) for t in self.sizes}
        # NOTE: filled with padding (no rows, no token blocks, no K/V writes): what warm-up and
        # capture run on
        self.blocks = {t: torch.tensor(extend_graph_block([], 1, pad_slot, shape)[0],
                                       dtype=torch.int32, device=device)
                       for t, shape in self.shapes.items()}
        self.page_table = torch.zeros(rows, max_pages, dtype=torch.int32, device=device)
        self.logits = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_s = 0.0

    @property
    def nbytes(self) -> int:
        """The static buffers' bytes: inputs and the shared logits."""
        return _nbytes(*self.blocks.values(), self.page_table, self.logits)

    def size_for(self, num_tokens: int, num_rows: int, num_samples: int = 0) -> int:
        """The graph a step of that many tokens, rows and sampled positions replays; 0: none
        (run it eagerly)."""
        if max(num_rows, num_samples) > self.rows or num_tokens > self.sizes[-1]:
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
        # NOTE: the page table's first rows, one a row of graph t (the kernel's contract)
        page_table = self.page_table[:self.shapes[t].rows]
        step = DeviceStep(ids, seg("positions"), seg("kv_slots"), seg("seq_lens"),
                          seg("cu_q_lens"), page_table, num_decode=0, max_q_len=t,
                          num_splits=1, extend_blocks=seg("extend_blocks"),
                          slots=seg("row_slots"), keep=seg("keep") if self.keeps else None)
        return step, seg("sample_index")

    def runs(self, forward: Callable[[int], None]) -> dict[int, Callable[[], None]]:
        """One extend forward per token count, on its static block's padding."""
        return {t: functools.partial(forward, t) for t in self.sizes}

    def capture(self, runs: dict[int, Callable[[], None]], pool: PoolHandle,
                stream: torch.cuda.Stream) -> None:
        """Capture one graph per token count (`runs`), largest first, in the decode graphs'
        pool (steps replay one at a time)."""
        t0 = time.perf_counter()
        with torch.inference_mode(), torch.cuda.stream(stream):
            for t in reversed(self.sizes):
                self.graphs[t], _ = record(runs[t], pool, stream)
        stream.synchronize()
        self.capture_s = time.perf_counter() - t0
        log.info("extend_graphs_captured", tokens=self.sizes, rows=self.rows,
                 seconds=round(self.capture_s, 2))


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def graph_reserve(max_bs: int, extend_tokens: int, extend_rows: int, vocab: int,
                  activations: int, max_batched_tokens: int) -> int:
    """Memory the graphs keep beyond their static buffers: the decode graphs' logits and a
    margin for their activations; the extend graphs' activations (the profile step's
    `activations` at `max_batched_tokens`, scaled to their largest token count) and shared
    logits. max_bs 0: no graphs; extend_tokens 0: no extend graphs."""
    if max_bs <= 0:
        return 0
    reserve = max_bs * vocab * 4 * 2 + (512 << 20)
    if extend_tokens > 0:
        # the shared logits and, inside the largest graph, the lm_head's own output
        reserve += (activations * extend_tokens // max_batched_tokens
                    + extend_rows * vocab * 4 * 2)
    return reserve
