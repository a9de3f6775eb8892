"""The model's shape, read from an HF config.json dict (GGUF metadata is mapped to the same dict)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from arle.errors import ModelLoadError

#: config.json `architectures` entries we run, and what differs between them.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": {"qk_norm": False},
    "MistralForCausalLM": {"qk_norm": False},
    "Qwen2ForCausalLM": {"qk_norm": False},
    "Qwen3ForCausalLM": {"qk_norm": True},
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    attention_bias: bool
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: object) -> ModelConfig:
        """Build from a config.json dict; `source` names the file in errors."""
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            name = archs[0] if archs else cfg.get("model_type", "unknown")
            supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
            raise ModelLoadError(source, f"unsupported architecture {name!r} (supported: {supported})")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            # Qwen2 always has q/k/v biases (transformers ignores `attention_bias` there); others
            # say it with `attention_bias`.
            bias = arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False))
            max_pos = int(cfg.get("max_position_embeddings", 4096))
            window = cfg.get("sliding_window")
            if isinstance(window, int) and cfg.get("use_sliding_window", True):
                # NOTE: no sliding-window attention here yet. Within one window it equals full
                # attention, so cap the context there rather than silently attend past it.
                max_pos = min(max_pos, window)
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(cfg.get("rope_theta")
                                 or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
                max_position_embeddings=max_pos,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qk_norm=SUPPORTED_ARCHITECTURES[arch]["qk_norm"],
                attention_bias=bias,
                rope_scaling=_rope_scaling(cfg, source),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
                raw=cfg,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(source, f"bad config field: {e!r}") from None

    def kv_bytes_per_token(self, element_bytes: int, scale_bytes: int = 0) -> int:
        """Bytes of K and V per token, all layers, at `element_bytes` per element (plus
        `scale_bytes` per token and KV head: FP8 caches keep an fp32 scale there)."""
        per_head = self.head_dim * element_bytes + scale_bytes
        return 2 * self.num_layers * self.num_kv_heads * per_head


#: rope scaling types rope.py implements.
ROPE_SCALING_TYPES = ("linear", "dynamic", "llama3", "yarn")


def _rope_scaling(cfg: dict[str, Any], source: object) -> dict[str, Any] | None:
    # transformers 5 moved rope settings into `rope_parameters`; older configs use `rope_scaling`.
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind == "default":
        return None
    if kind not in ROPE_SCALING_TYPES:
        raise ModelLoadError(source, f"unsupported rope scaling type {kind!r} "
                                     f"(supported: {', '.join(ROPE_SCALING_TYPES)})")
    if kind in ("llama3", "yarn"):
        # As transformers: without it, the configured context is the pretrained one.
        rs = {"original_max_position_embeddings": cfg.get("max_position_embeddings", 4096), **rs}
    return {**rs, "rope_type": kind}
