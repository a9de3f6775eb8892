"""`jit_varying`: @triton.jit for kernels some of whose arguments change from step to step."""

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
