"""One typed config for an engine. Front ends build it from their flags; nothing else does."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

DType = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]
KVCacheDType = Literal["auto", "bfloat16", "float16", "float32", "fp8_e4m3"]

#: Defaults that depend on the device: (CPU, CUDA). A GPU wants wide steps and many rows.
DEVICE_DEFAULTS = {
    "max_running_requests": (64, 256),
    "max_batched_tokens": (2048, 16384),
    "chunked_prefill_size": (512, 8192),
}
#: What a server (`serving`) takes instead. Fewer prompt tokens a step on a GPU: requests that
#: arrive together then get their first tokens in turn, not all after one long step. On the
#: H200 (Qwen3-4B, 512-token prompts, new ones each run) a 1024-token budget against 16384, at
#: concurrency 8 in one call: TTFT 43 ms against 56, 2239 against 2191 output tok/s, TPOT 3.25
#: against 3.23 ms; at 16 and 64 (other calls) TTFT 67 / 310 ms against 137 / 387. But the
#: offline run, all work queued at once, lost 18% of its throughput at 1024 (same call), so
#: only `arle serve` takes it (docs/benchmarks/gpu-2026-11-30.md).
SERVING_DEFAULTS = {
    "max_batched_tokens": (2048, 1024),
}


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
    #: Most requests decoding at once (None: 64 on CPU, 256 on CUDA).
    max_running_requests: int | None = None
    #: Token budget of one step, prefill chunk tokens + one per decode row (None: 2048 / 16384;
    #: serving: 2048 / 1024).
    max_batched_tokens: int | None = None
    #: Longest prefill chunk of one request in one step (None: 512 / 8192).
    chunked_prefill_size: int | None = None
    #: Bound of the waiting queue; over it `generate` raises OverloadedError.
    max_waiting_requests: int = 256
    enable_prefix_cache: bool = True
    #: Overlap CPU scheduling of step N+1 with the execution of step N.
    overlap: bool = True
    #: CPU threads for torch (None: torch's default).
    num_threads: int | None = None
    seed: int = 0
    # ---- CUDA only ----
    #: Share of GPU memory for weights, activations and the KV pool; the pool takes what the
    #: weights and a profile run at the largest step leave (as SGLang's flag).
    mem_fraction_static: float = 0.85
    #: KV cache format; auto: the model dtype. fp8_e4m3 halves the pool's bytes per token.
    kv_cache_dtype: KVCacheDType = "auto"
    #: Replay decode steps as CUDA graphs (captured at start-up for a ladder of batch sizes).
    cuda_graph: bool = True
    #: Largest decode batch captured (None: max_running_requests).
    cuda_graph_max_bs: int | None = None
    #: An online server (`arle serve`): the unset fields take SERVING_DEFAULTS, which trade
    #: some throughput for time to first token.
    serving: bool = False

    def __post_init__(self) -> None:
        for name in ("page_size", "max_running_requests", "max_batched_tokens",
                     "chunked_prefill_size", "max_waiting_requests", "cuda_graph_max_bs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise ValueError(f"kv_cache_tokens must be >= page_size ({self.page_size})")

    def for_device(self, device: str) -> EngineConfig:
        """A copy with the device-dependent defaults (None fields) filled in."""
        col = 1 if device == "cuda" else 0
        defaults = DEVICE_DEFAULTS | (SERVING_DEFAULTS if self.serving else {})
        filled = {name: values[col] for name, values in defaults.items()
                  if getattr(self, name) is None}
        return replace(self, device=device, **filled)  # type: ignore[arg-type]
