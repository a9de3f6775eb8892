"""jit_varying: the per-step arguments it names reach Triton, and a name that is no argument
fails at once (Triton itself would ignore it silently). compile_ahead: launches inside it build
their variants and run nothing; after it, the same launches run without a build (GPU), and
where it cannot build ahead (the interpreter) they run as usual."""

from __future__ import annotations

import pytest
import torch
from helpers import run_interpreter_check

from arle_kernels import decode_attention, extend_attention
from arle_kernels.gemv import GemvConfig, _launch, gemv_ref
from arle_kernels.jit import compile_ahead, jit_varying, watch_compiles


def test_unknown_argument_name_fails() -> None:
    with pytest.raises(TypeError, match="no argument stride_typo"):
        @jit_varying("n", "stride_typo")
        def _kernel(x_ptr, n):  # type: ignore[no-untyped-def]
            pass


@pytest.mark.parametrize("kernel, names", [
    (decode_attention._decode_split_kernel, {"num_splits", "stride_pt", "page_table_ptr"}),
    (decode_attention._merge_kernel, {"num_splits", "stride_lh"}),
    (extend_attention._extend_kernel, {"stride_pt", "seq_lens_ptr"}),
])
def test_kernels_do_not_specialise_per_step_arguments(kernel: object, names: set[str]) -> None:
    """The kernels' step-varying arguments are marked on the JIT function itself (under the
    interpreter too), so one compiled variant serves every step."""
    marked = set(getattr(kernel, "do_not_specialize", []))
    assert names <= {n if isinstance(n, str) else kernel.arg_names[n]  # type: ignore[attr-defined]
                     for n in marked}


def _odd_gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """The FMA GEMV with a tile no other test or start-up uses: a variant not yet built."""
    _launch(x, w, None, out, GemvConfig(block_n=4, block_k=64, num_warps=1, split_k=3))


def interp_check_compile_ahead_is_inert() -> None:
    """Under the interpreter there is nothing to build: launches inside run and compute."""
    x, w = torch.randn(2, 384), torch.randn(20, 384)
    out = torch.full((2, 20), float("nan"))
    with compile_ahead() as on:
        _odd_gemv(x, w, out)
    assert not on
    torch.testing.assert_close(out, gemv_ref(x, w), atol=1e-4, rtol=1e-4)


def test_compile_ahead_under_the_interpreter() -> None:
    run_interpreter_check("test_kernels_jit", "interp_check_compile_ahead_is_inert")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_gpu_compile_ahead_builds_and_runs_nothing() -> None:
    """Inside: the launches (with their split-K reduce) build and write nothing (`out` keeps
    its NaNs); a repeat is built once, and x read from an unaligned view (another variant for
    Triton) is built too. After: the same launches build nothing and compute y."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(2, 384, generator=gen, device="cuda").bfloat16()
    x_odd = torch.randn(2, 385, generator=gen, device="cuda").bfloat16()[:, 1:]
    w = torch.randn(20, 384, generator=gen, device="cuda").bfloat16()
    out = torch.full((2, 20), float("nan"), device="cuda").bfloat16()
    built: list[str] = []
    stop = watch_compiles(built.append)
    if stop is None:
        pytest.skip("this Triton has no jit_cache_hook to watch builds with")
    try:
        with compile_ahead() as on:
            for a in (x, x, x_odd):
                _odd_gemv(a, w, out)
        if not on:
            pytest.skip("this Triton cannot compile asynchronously")
        torch.cuda.synchronize()
        assert out.isnan().all(), "nothing ran inside compile_ahead"
        # two GEMV variants (their split-K reduce too, unless a test before built it)
        assert sum("_gemv_kernel" in b for b in built) == 2, built
        built.clear()
        for a in (x, x_odd):
            _odd_gemv(a, w, out)
            torch.testing.assert_close(out.float(), gemv_ref(a, w).float(), atol=2e-2,
                                       rtol=2e-2)
    finally:
        stop()
    assert not built, f"built again after compile_ahead: {built}"
