"""The CUDA executor's host side, on the CPU: how a plan is flattened for the device.

`pack_step` is checked against the CPU executor's `prepare` (the path the parity tests hold to
transformers): the same ids, positions, cache slots and page tables, in either layout.
"""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest

from arle.engine.request import SamplingParams
from arle.executor.cpu import CPUExecutor
from arle.executor.cuda import _ALIGN, pack_step
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
def test_eager_layout_matches_the_cpu_executor(decode: list[int],
                                               prefill: list[tuple[int, int]]) -> None:
    plan = _plan(decode, prefill)
    packed = pack_step(plan, PS)
    cpu = CPUExecutor.prepare(SimpleNamespace(page_size=PS), plan)  # type: ignore[arg-type]
    nd = len(decode)
    assert packed.segment("positions") == cpu.positions.tolist()
    assert packed.segment("kv_slots") == cpu.kv_slots.tolist()
    assert packed.segment("input_ids")[nd:] == cpu.input_ids.tolist()[nd:]
    assert packed.segment("seq_lens") == cpu.seq_lens
    assert packed.segment("decode_slots") == cpu.decode_slots.tolist()
    table = packed.segment("page_table")
    assert [table[i * packed.max_pages:(i + 1) * packed.max_pages]
            for i in range(len(plan.rows))] == cpu.page_tables.tolist()
    cu = packed.segment("cu_q_lens")
    assert cu[0] == 0 and [b - a for a, b in itertools.pairwise(cu)] == cpu.q_lens[nd:]
    assert packed.sample_rows == cpu.sample_index.tolist()
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
