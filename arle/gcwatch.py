"""Python's cyclic garbage collector while serving: what start-up leaves is frozen, and every
collection's pause is timed.

A collection runs on whichever thread allocates past a generation's threshold and holds the
GIL for its whole pass. In `arle serve` that stops the event loop, and with it every request's
next step, while the GPU runs dry. A full pass (generation 2) walks every tracked object that
is not frozen: after start-up that is hundreds of thousands (the compiled kernels and their
caches, the tokenizer, the graphs' bookkeeping), tens of milliseconds a pass.
`freeze_start_up` takes them out of the walk; `PAUSES` counts what is left
(`/v1/stats` and `/metrics` show it, `bench_gpu.py timeline` lines the pauses up with its steps).
"""

from __future__ import annotations

import gc
import time
from typing import Any


def freeze_start_up() -> int:
    """Collect once, then move every object alive now into the permanent generation, which
    collections never walk; returns how many were frozen. For a process that keeps what it
    built at start-up until it exits (nothing frozen is freed later)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw() -> None:
    """Undo `freeze_start_up` (at exit: frozen objects would never be finalized)."""
    gc.unfreeze()


class GCPauses:
    """Per generation: how many collections ran since `start`, their summed and longest pause.
    `events` (when kept): (start time on `time.perf_counter`, generation, seconds) of each.

    NOTE: the callback runs inside the collector, on any thread: it takes no lock and only
    updates numbers (a metrics library's lock taken there could be held already by the very
    thread the collection interrupted: a deadlock)."""

    def __init__(self, keep_events: bool = False) -> None:
        self.count = [0, 0, 0]
        self.total_s = [0.0, 0.0, 0.0]
        self.max_s = [0.0, 0.0, 0.0]
        self.events: list[tuple[float, int, float]] | None = [] if keep_events else None
        self._began = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        seconds = time.perf_counter() - self._began
        gen = info["generation"]
        self.count[gen] += 1
        self.total_s[gen] += seconds
        self.max_s[gen] = max(self.max_s[gen], seconds)
        if self.events is not None:
            self.events.append((self._began, gen, seconds))

    def start(self) -> GCPauses:
        """Begin timing (idempotent)."""
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, Any]:
        """{"gen0": {"count", "total_ms", "max_ms"}, "gen1": ..., "gen2": ...}."""
        return {f"gen{g}": {"count": self.count[g], "total_ms": round(self.total_s[g] * 1e3, 3),
                            "max_ms": round(self.max_s[g] * 1e3, 3)} for g in range(3)}


#: the process's one timer (`arle serve` starts it once warm)
PAUSES = GCPauses()

__all__ = ["PAUSES", "GCPauses", "freeze_start_up"]
