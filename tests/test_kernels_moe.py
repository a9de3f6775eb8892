"""The MoE MLP (arle_kernels.moe): the torch reference against transformers' `qwen3_moe`
router and experts on random weights (bf16 and FP8 blocks), then each Triton kernel against
the reference (interpreter, tiny shapes; GPU, Qwen3-30B-A3B's shapes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeConfig,
    Qwen3MoeSparseMoeBlock,
)

from arle_kernels.fp8 import FP8
from arle_kernels.moe import fused_moe_ref, moe_route_ref

# ---------------------------------------------------------------------------------------------
# the reference against transformers
# ---------------------------------------------------------------------------------------------


def hf_block(h: int, inter: int, e: int, k: int, norm: bool, impl: str, dtype: torch.dtype,
             seed: int = 0) -> Qwen3MoeSparseMoeBlock:
    """transformers' MoE block with unit-gain random weights (std 1/sqrt(fan_in)) and a router
    sharp enough that the top-k are well apart (ties are made on purpose, elsewhere)."""
    cfg = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=inter, num_experts=e,
                         num_experts_per_tok=k, norm_topk_prob=norm)
    cfg._experts_implementation = impl
    block = Qwen3MoeSparseMoeBlock(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5 * 4)
    return block.to(dtype)


def run_both(moe: Qwen3MoeSparseMoeBlock, x: torch.Tensor, **fp8: object) -> tuple:
    """(fused_moe_ref, transformers' block) on x; FP8 weights for the ref where given."""
    ex = moe.experts
    logits = F.linear(x, moe.gate.weight)  # the router's own linear
    with torch.no_grad():
        want = moe(x[None])[0]
        if fp8:
            w13, w2 = fp8["w13"], fp8["w2"]
        else:
            w13, w2 = ex.gate_up_proj, ex.down_proj
        got = fused_moe_ref(x, logits, w13, w2, moe.gate.top_k, moe.gate.norm_topk_prob,
                            fp8.get("w13_scale"), fp8.get("w2_scale"), fp8.get("block"))
    return got, want


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("norm", [True, False])
def test_ref_matches_transformers_fp32(norm: bool, impl: str) -> None:
    block = hf_block(48, 40, 8, 2, norm, impl, torch.float32)
    x = torch.randn(13, 48, generator=torch.Generator().manual_seed(1))
    got, want = run_both(block, x)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("norm", [True, False])
def test_ref_matches_transformers_bf16(norm: bool) -> None:
    """transformers' default experts (grouped_mm): the same roundings, so the same bits up to
    the fp32 order of the top-k sum (at most one bf16 ulp, rarely)."""
    block = hf_block(64, 32, 8, 4, norm, "grouped_mm", torch.bfloat16)
    x = torch.randn(17, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    got, want = run_both(block, x)
    assert got.dtype == torch.bfloat16
    differ = (got != want).float().mean().item()
    assert differ <= 0.01, differ
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-3)


def test_route_ref_matches_transformers_router_with_ties() -> None:
    """Tied logits (identical router rows) pick and order experts as transformers' router."""
    block = hf_block(32, 16, 8, 3, True, "eager", torch.float32)
    with torch.no_grad():
        block.gate.weight[5] = block.gate.weight[2]
        block.gate.weight[6] = block.gate.weight[2]
        block.gate.weight[1] = 0.0  # logit 0 for every token, tied with a zero row below
        block.gate.weight[7] = 0.0
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(3))
    x[4] = 0.0  # every logit 0: all experts tied
    logits = F.linear(x, block.gate.weight)
    for norm in (True, False):
        block.gate.norm_topk_prob = norm
        _, hf_weights, hf_ids = block.gate(x)
        weights, ids = moe_route_ref(logits, 3, norm)
        assert torch.equal(ids, hf_ids)
        assert torch.equal(weights, hf_weights)
    got, want = run_both(block, x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int], gen: torch.Generator,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 weights [..., N, K] and power-of-two block scales [..., ceil(N/bn), ceil(K/bk)]
    (as a checkpoint stores them), edge blocks partial."""
    n, k = w.shape[-2:]
    bn, bk = block
    scale = 2.0 ** torch.randint(-9, -4, (*w.shape[:-2], -(-n // bn), -(-k // bk)),
                                 generator=gen).float()
    full = scale.repeat_interleave(bn, -2).repeat_interleave(bk, -1)[..., :n, :k]
    return (w / full).clamp(-448, 448).to(FP8), scale


def test_ref_fp8_matches_transformers_dequantized() -> None:
    """FP8 experts: the same as transformers' experts on weights it dequantised itself."""
    h, inter, e, block = 64, 48, 4, (16, 32)
    hf = hf_block(h, inter, e, 2, True, "grouped_mm", torch.float32)
    gen = torch.Generator().manual_seed(4)
    w13, s13 = quantize_blocks(torch.randn(e, 2 * inter, h, generator=gen) * 0.2, block, gen)
    w2, s2 = quantize_blocks(torch.randn(e, h, inter, generator=gen) * 0.2, block, gen)
    with torch.no_grad():
        hf.experts.gate_up_proj.copy_(_dequantize_fp8_weight(w13, s13, list(block),
                                                             torch.float32))
        hf.experts.down_proj.copy_(_dequantize_fp8_weight(w2, s2, list(block), torch.float32))
    x = torch.randn(11, h, generator=gen)
    got, want = run_both(hf, x, w13=w13, w2=w2, w13_scale=s13, w2_scale=s2, block=block)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
