"""Block-scaled FP8 linears (arle_kernels.fp8): the torch references against transformers'
dequantisation and a longhand per-block loop (partial edge blocks), then each Triton kernel
against the reference (interpreter, tiny shapes; GPU, Qwen3-30B-A3B's dense shapes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import capture, hf_fp8_dequantize, run_interpreter_check

from arle_kernels.fp8 import (
    GEMV_MAX_M,
    W8A16_MAX_M,
    Fp8Config,
    _launch_fp8_linear,
    _pick_fp8_config,
    fp8_linear,
    fp8_linear_unreduced,
    fp8_row_classes,
    fp8_silu_mul,
    quantize_fp8_groups,
)
from arle_kernels.fp8_ref import (
    FP8,
    fp8_dequant_groups_ref,
    fp8_dequant_ref,
    fp8_linear_ref,
    fp8_linear_w8a8_ref,
    quantize_fp8_groups_ref,
)
from arle_kernels.fused import silu_and_mul
from arle_kernels.fused_ref import silu_and_mul_ref
from arle_kernels.gemv import USE_GEMV_MAX_M, GemvConfig, gemv_fp8_silu_mul
from arle_kernels.linear import linear_silu_and_mul
from arle_kernels.linear_ref import attach_fp8_scale
from arle_kernels.split_sums import SplitSums, take

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


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
    want = hf_fp8_dequantize(w, scale, list(block), torch.float32)
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


def test_quantize_groups_ref() -> None:
    """Per (row, group): the scale puts the group's amax on 448; dequantised values within half
    an e4m3 step (2^-4 relative) of x; a zero group stays zero."""
    x = torch.randn(3, 70) * 5
    x[1, 16:32] = 0.0
    q, scale = quantize_fp8_groups_ref(x, 16)
    assert q.dtype == FP8 and q.shape == x.shape and scale.shape == (3, 5)
    amax = F.pad(x, (0, 10)).view(3, 5, 16).abs().amax(-1)
    torch.testing.assert_close(scale[scale > 1e-9], (amax / 448)[scale > 1e-9])
    assert q[1, 16:32].float().eq(0).all()
    back = fp8_dequant_groups_ref(q, scale, 16)
    step = scale.repeat_interleave(16, -1)[:, :70] * 2.0 ** -9  # e4m3's smallest subnormal
    assert ((back - x).abs() <= (x.abs() * 2.0 ** -4).clamp_min(step) + 1e-12).all()
    assert q.float().abs().amax() == 448.0


def test_w8a8_ref_close_to_linear_ref() -> None:
    block = (16, 32)
    w, scale = make_fp8(40, 70, block)
    x = torch.randn(9, 70)
    got, want = fp8_linear_w8a8_ref(x, w, scale, block), fp8_linear_ref(x, w, scale, block)
    assert got.dtype == x.dtype
    assert 0 < ((got - want).norm() / want.norm()).item() < 0.05


def kind_of(cfg: GemvConfig | Fp8Config) -> str:
    if isinstance(cfg, GemvConfig):
        return "gemv_mma" if cfg.mma else "gemv"
    return cfg.kind


def test_pick_config() -> None:
    """Row classes: kernels/gemv.py's FMA GEMV and its tensor-core GEMV (never TMA: tiles are
    dequantised in registers), then W8A16 tiles, then W8A8; K steps inside one scale block."""
    for m, kind in ((1, "gemv"), (2, "gemv"), (3, "gemv_mma"), (GEMV_MAX_M, "gemv_mma"),
                    (GEMV_MAX_M + 1, "w8a16"), (W8A16_MAX_M, "w8a16"),
                    (W8A16_MAX_M + 1, "w8a8"), (4096, "w8a8")):
        for block in ((128, 128), (16, 16)):
            cfg = _pick_fp8_config(m, 5120, 2048, block)
            assert kind_of(cfg) == kind, (m, cfg)
            if isinstance(cfg, Fp8Config):
                assert cfg.block_m >= 16 and cfg.block_n >= 16 and cfg.block_k >= 16
            if kind != "gemv":
                assert block[1] % cfg.block_k == 0, (m, cfg)


def test_row_classes_cover_every_config() -> None:
    """A warm-up running fp8_row_classes meets every config of 1..max_rows rows once."""
    classes = fp8_row_classes(5120, 2048, (128, 128), 4096)
    cfgs = [_pick_fp8_config(m, 5120, 2048, (128, 128)) for m in classes]
    assert len(set(cfgs)) == len(cfgs) and classes[0] == 1
    assert {_pick_fp8_config(m, 5120, 2048, (128, 128)) for m in range(1, 4097)} == set(cfgs)


# ---- interpreter (CPU): every kernel against its ref on tiny shapes -----------------------

def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all()
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def nan_fenced(scale: torch.Tensor) -> torch.Tensor:
    """scale as a view into a buffer with a NaN row and column past its edges: a kernel that
    reads a scale past K's or N's last block gives NaN, not whatever memory lay there."""
    fenced = torch.full((scale.shape[0] + 1, scale.shape[1] + 1), float("nan"))
    fenced[:-1, :-1] = scale
    return fenced[:-1, :-1]


def interp_check_fp8() -> None:
    """Under TRITON_INTERPRET=1: quantize_fp8_groups against its ref (the interpreter's own
    e4m3 rounding, see interp_fp8_cast), each kernel kind of fp8_linear against its ref on
    odd shapes with partial scale blocks, fp32 and fp16 (the interpreter's bf16 dots are
    wrong)."""
    from test_kernels_fused import interp_fp8_cast

    gen = torch.Generator().manual_seed(7)
    for group in (16, 32):
        x = torch.randn(5, 70, generator=gen) * 3
        x[2, :group] = 0.0
        q, scale = quantize_fp8_groups(x, group)
        _, scale_ref = quantize_fp8_groups_ref(x, group)
        assert torch.equal(scale, scale_ref)
        quot = (x / scale.repeat_interleave(group, -1)[:, :70]).clamp(-448, 448)
        assert torch.equal(q.view(torch.uint8), interp_fp8_cast(quot).view(torch.uint8))
    cases = [((16, 16), 40, 70), ((16, 32), 33, 48), ((32, 16), 40, 70)]
    for i, (block, n, k) in enumerate(cases):
        w, ws = make_fp8(n, k, block, seed=n + k)
        ws = nan_fenced(ws)
        for dtype in (torch.float32, torch.float16):
            bias = torch.randn(n, generator=gen).to(dtype)
            for m in (1, 3, 4, 17):
                x = torch.randn(m, k, generator=gen).to(dtype)
                b = bias if (m + i) % 2 else None
                cfgs: list[GemvConfig | Fp8Config] = [Fp8Config(kind, 16, 16, 16)
                                                      for kind in ("w8a16", "w8a8")]
                if m in (1, 3):  # kernels/gemv.py's FMA (runs of 16) and tensor-core GEMVs:
                    # one row, and rows padded to 4 (4 rows is the same code, unmasked)
                    cfgs += [GemvConfig(2, 32, num_warps=1), GemvConfig(4, 32, num_warps=1),
                             GemvConfig(1, 16, split_k=2),
                             GemvConfig(16, 16, num_warps=1, mma=True),
                             GemvConfig(16, 16, num_warps=1, split_k=2, mma=True)]
                for cfg in cfgs:
                    check_fp8_linear(x, w, ws, block, b, cfg)
    # split sums left for the consumer: the same y as the reduce kernel's
    w, ws = make_fp8(40, 70, (16, 16))
    x = torch.randn(3, 70, generator=gen)
    cfg = GemvConfig(16, 16, num_warps=1, split_k=3, mma=True)
    y = _launch_fp8_linear(x, w, ws, (16, 16), None, cfg)
    sums = _launch_fp8_linear(x, w, ws, (16, 16), None, cfg, sums=True)
    assert isinstance(sums, SplitSums) and torch.allclose(take(sums), y, rtol=1e-6, atol=1e-6)
    # the dispatcher: its kernel for each row count
    w, ws = make_fp8(40, 70, (16, 32))
    for m in (2, 3, GEMV_MAX_M + 1, W8A16_MAX_M + 3):
        x = torch.randn(m, 70, generator=gen)
        cfg = _pick_fp8_config(m, 40, 70, (16, 32))
        want = _launch_fp8_linear(x, w, ws, (16, 32), None, cfg)
        assert torch.equal(fp8_linear(x, w, ws, (16, 32)), want)
        assert torch.equal(take(fp8_linear_unreduced(x, w, ws, (16, 32))), want)
    assert fp8_linear(x[:0], w, ws, (16, 32)).shape == (0, 40)
    interp_check_fp8_silu_mul()


def interp_check_fp8_silu_mul() -> None:
    """The FP8 gate_up with silu(gate) * up in the GEMV's epilogue: against the ref, and the
    same values as the unfused GEMV in that tile, then `silu_and_mul` (one order of sums, one
    rounding, the same Triton activation); `linear_silu_and_mul` fuses up to USE_GEMV_MAX_M
    rows and falls back past it. N = 20 gate rows: a 16-row scale block holds the last gate
    rows and the first up rows."""
    gen = torch.Generator().manual_seed(11)
    block = (16, 16)
    gate_up, ws = make_fp8(40, 70, block, seed=3)
    ws = nan_fenced(ws)
    for dtype in (torch.float32, torch.float16):
        for m in range(1, USE_GEMV_MAX_M + 1):
            x = torch.randn(m, 70, generator=gen).to(dtype)
            want = silu_and_mul_ref(fp8_linear_ref(x, gate_up, ws, block))
            for cfg in (None, GemvConfig(2, 32, num_warps=1), GemvConfig(4, 64, num_warps=2)):
                got = gemv_fp8_silu_mul(x, gate_up, (ws, block), cfg)
                what = f"{cfg} M={m} {dtype}"
                assert got.shape == (m, 20) and got.dtype == dtype, what
                tol = 1e-6 if dtype == torch.float32 else 2e-3
                assert rel(got, want) < tol, (what, rel(got, want))
                if cfg is not None:
                    apart = silu_and_mul(_launch_fp8_linear(x, gate_up, ws, block, None, cfg))
                    assert torch.equal(got, apart), what
    attach_fp8_scale(gate_up, ws, block)
    for m in (1, USE_GEMV_MAX_M + 1):
        x = torch.randn(m, 70, generator=gen)
        fused = fp8_silu_mul(x, gate_up, ws, block)
        assert (fused is None) == (m > USE_GEMV_MAX_M)
        want = fused if fused is not None else silu_and_mul(fp8_linear(x, gate_up, ws, block))
        assert torch.equal(linear_silu_and_mul(x, gate_up), want)


def check_fp8_linear(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                     block: tuple[int, int], bias: torch.Tensor | None,
                     cfg: GemvConfig | Fp8Config) -> None:
    got = _launch_fp8_linear(x, w, ws, block, bias, cfg)
    what = f"{cfg} M={x.shape[0]} N={w.shape[0]} K={x.shape[1]} {x.dtype} bias={bias is not None}"
    assert got.dtype == x.dtype and got.shape == (x.shape[0], w.shape[0]), what
    assert torch.isfinite(got).all(), (what, got)
    tol = 1e-6 if x.dtype == torch.float32 else 2e-3
    if kind_of(cfg) == "w8a8":
        # against the kernel's own quantised activations: the interpreter rounds to e4m3
        # its own way (a value may land on half its e4m3 neighbour), so no check against
        # fp8_linear_ref here; the quantisation itself is checked above
        q, s = quantize_fp8_groups(x, block[1])
        want = F.linear(fp8_dequant_groups_ref(q, s, block[1]), fp8_dequant_ref(w, ws, block),
                        bias.float() if bias is not None else None).to(x.dtype)
        assert rel(got, want) < tol, (what, rel(got, want))
    else:
        want = fp8_linear_ref(x, w, ws, block, bias)
        assert rel(got, want) < tol, (what, rel(got, want))


def test_fp8_kernels_interpreter() -> None:
    run_interpreter_check("test_kernels_fp8", "interp_check_fp8")


# ---- GPU: Qwen3-30B-A3B's dense projections -------------------------------------------------

#: (N, K) of Qwen3-30B-A3B's FP8 dense linears: qkv (32 + 2 x 4 heads of 128), o_proj
GPU_SHAPES = {"qkv": (5120, 2048), "o_proj": (2048, 4096)}


def gpu_case(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=gen, device="cuda") * 100).clamp(-448, 448).to(FP8)
    ws = torch.rand(-(-n // 128), -(-k // 128), generator=gen, device="cuda") * 1e-4 + 1e-4
    return x, w, ws


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16, 33, 64, 65, 300, 2048])
def test_fp8_linear_gpu(shape: str, m: int) -> None:
    n, k = GPU_SHAPES[shape]
    x, w, ws = gpu_case(m, n, k)
    got = fp8_linear(x, w, ws, (128, 128))
    want = fp8_linear_ref(x.float(), w, ws, (128, 128))
    cfg = _pick_fp8_config(m, n, k, (128, 128))
    if kind_of(cfg) == "w8a8":
        assert rel(got, fp8_linear_w8a8_ref(x.float(), w, ws, (128, 128))) < 1e-2
        assert rel(got, want) < 5e-2
    else:
        assert rel(got, want) < 1e-2
    if isinstance(cfg, GemvConfig):  # its split sums, left for a consumer: the same y
        assert rel(take(fp8_linear_unreduced(x, w, ws, (128, 128))), got) < 1e-3


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", range(1, USE_GEMV_MAX_M + 1))
def test_fp8_silu_mul_gpu(m: int) -> None:
    """Qwen3-4B's FP8 gate_up (`--quantization fp8`) with the activation in the GEMV's
    epilogue: against the ref, and within a rounding of the unfused GEMV then silu."""
    x, gate_up, ws = gpu_case(m, 2 * 9728, 2560)
    got = fp8_silu_mul(x, gate_up, ws, (128, 128))
    assert got is not None and got.shape == (m, 9728)
    want = silu_and_mul_ref(fp8_linear_ref(x.float(), gate_up, ws, (128, 128)))
    assert rel(got, want) < 1e-2
    apart = silu_and_mul_ref(fp8_linear(x, gate_up, ws, (128, 128)))
    assert rel(got, apart) < 1e-2


@pytest.mark.gpu
@needs_cuda
def test_fp8_kernel_kinds_agree_gpu() -> None:
    """Each kernel kind forced on the same rows (bias too): W8A16 kinds within bf16 rounding
    of the ref, W8A8 of its own ref."""
    n, k = GPU_SHAPES["qkv"]
    x, w, ws = gpu_case(4, n, k, seed=1)
    bias = torch.randn(n, device="cuda").bfloat16()
    want = fp8_linear_ref(x.float(), w, ws, (128, 128), bias.float())
    for cfg in (_pick_fp8_config(4, n, k, (128, 128)), GemvConfig(2, 512, num_warps=1),
                GemvConfig(64, 128, split_k=4, mma=True), Fp8Config("w8a16", 16, 64, 128),
                Fp8Config("w8a8", 16, 64, 128)):
        got = _launch_fp8_linear(x, w, ws, (128, 128), bias, cfg)
        assert rel(got, want) < (5e-2 if kind_of(cfg) == "w8a8" else 1e-2), cfg


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 8, 100])
def test_fp8_linear_graph_gpu(m: int) -> None:
    """Captured in a CUDA graph: replays follow new inputs written into the same buffer."""
    n, k = GPU_SHAPES["o_proj"]
    x, w, ws = gpu_case(m, n, k)
    graph, out = capture(lambda: fp8_linear(x, w, ws, (128, 128)))
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fp8_linear(x, w, ws, (128, 128)))
