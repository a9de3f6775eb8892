"""The CPU thread governor (arle/threads.py): fewer torch threads while the cores are shared,
all of them again once a probe keeps its cores."""

from __future__ import annotations

import pytest

from arle import threads as threads_mod
from arle.threads import ThreadGovernor


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(threads_mod.time, "monotonic", lambda: now[0])
    return now


def test_threads_follow_the_cores_the_process_gets(clock: list[float]) -> None:
    gov = ThreadGovernor(2)
    assert gov.record(0.3, 0.6) is None  # a window is 0.5 s of steps
    assert gov.record(0.3, 0.55) is None  # 2 threads, 1.9 cores: alone
    assert gov.record(0.6, 0.62) is None  # 1 core of 2: once can be a kernel's JIT
    assert gov.record(0.6, 0.62) == 1  # twice in a row: shared
    assert gov.record(0.6, 0.6) is None  # 1 thread keeps its core; too early to probe
    clock[0] += ThreadGovernor.BACKOFF_S[0]
    assert gov.record(0.6, 0.6) == 2  # the probe
    assert gov.record(0.6, 0.65) == 1  # it lost: back down, the back-off doubled
    clock[0] += ThreadGovernor.BACKOFF_S[0]
    assert gov.record(0.6, 0.6) is None
    clock[0] += ThreadGovernor.BACKOFF_S[0]
    assert gov.record(0.6, 0.6) == 2  # the next probe
    assert gov.record(0.6, 1.2) is None  # it kept its cores: it stays
    assert gov.current == 2 and gov.backoff == ThreadGovernor.BACKOFF_S[0]


def test_a_short_window_changes_nothing(clock: list[float]) -> None:
    gov = ThreadGovernor(4)
    assert gov.record(0.1, 0.01) is None and gov.current == 4


def test_one_low_window_between_good_ones_changes_nothing(clock: list[float]) -> None:
    gov = ThreadGovernor(2)
    for cpu in (1.1, 0.6, 1.1, 0.6, 1.1):
        assert gov.record(0.6, cpu) is None
    assert gov.current == 2
