"""The decode GEMV (arle_kernels.gemv): the Triton kernel against an fp64 reference, its own
torch reference and F.linear.

GPU tests (skipped without CUDA) use Qwen3-4B's linear shapes in bf16; the interpreter check runs
the same kernel on tiny CPU tensors under TRITON_INTERPRET=1, in a subprocess (the variable must
be set before triton is first imported). Outputs are filled with NaN before each run, so an
element the kernel does not write shows.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from helpers import run_interpreter_check

from arle_kernels.fused import silu_and_mul_ref
from arle_kernels.gemv import (
    ADD_RMS,
    BENCH_SHAPES,
    MAX_M,
    RMS,
    SILU,
    GemvConfig,
    _launch,
    _pick_config,
    add_rms_norm_linear,
    add_rms_norm_linear_ref,
    gemv,
    gemv_ref,
    silu_and_mul_linear,
    silu_and_mul_linear_ref,
    use_gemv,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


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
    got = gemv(x, w, b, out=out) if cfg is None else _launch(x, w, b, out, cfg)[0]
    assert got.data_ptr() == out.data_ptr() and got.dtype == x.dtype
    what = f"M={x.shape[0]} N={w.shape[0]} K={x.shape[1]} bias={b is not None} cfg={cfg}"
    err = rel_err(got, exact(x, w, b))
    assert err < tol, f"{what}: rel {err:.2e} vs fp64"
    err = rel_err(got, gemv_ref(x, w, b))
    assert err < tol, f"{what}: rel {err:.2e} vs gemv_ref"
    return got


def prologue_inputs(m: int, n: int, k: int, dtype: torch.dtype, device: str, seed: int = 0
                    ) -> dict[str, torch.Tensor]:
    """x, residual ~ N(0, 1), a norm weight ~ 1 +- 0.5, W ~ N(0, 1/K), gate_up ~ N(0, 2)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)
    return {"x": randn(m, k).to(dtype), "residual": randn(m, k).to(dtype),
            "norm": (1 + 0.5 * randn(k)).to(dtype), "w": (randn(n, k) * k ** -0.5).to(dtype),
            "gate_up": (2 * randn(m, 2 * k)).to(dtype)}


