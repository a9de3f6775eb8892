"""Rotary position embeddings, with the rope scaling types found in config.json files."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def inverse_frequencies(head_dim: int, theta: float,
                        scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies and the attention factor (yarn scales cos/sin by it).
    head_dim: the dims that rotate (with partial rotary, those of a head that do: as
    transformers, every formula here sees that width only)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv.float(), 1.0
    kind = scaling["rope_type"]
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return (inv / factor).float(), 1.0
    if kind == "dynamic":
        # Static form of dynamic NTK (as vLLM): the base stretched for the full scaled context.
        # HF stretches it only past the trained context, per forward; we fix it at factor x that.
        base = theta * (factor * factor - (factor - 1)) ** (head_dim / (head_dim - 2))
        return (1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
                ).float(), 1.0
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = ((old_ctx / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        scaled = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
        return scaled.float(), 1.0
    if kind == "yarn":
        old_ctx = float(scaling["original_max_position_embeddings"])
        beta_fast = float(scaling.get("beta_fast", 32))
        beta_slow = float(scaling.get("beta_slow", 1))

        def dim_for(rotations: float) -> float:
            return (head_dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        lo = max(math.floor(dim_for(beta_fast)), 0)
        hi = min(math.ceil(dim_for(beta_slow)), head_dim - 1)
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - lo) / max(hi - lo, 1e-3))
        extrapolation = 1 - ramp.clamp(0, 1)
        scaled = (inv / factor) * (1 - extrapolation) + inv * extrapolation
        mscale = float(scaling.get("attention_factor") or (0.1 * math.log(factor) + 1.0))
        return scaled.float(), mscale
    raise ValueError(f"unsupported rope scaling type {kind!r}")


class RotaryEmbedding(nn.Module):
    """Neox-style rotary frequencies (halves) over `dim` dims: a head's, or its first
    `rotary_dim` (partial rotary: the rest pass through). `DecoderLM.rotary_table` turns them
    into the cos | sin table the kernels read (`ops.qk_norm_rope_store_kv` applies the
    rotation)."""

    def __init__(self, dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv, self.attention_factor = inverse_frequencies(dim, theta, scaling)
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor
