"""`jit_varying`: @triton.jit for kernels some of whose arguments change from step to step;
`watch_compiles`: a callback for every kernel variant Triton builds (serving watches with it)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import triton


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
