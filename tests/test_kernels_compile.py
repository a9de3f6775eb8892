"""The FP8, MoE and GEMV kernels compile for Hopper (sm_90) on the CPU, through Triton's own
compiler down to a cubin, in the variants the engine launches.

The interpreter runs a kernel's Python and never meets the compiler's rules (every return of a
function one type, also in static ifs; tl.dot's operand types): a kernel that passes its
interpreter check can still fail to build on the GPU. No GPU is needed to find out.
"""

from __future__ import annotations

from typing import Any

import pytest
import triton

import arle_kernels.fp8 as fp8
import arle_kernels.gemv as gemv
import arle_kernels.moe as moe

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - an older triton
    GPUTarget = ASTSource = None

HOPPER = GPUTarget("cuda", 90, 32) if GPUTarget is not None else None
#: pointer arguments by name (the kernels share their names); other arguments are i32
POINTERS = {"x_ptr": "*bf16", "a_ptr": "*bf16", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
            "as_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*bf16", "c_ptr": "*bf16",
            "topw_ptr": "*fp32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
            "expert_ptr": "*i32"}

pytestmark = pytest.mark.skipif(
    HOPPER is None or "nvidia" not in triton.backends.backends,
    reason="this triton cannot compile for NVIDIA GPUs")


def compile_for_hopper(kernel: Any, constexprs: dict[str, Any], num_warps: int = 4,
                       aligned: bool = False, **types: str) -> Any:
    """triton.compile of `kernel` for sm_90 with these constexprs (pointer types from POINTERS
    unless given) -> the compiled kernel. aligned: every argument but M (the rows) is taken
    as a multiple of 16, as Triton specialises a launch whose pointers, sizes and strides are
    (without it, no load is wider than an element)."""
    names = list(kernel.arg_names)
    signature = {n: "constexpr" if n in constexprs else types.get(n, POINTERS.get(n, "i32"))
                 for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if aligned and n not in constexprs and n != "M"}
    src = ASTSource(kernel, signature,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    return triton.compile(src, target=HOPPER, options={"num_warps": num_warps})


@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("even_k", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
def test_gemv_kernels(glu: bool, even_k: bool, scaled: bool) -> None:
    w = "*fp8e4nv" if scaled else "*bf16"
    scale = {"SCALED": scaled, "SCALE_N": 128 if scaled else 1, "SCALE_K": 128 if scaled else 1}
    compile_for_hopper(gemv._gemv_kernel, {
        "HAS_BIAS": False, "PARTIAL": False, "EVEN_K": even_k, "M_PAD": 2, "BLOCK_N": 2,
        "BLOCK_K": 2048, "GLU": glu, "PDL": False, "RUN": 16 if scaled else 8, **scale},
        w_ptr=w)
    compile_for_hopper(gemv._gemv_mma_kernel, {
        "HAS_BIAS": False, "PARTIAL": False, "EVEN_K": even_k, "M_PAD": 16, "BLOCK_N": 64,
        "BLOCK_K": 128, "GLU": glu, "PDL": False, "PRECISION": "tf32", "PAIRED": False,
        **scale}, w_ptr=w)


@pytest.mark.parametrize("glu", [False, True])
def test_moe_kernels(glu: bool) -> None:
    route = {"ROW_DIV": 8 if glu else 1, "GLU": glu, "MUL_WEIGHT": not glu, "SLOT_K": 0}
    blocks = {"GROUP_N": 128, "GROUP_K": 128}
    for a8 in (False, True):
        for swap in (False, True):
            compile_for_hopper(moe._moe_mma_kernel, {
                **route, **blocks, "W8": True, "A8": a8, "BLOCK_M": 16, "BLOCK_N": 64,
                "BLOCK_K": 128, "SWAP": swap, "PRECISION": "tf32"},
                a_ptr="*fp8e4nv" if a8 else "*bf16")
    if not glu:  # down's top-k sum left in fp32 split-sum slots
        compile_for_hopper(moe._moe_mma_kernel, {
            **route, **blocks, "SLOT_K": 8, "W8": True, "A8": False, "BLOCK_M": 16,
            "BLOCK_N": 64, "BLOCK_K": 128, "SWAP": True, "PRECISION": "tf32"},
            c_ptr="*fp32", topw_ptr="*bf16")
    # sorted pairs; one token's pairs summed in down's epilogue; one token, a pair a program
    # (down: into split-sum slots); each with PDL as the engine launches it
    for direct, m_pad in ((False, 2), (True, 8), (True, 1)):
        slots = {"SLOT_K": 8} if direct and m_pad == 1 and not glu else {}
        for even_k in (False, True):
            compile_for_hopper(moe._moe_gemv_kernel, {
                **route, **blocks, **slots, "DIRECT": direct,
                "SUM_PAIRS": direct and m_pad > 1 and not glu, "W8": True, "M_PAD": m_pad,
                "BLOCK_N": 4, "BLOCK_K": 512, "RUN": 16, "EVEN_K": even_k, "PDL": True},
                **({"c_ptr": "*fp32", "topw_ptr": "*bf16"} if slots else {}))


def test_moe_routing_kernels() -> None:
    """The routing alone (one token on one warp, 16 a program) and fused with the align."""
    routing = {"TOP_K": 8, "K_PAD": 8, "RENORM": True, "E_PAD": 128}
    for block_t, warps in ((1, 1), (16, 4)):
        compile_for_hopper(moe._route_kernel, {**routing, "BLOCK_T": block_t, "PDL": True},
                           num_warps=warps, logits_ptr="*bf16", weights_ptr="*bf16",
                           ids_ptr="*i32")
    compile_for_hopper(moe._route_align_kernel, {
        **routing, "BLOCK_T": 16, "BLOCK_M": 16, "CHUNK": 128, "BLOCKS_CHUNK": 32, "PDL": True},
        num_warps=8, logits_ptr="*bf16", weights_ptr="*bf16", ids_ptr="*i32")


@pytest.mark.parametrize("a8", [False, True])
def test_fp8_gemm_kernel(a8: bool) -> None:
    compile_for_hopper(fp8._fp8_gemm_kernel, {
        "A8": a8, "HAS_BIAS": True, "GROUP_N": 128, "GROUP_K": 128, "BLOCK_M": 64,
        "BLOCK_N": 128, "BLOCK_K": 128, "PRECISION": "tf32"},
        a_ptr="*fp8e4nv" if a8 else "*bf16")
