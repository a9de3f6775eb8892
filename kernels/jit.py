"""How arle's Triton kernels are compiled and launched.

- `jit_varying`: @triton.jit for kernels some of whose arguments change from step to step.
- `watch_compiles`: a callback for every kernel variant Triton builds (serving watches with it).
- `compile_ahead`: launches turned into compiles on a thread pool (start-up builds its variants
  side by side).
- `pdl_enabled` / `pdl_launch`: programmatic dependent launch (PDL, Hopper and later).

PDL: a kernel launched with it may start while the kernel before it in the stream is still
running, once every program of that kernel has called `gdc_launch_dependents` (ours do so
first thing, but for the TMA GEMV of most layers: kernels/gemv.py's `_late_trigger`). Its
programs get resident early and run what does not depend on the previous kernel (a GEMV
loads its first chunk of weights, attention its page table), then `gdc_wait` until that
kernel has finished and its writes are visible. A decode step is ~360 launches of a few
microseconds each, so the launch and ramp-up of each one hidden under its predecessor's tail
is time off every step. Inside a CUDA graph the edges become programmatic.
NOTE: the rule every kernel keeps: before `gdc_wait`, read only what no kernel of the step
writes (weights, the step's metadata copied in before the first kernel, the K/V cache slots of
earlier steps: decode attention leaves out each row's newest token) and write nothing.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import inspect
import os
from collections.abc import Callable, Iterator
from typing import Any

import triton
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def jit_varying(*names: str) -> Callable[[Any], Any]:
    """@triton.jit with no specialisation on `names`' values.

    Triton compiles a variant per class of each int argument (== 1, a multiple of 16, other) and
    per pointer alignment (16 bytes or not). For an argument that changes every step (a page
    table's width, a split count, a view that starts a few rows into a buffer) each new class
    is a compile of up to seconds in the middle of serving, stalling every request. Not
    specialising them gives one variant, built at warm-up."""
    kw: dict[str, Any] = {"do_not_specialize": list(names)}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        kw["do_not_specialize_on_alignment"] = list(names)

    def wrap(fn: Any) -> Any:
        # NOTE: Triton ignores a name that is no argument: a typo would silently bring back
        # the mid-serving compiles, so it fails here, at import
        unknown = [n for n in names if n not in inspect.signature(fn).parameters]
        if unknown:
            raise TypeError(f"{fn.__name__} has no argument {', '.join(unknown)}")
        return triton.jit(**kw)(fn)
    return wrap


def watch_compiles(on_build: Callable[[str], None]) -> Callable[[], None] | None:
    """Call on_build(kernel and signature) for every Triton kernel variant this process builds
    from now on (or loads from Triton's disk cache); returns a function that stops watching.

    Serving calls it after warm-up: a variant built later is a stall of up to seconds (a
    compile) for every running request, and one the warm-up should have built. Needs Triton's
    `knobs` (3.4+); elsewhere it watches nothing and returns None."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        return None
    previous = runtime.jit_cache_hook

    def hook(*args: object, **kwargs: object) -> bool:
        on_build(str(kwargs.get("repr", "")))
        return False  # go on and build it

    runtime.jit_cache_hook = hook

    def stop() -> None:
        runtime.jit_cache_hook = previous
    return stop


@contextlib.contextmanager
def compile_ahead(workers: int | None = None) -> Iterator[bool]:
    """Inside: every Triton launch builds its kernel variant on a pool of `workers` threads
    (default: one per CPU, at most 32) and runs nothing. On leaving, every variant is built and
    in its kernel's cache, so the same launches after it run at once. Yields whether it is on:
    a Triton with async compiles (3.5+), not the interpreter; elsewhere launches run as usual.

    Why: from a cold cache, start-up builds its variants one after another as each first runs
    (Qwen3-4B with `arle serve`'s settings: 39, 0.1-1.4 s each, ~13 s on the H200's host).
    Most of a build (MLIR passes, LLVM, ptxas) runs without the GIL, so threads build them side
    by side, each with its launcher (the engine's start-up 14-24 -> 9 s,
    docs/benchmarks/gpu-2026-11-30o.md).
    NOTE: no kernel inside runs, so nothing it would write is written: pass through it only
    work whose results are thrown away, and nothing that reads a kernel's output on the host
    to decide what to launch next (decode and extend steps never do: they are captured in CUDA
    graphs)."""
    from triton.runtime.jit import JITFunction

    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # a Triton before async compiles
        available = False
    else:
        available = os.environ.get("TRITON_INTERPRET") != "1"
    if not available:
        yield False
        return
    launch = JITFunction.run
    seen: set[tuple[Any, ...]] = set()

    def build_only(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        # NOTE: Triton caches a variant only once it is built (on leaving), so each repeat of
        # a launch (every layer's) would take its slow path again: repeats stop here, by a key
        # at least as fine as Triton's (a launch it wrongly took for a repeat would only be
        # built later, when it runs)
        key = (self, *map(_launch_key, args), *((k, _launch_key(v)) for k, v in kwargs.items()))
        if key in seen:
            return None
        seen.add(key)
        return launch(self, *args, grid=grid, warmup=True, **kwargs)

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = workers or min(32, cpus or 1)
    with (concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="arle-compile")
          as pool, AsyncCompileMode(_BuildsWithLaunchers(pool))):
        JITFunction.run = build_only
        try:
            yield True
        finally:  # NOTE: before AsyncCompileMode's exit, which waits for the builds
            JITFunction.run = launch


class _BuildsWithLaunchers:
    """`compile_ahead`'s executor: each build on the pool also makes its kernel's launcher.
    Triton (3.6) compiles a small C module (gcc) per kernel signature at the kernel's first
    launch, on the launching thread, one after another; made here, side by side, that first
    launch finds it in Triton's disk cache."""

    def __init__(self, pool: concurrent.futures.Executor) -> None:
        self._pool = pool

    def submit(self, build: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        def build_and_link() -> Any:
            kernel = build()
            from triton.runtime.driver import driver

            make = getattr(driver.active, "launcher_cls", None)
            if make is not None and hasattr(kernel, "src") and hasattr(kernel, "metadata"):
                make(kernel.src, kernel.metadata)
            return kernel

        return self._pool.submit(build_and_link)


def _launch_key(arg: Any) -> Any:
    """What of a launch argument may decide its Triton variant: a tensor's dtype and alignment,
    a descriptor's layout, any other value itself (an unknown object: itself, by identity)."""
    if hasattr(arg, "data_ptr"):  # a tensor
        return (arg.dtype, arg.data_ptr() % 16)
    if hasattr(arg, "block_shape") and hasattr(arg, "base"):  # a TMA tensor descriptor
        return (_launch_key(arg.base), tuple(arg.shape), tuple(arg.strides),
                tuple(arg.block_shape))
    try:
        hash(arg)
    except TypeError:
        return id(arg)
    return (type(arg), arg)  # NOTE: True == 1, but Triton takes a bool and an int apart


_pdl: bool | None = None


def hopper_gpu() -> bool:
    """An NVIDIA GPU of compute capability 9.0+ to compile for, not the interpreter: what PDL
    and the TMA GEMV (`arle_kernels.gemv.tma_available`) both need first."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    import torch

    return (torch.cuda.is_available() and torch.version.hip is None
            and torch.cuda.get_device_capability() >= (9, 0))


def _pdl_supported() -> bool:
    if os.environ.get("ARLE_PDL", "1") == "0" or not hopper_gpu():
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__


def pdl_enabled() -> bool:
    """Whether kernels launch with PDL: an NVIDIA GPU of compute capability 9.0+, a Triton that
    has it, not the interpreter, and ARLE_PDL not "0" (the switch benchmarks compare with).
    Decided once per process (`set_pdl` overrides it)."""
    global _pdl
    if _pdl is None:
        _pdl = _pdl_supported()
    return _pdl


def set_pdl(on: bool | None) -> None:
    """Force PDL on or off for the launches that follow (None: decide again). For tests and
    benchmarks; a CUDA graph keeps what it was captured with."""
    global _pdl
    _pdl = on


_PDL_ON: dict[str, Any] = {"launch_pdl": True}
_PDL_OFF: dict[str, Any] = {}


def pdl_launch(pdl: bool) -> dict[str, Any]:
    """The launch keyword of a kernel taking `PDL: tl.constexpr` (nothing when off: the
    interpreter knows no such option). NOTE: shared dicts (every launch unpacks one; none
    builds a new one); never modify them."""
    return _PDL_ON if pdl else _PDL_OFF


__all__ = ["compile_ahead", "gdc_launch_dependents", "gdc_wait", "hopper_gpu", "jit_varying",
           "pdl_enabled", "pdl_launch", "set_pdl", "watch_compiles"]
