"""Integer weights on the CPU (kernels/quant.py): torch's packed layout, the products against
the dequantized weight, and the GGUF block formats as int4 groups."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from arle.model.gguf_io import _INT4_GROUPS
from arle_kernels.quant import (
    PACKED_MAX_ROWS,
    Int4Format,
    Int4Groups,
    Int8Format,
    int_format,
    int_linear,
    int_rows,
    pack_int4,
    quantize_int8_rows,
    unpack_int4,
)


def _groups(n: int, k: int, group: int = 32, seed: int = 0) -> Int4Groups:
    g = torch.Generator().manual_seed(seed)
    return Int4Groups(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g),
                      torch.rand(n, k // group, generator=g) * 0.02 + 1e-3,
                      torch.randn(n, k // group, generator=g) * 0.02, group)


def _held(w: Int4Groups) -> torch.Tensor:
    """The weight as the kernels hold it: the scales and zeros rounded to bf16, fp32 math."""
    return Int4Groups(w.q, w.scale.bfloat16().float(), w.zero.bfloat16().float(),
                      w.group).dequantize()


@pytest.mark.parametrize("n", [64, 192, 96])
def test_int4_pack_layout_is_the_one_unpack_reads(n: int) -> None:
    """torch's CPU pack layout ([N/64, K, 32] bytes, low nibble row j, high j + 32): the
    prefill path reads the bytes itself, so a torch that changes it fails here."""
    w = _groups(n, 128)
    packed = pack_int4(w)
    q_t = unpack_int4(packed)
    assert q_t.shape == (128, -(-n // 64) * 64)
    assert torch.equal(q_t[:, :n], w.q.t())


@pytest.mark.parametrize("rows", [1, 7, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1, 100])
def test_int4_linear_matches_the_held_weight(rows: int) -> None:
    """Both paths (the packed kernel up to PACKED_MAX_ROWS rows, bf16 expansion past it)
    against x (rounded to bf16) @ W^T in fp64. Bound: 2^-7 of the product's size for the
    expansion (it rounds W and its offset zero - 8 scale to bf16, 2^-9 each, and y), 2^-8
    for the packed kernel (fp32 math, y rounded to bf16)."""
    w = _groups(96, 256, seed=1)  # 96 rows: padded to 128
    packed = pack_int4(w)
    fmt = int_format(packed)
    assert isinstance(fmt, Int4Format)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(96)
    got = int_linear(x, packed, fmt, bias)
    xb, held = x.bfloat16().double(), _held(w).double()
    ref = xb @ held.T + bias.double()
    size = xb.abs() @ held.abs().T
    rel = 2**-7 if rows > PACKED_MAX_ROWS else 2**-8
    assert got.shape == (rows, 96) and got.dtype == torch.float32
    assert ((got.double() - ref).abs() <= rel * size + 1e-5).all()


def test_int4_rows_are_the_held_weight_rows() -> None:
    """An embedding lookup of an int4 weight: its rows, as the held weight has them."""
    w = _groups(128, 64, seed=3)
    packed = pack_int4(w)
    fmt = int_format(packed)
    assert fmt is not None
    ids = torch.tensor([0, 31, 32, 63, 64, 127, 5])
    assert torch.equal(int_rows(packed, fmt, ids), _held(w)[ids])


@pytest.mark.parametrize("rows", [1, PACKED_MAX_ROWS + 3])
def test_int8_rows_round_to_half_a_step(rows: int) -> None:
    """Per-row int8: the scale is a bf16 (the kernel multiplies by exactly it), every weight
    within half a step, and both product paths match q * scale within bf16's rounding of x."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(64, 96, generator=g) * torch.rand(64, 1, generator=g)
    q = quantize_int8_rows(w)
    fmt = int_format(q)
    assert isinstance(fmt, Int8Format) and q.dtype == torch.int8
    scale = fmt.scale.double()
    assert torch.equal(scale, fmt.scale.float().bfloat16().double())
    held = q.double() * scale[:, None]
    assert ((held - w.double()).abs() <= scale[:, None] / 2 * (1 + 1e-6)).all()
    x = torch.randn(rows, 96, generator=g)
    xb = x.bfloat16().double()
    size = xb.abs() @ held.abs().T
    got = int_linear(x, q, fmt).double()
    assert ((got - xb @ held.T).abs() <= 2**-7 * size + 1e-5).all()
    ids = torch.tensor([3, 0, 63])
    assert torch.equal(int_rows(q, fmt, ids).double(), held[ids].float().double())


def _q4_k_blocks(rows: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K super-blocks (any bytes are valid but d and dmin: small positive fp16)."""
    blocks = rng.integers(0, 256, (rows, 144), dtype=np.uint8)
    for cols in (slice(0, 2), slice(2, 4)):  # d, dmin
        blocks[:, cols] = rng.uniform(1e-4, 1e-2, (rows, 1)).astype(np.float16).view(np.uint8)
    return blocks


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K"])
def test_gguf_4bit_blocks_map_onto_int4_groups(name: str) -> None:
    """The claim: Q4_0, Q4_1 (d q + m) and Q4_K (d sc q - dmin mn) blocks are group-32 int4
    with a scale and a zero: (q - 8) scale + zero gives the `gguf` package's values, exactly
    in real arithmetic; in fp32 within one rounding of each value (the zero is exact: the sum
    of two fp16 products fits fp32's 24 bits)."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize

    qtype = gguf.GGMLQuantizationType[name]
    rng = np.random.default_rng(5)
    if name == "Q4_K":
        raw = _q4_k_blocks(6, rng).reshape(6, -1)
        shape = (6, 256)
    else:
        x = (rng.standard_normal((6, 64)) * rng.uniform(0.01, 10, (6, 1))).astype(np.float32)
        raw = np.ascontiguousarray(quantize(x, qtype)).view(np.uint8)
        shape = x.shape
    theirs = torch.from_numpy(dequantize(raw, qtype).reshape(shape)).double()
    groups = _INT4_GROUPS[qtype](torch.from_numpy(raw.reshape(-1).copy()), shape)
    assert groups.q.dtype == torch.uint8 and int(groups.q.max()) <= 15 and groups.group == 32
    exact = ((groups.q.double().view(6, -1, 32) - 8) * groups.scale.double()[..., None]
             + groups.zero.double()[..., None]).view(shape)
    ulp = theirs.abs() * 2**-23 + 2**-40
    assert ((exact - theirs).abs() <= ulp).all()  # fp64 from the fp32 scale and zero
    assert ((groups.dequantize().double() - theirs).abs() <= 2 * ulp).all()
    if name == "Q4_0":
        assert torch.equal(groups.dequantize().double(), theirs)
