"""How a plan is flattened for the device (`pack_step`), in both layouts.

Both executors run every step through it (the engine and parity tests cover it end to end on
the CPU); these tests pin down the layout the CUDA graphs and the kernels rely on: segment
alignment, graph padding, page tables.
"""

from __future__ import annotations

import itertools
import random

import pytest

from arle.engine.request import SamplingParams
from arle.executor.paged import _ALIGN, pack_step
from arle.executor.plan import Row, StepPlan

PS = 16


def _plan(decode_lens: list[int], prefill: list[tuple[int, int]], seed: int = 0) -> StepPlan:
    """Decode rows of the given lengths (context incl. the new token), then prefill rows of
    (cached prefix, new tokens); pages drawn at random (never in order)."""
    rng = random.Random(seed)
    free = list(range(1000))
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
    assert packed.segment("decode_slots") == list(range(nd))
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
