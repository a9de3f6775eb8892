"""The memory-bound glue of a decoder layer in plain torch: the CPU executor's ops, and
the references kernels/fused.py's kernels are tested against. These *are* the model's
semantics, HF's rounding order included (kernels/fused.py's docstring gives each op's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from arle_kernels.fp8_ref import FP8_MAX
from arle_kernels.split_sums import SplitSums, take

#: the floor of a KV head's amax (an all-zero head); FP8_MAX is e4m3fn's largest finite value
FP8_MIN_AMAX = 1e-6


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF's RMSNorm: normalise over the last dim in fp32, round to x's dtype, times weight;
    an fp32 weight (1 + w of a zero-centred norm) scales in fp32 before the one rounding."""
    y = F.rms_norm(x.float(), weight.shape, eps=eps)
    if weight.dtype == torch.float32:
        return (y * weight).to(x.dtype)
    return y.to(x.dtype) * weight


def add_rms_norm_ref(x: Tensor | SplitSums, residual: Tensor, weight: Tensor,
                     eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual). NOTE: updates `residual` in place, as the kernel
    does, and returns it."""
    residual.add_(take(x))  # x + residual in the dtype, rounded once (as `h = h + f(h)`)
    return rms_norm_ref(residual, weight, eps), residual


def silu_and_mul_ref(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def quantize_fp8_ref(x: Tensor) -> tuple[Tensor, Tensor]:
    """Per-(token, head) FP8 of x [..., D]: (x / scale as e4m3fn, scale [...] float32) with
    scale = max(amax |x|, 1e-6) / 448. Dequantised: stored.float() * scale."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp_min(FP8_MIN_AMAX) / FP8_MAX
    stored = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return stored, scale


def _write_cache_ref(cache: Tensor, scale: Tensor | None, x: Tensor, slots: Tensor) -> None:
    flat = cache.view(-1, *cache.shape[2:])
    if cache.dtype == torch.float8_e4m3fn:
        assert scale is not None
        stored, s = quantize_fp8_ref(x)
        # index_copy_ has no fp8 kernel everywhere: move the bytes
        flat.view(torch.uint8).index_copy_(0, slots, stored.view(torch.uint8))
        scale.view(-1, scale.shape[-1]).index_copy_(0, slots, s)
    else:
        flat.index_copy_(0, slots, x.to(cache.dtype))


def rotary_ref(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Neox rotary on x [T, heads, D] with cos/sin [T, R/2]: the first R dims of each head
    turn (fp32 math, rounded once to x's dtype: arle.model.rope's convention), the others
    pass through as they are."""
    rot = 2 * cos.shape[-1]
    x1, x2 = x[..., :rot].float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    turned = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
    return turned if rot == x.shape[-1] else torch.cat((turned, x[..., rot:]), dim=-1)


def qk_norm_rope_store_kv_ref(qkv: Tensor | SplitSums, positions: Tensor, cos_sin: Tensor,
                              q_norm: Tensor | None, k_norm: Tensor | None, eps: float,
                              num_heads: int, num_kv_heads: int,
                              k_cache: Tensor, v_cache: Tensor, kv_slots: Tensor,
                              k_scale: Tensor | None = None,
                              v_scale: Tensor | None = None) -> Tensor:
    """The plain-torch `qk_norm_rope_store_kv` (same contract). Reads kv_slots on the host
    (drops the < 0 ones): not for CUDA graphs."""
    qkv = take(qkv)
    t, d = qkv.shape[0], k_cache.shape[-1]
    h, kvh = num_heads, num_kv_heads
    qk = qkv[:, :(h + kvh) * d].view(t, h + kvh, d)
    if q_norm is not None and k_norm is not None:
        qk = torch.cat([rms_norm_ref(qk[:, :h], q_norm, eps),
                        rms_norm_ref(qk[:, h:], k_norm, eps)], dim=1)
    cos, sin = cos_sin[positions].chunk(2, dim=-1)
    qk = rotary_ref(qk, cos, sin)
    v = qkv[:, (h + kvh) * d:].view(t, kvh, d)
    k = qk[:, h:]
    slots = kv_slots.long()
    if not bool((kv_slots >= 0).all()):  # padding rows: write nothing (a host read: a reference)
        keep = kv_slots >= 0
        k, v, slots = k[keep], v[keep], slots[keep]
    _write_cache_ref(k_cache, k_scale, k, slots)
    _write_cache_ref(v_cache, v_scale, v, slots)
    return qk[:, :h].contiguous()
