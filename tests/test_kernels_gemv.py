"""The decode GEMV (arle_kernels.gemv): the Triton kernel against an fp64 reference, its own
torch reference and F.linear.

GPU tests (skipped without CUDA) use Qwen3-4B's linear shapes in bf16; the interpreter check runs
the same kernel on tiny CPU tensors under TRITON_INTERPRET=1, in a subprocess (the variable must
be set before triton is first imported). Outputs are filled with NaN before each run, so an
element the kernel does not write shows.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from helpers import run_interpreter_check

from arle_kernels import gemv as gemv_module
from arle_kernels.gemv import (
    _TRIGGER_AHEAD_16_ROWS,
    GemvConfig,
    _cp_async_config,
    _late_trigger,
    _launch,
    _pick_config,
    _tma_config,
    _tma_stages,
    _trigger_ahead,
    gemv,
    gemv_ref,
    gemv_silu_mul,
    gemv_silu_mul_ref,
    use_gemv,
)
from arle_kernels.jit import set_pdl

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
#: (N, K) of Qwen3-4B's linear layers
SHAPES: dict[str, tuple[int, int]] = {
    "qkv": (6144, 2560), "o_proj": (2560, 4096), "gate_up": (19456, 2560),
    "down": (2560, 9728), "lm_head": (151936, 2560),
}


def make_inputs(m: int, n: int, k: int, dtype: torch.dtype, device: str, bias: bool,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x ~ N(0, 1), W ~ N(0, 1/K) (outputs ~ N(0, 1)), bias ~ N(0, 1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device=device).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) * k ** -0.5).to(dtype)
    b = torch.randn(n, generator=gen, device=device).to(dtype) if bias else None
    return x, w, b


def exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T + b in fp64 from the same (rounded) inputs."""
    y = x.double() @ w.double().T
    return y + b.double() if b is not None else y


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| over the whole output; NaN/inf anywhere fails."""
    assert torch.isfinite(out).all(), "NaN/inf in the output (an element was not written)"
    diff = (out.double() - ref.double()).norm()
    return float(diff / ref.double().norm().clamp_min(1e-30))


def check(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, tol: float,
          cfg: GemvConfig | None = None) -> torch.Tensor:
    """gemv (or `cfg` through _launch) into a NaN-poisoned output, against the fp64 result and
    gemv_ref, each within `tol`."""
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    got = gemv(x, w, b, out=out) if cfg is None else _launch(x, w, b, out, cfg)
    assert got.data_ptr() == out.data_ptr() and got.dtype == x.dtype
    what = f"M={x.shape[0]} N={w.shape[0]} K={x.shape[1]} bias={b is not None} cfg={cfg}"
    err = rel_err(got, exact(x, w, b))
    assert err < tol, f"{what}: rel {err:.2e} vs fp64"
    err = rel_err(got, gemv_ref(x, w, b))
    assert err < tol, f"{what}: rel {err:.2e} vs gemv_ref"
    return got


# ---- CPU: the rules, the reference ----------------------------------------------------------

def test_ref_matches_fp64_and_f_linear() -> None:
    x, w, b = make_inputs(3, 40, 96, torch.float32, "cpu", bias=True)
    ref = gemv_ref(x, w, b)
    assert ref.dtype == x.dtype and ref.shape == (3, 40)
    assert rel_err(ref, exact(x, w, b)) < 1e-6
    assert torch.allclose(ref, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    out = torch.full((3, 40), float("nan"))
    assert gemv_ref(x, w, b, out=out) is out and torch.equal(out, ref)


@pytest.mark.parametrize("tma", [False, True], ids=["cp_async", "tma"])
def test_use_gemv_rule(tma: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """M = 1 and 2 on every Qwen3-4B shape (where the FMA kernel beat cuBLAS on the H200);
    M = 3..16 with TMA (Hopper) every shape; without it where the cp.async kernel made the
    engine's batch-8 step faster (the fused gate_up, lm_head), not where it lost (qkv) or only
    won alone (o_proj, down); M = 17..MAX_M with TMA only; never M = 0 or M > MAX_M. And the
    row counts a warm-up runs: one per kernel variant (FMA at 1, 2; each M_PAD of the MMA)."""
    monkeypatch.setattr(gemv_module, "tma_available", lambda: tma)
    top = gemv_module.MAX_M
    for n, k in SHAPES.values():
        assert use_gemv(1, n, k) and use_gemv(2, n, k)
        assert not any(use_gemv(m, n, k) for m in (0, top + 1, 2 * top))
        assert [use_gemv(m, n, k, glu) for m in (17, top) for glu in (False, True)] == [tma] * 4
    classes = gemv_module.row_classes()
    assert classes[:2] == (1, 2)
    pads = [max(16, 1 << (m - 1).bit_length()) for m in classes[2:]]
    assert pads == [16 << i for i in range(len(pads))]
    assert pads[-1] == (top if tma else 16)
    for m in (3, 8, 16):
        assert use_gemv(m, *SHAPES["lm_head"])
        assert use_gemv(m, *SHAPES["gate_up"], glu=True)
        rest = [use_gemv(m, *SHAPES[s]) for s in ("qkv", "o_proj", "down")]
        assert rest == [tma] * 3


@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_pick_config(m: int, shape: str) -> None:
    """Configs the GPU layout argument holds for, at most one split per 2 BLOCK_K chunks
    (mma) or one (FMA), enough programs for 132 SMs. FMA kernel (M <= 2): BLOCK_K a multiple of
    8 x 32 x warps, at most 64 fp32 accumulator registers per thread (M_PAD x BLOCK_N x runs of
    8 per thread). Tensor-core kernel (M = 3..16): tiles of >= 16 rows, and one config for every
    M (a row's sum must not depend on the batch)."""
    n, k = SHAPES[shape]
    cfg = _pick_config(m, n, k)
    assert cfg.block_n & (cfg.block_n - 1) == 0
    assert -(-n // cfg.block_n) * cfg.split_k >= 132
    if m <= 2:
        assert not cfg.mma and cfg.block_k % (8 * 32 * cfg.num_warps) == 0
        assert 1 <= cfg.split_k <= -(-k // cfg.block_k)
        assert triton_next_pow2(m) * cfg.block_n * cfg.block_k // (32 * cfg.num_warps) <= 8 * 64
    else:
        assert cfg.mma and cfg.block_n >= 16 and cfg.block_k >= 16
        assert 1 <= 2 * cfg.split_k <= -(-k // cfg.block_k)
        assert all(_pick_config(other, n, k) == cfg for other in (3, 5, 16))


def test_pick_config_splits_small_n() -> None:
    """Few rows: K is split so there are programs for every SM, each split >= 2 chunks."""
    cfg = _pick_config(1, 40, 9728)
    assert cfg.split_k > 1 and -(-9728 // cfg.block_k) >= 2 * cfg.split_k
    assert _pick_config(1, 6144, 2560).split_k == 1


def test_tma_stages() -> None:
    """The TMA kernel's stages for Qwen3-4B's shapes: at up to 16 rows two programs of the fused
    gate_up share an SM (227 KB of shared memory, 1 KB more a program), so its 152 tiles are
    all resident on 132 SMs; at 32 rows, and for the other layers, as many as fit in
    _TMA_SMEM; never fewer than 2."""
    def smem(cfg: GemvConfig, glu: bool, m_pad: int) -> int:
        stages = _tma_stages(cfg, glu, m_pad, 2)
        assert stages >= 2
        return stages * (cfg.block_n * (2 if glu else 1) + m_pad) * cfg.block_k * 2 + 1024

    n, k = SHAPES["gate_up"]
    glu = _tma_config(n, k, True)
    assert 2 * smem(glu, True, 16) <= 227 * 1024 < 3 * smem(glu, True, 16)
    assert -(-(n // 2) // glu.block_n) <= 2 * 132
    assert smem(glu, True, 32) > 227 * 1024 // 2  # one program an SM, its most stages
    assert _tma_stages(glu, True, 32, 2) == gemv_module._TMA_SMEM // ((128 + 32) * 128 * 2)
    for shape in ("qkv", "o_proj", "down", "lm_head"):
        cfg = _tma_config(*SHAPES[shape], False)
        assert _tma_stages(cfg, False, 16, 2) == _tma_stages(cfg, False, 32, 2) == cfg.num_stages


def test_late_trigger_layers() -> None:
    """Which of Qwen3-4B's layers let the next kernel launch only after their K loop on TMA:
    o_proj, down and the fused gate_up; not qkv (the rope and decode attention after it start
    early) nor lm_head."""
    late = {shape: _late_trigger(False, *SHAPES[shape])
            for shape in ("qkv", "o_proj", "down", "lm_head")}
    n2, k = SHAPES["gate_up"]
    assert late == {"qkv": False, "o_proj": True, "down": True, "lm_head": False}
    assert _late_trigger(True, n2 // 2, k)


def test_trigger_ahead_layers() -> None:
    """The late trigger fires two chunks early only where a norm comes next (o_proj, down) and
    at up to 16 rows: never in the fused gate_up (down's programs must land after its own),
    never at 32 rows, never where the trigger is first thing anyway."""
    for shape in ("qkv", "o_proj", "down", "lm_head"):
        n, k = SHAPES[shape]
        late = _late_trigger(False, n, k)
        assert _trigger_ahead(late, False, 16) == (2 if late else 0)
        assert _trigger_ahead(late, False, 32) == 0
        cfg = _tma_config(n, k, False)
        # the trigger chunk lies inside every split's K range (a split has >= 2 chunks)
        assert -(-k // cfg.block_k) // cfg.split_k >= _TRIGGER_AHEAD_16_ROWS
    assert _trigger_ahead(True, True, 16) == _trigger_ahead(True, True, 8) == 0


def triton_next_pow2(m: int) -> int:
    return 1 << (m - 1).bit_length()


# ---- interpreter (CI, CPU) -------------------------------------------------------------------

def interp_check_gemv() -> None:
    """Tiny shapes through the Triton kernel on CPU; needs TRITON_INTERPRET=1 set before triton
    is imported."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 1e-3)):
        for m in (1, 3):
            for bias in (False, True):
                x, w, b = make_inputs(m, 40, 96, dtype, "cpu", bias, seed=m)
                check(x, w, b, tol)  # the config gemv picks (K=96 < BLOCK_K: masked K)
                # BLOCK_N not dividing N, three K steps (EVEN_K), split K over 3 and 2 programs
                # (a ragged last split), a partial last K step (BLOCK_K 64 over K=96)
                for cfg in (GemvConfig(block_n=16, block_k=32, num_warps=1),
                            GemvConfig(block_n=8, block_k=32, num_warps=1, split_k=3),
                            GemvConfig(block_n=4, block_k=32, num_warps=1, split_k=2),
                            GemvConfig(block_n=2, block_k=64, num_warps=1, split_k=2)):
                    check(x, w, b, tol, cfg)
    # strided x and out (views into wider buffers); the rest of out's buffer stays untouched
    x, w, b = make_inputs(3, 40, 96, torch.float32, "cpu", bias=True, seed=7)
    wide_x = torch.randn(3, 160)
    wide_x[:, 32:128] = x
    wide_out = torch.full((3, 100), 7.0)
    out = wide_out[:, 50:90].fill_(float("nan"))
    gemv(wide_x[:, 32:128], w, b, out=out)
    assert rel_err(out, exact(x, w, b)) < 1e-5
    assert (wide_out[:, :50] == 7.0).all() and (wide_out[:, 90:] == 7.0).all()
    # M = 8 and 5 rows (padding to 8) with split K
    for m in (5, 8):
        x, w, b = make_inputs(m, 24, 64, torch.float32, "cpu", bias=False, seed=m)
        check(x, w, b, 1e-5)
        check(x, w, b, 1e-5, GemvConfig(block_n=4, block_k=16, num_warps=1, split_k=4))
    # gate_up with silu * up in the epilogue: N = 20 outputs from 40 rows, masked and even K,
    # BLOCK_N not dividing N; fp16 rounds gate and up as the reference does
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 1e-3)):
        for m, k in ((1, 96), (2, 64), (3, 96)):
            x, w, _ = make_inputs(m, 40, k, dtype, "cpu", bias=False, seed=10 + m)
            check_silu_mul(x, w, tol)
            check_silu_mul(x, w, tol, GemvConfig(block_n=8, block_k=32, num_warps=1))


    # the tensor-core kernel (3..16 rows, padded to 16): BLOCK_N not dividing N, masked and
    # even K, split K with a ragged last split, the fused activation (bf16 tl.dot is broken
    # under the interpreter: fp32 and fp16 only)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 1e-3)):
        for m, k, split in ((3, 96, 1), (8, 256, 3), (16, 200, 2)):
            x, w, b = make_inputs(m, 40, k, dtype, "cpu", bias=split == 1, seed=20 + m)
            cfg = GemvConfig(block_n=16, block_k=64, num_warps=1, split_k=split, mma=True)
            check(x, w, b, tol, cfg)
            check_silu_mul(x, w, tol, GemvConfig(block_n=16, block_k=64, num_warps=1,
                                                 mma=True))
    # the TMA kernel (descriptors zero-fill x's rows past M and K's tail), fp16; K = 100 has
    # rows TMA cannot read (200 bytes: not 16-byte aligned) and falls back to the kernel above
    for m, k, split in ((3, 96, 1), (8, 256, 3), (16, 200, 2), (5, 100, 1)):
        x, w, b = make_inputs(m, 40, k, torch.float16, "cpu", bias=split == 1, seed=30 + m)
        cfg = GemvConfig(block_n=64, block_k=32, num_warps=4, num_stages=2, split_k=split,
                         mma=True, tma=True)
        check(x, w, b, 1e-3, cfg)
        check_silu_mul(x, w, 1e-3, replace(cfg, split_k=1))


def check_silu_mul(x: torch.Tensor, gate_up: torch.Tensor, tol: float,
                   cfg: GemvConfig | None = None) -> torch.Tensor:
    """gemv_silu_mul (or `cfg` through _launch) into a NaN-poisoned output against its
    reference, silu_and_mul(gemv(x, gate_up)): within `tol` (norm-wise), and in a 16-bit dtype
    the same bits in >= 99% of the elements (gate and up are rounded to the dtype before the
    activation, as the reference rounds them; only a sum on a rounding boundary may differ)."""
    m, inter = x.shape[0], gate_up.shape[0] // 2
    out = torch.full((m, inter), float("nan"), dtype=x.dtype, device=x.device)
    got = gemv_silu_mul(x, gate_up, out=out) if cfg is None else _launch(
        x, gate_up, None, out, cfg, glu=True)
    assert got.data_ptr() == out.data_ptr() and got.shape == (m, inter)
    ref = gemv_silu_mul_ref(x, gate_up)
    what = f"M={m} gate_up {tuple(gate_up.shape)} cfg={cfg}"
    err = rel_err(got, ref)
    assert err < tol, f"{what}: rel {err:.2e}"
    if x.element_size() == 2:
        same = (got == ref).float().mean().item()
        assert same >= 0.99, f"{what}: {same:.2%} bit-equal"
    return got


@pytest.mark.slow
def test_interpreter() -> None:
    run_interpreter_check("test_kernels_gemv", "interp_check_gemv")


# ---- GPU -------------------------------------------------------------------------------------

@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 24, 32])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gpu_matches_reference(shape: str, m: int, bias: bool) -> None:
    n, k = SHAPES[shape]
    x, w, b = make_inputs(m, n, k, torch.bfloat16, "cuda", bias, seed=m)
    got = check(x, w, b, 1e-2)
    # and close to what cuBLAS gives (both bf16 outputs)
    assert rel_err(got, F.linear(x, w, b)) < 1e-2
    # deterministic: the same bits again (split K reduces in a fixed order, no atomics)
    assert torch.equal(gemv(x, w, b), got)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4])
def test_gpu_odd_shapes(m: int) -> None:
    """N, K off every block size (K % 8 != 0 too: scalar loads), fp16 and fp32, strided x."""
    for n, k, dtype in ((1000, 2500, torch.bfloat16), (77, 4100, torch.float16),
                        (3000, 1001, torch.float32), (5, 9728, torch.bfloat16)):
        x, w, b = make_inputs(m, n, k, dtype, "cuda", bias=True, seed=n)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-3
        check(x, w, b, tol)
        wide = torch.zeros(m, k + 64, dtype=dtype, device="cuda")
        wide[:, 64:] = x
        check(wide[:, 64:], w, b, tol)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2])
def test_gpu_silu_mul(m: int) -> None:
    """Qwen3-4B's gate_up with the activation fused, and an odd size, against the reference."""
    for n2, k in (SHAPES["gate_up"], (2 * 1000, 2500)):
        x, w, _ = make_inputs(m, n2, k, torch.bfloat16, "cuda", bias=False, seed=m)
        check_silu_mul(x, w, 1e-2)


def used_tiles(config: Callable[[int, int, bool], GemvConfig]) -> list[tuple[int, ...]]:
    """The tiles `config` picks for Qwen3-4B's shapes (scripts/bench_kernels.py sweep times others)."""
    return sorted({(c.block_n, c.block_k, c.num_warps, c.num_stages)
                   for c in (config(n, k, glu) for n, k in SHAPES.values()
                             for glu in (False, True))})


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tile", used_tiles(_cp_async_config),
                         ids=lambda t: "n{}k{}w{}s{}".format(*t))
def test_gpu_mma_tiles(tile: tuple[int, int, int, int]) -> None:
    """The tensor-core kernel's tiles in use, on Qwen3-4B's o_proj and down shapes
    (split K 1 and 4) and an odd one, at 3 / 8 / 16 rows, bf16 and fp32 (ieee, not tf32), and
    the fused activation: against fp64 and gemv_ref. A row's bits do not depend on the other
    rows (the same first rows at M = 3, 8, 16, ... up to MAX_M with TMA: batch invariance)."""
    check_mma_tile(tile, tma=False, odd_dtype=torch.float32)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tile", sorted({*used_tiles(_tma_config), (32, 128, 2, 4)}),
                         ids=lambda t: "n{}k{}w{}s{}".format(*t))
def test_gpu_tma_tiles(tile: tuple[int, int, int, int]) -> None:
    """The TMA kernel's tiles in use and one on mma.sync (Hopper): test_gpu_mma_tiles'
    checks, its odd shape in fp16 (TMA pads
    x's rows past M and K's tail with zeros: 2504 is no multiple of any BLOCK_K), and a K of
    2500 (rows not 16-byte aligned: TMA cannot read them, the cp.async kernel takes over)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs compute capability 9.0 (Hopper)")
    check_mma_tile(tile, tma=True, odd_dtype=torch.float16, odd_k=2504)
    x, w, b = make_inputs(8, 1000, 2500, torch.bfloat16, "cuda", bias=True, seed=7)
    check(x, w, b, 1e-2, GemvConfig(*tile, split_k=1, mma=True, tma=True))


def check_mma_tile(tile: tuple[int, int, int, int], tma: bool, odd_dtype: torch.dtype,
                   odd_k: int = 2500) -> None:
    bn, bk, warps, stages = tile
    for (n, k), dtype in ((SHAPES["o_proj"], torch.bfloat16),
                          (SHAPES["down"], torch.bfloat16), ((1000, odd_k), odd_dtype)):
        tol = 1e-2 if dtype != torch.float32 else 1e-5
        for split in (1, 4):
            cfg = GemvConfig(bn, bk, warps, stages, split, mma=True, tma=tma)
            # NOTE: with TMA up to MAX_M rows (M_PAD 32): a row's bits must not depend on it
            rows = gemv_module.MAX_M if tma else 16
            x, w, b = make_inputs(rows, n, k, dtype, "cuda", bias=split == 1, seed=n)
            full = check(x, w, b, tol, cfg)
            for m in (3, 8, 16, 32, 48):
                if m >= rows:
                    break
                part = check(x[:m].contiguous(), w, b, tol, cfg)
                assert torch.equal(part, full[:m]), f"rows changed with M: {cfg}"
    x, w, _ = make_inputs(8, 2 * 1000, 2560, torch.bfloat16, "cuda", bias=False, seed=5)
    check_silu_mul(x, w, 1e-2, GemvConfig(bn, bk, warps, stages, 1, mma=True, tma=tma))


@needs_cuda
@pytest.mark.gpu
def test_gpu_pdl_same_bits() -> None:
    """Launched with programmatic dependent launch (each kernel starts while the one before
    ends, W's first chunk loaded before waiting), chained kernels in a CUDA graph give the
    same bits as launched plainly: a GEMV whose x the previous GEMV writes, split K and not,
    and the fused activation."""
    torch.cuda.set_device(0)
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs compute capability 9.0+")
    x, w1, _ = make_inputs(1, 2560, 2560, torch.bfloat16, "cuda", bias=False, seed=1)
    w2 = make_inputs(1, 40, 2560, torch.bfloat16, "cuda", bias=False, seed=2)[1]  # split K
    w3 = make_inputs(1, 2 * 2560, 40, torch.bfloat16, "cuda", bias=False, seed=3)[1]

    def chain() -> torch.Tensor:
        h = gemv(x, w1)
        return gemv_silu_mul(gemv(h, w2), w3)

    results = []
    try:
        for pdl in (False, True):
            set_pdl(pdl)
            chain()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = chain()
            y.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            results.append(y.clone())
    finally:
        set_pdl(None)
    assert torch.isfinite(results[0]).all() and torch.equal(results[0], results[1])


@needs_cuda
@pytest.mark.gpu
def test_gpu_cuda_graph() -> None:
    """gemv captured in a CUDA graph (a split-K shape and a plain one) replays with new x."""
    for n, k in ((40, 9728), SHAPES["qkv"]):
        x, w, b = make_inputs(2, n, k, torch.bfloat16, "cuda", bias=True)
        gemv(x, w, b)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = gemv(x, w, b)
        for seed in (1, 2):
            x.copy_(make_inputs(2, n, k, torch.bfloat16, "cuda", bias=False, seed=seed)[0])
            y.fill_(float("nan"))
            graph.replay()
            assert rel_err(y, exact(x, w, b)) < 1e-2
