"""One typed config for an engine. Front ends build it from their flags; nothing else does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DType = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]


@dataclass(frozen=True)
class EngineConfig:
    #: A Hugging Face model directory or a .gguf file; None: ARLE_MODEL, then the default model.
    model: str | None = None
    dtype: DType = "auto"
    device: Device = "auto"
    #: Tokens per KV page. NOTE: the radix cache shares whole pages only.
    page_size: int = 16
    #: KV pool size in tokens; None: sized from `kv_cache_memory_gb` (CPU) or free memory (GPU).
    kv_cache_tokens: int | None = None
    kv_cache_memory_gb: float = 1.0
    #: Longest prompt + output a request may have; None: the model's context length.
    max_model_len: int | None = None
    #: Most requests decoding at once.
    max_running_requests: int = 64
    #: Token budget of one step (prefill chunk tokens + one per decode row).
    max_batched_tokens: int = 2048
    #: Longest prefill chunk of one request in one step.
    chunked_prefill_size: int = 512
    #: Bound of the waiting queue; over it `generate` raises OverloadedError.
    max_waiting_requests: int = 256
    enable_prefix_cache: bool = True
    #: Overlap CPU scheduling of step N+1 with the execution of step N.
    overlap: bool = True
    #: CPU threads for torch (None: torch's default).
    num_threads: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("page_size", "max_running_requests", "max_batched_tokens",
                     "chunked_prefill_size", "max_waiting_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise ValueError(f"kv_cache_tokens must be >= page_size ({self.page_size})")
