"""How arle's Triton kernels are compiled and launched.

- `jit_varying`: @triton.jit for kernels some of whose arguments change from step to step.
- `watch_compiles`: a callback for every kernel variant Triton builds (serving watches with it).
- `compile_ahead`: launches turned into compiles in worker processes (start-up builds its
  variants side by side); `start_cache_key` readies what every build needs first.
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
import dataclasses
import hashlib
import importlib
import inspect
import multiprocessing
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import triton
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Every environment variable kernels/ reads, read once here (Triton, too, decides when a kernel
# is defined whether it runs interpreted).
#: the Triton interpreter (kernel tests on the CPU): nothing is compiled, no PDL, no TMA
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Debug switches, only for A/B benchmarks:
#: ARLE_PDL=0: every kernel launches without programmatic dependent launch
_PDL_SWITCH = os.environ.get("ARLE_PDL", "1") != "0"
#: ARLE_BUILD_PROCESSES=0: `compile_ahead` builds on threads only (no worker processes)
_BUILD_PROCESSES = os.environ.get("ARLE_BUILD_PROCESSES", "1") != "0"


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


_cache_key: threading.Thread | None = None


def start_cache_key() -> None:
    """Start computing Triton's own cache key on a thread of its own: call it before loading
    a model, so that the key is ready when start-up builds (or loads) its first variant.

    Why: every variant's place in Triton's disk cache starts with a hash of Triton itself
    (`triton_key`: its sources and its library, hundreds of MB), computed once per process at
    the first build, on the way of every start-up, warm or cold; the hash runs without the
    GIL, beside the weights' load. NOTE: `triton_key` is cached per process
    (`functools.lru_cache`); `compile_ahead` waits for this thread, and any build before it
    would only compute the key a second time."""
    global _cache_key
    if _cache_key is not None or _INTERPRET:
        return
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # a Triton without it: its builds find their own way
        return

    def compute() -> None:
        with contextlib.suppress(Exception):  # a failure surfaces at the build that needs it
            triton_key()

    _cache_key = threading.Thread(target=compute, name="arle-triton-key", daemon=True)
    _cache_key.start()


@dataclasses.dataclass
class BuildsAhead:
    """What `compile_ahead` yields: whether it builds ahead (`on`), and once it has left, how
    many variants it built and how many of them a worker process compiled."""

    on: bool
    variants: int = 0
    in_processes: int = 0


@contextlib.contextmanager
def compile_ahead(workers: int | None = None, processes: bool = True) -> Iterator[BuildsAhead]:
    """Inside: every Triton launch builds its kernel variant on a pool of `workers` (default:
    one per CPU, at most 32) and runs nothing. On leaving, every variant is built and in its
    kernel's cache, so the same launches after it run at once. `on` in what it yields says
    whether it builds ahead: a Triton with async compiles (3.5+), not the interpreter;
    elsewhere launches run as usual.

    Why: from a cold cache, start-up would build its variants (dozens, up to a second or more
    each) one after another as each first runs; side by side they take a fraction of that. A
    build takes the GIL back many times (Triton's front end, between its MLIR passes), so
    threads wait on each other: with `processes` (Linux; off under ARLE_BUILD_PROCESSES=0) each
    variant missing from Triton's disk cache is compiled, with its launcher, by a worker process
    forked at the first such build (`_Builds`), and a thread of this process then loads it from
    that cache.
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
        available = not _INTERPRET
    stats = BuildsAhead(on=available)
    if _cache_key is not None:
        _cache_key.join()
    if not available:
        yield stats
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
    forks = processes and _BUILD_PROCESSES and "fork" in multiprocessing.get_all_start_methods()
    with (concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="arle-compile")
          as threads, _Builds(threads, workers if forks else 0, stats) as builds,
          AsyncCompileMode(builds)):
        JITFunction.run = build_only
        try:
            yield stats
        finally:  # NOTE: before AsyncCompileMode's exit, which waits for the builds
            JITFunction.run = launch


