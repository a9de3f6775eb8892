"""Every environment variable arle reads, and the one module that reads them.

A flag given on the command line wins over its variable. Variables set to an empty string are
returned as they are: each caller says what an empty value means (most treat it as unset).

The kernels (package `arle_kernels`, which imports nothing of arle's) read theirs in
kernels/jit.py: `TRITON_INTERPRET` (Triton's interpreter, for the CPU kernel tests) and two
debug switches for A/B benchmarks, `ARLE_PDL=0` (no programmatic dependent launch) and
`ARLE_BUILD_PROCESSES=0` (start-up builds on threads, not in worker processes).

NOTE: a bottom-layer module: the standard library only, nothing of arle's.
"""

from __future__ import annotations

import os

ARLE_MODEL = "ARLE_MODEL"
ARLE_LOG_FORMAT = "ARLE_LOG_FORMAT"
ARLE_API_KEY = "ARLE_API_KEY"
XDG_DATA_HOME = "XDG_DATA_HOME"
XDG_CACHE_HOME = "XDG_CACHE_HOME"
TRITON_CACHE_DIR = "TRITON_CACHE_DIR"
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
NCCL_SOCKET_IFNAME = "NCCL_SOCKET_IFNAME"

#: Name -> what it does.
VARIABLES: dict[str, str] = {
    ARLE_MODEL: "The model when --model is not given: a Hugging Face model directory or a "
                ".gguf file (unset: the default model package).",
    ARLE_LOG_FORMAT: "--log-format when the flag is not given: console or json.",
    ARLE_API_KEY: "--api-key of `arle serve`, `arle chat --url` and `arle bench` when the flag "
                  "is not given.",
    XDG_DATA_HOME: "Base of arle's data directory, $XDG_DATA_HOME/arle (the chat history); "
                   "unset or relative: ~/.local/share.",
    XDG_CACHE_HOME: "Base of arle's cache directory, $XDG_CACHE_HOME/arle; unset or relative: "
                    "~/.cache.",
    TRITON_CACHE_DIR: "Where Triton keeps compiled kernels (Triton reads it; `arle doctor` "
                      "checks that it is writable); unset: ~/.triton/cache.",
    CUDA_VISIBLE_DEVICES: "The GPUs CUDA shows (CUDA reads it; `arle doctor` and `arle warmup` "
                          "say when it hides every GPU).",
    RANK: "Set by torchrun: this process's rank; with --tensor-parallel-size, arle joins "
          "torchrun's group (env:// rendezvous, MASTER_ADDR / MASTER_PORT) instead of "
          "starting its own ranks.",
    WORLD_SIZE: "Set by torchrun: the number of ranks (must equal --tensor-parallel-size).",
    LOCAL_RANK: "Set by torchrun: the rank on this host (its GPU's index).",
    NCCL_SOCKET_IFNAME: "The interface of NCCL's bootstrap sockets (NCCL reads it); unset, a "
                        "one-host tensor-parallel group sets it to lo (loopback).",
}


def get(name: str) -> str | None:
    """The value of `name`, one of VARIABLES; None when it is unset."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not in arle.env.VARIABLES: list it there first")
    return os.environ.get(name)


def model() -> str | None:
    """ARLE_MODEL; None when unset or empty."""
    return get(ARLE_MODEL) or None


def log_format() -> str | None:
    """ARLE_LOG_FORMAT; None when unset or empty."""
    return get(ARLE_LOG_FORMAT) or None


def triton_cache_dir() -> str | None:
    """TRITON_CACHE_DIR; None when unset or empty."""
    return get(TRITON_CACHE_DIR) or None


def cuda_visible_devices() -> str | None:
    """CUDA_VISIBLE_DEVICES as set: None when unset, "" (every GPU hidden) when empty."""
    return get(CUDA_VISIBLE_DEVICES)


def torchrun_rank() -> tuple[int, int, int] | None:
    """(RANK, WORLD_SIZE, LOCAL_RANK) when torchrun started this process, else None."""
    rank, world = get(RANK), get(WORLD_SIZE)
    if not rank or not world:
        return None
    return int(rank), int(world), int(get(LOCAL_RANK) or rank)


def nccl_on_loopback() -> None:
    """NCCL_SOCKET_IFNAME=lo for the processes of a one-host group, unless the user set it."""
    if get(NCCL_SOCKET_IFNAME) is None:
        os.environ[NCCL_SOCKET_IFNAME] = "lo"
