"""Block-scaled FP8 linears (arle_kernels.fp8): the torch references against transformers'
dequantisation and a longhand per-block loop (partial edge blocks), then each Triton kernel
against the reference (interpreter, tiny shapes; GPU, Qwen3-30B-A3B's dense shapes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

from arle_kernels.fp8 import FP8, fp8_dequant_ref, fp8_linear_ref


def make_fp8(n: int, k: int, block: tuple[int, int], seed: int = 0, lead: tuple[int, ...] = (),
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random FP8 weights [*lead, n, k] and random positive block scales (not powers of two)."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(*lead, n, k, generator=gen) * 64).clamp(-448, 448).to(FP8)
    scale = torch.rand(*lead, -(-n // block[0]), -(-k // block[1]), generator=gen) * 1e-2 + 1e-3
    return w, scale


def longhand_dequant(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     ) -> torch.Tensor:
    out = torch.empty(w.shape, dtype=torch.float32)
    bn, bk = block
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            out[rows, cols] = w[rows, cols].float() * scale[i, j]
    return out


@pytest.mark.parametrize("n,k,block", [(40, 70, (16, 32)), (128, 256, (128, 128)),
                                       (300, 200, (128, 128)), (1, 1, (128, 128))])
def test_dequant_ref_per_block(n: int, k: int, block: tuple[int, int]) -> None:
    w, scale = make_fp8(n, k, block)
    got = fp8_dequant_ref(w, scale, block)
    assert got.dtype == torch.float32 and got.shape == (n, k)
    assert torch.equal(got, longhand_dequant(w, scale, block))
    assert torch.equal(fp8_dequant_ref(w, scale, block, torch.bfloat16), got.bfloat16())


def test_dequant_ref_matches_transformers() -> None:
    """transformers' own dequantisation (whole blocks; experts batched)."""
    block = (16, 32)
    w, scale = make_fp8(48, 96, block, lead=(3,))
    want = _dequantize_fp8_weight(w, scale, list(block), torch.float32)
    assert torch.equal(fp8_dequant_ref(w, scale, block), want)


def test_dequant_ref_rejects_wrong_scale_grid() -> None:
    w, scale = make_fp8(40, 70, (16, 32))
    with pytest.raises(AssertionError):
        fp8_dequant_ref(w, scale[:, :-1], (16, 32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_ref(dtype: torch.dtype, bias: bool) -> None:
    block = (16, 32)
    w, scale = make_fp8(40, 70, block)
    x = torch.randn(5, 70).to(dtype)
    b = torch.randn(40).to(dtype) if bias else None
    got = fp8_linear_ref(x, w, scale, block, b)
    assert got.dtype == dtype and got.shape == (5, 40)
    want = F.linear(x, longhand_dequant(w, scale, block).to(dtype), b)
    assert torch.equal(got, want)
    exact = x.double() @ longhand_dequant(w, scale, block).double().T
    if b is not None:
        exact += b.double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert ((got.double() - exact).norm() / exact.norm()).item() < tol