def exact_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm: torch.Tensor,
                      eps: float, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 RMSNorm(s) @ W^T for s = x + residual rounded to the dtype (the stream HF keeps),
    and s."""
    s = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    sd = s.double()
    inv = (sd.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    return (sd * inv * norm.double()) @ w.double().T, s


def check_prologues(m: int, n: int, k: int, dtype: torch.dtype, device: str, tol: float,
                    cfg: GemvConfig | None = None, seed: int = 0) -> None:
    """add_rms_norm_linear (with and without a residual) and silu_and_mul_linear through the
    kernels (the public functions, or `cfg` through _launch) against fp64 and the references;
    the new residual exactly x + residual rounded."""
    t = prologue_inputs(m, n, k, dtype, device, seed)
    eps = 1e-6
    what = f"M={m} N={n} K={k} {dtype} cfg={cfg}"
    for residual in (t["residual"], None):
        if cfg is None:
            y, r = add_rms_norm_linear(t["x"], residual, t["norm"], eps, t["w"])
        else:
            kind = RMS if residual is None else ADD_RMS
            y, r = _launch(t["x"], t["w"], None, None, cfg, kind, residual, t["norm"], eps)
        want, s = exact_norm_linear(t["x"], residual, t["norm"], eps, t["w"])
        assert torch.equal(r, s), f"{what}: the new residual"
        assert rel_err(y, want) < tol, f"{what}: norm+linear rel {rel_err(y, want):.2e} vs fp64"
        y_ref, r_ref = add_rms_norm_linear_ref(t["x"], residual, t["norm"], eps, t["w"])
        assert torch.equal(r_ref, s) and rel_err(y, y_ref) < 2 * tol, f"{what}: vs the ref"
    gu, w = t["gate_up"], t["w"]
    y = (silu_and_mul_linear(gu, w) if cfg is None
         else _launch(gu, w, None, None, cfg, SILU)[0])
    want = silu_and_mul_ref(gu).double() @ w.double().T  # the same rounded operand
    assert rel_err(y, want) < tol, f"{what}: silu+linear rel {rel_err(y, want):.2e} vs fp64"
    assert rel_err(y, silu_and_mul_linear_ref(gu, w)) < 2 * tol, f"{what}: silu vs the ref"


# ---- CPU: the rules, the reference ----------------------------------------------------------

def test_ref_matches_fp64_and_f_linear() -> None:
    x, w, b = make_inputs(3, 40, 96, torch.float32, "cpu", bias=True)
    ref = gemv_ref(x, w, b)
    assert ref.dtype == x.dtype and ref.shape == (3, 40)
    assert rel_err(ref, exact(x, w, b)) < 1e-6
    assert torch.allclose(ref, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    out = torch.full((3, 40), float("nan"))
    assert gemv_ref(x, w, b, out=out) is out and torch.equal(out, ref)


def test_use_gemv_rule() -> None:
    """Every row count a decode batch has up to MAX_M (the GEMV at 1-2 rows, tensor cores
    above), never 0 rows or more than MAX_M (cuBLAS)."""
    for n, k in BENCH_SHAPES.values():
        assert all(use_gemv(m, n, k) for m in (1, 2, 3, 8, 64))
        assert not use_gemv(0, n, k) and not use_gemv(MAX_M + 1, n, k)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16, 64])
@pytest.mark.parametrize("shape", list(BENCH_SHAPES))
@pytest.mark.parametrize("whole_rows", [False, True])
def test_pick_config(m: int, shape: str, whole_rows: bool) -> None:
    """GEMV configs the GPU layout argument holds for (BLOCK_K a multiple of 8 x 32 x warps, at
    most 64 fp32 accumulator registers per thread); tensor-core configs tl.dot takes (blocks
    >= 16); at most one split per BLOCK_K chunk and none for whole rows; enough programs for
    the 132 SMs."""
    n, k = BENCH_SHAPES[shape]
    cfg = _pick_config(m, n, k, whole_rows)
    assert cfg.tensor_cores == (m >= 3)
    assert cfg.block_n & (cfg.block_n - 1) == 0
    assert 1 <= cfg.split_k <= -(-k // cfg.block_k)
    assert cfg.split_k == 1 or not whole_rows
    assert -(-n // cfg.block_n) * cfg.split_k >= 132
    if cfg.tensor_cores:
        assert cfg.block_n >= 16 and cfg.block_k >= 16
    else:
        assert cfg.block_k % (8 * 32 * cfg.num_warps) == 0
        assert triton_next_pow2(m) * cfg.block_n * cfg.block_k // (32 * cfg.num_warps) <= 8 * 64


def test_pick_config_splits_small_n() -> None:
    """Few rows: K is split so there are programs for every SM, each split >= 2 chunks."""
    cfg = _pick_config(1, 40, 9728)
    assert cfg.split_k > 1 and -(-9728 // cfg.block_k) >= 2 * cfg.split_k
    assert _pick_config(1, 6144, 2560).split_k == 1


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
    # the tensor-core kernel: M padded to 16 (3, 5 rows) and 32 (17 rows), a ragged N and K,
    # split K, and the config gemv picks
    tc = GemvConfig(block_n=16, block_k=32, num_warps=4, tensor_cores=True)
    for m in (3, 5, 17):
        x, w, b = make_inputs(m, 40, 96, torch.float32, "cpu", bias=True, seed=m)
        check(x, w, b, 1e-5)
        for cfg in (tc, replace(tc, block_k=64, split_k=2), replace(tc, split_k=3)):
            check(x, w, b, 1e-5, cfg)
    # the fused prologues through both kernels, whole and masked K
    for m, cfg in ((1, GemvConfig(block_n=1, block_k=32, num_warps=1)),
                   (2, GemvConfig(block_n=2, block_k=64, num_warps=1)),
                   (5, tc), (5, replace(tc, block_k=64))):
        check_prologues(m, 40, 96, torch.float32, "cpu", 1e-5, cfg, seed=m)
        check_prologues(m, 24, 64, torch.float32, "cpu", 1e-5, cfg, seed=m)
    # SiLU has no row statistics: split K is fine
    t = prologue_inputs(4, 24, 64, torch.float32, "cpu")
    y = _launch(t["gate_up"], t["w"], None, None, replace(tc, split_k=2), SILU)[0]
    want = silu_and_mul_ref(t["gate_up"]).double() @ t["w"].double().T
    assert rel_err(y, want) < 1e-5


@pytest.mark.slow
def test_interpreter() -> None:
    run_interpreter_check("test_kernels_gemv", "interp_check_gemv")


# ---- GPU -------------------------------------------------------------------------------------

@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16, 33, 64])
@pytest.mark.parametrize("shape", list(BENCH_SHAPES))
def test_gpu_matches_reference(shape: str, m: int, bias: bool) -> None:
    n, k = BENCH_SHAPES[shape]
    x, w, b = make_inputs(m, n, k, torch.bfloat16, "cuda", bias, seed=m)
    got = check(x, w, b, 1e-2)
    # and close to what cuBLAS gives (both bf16 outputs)
    assert rel_err(got, F.linear(x, w, b)) < 1e-2
    # deterministic: the same bits again (split K reduces in a fixed order, no atomics)
    assert torch.equal(gemv(x, w, b), got)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 24])
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
@pytest.mark.parametrize("m", [1, 2, 5, 8, 64])
def test_gpu_prologues(m: int) -> None:
    """The fused norm + linear and SiLU + linear on Qwen3-4B's shapes (qkv and gate_up after a
    norm, down after SiLU; K = hidden or intermediate), bf16, and on Qwen3-0.6B's qkv."""
    for n, k in ((6144, 2560), (19456, 2560), (2560, 9728), (4096, 1024)):
        check_prologues(m, n, k, torch.bfloat16, "cuda", 1e-2, seed=m)


@needs_cuda
@pytest.mark.gpu
def test_gpu_cuda_graph() -> None:
    """gemv captured in a CUDA graph (a split-K shape and a plain one) replays with new x."""
    for n, k in ((40, 9728), BENCH_SHAPES["qkv"]):
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
