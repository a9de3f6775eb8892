"""Where arle keeps per-user files: the chat history (data) and compiled-kernel caches.

XDG base directories: `$XDG_DATA_HOME/arle` (default `~/.local/share/arle`) and
`$XDG_CACHE_HOME/arle` (default `~/.cache/arle`). Nothing here creates a directory: callers do,
when they write.
"""

from __future__ import annotations

import os
from pathlib import Path

from arle import env


def _xdg(var: str, fallback: str) -> Path:
    # NOTE: the spec says a relative value is invalid and must be ignored.
    value = env.get(var) or ""
    base = Path(value) if value and os.path.isabs(value) else Path.home() / fallback
    return base / "arle"


def data_dir() -> Path:
    return _xdg(env.XDG_DATA_HOME, ".local/share")


def cache_dir() -> Path:
    return _xdg(env.XDG_CACHE_HOME, ".cache")


def chat_history_path() -> Path:
    """The file `arle chat` keeps its input history in, across sessions."""
    return data_dir() / "chat_history"


def triton_cache_dir() -> Path:
    """Where Triton writes compiled kernels (its own default unless TRITON_CACHE_DIR is set)."""
    value = env.triton_cache_dir()
    return Path(value) if value else Path.home() / ".triton" / "cache"
