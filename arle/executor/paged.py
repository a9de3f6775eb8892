"""What both executors share: the paged KV cache, a step's metadata on the device, and the
attention backend the model calls, with the kernels of `model.ops` (torch references on the
CPU, Triton on CUDA). Also `pack_step`: a plan flattened into one int32 array on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from arle.executor.plan import Row, StepPlan
from arle.executor.sampler import SamplingBatch
from arle.model.config import ModelConfig
from arle.model.decoder import DecoderLM
from arle_kernels.deltanet_ref import Keep, kept_out
from arle_kernels.extend_attention_ref import plan_blocks
from arle_kernels.split_sums import SplitSums

FP8_KV = torch.float8_e4m3fn


def kv_format(dtype: torch.dtype) -> str:
    """A KV pool's format as logs and `KVPoolInfo` name it: "bfloat16", "fp8e4m3", ..."""
    return "fp8e4m3" if dtype == FP8_KV else str(dtype).removeprefix("torch.")


def bytes_of(*tensors: torch.Tensor | None) -> int:
    """The bytes of the tensors given (None: none)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class _KVTensors:
    """K and V pages (and, for FP8, one fp32 scale per token and KV head), in the layout of
    the pool that holds them."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        return bytes_of(self.k, self.v, self.k_scale, self.v_scale)


@dataclass
class KVCache(_KVTensors):
    """Every layer's K and V pages: k, v [layers, pages, page_size, kv_heads, head_dim], FP8's
    scales [layers, pages, page_size, kv_heads] float32."""

    @classmethod
    def allocate(cls, layers: int, pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> KVCache:
        """The pages uninitialised but page 0, zeroed: it is what the CUDA graphs' padding rows
        attend to (one token), from their capture on. NOTE: nothing else reads a slot before
        a step wrote it (the kernels mask past a row's length, the references gather within
        it), as with pages that come back to the pool holding an earlier request's K/V.
        Zeroing the whole pool would cost start-up time for nothing."""
        shape = (layers, pages, page_size, kv_heads, head_dim)
        k = torch.empty(shape, dtype=dtype, device=device)
        v = torch.empty(shape, dtype=dtype, device=device)
        k[:, 0].zero_()
        v[:, 0].zero_()
        scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        if dtype == FP8_KV:
            scales = (torch.ones(shape[:-1], dtype=torch.float32, device=device),
                      torch.ones(shape[:-1], dtype=torch.float32, device=device))
        return cls(k, v, *scales)

    @classmethod
    def for_model(cls, cfg: ModelConfig, pages: int, page_size: int, dtype: torch.dtype,
                  device: torch.device) -> KVCache:
        """A cache of `pages` pages for the model's full-attention layers (and its MTP
        head's)."""
        return cls.allocate(cfg.kv_layers, pages, page_size, cfg.num_kv_heads,
                            cfg.head_dim, dtype, device)

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                     torch.Tensor | None]:
        ks = self.k_scale[i] if self.k_scale is not None else None
        vs = self.v_scale[i] if self.v_scale is not None else None
        return self.k[i], self.v[i], ks, vs


#: the most bytes of K (or V) one host-tier copy moves at once (`HostKV.copy`)
COPY_RUN_BYTES = 32 << 20


