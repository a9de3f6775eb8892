"""One typed config for an engine, and the command-line flags that set it (ENGINE_OPTIONS).

Front ends build it from their flags; nothing else does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

DType = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]
KVCacheDType = Literal["auto", "bfloat16", "float16", "float32", "fp8_e4m3"]
Speculative = Literal["off", "ngram", "mtp"]
Quantization = Literal["none", "fp8"]

#: Defaults that depend on the device: (CPU, CUDA). A GPU wants wide steps and many rows.
DEVICE_DEFAULTS = {
    "max_running_requests": (64, 256),
    "max_batched_tokens": (2048, 16384),
    "chunked_prefill_size": (512, 8192),
}
#: What a server (`serving`) takes instead: a small per-step prompt budget on CUDA, so requests
#: that arrive together get their first tokens in turn instead of all after one long step.
#: Offline runs, all their work queued at once, keep the wide steps (more throughput).
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
    #: A second KV tier in host memory, in GB (0: off): pages the prefix cache evicts move
    #: there, and a prefix hit on them copies them back (pinned memory on CUDA).
    kv_host_cache_gb: float = 0.0
    #: KV pool size in tokens; None: sized from `kv_cache_memory_gb` (CPU) or free memory (GPU).
    kv_cache_tokens: int | None = None
    kv_cache_memory_gb: float = 1.0
    #: Longest prompt + output a request may have; None: the model's context length.
    max_model_len: int | None = None
    #: Most requests decoding at once (None: DEVICE_DEFAULTS).
    max_running_requests: int | None = None
    #: Token budget of one step, prefill chunk tokens + one per decode row (None: DEVICE_DEFAULTS;
    #: serving: SERVING_DEFAULTS).
    max_batched_tokens: int | None = None
    #: Longest prefill chunk of one request in one step (None: DEVICE_DEFAULTS).
    chunked_prefill_size: int | None = None
    #: Bound of the waiting queue; over it `generate` raises OverloadedError.
    max_waiting_requests: int = 256
    enable_prefix_cache: bool = True
    #: Hybrid models (Gated DeltaNet layers): recurrent-state snapshots the prefix cache keeps
    #: at page boundaries (None: one per running request).
    state_snapshots: int | None = None
    #: Overlap CPU scheduling of step N+1 with the execution of step N.
    overlap: bool = True
    #: CPU threads for torch (None: torch's default); with TP, each rank's.
    num_threads: int | None = None
    #: Ranks (one per device) the model is split over; rank 0 runs the engine (docs/parallel.md).
    tensor_parallel_size: int = 1
    seed: int = 0
    #: Speculative decoding: draft tokens and verify them in one forward (docs/speculative.md).
    #: ngram: drafts from the request's own prompt and output; mtp: from the model's
    #: multi-token prediction head (Qwen3.5).
    speculative: Speculative = "off"
    #: Most draft tokens a request verifies per step (None: the device's, 8 on CPU, 4 on
    #: CUDA: arle.engine.speculative.DEVICE_RULES).
    num_speculative_tokens: int | None = None
    # ---- CUDA only ----
    #: Share of GPU memory for weights, activations and the KV pool; the pool takes what the
    #: weights and a profile run at the largest step leave (as SGLang's flag).
    mem_fraction_static: float = 0.85
    #: KV cache format; auto: the model dtype. fp8_e4m3 halves the pool's bytes per token.
    kv_cache_dtype: KVCacheDType = "auto"
    #: fp8: a floating-point checkpoint's linears quantized at load to 128 x 128 block-scaled
    #: FP8 (the layout of Qwen's -FP8 releases), run by the FP8 kernels.
    quantization: Quantization = "none"
    #: Replay decode steps as CUDA graphs (captured at start-up for a ladder of batch sizes).
    cuda_graph: bool = True
    #: Largest decode batch captured (None: max_running_requests).
    cuda_graph_max_bs: int | None = None
    #: An online server (`arle serve`): the unset fields take SERVING_DEFAULTS, which trade
    #: some throughput for time to first token.
    serving: bool = False

    def __post_init__(self) -> None:
        for name in ("page_size", "max_running_requests", "max_batched_tokens",
                     "chunked_prefill_size", "max_waiting_requests", "cuda_graph_max_bs",
                     "tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.num_speculative_tokens is not None and not 1 <= self.num_speculative_tokens <= 8:
            raise ValueError("num_speculative_tokens must be in [1, 8], "
                             f"got {self.num_speculative_tokens}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.kv_host_cache_gb < 0:
            raise ValueError(f"kv_host_cache_gb must be >= 0, got {self.kv_host_cache_gb}")
        if self.state_snapshots is not None and self.state_snapshots < 0:
            raise ValueError(f"state_snapshots must be >= 0, got {self.state_snapshots}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise ValueError(f"kv_cache_tokens must be >= page_size ({self.page_size})")

    def for_device(self, device: str) -> EngineConfig:
        """A copy with the device-dependent defaults (None fields) filled in."""
        col = 1 if device == "cuda" else 0
        defaults = DEVICE_DEFAULTS | (SERVING_DEFAULTS if self.serving else {})
        filled = {name: values[col] for name, values in defaults.items()
                  if getattr(self, name) is None}
        return replace(self, device=device, **filled)  # type: ignore[arg-type]


@dataclass(frozen=True)
class EngineOption:
    """One EngineConfig field as a command-line flag; its type and default are the field's."""

    field: str
    flag: str
    help: str
    aliases: tuple[str, ...] = ()
    metavar: str | None = None
    min: float | None = None
    max: float | None = None
    #: The flag turns a boolean field off: `--no-prefix-cache` is enable_prefix_cache=False.
    inverted: bool = False

    @property
    def param(self) -> str:
        """The flag as a Python name: `--no-prefix-cache` -> no_prefix_cache."""
        return self.flag.removeprefix("--").replace("-", "_")


