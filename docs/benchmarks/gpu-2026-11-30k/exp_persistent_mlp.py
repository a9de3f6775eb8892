#!/usr/bin/env python3
"""EXPERIMENT (eighteenth session, not in the engine): a decoder layer's MLP (gate_up + SiLU·up,
then down) at 8 rows as one persistent kernel. Write-up: ../gpu-2026-11-30k.md.

The question (gpu-2026-11-30c.md, "what this leaves"): the engine's two MLP GEMVs read 149 MB a
layer in ~44 us (3.4 TB/s), lm_head's long kernel draws 4.36 TB/s. Does one launch a layer,
whose programs walk a byte-balanced schedule of gate_up tiles and down items, waiting only where
a down item needs a gate_up tile not yet written, stream closer to 4.4 TB/s?

- `build_schedule`: one program per SM; gate_up tiles (GBN rows of gate and of up, all of K)
  to the least-loaded program, then down items (DBN rows x GC chunks of K) in the order their
  K group's gate_up tiles should finish. A gate_up tile stores silu(gate) * up (HF's roundings)
  into h and counts itself in its group's counter (release); a down item of group g reads h
  after that counter is full (acquire) and adds its partial into slot g // 2 of a `SplitSums`
  (two adds onto zero a slot: deterministic), which `add_rms_norm` sums as for the engine's
  split-K down. The last program out zeroes the counters.
- v1 (`_persistent_mlp_kernel`, Triton): each item its own pipelined loop. Call 1.
- v2 (`_mlp_stream_kernel`, Gluon): W re-laid out as [64, BK] tiles (`tile_weights`), every
  chunk one W tile and one x or h tile, one ring of shared-memory slots per program across all
  its items (`build_chunks`). Calls 2-7; its hangs (calls 2-5) came from a per-thread counter
  load that warps saw differently ahead of CTA barriers.
- v3 (`_mlp_ws_kernel`, Gluon): v2 with a producer warp (warp specialisation). Calls 8-12.
- v4 (`_mlp_cross_kernel`, Gluon): v3 over all layers in one launch, with the norm between
  layers inside (run by the program that completes a layer). Call 13.
- v5 (`_mlp_cross5_kernel`, Gluon): v4 with that handoff spread over the row tiles, and an
  optional L2 prefetch of W ahead of the ring. Calls 14-15.

    python3 docs/benchmarks/gpu-2026-11-30k/exp_persistent_mlp.py --check --bench --call 10
    python3 docs/benchmarks/gpu-2026-11-30k/exp_persistent_mlp.py --bench --v1      # call 1
    python3 docs/benchmarks/gpu-2026-11-30k/exp_persistent_mlp.py --all-layers      # call 12
    python3 docs/benchmarks/gpu-2026-11-30k/exp_persistent_mlp.py --cross           # call 13
    python3 docs/benchmarks/gpu-2026-11-30k/exp_persistent_mlp.py --cross5          # calls 14-15
    python3 docs/benchmarks/gpu-2026-11-30k/exp_persistent_mlp.py --compile-stream  # no GPU

(On the device `arle_kernels` must import: `ln -sfn $PWD/kernels /tmp/site/arle_kernels` and
PYTHONPATH=/tmp/site, as scripts/gpu_session.sh does.)
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch import Tensor

ROOT = Path(__file__).resolve().parents[3]  # the repository
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from arle_kernels.fused import add_rms_norm, silu_mul  # noqa: E402
from arle_kernels.gemv import gemv_ref, gemv_silu_mul, gemv_silu_mul_ref, gemv_split_sums  # noqa: E402
from arle_kernels.jit import gdc_launch_dependents, gdc_wait, pdl_enabled, pdl_launch  # noqa: E402
from arle_kernels.split_sums import SplitSums, slot_buffer, take  # noqa: E402

#: Qwen3-4B
HIDDEN, INTER = 2560, 9728


@dataclass(frozen=True)
class MlpConfig:
    gbn: int = 32  # gate_up rows (of gate, and of up) per tile
    dbn: int = 64  # down rows per item
    bk: int = 128  # K per chunk
    gc: int = 4  # down chunks per item (a K group is gc * bk wide)
    gu_stages: int = 6
    dn_stages: int = 4
    num_warps: int = 4


@triton.jit
def _fence_proxy_async():
    """Generic-proxy writes (h's stores) ordered with async-proxy reads (TMA)."""
    tl.inline_asm_elementwise("fence.proxy.async.global; // $0", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _fence_acq_rel():
    tl.inline_asm_elementwise("fence.acq_rel.gpu; // $0", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _group_of(item, GU_TILES: tl.constexpr, ROW_TILES: tl.constexpr):
    """A down item's K group (gate_up tiles: 0, never waited on)."""
    return tl.where(item >= GU_TILES, (item - GU_TILES) // ROW_TILES, 0)


@triton.jit
def _persistent_mlp_kernel(x_desc, wgu_desc, wd_desc, h_desc, h_ptr, slots_ptr, sched_ptr,
                           gctr_ptr, done_ptr, M, stride_hm, stride_ss, stride_sm,
                           INTER_N: tl.constexpr, H: tl.constexpr, M_PAD: tl.constexpr,
                           GBN: tl.constexpr, DBN: tl.constexpr, BK: tl.constexpr,
                           GC: tl.constexpr, MAXI: tl.constexpr, NPROG: tl.constexpr,
                           GROUPS: tl.constexpr, G_PAD: tl.constexpr, GU_STAGES: tl.constexpr,
                           DN_STAGES: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    GU_TILES: tl.constexpr = INTER_N // GBN
    ROW_TILES: tl.constexpr = H // DBN
    TPG: tl.constexpr = GC * BK // GBN  # gate_up tiles a K group holds
    pid = tl.program_id(0)
    offs_j = tl.arange(0, MAXI)
    sched = tl.load(sched_ptr + pid * MAXI + offs_j)  # item ids, -1 past the end
    n = tl.sum((sched >= 0).to(tl.int32), 0)
    offs_m = tl.arange(0, M_PAD)
    dtype = h_ptr.dtype.element_ty
    if PDL:
        gdc_wait()
    item = tl.sum(tl.where(offs_j == 0, sched, 0), 0)
    ready = tl.load(gctr_ptr + _group_of(item, GU_TILES, ROW_TILES), volatile=True)
    for j in range(0, n):
        nxt = tl.sum(tl.where(offs_j == j + 1, sched, 0), 0)
        # NOTE: the next item's counter, loaded now and used next turn (no round trip then)
        ready_nxt = tl.load(gctr_ptr + _group_of(nxt, GU_TILES, ROW_TILES), volatile=True)
        if item < GU_TILES:
            acc = tl.zeros([GBN, M_PAD], tl.float32)
            acc_up = tl.zeros([GBN, M_PAD], tl.float32)
            for k0 in tl.range(0, H, BK, num_stages=GU_STAGES):
                x = x_desc.load([0, k0])
                w = wgu_desc.load([item * GBN, k0])
                w_up = wgu_desc.load([INTER_N + item * GBN, k0])
                acc = tl.dot(w, x.T, acc)
                acc_up = tl.dot(w_up, x.T, acc_up)
            hv = silu_mul(acc.to(dtype), acc_up.to(dtype))
            offs_n = item * GBN + tl.arange(0, GBN)
            tl.store(h_ptr + offs_m[None, :] * stride_hm + offs_n[:, None], hv,
                     mask=(offs_m < M)[None, :])
            _fence_proxy_async()
            tl.debug_barrier()
            tl.atomic_add(gctr_ptr + item * GBN // (GC * BK), 1, sem="release", scope="gpu")
        else:
            d = item - GU_TILES
            g = d // ROW_TILES
            r = d % ROW_TILES
            while ready < TPG:
                ready = tl.load(gctr_ptr + g, volatile=True)
            _fence_acq_rel()
            _fence_proxy_async()
            acc_d = tl.zeros([DBN, M_PAD], tl.float32)
            for kc in tl.range(0, GC, num_stages=DN_STAGES):
                k0 = (g * GC + kc) * BK
                w_d = wd_desc.load([r * DBN, k0])
                hx = h_desc.load([0, k0])
                acc_d = tl.dot(w_d, hx.T, acc_d)
            offs_d = r * DBN + tl.arange(0, DBN)
            ptrs = slots_ptr + (g // 2) * stride_ss + offs_m[None, :] * stride_sm + offs_d[:, None]
            tl.atomic_add(ptrs, acc_d, mask=(offs_m < M)[None, :], sem="relaxed", scope="gpu")
        item = nxt
        ready = ready_nxt
    # the last program out zeroes the counters for the next launch (every read of them is done)
    tl.debug_barrier()
    last = tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu")
    if last == NPROG - 1:
        offs_g = tl.arange(0, G_PAD)
        tl.store(gctr_ptr + offs_g, tl.zeros([G_PAD], tl.int32), mask=offs_g < GROUPS)
        tl.store(done_ptr, 0)


def build_schedule(nprog: int, cfg: MlpConfig, hidden: int = HIDDEN, inter: int = INTER
                   ) -> tuple[list[list[int]], list[float]]:
    """Each program's item ids, and its weight bytes: gate_up tiles to the least-loaded program
    in tile order; then down items in the order their group is expected ready (the finish of
    its last gate_up tile, at equal bytes per second on every SM), each to the least-loaded
    program. Item ids: gate_up tile t is t; down item (group g, row tile r) is
    GU_TILES + g * ROW_TILES + r."""
    gu_tiles, row_tiles = inter // cfg.gbn, hidden // cfg.dbn
    groups = inter // (cfg.gc * cfg.bk)
    tpg = cfg.gc * cfg.bk // cfg.gbn
    gu_bytes = 2 * cfg.gbn * hidden * 2
    dn_bytes = cfg.dbn * cfg.gc * cfg.bk * 2
    lists: list[list[int]] = [[] for _ in range(nprog)]
    heap = [(0.0, p) for p in range(nprog)]
    finish = [0.0] * gu_tiles
    for t in range(gu_tiles):
        load, p = heapq.heappop(heap)
        load += gu_bytes
        lists[p].append(t)
        finish[t] = load
        heapq.heappush(heap, (load, p))
    ready = [max(finish[g * tpg:(g + 1) * tpg]) for g in range(groups)]
    items = sorted((ready[g], g, r) for g in range(groups) for r in range(row_tiles))
    for at, g, r in items:
        load, p = heapq.heappop(heap)
        load = max(load, at) + dn_bytes
        lists[p].append(gu_tiles + g * row_tiles + r)
        heapq.heappush(heap, (load, p))
    loads = [0.0] * nprog
    for load, p in heap:
        loads[p] = load
    return lists, loads


class PersistentMlp:
    """The kernel's buffers and schedule for one (M, config): h, the group counters, the
    done counter and the schedule table."""

    def __init__(self, m: int, cfg: MlpConfig, device: torch.device, nprog: int,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.m, self.cfg, self.nprog = m, cfg, nprog
        self.groups = INTER // (cfg.gc * cfg.bk)
        assert INTER % (cfg.gc * cfg.bk) == 0 and INTER % cfg.gbn == 0 and HIDDEN % cfg.dbn == 0
        lists, self.loads = build_schedule(nprog, cfg)
        self.maxi = triton.next_power_of_2(max(len(items) for items in lists) + 1)
        table = torch.full((nprog, self.maxi), -1, dtype=torch.int32)
        for p, items in enumerate(lists):
            table[p, :len(items)] = torch.tensor(items, dtype=torch.int32)
        self.sched = table.to(device)
        self.h = torch.zeros(m, INTER, dtype=dtype, device=device)
        self.gctr = torch.zeros(triton.next_power_of_2(self.groups), dtype=torch.int32,
                                device=device)
        self.done = torch.zeros(1, dtype=torch.int32, device=device)

    def __call__(self, x: Tensor, wgu: Tensor, wd: Tensor) -> SplitSums:
        from triton.tools.tensor_descriptor import TensorDescriptor

        cfg, m = self.cfg, self.m
        assert x.shape == (m, HIDDEN) and wgu.shape == (2 * INTER, HIDDEN)
        assert wd.shape == (HIDDEN, INTER)
        m_pad = max(16, triton.next_power_of_2(m))
        slots = slot_buffer(x.device, (self.groups + 1) // 2, m, HIDDEN)
        x_desc = TensorDescriptor(x, [m, HIDDEN], [x.stride(0), 1], [m_pad, cfg.bk])
        wgu_desc = TensorDescriptor(wgu, [2 * INTER, HIDDEN], [HIDDEN, 1], [cfg.gbn, cfg.bk])
        wd_desc = TensorDescriptor(wd, [HIDDEN, INTER], [INTER, 1], [cfg.dbn, cfg.bk])
        h_desc = TensorDescriptor(self.h, [m, INTER], [INTER, 1], [m_pad, cfg.bk])
        pdl = pdl_enabled()
        _persistent_mlp_kernel[(self.nprog,)](
            x_desc, wgu_desc, wd_desc, h_desc, self.h, slots, self.sched, self.gctr, self.done,
            m, self.h.stride(0), slots.stride(0), slots.stride(1),
            INTER_N=INTER, H=HIDDEN, M_PAD=m_pad, GBN=cfg.gbn, DBN=cfg.dbn, BK=cfg.bk, GC=cfg.gc,
            MAXI=self.maxi, NPROG=self.nprog, GROUPS=self.groups, G_PAD=self.gctr.numel(),
            GU_STAGES=cfg.gu_stages, DN_STAGES=cfg.dn_stages, PDL=pdl,
            num_warps=cfg.num_warps, **pdl_launch(pdl))
        return SplitSums(slots, x.dtype)


# ---- v2: one pipelined stream of chunks per program (Gluon) ---------------------------------
#
# Call 1 measured v1 (above) at 57-80 us a layer against the engine's 44: each item's loop
# fills its pipeline anew, so a program's memory pipe drains ~8 times a layer. v2 keeps one
# ring of shared-memory slots per program across all its items: the weights of a layer are
# re-laid out as [64, 128] tiles (a gate_up tile stacks 32 gate rows over the same 32 up rows),
# every chunk is one W tile plus a [16, 128] tile of x or h, and the program walks its chunk
# list (`build_chunks`) with TMA copies STAGES chunks ahead of the MMA. The activation copies go
# out in order, and a down item's h copy only once its group's counter is full; a program
# waits for a counter only when the MMA has caught up with that copy, i.e. once all its own
# gate_up tiles are written (no deadlock). The W copies of the first STAGES chunks go out
# before the PDL wait (W is no kernel's output).

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
except ImportError:  # pragma: no cover
    gluon = None

TILE_N = 64
#: chunk-table rows: 0 W tile index, 1 activation column, 2 flags (kind | first << 1 | last << 2), 3 unit


def tile_weights(wgu: Tensor, wd: Tensor, half: int = 32, tile_k: int = 128) -> Tensor:
    """W of gate_up and down as [tiles * 64, 128]: gate_up unit r, chunk k is tile r * KG + k
    (32 gate rows over the same 32 up rows); down (row tile rt, chunk kc) is tile
    GU + rt * KD + kc, where GU = (I / 32) * (H / 128), KG = H / 128, KD = I / 128."""
    inter, hidden = wgu.shape[0] // 2, wgu.shape[1]
    kg, kd = hidden // tile_k, inter // tile_k
    gate = wgu[:inter].reshape(inter // half, half, kg, tile_k).permute(0, 2, 1, 3)
    up = wgu[inter:].reshape(inter // half, half, kg, tile_k).permute(0, 2, 1, 3)
    gu = torch.cat([gate, up], dim=2).reshape(-1, tile_k)
    dn = wd.reshape(hidden // TILE_N, TILE_N, kd, tile_k).permute(0, 2, 1, 3).reshape(-1, tile_k)
    return torch.cat([gu, dn]).contiguous()


def build_chunks(nprog: int, cfg: MlpConfig, hidden: int = HIDDEN, inter: int = INTER
                 ) -> tuple[Tensor, Tensor]:
    """Each program's chunks in order ([nprog, 4, MAXC] int32, rows as the chunk table's
    comment says) and their counts, from `build_schedule`'s items (cfg.gbn must be 32)."""
    assert cfg.gbn == 32 and cfg.dbn == TILE_N
    lists, _ = build_schedule(nprog, cfg, hidden, inter)
    gu_units, row_tiles = inter // cfg.gbn, hidden // cfg.dbn
    bk = cfg.bk
    kg, kd = hidden // bk, inter // bk
    per_prog: list[list[tuple[int, int, int, int]]] = []
    for items in lists:
        chunks: list[tuple[int, int, int, int]] = []
        for it in items:
            if it < gu_units:
                for k in range(kg):
                    chunks.append((it * kg + k, k * bk,
                                   0 | (k == 0) << 1 | (k == kg - 1) << 2, it))
            else:
                d = it - gu_units
                g, rt = divmod(d, row_tiles)
                for j in range(cfg.gc):
                    kc = g * cfg.gc + j
                    chunks.append((gu_units * kg + rt * kd + kc, kc * bk,
                                   1 | (j == 0) << 1 | (j == cfg.gc - 1) << 2, d))
        per_prog.append(chunks)
    maxc = triton.next_power_of_2(max(map(len, per_prog)))
    table = torch.zeros(nprog, 4, maxc, dtype=torch.int32)
    for p, chunks in enumerate(per_prog):
        if chunks:
            table[p, :, :len(chunks)] = torch.tensor(chunks, dtype=torch.int32).T
    return table, torch.tensor([len(c) for c in per_prog], dtype=torch.int32)


if gluon is not None:

    @gluon.jit
    def _g_fence_proxy_async():
        gl.inline_asm_elementwise("fence.proxy.async.global; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _g_fence_acq_rel():
        gl.inline_asm_elementwise("fence.acq_rel.gpu; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _g_launch_dependents():
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _g_grid_wait():
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _issue_w(w_desc, tab, c, w_ring, bars, STAGES: gl.constexpr, MAXC: gl.constexpr,
                 ACT_BYTES: gl.constexpr):
        """Chunk c's W tile into its slot (the slot's barrier expects W and the act tile)."""
        s = c % STAGES
        bar = bars.index(s)
        mbarrier.expect(bar, w_desc.block_type.nbytes + ACT_BYTES)
        tile = gl.load(tab + 0 * MAXC + c)
        tma.async_copy_global_to_shared(w_desc, [tile * 64, 0], bar, w_ring.index(s))

    @gluon.jit
    def _issue_act(x_desc, h_desc, tab, c, a_ring, bars, STAGES: gl.constexpr,
                   MAXC: gl.constexpr):
        """Chunk c's tile of x (gate_up) or of h (down) into its slot."""
        s = c % STAGES
        bar = bars.index(s)
        col = gl.load(tab + 1 * MAXC + c)
        if (gl.load(tab + 2 * MAXC + c) & 1) == 0:
            tma.async_copy_global_to_shared(x_desc, [0, col], bar, a_ring.index(s))
        else:
            tma.async_copy_global_to_shared(h_desc, [0, col], bar, a_ring.index(s))

    @gluon.jit
    def _group_ready(tab, c, gctr_ptr, MAXC: gl.constexpr, ROW_TILES: gl.constexpr,
                     TPG: gl.constexpr, SKIP: gl.constexpr):
        """Whether chunk c may read its activation: not the first chunk of a down item, or
        its group's gate_up tiles are all written (then acquire them for the TMA copy).
        SKIP (timing only, wrong results): 1 no fences, 8 no check at all."""
        flags = gl.load(tab + 2 * MAXC + c)
        ok = flags >= 0  # (a tensor: the branch may change it)
        if ((flags & 3) == 3) & ((SKIP & 8) == 0):
            g = gl.load(tab + 3 * MAXC + c) // ROW_TILES
            # NOTE: one thread's atomic read, broadcast to all: a per-thread load could differ
            # between warps while the counter moves, and the branches below hold CTA barriers
            # (call 3-5's hangs)
            ok = gl.atomic_add(gctr_ptr + g, 0, sem="acquire", scope="gpu") >= TPG
            if ok & ((SKIP & 1) == 0):
                _g_fence_acq_rel()
                _g_fence_proxy_async()
        return ok

    @gluon.jit
    def _advance(x_desc, h_desc, tab, pend, limit, a_ring, bars, gctr_ptr,
                 STAGES: gl.constexpr, MAXC: gl.constexpr, ROW_TILES: gl.constexpr,
                 TPG: gl.constexpr, SKIP: gl.constexpr):
        """Issue the activation copies of chunks pend.. (up to limit) in order, stopping at a
        down item whose group is not ready; returns the first chunk not issued.
        NOTE: never waits: a program that waited here could hold back its own gate_up tiles,
        which the group may need (a deadlock)."""
        go = pend >= 0  # (a tensor: the loop changes it)
        while go & (pend < limit):
            if _group_ready(tab, pend, gctr_ptr, MAXC, ROW_TILES, TPG, SKIP):
                _issue_act(x_desc, h_desc, tab, pend, a_ring, bars, STAGES, MAXC)
                pend += 1
            else:
                go = pend < 0
        return pend

    @gluon.jit
    def _mlp_stream_kernel(w_desc, x_desc, h_desc, h_ptr, slots_ptr, tab_ptr, count_ptr,
                           gctr_ptr, done_ptr, dbg_ptr, M, stride_hm, stride_ss, stride_sm,
                           MAXC: gl.constexpr, M_PAD: gl.constexpr, HALF: gl.constexpr,
                           ROW_TILES: gl.constexpr, TPG: gl.constexpr, GK: gl.constexpr,
                           NPROG: gl.constexpr, GROUPS: gl.constexpr, G_PAD: gl.constexpr,
                           STAGES: gl.constexpr, PDL: gl.constexpr, SPIN_LIMIT: gl.constexpr,
                           SKIP: gl.constexpr):
        if PDL:
            _g_launch_dependents()
        pid = gl.program_id(0)
        tab = tab_ptr + pid * 4 * MAXC
        n = gl.load(count_ptr + pid)
        dtype: gl.constexpr = w_desc.dtype
        ACT_BYTES: gl.constexpr = x_desc.block_type.nbytes
        BK: gl.constexpr = w_desc.block_type.shape[1]
        w_ring = gl.allocate_shared_memory(dtype, [STAGES, 64, BK], w_desc.layout)
        a_ring = gl.allocate_shared_memory(dtype, [STAGES, M_PAD, BK], x_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        # NOTE: W is no kernel's output: the first STAGES tiles go out before the PDL wait
        for i in gl.static_range(STAGES):
            if i < n:
                _issue_w(w_desc, tab, i, w_ring, bars, STAGES, MAXC, ACT_BYTES)
        if PDL:
            _g_grid_wait()
        pend = _advance(x_desc, h_desc, tab, n * 0, gl.minimum(n, STAGES), a_ring, bars, gctr_ptr,
                        STAGES, MAXC, ROW_TILES, TPG, SKIP)
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, M_PAD, 16])
        acc = gl.zeros([64, M_PAD], gl.float32, acc_layout)
        epi_layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
        epi = gl.allocate_shared_memory(gl.float32, [64, M_PAD],
                                        gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        rows_e = gl.arange(0, HALF, layout=gl.SliceLayout(1, epi_layout))
        cols_e = gl.arange(0, M_PAD, layout=gl.SliceLayout(0, epi_layout))
        rows_a = gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
        cols_a = gl.arange(0, M_PAD, layout=gl.SliceLayout(0, acc_layout))
        for c in range(n):
            s = c % STAGES
            if pend == c:
                # NOTE: every chunk before c is done, this program's gate_up tiles with them,
                # so waiting for other programs' tiles cannot deadlock
                spins = c * 0
                while (not _group_ready(tab, c, gctr_ptr, MAXC, ROW_TILES, TPG, SKIP)) & (spins < SPIN_LIMIT):
                    spins += 1
                if spins >= SPIN_LIMIT:  # DEBUG: record and go on
                    g_dbg = gl.load(tab + 3 * MAXC + c) // ROW_TILES
                    gl.store(dbg_ptr + pid * 4, c + 1)
                    gl.store(dbg_ptr + pid * 4 + 1, g_dbg)
                    gl.store(dbg_ptr + pid * 4 + 2, gl.load(gctr_ptr + g_dbg, volatile=True))
                    gl.store(dbg_ptr + pid * 4 + 3, n)
                _issue_act(x_desc, h_desc, tab, c, a_ring, bars, STAGES, MAXC)
                pend = c + 1
            mbarrier.wait(bars.index(s), (c // STAGES) & 1)
            flags = gl.load(tab + 2 * MAXC + c)
            acc = warpgroup_mma(w_ring.index(s), a_ring.index(s).permute((1, 0)), acc,
                                use_acc=(flags & 2) == 0)
            nc = c + STAGES
            if nc < n:
                _issue_w(w_desc, tab, nc, w_ring, bars, STAGES, MAXC, ACT_BYTES)
            pend = _advance(x_desc, h_desc, tab, pend, gl.minimum(n, nc + 1), a_ring, bars,
                            gctr_ptr, STAGES, MAXC, ROW_TILES, TPG, SKIP)
            if (flags & 4) != 0:
                unit = gl.load(tab + 3 * MAXC + c)
                if (flags & 1) == 0:
                    # gate_up unit: rows 0..31 gate, 32..63 up -> h[:, unit*32 : +32]
                    epi.store(acc)
                    gl.thread_barrier()
                    gate = epi.slice(0, HALF).load(epi_layout)
                    up = epi.slice(HALF, HALF).load(epi_layout)
                    gl.thread_barrier()
                    hv = silu_mul(gate.to(dtype), up.to(dtype))
                    h_ptrs = h_ptr + cols_e[None, :] * stride_hm + (unit * HALF + rows_e)[:, None]
                    gl.store(h_ptrs, hv, mask=(cols_e < M)[None, :])
                    if (SKIP & 2) == 0:
                        _g_fence_proxy_async()
                    gl.thread_barrier()
                    gl.atomic_add(gctr_ptr + unit * HALF // GK, 1, sem="release", scope="gpu")
                else:
                    g = unit // ROW_TILES
                    rt = unit % ROW_TILES
                    s_ptrs = (slots_ptr + (g // 2) * stride_ss + cols_a[None, :] * stride_sm
                              + (rt * 64 + rows_a)[:, None])
                    if (SKIP & 4) == 0:
                        gl.atomic_add(s_ptrs, acc, mask=(cols_a < M)[None, :], sem="relaxed",
                                      scope="gpu")
                    else:
                        gl.store(s_ptrs, acc, mask=(cols_a < M)[None, :])
        gl.thread_barrier()
        last = gl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu")
        if last == NPROG - 1:
            zl: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
            offs_g = gl.arange(0, G_PAD, layout=zl)
            gl.store(gctr_ptr + offs_g, gl.zeros([G_PAD], gl.int32, zl), mask=offs_g < GROUPS)
            gl.store(done_ptr, 0)




    # ---- v3: v2 with a producer warp (warp specialisation) ------------------------------------
    #
    # Call 7: v2's single warpgroup issues, waits, multiplies and runs every epilogue in turn,
    # so each chunk's bookkeeping and each item's group check (an atomic round trip and two
    # fences) leave the memory pipe idle: 62 us a layer (45 with BK 256 and the checks,
    # fences and atomics removed). Here one producer warp only issues copies into the ring
    # (waiting on an `empty` barrier per slot, and on group counters, polled all at once and
    # remembered as a bitmask), and the warpgroup only waits, multiplies and writes results.
    # A producer waiting on a group cannot deadlock: the warpgroup goes on with the chunks
    # already issued, this program's gate_up tiles among them.

    @gluon.jit
    def _ws_producer(w_desc, x_desc, h_desc, tab, n, w_ring, a_ring, full, empty, gctr_ptr,
                     MAXC: gl.constexpr, ROW_TILES: gl.constexpr, TPG: gl.constexpr,
                     GROUPS: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr,
                     SKIP: gl.constexpr):
        ACT_BYTES: gl.constexpr = x_desc.block_type.nbytes
        W_BYTES: gl.constexpr = w_desc.block_type.nbytes
        # NOTE: W is no kernel's output: the first STAGES tiles go out before the PDL wait
        for i in gl.static_range(STAGES):
            if i < n:
                mbarrier.expect(full.index(i), W_BYTES + ACT_BYTES)
                tma.async_copy_global_to_shared(w_desc, [gl.load(tab + i) * 64, 0],
                                                full.index(i), w_ring.index(i))
        if PDL:
            _g_grid_wait()
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        offs_g = gl.arange(0, 32, layout=lay)
        known = n * 0  # bitmask of the groups seen complete
        if (SKIP & 8) != 0:  # timing only: every group taken as complete (races)
            known = known - 1
        for c in range(n):
            s = c % STAGES
            if c >= STAGES:
                mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
                mbarrier.expect(full.index(s), W_BYTES + ACT_BYTES)
                tma.async_copy_global_to_shared(w_desc, [gl.load(tab + c) * 64, 0],
                                                full.index(s), w_ring.index(s))
            flags = gl.load(tab + 2 * MAXC + c)
            col = gl.load(tab + 1 * MAXC + c)
            if (flags & 1) == 0:
                tma.async_copy_global_to_shared(x_desc, [0, col], full.index(s), a_ring.index(s))
            else:
                if (flags & 2) != 0:
                    g = gl.load(tab + 3 * MAXC + c) // ROW_TILES
                    if ((known >> g) & 1) == 0:
                        while ((known >> g) & 1) == 0:
                            cnt = gl.load(gctr_ptr + offs_g, mask=offs_g < GROUPS, other=0,
                                          volatile=True)
                            known = gl.sum(gl.where(cnt >= TPG, 1 << offs_g, 0), 0)
                        _g_fence_acq_rel()
                        _g_fence_proxy_async()
                tma.async_copy_global_to_shared(h_desc, [0, col], full.index(s), a_ring.index(s))

    @gluon.jit
    def _ws_consumer(tab, n, w_ring, a_ring, full, empty, epi, h_ptr, slots_ptr, gctr_ptr, M,
                     stride_hm, stride_ss, stride_sm, MAXC: gl.constexpr, M_PAD: gl.constexpr,
                     HALF: gl.constexpr, ROW_TILES: gl.constexpr, GK: gl.constexpr,
                     STAGES: gl.constexpr, PDL: gl.constexpr):
        if PDL:
            _g_grid_wait()  # (the slots it adds into are zeroed by the kernel before)
        dtype: gl.constexpr = w_ring.dtype
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, M_PAD, 16])
        acc = gl.zeros([64, M_PAD], gl.float32, acc_layout)
        epi_layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
        rows_e = gl.arange(0, HALF, layout=gl.SliceLayout(1, epi_layout))
        cols_e = gl.arange(0, M_PAD, layout=gl.SliceLayout(0, epi_layout))
        rows_a = gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
        cols_a = gl.arange(0, M_PAD, layout=gl.SliceLayout(0, acc_layout))
        for c in range(n):
            s = c % STAGES
            mbarrier.wait(full.index(s), (c // STAGES) & 1)
            flags = gl.load(tab + 2 * MAXC + c)
            acc = warpgroup_mma(w_ring.index(s), a_ring.index(s).permute((1, 0)), acc,
                                use_acc=(flags & 2) == 0)
            gl.thread_barrier()  # every warp's MMA has read the slot
            mbarrier.arrive(empty.index(s))
            if (flags & 4) != 0:
                unit = gl.load(tab + 3 * MAXC + c)
                if (flags & 1) == 0:
                    epi.store(acc)
                    gl.thread_barrier()
                    gate = epi.slice(0, HALF).load(epi_layout)
                    up = epi.slice(HALF, HALF).load(epi_layout)
                    gl.thread_barrier()
                    hv = silu_mul(gate.to(dtype), up.to(dtype))
                    h_ptrs = h_ptr + cols_e[None, :] * stride_hm + (unit * HALF + rows_e)[:, None]
                    gl.store(h_ptrs, hv, mask=(cols_e < M)[None, :])
                    _g_fence_proxy_async()
                    gl.thread_barrier()
                    gl.atomic_add(gctr_ptr + unit * HALF // GK, 1, sem="release", scope="gpu")
                else:
                    g = unit // ROW_TILES
                    rt = unit % ROW_TILES
                    s_ptrs = (slots_ptr + (g // 2) * stride_ss + cols_a[None, :] * stride_sm
                              + (rt * 64 + rows_a)[:, None])
                    gl.atomic_add(s_ptrs, acc, mask=(cols_a < M)[None, :], sem="relaxed",
                                  scope="gpu")

    @gluon.jit
    def _mlp_ws_kernel(w_desc, x_desc, h_desc, h_ptr, slots_ptr, tab_ptr, count_ptr, gctr_ptr,
                       done_ptr, M, stride_hm, stride_ss, stride_sm,
                       MAXC: gl.constexpr, M_PAD: gl.constexpr, HALF: gl.constexpr,
                       ROW_TILES: gl.constexpr, TPG: gl.constexpr, GK: gl.constexpr,
                       NPROG: gl.constexpr, GROUPS: gl.constexpr, G_PAD: gl.constexpr,
                       STAGES: gl.constexpr, PDL: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                       SKIP: gl.constexpr = 0):
        if PDL:
            _g_launch_dependents()
        pid = gl.program_id(0)
        tab = tab_ptr + pid * 4 * MAXC
        n = gl.load(count_ptr + pid)
        dtype: gl.constexpr = w_desc.dtype
        BK: gl.constexpr = w_desc.block_type.shape[1]
        w_ring = gl.allocate_shared_memory(dtype, [STAGES, 64, BK], w_desc.layout)
        a_ring = gl.allocate_shared_memory(dtype, [STAGES, M_PAD, BK], x_desc.layout)
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        epi = gl.allocate_shared_memory(gl.float32, [64, M_PAD],
                                        gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        for i in gl.static_range(STAGES):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()
        gl.thread_barrier()
        gl.warp_specialize([
            (_ws_consumer, (tab, n, w_ring, a_ring, full, empty, epi, h_ptr, slots_ptr, gctr_ptr,
                            M, stride_hm, stride_ss, stride_sm, MAXC, M_PAD, HALF, ROW_TILES,
                            GK, STAGES, PDL)),
            (_ws_producer, (w_desc, x_desc, h_desc, tab, n, w_ring, a_ring, full, empty,
                            gctr_ptr, MAXC, ROW_TILES, TPG, GROUPS, STAGES, PDL, SKIP)),
        ], [1], [PRODUCER_REGS])
        gl.thread_barrier()
        last = gl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu")
        if last == NPROG - 1:
            zl: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
            offs_g = gl.arange(0, G_PAD, layout=zl)
            gl.store(gctr_ptr + offs_g, gl.zeros([G_PAD], gl.int32, zl), mask=offs_g < GROUPS)
            gl.store(done_ptr, 0)


    # ---- v4: v3 across layers, with the real dependencies --------------------------------------
    #
    # Call 12: v3 streaming all 36 layers' MLP weights in one launch drew 4.04 TB/s (37 us a
    # layer) against 44 us launched per layer. v4 asks whether that survives the dependencies:
    # layer l + 1's gate_up reads x_{l+1} = rms_norm(residual + y_l), which needs all of layer
    # l's down items. Each down item adds into y (fp32, [2, M, H] by layer parity: atomics in
    # any order, so not bit-reproducible) and counts itself; the program whose item completes a
    # layer runs the residual add + RMSNorm (HF's roundings) and publishes x_{l+1}. Counters are
    # cumulative (group g of layer l is complete at TPG * (l + 1)). The producer copies W ahead
    # regardless and holds back only the activation copies, so the ring fills with the next
    # layer's weights while the norm runs.

    @gluon.jit
    def _v4_ready(tab, d, gctr_ptr, xready_ptr, known, known_layer, xr, MAXC: gl.constexpr,
                  ROW_TILES: gl.constexpr, TPG: gl.constexpr, GROUPS: gl.constexpr):
        """Whether chunk d's activation may be copied, from what is known (polled once more if
        not): (ok, known, known_layer, xr). A successful poll is followed by the acquire and
        proxy fences."""
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        offs_g = gl.arange(0, 32, layout=lay)
        flags = gl.load(tab + 2 * MAXC + d)
        layer = flags >> 3
        ok = flags >= 0
        if (flags & 1) == 0:
            if xr < layer:
                xr = gl.load(xready_ptr, volatile=True)
                ok = xr >= layer
                if ok:
                    _g_fence_acq_rel()
                    _g_fence_proxy_async()
        elif (flags & 2) != 0:
            g = gl.load(tab + 3 * MAXC + d) // ROW_TILES
            if known_layer != layer:
                known = known * 0
                known_layer = layer
            if ((known >> g) & 1) == 0:
                cnt = gl.load(gctr_ptr + offs_g, mask=offs_g < GROUPS, other=0, volatile=True)
                known = gl.sum(gl.where(cnt >= TPG * (layer + 1), 1 << offs_g, 0), 0)
                ok = ((known >> g) & 1) != 0
                if ok:
                    _g_fence_acq_rel()
                    _g_fence_proxy_async()
        return ok, known, known_layer, xr

    @gluon.jit
    def _v4_issue_act(xs_desc, h_desc, tab, d, a_ring, full, MAXC: gl.constexpr,
                      STAGES: gl.constexpr, M_ROWS: gl.constexpr):
        s = d % STAGES
        flags = gl.load(tab + 2 * MAXC + d)
        col = gl.load(tab + 1 * MAXC + d)
        if (flags & 1) == 0:
            tma.async_copy_global_to_shared(xs_desc, [(flags >> 3) * M_ROWS, col], full.index(s),
                                            a_ring.index(s))
        else:
            tma.async_copy_global_to_shared(h_desc, [0, col], full.index(s), a_ring.index(s))

    @gluon.jit
    def _v4_producer(w_desc, xs_desc, h_desc, tab, n, w_ring, a_ring, full, empty, gctr_ptr,
                     xready_ptr, MAXC: gl.constexpr, ROW_TILES: gl.constexpr, TPG: gl.constexpr,
                     GROUPS: gl.constexpr, STAGES: gl.constexpr, M_ROWS: gl.constexpr,
                     PDL: gl.constexpr):
        W_BYTES: gl.constexpr = w_desc.block_type.nbytes
        ACT_BYTES: gl.constexpr = xs_desc.block_type.nbytes
        for i in gl.static_range(STAGES):
            if i < n:
                mbarrier.expect(full.index(i), W_BYTES + ACT_BYTES)
                tma.async_copy_global_to_shared(w_desc, [gl.load(tab + i) * 64, 0],
                                                full.index(i), w_ring.index(i))
        if PDL:
            _g_grid_wait()
        pend = n * 0  # the first chunk whose activation copy is not issued
        known = n * 0
        known_layer = n * 0 - 1
        xr = n * 0
        for c in range(n):
            s = c % STAGES
            if c >= STAGES:
                # the warpgroup frees slot s only once chunk c - STAGES is in: wait for it here
                while pend <= c - STAGES:
                    ok, known, known_layer, xr = _v4_ready(
                        tab, pend, gctr_ptr, xready_ptr, known, known_layer, xr, MAXC,
                        ROW_TILES, TPG, GROUPS)
                    if ok:
                        _v4_issue_act(xs_desc, h_desc, tab, pend, a_ring, full, MAXC, STAGES,
                                      M_ROWS)
                        pend += 1
                mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
                mbarrier.expect(full.index(s), W_BYTES + ACT_BYTES)
                tma.async_copy_global_to_shared(w_desc, [gl.load(tab + c) * 64, 0],
                                                full.index(s), w_ring.index(s))
            go = pend >= 0
            while go & (pend <= c):
                ok, known, known_layer, xr = _v4_ready(
                    tab, pend, gctr_ptr, xready_ptr, known, known_layer, xr, MAXC, ROW_TILES,
                    TPG, GROUPS)
                if ok:
                    _v4_issue_act(xs_desc, h_desc, tab, pend, a_ring, full, MAXC, STAGES, M_ROWS)
                    pend += 1
                else:
                    go = pend < 0
        while pend < n:
            ok, known, known_layer, xr = _v4_ready(
                tab, pend, gctr_ptr, xready_ptr, known, known_layer, xr, MAXC, ROW_TILES, TPG,
                GROUPS)
            if ok:
                _v4_issue_act(xs_desc, h_desc, tab, pend, a_ring, full, MAXC, STAGES, M_ROWS)
                pend += 1

    @gluon.jit
    def _v4_norm(layer, y_ptr, res_ptr, nw_ptr, xs_ptr, M, eps, H: gl.constexpr,
                 M_ROWS: gl.constexpr):
        """Rows 0..M-1: r = residual + y (rounded), residual = r, x_{layer+1} =
        rms_norm(r) * w (HF's roundings), y zeroed for layer + 2."""
        dtype: gl.constexpr = res_ptr.dtype.element_ty
        lay: gl.constexpr = gl.BlockedLayout([4], [32], [4], [0])
        CH: gl.constexpr = 512
        offs = gl.arange(0, CH, layout=lay)
        y_row0 = y_ptr + (layer % 2) * M_ROWS * H
        for m in range(M):
            sq = gl.zeros([CH], gl.float32, lay)
            for k0 in gl.static_range(0, H, CH):
                yv = gl.load(y_row0 + m * H + k0 + offs)
                rv = gl.load(res_ptr + m * H + k0 + offs)
                r = (yv.to(dtype).to(gl.float32) + rv.to(gl.float32)).to(dtype)
                gl.store(res_ptr + m * H + k0 + offs, r)
                gl.store(y_row0 + m * H + k0 + offs, gl.zeros([CH], gl.float32, lay))
                rf = r.to(gl.float32)
                sq += rf * rf
            zero = gl.zeros([CH], gl.float32, lay)  # (div_rn / sqrt_rn take fp32 tensors)
            inv = gl.div_rn(zero + 1.0, gl.sqrt_rn(gl.div_rn(zero + gl.sum(sq, 0), zero + H)
                                                   + eps))
            for k0 in gl.static_range(0, H, CH):
                rf = gl.load(res_ptr + m * H + k0 + offs).to(gl.float32)
                w = gl.load(nw_ptr + layer * H + k0 + offs).to(gl.float32)
                xn = ((rf * inv).to(dtype).to(gl.float32) * w).to(dtype)
                gl.store(xs_ptr + ((layer + 1) * M_ROWS + m) * H + k0 + offs, xn)

    @gluon.jit
    def _v4_consumer(tab, n, w_ring, a_ring, full, empty, epi, h_ptr, y_ptr, res_ptr, nw_ptr,
                     xs_ptr, gctr_ptr, dctr_ptr, xready_ptr, M, stride_hm, eps,
                     MAXC: gl.constexpr, M_PAD: gl.constexpr, HALF: gl.constexpr,
                     ROW_TILES: gl.constexpr, GK: gl.constexpr, H: gl.constexpr,
                     DOWN_ITEMS: gl.constexpr, M_ROWS: gl.constexpr, STAGES: gl.constexpr,
                     PDL: gl.constexpr):
        if PDL:
            _g_grid_wait()
        dtype: gl.constexpr = w_ring.dtype
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, M_PAD, 16])
        acc = gl.zeros([64, M_PAD], gl.float32, acc_layout)
        epi_layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
        rows_e = gl.arange(0, HALF, layout=gl.SliceLayout(1, epi_layout))
        cols_e = gl.arange(0, M_PAD, layout=gl.SliceLayout(0, epi_layout))
        rows_a = gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
        cols_a = gl.arange(0, M_PAD, layout=gl.SliceLayout(0, acc_layout))
        for c in range(n):
            s = c % STAGES
            mbarrier.wait(full.index(s), (c // STAGES) & 1)
            flags = gl.load(tab + 2 * MAXC + c)
            acc = warpgroup_mma(w_ring.index(s), a_ring.index(s).permute((1, 0)), acc,
                                use_acc=(flags & 2) == 0)
            gl.thread_barrier()
            mbarrier.arrive(empty.index(s))
            if (flags & 4) != 0:
                unit = gl.load(tab + 3 * MAXC + c)
                layer = flags >> 3
                if (flags & 1) == 0:
                    epi.store(acc)
                    gl.thread_barrier()
                    gate = epi.slice(0, HALF).load(epi_layout)
                    up = epi.slice(HALF, HALF).load(epi_layout)
                    gl.thread_barrier()
                    hv = silu_mul(gate.to(dtype), up.to(dtype))
                    h_ptrs = h_ptr + cols_e[None, :] * stride_hm + (unit * HALF + rows_e)[:, None]
                    gl.store(h_ptrs, hv, mask=(cols_e < M)[None, :])
                    _g_fence_proxy_async()
                    gl.thread_barrier()
                    gl.atomic_add(gctr_ptr + unit * HALF // GK, 1, sem="release", scope="gpu")
                else:
                    rt = unit % ROW_TILES
                    y_ptrs = (y_ptr + (layer % 2) * M_ROWS * H + cols_a[None, :] * H
                              + (rt * 64 + rows_a)[:, None])
                    gl.atomic_add(y_ptrs, acc, mask=(cols_a < M)[None, :], sem="relaxed",
                                  scope="gpu")
                    gl.thread_barrier()
                    prev = gl.atomic_add(dctr_ptr, 1, sem="acq_rel", scope="gpu")
                    if prev == DOWN_ITEMS * (layer + 1) - 1:
                        _v4_norm(layer, y_ptr, res_ptr, nw_ptr, xs_ptr, M, eps, H, M_ROWS)
                        _g_fence_proxy_async()
                        gl.thread_barrier()
                        gl.atomic_add(xready_ptr, 1, sem="release", scope="gpu")

    @gluon.jit
    def _mlp_cross_kernel(w_desc, xs_desc, h_desc, h_ptr, y_ptr, res_ptr, nw_ptr, xs_ptr,
                          tab_ptr, count_ptr, gctr_ptr, dctr_ptr, xready_ptr, done_ptr, M,
                          stride_hm, eps, MAXC: gl.constexpr, M_PAD: gl.constexpr,
                          HALF: gl.constexpr, ROW_TILES: gl.constexpr, TPG: gl.constexpr,
                          GK: gl.constexpr, H: gl.constexpr, DOWN_ITEMS: gl.constexpr,
                          M_ROWS: gl.constexpr, NPROG: gl.constexpr, GROUPS: gl.constexpr,
                          G_PAD: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr):
        if PDL:
            _g_launch_dependents()
        pid = gl.program_id(0)
        tab = tab_ptr + pid * 4 * MAXC
        n = gl.load(count_ptr + pid)
        dtype: gl.constexpr = w_desc.dtype
        BK: gl.constexpr = w_desc.block_type.shape[1]
        w_ring = gl.allocate_shared_memory(dtype, [STAGES, 64, BK], w_desc.layout)
        a_ring = gl.allocate_shared_memory(dtype, [STAGES, M_PAD, BK], xs_desc.layout)
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        epi = gl.allocate_shared_memory(gl.float32, [64, M_PAD],
                                        gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        for i in gl.static_range(STAGES):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()
        gl.thread_barrier()
        gl.warp_specialize([
            (_v4_consumer, (tab, n, w_ring, a_ring, full, empty, epi, h_ptr, y_ptr, res_ptr,
                            nw_ptr, xs_ptr, gctr_ptr, dctr_ptr, xready_ptr, M, stride_hm, eps,
                            MAXC, M_PAD, HALF, ROW_TILES, GK, H, DOWN_ITEMS, M_ROWS, STAGES,
                            PDL)),
            (_v4_producer, (w_desc, xs_desc, h_desc, tab, n, w_ring, a_ring, full, empty,
                            gctr_ptr, xready_ptr, MAXC, ROW_TILES, TPG, GROUPS, STAGES, M_ROWS,
                            PDL)),
        ], [1], [40])
        gl.thread_barrier()
        last = gl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu")
        if last == NPROG - 1:
            zl: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
            offs_g = gl.arange(0, G_PAD, layout=zl)
            gl.store(gctr_ptr + offs_g, gl.zeros([G_PAD], gl.int32, zl), mask=offs_g < GROUPS)
            gl.store(dctr_ptr, 0)
            gl.store(xready_ptr, 0)
            gl.store(done_ptr, 0)


class CrossMlp:
    """v4: `layers` MLPs and their norms in one launch. Call with x0 [M, H]; the residual
    stream starts at zero (as `bench`'s chain); returns x_L (the last norm's output)."""

    def __init__(self, m: int, cfg: MlpConfig, nws: list[Tensor], wts: list[Tensor],
                 nprog: int, stages: int = 4) -> None:
        assert cfg.gbn == 32 and m <= 8
        dev, dt = wts[0].device, wts[0].dtype
        self.m, self.cfg, self.nprog, self.stages = m, cfg, nprog, stages
        self.layers = len(wts)
        self.groups = INTER // (cfg.gc * cfg.bk)
        assert self.groups <= 31
        table, counts = build_chunks(nprog, cfg)
        tiles = wts[0].shape[0] // TILE_N
        big = torch.zeros(nprog, 4, triton.next_power_of_2(int(counts.max()) * self.layers),
                          dtype=torch.int32)
        for p in range(nprog):
            k = int(counts[p])
            parts = []
            for layer in range(self.layers):
                t = table[p, :, :k].clone()
                t[0] += layer * tiles
                t[2] |= layer << 3
                parts.append(t)
            big[p, :, :k * self.layers] = torch.cat(parts, dim=1)
        self.table, self.counts = big.to(dev), (counts * self.layers).to(dev)
        self.maxc = big.shape[-1]
        self.w = torch.cat(wts)
        self.nw = torch.stack(nws)
        self.h = torch.zeros(m, INTER, dtype=dt, device=dev)
        self.y = torch.zeros(2, 8, HIDDEN, dtype=torch.float32, device=dev)
        self.res = torch.zeros(8, HIDDEN, dtype=dt, device=dev)
        self.xs = torch.zeros((self.layers + 1) * 8, HIDDEN, dtype=dt, device=dev)
        self.gctr = torch.zeros(32, dtype=torch.int32, device=dev)
        self.dctr = torch.zeros(1, dtype=torch.int32, device=dev)
        self.xready = torch.zeros(1, dtype=torch.int32, device=dev)
        self.done = torch.zeros(1, dtype=torch.int32, device=dev)
        bk = cfg.bk
        lay_w = gl.NVMMASharedLayout.get_default_for([TILE_N, bk], gl.bfloat16)
        lay_a = gl.NVMMASharedLayout.get_default_for([16, bk], gl.bfloat16)
        self.w_desc = GluonDescriptor(self.w, list(self.w.shape), [bk, 1], [TILE_N, bk], lay_w)
        self.xs_desc = GluonDescriptor(self.xs, list(self.xs.shape), [HIDDEN, 1], [16, bk], lay_a)
        self.h_desc = GluonDescriptor(self.h, [m, INTER], [INTER, 1], [16, bk], lay_a)

    def __call__(self, x0: Tensor) -> Tensor:
        self.xs[:self.m].copy_(x0)
        self.res.zero_()
        cfg = self.cfg
        pdl = pdl_enabled()
        _mlp_cross_kernel[(self.nprog,)](
            self.w_desc, self.xs_desc, self.h_desc, self.h, self.y, self.res, self.nw, self.xs,
            self.table, self.counts, self.gctr, self.dctr, self.xready, self.done, self.m,
            self.h.stride(0), 1e-6, MAXC=self.maxc, M_PAD=16, HALF=32,
            ROW_TILES=HIDDEN // TILE_N, TPG=cfg.gc * cfg.bk // 32, GK=cfg.gc * cfg.bk,
            H=HIDDEN, DOWN_ITEMS=(HIDDEN // TILE_N) * self.groups, M_ROWS=8, NPROG=self.nprog,
            GROUPS=self.groups, G_PAD=32, STAGES=self.stages, PDL=pdl, num_warps=4,
            **pdl_launch(pdl))
        return self.xs[self.layers * 8:self.layers * 8 + self.m]


if gluon is not None:

    # ---- v5: v4 with the handoff spread over the grid --------------------------------------------
    #
    # Call 13: v4's handoff (residual add + norm by the one program that completes a layer)
    # cost ~33 us a layer. v5 spreads it: the down item that completes a 64-column row tile
    # adds the residual for those columns (r = residual + y, HF's rounding) and adds its rows'
    # sums of squares into ssq[layer]; the next layer's gate_up reads r itself (by TMA, once
    # all 40 row tiles are in) and scales its sums by 1 / rms per row in the epilogue, with the
    # norm weight folded into its gate and up weights on the host (W' = W diag(w)).
    # NOTE: so x = rms_norm(r) * w is never rounded to bf16 as HF does: the numbers differ from
    # the engine's by that rounding (timing experiment; an engine version would build x in
    # shared memory instead).

    @gluon.jit
    def _g_prefetch_l2(ptr):
        """cp.async.bulk.prefetch.L2 of one 32 KB W tile (64 x 256 bf16) at ptr, from one lane."""
        gl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 l; mov.u32 l, %laneid; setp.eq.u32 p, l, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], 32768; mov.u32 $0, 0; }",
            "=r,l", [ptr], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _v5_ready(tab, d, gctr_ptr, rdone_ptr, known, known_layer, rr, MAXC: gl.constexpr,
                  ROW_TILES: gl.constexpr, TPG: gl.constexpr, GROUPS: gl.constexpr):
        """v4's `_v4_ready` with the gate_up condition "all row tiles of the layer before are
        in" (rr: the row tiles known done, cumulative)."""
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        offs_g = gl.arange(0, 32, layout=lay)
        flags = gl.load(tab + 2 * MAXC + d)
        layer = flags >> 3
        ok = flags >= 0
        if (flags & 1) == 0:
            if rr < ROW_TILES * layer:
                rr = gl.load(rdone_ptr, volatile=True)
                ok = rr >= ROW_TILES * layer
                if ok:
                    _g_fence_acq_rel()
                    _g_fence_proxy_async()
        elif (flags & 2) != 0:
            g = gl.load(tab + 3 * MAXC + d) // ROW_TILES
            if known_layer != layer:
                known = known * 0
                known_layer = layer
            if ((known >> g) & 1) == 0:
                cnt = gl.load(gctr_ptr + offs_g, mask=offs_g < GROUPS, other=0, volatile=True)
                known = gl.sum(gl.where(cnt >= TPG * (layer + 1), 1 << offs_g, 0), 0)
                ok = ((known >> g) & 1) != 0
                if ok:
                    _g_fence_acq_rel()
                    _g_fence_proxy_async()
        return ok, known, known_layer, rr

    @gluon.jit
    def _v5_issue_act(x0_desc, res_desc, h_desc, tab, d, a_ring, full, MAXC: gl.constexpr,
                      STAGES: gl.constexpr):
        s = d % STAGES
        flags = gl.load(tab + 2 * MAXC + d)
        col = gl.load(tab + 1 * MAXC + d)
        if (flags & 1) == 0:
            if (flags >> 3) == 0:
                tma.async_copy_global_to_shared(x0_desc, [0, col], full.index(s), a_ring.index(s))
            else:
                tma.async_copy_global_to_shared(res_desc, [0, col], full.index(s),
                                                a_ring.index(s))
        else:
            tma.async_copy_global_to_shared(h_desc, [0, col], full.index(s), a_ring.index(s))

    @gluon.jit
    def _v5_producer(w_desc, x0_desc, res_desc, h_desc, tab, n, w_ring, a_ring, full, empty,
                     gctr_ptr, rdone_ptr, w_ptr, MAXC: gl.constexpr, ROW_TILES: gl.constexpr,
                     TPG: gl.constexpr, GROUPS: gl.constexpr, STAGES: gl.constexpr,
                     PDL: gl.constexpr, PREFETCH: gl.constexpr):
        W_BYTES: gl.constexpr = w_desc.block_type.nbytes
        ACT_BYTES: gl.constexpr = h_desc.block_type.nbytes
        for i in gl.static_range(STAGES):
            if i < n:
                mbarrier.expect(full.index(i), W_BYTES + ACT_BYTES)
                tma.async_copy_global_to_shared(w_desc, [gl.load(tab + i) * 64, 0],
                                                full.index(i), w_ring.index(i))
        if PDL:
            _g_grid_wait()
        pend = n * 0
        known = n * 0
        known_layer = n * 0 - 1
        rr = n * 0
        for c in range(n):
            s = c % STAGES
            if c >= STAGES:
                while pend <= c - STAGES:
                    ok, known, known_layer, rr = _v5_ready(
                        tab, pend, gctr_ptr, rdone_ptr, known, known_layer, rr, MAXC,
                        ROW_TILES, TPG, GROUPS)
                    if ok:
                        _v5_issue_act(x0_desc, res_desc, h_desc, tab, pend, a_ring, full, MAXC,
                                      STAGES)
                        pend += 1
                mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)
                mbarrier.expect(full.index(s), W_BYTES + ACT_BYTES)
                tma.async_copy_global_to_shared(w_desc, [gl.load(tab + c) * 64, 0],
                                                full.index(s), w_ring.index(s))
            if PREFETCH > 0:  # noqa: SIM102 (a constexpr test, then a runtime one)
                # W of the chunk PREFETCH past this one into L2 (a hint: a contiguous tile)
                if c + PREFETCH < n:
                    tile_pf = gl.load(tab + c + PREFETCH)
                    _g_prefetch_l2(w_ptr + tile_pf.to(gl.int64) * (W_BYTES // 2))
            go = pend >= 0
            while go & (pend <= c):
                ok, known, known_layer, rr = _v5_ready(
                    tab, pend, gctr_ptr, rdone_ptr, known, known_layer, rr, MAXC, ROW_TILES,
                    TPG, GROUPS)
                if ok:
                    _v5_issue_act(x0_desc, res_desc, h_desc, tab, pend, a_ring, full, MAXC,
                                  STAGES)
                    pend += 1
                else:
                    go = pend < 0
        while pend < n:
            ok, known, known_layer, rr = _v5_ready(
                tab, pend, gctr_ptr, rdone_ptr, known, known_layer, rr, MAXC, ROW_TILES, TPG,
                GROUPS)
            if ok:
                _v5_issue_act(x0_desc, res_desc, h_desc, tab, pend, a_ring, full, MAXC, STAGES)
                pend += 1

    @gluon.jit
    def _v5_consumer(tab, n, w_ring, a_ring, full, empty, epi, h_ptr, y_ptr, res_ptr, ssq_ptr,
                     gctr_ptr, rtc_ptr, rdone_ptr, M, stride_hm, eps, MAXC: gl.constexpr,
                     M_PAD: gl.constexpr, HALF: gl.constexpr, ROW_TILES: gl.constexpr,
                     GK: gl.constexpr, H: gl.constexpr, GROUPS: gl.constexpr,
                     M_ROWS: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr):
        if PDL:
            _g_grid_wait()
        dtype: gl.constexpr = w_ring.dtype
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, M_PAD, 16])
        acc = gl.zeros([64, M_PAD], gl.float32, acc_layout)
        epi_layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
        rows_e = gl.arange(0, HALF, layout=gl.SliceLayout(1, epi_layout))
        cols_e = gl.arange(0, M_PAD, layout=gl.SliceLayout(0, epi_layout))
        rows_a = gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
        cols_a = gl.arange(0, M_PAD, layout=gl.SliceLayout(0, acc_layout))
        # a row tile's handoff: [64 columns, M_PAD rows]
        rt_layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
        rows_r = gl.arange(0, 64, layout=gl.SliceLayout(1, rt_layout))
        cols_r = gl.arange(0, M_PAD, layout=gl.SliceLayout(0, rt_layout))
        mask_r = (cols_r < M)[None, :] & (rows_r >= 0)[:, None]
        for c in range(n):
            s = c % STAGES
            mbarrier.wait(full.index(s), (c // STAGES) & 1)
            flags = gl.load(tab + 2 * MAXC + c)
            acc = warpgroup_mma(w_ring.index(s), a_ring.index(s).permute((1, 0)), acc,
                                use_acc=(flags & 2) == 0)
            gl.thread_barrier()
            mbarrier.arrive(empty.index(s))
            if (flags & 4) != 0:
                unit = gl.load(tab + 3 * MAXC + c)
                layer = flags >> 3
                if (flags & 1) == 0:
                    epi.store(acc)
                    gl.thread_barrier()
                    gate = epi.slice(0, HALF).load(epi_layout)
                    up = epi.slice(HALF, HALF).load(epi_layout)
                    gl.thread_barrier()
                    if layer > 0:  # x = r / rms: scale the sums (the weight is in W)
                        q = gl.atomic_add(ssq_ptr + (layer - 1) * M_ROWS + cols_e,
                                          gl.zeros([M_PAD], gl.float32,
                                                   gl.SliceLayout(0, epi_layout)),
                                          mask=cols_e < M, sem="acquire", scope="gpu")
                        zero = gl.zeros([M_PAD], gl.float32, gl.SliceLayout(0, epi_layout))
                        inv = gl.div_rn(zero + 1.0,
                                        gl.sqrt_rn(gl.div_rn(q, zero + H) + eps))
                        gate = gate * inv[None, :]
                        up = up * inv[None, :]
                    hv = silu_mul(gate.to(dtype), up.to(dtype))
                    h_ptrs = h_ptr + cols_e[None, :] * stride_hm + (unit * HALF + rows_e)[:, None]
                    gl.store(h_ptrs, hv, mask=(cols_e < M)[None, :])
                    _g_fence_proxy_async()
                    gl.thread_barrier()
                    gl.atomic_add(gctr_ptr + unit * HALF // GK, 1, sem="release", scope="gpu")
                else:
                    rt = unit % ROW_TILES
                    y_base = y_ptr + (layer % 2) * M_ROWS * H
                    y_ptrs = y_base + cols_a[None, :] * H + (rt * 64 + rows_a)[:, None]
                    gl.atomic_add(y_ptrs, acc, mask=(cols_a < M)[None, :], sem="relaxed",
                                  scope="gpu")
                    gl.thread_barrier()
                    prev = gl.atomic_add(rtc_ptr + rt, 1, sem="acq_rel", scope="gpu")
                    if prev == GROUPS * (layer + 1) - 1:
                        # this row tile of y is complete: r = residual + y for its columns
                        offs = cols_r[None, :] * H + (rt * 64 + rows_r)[:, None]
                        yv = gl.load(y_base + offs, mask=mask_r, other=0.0)
                        rv = gl.load(res_ptr + offs, mask=mask_r, other=0.0)
                        r = (yv.to(dtype).to(gl.float32) + rv.to(gl.float32)).to(dtype)
                        gl.store(res_ptr + offs, r, mask=mask_r)
                        gl.store(y_base + offs, gl.zeros([64, M_PAD], gl.float32, rt_layout),
                                 mask=mask_r)
                        rf = r.to(gl.float32)
                        gl.atomic_add(ssq_ptr + layer * M_ROWS + cols_r, gl.sum(rf * rf, 0),
                                      mask=cols_r < M, sem="relaxed", scope="gpu")
                        _g_fence_proxy_async()
                        gl.thread_barrier()
                        gl.atomic_add(rdone_ptr, 1, sem="release", scope="gpu")

    @gluon.jit
    def _mlp_cross5_kernel(w_desc, x0_desc, res_desc, h_desc, h_ptr, y_ptr, res_ptr, ssq_ptr,
                           tab_ptr, count_ptr, gctr_ptr, rtc_ptr, rdone_ptr, done_ptr, M,
                           stride_hm, eps, MAXC: gl.constexpr, M_PAD: gl.constexpr,
                           HALF: gl.constexpr, ROW_TILES: gl.constexpr, TPG: gl.constexpr,
                           GK: gl.constexpr, H: gl.constexpr, M_ROWS: gl.constexpr,
                           NPROG: gl.constexpr, GROUPS: gl.constexpr, SSQ: gl.constexpr,
                           STAGES: gl.constexpr, PDL: gl.constexpr, PREFETCH: gl.constexpr,
                           w_ptr=None):
        if PDL:
            _g_launch_dependents()
        pid = gl.program_id(0)
        tab = tab_ptr + pid * 4 * MAXC
        n = gl.load(count_ptr + pid)
        dtype: gl.constexpr = w_desc.dtype
        BK: gl.constexpr = w_desc.block_type.shape[1]
        w_ring = gl.allocate_shared_memory(dtype, [STAGES, 64, BK], w_desc.layout)
        a_ring = gl.allocate_shared_memory(dtype, [STAGES, M_PAD, BK], h_desc.layout)
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        epi = gl.allocate_shared_memory(gl.float32, [64, M_PAD],
                                        gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        for i in gl.static_range(STAGES):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()
        gl.thread_barrier()
        gl.warp_specialize([
            (_v5_consumer, (tab, n, w_ring, a_ring, full, empty, epi, h_ptr, y_ptr, res_ptr,
                            ssq_ptr, gctr_ptr, rtc_ptr, rdone_ptr, M, stride_hm, eps, MAXC,
                            M_PAD, HALF, ROW_TILES, GK, H, GROUPS, M_ROWS, STAGES, PDL)),
            (_v5_producer, (w_desc, x0_desc, res_desc, h_desc, tab, n, w_ring, a_ring, full,
                            empty, gctr_ptr, rdone_ptr, w_ptr, MAXC, ROW_TILES, TPG, GROUPS,
                            STAGES, PDL, PREFETCH)),
        ], [1], [40])
        gl.thread_barrier()
        last = gl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu")
        if last == NPROG - 1:
            zl: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
            offs_g = gl.arange(0, 64, layout=zl)
            gl.store(gctr_ptr + offs_g, gl.zeros([64], gl.int32, zl), mask=offs_g < 32)
            gl.store(rtc_ptr + offs_g, gl.zeros([64], gl.int32, zl), mask=offs_g < ROW_TILES)
            offs_q = gl.arange(0, SSQ, layout=zl)
            gl.store(ssq_ptr + offs_q, gl.zeros([SSQ], gl.float32, zl))
            gl.store(rdone_ptr, 0)
            gl.store(done_ptr, 0)


class CrossMlp5:
    """v5: `layers` MLPs in one launch, the handoff spread over the row tiles. x0 [M, H] in,
    the residual stream from zero; returns x_L (rms_norm of the last residual, times the
    last norm weight, computed here on the host from the kernel's residual and sums)."""

    def __init__(self, m: int, cfg: MlpConfig, ws: list[tuple[Tensor, Tensor, Tensor]],
                 nprog: int, stages: int = 4, prefetch: int = 0) -> None:
        assert cfg.gbn == 32 and m <= 8
        assert not prefetch or cfg.bk == 256, "the L2 prefetch is of 32 KB tiles"
        self.prefetch = prefetch
        wgu0 = ws[0][0]
        dev, dt = wgu0.device, wgu0.dtype
        self.m, self.cfg, self.nprog, self.stages = m, cfg, nprog, stages
        self.layers = len(ws)
        self.groups = INTER // (cfg.gc * cfg.bk)
        assert self.groups <= 31
        wts = []
        for i, (wgu, wd, _) in enumerate(ws):
            if i:  # the norm before this layer: its weight folded into gate and up's columns
                wgu = (wgu.float() * ws[i - 1][2].float()[None, :]).to(dt)
            wts.append(tile_weights(wgu, wd, tile_k=cfg.bk))
        self.last_nw = ws[-1][2]
        table, counts = build_chunks(nprog, cfg)
        tiles = wts[0].shape[0] // TILE_N
        big = torch.zeros(nprog, 4, triton.next_power_of_2(int(counts.max()) * self.layers),
                          dtype=torch.int32)
        for p in range(nprog):
            k = int(counts[p])
            parts = []
            for layer in range(self.layers):
                t = table[p, :, :k].clone()
                t[0] += layer * tiles
                t[2] |= layer << 3
                parts.append(t)
            big[p, :, :k * self.layers] = torch.cat(parts, dim=1)
        self.table, self.counts = big.to(dev), (counts * self.layers).to(dev)
        self.maxc = big.shape[-1]
        self.w = torch.cat(wts)
        self.h = torch.zeros(m, INTER, dtype=dt, device=dev)
        self.y = torch.zeros(2, 8, HIDDEN, dtype=torch.float32, device=dev)
        self.res = torch.zeros(m, HIDDEN, dtype=dt, device=dev)
        self.x0 = torch.zeros(m, HIDDEN, dtype=dt, device=dev)
        self.ssq_n = triton.next_power_of_2(8 * self.layers)
        self.ssq = torch.zeros(self.ssq_n, dtype=torch.float32, device=dev)
        self.gctr = torch.zeros(64, dtype=torch.int32, device=dev)
        self.rtc = torch.zeros(64, dtype=torch.int32, device=dev)
        self.rdone = torch.zeros(1, dtype=torch.int32, device=dev)
        self.done = torch.zeros(1, dtype=torch.int32, device=dev)
        bk = cfg.bk
        lay_w = gl.NVMMASharedLayout.get_default_for([TILE_N, bk], gl.bfloat16)
        lay_a = gl.NVMMASharedLayout.get_default_for([16, bk], gl.bfloat16)
        self.w_desc = GluonDescriptor(self.w, list(self.w.shape), [bk, 1], [TILE_N, bk], lay_w)
        self.x0_desc = GluonDescriptor(self.x0, [m, HIDDEN], [HIDDEN, 1], [16, bk], lay_a)
        self.res_desc = GluonDescriptor(self.res, [m, HIDDEN], [HIDDEN, 1], [16, bk], lay_a)
        self.h_desc = GluonDescriptor(self.h, [m, INTER], [INTER, 1], [16, bk], lay_a)

    def launch(self, x0: Tensor) -> None:
        self.x0.copy_(x0)
        self.res.zero_()
        cfg = self.cfg
        pdl = pdl_enabled()
        _mlp_cross5_kernel[(self.nprog,)](
            self.w_desc, self.x0_desc, self.res_desc, self.h_desc, self.h, self.y, self.res,
            self.ssq, self.table, self.counts, self.gctr, self.rtc, self.rdone, self.done,
            self.m, self.h.stride(0), 1e-6, MAXC=self.maxc, M_PAD=16, HALF=32,
            ROW_TILES=HIDDEN // TILE_N, TPG=cfg.gc * cfg.bk // 32, GK=cfg.gc * cfg.bk,
            H=HIDDEN, M_ROWS=8, NPROG=self.nprog, GROUPS=self.groups, SSQ=self.ssq_n,
            STAGES=self.stages, PDL=pdl, PREFETCH=self.prefetch, w_ptr=self.w, num_warps=4,
            **pdl_launch(pdl))

    def output(self) -> Tensor:
        """x_L from the residual (HF's norm on the host: the kernel zeroed its sums)."""
        r = self.res.float()
        x = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x.to(self.res.dtype) * self.last_nw


class StreamMlp:
    """v2's buffers for one (M, config): h, the counters, the chunk table."""

    def __init__(self, m: int, cfg: MlpConfig, device: torch.device, nprog: int,
                 stages: int = 8, skip: int = 0, ws: bool = False,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        self.m, self.cfg, self.nprog, self.stages, self.skip = m, cfg, nprog, stages, skip
        self.ws = ws
        self.groups = INTER // (cfg.gc * cfg.bk)
        assert INTER % (cfg.gc * cfg.bk) == 0, "a K group must divide the intermediate size"
        # NOTE: v3's producer polls the group counters one a lane of its warp, as a bitmask
        # (call 9 hung on 38 groups: groups 32.. were never seen complete)
        assert self.groups <= 31, "v3 polls at most 31 group counters"
        table, counts = build_chunks(nprog, cfg)
        self.maxc = table.shape[-1]
        self.table, self.counts = table.to(device), counts.to(device)
        self.h = torch.zeros(m, INTER, dtype=dtype, device=device)
        self.gctr = torch.zeros(triton.next_power_of_2(self.groups), dtype=torch.int32,
                                device=device)
        self.done = torch.zeros(1, dtype=torch.int32, device=device)
        self.dbg = torch.zeros(nprog, 4, dtype=torch.int32, device=device)
        self.m_pad = max(16, triton.next_power_of_2(m))
        bk = cfg.bk
        lay_w = gl.NVMMASharedLayout.get_default_for([TILE_N, bk], gl.bfloat16)
        self.lay_a = gl.NVMMASharedLayout.get_default_for([self.m_pad, bk], gl.bfloat16)
        self.lay_w = lay_w
        self.h_desc = GluonDescriptor(self.h, [m, INTER], [INTER, 1], [self.m_pad, bk],
                                      self.lay_a)
        self._w: dict[int, object] = {}

    def __call__(self, x: Tensor, wt: Tensor) -> SplitSums:
        """x [M, H]; wt: `tile_weights(wgu, wd)`."""
        m = self.m
        slots = slot_buffer(x.device, (self.groups + 1) // 2, m, HIDDEN)
        w_desc = self._w.get(wt.data_ptr())
        if w_desc is None:
            w_desc = self._w[wt.data_ptr()] = GluonDescriptor(
                wt, list(wt.shape), [self.cfg.bk, 1], [TILE_N, self.cfg.bk], self.lay_w)
        x_desc = GluonDescriptor(x, [m, HIDDEN], [x.stride(0), 1], [self.m_pad, self.cfg.bk],
                                 self.lay_a)
        pdl = pdl_enabled()
        common = dict(MAXC=self.maxc, M_PAD=self.m_pad, HALF=32, ROW_TILES=HIDDEN // TILE_N,
                      TPG=self.cfg.gc * self.cfg.bk // 32, GK=self.cfg.gc * self.cfg.bk,
                      NPROG=self.nprog, GROUPS=self.groups, G_PAD=self.gctr.numel(),
                      STAGES=self.stages, PDL=pdl, num_warps=4, **pdl_launch(pdl))
        if self.ws:
            _mlp_ws_kernel[(self.nprog,)](
                w_desc, x_desc, self.h_desc, self.h, slots, self.table, self.counts, self.gctr,
                self.done, m, self.h.stride(0), slots.stride(0), slots.stride(1),
                PRODUCER_REGS=40, SKIP=self.skip, **common)
        else:
            _mlp_stream_kernel[(self.nprog,)](
                w_desc, x_desc, self.h_desc, self.h, slots, self.table, self.counts, self.gctr,
                self.done, self.dbg, m, self.h.stride(0), slots.stride(0), slots.stride(1),
                SPIN_LIMIT=1 << 20, SKIP=self.skip, **common)
        return SplitSums(slots, x.dtype)


# ---- checks and timing on the GPU -----------------------------------------------------------

def _weights(layers: int, gen: torch.Generator) -> list[tuple[Tensor, Tensor, Tensor]]:
    dev, dt = "cuda", torch.bfloat16
    return [((torch.randn(2 * INTER, HIDDEN, generator=gen, device=dev) * HIDDEN ** -0.5).to(dt),
             (torch.randn(HIDDEN, INTER, generator=gen, device=dev) * INTER ** -0.5).to(dt),
             (1 + 0.1 * torch.randn(HIDDEN, generator=gen, device=dev)).to(dt))
            for _ in range(layers)]


def check(cfg: MlpConfig, m: int, nprog: int, stages: int = 0, ws: bool = False
          ) -> dict[str, object]:
    """One call against the references, twice (the counters must come back to zero), and
    h against the engine's fused gate_up kernel. stages > 0: v2 (`StreamMlp`) with that ring."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    (wgu, wd, _), = _weights(1, gen)
    dev = torch.device("cuda")
    mlp: PersistentMlp | StreamMlp
    if stages:
        mlp = StreamMlp(m, cfg, dev, nprog, stages, ws=ws)
        wt = tile_weights(wgu, wd, tile_k=cfg.bk)
    else:
        mlp = PersistentMlp(m, cfg, dev, nprog)
    out: dict[str, object] = {"config": asdict(cfg), "m": m, "stages": stages, "ws": ws}
    for run in range(2):
        x = torch.randn(m, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
        y = take(mlp(x, wt) if isinstance(mlp, StreamMlp) else mlp(x, wgu, wd))
        torch.cuda.synchronize()
        h_ref = gemv_silu_mul_ref(x, wgu)
        h_arle = gemv_silu_mul(x, wgu)
        y_ref = gemv_ref(mlp.h, wd)  # on the kernel's own h: isolates down
        y_full = gemv_ref(h_ref, wd)
        out[f"run{run}"] = {
            "h_vs_ref_max_abs": (mlp.h.float() - h_ref.float()).abs().max().item(),
            "h_vs_arle_equal": float((mlp.h == h_arle).float().mean().item()),
            "y_rel_err": ((y.float() - y_ref.float()).norm() / y_ref.float().norm()).item(),
            "y_vs_full_ref_rel_err": ((y.float() - y_full.float()).norm()
                                      / y_full.float().norm()).item(),
            "counters_after": int(mlp.gctr.abs().sum().item()) + int(mlp.done.item()),
        }
    r0, r1 = out["run0"], out["run1"]
    assert isinstance(r0, dict) and isinstance(r1, dict)
    out["ok"] = all(r["y_rel_err"] < 1e-2 and r["h_vs_ref_max_abs"] < 0.05
                    and r["counters_after"] == 0 for r in (r0, r1))
    return out


def _graph_us(body: object, replays: int = 15) -> float:
    """Median microseconds of a replay of the CUDA graph of body()."""
    assert callable(body)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()
        body()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times[2:])[len(times[2:]) // 2]


def bench(cfgs: list[MlpConfig], streams: list[tuple[MlpConfig, int, int, bool]], m: int,
          layers: int,
          nprog: int) -> dict[str, object]:
    """A chain of `layers` MLPs, each followed by the residual add + RMSNorm that consumes its
    split sums (as in the engine), in one CUDA graph under PDL: the engine's two GEMVs against
    the persistent kernel, interleaved twice. Microseconds a layer; the chains' outputs
    compared."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    ws = _weights(layers, gen)
    x0 = torch.randn(m, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    outs: dict[str, Tensor] = {}

    def chain(name: str, mlp_fn: object) -> object:
        assert callable(mlp_fn)
        res = torch.zeros(m, HIDDEN, dtype=torch.bfloat16, device="cuda")
        x = x0.clone()

        def body() -> None:
            res.zero_()
            h = x0
            for wgu, wd, nw in ws:
                h, _ = add_rms_norm(mlp_fn(h, wgu, wd), res, nw, 1e-6)
            x.copy_(h)
        outs[name] = x
        return body

    def engine_mlp(h: Tensor, wgu: Tensor, wd: Tensor) -> Tensor | SplitSums:
        return gemv_split_sums(gemv_silu_mul(h, wgu), wd)

    variants: dict[str, object] = {"engine": chain("engine", engine_mlp)}
    tiled: dict[tuple[int, int], Tensor] = {}
    for cfg, _, _, _ in streams:
        for wgu, wd, _ in ws:
            if (wgu.data_ptr(), cfg.bk) not in tiled:
                tiled[(wgu.data_ptr(), cfg.bk)] = tile_weights(wgu, wd, tile_k=cfg.bk)
    for cfg, stages, skip, spec in streams:
        name = f"{'ws' if spec else 'stream'}_k{cfg.bk}_c{cfg.gc}_s{stages}_skip{skip}"
        smlp = StreamMlp(m, cfg, torch.device("cuda"), nprog, stages, skip, spec)

        def run(h: Tensor, wgu: Tensor, wd: Tensor, smlp: StreamMlp = smlp) -> SplitSums:
            return smlp(h, tiled[(wgu.data_ptr(), smlp.cfg.bk)])
        variants[name] = chain(name, run)
    for cfg in cfgs:
        name = f"persistent_g{cfg.gbn}_d{cfg.dbn}_c{cfg.gc}_s{cfg.gu_stages}{cfg.dn_stages}"
        variants[name] = chain(name, PersistentMlp(m, cfg, torch.device("cuda"), nprog))
    result: dict[str, object] = {"m": m, "layers": layers, "nprog": nprog}
    mlp_bytes = 3 * INTER * HIDDEN * 2
    for rnd in range(2):
        for name, body in variants.items():
            us = _graph_us(body) / layers
            result[f"{name}_r{rnd}"] = {"us_per_layer": us, "tb_s": mlp_bytes / us / 1e6}
            print(f"{name:36} round {rnd}: {us:7.2f} us a layer, {mlp_bytes / us / 1e6:5.2f} TB/s",
                  flush=True)
    ref = outs["engine"].float()
    result["output_rel_err_vs_engine"] = {
        k: ((v.float() - ref).norm() / ref.norm()).item() for k, v in outs.items()}
    return result


def compile_only(cfgs: list[MlpConfig], m: int) -> list[dict[str, object]]:
    """sm_90a registers, spills and shared memory, without a GPU (kernel_regs' machinery)."""
    from kernel_regs import caught_launches, resources

    rows = []
    for cfg in cfgs:
        mlp = PersistentMlp.__new__(PersistentMlp)
        mlp.m, mlp.cfg, mlp.nprog = m, cfg, 132
        mlp.groups = INTER // (cfg.gc * cfg.bk)
        mlp.maxi = 16
        meta = torch.device("meta")
        mlp.sched = torch.empty(132, 16, dtype=torch.int32, device=meta)
        mlp.h = torch.empty(m, INTER, dtype=torch.bfloat16, device=meta)
        mlp.gctr = torch.empty(triton.next_power_of_2(mlp.groups), dtype=torch.int32, device=meta)
        mlp.done = torch.empty(1, dtype=torch.int32, device=meta)
        import arle_kernels.split_sums as ss

        slots = torch.empty((mlp.groups + 1) // 2, 32, HIDDEN, dtype=torch.float32, device=meta)
        ss._BUFFERS[(meta, (mlp.groups + 1) // 2, HIDDEN)] = slots
        with caught_launches() as launches:
            mlp(torch.empty(m, HIDDEN, dtype=torch.bfloat16, device=meta),
                torch.empty(2 * INTER, HIDDEN, dtype=torch.bfloat16, device=meta),
                torch.empty(HIDDEN, INTER, dtype=torch.bfloat16, device=meta))
        row = resources(launches[0]) | {"cfg": asdict(cfg)}
        row.pop("config", None)
        rows.append(row)
        print(row, flush=True)
    return rows


def compile_stream(cfg: MlpConfig, m: int, stages: int, skip: int = 0, ws: bool = False
                   ) -> dict[str, object]:
    """v2 compiled for sm_90a without a GPU: registers, spills, shared memory."""
    import re
    import subprocess
    import tempfile

    from kernel_regs import TARGET, _ptxas
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    meta = torch.device("meta")
    mlp = StreamMlp.__new__(StreamMlp)
    mlp.m, mlp.cfg, mlp.nprog, mlp.stages, mlp.skip, mlp.ws = m, cfg, 132, stages, skip, ws
    mlp.groups = INTER // (cfg.gc * cfg.bk)
    mlp.maxc = 128
    mlp.table = torch.empty(132, 4, 128, dtype=torch.int32, device=meta)
    mlp.counts = torch.empty(132, dtype=torch.int32, device=meta)
    mlp.h = torch.empty(m, INTER, dtype=torch.bfloat16, device=meta)
    mlp.gctr = torch.empty(32, dtype=torch.int32, device=meta)
    mlp.done = torch.empty(1, dtype=torch.int32, device=meta)
    mlp.dbg = torch.empty(132, 4, dtype=torch.int32, device=meta)
    mlp.m_pad = max(16, triton.next_power_of_2(m))
    mlp.lay_w = gl.NVMMASharedLayout.get_default_for([TILE_N, cfg.bk], gl.bfloat16)
    mlp.lay_a = gl.NVMMASharedLayout.get_default_for([mlp.m_pad, cfg.bk], gl.bfloat16)
    mlp.h_desc = GluonDescriptor(mlp.h, [m, INTER], [INTER, 1], [mlp.m_pad, cfg.bk], mlp.lay_a)
    mlp._w = {}
    import arle_kernels.split_sums as ss

    ss._BUFFERS[(meta, (mlp.groups + 1) // 2, HIDDEN)] = torch.empty(
        (mlp.groups + 1) // 2, 32, HIDDEN, dtype=torch.float32, device=meta)
    caught: list[tuple[object, tuple[object, ...], dict[str, object]]] = []
    kernel = _mlp_ws_kernel if ws else _mlp_stream_kernel
    original = type(kernel).run

    def record(self: object, *args: object, grid: object, warmup: bool, **kw: object) -> None:
        caught.append((self, args, kw))

    type(kernel).run = record
    try:
        from arle_kernels.jit import set_pdl
        set_pdl(True)
        mlp(torch.empty(m, HIDDEN, dtype=torch.bfloat16, device=meta),
            torch.empty(9120 * 64, 128, dtype=torch.bfloat16, device=meta))
    finally:
        type(kernel).run = original
    _fn, args, kw = caught[0]
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, opts = binder(*args, **kw)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kw, bound, spec, opts)
    compiled = triton.compile(GluonASTSource(kernel, signature, constexprs, attrs),
                              target=TARGET, options=options.__dict__)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        Path("/tmp/stream.ptx").write_text(compiled.asm["ptx"])
        out = subprocess.run([_ptxas(), "-v", "-arch=sm_90a", str(ptx), "-o",
                              str(Path(tmp) / "k.cubin")], capture_output=True, text=True,
                             check=True).stderr
    used = re.search(r"Used (\d+) registers", out)
    return {"stages": stages, "ws": ws, "cfg": asdict(cfg), "shared": compiled.metadata.shared,
            "registers": int(used.group(1)) if used else None, "ptxas": out[-300:]}


CONFIGS = [MlpConfig(), MlpConfig(gbn=64, gu_stages=5, dn_stages=4),
           MlpConfig(gc=2), MlpConfig(gu_stages=4, dn_stages=6)]


def diag(layers: int, nprog: int, stages: int, pdl: bool, graph: bool) -> None:
    """A chain of `layers` stream MLPs + norms, run once eagerly (or captured and replayed),
    synchronised and timed: where a hang starts."""
    import time

    from arle_kernels.jit import set_pdl

    set_pdl(pdl)
    gen = torch.Generator(device="cuda").manual_seed(2)
    ws = _weights(layers, gen)
    wts = [tile_weights(wgu, wd) for wgu, wd, _ in ws]
    mlp = StreamMlp(8, MlpConfig(), torch.device("cuda"), nprog, stages)
    x0 = torch.randn(8, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    res = torch.zeros(8, HIDDEN, dtype=torch.bfloat16, device="cuda")

    import os
    fresh_x = os.environ.get("DIAG_FRESH_X") == "1"
    if os.environ.get("DIAG_SAME_W") == "1":
        wts = [wts[0]] * layers

    def body(sync: bool = False) -> Tensor:
        res.zero_()
        h = x0
        for i, ((_, _, nw), wt) in enumerate(zip(ws, wts, strict=True)):
            if fresh_x:
                h = x0.clone()
            h, _ = add_rms_norm(mlp(h, wt), res, nw, 1e-6)
            if sync:
                torch.cuda.synchronize()
                bad = mlp.dbg[:, 0].nonzero().flatten().tolist()
                print(f"layer {i} done; spin timeouts in programs {bad[:8]}: "
                      f"{mlp.dbg[bad[:4]].tolist()}; gctr {mlp.gctr.tolist()} done "
                      f"{mlp.done.item()}", flush=True)
                mlp.dbg.zero_()
        return h
    t = time.perf_counter()
    out = body(sync=True)
    torch.cuda.synchronize()
    print(f"diag layers={layers} pdl={pdl} eager ok {time.perf_counter() - t:.3f} s "
          f"norm {out.float().norm().item():.3f}", flush=True)
    if graph:
        us = _graph_us(body) / layers
        print(f"diag layers={layers} pdl={pdl} graph {us:.2f} us a layer", flush=True)


def bench_all_layers(layers: int, nprog: int) -> dict[str, object]:
    """v3 without group checks (SKIP 8) streaming every layer's MLP weights in ONE launch (each
    program's chunk list repeated per layer, tile indices moved on by a layer's tiles; no norm
    between): the design's streaming rate with no per-layer boundary, against the same kernel
    launched per layer. Timing only (results race)."""
    cfg = MlpConfig(bk=256, gc=2)
    gen = torch.Generator(device="cuda").manual_seed(3)
    ws = _weights(layers, gen)
    tiled = torch.cat([tile_weights(wgu, wd, tile_k=cfg.bk) for wgu, wd, _ in ws])
    tiles_per_layer = tiled.shape[0] // TILE_N // layers
    x = torch.randn(8, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    one = StreamMlp(8, cfg, torch.device("cuda"), nprog, 4, skip=8, ws=True)
    per_layer = [tiled[i * tiles_per_layer * TILE_N:(i + 1) * tiles_per_layer * TILE_N]
                 for i in range(layers)]
    allm = StreamMlp(8, cfg, torch.device("cuda"), nprog, 4, skip=8, ws=True)
    table, counts = build_chunks(nprog, cfg)
    reps = []
    for rep in range(layers):
        t = table.clone()
        t[:, 0] += rep * tiles_per_layer
        reps.append(t)
    big = torch.zeros(nprog, 4, triton.next_power_of_2(int(counts.max()) * layers),
                      dtype=torch.int32)
    for p in range(nprog):
        k = int(counts[p])
        big[p, :, :k * layers] = torch.cat([r[p, :, :k] for r in reps], dim=1)
    allm.table, allm.counts = big.cuda(), (counts * layers).cuda()
    allm.maxc = big.shape[-1]
    mlp_bytes = 3 * INTER * HIDDEN * 2

    res = torch.zeros(8, HIDDEN, dtype=torch.bfloat16, device="cuda")

    def per_launch() -> None:  # as the chain in `bench`: each launch's sums into the norm
        h = x
        for w, (_, _, nw) in zip(per_layer, ws, strict=True):
            h, _ = add_rms_norm(one(h, w), res, nw, 1e-6)

    def single() -> None:
        take(allm(x, tiled))
    out: dict[str, object] = {}
    for rnd in range(2):
        for name, body in (("per_layer_launches", per_launch), ("one_launch", single)):
            us = _graph_us(body) / layers
            out[f"{name}_r{rnd}"] = {"us_per_layer": us, "tb_s": mlp_bytes / us / 1e6}
            print(f"{name:24} round {rnd}: {us:7.2f} us a layer, {mlp_bytes / us / 1e6:5.2f} TB/s",
                  flush=True)
    return out


def compile_cross(layers: int = 2, m: int = 8, v5: bool = False) -> dict[str, object]:
    """v4 (v5) compiled for sm_90a without a GPU (the launch caught on CPU tensors)."""
    import re
    import subprocess
    import tempfile

    from kernel_regs import TARGET, _ptxas
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    from arle_kernels.jit import set_pdl

    cfg = MlpConfig(bk=256, gc=2)
    bf = torch.bfloat16
    if v5:
        w3 = (torch.zeros(2 * INTER, HIDDEN, dtype=bf), torch.zeros(HIDDEN, INTER, dtype=bf),
              torch.zeros(HIDDEN, dtype=bf))
        mlp5 = CrossMlp5(m, cfg, [w3] * layers, 132, prefetch=6)
    else:
        wt = torch.zeros(9120 // 2 * 64, 256, dtype=bf)
        mlp = CrossMlp(m, cfg, [torch.zeros(HIDDEN, dtype=bf)] * layers, [wt] * layers, 132)
    caught: list[tuple[tuple[object, ...], dict[str, object]]] = []
    kernel = _mlp_cross5_kernel if v5 else _mlp_cross_kernel
    original = type(kernel).run

    def record(self: object, *args: object, grid: object, warmup: bool, **kw: object) -> None:
        caught.append((args, kw))

    type(kernel).run = record
    try:
        set_pdl(True)
        if v5:
            mlp5.launch(torch.zeros(m, HIDDEN, dtype=bf))
        else:
            mlp(torch.zeros(m, HIDDEN, dtype=bf))
    finally:
        type(kernel).run = original
    args, kw = caught[0]
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, opts = binder(*args, **kw)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kw, bound, spec, opts)
    compiled = triton.compile(GluonASTSource(kernel, signature, constexprs, attrs),
                              target=TARGET, options=options.__dict__)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        Path("/tmp/cross.ptx").write_text(compiled.asm["ptx"])
        out = subprocess.run([_ptxas(), "-v", "-arch=sm_90a", str(ptx), "-o",
                              str(Path(tmp) / "k.cubin")], capture_output=True, text=True,
                             check=True).stderr
    used = re.search(r"Used (\d+) registers", out)
    return {"shared": compiled.metadata.shared,
            "registers": int(used.group(1)) if used else None}


def cross(layers: int, nprog: int) -> dict[str, object]:
    """v4 against the engine's chain (MLP + add_rms_norm a layer, from a zero residual): the
    outputs after 1, 2 and `layers` layers, then both timed as CUDA graphs."""
    import time

    cfg = MlpConfig(bk=256, gc=2)
    gen = torch.Generator(device="cuda").manual_seed(4)
    ws = _weights(layers, gen)
    wts = [tile_weights(wgu, wd, tile_k=cfg.bk) for wgu, wd, _ in ws]
    x0 = torch.randn(8, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    res = torch.zeros(8, HIDDEN, dtype=torch.bfloat16, device="cuda")

    def engine(n: int) -> Tensor:
        res.zero_()
        h = x0
        for wgu, wd, nw in ws[:n]:
            h, _ = add_rms_norm(gemv_split_sums(gemv_silu_mul(h, wgu), wd), res, nw, 1e-6)
        return h
    out: dict[str, object] = {"layers": layers}
    for n in (1, 2, layers):
        mlp = CrossMlp(8, cfg, [nw for _, _, nw in ws[:n]], wts[:n], nprog)
        t = time.perf_counter()
        got = mlp(x0).clone()
        torch.cuda.synchronize()
        ref = engine(n).float()
        err = ((got.float() - ref).norm() / ref.norm()).item()
        out[f"rel_err_{n}_layers"] = err
        print(f"v4 {n} layers: ran in {time.perf_counter() - t:.3f} s, rel err vs engine "
              f"{err:.2e}, counters {int(mlp.gctr.abs().sum() + mlp.dctr + mlp.xready)}",
              flush=True)
    mlp_bytes = 3 * INTER * HIDDEN * 2
    for rnd in range(2):
        for name, body in (("engine", lambda: engine(layers)), ("v4_one_launch", lambda: mlp(x0))):
            us = _graph_us(body) / layers
            out[f"{name}_r{rnd}"] = {"us_per_layer": us, "tb_s": mlp_bytes / us / 1e6}
            print(f"{name:16} round {rnd}: {us:7.2f} us a layer, {mlp_bytes / us / 1e6:5.2f} TB/s",
                  flush=True)
    return out


def cross5(layers: int, nprog: int) -> dict[str, object]:
    """v5 against the engine's chain, as `cross` for v4."""
    import time

    cfg = MlpConfig(bk=256, gc=2)
    gen = torch.Generator(device="cuda").manual_seed(4)
    ws = _weights(layers, gen)
    x0 = torch.randn(8, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    res = torch.zeros(8, HIDDEN, dtype=torch.bfloat16, device="cuda")

    def engine(n: int) -> Tensor:
        res.zero_()
        h = x0
        for wgu, wd, nw in ws[:n]:
            h, _ = add_rms_norm(gemv_split_sums(gemv_silu_mul(h, wgu), wd), res, nw, 1e-6)
        return h
    out: dict[str, object] = {"layers": layers}
    for n in (1, 2, layers):
        mlp = CrossMlp5(8, cfg, ws[:n], nprog, prefetch=6)
        t = time.perf_counter()
        mlp.launch(x0)
        torch.cuda.synchronize()
        got = mlp.output().float()
        ref = engine(n).float()
        err = ((got - ref).norm() / ref.norm()).item()
        out[f"rel_err_{n}_layers"] = err
        print(f"v5 {n} layers: ran in {time.perf_counter() - t:.3f} s, rel err vs engine "
              f"{err:.2e}, counters {int(mlp.gctr.abs().sum() + mlp.rtc.sum() + mlp.rdone)}",
              flush=True)
    mlp_bytes = 3 * INTER * HIDDEN * 2
    pf = {k: CrossMlp5(8, cfg, ws, nprog, prefetch=k) for k in (0, 3, 10)}
    pf[6] = mlp
    bodies = [("engine", lambda: engine(layers))] + [
        (f"v5_one_launch_prefetch{k}", lambda k=k: pf[k].launch(x0)) for k in sorted(pf)]
    for rnd in range(2):
        for name, body in bodies:
            us = _graph_us(body) / layers
            out[f"{name}_r{rnd}"] = {"us_per_layer": us, "tb_s": mlp_bytes / us / 1e6}
            print(f"{name:16} round {rnd}: {us:7.2f} us a layer, {mlp_bytes / us / 1e6:5.2f} TB/s",
                  flush=True)
    return out


#: the stream variants of calls 7, 10 and 11: (config, ring stages, skip, ws). skip (v2: see
#: `_group_ready` and the kernel; v3: 8 only) takes parts out for timing, with wrong results;
#: ws: v3 (a producer warp) rather than v2
CALLS: dict[int, list[tuple[MlpConfig, int, int, bool]]] = {
    7: [(MlpConfig(), 8, sk, False) for sk in (0, 1, 2, 4, 8, 15)]
    + [(MlpConfig(bk=256, gc=2), 4, 0, False), (MlpConfig(bk=256, gc=2), 4, 15, False)],
    10: [(MlpConfig(), 8, 0, True), (MlpConfig(bk=256, gc=2), 4, 0, True),
         (MlpConfig(bk=256, gc=2), 5, 0, True), (MlpConfig(bk=256, gc=2), 4, 0, False)],
    11: [(MlpConfig(bk=256, gc=2), 4, 0, True), (MlpConfig(bk=256, gc=2), 4, 8, True),
         (MlpConfig(), 8, 8, True)],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--compile-stream", action="store_true")
    ap.add_argument("--v1", action="store_true", help="also v1 (call 1's Triton kernel)")
    ap.add_argument("--diag", nargs=3, type=int, metavar=("LAYERS", "STAGES", "PDL"))
    ap.add_argument("--graph", action="store_true")
    ap.add_argument("--call", type=int, default=10, choices=sorted(CALLS),
                    help="whose stream variants --check / --bench run")
    ap.add_argument("--all-layers", action="store_true", help="call 12: one launch, 36 layers")
    ap.add_argument("--compile-cross", action="store_true", help="v4 for sm_90a, no GPU")
    ap.add_argument("--cross", action="store_true", help="v4 against the engine's chain")
    ap.add_argument("--cross5", action="store_true", help="v5 against the engine's chain")
    ap.add_argument("--schedule", action="store_true", help="print the schedules' balance")
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    result: dict[str, object] = {}
    if args.schedule:
        for cfg in CONFIGS:
            lists, loads = build_schedule(132, cfg)
            mean = 3 * INTER * HIDDEN * 2 / 132  # weight bytes a program, balanced
            print(f"{cfg}: max/mean bytes {max(loads) / mean:.3f}, items "
                  f"{min(map(len, lists))}..{max(map(len, lists))}")
    if args.compile_only:
        result["compile"] = compile_only(CONFIGS, args.m)
    if args.compile_cross:
        result["compile_cross"] = [compile_cross(), compile_cross(v5=True)]
        print(result["compile_cross"])
    if args.compile_stream:
        result["compile_stream"] = [compile_stream(cfg, args.m, st, sk, ws)
                                    for cfg, st, sk, ws in CALLS[args.call]]
        print(json.dumps(result["compile_stream"], indent=1))
    if args.check or args.bench or args.diag or args.all_layers or args.cross or args.cross5:
        nprog = torch.cuda.get_device_properties(0).multi_processor_count
        if args.cross:
            result["cross"] = cross(args.layers, nprog)
        if args.cross5:
            result["cross5"] = cross5(args.layers, nprog)
        if args.all_layers:
            result["all_layers"] = bench_all_layers(args.layers, nprog)
        if args.diag:
            diag(args.diag[0], nprog, args.diag[1], bool(args.diag[2]), args.graph)
        v1 = CONFIGS if args.v1 else []
        if args.check:
            result["check"] = ([check(cfg, m, nprog) for cfg in v1 for m in (args.m, 3)]
                               + [check(cfg, m, nprog, st, ws)
                                  for cfg, st, skip, ws in CALLS[args.call]
                                  if not skip for m in (args.m, 3)])
            print(json.dumps(result["check"], indent=1), flush=True)
        if args.bench:
            result["bench"] = bench(v1, CALLS[args.call], args.m, args.layers, nprog)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
