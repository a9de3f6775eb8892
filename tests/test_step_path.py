"""One step on its way to the device: `pack_step` layouts, and the CUDA graphs' static inputs.

Both executors run every step through it (the engine and parity tests cover it end to end on
the CPU); these tests pin down the layout the CUDA graphs and the kernels rely on: segment
alignment, graph padding, page tables.
"""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import torch
from model_dirs import write_qwen3_5_dir

from arle.engine.request import SamplingParams
from arle.executor.cuda_graphs import DecodeGraphs, ExtendGraphs
from arle.executor.paged import (
    _ALIGN,
    KVCache,
    PagedAttention,
    StatePool,
    pack_step,
    step_views,
)
from arle.executor.plan import Row, StepPlan
from arle.model.loader import LoadedModel, load_model

PS = 16


def _plan(decode_lens: list[int], prefill: list[tuple[int, int]], seed: int = 0,
          num_pages: int = 1000) -> StepPlan:
    """Decode rows of the given lengths (context incl. the new token), then prefill rows of
    (cached prefix, new tokens); pages drawn at random (never in order)."""
    rng = random.Random(seed)
    free = list(range(num_pages))
    rng.shuffle(free)
    rows = []
    for i, n in enumerate(decode_lens):
        pages = [free.pop() for _ in range(-(-n // PS))]
        rows.append(Row(slot=i, start=n - 1, num_tokens=1, input_ids=None, sample=True,
                        sample_offset=3, pages=pages, params=SamplingParams()))
    for j, (prefix, n) in enumerate(prefill):
        pages = [free.pop() for _ in range(-(-(prefix + n) // PS))]
        ids = [rng.randrange(50000) for _ in range(n)]
        rows.append(Row(slot=len(decode_lens) + j, start=prefix, num_tokens=n, input_ids=ids,
                        sample=j % 2 == 0, sample_offset=0, pages=pages,
                        params=SamplingParams()))
    return StepPlan(step_id=1, rows=rows)


@pytest.mark.parametrize(("decode", "prefill"), [
    ([], [(0, 5)]), ([17], []), ([1, 16, 33], [(0, 1), (32, 17)]), ([], [(5, 40), (0, 3)])])
def test_eager_layout(decode: list[int], prefill: list[tuple[int, int]]) -> None:
    plan = _plan(decode, prefill)
    packed = pack_step(plan, PS)
    nd = len(decode)
    positions, slots, ids = [], [], []
    for r in plan.rows:  # token by token, straight from the definition of a page table
        for p in range(r.start, r.seq_len):
            positions.append(p)
            slots.append(r.pages[p // PS] * PS + p % PS)
        ids += r.input_ids if r.input_ids is not None else [0]
    assert packed.segment("positions") == positions
    assert packed.segment("kv_slots") == slots
    assert packed.segment("input_ids") == ids
    assert packed.segment("seq_lens") == [r.seq_len for r in plan.rows]
    assert packed.segment("row_slots") == [r.slot for r in plan.rows]
    assert packed.segment("row_slots")[:nd] == list(range(nd))
    table = packed.segment("page_table")
    for i, r in enumerate(plan.rows):
        row = table[i * packed.max_pages:(i + 1) * packed.max_pages]
        assert row[:len(r.pages)] == r.pages and set(row[len(r.pages):]) <= {0}
    cu = packed.segment("cu_q_lens")
    assert cu[0] == 0 and [b - a for a, b in itertools.pairwise(cu)] == [n for _, n in prefill]
    ends = list(itertools.accumulate(r.num_tokens for r in plan.rows))
    assert packed.sample_rows == [e - 1 for e, r in zip(ends, plan.rows, strict=True) if r.sample]
    assert packed.max_q_len == max([n for _, n in prefill], default=1)
    # NOTE: every segment 16-byte aligned (Triton specialises pointers on alignment)
    assert all(start % _ALIGN == 0 for start, _ in packed.offsets.values())


def test_graph_layout_pads_to_the_batch_size() -> None:
    plan = _plan([1, 17, 40], [], seed=1)
    packed = pack_step(plan, PS, graph_bs=8, pad_slot=99)
    start = packed.offsets["decode_slots"][0]
    assert start % _ALIGN == 0
    block = packed.meta[start:start + 4 * 8]  # the graph's static meta block, copied whole
    slots, positions, kv_slots, seq_lens = (block[i * 8:(i + 1) * 8] for i in range(4))
    assert slots == [0, 1, 2] + [99] * 5
    assert positions == [0, 16, 39] + [0] * 5
    assert seq_lens == [1, 17, 40] + [1] * 5
    rows = plan.rows
    assert kv_slots[:3] == [r.pages[r.start // PS] * PS + r.start % PS for r in rows]
    assert kv_slots[3:] == [-1] * 5  # padding rows write no K/V
    table = packed.segment("page_table")
    assert len(table) == 8 * packed.max_pages == 8 * 3
    assert table[3:6] == rows[1].pages + [0] and table[9:24] == [0] * 15
    assert packed.sample_rows == [0, 1, 2]


def test_graph_inputs_compute_what_the_eager_step_does(tiny: LoadedModel) -> None:
    """A decode step through the CUDA graphs' static buffers (padded to the batch size, loaded
    with `DecodeGraphs.load`) gives the eager step's logits and writes the same K/V, padding
    rows writing nothing. Run on the CPU with the kernels' torch references (no capture)."""
    model, cfg = tiny.model, tiny.config
    lens = [5, 20, 33]
    prefill = _plan([], [(0, n + 1) for n in lens], seed=2, num_pages=32)
    kv = KVCache.allocate(cfg.num_layers, 32, PS, cfg.num_kv_heads, cfg.head_dim,
                          torch.float32, torch.device("cpu"))
    rotary = model.rotary_table(256)

    # prefill the prompts (without their last token: the decode step feeds it)
    for r in prefill.rows:
        r.num_tokens -= 1
        r.input_ids = [i % cfg.vocab_size for i in (r.input_ids or [])[:-1]]
    packed = pack_step(prefill, PS)
    step, _ = step_views(packed, torch.tensor(packed.meta, dtype=torch.int32), 1)
    model(step.input_ids, PagedAttention(kv, step, rotary, model))
    decode = StepPlan(2, [Row(slot=r.slot, start=n, num_tokens=1, input_ids=None, sample=True,
                              sample_offset=0, pages=r.pages, params=r.params)
                          for r, n in zip(prefill.rows, lens, strict=True)])
    token_buffer = torch.zeros(16, dtype=torch.int32)
    token_buffer[:3] = torch.tensor([7, 300, 4000], dtype=torch.int32)

    kv_eager = KVCache(kv.k.clone(), kv.v.clone(), None, None)
    packed = pack_step(decode, PS)
    step, slots = step_views(packed, torch.tensor(packed.meta, dtype=torch.int32), 1)
    step.input_ids[:3] = token_buffer[slots]
    eager = model.logits(model(step.input_ids, PagedAttention(kv_eager, step, rotary, model)))

    graphs = DecodeGraphs(max_bs=8, max_pages=8, device=torch.device("cpu"))
    bs = graphs.size_for(3)
    assert bs == 4
    graphs.num_splits[bs] = 1
    packed = pack_step(decode, PS, graph_bs=bs, pad_slot=15)
    graphs.load(packed, torch.tensor(packed.meta, dtype=torch.int32), bs)
    step = graphs.step(bs)  # its input ids: the rows' slots into the token buffer
    padded = model.logits(model(step.input_ids, PagedAttention(kv, step, rotary, model),
                                id_source=token_buffer))
    torch.testing.assert_close(padded[:3], eager, rtol=1e-5, atol=1e-5)
    # NOTE: close, not equal: a CPU's matmul may round 4 rows and 3 rows differently (it does
    # on some); a padding row's write would differ by O(1). The slots no step wrote hold the
    # same uninitialised bits in both (NaNs among them)
    torch.testing.assert_close(kv.k, kv_eager.k, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(kv.v, kv_eager.v, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("rows", [8, 200])
def test_extend_graph_inputs_compute_what_the_eager_step_does(tiny: LoadedModel,
                                                              rows: int) -> None:
    """A mixed step (decode rows beside prefill rows with and without a cached prefix) through
    an extend graph's static block (every row an extend row, padded to the graph's token count,
    the extend kernel's work as a block list) gives the eager step's logits and K/V. CPU, the
    kernels' torch references, no capture. rows 200: more than the 64-token graph's tokens,
    which bound its rows (and its logits) instead."""
    model, cfg = tiny.model, tiny.config
    plan = _plan([5, 20, 33], [(0, 9), (16, 30), (3, 1)], seed=4, num_pages=64)
    for r in plan.rows:
        if r.input_ids is not None:
            r.input_ids = [i % cfg.vocab_size for i in r.input_ids]
    kv = KVCache.allocate(cfg.num_layers, 64, PS, cfg.num_kv_heads, cfg.head_dim,
                          torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    kv.k.copy_(torch.randn(kv.k.shape, generator=gen))
    kv.v.copy_(torch.randn(kv.v.shape, generator=gen))
    rotary = model.rotary_table(256)
    token_buffer = torch.zeros(16, dtype=torch.int32)
    token_buffer[:3] = torch.tensor([7, 300, 4000], dtype=torch.int32) % cfg.vocab_size

    kv_eager = KVCache(kv.k.clone(), kv.v.clone(), None, None)
    packed = pack_step(plan, PS)
    meta = torch.tensor(packed.meta, dtype=torch.int32)
    step, slots = step_views(packed, meta, 1)
    step.input_ids[:3] = token_buffer[slots]
    hidden = model(step.input_ids, PagedAttention(kv_eager, step, rotary, model))
    eager = model.logits(hidden[packed.view(meta, "sample_index")])

    graphs = ExtendGraphs(max_tokens=128, rows=rows, block_t=4, max_pages=8,
                          vocab=cfg.vocab_size, pad_slot=15, device=torch.device("cpu"))
    t = graphs.size_for(plan.num_tokens, len(plan.rows))
    assert t == 64 and plan.num_tokens == 43
    assert graphs.shapes[t].rows == min(64, rows) and graphs.shapes[32].rows == min(32, rows)
    assert graphs.size_for(129, 2) == 0  # too many tokens: eager
    assert (graphs.size_for(10, 9) == 0) == (rows < 9)  # too many rows: eager
    packed = pack_step(plan, PS, pad_slot=15, extend=graphs.shapes[t])
    graphs.load(packed, torch.tensor(packed.meta, dtype=torch.int32), t)
    step, sample_index = graphs.step(t, token_buffer, pad_slot=15)
    assert step.extend_blocks is not None and step.num_tokens == 64
    padded = model.logits(model(step.input_ids, PagedAttention(kv, step, rotary, model))
                          [sample_index])
    torch.testing.assert_close(padded[:eager.shape[0]], eager, rtol=1e-5, atol=1e-5)
    # the same slots written (the projections of 43 and 64 rows may round apart in the last bit)
    torch.testing.assert_close(kv.k, kv_eager.k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv.v, kv_eager.v, rtol=1e-5, atol=1e-5)
    # every token block of every row listed once, then padding
    blocks = step.extend_blocks.view(-1, 2).tolist()
    expect = {(r, b) for r, row in enumerate(plan.rows) for b in range(-(-row.num_tokens // 4))}
    assert {tuple(p) for p in blocks if p[0] >= 0} == expect
    assert len([p for p in blocks if p[0] >= 0]) == len(expect)


def test_extend_graph_verify_rows_keep_the_eager_states(tmp_path: Path) -> None:
    """A hybrid model's verify step (a decode row, two verify rows sampling at each token and
    keeping their recurrent states, a prompt chunk) through an extend graph's static block
    gives the eager step's logits, slot states and kept states. CPU, torch references, no
    capture."""
    write_qwen3_5_dir(tmp_path, seed=3, vocab_size=259)
    loaded = load_model(str(tmp_path), "float32")
    model, cfg = loaded.model, loaded.config
    rng = random.Random(2)
    pages = list(range(1, 40))
    rng.shuffle(pages)

    def row(slot: int, start: int, n: int, decode: bool = False, entry: int = -1) -> Row:
        table = [pages.pop() for _ in range(-(-(start + n) // PS))]
        ids = None if decode else [rng.randrange(cfg.vocab_size) for _ in range(n)]
        spec = n - 1 if entry >= 0 else 0
        return Row(slot=slot, start=start, num_tokens=n, input_ids=ids, sample=True,
                   sample_offset=0, pages=table, params=SamplingParams(), verify=entry >= 0,
                   spec=spec, spec_entry=entry)

    plan = StepPlan(step_id=1, rows=[row(0, 20, 1, decode=True), row(1, 30, 4, entry=1),
                                     row(2, 14, 3, entry=0), row(3, 0, 9)])
    kv = KVCache.allocate(cfg.num_layers, 40, PS, cfg.num_kv_heads, cfg.head_dim,
                          torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    kv.k.copy_(torch.randn(kv.k.shape, generator=gen))
    kv.v.copy_(torch.randn(kv.v.shape, generator=gen))
    state = StatePool.for_model(model.rank_config, 8, 1, torch.float32, torch.device("cpu"),
                                spec=(2, 5))
    assert state is not None and state.spec_conv is not None and state.spec_ssm is not None
    for t in (state.conv, state.ssm):
        t.copy_(torch.randn(t.shape, generator=gen))
    rotary = model.rotary_table(256)
    token_buffer = torch.tensor([17] + [0] * 7, dtype=torch.int32)

    def run(extend: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        k, v = kv.k.clone(), kv.v.clone()
        st = StatePool(*(t.clone() if t is not None else None for t in (
            state.conv, state.ssm, state.boundary_conv, state.boundary_ssm, state.snap_conv,
            state.snap_ssm, state.spec_conv, state.spec_ssm)))
        assert st.spec_conv is not None and st.spec_ssm is not None
        st.spec_conv.fill_(float("nan"))
        st.spec_ssm.fill_(float("nan"))
        if extend:
            graphs = ExtendGraphs(max_tokens=32, rows=16, block_t=4, max_pages=8,
                                  vocab=cfg.vocab_size, pad_slot=7, device=torch.device("cpu"),
                                  keeps=True)
            t = graphs.size_for(plan.num_tokens, len(plan.rows), 1 + 4 + 3 + 1)
            assert t == 32
            packed = pack_step(plan, PS, pad_slot=7, extend=graphs.shapes[t])
            graphs.load(packed, torch.tensor(packed.meta, dtype=torch.int32), t)
            step, index = graphs.step(t, token_buffer, pad_slot=7)
        else:
            packed = pack_step(plan, PS)
            meta = torch.tensor(packed.meta, dtype=torch.int32)
            step, slots = step_views(packed, meta, 1)
            step.input_ids[:1] = token_buffer[slots]
            index = packed.view(meta, "sample_index")
        attn = PagedAttention(KVCache(k, v, None, None), step, rotary, model, st, PS)
        logits = model.logits(model(step.input_ids, attn)[index])[:9]
        return logits, [st.conv[:, :4], st.ssm[:, :4], st.spec_conv, st.spec_ssm]

    (eager, eager_states), (graph, graph_states) = run(False), run(True)
    torch.testing.assert_close(graph, eager, rtol=1e-5, atol=1e-5)
    for got, want in zip(graph_states, eager_states, strict=True):
        assert torch.equal(got.isnan(), want.isnan())
        torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=1e-5, atol=1e-5)
    # the kept states: every token of each verify row (entry 1: 4 tokens, entry 0: 3)
    kept = ~eager_states[3].isnan().flatten(3).all(-1)  # [layers, entries, positions]
    assert kept[:, 1, :4].all() and kept[:, 0, :3].all()
    assert not kept[:, 1, 4:].any() and not kept[:, 0, 3:].any()
