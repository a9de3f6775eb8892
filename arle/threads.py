"""The one thread that runs heavy torch work: model loading and every step."""

from __future__ import annotations

import concurrent.futures
import time

_TORCH_THREAD: concurrent.futures.ThreadPoolExecutor | None = None


def torch_thread() -> concurrent.futures.ThreadPoolExecutor:
    """The process's single torch worker thread (made on first use).

    NOTE: each thread that enters an OpenMP parallel region gets its own team of worker
    threads, which spin while idle; two teams on a small CPU fight for its cores (about half
    the decode speed on 2 cores). So all heavy torch work runs here; light calls (building
    small tensors) on other threads start no parallel region. On CUDA this thread is the
    launcher: it queues each step's kernels and returns.
    """
    global _TORCH_THREAD
    if _TORCH_THREAD is None:
        _TORCH_THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="arle-torch")
    return _TORCH_THREAD


class ThreadGovernor:
    """Fewer torch threads while the CPU's cores are shared, back up when they are free.

    Why: torch's OpenMP threads spin-wait between parallel regions. On 2 cores shared with
    another process's OpenMP team, each spins through time slices the other needs: a decode
    step of the default model took 276 ms against 21 ms alone; with two busy processes beside
    it, 77 ms at 2 threads against 28 ms at 1. A passive wait policy avoids the spinning but
    costs 2.4x alone (the many short regions of a step each wake the team).

    The signal: over a window of steps, the process's CPU time against the step time times
    the threads. Alone, the team keeps its cores (spinning counts): about 1. Sharing them, it
    gets its share of the cores: after two such windows in a row (one can be a first step's
    one-threaded kernel JIT), the threads drop to the cores it got. More threads are tried
    again after a back-off that doubles each time they lose."""

    WINDOW_S = 0.5  # step time one measurement spans
    SHARE = 0.7  # of its threads' CPU time, below which the cores are shared
    BACKOFF_S = (10.0, 640.0)  # first and longest wait before trying more threads again

    def __init__(self, threads: int) -> None:
        self.max = self.current = threads
        self.wall = self.cpu = 0.0
        self.backoff = self.BACKOFF_S[0]
        self.changed = time.monotonic()
        self.probing = False
        self.low = 0  # windows in a row that got fewer cores than threads

    def record(self, wall: float, cpu: float) -> int | None:
        """A step's wall and process CPU seconds -> the thread count to use from now, where it
        changes (else None)."""
        self.wall += wall
        self.cpu += cpu
        if self.wall < self.WINDOW_S:
            return None
        share = self.cpu / (self.wall * self.current)
        got = max(1, min(self.max, round(self.cpu / self.wall)))
        self.wall = self.cpu = 0.0
        now = time.monotonic()
        self.low = self.low + 1 if share < self.SHARE and got < self.current else 0
        if self.low and (self.low >= 2 or self.probing):  # a probe gets one window
            if self.probing:
                self.backoff = min(2 * self.backoff, self.BACKOFF_S[1])
            self.probing, self.low = False, 0
            return self._set(got, now)
        if self.low:
            return None
        if self.probing:  # the probe kept its cores
            self.probing, self.backoff = False, self.BACKOFF_S[0]
        elif self.current < self.max and now - self.changed >= self.backoff:
            self.probing = True
            return self._set(self.max, now)
        return None

    def _set(self, threads: int, now: float) -> int:
        self.current, self.changed = threads, now
        return threads
