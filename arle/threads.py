"""The one thread that runs heavy torch work: model loading and every step."""

from __future__ import annotations

import concurrent.futures

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