def _by_device(name: str) -> str:
    """The help text's default of a device-dependent field."""
    cpu, cuda = DEVICE_DEFAULTS[name]
    return f"default: {cpu} on CPU, {cuda} on CUDA"


#: The engine flags of `arle complete`, `chat`, `serve` and `warmup`, in --help order. The other
#: fields have no engine flag: `arle serve` sets max_waiting_requests (its --max-waiting) and
#: serving; page_size, kv_cache_memory_gb and seed keep their defaults.
ENGINE_OPTIONS: tuple[EngineOption, ...] = (
    EngineOption("model", "--model", aliases=("-m",), metavar="PATH",
                 help="A Hugging Face model directory or a .gguf file "
                      "(default: $ARLE_MODEL, else the SmolLM2-135M package)."),
    EngineOption("dtype", "--dtype",
                 help="Weight and activation dtype; auto: the model's (float32 on CPU)."),
    EngineOption("device", "--device", help="auto: cuda if available, else cpu."),
    EngineOption("max_model_len", "--max-model-len", min=1,
                 help="Longest prompt + output of a request (default: the model's context "
                      "length)."),
    EngineOption("max_running_requests", "--max-running-requests", min=1,
                 help=f"Most requests decoding at once ({_by_device('max_running_requests')}; "
                      "1 for `arle complete` and `arle chat`, which run one at a time)."),
    EngineOption("max_batched_tokens", "--max-batched-tokens", min=1,
                 help=f"Token budget of one engine step ({_by_device('max_batched_tokens')}; "
                      f"{SERVING_DEFAULTS['max_batched_tokens'][1]} for `arle serve` on CUDA)."),
    EngineOption("chunked_prefill_size", "--chunked-prefill-size", min=1,
                 help="Longest prefill chunk of one request per step "
                      f"({_by_device('chunked_prefill_size')})."),
    EngineOption("kv_cache_tokens", "--kv-cache-tokens", min=1,
                 help="KV cache size in tokens (default: sized from memory)."),
    EngineOption("enable_prefix_cache", "--no-prefix-cache", inverted=True,
                 help="Do not reuse the KV cache of shared prompt prefixes."),
    EngineOption("state_snapshots", "--state-snapshots", min=0,
                 help="Hybrid models: recurrent-state snapshots kept for prefix reuse "
                      "(default: one per running request; 0: no prefix reuse)."),
    EngineOption("overlap", "--disable-overlap", inverted=True,
                 help="Schedule the next step only after the current one ran."),
    EngineOption("num_threads", "--threads", min=1,
                 help="CPU threads for torch, fixed (default: torch's, fewer while other "
                      "processes share the cores; with --tp, each rank's)."),
    EngineOption("tensor_parallel_size", "--tensor-parallel-size", aliases=("--tp",), min=1,
                 help="Split the model over this many devices, one process each "
                      "(docs/parallel.md)."),
    EngineOption("speculative", "--speculative",
                 help="Speculative decoding: drafts from the request's own prompt and output "
                      "(ngram) or the model's multi-token prediction head (mtp: Qwen3.5), "
                      "verified in one forward (docs/speculative.md)."),
    EngineOption("num_speculative_tokens", "--num-speculative-tokens", min=1, max=8,
                 help="Most draft tokens a request verifies per step (default: 8 on CPU, 4 on "
                      "CUDA)."),
    EngineOption("mem_fraction_static", "--mem-fraction-static", min=0.05, max=0.99,
                 help="CUDA: share of GPU memory for weights, activations and the KV pool."),
    EngineOption("kv_host_cache_gb", "--kv-host-cache-gb", min=0,
                 help="A host-memory KV tier of this many GB: evicted prefix pages (and a "
                      "hybrid model's state snapshots) move there and prefix hits copy them "
                      "back (default 0: off)."),
    EngineOption("kv_cache_dtype", "--kv-cache-dtype",
                 help="CUDA: KV cache format (auto: the model dtype)."),
    EngineOption("quantization", "--quantization",
                 help="CUDA: fp8 quantizes a bf16/fp16/fp32 checkpoint's linears at load "
                      "(128x128 block FP8; norms, router, embeddings and lm_head stay)."),
    EngineOption("cuda_graph", "--disable-cuda-graph", inverted=True,
                 help="CUDA: run decode steps eagerly (no graph replay)."),
    EngineOption("cuda_graph_max_bs", "--cuda-graph-max-bs", min=1,
                 help="CUDA: largest decode batch captured (default: --max-running-requests)."),
)
