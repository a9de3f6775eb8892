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
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

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

    # ---- pieces every Gluon version shares ---------------------------------------------------

    @gluon.jit
    def _g_my_chunks(tab_ptr, count_ptr, MAXC: gl.constexpr, PDL: gl.constexpr):
        """A kernel's start: let the next kernel launch (PDL), then this program's chunk table
        and chunk count (static data: read before the PDL wait)."""
        if PDL:
            gdc_launch_dependents()
        pid = gl.program_id(0)
        return tab_ptr + pid * 4 * MAXC, gl.load(count_ptr + pid)

    @gluon.jit
    def _g_prefetch_l2(ptr):
        """cp.async.bulk.prefetch.L2 of one 32 KB W tile (64 x 256 bf16) at ptr, from one lane."""
        gl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 l; mov.u32 l, %laneid; setp.eq.u32 p, l, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], 32768; mov.u32 $0, 0; }",
            "=r,l", [ptr], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _g_issue_w(w_desc, tab, c, w_ring, bars, STAGES: gl.constexpr, ACT_BYTES: gl.constexpr):
        """Chunk c's W tile into its slot; the slot's barrier expects W and the act tile."""
        s = c % STAGES
        mbarrier.expect(bars.index(s), w_desc.block_type.nbytes + ACT_BYTES)
        tma.async_copy_global_to_shared(w_desc, [gl.load(tab + c) * 64, 0], bars.index(s),
                                        w_ring.index(s))

    @gluon.jit
    def _g_w_prologue(w_desc, tab, n, w_ring, bars, PDL: gl.constexpr, STAGES: gl.constexpr,
                      ACT_BYTES: gl.constexpr):
        """The first STAGES W tiles, then the PDL wait.
        NOTE: W is no kernel's output, so its copies may go out before the wait."""
        for i in gl.static_range(STAGES):
            if i < n:
                _g_issue_w(w_desc, tab, i, w_ring, bars, STAGES, ACT_BYTES)
        if PDL:
            gdc_wait()

    @gluon.jit
    def _g_groups_ready(tab, d, gctr_ptr, known, known_layer, MAXC: gl.constexpr,
                        ROW_TILES: gl.constexpr, TPG: gl.constexpr, GROUPS: gl.constexpr):
        """For the first chunk of a down item (group g, layer l): whether g's gate_up tiles
        are all written (its counter at TPG * (l + 1): counters add up across layers), from
        `known` (a bitmask of layer `known_layer`'s complete groups), else from one poll of
        every counter, one a lane (so at most 31 groups). Acquire and proxy fences after a
        poll that finds it. Returns (ok, known, known_layer)."""
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        offs_g = gl.arange(0, 32, layout=lay)
        flags = gl.load(tab + 2 * MAXC + d)
        layer = flags >> 3
        g = gl.load(tab + 3 * MAXC + d) // ROW_TILES
        if known_layer != layer:
            known = known * 0
            known_layer = layer
        ok = ((known >> g) & 1) != 0
        if not ok:
            cnt = gl.load(gctr_ptr + offs_g, mask=offs_g < GROUPS, other=0, volatile=True)
            known = gl.sum(gl.where(cnt >= TPG * (layer + 1), 1 << offs_g, 0), 0)
            ok = ((known >> g) & 1) != 0
            if ok:
                _fence_acq_rel()
                _fence_proxy_async()
        return ok, known, known_layer

    @gluon.jit
    def _g_glu_epilogue(acc, epi, h_ptr, gctr_ptr, unit, M, stride_hm, inv, HALF: gl.constexpr,
                        GK: gl.constexpr, M_PAD: gl.constexpr, SCALE: gl.constexpr,
                        FENCE: gl.constexpr):
        """A gate_up unit done: acc's rows 0..HALF-1 are gate, the rest up (split through
        `epi`, shared memory); SCALE: both times inv (per row of x); h[:, unit * HALF:][:HALF]
        = silu(gate) * up with HF's roundings; then the unit counts itself in its K group's
        counter (release; FENCE: after a proxy fence, for h's TMA readers)."""
        dtype: gl.constexpr = h_ptr.dtype.element_ty
        epi_layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
        rows_e = gl.arange(0, HALF, layout=gl.SliceLayout(1, epi_layout))
        cols_e = gl.arange(0, M_PAD, layout=gl.SliceLayout(0, epi_layout))
        epi.store(acc)
        gl.thread_barrier()
        gate = epi.slice(0, HALF).load(epi_layout)
        up = epi.slice(HALF, HALF).load(epi_layout)
        gl.thread_barrier()
        if SCALE:
            gate = gate * inv[None, :]
            up = up * inv[None, :]
        hv = silu_mul(gate.to(dtype), up.to(dtype))
        h_ptrs = h_ptr + cols_e[None, :] * stride_hm + (unit * HALF + rows_e)[:, None]
        gl.store(h_ptrs, hv, mask=(cols_e < M)[None, :])
        if FENCE:
            _fence_proxy_async()
        gl.thread_barrier()
        gl.atomic_add(gctr_ptr + unit * HALF // GK, 1, sem="release", scope="gpu")

    @gluon.jit
    def _g_acc_ptrs(base, unit, stride_m, ROW_TILES: gl.constexpr, M_PAD: gl.constexpr):
        """Pointers [64, M_PAD] in the accumulator's layout to base + m * stride_m + the 64
        columns of a down item's row tile."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, M_PAD, 16])
        rows_a = gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
        cols_a = gl.arange(0, M_PAD, layout=gl.SliceLayout(0, acc_layout))
        return (base + cols_a[None, :] * stride_m + ((unit % ROW_TILES) * 64 + rows_a)[:, None],
                cols_a)

    @gluon.jit
    def _g_last_out(done_ptr, NPROG: gl.constexpr):
        """Whether this program is the last to finish (then it zeroes the counters)."""
        gl.thread_barrier()
        return gl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu") == NPROG - 1

    @gluon.jit
    def _g_zero(ptr, N: gl.constexpr, N_PAD: gl.constexpr, dtype: gl.constexpr):
        zl: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        offs = gl.arange(0, N_PAD, layout=zl)
        gl.store(ptr + offs, gl.zeros([N_PAD], dtype, zl), mask=offs < N)

    # ---- v2: one warpgroup, one ring ----------------------------------------------------------

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
                _fence_acq_rel()
                _fence_proxy_async()
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
        tab, n = _g_my_chunks(tab_ptr, count_ptr, MAXC, PDL)
        dtype: gl.constexpr = w_desc.dtype
        ACT_BYTES: gl.constexpr = x_desc.block_type.nbytes
        BK: gl.constexpr = w_desc.block_type.shape[1]
        w_ring = gl.allocate_shared_memory(dtype, [STAGES, 64, BK], w_desc.layout)
        a_ring = gl.allocate_shared_memory(dtype, [STAGES, M_PAD, BK], x_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        _g_w_prologue(w_desc, tab, n, w_ring, bars, PDL, STAGES, ACT_BYTES)
        pend = _advance(x_desc, h_desc, tab, n * 0, gl.minimum(n, STAGES), a_ring, bars, gctr_ptr,
                        STAGES, MAXC, ROW_TILES, TPG, SKIP)
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, M_PAD, 16])
        acc = gl.zeros([64, M_PAD], gl.float32, acc_layout)
        epi = gl.allocate_shared_memory(gl.float32, [64, M_PAD],
                                        gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
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
                    dbg = dbg_ptr + gl.program_id(0) * 4
                    gl.store(dbg, c + 1)
                    gl.store(dbg + 1, g_dbg)
                    gl.store(dbg + 2, gl.load(gctr_ptr + g_dbg, volatile=True))
                    gl.store(dbg + 3, n)
                _issue_act(x_desc, h_desc, tab, c, a_ring, bars, STAGES, MAXC)
                pend = c + 1
            mbarrier.wait(bars.index(s), (c // STAGES) & 1)
            flags = gl.load(tab + 2 * MAXC + c)
            acc = warpgroup_mma(w_ring.index(s), a_ring.index(s).permute((1, 0)), acc,
                                use_acc=(flags & 2) == 0)
            nc = c + STAGES
            if nc < n:
                _g_issue_w(w_desc, tab, nc, w_ring, bars, STAGES, ACT_BYTES)
            pend = _advance(x_desc, h_desc, tab, pend, gl.minimum(n, nc + 1), a_ring, bars,
                            gctr_ptr, STAGES, MAXC, ROW_TILES, TPG, SKIP)
            if (flags & 4) != 0:
                unit = gl.load(tab + 3 * MAXC + c)
                if (flags & 1) == 0:
                    _g_glu_epilogue(acc, epi, h_ptr, gctr_ptr, unit, M, stride_hm, 0.0, HALF, GK,
                                    M_PAD, False, (SKIP & 2) == 0)
                else:
                    s_ptrs, cols_a = _g_acc_ptrs(slots_ptr + (unit // ROW_TILES // 2) * stride_ss,
                                                 unit, stride_sm, ROW_TILES, M_PAD)
                    if (SKIP & 4) == 0:
                        gl.atomic_add(s_ptrs, acc, mask=(cols_a < M)[None, :], sem="relaxed",
                                      scope="gpu")
                    else:
                        gl.store(s_ptrs, acc, mask=(cols_a < M)[None, :])
        if _g_last_out(done_ptr, NPROG):
            _g_zero(gctr_ptr, GROUPS, G_PAD, gl.int32)
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
    def _g_ws_rings(w_desc, a_desc, STAGES: gl.constexpr, M_PAD: gl.constexpr):
        """The shared memory of v3-v5: W and activation rings, `full` and `empty` barriers a
        slot, and the gate_up epilogue's [64, M_PAD] fp32 tile."""
        dtype: gl.constexpr = w_desc.dtype
        BK: gl.constexpr = w_desc.block_type.shape[1]
        w_ring = gl.allocate_shared_memory(dtype, [STAGES, 64, BK], w_desc.layout)
        a_ring = gl.allocate_shared_memory(dtype, [STAGES, M_PAD, BK], a_desc.layout)
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        epi = gl.allocate_shared_memory(gl.float32, [64, M_PAD],
                                        gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        for i in gl.static_range(STAGES):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()
        gl.thread_barrier()
        return w_ring, a_ring, full, empty, epi

    @gluon.jit
    def _g_refill_w(w_desc, tab, c, w_ring, full, empty, STAGES: gl.constexpr,
                    ACT_BYTES: gl.constexpr):
        """Chunk c's W tile into its slot once the warpgroup has freed it."""
        mbarrier.wait(empty.index(c % STAGES), ((c // STAGES) & 1) ^ 1)
        _g_issue_w(w_desc, tab, c, w_ring, full, STAGES, ACT_BYTES)

    @gluon.jit
    def _g_warpgroup_start(M_PAD: gl.constexpr, PDL: gl.constexpr):
        """The warpgroup's start: wait for the kernel before (the sums it adds into were zeroed
        there), and a zero [64, M_PAD] accumulator in the wgmma layout."""
        if PDL:
            gdc_wait()
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, M_PAD, 16])
        return gl.zeros([64, M_PAD], gl.float32, acc_layout)

    @gluon.jit
    def _g_consume(tab, c, acc, w_ring, a_ring, full, empty, MAXC: gl.constexpr,
                   STAGES: gl.constexpr):
        """The warpgroup's turn for chunk c: wait for its slot, multiply, free the slot.
        Returns (acc, the chunk's flags)."""
        s = c % STAGES
        mbarrier.wait(full.index(s), (c // STAGES) & 1)
        flags = gl.load(tab + 2 * MAXC + c)
        acc = warpgroup_mma(w_ring.index(s), a_ring.index(s).permute((1, 0)), acc,
                            use_acc=(flags & 2) == 0)
        gl.thread_barrier()  # every warp's MMA has read the slot
        mbarrier.arrive(empty.index(s))
        return acc, flags

    @gluon.jit
    def _ws_producer(w_desc, x_desc, h_desc, tab, n, w_ring, a_ring, full, empty, gctr_ptr,
                     MAXC: gl.constexpr, ROW_TILES: gl.constexpr, TPG: gl.constexpr,
                     GROUPS: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr,
                     SKIP: gl.constexpr):
        ACT_BYTES: gl.constexpr = x_desc.block_type.nbytes
        _g_w_prologue(w_desc, tab, n, w_ring, full, PDL, STAGES, ACT_BYTES)
        known = n * 0  # bitmask of the groups seen complete
        if (SKIP & 8) != 0:  # timing only: every group taken as complete (races)
            known = known - 1
        known_layer = n * 0
        for c in range(n):
            s = c % STAGES
            if c >= STAGES:
                _g_refill_w(w_desc, tab, c, w_ring, full, empty, STAGES, ACT_BYTES)
            flags = gl.load(tab + 2 * MAXC + c)
            col = gl.load(tab + 1 * MAXC + c)
            if (flags & 1) == 0:
                tma.async_copy_global_to_shared(x_desc, [0, col], full.index(s), a_ring.index(s))
            else:
                if (flags & 2) != 0:
                    ok = flags < 0
                    while not ok:
                        ok, known, known_layer = _g_groups_ready(
                            tab, c, gctr_ptr, known, known_layer, MAXC, ROW_TILES, TPG, GROUPS)
                tma.async_copy_global_to_shared(h_desc, [0, col], full.index(s), a_ring.index(s))

    @gluon.jit
    def _ws_consumer(tab, n, w_ring, a_ring, full, empty, epi, h_ptr, slots_ptr, gctr_ptr, M,
                     stride_hm, stride_ss, stride_sm, MAXC: gl.constexpr, M_PAD: gl.constexpr,
                     HALF: gl.constexpr, ROW_TILES: gl.constexpr, GK: gl.constexpr,
                     STAGES: gl.constexpr, PDL: gl.constexpr):
        acc = _g_warpgroup_start(M_PAD, PDL)
        for c in range(n):
            acc, flags = _g_consume(tab, c, acc, w_ring, a_ring, full, empty, MAXC, STAGES)
            if (flags & 4) != 0:
                unit = gl.load(tab + 3 * MAXC + c)
                if (flags & 1) == 0:
                    _g_glu_epilogue(acc, epi, h_ptr, gctr_ptr, unit, M, stride_hm, 0.0, HALF, GK,
                                    M_PAD, False, True)
                else:
                    s_ptrs, cols_a = _g_acc_ptrs(slots_ptr + (unit // ROW_TILES // 2) * stride_ss,
                                                 unit, stride_sm, ROW_TILES, M_PAD)
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
        tab, n = _g_my_chunks(tab_ptr, count_ptr, MAXC, PDL)
        w_ring, a_ring, full, empty, epi = _g_ws_rings(w_desc, x_desc, STAGES, M_PAD)
        gl.warp_specialize([
            (_ws_consumer, (tab, n, w_ring, a_ring, full, empty, epi, h_ptr, slots_ptr, gctr_ptr,
                            M, stride_hm, stride_ss, stride_sm, MAXC, M_PAD, HALF, ROW_TILES,
                            GK, STAGES, PDL)),
            (_ws_producer, (w_desc, x_desc, h_desc, tab, n, w_ring, a_ring, full, empty,
                            gctr_ptr, MAXC, ROW_TILES, TPG, GROUPS, STAGES, PDL, SKIP)),
        ], [1], [PRODUCER_REGS])
        if _g_last_out(done_ptr, NPROG):
            _g_zero(gctr_ptr, GROUPS, G_PAD, gl.int32)
            gl.store(done_ptr, 0)

    # ---- v4 and v5: v3 across layers, with the real dependencies ------------------------------
    #
    # Call 12: v3 streaming all 36 layers' MLP weights in one launch drew 4.04 TB/s (37 us a
    # layer) against 44 us launched per layer. v4 and v5 ask whether that survives the
    # dependencies: layer l + 1's gate_up reads x_{l+1} = rms_norm(residual + y_l), which needs
    # all of layer l's down items. Down items add into y (fp32, [2, M, H] by layer parity:
    # atomics in any order, so not bit-reproducible). Counters add up across layers (group g
    # of layer l is complete at TPG * (l + 1)). The producer copies W ahead regardless and
    # holds back only the activation copies, so the ring fills with the next layer's weights
    # while the handoff runs.
    # - v4 (call 13): the program whose down item completes a layer runs the residual add +
    #   RMSNorm (HF's roundings) alone and publishes x_{l+1}; `ready` counts layers.
    # - v5 (calls 14-15): the down item that completes a 64-column row tile adds the residual
    #   for those columns and its rows' sums of squares into ssq[layer]; the next layer's
    #   gate_up reads the residual itself (by TMA, once all row tiles are in; `ready` counts
    #   row tiles) and scales its sums by 1 / rms in the epilogue, with the norm weight folded
    #   into its gate and up weights on the host (W' = W diag(w)).
    #   NOTE: so v5's normed x is never rounded to bf16 as HF does: its numbers differ from the
    #   engine's by that rounding (a timing experiment; an engine version would build x in
    #   shared memory).

    @gluon.jit
    def _g_cross_ready(tab, d, gctr_ptr, ready_ptr, known, known_layer, seen,
                       MAXC: gl.constexpr, ROW_TILES: gl.constexpr, TPG: gl.constexpr,
                       GROUPS: gl.constexpr, READY_PER_LAYER: gl.constexpr):
        """Whether chunk d's activation may be copied: a gate_up chunk of layer l once the
        `ready` counter (`seen` is its last value read) holds READY_PER_LAYER * l; the first
        chunk of a down item as `_g_groups_ready`. Returns (ok, known, known_layer, seen)."""
        flags = gl.load(tab + 2 * MAXC + d)
        layer = flags >> 3
        ok = flags >= 0
        if (flags & 1) == 0:
            if seen < READY_PER_LAYER * layer:
                seen = gl.load(ready_ptr, volatile=True)
                ok = seen >= READY_PER_LAYER * layer
                if ok:
                    _fence_acq_rel()
                    _fence_proxy_async()
        elif (flags & 2) != 0:
            ok, known, known_layer = _g_groups_ready(tab, d, gctr_ptr, known, known_layer, MAXC,
                                                     ROW_TILES, TPG, GROUPS)
        return ok, known, known_layer, seen

    @gluon.jit
    def _g_cross_issue_act(x_desc, res_desc, h_desc, tab, d, a_ring, full, MAXC: gl.constexpr,
                           STAGES: gl.constexpr, M_ROWS: gl.constexpr, V5: gl.constexpr):
        """Chunk d's activation tile: h (down); for gate_up, v4's x_{layer} (rows of x_desc,
        one block of M_ROWS a layer), v5's x0 (layer 0) or residual (res_desc)."""
        s = d % STAGES
        flags = gl.load(tab + 2 * MAXC + d)
        col = gl.load(tab + 1 * MAXC + d)
        if (flags & 1) == 0:
            if not V5:
                tma.async_copy_global_to_shared(x_desc, [(flags >> 3) * M_ROWS, col],
                                                full.index(s), a_ring.index(s))
            elif (flags >> 3) == 0:
                tma.async_copy_global_to_shared(x_desc, [0, col], full.index(s), a_ring.index(s))
            else:
                tma.async_copy_global_to_shared(res_desc, [0, col], full.index(s),
                                                a_ring.index(s))
        else:
            tma.async_copy_global_to_shared(h_desc, [0, col], full.index(s), a_ring.index(s))

    @gluon.jit
    def _g_cross_producer(w_desc, x_desc, res_desc, h_desc, tab, n, w_ring, a_ring, full, empty,
                          gctr_ptr, ready_ptr, w_ptr, MAXC: gl.constexpr,
                          ROW_TILES: gl.constexpr, TPG: gl.constexpr, GROUPS: gl.constexpr,
                          STAGES: gl.constexpr, M_ROWS: gl.constexpr, PDL: gl.constexpr,
                          V5: gl.constexpr, READY_PER_LAYER: gl.constexpr,
                          PREFETCH: gl.constexpr):
        """W copies run ahead as far as the ring allows; the activation copies follow in order
        and wait (here only: the warpgroup goes on) for what their chunk reads."""
        ACT_BYTES: gl.constexpr = h_desc.block_type.nbytes
        _g_w_prologue(w_desc, tab, n, w_ring, full, PDL, STAGES, ACT_BYTES)
        pend = n * 0  # the first chunk whose activation copy is not issued
        known = n * 0
        known_layer = n * 0 - 1
        seen = n * 0
        for c in range(n):
            if c >= STAGES:
                # the warpgroup frees the slot only once chunk c - STAGES is in: wait for it
                while pend <= c - STAGES:
                    ok, known, known_layer, seen = _g_cross_ready(
                        tab, pend, gctr_ptr, ready_ptr, known, known_layer, seen, MAXC,
                        ROW_TILES, TPG, GROUPS, READY_PER_LAYER)
                    if ok:
                        _g_cross_issue_act(x_desc, res_desc, h_desc, tab, pend, a_ring, full,
                                           MAXC, STAGES, M_ROWS, V5)
                        pend += 1
                _g_refill_w(w_desc, tab, c, w_ring, full, empty, STAGES, ACT_BYTES)
            if PREFETCH > 0:  # noqa: SIM102 (a constexpr test, then a runtime one)
                # W of the chunk PREFETCH past this one into L2 (a hint: a contiguous tile)
                if c + PREFETCH < n:
                    tile_pf = gl.load(tab + c + PREFETCH)
                    _g_prefetch_l2(w_ptr + tile_pf.to(gl.int64) * (w_desc.block_type.nbytes // 2))
            go = pend >= 0
            while go & (pend <= c):
                ok, known, known_layer, seen = _g_cross_ready(
                    tab, pend, gctr_ptr, ready_ptr, known, known_layer, seen, MAXC, ROW_TILES,
                    TPG, GROUPS, READY_PER_LAYER)
                if ok:
                    _g_cross_issue_act(x_desc, res_desc, h_desc, tab, pend, a_ring, full, MAXC,
                                       STAGES, M_ROWS, V5)
                    pend += 1
                else:
                    go = pend < 0
        while pend < n:
            ok, known, known_layer, seen = _g_cross_ready(
                tab, pend, gctr_ptr, ready_ptr, known, known_layer, seen, MAXC, ROW_TILES, TPG,
                GROUPS, READY_PER_LAYER)
            if ok:
                _g_cross_issue_act(x_desc, res_desc, h_desc, tab, pend, a_ring, full, MAXC,
                                   STAGES, M_ROWS, V5)
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
    def _v5_row_tile(unit, layer, y_base, res_ptr, ssq_ptr, M, H: gl.constexpr,
                     ROW_TILES: gl.constexpr, M_PAD: gl.constexpr, M_ROWS: gl.constexpr):
        """A row tile of y complete: r = residual + y (rounded) for its 64 columns, y zeroed
        there, and its rows' sums of squares of r added into ssq[layer]."""
        dtype: gl.constexpr = res_ptr.dtype.element_ty
        rt_layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
        rows_r = gl.arange(0, 64, layout=gl.SliceLayout(1, rt_layout))
        cols_r = gl.arange(0, M_PAD, layout=gl.SliceLayout(0, rt_layout))
        mask_r = (cols_r < M)[None, :] & (rows_r >= 0)[:, None]
        offs = cols_r[None, :] * H + ((unit % ROW_TILES) * 64 + rows_r)[:, None]
        yv = gl.load(y_base + offs, mask=mask_r, other=0.0)
        rv = gl.load(res_ptr + offs, mask=mask_r, other=0.0)
        r = (yv.to(dtype).to(gl.float32) + rv.to(gl.float32)).to(dtype)
        gl.store(res_ptr + offs, r, mask=mask_r)
        gl.store(y_base + offs, gl.zeros([64, M_PAD], gl.float32, rt_layout), mask=mask_r)
        rf = r.to(gl.float32)
        gl.atomic_add(ssq_ptr + layer * M_ROWS + cols_r, gl.sum(rf * rf, 0), mask=cols_r < M,
                      sem="relaxed", scope="gpu")

    @gluon.jit
    def _g_inv_rms(ssq_row, M, eps, H: gl.constexpr, M_PAD: gl.constexpr):
        """1 / sqrt(ssq / H + eps) for rows 0..M-1 (read with acquire), in the gate_up
        epilogue's column layout."""
        epi_layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
        cols_e = gl.arange(0, M_PAD, layout=gl.SliceLayout(0, epi_layout))
        zero = gl.zeros([M_PAD], gl.float32, gl.SliceLayout(0, epi_layout))
        q = gl.atomic_add(ssq_row + cols_e, zero, mask=cols_e < M, sem="acquire", scope="gpu")
        return gl.div_rn(zero + 1.0, gl.sqrt_rn(gl.div_rn(q, zero + H) + eps))

    @gluon.jit
    def _g_cross_consumer(tab, n, w_ring, a_ring, full, empty, epi, h_ptr, y_ptr, res_ptr,
                          nw_ptr, xs_ptr, ssq_ptr, gctr_ptr, count_ptr, ready_ptr, M, stride_hm,
                          eps, MAXC: gl.constexpr, M_PAD: gl.constexpr, HALF: gl.constexpr,
                          ROW_TILES: gl.constexpr, GK: gl.constexpr, H: gl.constexpr,
                          GROUPS: gl.constexpr, M_ROWS: gl.constexpr, STAGES: gl.constexpr,
                          PDL: gl.constexpr, V5: gl.constexpr):
        """count_ptr: v4 one counter (down items done), v5 one a row tile."""
        acc = _g_warpgroup_start(M_PAD, PDL)
        for c in range(n):
            acc, flags = _g_consume(tab, c, acc, w_ring, a_ring, full, empty, MAXC, STAGES)
            if (flags & 4) != 0:
                unit = gl.load(tab + 3 * MAXC + c)
                layer = flags >> 3
                if (flags & 1) == 0:
                    if V5:
                        ones = gl.full([M_PAD], 1.0, gl.float32, gl.SliceLayout(
                            0, gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])))
                        inv = ones
                        if layer > 0:  # x = r / rms: scale the sums (the weight is in W)
                            inv = _g_inv_rms(ssq_ptr + (layer - 1) * M_ROWS, M, eps, H, M_PAD)
                        _g_glu_epilogue(acc, epi, h_ptr, gctr_ptr, unit, M, stride_hm, inv,
                                        HALF, GK, M_PAD, True, True)
                    else:
                        _g_glu_epilogue(acc, epi, h_ptr, gctr_ptr, unit, M, stride_hm, 0.0,
                                        HALF, GK, M_PAD, False, True)
                else:
                    y_base = y_ptr + (layer % 2) * M_ROWS * H
                    y_ptrs, cols_a = _g_acc_ptrs(y_base, unit, H, ROW_TILES, M_PAD)
                    gl.atomic_add(y_ptrs, acc, mask=(cols_a < M)[None, :], sem="relaxed",
                                  scope="gpu")
                    gl.thread_barrier()
                    if V5:
                        prev = gl.atomic_add(count_ptr + unit % ROW_TILES, 1, sem="acq_rel",
                                             scope="gpu")
                        if prev == GROUPS * (layer + 1) - 1:  # this row tile of y is complete
                            _v5_row_tile(unit, layer, y_base, res_ptr, ssq_ptr, M, H, ROW_TILES,
                                         M_PAD, M_ROWS)
                            _fence_proxy_async()
                            gl.thread_barrier()
                            gl.atomic_add(ready_ptr, 1, sem="release", scope="gpu")
                    else:
                        prev = gl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
                        if prev == ROW_TILES * GROUPS * (layer + 1) - 1:  # the layer's last
                            _v4_norm(layer, y_ptr, res_ptr, nw_ptr, xs_ptr, M, eps, H, M_ROWS)
                            _fence_proxy_async()
                            gl.thread_barrier()
                            gl.atomic_add(ready_ptr, 1, sem="release", scope="gpu")

    @gluon.jit
    def _mlp_cross_kernel(w_desc, x_desc, res_desc, h_desc, w_ptr, h_ptr, y_ptr, res_ptr, nw_ptr,
                          xs_ptr, ssq_ptr, tab_ptr, count_ptr, gctr_ptr, item_ctr_ptr, ready_ptr,
                          done_ptr, M, stride_hm, eps, MAXC: gl.constexpr, M_PAD: gl.constexpr,
                          HALF: gl.constexpr, ROW_TILES: gl.constexpr, TPG: gl.constexpr,
                          GK: gl.constexpr, H: gl.constexpr, M_ROWS: gl.constexpr,
                          NPROG: gl.constexpr, GROUPS: gl.constexpr, SSQ: gl.constexpr,
                          STAGES: gl.constexpr, PDL: gl.constexpr, V5: gl.constexpr,
                          PREFETCH: gl.constexpr):
        """v4 (V5 False) and v5. item_ctr: v4 one counter of down items, v5 one a row tile;
        ready: v4 counts layers whose x is out, v5 row tiles whose residual is."""
        tab, n = _g_my_chunks(tab_ptr, count_ptr, MAXC, PDL)
        w_ring, a_ring, full, empty, epi = _g_ws_rings(w_desc, h_desc, STAGES, M_PAD)
        gl.warp_specialize([
            (_g_cross_consumer, (tab, n, w_ring, a_ring, full, empty, epi, h_ptr, y_ptr, res_ptr,
                                 nw_ptr, xs_ptr, ssq_ptr, gctr_ptr, item_ctr_ptr, ready_ptr, M,
                                 stride_hm, eps, MAXC, M_PAD, HALF, ROW_TILES, GK, H, GROUPS,
                                 M_ROWS, STAGES, PDL, V5)),
            (_g_cross_producer, (w_desc, x_desc, res_desc, h_desc, tab, n, w_ring, a_ring, full,
                                 empty, gctr_ptr, ready_ptr, w_ptr, MAXC, ROW_TILES, TPG, GROUPS,
                                 STAGES, M_ROWS, PDL, V5, ROW_TILES if V5 else 1, PREFETCH)),
        ], [1], [40])
        if _g_last_out(done_ptr, NPROG):
            _g_zero(gctr_ptr, 32, 64, gl.int32)
            _g_zero(item_ctr_ptr, ROW_TILES, 64, gl.int32)
            if V5:
                _g_zero(ssq_ptr, SSQ, SSQ, gl.float32)
            gl.store(ready_ptr, 0)
            gl.store(done_ptr, 0)


def _layer_tables(table: Tensor, counts: Tensor, layers: int, tiles: int, flags: bool = True
                  ) -> tuple[Tensor, Tensor]:
    """Each program's chunk list repeated for `layers` layers, the W tile indices moved on by
    `tiles` a layer (and, with flags, the layer in the flags' bits 3..)."""
    nprog = table.shape[0]
    big = torch.zeros(nprog, 4, triton.next_power_of_2(int(counts.max()) * layers),
                      dtype=torch.int32)
    for p in range(nprog):
        k = int(counts[p])
        parts = []
        for layer in range(layers):
            t = table[p, :, :k].clone()
            t[0] += layer * tiles
            if flags:
                t[2] |= layer << 3
            parts.append(t)
        big[p, :, :k * layers] = torch.cat(parts, dim=1)
    return big, counts * layers


class CrossMlp:
    """v4 (v5=False) or v5: `layers` MLPs, from x0 [M, H] and a zero residual (as `bench`'s
    chain), in one launch. ws: each layer's (gate_up, down, norm weight); `output()` is x_L,
    the last norm's output."""

    def __init__(self, m: int, cfg: MlpConfig, ws: list[tuple[Tensor, Tensor, Tensor]],
                 nprog: int, v5: bool, stages: int = 4, prefetch: int = 0) -> None:
        assert cfg.gbn == 32 and m <= 8
        assert not prefetch or (v5 and cfg.bk == 256), "the L2 prefetch is v5's, of 32 KB tiles"
        wgu0 = ws[0][0]
        dev, dt = wgu0.device, wgu0.dtype
        self.m, self.cfg, self.nprog, self.stages = m, cfg, nprog, stages
        self.v5, self.prefetch = v5, prefetch
        self.layers = len(ws)
        self.groups = INTER // (cfg.gc * cfg.bk)
        assert self.groups <= 31
        wts = []
        for i, (wgu, wd, _) in enumerate(ws):
            if v5 and i:  # the norm before this layer: its weight folded into gate and up
                wgu = (wgu.float() * ws[i - 1][2].float()[None, :]).to(dt)
            wts.append(tile_weights(wgu, wd, tile_k=cfg.bk))
        table, counts = build_chunks(nprog, cfg)
        big, total = _layer_tables(table, counts, self.layers, wts[0].shape[0] // TILE_N)
        self.table, self.counts, self.maxc = big.to(dev), total.to(dev), big.shape[-1]
        self.w = torch.cat(wts)
        self.nw = torch.stack([nw for _, _, nw in ws])
        self.h = torch.zeros(m, INTER, dtype=dt, device=dev)
        self.y = torch.zeros(2, 8, HIDDEN, dtype=torch.float32, device=dev)
        self.res = torch.zeros(m if v5 else 8, HIDDEN, dtype=dt, device=dev)
        # v4: x_0 .. x_L, a block of 8 rows each; v5: x_0 only
        self.xs = torch.zeros(m if v5 else (self.layers + 1) * 8, HIDDEN, dtype=dt, device=dev)
        self.ssq_n = triton.next_power_of_2(8 * self.layers)
        self.ssq = torch.zeros(self.ssq_n, dtype=torch.float32, device=dev)
        self.gctr = torch.zeros(64, dtype=torch.int32, device=dev)
        self.item_ctr = torch.zeros(64, dtype=torch.int32, device=dev)
        self.ready = torch.zeros(1, dtype=torch.int32, device=dev)
        self.done = torch.zeros(1, dtype=torch.int32, device=dev)
        bk = cfg.bk
        lay_w = gl.NVMMASharedLayout.get_default_for([TILE_N, bk], gl.bfloat16)
        lay_a = gl.NVMMASharedLayout.get_default_for([16, bk], gl.bfloat16)
        self.w_desc = GluonDescriptor(self.w, list(self.w.shape), [bk, 1], [TILE_N, bk], lay_w)
        self.x_desc = GluonDescriptor(self.xs, list(self.xs.shape), [HIDDEN, 1], [16, bk], lay_a)
        self.res_desc = GluonDescriptor(self.res, list(self.res.shape), [HIDDEN, 1], [16, bk],
                                        lay_a)
        self.h_desc = GluonDescriptor(self.h, [m, INTER], [INTER, 1], [16, bk], lay_a)

    def launch(self, x0: Tensor) -> None:
        self.xs[:self.m].copy_(x0)
        self.res.zero_()
        cfg = self.cfg
        pdl = pdl_enabled()
        _mlp_cross_kernel[(self.nprog,)](
            self.w_desc, self.x_desc, self.res_desc, self.h_desc, self.w, self.h, self.y,
            self.res, self.nw, self.xs, self.ssq, self.table, self.counts, self.gctr,
            self.item_ctr, self.ready, self.done, self.m, self.h.stride(0), 1e-6,
            MAXC=self.maxc, M_PAD=16, HALF=32, ROW_TILES=HIDDEN // TILE_N,
            TPG=cfg.gc * cfg.bk // 32, GK=cfg.gc * cfg.bk, H=HIDDEN, M_ROWS=8,
            NPROG=self.nprog, GROUPS=self.groups, SSQ=self.ssq_n, STAGES=self.stages, PDL=pdl,
            V5=self.v5, PREFETCH=self.prefetch, num_warps=4, **pdl_launch(pdl))

    def output(self) -> Tensor:
        """x_L: v4's last block of xs; v5's from the residual (HF's norm, on the host)."""
        if not self.v5:
            return self.xs[self.layers * 8:self.layers * 8 + self.m]
        r = self.res.float()
        x = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x.to(self.res.dtype) * self.nw[-1]


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


def _compile_caught(kernel: object, launch: Callable[[], object], ptx_out: str
                    ) -> dict[str, object]:
    """The Gluon kernel `launch()` would run (its launch caught, as kernel_regs does),
    compiled for sm_90a without a GPU: shared memory, and registers from ptxas -v; the PTX is
    written to ptx_out."""
    import re
    import subprocess
    import tempfile

    from kernel_regs import TARGET, _ptxas
    from triton.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    from arle_kernels.jit import set_pdl

    caught: list[tuple[tuple[object, ...], dict[str, object]]] = []
    cls: Any = type(kernel)
    original = cls.run

    def record(self: object, *args: object, grid: object, warmup: bool, **kw: object) -> None:
        caught.append((args, kw))

    cls.run = record
    try:
        set_pdl(True)
        launch()
    finally:
        cls.run = original
        set_pdl(None)
    args, kw = caught[0]
    k: Any = kernel
    backend = make_backend(TARGET)
    binder = create_function_from_signature(k.signature, k.params, backend)
    bound, spec, opts = binder(*args, **kw)
    options, signature, constexprs, attrs = k._pack_args(backend, kw, bound, spec, opts)
    compiled = triton.compile(GluonASTSource(k, signature, constexprs, attrs), target=TARGET,
                              options=options.__dict__)
    Path(ptx_out).write_text(compiled.asm["ptx"])
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([_ptxas(), "-v", "-arch=sm_90a", ptx_out, "-o",
                              str(Path(tmp) / "k.cubin")], capture_output=True, text=True,
                             check=True).stderr
    used = re.search(r"Used (\d+) registers", out)
    return {"shared": compiled.metadata.shared,
            "registers": int(used.group(1)) if used else None, "ptxas": out[-300:]}


def compile_stream(cfg: MlpConfig, m: int, stages: int, skip: int = 0, ws: bool = False
                   ) -> dict[str, object]:
    """v2 (v3 with ws) compiled for sm_90a without a GPU (on CPU tensors)."""
    mlp = StreamMlp(m, cfg, torch.device("cpu"), 132, stages, skip, ws)
    rows = (2 * INTER * HIDDEN + HIDDEN * INTER) // cfg.bk
    wt = torch.zeros(rows, cfg.bk, dtype=torch.bfloat16)
    x = torch.zeros(m, HIDDEN, dtype=torch.bfloat16)
    kernel = _mlp_ws_kernel if ws else _mlp_stream_kernel
    return {"stages": stages, "ws": ws, "cfg": asdict(cfg)} | _compile_caught(
        kernel, lambda: mlp(x, wt), "/tmp/stream.ptx")


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
    big, total = _layer_tables(table, counts, layers, tiles_per_layer, flags=False)
    allm.table, allm.counts, allm.maxc = big.cuda(), total.cuda(), big.shape[-1]
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
    """v4 (v5: with a 6-chunk L2 prefetch) compiled for sm_90a without a GPU (CPU tensors)."""
    bf = torch.bfloat16
    w3 = (torch.zeros(2 * INTER, HIDDEN, dtype=bf), torch.zeros(HIDDEN, INTER, dtype=bf),
          torch.zeros(HIDDEN, dtype=bf))
    mlp = CrossMlp(m, MlpConfig(bk=256, gc=2), [w3] * layers, 132, v5, prefetch=6 if v5 else 0)
    return {"v5": v5} | _compile_caught(
        _mlp_cross_kernel, lambda: mlp.launch(torch.zeros(m, HIDDEN, dtype=bf)), "/tmp/cross.ptx")


def cross(layers: int, nprog: int, v5: bool) -> dict[str, object]:
    """v4 (call 13) or v5 (calls 14-15: without and with L2 prefetches) against the engine's
    chain (MLP + add_rms_norm a layer, from a zero residual): the outputs after 1, 2 and
    `layers` layers, then each timed as a CUDA graph, interleaved with the engine's."""
    import time

    cfg = MlpConfig(bk=256, gc=2)
    gen = torch.Generator(device="cuda").manual_seed(4)
    ws = _weights(layers, gen)
    x0 = torch.randn(8, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    res = torch.zeros(8, HIDDEN, dtype=torch.bfloat16, device="cuda")
    name = "v5" if v5 else "v4"

    def engine(n: int) -> Tensor:
        res.zero_()
        h = x0
        for wgu, wd, nw in ws[:n]:
            h, _ = add_rms_norm(gemv_split_sums(gemv_silu_mul(h, wgu), wd), res, nw, 1e-6)
        return h
    out: dict[str, object] = {"layers": layers}
    for n in (1, 2, layers):
        mlp = CrossMlp(8, cfg, ws[:n], nprog, v5, prefetch=6 if v5 else 0)
        t = time.perf_counter()
        mlp.launch(x0)
        torch.cuda.synchronize()
        got = mlp.output().float()
        ref = engine(n).float()
        err = ((got - ref).norm() / ref.norm()).item()
        out[f"rel_err_{n}_layers"] = err
        print(f"{name} {n} layers: ran in {time.perf_counter() - t:.3f} s, rel err vs engine "
              f"{err:.2e}, counters {int(mlp.gctr.abs().sum() + mlp.item_ctr.sum() + mlp.ready)}",
              flush=True)
    variants = {6 if v5 else 0: mlp} | ({k: CrossMlp(8, cfg, ws, nprog, v5, prefetch=k)
                                         for k in (0, 3, 10)} if v5 else {})
    bodies = [("engine", lambda: engine(layers))] + [
        (f"{name}_one_launch_prefetch{k}", lambda k=k: variants[k].launch(x0))
        for k in sorted(variants)]
    mlp_bytes = 3 * INTER * HIDDEN * 2
    for rnd in range(2):
        for label, body in bodies:
            us = _graph_us(body) / layers
            out[f"{label}_r{rnd}"] = {"us_per_layer": us, "tb_s": mlp_bytes / us / 1e6}
            print(f"{label:26} round {rnd}: {us:7.2f} us a layer, "
                  f"{mlp_bytes / us / 1e6:5.2f} TB/s", flush=True)
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
    ap.add_argument("--cross", action="store_true", help="call 13: v4 against the engine")
    ap.add_argument("--cross5", action="store_true", help="calls 14-15: v5 against the engine")
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
        if args.cross or args.cross5:
            result["cross"] = cross(args.layers, nprog, v5=args.cross5)
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
