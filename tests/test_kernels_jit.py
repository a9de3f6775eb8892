"""jit_varying: the per-step arguments it names reach Triton, and a name that is no argument
fails at once (Triton itself would ignore it silently). compile_ahead: launches inside it build
their variants and run nothing; after it, the same launches run without a build (GPU), and
where it cannot build ahead (the interpreter) they run as usual."""

from __future__ import annotations

import importlib
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import triton
import triton.language as tl
from helpers import run_interpreter_check

import arle_kernels
import arle_kernels.jit as jit
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


@triton.jit
def _scale_kernel(x_ptr, n, scale, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * scale, mask=offs < n)


def test_a_build_reaches_a_worker_as_plain_data(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """compile_ahead's worker path, without a GPU: from a closure shaped like Triton's async
    build (free variables src, target, options, env_vars) come inputs that pickle, and from
    them `_compile_elsewhere` compiles that variant (for an H100's sm_90) into Triton's disk
    cache and makes its launcher; once there, or for a kernel that is no module global,
    nothing is sent. (On the GPU,
    test_gpu_compile_ahead_builds_and_runs_nothing checks Triton's real closure.)"""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def triton_like(src: Any, target: Any, options: Any, env_vars: Any) -> Any:
        def async_compile() -> Any:
            return src, target, options, env_vars
        return async_compile

    class Options:
        def __init__(self) -> None:
            self.num_warps = 1

    sig = {"x_ptr": "*fp32", "n": "i32", "scale": "fp32", "BLOCK": "constexpr"}
    src = ASTSource(_scale_kernel, sig, {(3,): 128}, {})
    inputs = jit._compile_inputs(triton_like(src, GPUTarget("cuda", 90, 32), Options(), None))
    assert inputs is not None and inputs[:2] == (__name__, "_scale_kernel")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    launchers: list[Any] = []
    monkeypatch.setattr(jit, "_make_launcher", launchers.append)  # no GPU driver here
    jit._compile_elsewhere(*pickle.loads(pickle.dumps(inputs)))
    assert [k.metadata.name for k in launchers] == ["_scale_kernel"]
    assert any(tmp_path.rglob("_scale_kernel.cubin")), "not in the cache"
    # now in the disk cache (a warm start): nothing to send
    assert jit._compile_inputs(triton_like(src, GPUTarget("cuda", 90, 32), Options(), None)) \
        is None

    @triton.jit
    def local_kernel(x_ptr):  # type: ignore[no-untyped-def]
        pass

    local = ASTSource(local_kernel, {"x_ptr": "*fp32"}, {}, {})
    assert jit._compile_inputs(triton_like(local, None, Options(), None)) is None
    assert jit._compile_inputs(lambda: None) is None


@triton.jit
def _fma_kernel(x_ptr, y_ptr, z_ptr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    offs = tl.arange(0, BLOCK)
    x, y = tl.load(x_ptr + offs), tl.load(y_ptr + offs)
    tl.store(z_ptr + offs, x * y + y)


def test_kernels_compile_with_fma_contraction(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing arle_kernels pins Triton's FP fusion on, where the user set nothing: with the
    default Triton announces for 3.10 (off, simulated here), a * b + c compiles (for sm_90, no
    GPU needed) to a mul and an add; after the import, to one fma."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    language = getattr(getattr(triton, "knobs", None), "language", None)
    knob = type(language).__dict__.get("default_fp_fusion")  # the descriptor, not its value
    if knob is None or not hasattr(knob, "default"):
        pytest.skip("this Triton has no default_fp_fusion knob")
    monkeypatch.setattr(knob, "default", False)  # Triton 3.10's announced default
    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    src = ASTSource(_fma_kernel, {"x_ptr": "*fp32", "y_ptr": "*fp32", "z_ptr": "*fp32",
                                  "BLOCK": "constexpr"}, {(3,): 128}, {})

    def ptx() -> str:
        return str(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"])

    with warnings.catch_warnings():  # Triton's warning that the default is about to change
        warnings.simplefilter("ignore")
        assert "fma.rn.f32" not in ptx(), "the simulated default did not take"
    importlib.reload(arle_kernels)
    assert "fma.rn.f32" in ptx()
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")  # the user's choice stands
    importlib.reload(arle_kernels)
    assert "fma.rn.f32" not in ptx()


def _odd_gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """The FMA GEMV with a tile no other test or start-up uses: a variant not yet built."""
    _launch(x, w, None, out, GemvConfig(block_n=4, block_k=64, num_warps=1, split_k=3))


def interp_check_compile_ahead_is_inert() -> None:
    """Under the interpreter there is nothing to build: launches inside run and compute."""
    x, w = torch.randn(2, 384), torch.randn(20, 384)
    out = torch.full((2, 20), float("nan"))
    with compile_ahead() as builds:
        _odd_gemv(x, w, out)
    assert not builds.on
    torch.testing.assert_close(out, gemv_ref(x, w), atol=1e-4, rtol=1e-4)


def test_start_cache_key_readies_tritons_key_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """start_cache_key computes Triton's own cache key on a thread, once per process: the
    builds after it find the key in triton_key's cache."""
    from triton.runtime.cache import triton_key

    monkeypatch.setattr(jit, "_INTERPRET", False)
    monkeypatch.setattr(jit, "_cache_key", None)
    triton_key.cache_clear()
    jit.start_cache_key()
    thread = jit._cache_key
    assert thread is not None and thread.name == "arle-triton-key"
    thread.join()
    assert triton_key.cache_info().currsize == 1
    jit.start_cache_key()  # a second call starts nothing
    assert jit._cache_key is thread
    monkeypatch.setattr(jit, "_cache_key", None)
    monkeypatch.setattr(jit, "_INTERPRET", True)
    jit.start_cache_key()  # the interpreter builds nothing
    assert jit._cache_key is None


def test_compile_ahead_under_the_interpreter() -> None:
    run_interpreter_check("test_kernels_jit", "interp_check_compile_ahead_is_inert")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("processes", [True, False])
def test_gpu_compile_ahead_builds_and_runs_nothing(processes: bool, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """From an empty Triton cache, as a new process (the kernels' variants in memory dropped).
    Inside: the launches (with their split-K reduce) build and write nothing (`out` keeps its
    NaNs); a repeat is built once, and x read from an unaligned view (another variant for
    Triton) is built too; with processes, by worker processes. After: the same launches build
    nothing and compute y. Then a warm start (the variants in memory dropped again) loads them
    from the disk cache and sends no worker anything."""
    from arle_kernels import gemv

    def new_process() -> None:
        for kernel in (gemv._gemv_kernel, gemv._split_reduce_kernel):
            kernel.device_caches.clear()  # type: ignore[attr-defined]

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    new_process()
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
        with compile_ahead(processes=processes) as builds:
            for a in (x, x, x_odd):
                _odd_gemv(a, w, out)
        if not builds.on:
            pytest.skip("this Triton cannot compile asynchronously")
        torch.cuda.synchronize()
        assert out.isnan().all(), "nothing ran inside compile_ahead"
        # two GEMV variants, and their split-K reduce
        assert sum("_gemv_kernel" in b for b in built) == 2, built
        assert any("_split_reduce_kernel" in b for b in built), built
        assert builds.variants == len(built), (builds, built)
        assert builds.in_processes == (builds.variants if processes else 0), builds
        built.clear()
        for a in (x, x_odd):
            _odd_gemv(a, w, out)
            torch.testing.assert_close(out.float(), gemv_ref(a, w).float(), atol=2e-2,
                                       rtol=2e-2)
        assert not built, f"built again after compile_ahead: {built}"
        new_process()
        with compile_ahead(processes=processes) as warm:
            for a in (x, x_odd):
                _odd_gemv(a, w, out)
        assert warm.variants == builds.variants and warm.in_processes == 0, (warm, builds)
    finally:
        stop()