class _Builds:
    """`compile_ahead`'s executor (Triton's `AsyncCompileMode` hands it each build).

    A build is run on a thread, and makes its kernel's launcher there too: Triton (3.6)
    compiles a small C module (gcc) per kernel signature at the kernel's first launch, on the
    launching thread, one after another; made here, side by side, that first launch finds it
    in Triton's disk cache. With `processes` > 0, a worker process (forked at the first build,
    so it has every kernel module this one has) first compiles the variant and its launcher
    into that cache from the build's inputs (`_compile_inputs`), and the thread's build is then
    a load from the cache. A build whose inputs cannot be sent, or whose worker failed, is
    compiled on the thread as before (a compile error then surfaces from there).
    NOTE: the workers never touch the GPU (a forked child of a CUDA process must not): Triton
    compiles for the target it is given. Python warns that fork() in a process with threads
    may deadlock a child that needs a lock another thread held; a worker takes none of this
    process's locks but the interpreter's own, which fork() resets. They are forked only on a
    cache miss (a warm start forks nothing), and ARLE_BUILD_PROCESSES=0 keeps builds on
    threads."""

    def __init__(self, threads: concurrent.futures.Executor, processes: int,
                 stats: BuildsAhead) -> None:
        self._threads = threads
        self._processes = processes
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._stats = stats
        self._remote_done: list[bool] = []  # one per build sent to a worker: did it compile?

    def __enter__(self) -> _Builds:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._stats.in_processes = sum(self._remote_done)

    def _workers(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self._processes, mp_context=multiprocessing.get_context("fork"))
        return self._pool

    def submit(self, build: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        self._stats.variants += 1
        inputs = _compile_inputs(build) if self._processes else None
        remote = None
        if inputs is not None:
            try:
                with warnings.catch_warnings():  # the first submit forks: see the NOTE
                    warnings.simplefilter("ignore", DeprecationWarning)
                    remote = self._workers().submit(_compile_elsewhere, *inputs)
            except (OSError, RuntimeError):  # no fork here, or a worker died: threads only
                self._processes = 0

        def build_here() -> Any:
            if remote is not None:
                try:
                    remote.result()
                except Exception:  # compiled here instead (see the class)
                    self._remote_done.append(False)
                else:
                    self._remote_done.append(True)
            kernel = build()
            _make_launcher(kernel)
            return kernel

        return self._threads.submit(build_here)


def _compile_inputs(build: Callable[[], Any]) -> tuple[Any, ...] | None:
    """What a worker process needs to compile what `build` (Triton's closure over the source,
    target, options and environment, 3.5-3.9) compiles: the kernel by module and name (it must
    be that module's global) and the rest as plain data. None where it is not found as such,
    or where Triton's disk cache holds the variant already (a warm start: nothing to send)."""
    try:
        cells = dict(zip(build.__code__.co_freevars,
                         (c.cell_contents for c in build.__closure__ or ()), strict=True))
        src, target, options = cells["src"], cells["target"], cells["options"]
        env_vars = cells.get("env_vars")
        fn = src.fn.fn  # the source's JITFunction's Python function
        if getattr(sys.modules.get(fn.__module__), fn.__name__, None) is not src.fn:
            return None
        if _in_disk_cache(src, target, options, env_vars):
            return None
        return (fn.__module__, fn.__name__, src.signature, src.constants, src.attrs, target,
                dict(options.__dict__), env_vars)
    except (AttributeError, KeyError, ValueError):  # another Triton's closure
        return None


def _in_disk_cache(src: Any, target: Any, options: Any, env_vars: Any) -> bool:
    """Whether Triton's disk cache holds this variant: the lookup `triton.compile` starts with
    (3.5-3.9). False where that cannot be told (the variant then goes to a worker, which finds
    it there)."""
    try:
        from triton.compiler.compiler import get_cache_invalidating_env_vars, make_backend
        from triton.runtime.cache import get_cache_key, get_cache_manager

        backend = make_backend(target)
        parsed = backend.parse_options(dict(options.__dict__, **src.parse_options()))
        key = get_cache_key(src, backend, parsed, env_vars=env_vars if env_vars is not None
                            else get_cache_invalidating_env_vars())
        name = f"{src.name[:150]}.json"
        group = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(name)
    except Exception:  # another Triton's internals
        return False
    return bool(group) and name in group


def _compile_elsewhere(module: str, name: str, signature: Any, constexprs: Any, attrs: Any,
                       target: Any, options: dict[str, Any], env_vars: Any) -> None:
    """In a worker process: compile one variant, and its launcher, into Triton's disk cache."""
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(module), name)
    _make_launcher(triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                  options=options, _env_vars=env_vars))


def _make_launcher(kernel: Any) -> None:
    """Make (or load from Triton's disk cache) a built variant's launcher, as its first launch
    would (a C module compiled per kernel signature)."""
    from triton.runtime.driver import driver

    make = getattr(driver.active, "launcher_cls", None)
    if make is not None and hasattr(kernel, "src") and hasattr(kernel, "metadata"):
        make(kernel.src, kernel.metadata)


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
    if _INTERPRET:
        return False
    import torch

    return (torch.cuda.is_available() and torch.version.hip is None
            and torch.cuda.get_device_capability() >= (9, 0))


def _pdl_supported() -> bool:
    if not _PDL_SWITCH or not hopper_gpu():
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__


def pdl_enabled() -> bool:
    """Whether kernels launch with PDL: an NVIDIA GPU of compute capability 9.0+, a Triton that
    has it, not the interpreter, and not switched off (ARLE_PDL=0, for A/B benchmarks).
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


__all__ = ["BuildsAhead", "compile_ahead", "gdc_launch_dependents", "gdc_wait", "hopper_gpu",
           "jit_varying", "pdl_enabled", "pdl_launch", "set_pdl", "start_cache_key",
           "watch_compiles"]