@dataclass
class HostKV(_KVTensors):
    """The host tier's K/V pages (`CacheManager`'s host pages): [pages, layers, page_size,
    kv_heads, head_dim] per K and V (and FP8's scales), so a page is one contiguous block;
    pinned where the device pool is on CUDA (its copies are queued on a stream, never waited
    for on the host)."""

    @classmethod
    def beside(cls, kv: KVCache, nbytes: int) -> HostKV | None:
        """A tier of `nbytes` for pages of `kv` (None: too small for one page)."""
        pages = nbytes * kv.k.shape[1] // max(kv.nbytes, 1)
        if pages < 1:
            return None
        scales = (None if t is None else _host_blocks(t, pages) for t in (kv.k_scale, kv.v_scale))
        return cls(_host_blocks(kv.k, pages), _host_blocks(kv.v, pages), *scales)

    @property
    def num_pages(self) -> int:
        return self.k.shape[0]

    def copy(self, kv: KVCache, offloads: list[tuple[int, int]],
             restores: list[tuple[int, int]]) -> None:
        """A step's page copies, in this order (`CacheManager.take_copies`): (device page,
        host page) offloads, then (host page, device page) restores."""
        # NOTE: FP8 pages move as bytes: index_copy_ has no float8 kernel
        pairs = [(_as_bytes(h), _as_bytes(d)) for h, d in (
            (self.k, kv.k), (self.v, kv.v), (self.k_scale, kv.k_scale),
            (self.v_scale, kv.v_scale)) if h is not None and d is not None]
        device = kv.k.device
        # NOTE: a run's temporary on the device is bounded: it is memory the plan never saw
        longest = max(1, COPY_RUN_BYTES // (self.k[0].numel() * self.k.element_size()))
        for h, index in _host_runs([(h, d) for d, h in offloads], device, longest):
            for host, dev in pairs:
                host[h].copy_(dev.index_select(1, index).transpose(0, 1), non_blocking=True)
        for h, index in _host_runs(restores, device, longest):
            for host, dev in pairs:
                dev.index_copy_(1, index, host[h].to(device, non_blocking=True).transpose(0, 1))


def _host_blocks(pool: torch.Tensor, n: int) -> torch.Tensor:
    """n host entries of a device pool [layers, entries, ...] as [n, layers, ...], an entry one
    contiguous block; pinned where the pool is on CUDA (its copies queue on a stream)."""
    return torch.empty((n, pool.shape[0], *pool.shape[2:]), dtype=pool.dtype,
                       pin_memory=pool.device.type == "cuda")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_KV else t


def _host_runs(pairs: list[tuple[int, int]], device: torch.device, longest: int
               ) -> list[tuple[slice, torch.Tensor]]:
    """(host page, device page) pairs as runs of consecutive host pages, each with its device
    pages (an index on `device`), at most `longest` pages a run: a run is one gather or
    scatter on the device and one copy of a contiguous host block (a page at a time would be
    two launches and a copy a page).
    NOTE: a host page may take two offloads of one step (the host dropped the first node to
    make room for the second): the last one holds, as it would copied in order. Otherwise the
    pages of a batch are distinct on each side, so their order is free."""
    runs: list[tuple[slice, torch.Tensor]] = []
    ordered = sorted(dict(pairs).items())
    start = 0
    for i in range(1, len(ordered) + 1):
        if (i == len(ordered) or ordered[i][0] != ordered[i - 1][0] + 1
                or i - start == longest):
            pages = [d for _, d in ordered[start:i]]
            runs.append((slice(ordered[start][0], ordered[i - 1][0] + 1),
                         torch.tensor(pages, dtype=torch.long, device=device)))
            start = i
    return runs


@dataclass
class HostStates:
    """The host tier's state snapshots (a hybrid model's, beside `HostKV`): conv and ssm
    [snapshots, linear layers, ...], a snapshot one contiguous block; pinned where the state
    pool is on CUDA. A snapshot moves here from the pool's `snap_*` and is read back straight
    into a request's slot."""

    conv: torch.Tensor
    ssm: torch.Tensor

    @classmethod
    def beside(cls, state: StatePool, nbytes: int) -> HostStates | None:
        """Snapshots of `state` in `nbytes` (None: too small for one)."""
        count = nbytes // max(state.slot_bytes, 1)
        if count < 1:
            return None
        return cls(_host_blocks(state.snap_conv, count), _host_blocks(state.snap_ssm, count))

    @property
    def num_snapshots(self) -> int:
        return self.conv.shape[0]

    @property
    def nbytes(self) -> int:
        return bytes_of(self.conv, self.ssm)

    def offload(self, state: StatePool, pairs: list[tuple[int, int]]) -> None:
        """(device snapshot, host snapshot): the pool's snapshot down to the host."""
        for d, h in pairs:
            self.conv[h].copy_(state.snap_conv[:, d], non_blocking=True)
            self.ssm[h].copy_(state.snap_ssm[:, d], non_blocking=True)

    def start(self, state: StatePool, slot: int, h: int) -> None:
        """A request starts on `slot` from host snapshot `h`."""
        state.conv[:, slot].copy_(self.conv[h], non_blocking=True)
        state.ssm[:, slot].copy_(self.ssm[h], non_blocking=True)


def host_tier(kv: KVCache, state: StatePool | None, nbytes: int
              ) -> tuple[HostKV | None, HostStates | None]:
    """The host tier of `nbytes` (`--kv-host-cache-gb`) beside these pools: K/V pages and, for
    a hybrid model, state snapshots, the bytes split as the device pools split theirs (a
    page moving down takes its snapshot with it)."""
    if not nbytes:
        return None, None
    snaps = bytes_of(state.snap_conv, state.snap_ssm) if state is not None else 0
    share = nbytes * snaps // max(snaps + kv.nbytes, 1)
    states = HostStates.beside(state, share) if state is not None else None
    return HostKV.beside(kv, nbytes - share), states


@dataclass
class StatePool:
    """A hybrid model's recurrent state, per Gated DeltaNet layer: one entry per request slot
    (and a spare: start-up's profile step runs there; padding rows run with slot -1 and touch
    no state), each slot's state at the last page boundary its rows reached (`boundary_*`),
    and snapshots the prefix cache keeps (`snap_*`). conv: the conv's last kernel - 1 inputs,
    in the model dtype; ssm: the delta-rule state, fp32."""

    conv: torch.Tensor  # [linear layers, slots, conv_dim, kernel - 1]
    ssm: torch.Tensor  # [linear layers, slots, value heads, key dim, value dim]
    boundary_conv: torch.Tensor
    boundary_ssm: torch.Tensor
    snap_conv: torch.Tensor  # [linear layers, snapshots, ...]
    snap_ssm: torch.Tensor
    #: speculative decoding: a verify row's state after each of its sampled positions
    spec_conv: torch.Tensor | None = None  # [linear layers, entries, K + 1, ...]
    spec_ssm: torch.Tensor | None = None

    @classmethod
    def for_model(cls, cfg: ModelConfig, slots: int, snapshots: int, dtype: torch.dtype,
                  device: torch.device, spec: tuple[int, int] = (0, 0)) -> StatePool | None:
        """None for a model without Gated DeltaNet layers. spec: (verify rows, positions
        each) whose states a step keeps (speculative decoding)."""
        la = cfg.linear_attention
        if la is None or not cfg.linear_layers:
            return None
        n = len(cfg.linear_layers)
        conv = (la.conv_dim, la.conv_kernel - 1)
        ssm = (la.num_value_heads, la.key_head_dim, la.value_head_dim)

        def zeros(entries: int, shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, entries, *shape, dtype=dt, device=device)

        rows, positions = spec
        kept = ((zeros(rows * positions, conv, dtype).unflatten(1, spec),
                 zeros(rows * positions, ssm, torch.float32).unflatten(1, spec))
                if rows else (None, None))
        return cls(zeros(slots, conv, dtype), zeros(slots, ssm, torch.float32),
                   zeros(slots, conv, dtype), zeros(slots, ssm, torch.float32),
                   zeros(max(snapshots, 1), conv, dtype),
                   zeros(max(snapshots, 1), ssm, torch.float32), *kept)

    @property
    def nbytes(self) -> int:
        return bytes_of(self.conv, self.ssm, self.boundary_conv, self.boundary_ssm,
                        self.snap_conv, self.snap_ssm, self.spec_conv, self.spec_ssm)

    def restore(self, slot: int, entry: int, index: int) -> None:
        """A verify row's outcome: the slot's state as it was after its sampled position
        `index` (the last accepted draft)."""
        assert self.spec_conv is not None and self.spec_ssm is not None
        self.conv[:, slot].copy_(self.spec_conv[:, entry, index])
        self.ssm[:, slot].copy_(self.spec_ssm[:, entry, index])

    @property
    def slot_bytes(self) -> int:
        """One slot's state, all layers."""
        return (self.conv[:, 0].numel() * self.conv.element_size()
                + self.ssm[:, 0].numel() * self.ssm.element_size())

    def start(self, slot: int, snapshot: int | None) -> None:
        """A request starts on `slot`: from zero, or from a snapshot's state."""
        if snapshot is None:
            self.conv[:, slot].zero_()
            self.ssm[:, slot].zero_()
        else:
            self.conv[:, slot].copy_(self.snap_conv[:, snapshot])
            self.ssm[:, slot].copy_(self.snap_ssm[:, snapshot])

    def save(self, slot: int, snapshot: int) -> None:
        """The slot's state at its last page boundary into a snapshot."""
        self.snap_conv[:, snapshot].copy_(self.boundary_conv[:, slot])
        self.snap_ssm[:, snapshot].copy_(self.boundary_ssm[:, slot])


@dataclass
class DeviceStep:
    """One step's metadata on the device (views into one buffer) and the host ints that size
    its kernel grids."""

    input_ids: torch.Tensor  # [T] int32 (decode rows: filled from the token buffer)
    positions: torch.Tensor  # [T]
    kv_slots: torch.Tensor  # [T]; -1: do not write (graph padding)
    seq_lens: torch.Tensor  # [R]
    cu_q_lens: torch.Tensor  # [R - num_decode + 1] for the extend rows
    page_table: torch.Tensor  # [R, max_pages]
    num_decode: int
    max_q_len: int
    num_splits: int
    #: The extend kernel's (row, token block) work list (extend graphs; None: its grid)
    extend_blocks: torch.Tensor | None = None
    #: Each row's request slot [R] (a hybrid model's state entry)
    slots: torch.Tensor | None = None
    #: A hybrid model's verify rows (speculative decoding): each row's entry in the state
    #: pool's `spec_*` buffers [R] (-1: none), where its state after each token is kept
    keep: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


class PagedAttention:
    """The model's attention backend for one step: q/k norms + rotary + K/V store, then decode
    attention over the decode rows and extend attention over the prefill rows, all with the
    kernels of `model.ops`."""

    def __init__(self, kv: KVCache, step: DeviceStep, rotary: torch.Tensor,
                 model: DecoderLM, state: StatePool | None = None, page_size: int = 16) -> None:
        cfg = model.rank_config  # this rank's heads
        self.kv, self.step, self.rotary, self.ops = kv, step, rotary, model.ops
        self.state, self.page_size = state, page_size
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.eps, self.scale = cfg.rms_norm_eps, cfg.head_dim ** -0.5
        la = cfg.linear_attention
        self.num_k_heads = la.num_key_heads if la is not None else 0
        #: verify rows: the other rows' slots, made once for every layer (`Keep.others`)
        self.kept_out = (kept_out(step.slots, step.keep)
                         if step.keep is not None and step.slots is not None else None)

    def attend(self, layer: int, qkv: torch.Tensor | SplitSums, q_norm: torch.Tensor | None,
               k_norm: torch.Tensor | None) -> torch.Tensor:
        s, ops = self.step, self.ops
        k, v, ks, vs = self.kv.layer(layer)
        q = ops.qk_norm_rope_store_kv(qkv, s.positions, self.rotary, q_norm, k_norm, self.eps,
                                      self.num_heads, self.num_kv_heads, k, v, s.kv_slots, ks, vs)
        out = torch.empty_like(q)
        nd = s.num_decode
        if nd:
            ops.decode_attention(q[:nd], k, v, s.page_table[:nd], s.seq_lens[:nd], self.scale,
                                 s.num_splits, k_scale=ks, v_scale=vs, out=out[:nd])
        if s.num_tokens > nd:
            ops.extend_attention(q[nd:], k, v, s.page_table[nd:], s.cu_q_lens, s.seq_lens[nd:],
                                 self.scale, s.max_q_len, k_scale=ks, v_scale=vs, out=out[nd:],
                                 blocks=s.extend_blocks)
        return out.view(q.shape[0], -1)

    def gated_delta(self, layer: int, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    conv_weight: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
                    ) -> torch.Tensor:
        s, st = self.step, self.state
        assert st is not None and s.slots is not None, "a hybrid model's step needs its state"
        keep = None
        if s.keep is not None:  # verify rows: the state after each token kept (restore)
            assert st.spec_conv is not None and st.spec_ssm is not None
            keep = Keep(s.keep, st.spec_conv[layer], st.spec_ssm[layer], self.kept_out)
        out = self.ops.gated_delta(
            mixed_qkv, a, b, conv_weight, a_log, dt_bias, st.conv[layer], st.ssm[layer],
            s.slots, s.seq_lens, s.cu_q_lens, s.num_decode, s.max_q_len, self.num_k_heads,
            self.page_size, st.boundary_conv[layer], st.boundary_ssm[layer], keep=keep)
        return out.reshape(out.shape[0], -1)


#: Segments of the packed step array start at multiples of 4 int32s (16 bytes): Triton
#: specialises pointer arguments on 16-byte alignment, so unaligned views would compile (and
#: stall the engine for) a second variant of every kernel.
_ALIGN = 4


@dataclass(frozen=True)
class ExtendGraphShape:
    """A step padded for an extend graph (`arle.executor.cuda_graphs.ExtendGraphs`): `tokens` token
    slots, `rows` rows, every row an extend row (a decode row is one new token), and the
    extend kernel's work as a list of (row, token block of `block_t` tokens) pairs."""

    tokens: int
    rows: int
    block_t: int

    @property
    def blocks(self) -> int:
        """Room for every token block: sum of ceil(q_len / block_t) <= tokens / block_t + rows."""
        return self.tokens // self.block_t + self.rows

    @cached_property
    def layout(self) -> tuple[dict[str, tuple[int, int]], int]:
        """Segment -> (start, length) within the graph's static block, and its size. Every
        segment 16-byte aligned, as in the eager layout (computed once: packing reads it every
        step)."""
        t, r = self.tokens, self.rows
        offsets: dict[str, tuple[int, int]] = {}
        n = 0
        for name, size in (("input_ids", t), ("tok_slots", t), ("positions", t),
                           ("kv_slots", t), ("seq_lens", r), ("cu_q_lens", r + 1),
                           ("row_slots", r), ("keep", r), ("sample_index", r),
                           ("extend_blocks", 2 * self.blocks)):
            n += -n % _ALIGN
            offsets[name] = (n, size)
            n += size
        return offsets, n


@dataclass
class PackedStep:
    """One step's metadata as one int32 list, and where each segment sits in it.

    Eager steps: ids, positions, kv_slots [T]; seq_lens [R]; cu_q_lens [R - nd + 1] (the extend
    rows'); row_slots [R] (the decode rows' first); page_table [R, max_pages]. Graph steps (decode only, padded to
    the graph's batch size bs): decode_slots, positions, kv_slots, seq_lens [bs] back to back
    (the graph's static `meta` block, copied whole), then page_table [bs, max_pages].
    Both: sample_index [S], the row (graph) or token (eager) index each sampling row reads its
    logits at (`sample_rows` on the host), and sample_slots [S], that row's request slot.
    Eager steps that score prompt tokens also: score_index and score_targets [num_scores], each
    scored position's token index and the prompt token it scores (`Row.score_targets`).
    """

    meta: list[int]
    offsets: dict[str, tuple[int, int]]  # segment -> (start, length)
    num_tokens: int
    num_rows: int
    num_decode: int
    max_pages: int
    max_q_len: int
    max_seq_len: int
    sample_rows: list[int]
    num_scores: int = 0
    #: the MTP head's drafts per chaining row, and the most drafts a verify row has (0: no
    #: MTP head in the step)
    mtp_drafts: int = 0
    max_spec: int = 0

    @property
    def has_mtp(self) -> bool:
        """The MTP head runs over the step (`StepPlan.mtp`)."""
        return "mtp_ids" in self.offsets

    def segment(self, name: str) -> list[int]:
        start, n = self.offsets[name]
        return self.meta[start:start + n]

    def view(self, meta: torch.Tensor, name: str) -> torch.Tensor:
        """Segment `name` of `meta`, this array as a tensor (on any device)."""
        start, n = self.offsets[name]
        return meta[start:start + n]


class _Segments:
    """The packed array as it is built: named segments, each aligned to _ALIGN unless told."""

    def __init__(self) -> None:
        self.meta: list[int] = []
        self.offsets: dict[str, tuple[int, int]] = {}

    def put(self, name: str, values: list[int], align: bool = True) -> None:
        if align:
            self.meta.extend([0] * (-len(self.meta) % _ALIGN))
        self.offsets[name] = (len(self.meta), len(values))
        self.meta.extend(values)


def pack_step(plan: StepPlan, page_size: int, graph_bs: int = 0, pad_slot: int = 0,
              extend: ExtendGraphShape | None = None) -> PackedStep:
    """Flatten a plan for the device: plain Python, no torch (runs on the event loop).
    graph_bs: a decode graph's layout; extend: an extend graph's (see `extend_graph_block`)."""
    rows, nd = plan.rows, plan.num_decode_rows
    max_seq = max(r.seq_len for r in rows)
    max_pages = -(-max(r.table_len for r in rows) // page_size)
    table: list[int] = []
    for r in rows:
        n = -(-r.table_len // page_size)
        table += r.pages[:n] + [0] * (max_pages - n)
    seg = _Segments()
    if extend is not None:
        block, sample_at = extend_graph_block(rows, page_size, pad_slot, extend)
        seg.put("extend_graph", block)
        seg.put("page_table", table)
    elif graph_bs:
        sample_at = _put_decode_graph(seg, rows, page_size, table, max_pages, graph_bs - nd,
                                      pad_slot)
    else:
        sample_at = _put_eager(seg, rows, nd, page_size, table)
    seg.put("sample_index", sample_at)
    seg.put("sample_slots", [r.slot for r in rows for _ in range(r.num_samples)])
    if plan.mtp:
        # NOTE: an eager step (its hidden states): the CUDA executor runs these eagerly
        assert not graph_bs and extend is None, "the MTP head needs an eager step"
        _put_mtp(seg, rows)
    score_at, targets = _score_segments(rows)
    if score_at:
        # NOTE: scored positions need every token's hidden state: only eager steps have them
        assert not graph_bs and extend is None, "scoring needs an eager step"
        seg.put("score_index", score_at)
        seg.put("score_targets", targets)
    return PackedStep(seg.meta, seg.offsets, num_tokens=plan.num_tokens, num_rows=len(rows),
                      num_decode=nd, max_pages=max_pages,
                      max_q_len=max((r.num_tokens for r in rows[nd:]), default=1),
                      max_seq_len=max_seq, sample_rows=sample_at, num_scores=len(score_at),
                      mtp_drafts=max((r.mtp_drafts for r in rows), default=0) if plan.mtp else 0,
                      max_spec=max((r.spec for r in rows), default=0))


def _put_decode_graph(seg: _Segments, rows: list[Row], ps: int, table: list[int],
                      max_pages: int, pad: int, pad_slot: int) -> list[int]:
    """A decode graph's segments (its rows are all decode rows), `pad` padding rows
    included; -> the sampling indices."""
    # NOTE: the four [bs] segments stay back to back: one copy fills the graph's meta block
    seg.put("decode_slots", [r.slot for r in rows] + [pad_slot] * pad)
    seg.put("positions", [r.start for r in rows] + [0] * pad, align=False)
    seg.put("kv_slots", [r.pages[r.start // ps] * ps + r.start % ps for r in rows] + [-1] * pad,
            align=False)
    seg.put("seq_lens", [r.seq_len for r in rows] + [1] * pad, align=False)
    seg.put("page_table", table + [0] * (max_pages * pad))
    return list(range(len(rows)))


def _put_eager(seg: _Segments, rows: list[Row], nd: int, ps: int, table: list[int]
               ) -> list[int]:
    """An eager step's segments, token by token; -> the sampling indices."""
    ids, positions, kv_slots, sample_at = _token_segments(rows, ps)
    cu = [0]
    for r in rows[nd:]:  # decode rows come first; the extend rows' new tokens follow
        cu.append(cu[-1] + r.num_tokens)
    seg.put("input_ids", ids)
    seg.put("positions", positions)
    seg.put("kv_slots", kv_slots)
    seg.put("seq_lens", [r.seq_len for r in rows])
    seg.put("cu_q_lens", cu)
    seg.put("row_slots", [r.slot for r in rows])
    seg.put("page_table", table)
    if any(r.spec_entry >= 0 for r in rows):
        seg.put("keep", [r.spec_entry for r in rows])
    return sample_at


def _put_mtp(seg: _Segments, rows: list[Row]) -> None:
    """The MTP head's inputs: per token the id after it (-1 where the step samples it), and per
    row that chains drafts (row, its first sample's index among the samples, its drafts)."""
    ids: list[int] = []
    chains: list[int] = []
    first = 0
    for i, r in enumerate(rows):
        ids += (r.input_ids or [0])[1:] + [r.next_id if not r.sample else -1]
        if r.mtp_drafts:
            chains += [i, first, r.spec]
        first += r.num_samples
    seg.put("mtp_ids", ids)
    seg.put("mtp_rows", chains)


def _score_segments(rows: list[Row]) -> tuple[list[int], list[int]]:
    """The eager layout's token index of each scored prompt position, and its target id."""
    index: list[int] = []
    targets: list[int] = []
    first = 0  # the row's first token index in the step
    for r in rows:
        if r.score_targets:
            index += range(first + r.score_from, first + r.score_from + len(r.score_targets))
            targets += r.score_targets
        first += r.num_tokens
    return index, targets


def _token_segments(rows: list[Row], ps: int
                    ) -> tuple[list[int], list[int], list[int], list[int]]:
    """Per token of the rows, back to back: input ids (0 for a decode row: its input is on the
    device), positions, K/V cache slots; and the token index each sampling row samples at."""
    ids: list[int] = []
    positions: list[int] = []
    kv_slots: list[int] = []
    sample_at: list[int] = []
    for r in rows:
        ids += [0] if r.input_ids is None else r.input_ids
        pos = range(r.start, r.seq_len)
        positions += pos
        kv_slots += [r.pages[p // ps] * ps + p % ps for p in pos]
        sample_at += range(len(ids) - r.num_samples, len(ids))
    return ids, positions, kv_slots, sample_at


def extend_graph_block(rows: list[Row], ps: int, pad_slot: int, shape: ExtendGraphShape
                       ) -> tuple[list[int], list[int]]:
    """The static block of an extend graph (`ExtendGraphShape.layout`) for these rows, and the
    token index each sampling row samples at. Padded: token slots past the rows' tokens get id
    0, position 0, no K/V write (-1); rows past theirs own no tokens (cu_q_lens stays at the
    token count) and no token block. tok_slots: a decode row's request slot (its input is on
    the device, in the token buffer), pad_slot elsewhere. No rows: pure padding (what the
    graphs are captured on)."""
    ids, positions, kv_slots, sample_at = _token_segments(rows, ps)
    tok_slots: list[int] = []
    cu = [0]
    for r in rows:
        tok_slots += [r.slot] if r.is_decode else [pad_slot] * r.num_tokens
        cu.append(cu[-1] + r.num_tokens)
    t, nr = len(ids), len(rows)
    assert t <= shape.tokens and nr <= shape.rows, f"{t} tokens, {nr} rows > {shape}"
    pad_t, pad_r = shape.tokens - t, shape.rows - nr
    seq_lens = [r.seq_len for r in rows]
    values = {
        "input_ids": ids + [0] * pad_t, "tok_slots": tok_slots + [pad_slot] * pad_t,
        "positions": positions + [0] * pad_t, "kv_slots": kv_slots + [-1] * pad_t,
        "seq_lens": seq_lens + [0] * pad_r, "cu_q_lens": cu + [t] * pad_r,
        # padding rows own no tokens and no recurrent state (-1)
        "row_slots": [r.slot for r in rows] + [-1] * pad_r,
        "keep": [r.spec_entry for r in rows] + [-1] * pad_r,
        "sample_index": sample_at + [0] * (shape.rows - len(sample_at)),
        "extend_blocks": plan_blocks([r.num_tokens for r in rows], seq_lens,
                                     shape.block_t, shape.blocks)}
    offsets, size = shape.layout
    block = [0] * size
    for name, (start, n) in offsets.items():
        block[start:start + n] = values[name]
    return block, sample_at


def step_views(packed: PackedStep, meta: torch.Tensor, num_splits: int
               ) -> tuple[DeviceStep, torch.Tensor]:
    """An eager step's `DeviceStep` as views into `meta` (the packed array, on the device), and
    its decode rows' slots."""
    def seg(name: str) -> torch.Tensor:
        return packed.view(meta, name)

    table = seg("page_table").view(packed.num_rows, packed.max_pages)
    slots = seg("row_slots")
    return DeviceStep(seg("input_ids"), seg("positions"), seg("kv_slots"), seg("seq_lens"),
                      seg("cu_q_lens"), table, packed.num_decode, packed.max_q_len,
                      num_splits, slots=slots,
                      keep=seg("keep") if "keep" in packed.offsets else None
                      ), slots[:packed.num_decode]


@dataclass
class StepInputs:
    """What an executor takes from a plan on the caller's thread: the packed array and the
    sampling rows' parameters (the plan's page tables change after launch: nothing else is
    read later)."""

    packed: PackedStep
    sampling: SamplingBatch | None  # on the host
    want_logprobs: list[int | None]
    #: (slot, tokens, num_prompt, penalized) of each request starting this step
    new_slots: list[tuple[int, list[int], int, bool]]
    #: (slot, snapshot to restore or None, host snapshot to restore or None) of each request
    #: starting this step (hybrid models)
    state_starts: list[tuple[int, int | None, int | None]]
    saves_before: list[tuple[int, int]]
    saves_after: list[tuple[int, int]]
    #: (index among the sampling rows, matcher) of each grammar row (arle.executor.grammar)
    grammars: list[tuple[int, Any]] = field(default_factory=list)
    #: (positions scored, top-N asked) of each row that scores prompt tokens, in row order
    score_rows: list[tuple[int, int]] = field(default_factory=list)
    #: (slot, entry, index) of each state a verify step kept to restore (`StepPlan`)
    state_restores: list[tuple[int, int, int]] = field(default_factory=list)
    #: the host tier's page copies, run first (`StepPlan`)
    kv_offloads: list[tuple[int, int]] = field(default_factory=list)
    kv_restores: list[tuple[int, int]] = field(default_factory=list)
    kv_restores_overlap: bool = False
    #: (device snapshot, host snapshot): state snapshots down to the host tier (`StepPlan`)
    snapshot_offloads: list[tuple[int, int]] = field(default_factory=list)

    @property
    def score_top(self) -> int:
        """The most alternatives any scoring row asks for."""
        return max((n for _, n in self.score_rows), default=0)

    @classmethod
    def of(cls, plan: StepPlan, page_size: int, graph_bs: int = 0,
           pad_slot: int = 0, extend: ExtendGraphShape | None = None) -> StepInputs:
        # NOTE: one sample per sampled position (a verify row has several: consecutive
        # output offsets)
        rows = [(r, i) for r in plan.rows for i in range(r.num_samples)]
        sampling = (SamplingBatch.build([r.params for r, _ in rows],
                                        [r.sample_offset + i for r, i in rows])
                    if rows else None)
        return cls(pack_step(plan, page_size, graph_bs, pad_slot, extend), sampling,
                   [r.params.logprobs for r, _ in rows],
                   [(n.slot, n.token_ids, n.num_prompt, n.params.has_penalties)
                    for n in plan.new_slots],
                   [(n.slot, n.restore, n.restore_host) for n in plan.new_slots],
                   list(plan.saves_before), list(plan.saves_after),
                   [(i, r.grammar) for i, (r, _) in enumerate(rows) if r.grammar is not None],
                   [(len(r.score_targets), r.params.prompt_logprobs or 0)
                    for r in plan.rows if r.score_targets],
                   list(plan.state_restores), list(plan.kv_offloads), list(plan.kv_restores),
                   plan.kv_restores_overlap, list(plan.snapshot_offloads))

    def start_states(self, state: StatePool | None, host: HostStates | None = None) -> None:
        """Before the step: the states the last verify step kept (speculative decoding), the
        snapshots moving to the host tier, the snapshots of requests released since the last
        step, then the new requests' states (zero, or restored from a snapshot on either
        tier). NOTE: in this order: a snapshot moving down frees its entry for a save of
        this step; a new request may restore the snapshot a release just took (a save never
        targets a snapshot a later restore reads: taking one detaches it from the radix tree
        first)."""
        if state is None:
            return
        for slot, entry, index in self.state_restores:
            state.restore(slot, entry, index)
        if self.snapshot_offloads:
            assert host is not None
            host.offload(state, self.snapshot_offloads)
        for slot, snapshot in self.saves_before:
            state.save(slot, snapshot)
        for slot, restore, restore_host in self.state_starts:
            if restore_host is not None:
                assert host is not None
                host.start(state, slot, restore_host)
            else:
                state.start(slot, restore)

    def save_states(self, state: StatePool | None) -> None:
        """After the step: the snapshots at page boundaries its prefill rows reached."""
        if state is None:
            return
        for slot, snapshot in self.saves_after:
            state.save(slot, snapshot)
