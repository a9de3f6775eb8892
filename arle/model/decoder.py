"""Llama-family and Qwen3 dense decoders, written once.

Differences are flags on ModelConfig: per-head q/k RMSNorm (Qwen3), q/k/v bias (Qwen2), tied or
untied embeddings. The model sees a flat batch of tokens (prefill chunks and decode rows mixed);
attention reads and writes the paged KV cache through the backend the executor passes in.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from arle.model.config import ModelConfig
from arle.model.parallel import (
    SINGLE,
    MergedColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    linear,
    linear_silu_and_mul,
)
from arle.model.rope import RotaryEmbedding
from arle_kernels.ops import REFERENCE, Ops
from arle_kernels.split_sums import SplitSums


class AttentionBackend(Protocol):
    """One step's attention, set up by the executor: q/k norms and rotary at the step's
    positions, this step's K/V into the paged cache, then attention over each row's pages."""

    def attend(self, layer: int, qkv: torch.Tensor | SplitSums, q_norm: torch.Tensor | None,
               k_norm: torch.Tensor | None) -> torch.Tensor:
        """qkv [T, (H + 2 KVH) * D] (or its SplitSums) -> attention output [T, H * D]."""
        ...


class RMSNorm(nn.Module):
    """A weight holder: the norm itself is `ops.rms_norm` / `ops.add_rms_norm` (fp32 statistics,
    scaled in the model dtype, as HF Llama/Qwen do)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = cfg.num_heads // tp.size
        self.num_kv_heads = max(1, cfg.num_kv_heads // tp.size)
        self.head_dim = cfg.head_dim
        d = cfg.head_dim
        self.qkv_proj = MergedColumnParallelLinear(
            cfg.hidden_size,
            {"q": cfg.num_heads * d, "k": cfg.num_kv_heads * d, "v": cfg.num_kv_heads * d},
            bias=cfg.attention_bias, tp=tp)
        # Llama/Qwen3 `attention_bias` covers o_proj too; Qwen2's q/k/v biases do not.
        o_bias = cfg.attention_bias and cfg.architecture != "Qwen2ForCausalLM"
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, bias=o_bias, tp=tp)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def qk_norm_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The per-head q / k RMSNorm weights (Qwen3), or None, None."""
        return (self.q_norm.weight if self.q_norm is not None else None,
                self.k_norm.weight if self.k_norm is not None else None)

    def forward(self, x: torch.Tensor, backend: AttentionBackend) -> torch.Tensor | SplitSums:
        # NOTE: qkv and the output may stay split sums: their consumers (the backend's q/k
        # norm + rope, the next add_rms_norm) add them up (arle_kernels.split_sums)
        qkv = self.qkv_proj.forward_unreduced(x)
        attn = backend.attend(self.layer, qkv, *self.qk_norm_weights())
        return self.o_proj.forward_unreduced(attn)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, {0: cfg.intermediate_size, 1: cfg.intermediate_size}, tp=tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp=tp)

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor | SplitSums:
        return self.down_proj.forward_unreduced(linear_silu_and_mul(x, self.gate_up_proj.weight,
                                                                    ops.silu_and_mul))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, x: torch.Tensor | SplitSums, residual: torch.Tensor | None,
                backend: AttentionBackend, ops: Ops) -> tuple[torch.Tensor | SplitSums, torch.Tensor]:
        """(x, residual) -> (this layer's MLP output, the residual stream before it).

        NOTE: the residual add is fused into the next norm (`ops.add_rms_norm`): the stream is
        x + residual, rounded to the model dtype, exactly as `h = h + f(h)` in HF's code."""
        norm = self.input_layernorm
        if residual is None:
            assert isinstance(x, torch.Tensor), "the first layer takes the embeddings"
            residual, h = x, ops.rms_norm(x, norm.weight, norm.eps)
        else:
            h, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        h = self.self_attn(h, backend)
        norm = self.post_attention_layernorm
        h, residual = ops.add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(h, ops), residual


class DecoderLM(nn.Module):
    """Token ids at positions -> hidden states; `logits()` projects only the rows that sample."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.lm_head = (self.embed_tokens if cfg.tie_word_embeddings
                        else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp))
        #: The kernels (`ops_for` its device: set on loading and by the executor).
        self.ops: Ops = REFERENCE

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, backend: AttentionBackend,
                id_source: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden]. Positions live in the backend.
        id_source: the ids are id_source[input_ids] (the CUDA decode graphs pass their rows'
        slots and the token buffer: the embedding kernel reads the ids there itself)."""
        x: torch.Tensor | SplitSums = self.ops.embed(self.embed_tokens.weight, input_ids,
                                                     id_source)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(x, residual, backend, self.ops)
        assert residual is not None
        return self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def rotary_table(self, max_positions: int) -> torch.Tensor:
        """cos | sin for positions [0, max_positions): [max_positions, head_dim] float32, the
        table `ops.qk_norm_rope_store_kv` reads."""
        cos, sin = self.rotary.cos_sin(torch.arange(max_positions,
                                                    device=self.rotary.inv_freq.device))
        return torch.cat([cos, sin], dim=-1).contiguous()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, *, upcast: bool = True) -> torch.Tensor:
        """lm_head(hidden): fp32, or (upcast=False) in the model's dtype, for a consumer that
        upcasts only what it needs (the CUDA decode graphs: the greedy pick reads bf16)."""
        y = linear(hidden, self.lm_head.weight)
        return y.float() if upcast else y

    def weight_targets(self) -> dict[str, tuple[nn.Parameter, str | int | None]]:
        """Checkpoint (HF) tensor name -> (parameter, shard id) it loads into."""
        params = dict(self.named_parameters())
        out: dict[str, tuple[nn.Parameter, str | int | None]] = {}
        merged: dict[str, tuple[str, str | int]] = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                  "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", 0),
                  "up_proj": ("gate_up_proj", 1)}
        for i in range(self.config.num_layers):
            prefix = f"layers.{i}."
            for hf, (ours, shard) in merged.items():
                sub = "self_attn" if ours == "qkv_proj" else "mlp"
                for kind in ("weight", "bias"):
                    name = f"{prefix}{sub}.{ours}.{kind}"
                    if name in params:
                        out[f"model.{prefix}{sub}.{hf}.{kind}"] = (params[name], shard)
        for name, p in params.items():
            if ".qkv_proj." in name or ".gate_up_proj." in name:
                continue
            hf = name if name.startswith("lm_head") else f"model.{name}"
            out[hf] = (p, None)
        if self.config.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        return out
