"""Llama-family and Qwen3 dense decoders, written once.

Differences are flags on ModelConfig: per-head q/k RMSNorm (Qwen3), q/k/v bias (Qwen2), tied or
untied embeddings. The model sees a flat batch of tokens (prefill chunks and decode rows mixed);
attention reads and writes the paged KV cache through the backend the executor passes in.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from arle.model.config import ModelConfig
from arle.model.parallel import (
    SINGLE,
    MergedColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
)
from arle.model.rope import RotaryEmbedding, apply_rotary


class AttentionBackend(Protocol):
    """Writes this step's K/V into the cache and attends. Set up by the executor per step."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> [T, H, D]."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: normalise in fp32, then scale in the model dtype, as HF Llama/Qwen do.
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return normed.to(x.dtype) * self.weight


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        q_size, kv_size = h * d, self.num_kv_heads * d
        qkv = self.qkv_proj(x)
        # q and k heads side by side: one rotary pass serves both (fewer small kernels).
        qk = qkv[:, :q_size + kv_size].view(t, -1, d)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])], dim=1)
        qk = apply_rotary(qk, cos, sin)
        v = qkv[:, q_size + kv_size:].view(t, self.num_kv_heads, d)
        o = backend.attend(self.layer, qk[:, :h], qk[:, h:], v)
        return self.o_proj(o.reshape(t, q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, {0: cfg.intermediate_size, 1: cfg.intermediate_size}, tp=tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


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

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                backend: AttentionBackend) -> torch.Tensor:
        cos, sin = self.rotary.cos_sin(positions)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, backend)
        return self.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head.weight).float()

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
