"""The paged KV cache's layout, and what the attention kernels' modules share about it.

Cache layout, per layer: k_cache / v_cache of shape [num_pages, page_size, kv_heads, head_dim].
A request's tokens live in the pages its page table lists, in order; token i of the request sits
in page page_table[i // page_size] at offset i % page_size. FP8 caches (torch.float8_e4m3fn)
carry one fp32 scale per (token, KV head) beside them: dequantised = stored * scale.

A step's batch is flat: rows (requests) one after another, decode rows (one new token) first,
then extend rows (a chunk of prompt, attending to the row's cached prefix and causally to itself).
Decode rows go through kernels/decode_attention.py, extend rows through
kernels/extend_attention.py: each a Triton kernel beside its plain-torch reference.
"""

from __future__ import annotations

import torch


def check_kv_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None) -> None:
    """FP8 caches carry fp32 scales [pages, page_size, kv_heads], strided alike; others none.
    Host metadata only (no device reads: safe under graph capture)."""
    if k_cache.dtype == torch.float8_e4m3fn:
        assert k_scale is not None and v_scale is not None, "fp8 KV needs k_scale and v_scale"
        assert k_scale.shape == k_cache.shape[:3] and v_scale.shape == v_cache.shape[:3]
        assert k_scale.dtype == torch.float32 and v_scale.dtype == torch.float32
        assert k_scale.stride() == v_scale.stride()
    else:
        assert k_scale is None and v_scale is None, "scales are for fp8 KV only"

