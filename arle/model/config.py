"""The model's shape, read from an HF config.json dict (GGUF metadata is mapped to the same dict).

One `ModelConfig` describes every family: the dense fields, then what a layer may be instead
(`layer_types`: full attention or Gated DeltaNet; `moe`: expert MLPs) and how weights are stored
(`quant`). The decoder picks each layer's parts from it (`DecoderLayer`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from arle.errors import ModelLoadError

#: config.json `architectures` entries we run, and what differs between them: per-head q/k
#: norms; Qwen3.5's zero-centred norms, gated attention and Gated DeltaNet layers (`hybrid`);
#: the text config nested under `text_config` (the multimodal checkpoints).
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qk_norm": False},
    "MistralForCausalLM": {"qk_norm": False},
    "Qwen2ForCausalLM": {"qk_norm": False},
    "Qwen3ForCausalLM": {"qk_norm": True},
    "Qwen3MoeForCausalLM": {"qk_norm": True},
    "Qwen3_5ForCausalLM": {"qk_norm": True, "hybrid": True},
    "Qwen3_5ForConditionalGeneration": {"qk_norm": True, "hybrid": True, "nested": True},
    "Qwen3_5MoeForCausalLM": {"qk_norm": True, "hybrid": True},
    "Qwen3_5MoeForConditionalGeneration": {"qk_norm": True, "hybrid": True, "nested": True},
}

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet layers (Qwen3.5): heads and the causal conv's kernel size."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        """Channels of the conv (and of `in_proj_qkv`): q, k and v."""
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim

    def state_bytes(self, conv_bytes: int, state_bytes: int = 4) -> int:
        """One layer's state of one request: the conv's last kernel - 1 inputs and the
        delta-rule state [value heads, key dim, value dim]."""
        return (self.conv_dim * (self.conv_kernel - 1) * conv_bytes
                + self.num_value_heads * self.key_head_dim * self.value_head_dim * state_bytes)


@dataclass(frozen=True)
class MoEConfig:
    """Expert MLPs: which layers have them and how tokens are routed."""

    num_experts: int
    experts_per_token: int
    intermediate_size: int
    norm_topk_prob: bool
    #: every `sparse_step`-th layer is MoE, except `mlp_only_layers`
    sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    #: a shared expert beside the routed ones, its output scaled by sigmoid(gate) (Qwen3.5-MoE)
    shared_expert_intermediate_size: int = 0


@dataclass(frozen=True)
class QuantConfig:
    """How the checkpoint's linear weights are stored. Only block-scaled FP8 (e4m3) is read:
    `weight` float8_e4m3fn and `weight_scale_inv` fp32 per `block` of [out, in] elements."""

    method: str
    block: tuple[int, int]
    #: module name fragments whose linears stay unquantized (lm_head, the router gate, ...)
    modules_to_not_convert: tuple[str, ...] = ()
    #: `--quantization fp8`: a floating-point checkpoint, its linears quantized as they load
    at_load: bool = False


@dataclass(frozen=True)
class Int4Quant:
    """A 4-bit checkpoint (W4A16, `quantization_config`): AWQ's GEMM layout or GPTQ's, each
    quantized linear `X` stored as `X.qweight`, `X.qzeros`, `X.scales` (and GPTQ's `X.g_idx`)
    in groups of `group` input columns (arle/model/int_weights.py reads them)."""

    method: str  # "awq" | "gptq"
    group: int
    #: added to a stored zero: GPTQ's original format stores zero - 1
    zero_offset: int = 0


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
    #: rotary on the first `partial_rotary_factor` of each head's dims (Qwen3.5: 0.25)
    partial_rotary_factor: float = 1.0
    #: per layer, FULL_ATTENTION or LINEAR_ATTENTION; empty: every layer full attention
    layer_types: tuple[str, ...] = ()
    #: attention's q_proj also emits a gate per head: o_proj(attention * sigmoid(gate))
    attn_output_gate: bool = False
    #: RMSNorms compute x * (1 + w) in fp32 (Qwen3.5's zero-centred weights)
    norm_zero_centered: bool = False
    linear_attention: LinearAttentionConfig | None = None
    moe: MoEConfig | None = None
    quant: QuantConfig | None = None
    int4: Int4Quant | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    #: the checkpoint's multi-token prediction layers (Qwen3.5's `mtp.*`), and whether the
    #: model runs its head (`--speculative mtp`: its layer takes a KV cache entry)
    mtp_layers: int = 0
    with_mtp: bool = False
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
        family = SUPPORTED_ARCHITECTURES[arch]
        quant = _quant_config(cfg, source)
        int4 = quant if isinstance(quant, Int4Quant) else None
        fp8 = quant if isinstance(quant, QuantConfig) else None
        if family.get("nested"):
            # the text model's fields, under the multimodal wrapper's (the vision tower's are
            # not read)
            text = cfg.get("text_config")
            if not isinstance(text, dict):
                raise ModelLoadError(source, f"{arch} needs a text_config object")
            top = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
            cfg = {**top, **text}
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
                intermediate_size=int(cfg.get("intermediate_size") or 0),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(cfg.get("rope_theta")
                                 or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
                max_position_embeddings=max_pos,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qk_norm=family["qk_norm"],
                attention_bias=bias,
                rope_scaling=_rope_scaling(cfg, source),
                partial_rotary_factor=float(
                    cfg.get("partial_rotary_factor")
                    or (cfg.get("rope_parameters") or {}).get("partial_rotary_factor")
                    or (0.25 if family.get("hybrid") else 1.0)),
                layer_types=_layer_types(cfg, family),
                attn_output_gate=bool(family.get("hybrid")),
                norm_zero_centered=bool(family.get("hybrid")),
                linear_attention=_linear_attention(cfg) if family.get("hybrid") else None,
                moe=_moe_config(cfg),
                quant=fp8, int4=int4,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
                mtp_layers=int(cfg.get("mtp_num_hidden_layers")
                               or cfg.get("num_nextn_predict_layers") or 0),
                raw=cfg,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(source, f"bad config field: {e!r}") from None

    # ---- what each layer is --------------------------------------------------------------
    def is_linear(self, layer: int) -> bool:
        """A Gated DeltaNet layer (else full attention)."""
        return bool(self.layer_types) and self.layer_types[layer] == LINEAR_ATTENTION

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The full-attention layers, in order: the KV cache holds one entry per such layer."""
        return tuple(i for i in range(self.num_layers) if not self.is_linear(i))

    @property
    def kv_layers(self) -> int:
        """KV cache entries: the full-attention layers, and the MTP head's where it runs."""
        return len(self.attention_layers) + self.with_mtp

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The Gated DeltaNet layers, in order: a state slot holds one entry per such layer."""
        return tuple(i for i in range(self.num_layers) if self.is_linear(i))

    def is_moe(self, layer: int) -> bool:
        """An expert MLP (else the dense one), as transformers' qwen3_moe decides."""
        m = self.moe
        return (m is not None and layer not in m.mlp_only_layers
                and (layer + 1) % m.sparse_step == 0)

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that rotary turns (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def shard(self, tp: int) -> ModelConfig:
        """The config as one of `tp` tensor-parallel ranks holds it: its share of the attention
        heads (at least one KV head: replicated where fewer than ranks) and of the Gated
        DeltaNet heads. The weights' loaders use the full config; this sizes the caches."""
        if tp == 1:
            return self
        la = self.linear_attention
        if la is not None:
            la = replace(la, num_key_heads=la.num_key_heads // tp,
                         num_value_heads=la.num_value_heads // tp)
        return replace(self, num_heads=self.num_heads // tp,
                       num_kv_heads=max(1, self.num_kv_heads // tp), linear_attention=la)

    # ---- what a request holds ---------------------------------------------------------------
    def kv_bytes_per_token(self, element_bytes: int, scale_bytes: int = 0) -> int:
        """Bytes of K and V per token, all full-attention layers, at `element_bytes` per
        element (plus `scale_bytes` per token and KV head: FP8 caches keep an fp32 scale)."""
        per_head = self.head_dim * element_bytes + scale_bytes
        return 2 * self.kv_layers * self.num_kv_heads * per_head

    def state_bytes_per_slot(self, conv_bytes: int) -> int:
        """Bytes of one request's recurrent state, all Gated DeltaNet layers (0: none)."""
        la = self.linear_attention
        return 0 if la is None else len(self.linear_layers) * la.state_bytes(conv_bytes)


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


def _layer_types(cfg: dict[str, Any], family: dict[str, bool]) -> tuple[str, ...]:
    if not family.get("hybrid"):
        return ()
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:  # as transformers: every `full_attention_interval`-th layer is full
        interval = int(cfg.get("full_attention_interval", 4))
        types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n)]
    if len(types) != n or any(t not in (FULL_ATTENTION, LINEAR_ATTENTION) for t in types):
        raise ValueError(f"layer_types must list {n} of {FULL_ATTENTION!r} / {LINEAR_ATTENTION!r}")
    return tuple(types)


def _linear_attention(cfg: dict[str, Any]) -> LinearAttentionConfig:
    return LinearAttentionConfig(
        num_key_heads=int(cfg.get("linear_num_key_heads", 16)),
        num_value_heads=int(cfg.get("linear_num_value_heads", 32)),
        key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
        value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)))


def _moe_config(cfg: dict[str, Any]) -> MoEConfig | None:
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if experts <= 0:
        return None
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    return MoEConfig(
        num_experts=experts,
        experts_per_token=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["moe_intermediate_size"]),
        # Qwen3.5-MoE's router always renormalises (its config has no such field)
        norm_topk_prob=bool(cfg.get("norm_topk_prob", shared > 0)),
        sparse_step=int(cfg.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
        shared_expert_intermediate_size=shared)


#: the group sizes torch's int4 CPU kernel takes (a group of -1: one per row, refused)
INT4_GROUPS = (32, 64, 128, 256)


def _quant_config(cfg: dict[str, Any], source: object) -> QuantConfig | Int4Quant | None:
    """`quantization_config`: block-scaled FP8, and 4-bit AWQ (GEMM) and GPTQ (no act-order)
    are read; any other format is refused by name."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    method = str(q.get("quant_method", "unknown")).lower()
    if method in ("awq", "gptq"):
        return _int4_quant(method, q, source)
    block = q.get("weight_block_size")
    if method != "fp8" or not block or str(q.get("fmt", "e4m3")).lower() != "e4m3":
        what = f"{method} (per-tensor scales)" if method == "fp8" and not block else method
        raise ModelLoadError(source, f"unsupported quantization {what!r}: arle reads "
                                     "block-scaled FP8 (quant_method fp8, fmt e4m3, "
                                     "weight_block_size), 4-bit awq and gptq")
    return QuantConfig("fp8", (int(block[0]), int(block[1])),
                       tuple(str(m) for m in q.get("modules_to_not_convert") or ()))


def _int4_quant(method: str, q: dict[str, Any], source: object) -> Int4Quant:
    """AWQ or GPTQ's settings, refused by name where arle does not read them."""
    bits, group = int(q.get("bits", 4)), int(q.get("group_size", 128))

    def refuse(what: str) -> ModelLoadError:
        return ModelLoadError(source, f"unsupported quantization {method!r} with {what}: arle "
                                      f"reads 4-bit {method} in groups of "
                                      f"{', '.join(map(str, INT4_GROUPS))}")

    if bits != 4:
        raise refuse(f"bits {bits}")
    if group not in INT4_GROUPS:
        raise refuse(f"group_size {group}")
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm" or q.get("zero_point") is False:
            raise refuse(f"version {version!r}" if version != "gemm" else "zero_point false")
        return Int4Quant("awq", group)
    if q.get("desc_act"):
        raise ModelLoadError(source, "unsupported quantization 'gptq' with desc_act (act-order):"
                                     " its groups gather input columns out of order (g_idx), "
                                     "which the int4 kernels' contiguous groups cannot hold; "
                                     "quantize with desc_act false")
    fmt = str(q.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise refuse(f"checkpoint_format {fmt!r}")
    return Int4Quant("gptq", group, zero_offset=1 if fmt == "gptq" else 0)
