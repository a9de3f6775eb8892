"""The W4A16 kernels (kernels/w4a16.py, kernels/gemv.py's 4-bit GEMV): the GPU layout of 4-bit
groups against the loaders' `Int4Groups`, the Triton GEMV and GEMM against `w4_linear_ref`
under the interpreter (tiny shapes, fp16: the interpreter's bf16 dots are wrong) and on a GPU
(Qwen3-4B's shapes, bf16), their sm_90 builds, and the GEMV's loads as built."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from helpers import run_interpreter_check

from arle_kernels import gemv, w4a16
from arle_kernels.gemv import MAX_W4_ROWS, GemvConfig, gemv_w4, use_w4_gemv, w4_gemv_config
from arle_kernels.quant import Int4Groups
from arle_kernels.w4a16 import w4_linear, w4_silu_mul
from arle_kernels.w4a16_ref import pack_w4, unpack_w4, w4_format, w4_linear_ref


def random_groups(n: int, k: int, group: int, seed: int, device: str = "cpu") -> Int4Groups:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=gen) * 0.02 + 0.001
    zero = torch.randn(n, k // group, generator=gen) * 0.05
    return Int4Groups(q.to(device), scale.to(device), zero.to(device), group)


@pytest.mark.parametrize(("n", "k", "group"), [(40, 256, 32), (17, 384, 128), (8, 512, 256)])
def test_pack_keeps_every_nibble_and_rounds_only_the_group_terms(n: int, k: int,
                                                                 group: int) -> None:
    """Nibble j of a run's word i is the run's column 4j + i (runs of 4 words, 32 columns);
    unpacked, the weight is the groups' dequantization but for the fp16 scale and zero:
    within 2^-10 of |q - 8| scale + |zero| each."""
    w = random_groups(n, k, group, seed=n)
    words = pack_w4(w)
    fmt = w4_format(words)
    assert fmt is not None and words.dtype == torch.int32 and words.shape == (n, k // 8)
    nib = (words[..., None] >> torch.arange(0, 32, 4, dtype=torch.int32)) & 0xF
    run, i, j = 3 % (k // 32), 2, 5
    assert torch.equal(nib[:, 4 * run + i, j].to(torch.uint8), w.q[:, 32 * run + 4 * j + i])
    runs = nib.view(n, k // 32, 4, 8).transpose(2, 3).reshape(n, k)
    assert torch.equal(runs.to(torch.uint8), w.q)
    exact = w.dequantize()
    bound = ((w.q.float() - 8).view(n, -1, group) * w.scale[..., None]).abs()
    bound = (bound + w.zero.abs()[..., None]).view(n, k) * 2**-10
    assert ((unpack_w4(words, fmt) - exact).abs() <= bound).all()


#: (rows of x, rows of W, K, group): GEMV rows 1..8, GEMM above; K past a whole chunk and a
#: group of 256 spanning two GEMM tiles
SHAPES = [(1, 40, 256, 32), (3, 17, 512, 128), (8, 24, 160, 32), (2, 16, 512, 256),
          (20, 33, 256, 64), (70, 24, 160, 32), (9, 64, 384, 128)]
assert any(m >= w4a16.DEQUANT_ROWS for m, *_ in SHAPES)

#: GEMV configs besides the chosen ones (`scripts/bench_kernels.py w4` times them on a GPU):
#: more rows a program, K split (with and without whole chunks), two warps, a warp a row, two
#: rows a thread (stack), the next chunk loaded ahead (num_stages 2)
OTHER_CONFIGS = (GemvConfig(block_n=4, block_k=128, num_warps=1, split_k=2),
                 GemvConfig(block_n=1, block_k=64, num_warps=1, split_k=3, stack=True),
                 GemvConfig(block_n=2, block_k=256, num_warps=2, num_stages=2),
                 GemvConfig(block_n=4, block_k=64, num_warps=4, stack=True, num_stages=2))


def _tol(want: torch.Tensor) -> torch.Tensor:
    """fp16 output: one rounding of |y| (2^-11), fp32 sums in another order."""
    return want.abs() * 2**-10 + 1e-3


def interp_check_w4a16() -> None:
    """Under TRITON_INTERPRET=1: the GEMV, the GEMM and the dequantizing kernel (prefill rows:
    `DEQUANT_ROWS`) against the reference, fp16, with a bias and without; output rows and
    columns that are no multiple of a tile; the GEMV in other configs and as the fused
    gate_up (silu(gate) * up, each rounded to fp16 first)."""
    for m, n, k, g in SHAPES:
        w = random_groups(n, k, g, seed=m + n)
        words = pack_w4(w)
        fmt = w4_format(words)
        assert fmt is not None
        gen = torch.Generator().manual_seed(k)
        x = torch.randn(m, k, generator=gen).to(torch.float16)
        for bias in (None, torch.randn(n, generator=gen).to(torch.float16)):
            want = w4_linear_ref(x, words, fmt, bias).float()
            got = w4_linear(x, words, fmt, bias).float()
            assert ((got - want).abs() <= _tol(want)).all(), (m, n, k, g, bias is None)
            split = w4a16.w4_gemm(x, words, fmt, bias, split=3).float()  # K split, reduced
            assert ((split - want).abs() <= _tol(want)).all(), (m, n, k, g, "split")
        if m > MAX_W4_ROWS:
            continue
        assert torch.equal(w4a16.w4_dequant(words, fmt, torch.float32), unpack_w4(words, fmt))
        want = w4_linear_ref(x, words, fmt).float()
        for cfg in OTHER_CONFIGS:
            got = gemv_w4(x, words, (fmt.scales, fmt.group), cfg=cfg).float()
            assert ((got - want).abs() <= _tol(want)).all(), (m, n, k, g, cfg)
        # bf16 x takes its own path (int32 pairs, the scale added to the exponent bits); a
        # zero in x stays (in effect) zero; the output is bf16 (the interpreter truncates to
        # it: one ulp, 2^-7)
        xb = x.bfloat16()
        xb[0, :3] = 0.0
        want_b = w4_linear_ref(xb.float(), words, fmt)
        for cfg in (None, *OTHER_CONFIGS):
            got = gemv_w4(xb, words, (fmt.scales, fmt.group), cfg=cfg).float()
            assert ((got - want_b).abs() <= want_b.abs() * 2**-7 + 1e-3).all(), (m, n, k, g, cfg)
        fused = w4_silu_mul(x, words, fmt) if n % 2 == 0 else None
        assert (fused is not None) == (n % 2 == 0 and use_w4_gemv(m))
        if fused is not None:
            half = want.half()
            glu = (F.silu(half[:, :n // 2].float()).half() * half[:, n // 2:]).float()
            assert ((fused.float() - glu).abs() <= _tol(glu)).all(), (m, n, k, g, "glu")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_centred_bits_are_q_minus_8(dtype: torch.dtype) -> None:
    """`_load_centred`'s rule for each x dtype, in torch's own bit views (the interpreter runs
    fp16 and fp32 through the GEMM, not bf16): q | MAGIC, read as a float, minus CENTRE is
    q - 8 for every nibble."""
    magic, centre = gemv.W4_CENTRED[dtype]
    q = torch.arange(16, dtype=torch.int32)
    bits = q | magic
    floats = (bits.to(torch.int16) if dtype.itemsize == 2 else bits).view(dtype)
    assert torch.equal(floats - centre, (q - 8).to(dtype))


def test_nibble_denormals_are_exact() -> None:
    """The 4-bit GEMV's rules (`_x_slice`, `_nibble_product`), in torch's own bit views: nibble
    j of a word, masked in place (nibbles 5-7 from the word >> 12), read as an fp32 denormal,
    is q 2^(4J - 149) exactly; a bf16 pair of x made fp32 with 2^(W4_SHIFT - 4J) added into its
    exponent bits is x 2^(W4_SHIFT - 4J) for every x of 2^-60 <= |x| < 2^40, and a zero is
    2^(W4_SHIFT - 4J - 127) (2^-127 in effect); their product is x q 2^(W4_SHIFT - 149)
    exactly, so the products sum as x q would."""
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-2**31, 2**31 - 1, (4096,), generator=gen, dtype=torch.int64)
    sign = torch.randint(0, 2, (4096,), generator=gen) * 2 - 1
    x = (sign * (1 + torch.rand(4096, generator=gen))
         * 2.0 ** torch.randint(-60, 39, (4096,), generator=gen)).bfloat16()
    assert x.abs().max() < 2**40 and x.abs().min() >= 2**-60
    x[:2] = 0.0
    pairs = x.view(torch.int16).to(torch.int32).view(-1, 2)  # [lo, hi] as each int32 holds them
    packed = (pairs[:, 0] & 0xFFFF) | (pairs[:, 1] << 16)
    shift = int(gemv.W4_SHIFT.value)
    for j in range(8):
        big = 3 if j >= 5 else 0
        src, J = (words >> (4 * big)) & 0xFFFFFFFF, j - big
        q = (words >> (4 * j)) & 0xF
        bits = (src & (0xF << (4 * J))).to(torch.int32).view(torch.float32)
        assert torch.equal(bits.double() * 2.0 ** (149 - 4 * J), q.double()), j
        add = (shift - 4 * J) << 23
        even = ((packed << 16) + add).view(torch.float32)
        odd = ((packed & -65536) + add).view(torch.float32)
        scaled = torch.stack([even, odd], 1).flatten()
        want = x.double() * 2.0 ** (shift - 4 * J)
        want[:2] = 2.0 ** (shift - 4 * J - 127)
        assert torch.equal(scaled.double(), want), j
        assert torch.equal((scaled * bits).double()[2:],
                           x.double()[2:] * q.double()[2:] * 2.0 ** (shift - 149)), j


def test_w4a16_kernels_interpreted() -> None:
    run_interpreter_check("test_kernels_w4a16", "interp_check_w4a16")


def test_gemm_splits_fill_the_gpu_at_decode_rows_only() -> None:
    """At 8 rows (one 16-row tile of rows) Qwen3-4B's qkv (96 tiles) splits K to ~4 programs
    an SM, each split at least 4 K tiles; gate_up's 304 tiles, like a prefill chunk's, already
    fill the GPU."""
    tiles, chunks = 6144 // w4a16.GEMM_TILE_FEW_ROWS[1], 2560 // w4a16.BLOCK_K
    split = gemv.fill_splits(tiles, chunks, 4)
    assert split > 1 and chunks // split >= 4
    assert tiles * split <= 4 * gemv.NUM_SMS + tiles
    assert gemv.fill_splits(19456 // w4a16.GEMM_TILE_FEW_ROWS[1], chunks, 4) == 1


def test_gemv_configs_keep_one_layout_and_fill_the_gpu() -> None:
    """Qwen3-4B's decode shapes at 1..MAX_W4_ROWS rows: each thread on its own run (a warp's
    lanes on one row's runs, or two rows', and the warps on further rows: x's and W's loads in
    one register layout), two rows of W a thread, and at least 2 programs an SM; glu pairs
    gate and up rows itself, K whole."""
    for n, k in ((6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)):
        for m in range(1, MAX_W4_ROWS + 1):
            cfg = w4_gemv_config(m, n, k)
            assert cfg.block_k >= 512 and not cfg.mma and cfg.stack
            assert cfg.num_warps <= cfg.block_n * cfg.block_k // 1024
            assert -(-n // (2 * cfg.block_n)) * cfg.split_k >= 2 * 132
            glu = w4_gemv_config(m, n, k, glu=True)
            assert not glu.stack and glu.split_k == 1


# ---- sm_90 builds (no GPU needed) -------------------------------------------------------------

W4_TYPES = {"x_ptr": "*bf16", "w_ptr": "*i32", "ws_ptr": "*fp16", "s_ptr": "*fp16",
            "b_ptr": "*bf16", "y_ptr": "*bf16"}


def _gemv_w4_build(m_pad: int, cfg: GemvConfig, **flags: bool) -> object:
    compile_ = pytest.importorskip("test_kernels_compile")
    if compile_.HOPPER is None:
        pytest.skip("this triton cannot compile for NVIDIA GPUs")
    meta = {"HAS_BIAS": False, "PARTIAL": False, "EVEN_K": True, "GLU": False, "PDL": False,
            **flags, "M_PAD": m_pad, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
            "GROUP": 128, "STACK": cfg.stack, "PREFETCH": cfg.num_stages > 1}
    return compile_.compile_for_hopper(gemv._gemv_w4_kernel, meta, num_warps=cfg.num_warps,
                                       aligned=True, **W4_TYPES)


def test_w4a16_kernels_build_for_sm90() -> None:
    """The GEMV in the chosen configs at every row class (bias, split K, the fused gate_up,
    PDL), the GEMM at every group (whole and split K)."""
    for m in range(1, MAX_W4_ROWS + 1):
        for n, k in ((6144, 2560), (19456, 2560), (2560, 9728)):
            cfg = w4_gemv_config(m, n, k)
            _gemv_w4_build(m, cfg, EVEN_K=False, HAS_BIAS=True, PDL=True)
            _gemv_w4_build(m, cfg, PARTIAL=True)
            _gemv_w4_build(m, replace(cfg, stack=False), GLU=True)
    compile_ = pytest.importorskip("test_kernels_compile")
    for group in (32, 128, 256):
        for (bm, bn, warps), partial in ((w4a16.GEMM_TILE, False),
                                         (w4a16.GEMM_TILE_FEW_ROWS, True)):
            kernel = compile_.compile_for_hopper(w4a16._w4_gemm_kernel, {
                "G": group, "BM": bm, "BN": bn, "BK": w4a16.BLOCK_K, "HAS_BIAS": not partial,
                "PARTIAL": partial, "MAGIC": gemv.W4_CENTRED[torch.bfloat16][0],
                "CENTRE": gemv.W4_CENTRED[torch.bfloat16][1]},
                num_warps=warps, **W4_TYPES)
            # whole groups a K step: the nibbles become bf16 by bits, no int-to-float convert
            i2f = re.findall(r"cvt\.rn\.f32\.[su]32", kernel.asm["ptx"])
            assert bool(i2f) == (group % w4a16.BLOCK_K != 0), (group, len(i2f))


def test_w4_gemv_streams_the_words_in_16_byte_loads() -> None:
    """Built for sm_90 at one and two rows, as launched (aligned pointers and strides): W's
    words come in 16-byte loads (a run's), bf16 x in 8-byte ones (a nibble's 4 columns) where
    K is whole chunks, and nothing goes through shared memory inside the K loop: x and W keep
    one register layout (`_w4_x_ptrs`)."""
    for m in range(1, MAX_W4_ROWS + 1):
        for even_k in (True, False):
            cfg = w4_gemv_config(m, 6144, 2560)
            kernel = _gemv_w4_build(m, cfg, EVEN_K=even_k)
            ptx = kernel.asm["ptx"]  # type: ignore[attr-defined]
            loads = re.findall(r"ld\.global\S*", ptx)
            words = [ld for ld in loads if "evict_first" in ld]
            xs = [ld for ld in loads if "evict_last" in ld]
            assert words and all(ld.endswith(".v4.b32") for ld in words), loads
            assert xs and (not even_k or all(ld.endswith(".v2.b32") for ld in xs)), loads
            # NOTE: x moved through shared memory every chunk took ~20 barriers (and stmatrix /
            # ldmatrix); the sums across warps after the loop take 3
            assert ptx.count("bar.sync") <= 4 and "matrix" not in ptx, (m, even_k)


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
