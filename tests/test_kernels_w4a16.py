"""The W4A16 kernels (kernels/w4a16.py): the GPU layout of 4-bit groups against the loaders'
`Int4Groups`, the Triton GEMV and GEMM against `w4_linear_ref` under the interpreter (tiny
shapes, fp16: the interpreter's bf16 dots are wrong) and on a GPU (Qwen3-4B's shapes, bf16),
and their sm_90 builds."""

from __future__ import annotations

import pytest
import torch
from helpers import run_interpreter_check

from arle_kernels import w4a16
from arle_kernels.quant import Int4Groups
from arle_kernels.w4a16 import pack_w4, unpack_w4, w4_format, w4_linear, w4_linear_ref


def random_groups(n: int, k: int, group: int, seed: int, device: str = "cpu") -> Int4Groups:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=gen) * 0.02 + 0.001
    zero = torch.randn(n, k // group, generator=gen) * 0.05
    return Int4Groups(q.to(device), scale.to(device), zero.to(device), group)


@pytest.mark.parametrize(("n", "k", "group"), [(40, 256, 32), (17, 384, 128), (8, 512, 256)])
def test_pack_keeps_every_nibble_and_rounds_only_the_group_terms(n: int, k: int,
                                                                 group: int) -> None:
    """Nibble j of word w is column 8w + j; unpacked, the weight is the groups' dequantization
    but for the fp16 scale and offset (offset = zero - 8 scale): within 2^-11 of |q scale| +
    |offset| each."""
    w = random_groups(n, k, group, seed=n)
    words = pack_w4(w)
    fmt = w4_format(words)
    assert fmt is not None and words.dtype == torch.int32 and words.shape == (n, k // 8)
    nibbles = (words[..., None] >> torch.arange(0, 32, 4, dtype=torch.int32)) & 0xF
    assert torch.equal(nibbles.view(n, k).to(torch.uint8), w.q)
    exact = w.dequantize()
    bound = (w.q.float().view(n, -1, group) * w.scale[..., None]).abs()
    bound = (bound + (w.zero - 8 * w.scale).abs()[..., None]).view(n, k) * 2**-10
    assert ((unpack_w4(words, fmt) - exact).abs() <= bound).all()


#: (rows of x, rows of W, K, group): GEMV rows 1..8, GEMM above; K past a whole tile and a
#: group of 256 spanning two tiles
SHAPES = [(1, 40, 256, 32), (3, 17, 512, 128), (8, 24, 160, 32), (2, 16, 512, 256),
          (20, 33, 256, 64), (70, 24, 160, 32), (9, 64, 384, 128)]


#: GEMV tiles besides the default (`scripts/bench_kernels.py w4` times them on a GPU): fewer
#: rows and a longer K step, with splits of K and a group of 256 inside one step
OTHER_TILES = (w4a16.W4Tile(4, 512, 4), w4a16.W4Tile(2, 256, 2))


def interp_check_w4a16() -> None:
    """Under TRITON_INTERPRET=1: both kernels against the reference, fp16, with a bias and
    without; output rows and columns that are no multiple of a tile; the GEMV in other
    tiles too."""
    cases = [(shape, w4a16.GEMV_TILE) for shape in SHAPES]
    cases += [(shape, tile) for shape in SHAPES[:4] for tile in OTHER_TILES]
    for (m, n, k, g), tile in cases:
        w = random_groups(n, k, g, seed=m + n)
        words = pack_w4(w)
        fmt = w4_format(words)
        assert fmt is not None
        gen = torch.Generator().manual_seed(k)
        x = torch.randn(m, k, generator=gen).to(torch.float16)
        for bias in (None, torch.randn(n, generator=gen).to(torch.float16)):
            want = w4_linear_ref(x, words, fmt, bias).float()
            got = w4_linear(x, words, fmt, bias, tile).float()
            # fp16 output: one rounding of |y| (2^-11), fp32 sums in another order
            tol = want.abs() * 2**-10 + 1e-3
            assert ((got - want).abs() <= tol).all(), (m, n, k, g, tile,
                                                         (got - want).abs().max())


def test_w4a16_kernels_interpreted() -> None:
    run_interpreter_check("test_kernels_w4a16", "interp_check_w4a16")


def test_splits_fill_the_gpu_with_whole_tiles() -> None:
    """Qwen3-4B's decode shapes: each split of K whole tiles of at least 4, the programs near
    GEMV_PROGRAMS where K allows."""
    for n, k in ((6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)):
        blocks = -(-n // w4a16.GEMV_TILE.block_n)
        splits = w4a16._splits(blocks, k)
        assert 1 <= splits <= max(1, k // (4 * w4a16.BLOCK_K))
        assert blocks * splits <= max(blocks, w4a16.GEMV_PROGRAMS)


# ---- sm_90 builds (no GPU needed) -------------------------------------------------------------

def test_w4a16_kernels_build_for_sm90() -> None:
    compile_ = pytest.importorskip("test_kernels_compile")
    if compile_.HOPPER is None:
        pytest.skip("this triton cannot compile for NVIDIA GPUs")
    types = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*fp16", "o_ptr": "*fp16",
             "b_ptr": "*bf16"}
    for tile in (w4a16.GEMV_TILE, *OTHER_TILES):  # the other tiles at Qwen's group only
        for group in (32, 128, 256) if tile == w4a16.GEMV_TILE else (128,):
            compile_.compile_for_hopper(w4a16._w4_gemv_kernel, {
                "G": group, "BM": 2, "BN": tile.block_n, "BK": tile.block_k},
                **types, y_ptr="*fp32")
    for group in (32, 128, 256):
        bm, bn, _ = w4a16.GEMM_TILE
        compile_.compile_for_hopper(w4a16._w4_gemm_kernel, {
            "G": group, "BM": bm, "BN": bn, "BK": w4a16.BLOCK_K, "HAS_BIAS": True},
            **types, y_ptr="*bf16")


# ---- on the GPU -------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 4, 8, 64, 512])
@pytest.mark.parametrize(("n", "k"), [(6144, 2560), (2560, 9728)])
def test_gpu_w4a16_qwen3_4b_shapes(m: int, n: int, k: int) -> None:
    """bf16 activations at Qwen3-4B's qkv and down_proj shapes, group 128: within bf16's
    output rounding of the fp32 reference (plus the GEMM's bf16 weight tile)."""
    w = random_groups(n, k, 128, seed=m, device="cuda")
    words = pack_w4(w)
    fmt = w4_format(words)
    assert fmt is not None
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    want = w4_linear_ref(x, words, fmt).float()
    got = w4_linear(x, words, fmt).float()
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 2e-2 * scale, (got - want).abs().max()
