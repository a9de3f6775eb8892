"""`arle.gcwatch`: the cyclic GC's pauses are counted and timed by generation, and start-up's
objects are frozen out of its walks."""

from __future__ import annotations

import gc

from arle.gcwatch import GCPauses, freeze_start_up


def _cycles(n: int) -> None:
    """n reference cycles that only the cyclic GC can free."""
    for _ in range(n):
        a: list[object] = []
        a.append(a)


def test_pauses_by_generation_and_events() -> None:
    pauses = GCPauses(keep_events=True).start()
    try:
        pauses.start()  # idempotent: one callback, so each collection counts once
        _cycles(1000)
        gc.collect(2)
        gc.collect(0)
    finally:
        pauses.stop()
    assert pauses.count[2] == 1 and pauses.count[0] >= 1
    assert 0.0 < pauses.max_s[2] <= pauses.total_s[2]
    assert pauses.events is not None
    gens = [g for _t, g, _s in pauses.events]
    assert gens.count(2) == 1 and sum(pauses.count) == len(pauses.events)
    full = next(e for e in pauses.events if e[1] == 2)
    assert full[2] == pauses.total_s[2]
    summary = pauses.summary()
    assert summary["gen2"]["count"] == 1 and summary["gen2"]["max_ms"] > 0.0
    # stopped: collections no longer count
    before = list(pauses.count)
    gc.collect(2)
    assert pauses.count == before


def test_freeze_start_up_takes_objects_out_of_full_passes() -> None:
    gc.collect()
    walked = len(gc.get_objects(generation=2))  # what a full pass walks now
    try:
        frozen = freeze_start_up()
        # NOTE: >=, not ==: a thread an earlier test left running may add to the permanent
        # generation between the two reads
        assert gc.get_freeze_count() >= frozen >= walked > 1000
        assert len(gc.get_objects(generation=2)) < walked // 10
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
