"""The fused glue ops (arle_kernels.fused) and the seeded-sampling noise (arle_kernels.noise).

Three kinds of test:
- CPU: the torch refs are the model's semantics, checked against independent longhand versions
  (HF's RMSNorm and rotate_half formulas, the model's rotary table, the CPU sampler's noise).
- Interpreter (CPU, in a subprocess with TRITON_INTERPRET=1): `interp_check_fused()` runs every
  Triton wrapper on tiny fp32/fp16 shapes (and an fp8 cache) against its ref.
- GPU (skipped without CUDA): realistic shapes in bf16 (Qwen3-4B; a Llama-like model without
  q/k norm), bf16 and fp8 caches, padding slots, CUDA-graph capture.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from helpers import capture, run_interpreter_check
from torch import Tensor

from arle_kernels import fused_ref
from arle_kernels.fused import add_rms_norm, qk_norm_rope_store_kv, rms_norm, silu_and_mul
from arle_kernels.fused_ref import (
    add_rms_norm_ref,
    qk_norm_rope_store_kv_ref,
    quantize_fp8_ref,
    rms_norm_ref,
    silu_and_mul_ref,
)
from arle_kernels.noise import exponential_noise
from arle_kernels.noise_ref import exponential_noise_ref

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FP8 = torch.float8_e4m3fn
_MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def ulp(x: Tensor, dtype: torch.dtype) -> Tensor:
    """The spacing of `dtype` numbers at |x| (float32 tensor)."""
    mant = _MANTISSA[dtype]
    _, exp = torch.frexp(x.float().abs())  # |x| = m * 2^exp, m in [0.5, 1)
    floor = torch.finfo(dtype).smallest_normal * 2.0 ** -mant
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exp - 1 - mant).clamp_min(floor)


# NOTE: the norms and silu round twice (normed value, then times the weight / up): an
# intermediate one ulp apart (fp32 sums and approximate exp differ from torch's) becomes up to 2
# ulps of the output when the weight is near 1 and the product falls one binade lower.
TWO_ROUNDINGS = 2.0


def assert_ulp_close(out: Tensor, ref: Tensor, ulps: float = 1.0, atol: Tensor | float = 0.0,
                     what: str = "") -> None:
    """|out - ref| <= ulps * ulp(max(|out|, |ref|)) + atol elementwise, and no NaN. 16-bit
    dtypes: at most 1% of the elements may differ by more than 1 ulp."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape)
    o, r = out.float(), ref.float()
    assert not o.isnan().any(), f"{what}: NaN in the output (an element left unwritten?)"
    one_ulp = ulp(torch.maximum(o.abs(), r.abs()), out.dtype)
    if out.dtype != torch.float32:
        beyond = ((o - r).abs() > one_ulp).float().mean().item()
        assert beyond <= 0.01, f"{what}: {beyond:.2%} of the elements differ by over 1 ulp"
    bad = (o - r).abs() > ulps * one_ulp + atol
    if bad.any():
        i = bad.nonzero()[0].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} elements off, e.g. at "
                             f"{i}: {o[tuple(i)].item()} vs {r[tuple(i)].item()}")
    rel = (o - r).norm() / r.norm().clamp_min(1e-30)
    assert rel < (1e-2 if out.dtype == torch.bfloat16 else 1e-3), f"{what}: rel err {rel}"


def rope_tolerance(ref: Tensor, has_norm: bool) -> Tensor:
    """atol for rotated heads (on top of 1 ulp of each value). Without a norm, the kernel's
    fp32 rounding (FMA) differs from torch's by ~2^-24 of the inputs: visible only where the
    rotation cancels. With a norm, a normed element may round the other way (1 ulp, <= 2^-bits
    of it) before the rotation mixes it into its pair: both elements of a pair flipping, at
    worst angles, move a value by 2^(2-bits) of the head's largest output (|pair| is kept)."""
    amax = ref.float().abs().amax(-1, keepdim=True)
    bits = _MANTISSA[ref.dtype]
    return amax * (2.0 ** (2 - bits) if has_norm else 2.0 ** (-bits - 8))


def poison_next(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> None:
    """Best effort: leave NaN where the next allocation of this size will land (the CUDA caching
    allocator reuses the freed block), so output elements a kernel skips read as NaN."""
    if device == "cuda":
        torch.full(shape, math.nan, dtype=dtype, device=device)


def nan_cache(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> Tensor:
    return torch.full(shape, math.nan, device=device).to(dtype)  # fp8 NaN is 0x7f


def hf_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' LlamaRMSNorm / Qwen3RMSNorm forward, longhand."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def hf_rotary_fp32(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF's `x * cos + rotate_half(x) * sin`, in fp32 with fp32 cos/sin, rounded once (arle's
    convention: HF itself rounds cos/sin to the model dtype)."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    c = torch.cat((cos, cos), dim=-1)[:, None, :]
    s = torch.cat((sin, sin), dim=-1)[:, None, :]
    return (xf * c + rotated * s).to(x.dtype)


def make_qk_case(t: int, h: int, kvh: int, d: int, dtype: torch.dtype, norm: bool,
                 device: str, seed: int, num_pages: int, page_size: int = 16,
                 max_pos: int = 4096, rot: int | None = None,
                 w_dtype: torch.dtype | None = None) -> dict:
    """rot: the rotated dims of each head (None: all d); w_dtype: the norm weights' dtype
    (None: the model's; fp32: a zero-centred norm's 1 + w)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=gen, device=device).mul_(2).to(dtype)
    positions = torch.randint(0, max_pos, (t,), generator=gen, device=device)
    angle = torch.rand(max_pos, (rot or d) // 2, generator=gen, device=device) * 2 * math.pi
    cos_sin = torch.cat([angle.cos(), angle.sin()], dim=-1)
    w = [(torch.rand(d, generator=gen, device=device) + 0.5).to(w_dtype or dtype) if norm
         else None for _ in range(2)]
    slots = torch.randperm(num_pages * page_size, generator=gen, device=device)[:t]
    slots[1::4] = -1  # padding rows: nothing written (T = 1 keeps its slot: a decode row)
    return {"qkv": qkv, "positions": positions, "cos_sin": cos_sin, "q_norm": w[0],
            "k_norm": w[1], "eps": 1e-6, "num_heads": h, "num_kv_heads": kvh,
            "kv_slots": slots}


def fresh_caches(case: dict, cache_dtype: torch.dtype, num_pages: int, page_size: int,
                 device: str) -> dict:
    kvh, d = case["num_kv_heads"], case["qkv"].shape[1] // (case["num_heads"]
                                                             + 2 * case["num_kv_heads"])
    shape = (num_pages, page_size, kvh, d)
    out = {"k_cache": nan_cache(shape, cache_dtype, device),
           "v_cache": nan_cache(shape, cache_dtype, device), "k_scale": None, "v_scale": None}
    if cache_dtype == FP8:
        out["k_scale"] = torch.full(shape[:3], math.nan, device=device)
        out["v_scale"] = torch.full(shape[:3], math.nan, device=device)
    return out


def check_qk_case(case: dict, cache_dtype: torch.dtype, num_pages: int, page_size: int,
                  device: str, fp8_cast: object = None) -> None:
    """Run kernel and ref on fresh NaN-poisoned caches; compare q, the written K/V (and scales),
    and that padding rows' slots stay unwritten. fp8_cast: how to round the ref's fp32
    quotients to e4m3 (the interpreter's own conversion, which is not IEEE); None: compare
    dequantised values within fp8 rounding."""
    dtype, h, kvh = case["qkv"].dtype, case["num_heads"], case["num_kv_heads"]
    d = case["qkv"].shape[1] // (h + 2 * kvh)
    has_norm = case["q_norm"] is not None
    kern = fresh_caches(case, cache_dtype, num_pages, page_size, device)
    ref = fresh_caches(case, cache_dtype, num_pages, page_size, device)
    # the exact k/v the ref stores, before any fp8 quantisation
    exact = fresh_caches(case, dtype, num_pages, page_size, device)
    poison_next((case["qkv"].shape[0], h, d), dtype, device)
    q = qk_norm_rope_store_kv(**case, **kern)
    q_ref = qk_norm_rope_store_kv_ref(**case, **ref)
    qk_norm_rope_store_kv_ref(**case, **exact)
    assert_ulp_close(q, q_ref, atol=rope_tolerance(q_ref, has_norm), what="q")

    slots = case["kv_slots"]
    written = slots[slots >= 0].long()
    unused = torch.ones(num_pages * page_size, dtype=torch.bool, device=device)
    unused[written] = False
    for name in ("k_cache", "v_cache"):
        got = kern[name].view(-1, *kern[name].shape[2:])
        assert got[unused].float().isnan().all(), f"{name}: a slot not in kv_slots was written"
        x = exact[name].view(-1, *exact[name].shape[2:])[written]  # [W, KVH, D] in dtype
        ref_got = ref[name].view(-1, *ref[name].shape[2:])
        is_k = name == "k_cache"
        k_atol = rope_tolerance(x, has_norm) if is_k else torch.zeros_like(x[..., :1].float())
        if cache_dtype != FP8:  # (a wider cache holds the same values exactly)
            assert torch.equal(ref_got[written], x.to(cache_dtype))
            assert_ulp_close(got[written], x.to(cache_dtype), atol=k_atol, what=name)
            continue
        scale_name = "k_scale" if name == "k_cache" else "v_scale"
        scale = kern[scale_name].view(-1, kern[scale_name].shape[-1])
        assert scale[unused].isnan().all(), f"{scale_name}: a slot not in kv_slots was written"
        scale, stored = scale[written], got[written]
        stored_ref, scale_ref = quantize_fp8_ref(x)
        # the ref's own fp8 store
        assert torch.equal(ref_got[written].view(torch.uint8), stored_ref.view(torch.uint8))
        assert torch.equal(ref[scale_name].view(-1, scale.shape[-1])[written], scale_ref)
        if is_k:  # k's amax may move by the rotary tolerance
            torch.testing.assert_close(scale, scale_ref, rtol=2.0 ** (1 - _MANTISSA[dtype]),
                                       atol=0.0)
        else:
            # v is stored as read: the same amax. NOTE: the kernel divides by 448 exactly
            # (div_rn); torch on CUDA multiplies by the reciprocal: 1 ulp apart, seen on the H200.
            torch.testing.assert_close(scale, scale_ref, rtol=2.0 ** -22, atol=0.0)
        xf = x.float()
        if fp8_cast is not None:
            # the kernel's logic with the interpreter's conversion: stored == cast(x / scale)
            quot = (xf / scale[..., None]).clamp(-fused_ref.FP8_MAX, fused_ref.FP8_MAX)
            expect = fp8_cast(quot)  # type: ignore[operator]
            same = stored.view(torch.uint8) == expect.view(torch.uint8)
            assert same.float().mean() > 0.97, f"{name}: {int((~same).sum())} fp8 values off"
            continue
        if not is_k:
            # Nearly the same quotients (scales 1 ulp apart): they round apart only where the
            # ref's quotient sits on a rounding tie, and then by one e4m3 step. Seen on the H200:
            # up to 0.5% of v values (bf16 inputs over amax / 448 hit ties often).
            got_code = stored.view(torch.uint8).int()
            ref_code = stored_ref.view(torch.uint8).int()
            same = got_code == ref_code
            step = ((got_code & 0x7F) - (ref_code & 0x7F)).abs()
            near = ((got_code >> 7) == (ref_code >> 7)) & (step <= 1)
            assert near.all(), f"v fp8: {int((~near).sum())} values more than one step off"
            assert same.float().mean() > 0.99, f"v fp8: {int((~same).sum())} values off"
        deq = stored.float() * scale[..., None]
        # e4m3 keeps 3 mantissa bits: rounding moves a value by <= 2^-4 of it (normals) or
        # 2^-10 * scale (subnormals); k: on top of the kernel's own rotary tolerance
        tol = (2.0 ** -4 * xf.abs() + 2.0 ** -9 * scale[..., None]
               + k_atol * (1 + 2.0 ** -4) + 1e-30)
        err = (deq - xf).abs()
        assert (err <= tol).all(), f"{name}: fp8 error {(err - tol).max()} past rounding"


# ---------------------------------------------------------------------------------------------
# CPU: the refs are the model's semantics
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rms_norm_ref_is_hf_rmsnorm(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    for n in (64, 576, 2560):
        x = (torch.randn(33, n, generator=gen) * 3).to(dtype)
        w = (torch.rand(n, generator=gen) + 0.5).to(dtype)
        assert torch.equal(rms_norm_ref(x, w, 1e-6), hf_rms_norm(x, w, 1e-6))
        # any leading dims (the per-head q/k norms)
        x3 = x.view(33, -1, 64)
        assert torch.equal(rms_norm_ref(x3, w[:64], 1e-5), hf_rms_norm(x3, w[:64], 1e-5))


def test_add_rms_norm_ref_updates_the_residual_in_place() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, 576, generator=gen).bfloat16()
    residual = torch.randn(9, 576, generator=gen).bfloat16()
    w = (torch.rand(576, generator=gen) + 0.5).bfloat16()
    expected_r = x + residual  # HF's `hidden = residual + hidden` in bf16
    y, r = add_rms_norm_ref(x, residual, w, 1e-6)
    assert r is residual and torch.equal(residual, expected_r)
    assert torch.equal(y, hf_rms_norm(expected_r, w, 1e-6))


def test_silu_and_mul_ref_rounds_like_hf() -> None:
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(17, 2 * 1536, generator=gen) * 4).bfloat16()
    out = silu_and_mul_ref(gate_up)
    gate, up = gate_up[:, :1536].double(), gate_up[:, 1536:].double()
    act = (gate * torch.sigmoid(gate)).bfloat16()  # silu rounded to bf16, then the product
    expected = (act.double() * up).bfloat16()
    assert out.shape == (17, 1536) and out.dtype == torch.bfloat16
    # fp32 vs float64 silu differ only next to a rounding tie
    assert_ulp_close(out, expected, TWO_ROUNDINGS, what="silu")
    assert (out == expected).float().mean() > 0.999


@pytest.mark.parametrize("norm", [True, False])
def test_qk_ref_matches_model_rotary_and_writes_the_cache(norm: bool) -> None:
    """The ref against HF's longhand norm + rotate_half rotary at the model's cos/sin (yarn
    scaling: attention factor != 1), read from the model's own rotary table."""
    from arle.model.config import ModelConfig
    from arle.model.decoder import DecoderLM

    cfg = ModelConfig.from_hf({
        "architectures": ["Qwen3ForCausalLM" if norm else "LlamaForCausalLM"],
        "vocab_size": 32, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 128}}, "test")
    model = DecoderLM(cfg)
    assert model.rotary.attention_factor != 1.0
    h, kvh, d, t, page_size, num_pages = 4, 2, 32, 11, 4, 8
    table = model.rotary_table(512)
    case = make_qk_case(t, h, kvh, d, torch.bfloat16, norm, "cpu", seed=4,
                        num_pages=num_pages, page_size=page_size, max_pos=512)
    case["cos_sin"] = table
    caches = fresh_caches(case, torch.bfloat16, num_pages, page_size, "cpu")
    q = qk_norm_rope_store_kv_ref(**case, **caches)

    cos, sin = table[case["positions"]].chunk(2, -1)
    # the table holds what the rotary computes on the fly (NOTE: torch's vectorised and scalar
    # cos/sin may differ in the last bit, depending on how the elements are chunked)
    torch.testing.assert_close(torch.cat(model.rotary.cos_sin(case["positions"]), -1),
                               table[case["positions"]], rtol=2.0 ** -22, atol=2.0 ** -24)
    qkv = case["qkv"]
    q_in = qkv[:, :h * d].view(t, h, d)
    k_in = qkv[:, h * d:(h + kvh) * d].view(t, kvh, d)
    if norm:
        q_in = hf_rms_norm(q_in, case["q_norm"], 1e-6)
        k_in = hf_rms_norm(k_in, case["k_norm"], 1e-6)
    assert torch.equal(q, hf_rotary_fp32(q_in, cos, sin))
    k_expected = hf_rotary_fp32(k_in, cos, sin)
    v_expected = qkv[:, (h + kvh) * d:].view(t, kvh, d)
    k_flat = caches["k_cache"].view(-1, kvh, d)
    v_flat = caches["v_cache"].view(-1, kvh, d)
    for i, slot in enumerate(case["kv_slots"].tolist()):
        if slot >= 0:
            assert torch.equal(k_flat[slot], k_expected[i])
            assert torch.equal(v_flat[slot], v_expected[i])
    written = case["kv_slots"][case["kv_slots"] >= 0]
    unused = torch.ones(num_pages * page_size, dtype=torch.bool)
    unused[written] = False
    assert k_flat[unused].isnan().all() and v_flat[unused].isnan().all()


def hf_qwen3_5() -> object:
    """transformers' qwen3_5 modeling module (the reference for the zero-centred norm and the
    partial rotary), or skip."""
    return pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rms_norm_ref_with_fp32_weight_is_hf_zero_centred_norm(dtype: torch.dtype) -> None:
    """An fp32 weight holding 1 + w gives `Qwen3_5RMSNorm` (weight w, in the model's dtype):
    x * (1 + w) in fp32, rounded once. The two-rounding rule would not match in 16 bits."""
    hf = hf_qwen3_5()
    gen = torch.Generator().manual_seed(11)
    for n in (64, 256, 2560):
        x = (torch.randn(33, n, generator=gen) * 3).to(dtype)
        w = (0.3 * torch.randn(n, generator=gen)).to(dtype)  # as stored: around 0
        norm = hf.Qwen3_5RMSNorm(n, eps=1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(w)
            expected = norm(x)
        ours = rms_norm_ref(x, 1.0 + w.float(), 1e-6)
        assert ours.dtype == dtype
        assert torch.equal(ours, expected), (ours - expected).abs().max()
        res = torch.randn(33, n, generator=gen).to(dtype)
        y, r = add_rms_norm_ref(x, res.clone(), 1.0 + w.float(), 1e-6)
        assert torch.equal(r, x + res) and torch.equal(y, norm(x + res).detach())
        if dtype != torch.float32:  # in 16 bits, the rounding order shows
            assert not torch.equal(rms_norm_ref(x, (1.0 + w.float()).to(dtype), 1e-6), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_ref_partial_rotary_is_qwen3_5s(dtype: torch.dtype) -> None:
    """Qwen3.5's attention prologue: zero-centred q/k norms (fp32 1 + w), then rotary on the
    first quarter of each head (head_dim 256, rotary 64), against transformers' own
    `Qwen3_5RMSNorm` and `apply_rotary_pos_emb` at the same cos/sin."""
    hf = hf_qwen3_5()
    h, kvh, d, rot, t, page_size, num_pages = 4, 2, 256, 64, 9, 4, 4
    case = make_qk_case(t, h, kvh, d, dtype, True, "cpu", seed=12, num_pages=num_pages,
                        page_size=page_size, max_pos=64, rot=rot, w_dtype=torch.float32)
    gen = torch.Generator().manual_seed(13)
    stored = [(0.3 * torch.randn(d, generator=gen)).to(dtype) for _ in range(2)]
    case["q_norm"], case["k_norm"] = (1.0 + w.float() for w in stored)
    caches = fresh_caches(case, dtype, num_pages, page_size, "cpu")
    q = qk_norm_rope_store_kv_ref(**case, **caches)

    norms = []
    for w in stored:
        norm = hf.Qwen3_5RMSNorm(d, eps=1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(w)
        norms.append(norm)
    qkv = case["qkv"]
    with torch.no_grad():
        q_in = norms[0](qkv[:, :h * d].view(t, h, d))
        k_in = norms[1](qkv[:, h * d:(h + kvh) * d].view(t, kvh, d))
    cos, sin = case["cos_sin"][case["positions"]].chunk(2, -1)
    cos2, sin2 = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    # HF's rotary in fp32 (its layout: [T, heads, D] with unsqueeze_dim=1), rounded once
    q_ref, k_ref = hf.apply_rotary_pos_emb(q_in.float(), k_in.float(), cos2, sin2)
    assert torch.equal(q, q_ref.to(dtype))
    assert torch.equal(q[..., rot:], q_in[..., rot:])  # the dims past the rotary pass through
    k_flat = caches["k_cache"].view(-1, kvh, d)
    v_in = qkv[:, (h + kvh) * d:].view(t, kvh, d)
    for i, slot in enumerate(case["kv_slots"].tolist()):
        if slot >= 0:
            assert torch.equal(k_flat[slot], k_ref[i].to(dtype))
            assert torch.equal(caches["v_cache"].view(-1, kvh, d)[slot], v_in[i])


def test_quantize_fp8_ref() -> None:
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 4, 64, generator=gen) * torch.logspace(-3, 3, 6)[:, None, None]).bfloat16()
    x[2, 1] = 0  # an all-zero head
    stored, scale = quantize_fp8_ref(x)
    assert stored.dtype == FP8 and scale.shape == (6, 4) and scale.dtype == torch.float32
    xf = x.float()
    amax = xf.abs().amax(-1)
    assert torch.equal(scale, amax.clamp_min(1e-6) / 448)
    deq = stored.float() * scale[..., None]
    assert (deq - xf).abs().le(2.0 ** -4 * xf.abs() + 2.0 ** -9 * scale[..., None]).all()
    # each head's largest element maps to +-448 exactly
    assert torch.equal(stored.float().abs().amax(-1)[amax > 0], torch.full_like(amax[amax > 0], 448))
    assert (stored[2, 1].float() == 0).all()


def test_exponential_noise_ref_is_the_cpu_samplers_stream() -> None:
    from arle.executor.sampler import _fill_seeded_noise

    seeds = torch.tensor([7, -3, 2**40 + 1])
    offsets = torch.tensor([0, 5, 123456])
    noise = exponential_noise_ref(seeds, offsets, 1000)
    q = torch.ones(3, 1000)
    _fill_seeded_noise(q, tuple((i, int(s), int(o))
                                for i, (s, o) in enumerate(zip(seeds, offsets, strict=True))))
    assert torch.equal(noise, q.clamp(min=torch.finfo(torch.float32).tiny))


def check_noise_properties(fn: object, device: str, vocab: int,
                           low_dtype: torch.dtype = torch.bfloat16) -> None:
    """Row b is a function of (seed[b], offset[b]) only; offsets matter; Exp(1) moments;
    out_dtype=low_dtype is the float32 noise rounded."""
    seeds = torch.tensor([11, 12, 11, 11], device=device)
    offsets = torch.tensor([3, 3, 3, 4], device=device)
    noise = fn(seeds, offsets, vocab)  # type: ignore[operator]
    assert noise.shape == (4, vocab) and noise.dtype == torch.float32
    assert torch.equal(noise[0], noise[2])  # same (seed, offset), another row
    alone = fn(seeds[2:3], offsets[2:3], vocab)  # type: ignore[operator]
    assert torch.equal(alone[0], noise[0])  # ... another batch
    assert (noise[0] != noise[1]).float().mean() > 0.99  # another seed
    assert (noise[0] != noise[3]).float().mean() > 0.99  # another offset
    assert torch.isfinite(noise).all() and (noise > 0).all()
    flat = noise[[0, 1, 3]].flatten().double()
    sigma = 1 / math.sqrt(flat.numel())  # std of the sample mean of Exp(1)
    assert abs(flat.mean().item() - 1) < 6 * sigma
    # the sample variance of Exp(1) has std sqrt((mu4 - 1) / n) = sqrt(8 / n)
    assert abs(flat.var().item() - 1) < 6 * math.sqrt(8) * sigma
    low = fn(seeds, offsets, vocab, out_dtype=low_dtype)  # type: ignore[operator]
    assert low.dtype == low_dtype and torch.equal(low, noise.to(low_dtype))


def test_exponential_noise_ref_properties() -> None:
    check_noise_properties(exponential_noise_ref, "cpu", 20000)


# ---------------------------------------------------------------------------------------------
# Interpreter: every kernel on tiny shapes, in a subprocess with TRITON_INTERPRET=1
# ---------------------------------------------------------------------------------------------

@triton.jit
def _cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, x.to(y_ptr.dtype.element_ty), mask=offs < n)


def interp_fp8_cast(x: Tensor) -> Tensor:
    """fp32 -> e4m3 as the interpreter does it. NOTE: triton's interpreter (3.6-3.9) rounds
    ties up and drops the carry of a mantissa that rounds up (127.9 -> 64, not 128), so under
    it fp8 stores are checked against its own conversion, not torch's."""
    flat = x.contiguous().view(-1)
    out = torch.empty(flat.shape, dtype=FP8)
    _cast_kernel[(triton.cdiv(flat.numel(), 1024),)](flat, out, flat.numel(), BLOCK=1024)
    return out.view(x.shape)


def interp_check_fused() -> None:
    """Every wrapper against its ref on tiny shapes; run under TRITON_INTERPRET=1 on CPU."""
    gen = torch.Generator().manual_seed(6)
    for dtype in (torch.float32, torch.float16):
        ulps = 4.0 if dtype == torch.float32 else TWO_ROUNDINGS  # fp32: sum order, few ulps
        for t, n in ((1, 48), (5, 200), (2, 9000)):  # 9000: the two-pass (looping) path
            x = (torch.randn(t, n, generator=gen) * 2).to(dtype)
            w = (torch.rand(n, generator=gen) + 0.5).to(dtype)
            assert_ulp_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), ulps,
                             what=f"rms_norm {dtype} {n}")
            res = torch.randn(t, n, generator=gen).to(dtype)
            res_ref = res.clone()
            y, r = add_rms_norm(x, res, w, 1e-5)
            y_ref, _ = add_rms_norm_ref(x, res_ref, w, 1e-5)
            assert r is res and torch.equal(res, res_ref), "residual: x + residual in place"
            assert_ulp_close(y, y_ref, ulps, what=f"add_rms_norm {dtype} {n}")
            # an fp32 weight (a zero-centred norm's 1 + w): scaled in fp32, rounded once, so
            # the two differ only where fp32 sums round a value across a tie
            w32 = 1.0 + 0.3 * torch.randn(n, generator=gen)
            res_ref = res.clone()
            y, r = add_rms_norm(x, res, w32, 1e-6)
            assert torch.equal(res, add_rms_norm_ref(x, res_ref, w32, 1e-6)[1])
            for what, got, ref in (("rms_norm", rms_norm(x, w32, 1e-6), rms_norm_ref(x, w32, 1e-6)),
                                   ("add_rms_norm", y, rms_norm_ref(r, w32, 1e-6))):
                assert_ulp_close(got, ref, 4.0 if dtype == torch.float32 else 1.0,
                                 what=f"{what} fp32 weight {dtype} {n}")
                if dtype != torch.float32:  # (fp32: the sums' order moves the last bit)
                    assert (got == ref).float().mean() > 0.99, f"{what} fp32 w {dtype} {n}"
        # a strided view (rows of a wider buffer)
        wide = torch.randn(3, 160, generator=gen).to(dtype)
        w = (torch.rand(96, generator=gen) + 0.5).to(dtype)
        assert_ulp_close(rms_norm(wide[:, :96], w, 1e-6), rms_norm_ref(wide[:, :96], w, 1e-6),
                         ulps, what="rms_norm strided")
        for t, inter in ((1, 40), (3, 1500)):
            gu = (torch.randn(t, 2 * inter, generator=gen) * 4).to(dtype)
            assert_ulp_close(silu_and_mul(gu), silu_and_mul_ref(gu), ulps,
                             what=f"silu_and_mul {dtype}")

    page_size, num_pages = 8, 4
    f32 = torch.float32
    # (dtype, cache dtype, q/k norm, heads, kv heads, head dim, rotary dims, norm weight dtype)
    for i, (dtype, cache_dtype, norm, h, kvh, d, rot, w_dtype) in enumerate((
            (torch.float16, torch.float16, True, 4, 2, 32, None, None),  # Qwen3-like, GQA 2
            (torch.float32, torch.float32, False, 3, 1, 24, None, None),  # Llama-like, odd sizes
            (torch.float16, torch.float32, True, 2, 2, 16, None, None),  # wider cache, GQA 1
            (torch.float16, FP8, True, 4, 2, 32, None, None),  # FP8 KV
            # Qwen3.5-like: partial rotary, zero-centred norms (fp32 weights), head dim 256
            (torch.float16, torch.float16, True, 4, 2, 256, 64, f32),
            (torch.float16, torch.float16, True, 3, 1, 40, 12, f32),  # odd halves and rest
            (torch.float32, torch.float32, False, 2, 2, 32, 8, None),  # partial, no norm
            (torch.float16, FP8, True, 2, 1, 64, 16, f32))):  # partial with FP8 KV
        case = make_qk_case(7, h, kvh, d, dtype, norm, "cpu", seed=10 + i, num_pages=num_pages,
                            page_size=page_size, max_pos=64, rot=rot, w_dtype=w_dtype)
        check_qk_case(case, cache_dtype, num_pages, page_size, "cpu", fp8_cast=interp_fp8_cast)
    # (fp16: the interpreter's own bf16 rounding is not round-to-nearest-even)
    check_noise_properties(exponential_noise, "cpu", 3000, torch.float16)


def test_kernels_under_the_interpreter() -> None:
    run_interpreter_check("test_kernels_fused", "interp_check_fused")


# ---------------------------------------------------------------------------------------------
# GPU: realistic shapes, bf16
# ---------------------------------------------------------------------------------------------

TOKENS = [1, 7, 512, 4096]


@needs_cuda
@pytest.mark.parametrize("n", [2560, 4096, 12288, 16384])  # 12288 / 16384: two-pass path
@pytest.mark.parametrize("t", TOKENS)
def test_gpu_rms_norm_and_add(t: int, n: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(t * 7 + n)
    x = (torch.randn(t, n, device="cuda", generator=gen) * 3).bfloat16()
    w = (torch.rand(n, device="cuda", generator=gen) + 0.5).bfloat16()
    poison_next((t, n), torch.bfloat16, "cuda")
    assert_ulp_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), TWO_ROUNDINGS,
                     what="rms_norm")
    res = torch.randn(t, n, device="cuda", generator=gen).bfloat16()
    res_ref = res.clone()
    poison_next((t, n), torch.bfloat16, "cuda")
    y, r = add_rms_norm(x, res, w, 1e-6)
    y_ref, _ = add_rms_norm_ref(x, res_ref, w, 1e-6)
    assert r is res and torch.equal(res, res_ref)
    assert_ulp_close(y, y_ref, TWO_ROUNDINGS, what="add_rms_norm")


@needs_cuda
@pytest.mark.parametrize("inter", [9728, 1536])
@pytest.mark.parametrize("t", TOKENS)
def test_gpu_silu_and_mul(t: int, inter: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(t + inter)
    gu = (torch.randn(t, 2 * inter, device="cuda", generator=gen) * 4).bfloat16()
    poison_next((t, inter), torch.bfloat16, "cuda")
    assert_ulp_close(silu_and_mul(gu), silu_and_mul_ref(gu), TWO_ROUNDINGS, what="silu_and_mul")


@needs_cuda
@pytest.mark.parametrize("n", [1024, 2560, 4096])  # Qwen3.5 0.8B / 4B / 9B
@pytest.mark.parametrize("t", TOKENS)
def test_gpu_rms_norm_and_add_fp32_weight(t: int, n: int) -> None:
    """Zero-centred norms (fp32 1 + w): one rounding, so nearly every element is the ref's."""
    gen = torch.Generator(device="cuda").manual_seed(t * 5 + n)
    x = (torch.randn(t, n, device="cuda", generator=gen) * 3).bfloat16()
    w = 1.0 + 0.3 * torch.randn(n, device="cuda", generator=gen)
    res = torch.randn(t, n, device="cuda", generator=gen).bfloat16()
    res_ref = res.clone()
    y, r = add_rms_norm(x, res, w, 1e-6)
    y_ref, _ = add_rms_norm_ref(x, res_ref, w, 1e-6)
    assert r is res and torch.equal(res, res_ref)
    for got, ref in ((rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)), (y, y_ref)):
        assert_ulp_close(got, ref, 1.0, what="fp32-weight norm")
        assert (got == ref).float().mean() > 0.99


#: model -> (heads, kv heads, head dim, q/k norm, rotary dims or None, norm weight dtype)
QK_MODELS = {"qwen3-4b": (32, 8, 128, True, None, None), "llama-smol": (9, 3, 64, False, None, None),
             "gqa1": (8, 8, 128, True, None, None),
             "qwen3.5-4b": (16, 4, 256, True, 64, torch.float32),
             "qwen3.5-0.8b": (8, 2, 256, True, 64, torch.float32)}


@needs_cuda
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16kv", "fp8kv"])
@pytest.mark.parametrize("model", list(QK_MODELS))
@pytest.mark.parametrize("t", TOKENS)
def test_gpu_qk_norm_rope_store_kv(t: int, model: str, cache_dtype: torch.dtype) -> None:
    h, kvh, d, norm, rot, w_dtype = QK_MODELS[model]
    num_pages, page_size = 4096 // 16 + 8, 16
    case = make_qk_case(t, h, kvh, d, torch.bfloat16, norm, "cuda", seed=t, num_pages=num_pages,
                        page_size=page_size, rot=rot, w_dtype=w_dtype)
    check_qk_case(case, cache_dtype, num_pages, page_size, "cuda")


@needs_cuda
def test_gpu_qk_accepts_int32_indices_and_strided_cache() -> None:
    """int32 positions/slots, and caches that are slices of a bigger pool (page stride)."""
    h, kvh, d, t, page_size, num_pages = 32, 8, 128, 33, 16, 16
    case = make_qk_case(t, h, kvh, d, torch.bfloat16, True, "cuda", seed=3, num_pages=num_pages)
    pool = torch.full((num_pages, 2, page_size, kvh, d), math.nan, device="cuda").bfloat16()
    k_cache, v_cache = pool[:, 0], pool[:, 1]
    ref = fresh_caches(case, torch.bfloat16, num_pages, page_size, "cuda")
    q_ref = qk_norm_rope_store_kv_ref(**case, **ref)
    case["positions"] = case["positions"].int()
    case["kv_slots"] = case["kv_slots"].int()
    q = qk_norm_rope_store_kv(**case, k_cache=k_cache, v_cache=v_cache)
    assert_ulp_close(q, q_ref, atol=rope_tolerance(q_ref, True), what="q")
    assert torch.equal(k_cache.isnan(), ref["k_cache"].isnan())
    assert torch.equal(v_cache.nan_to_num(), ref["v_cache"].nan_to_num())
    k, k_ref = k_cache.nan_to_num(), ref["k_cache"].nan_to_num()
    assert_ulp_close(k, k_ref, atol=rope_tolerance(k_ref, True), what="k")


@needs_cuda
def test_gpu_exponential_noise() -> None:
    check_noise_properties(exponential_noise, "cuda", 151936)
    seeds = torch.arange(64, device="cuda")
    noise = exponential_noise(seeds, torch.full((64,), 9, device="cuda"), 151936)
    flat = noise.flatten().double()
    assert abs(flat.mean().item() - 1) < 0.002 and abs(flat.var().item() - 1) < 0.01
    # P(E > x) = exp(-x): the tail of the uniform's conversion is right
    assert abs((flat > 5).double().mean().item() - math.exp(-5)) < 0.0005


@needs_cuda
def test_gpu_kernels_replay_in_a_cuda_graph() -> None:
    """Captured once, replayed on new inputs: same results as eager calls."""
    dt, t, hidden, inter, h, kvh, d = torch.bfloat16, 4, 2560, 9728, 32, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, hidden, device="cuda", generator=gen).to(dt)
    res = torch.randn(t, hidden, device="cuda", generator=gen).to(dt)
    w = (torch.rand(hidden, device="cuda", generator=gen) + 0.5).to(dt)
    gu = torch.randn(t, 2 * inter, device="cuda", generator=gen).to(dt)
    case = make_qk_case(t, h, kvh, d, dt, True, "cuda", seed=1, num_pages=4)
    caches = fresh_caches(case, FP8, 4, 16, "cuda")
    for c in caches.values():
        c.zero_()  # no NaN: results are compared with torch.equal
    seeds, offsets = torch.arange(t, device="cuda"), torch.zeros(t, dtype=torch.int64, device="cuda")

    def step() -> list[Tensor]:
        y, r = add_rms_norm(x, res, w, 1e-6)
        return [rms_norm(x, w, 1e-6), y, r.clone(), silu_and_mul(gu),
                qk_norm_rope_store_kv(**case, **caches), caches["k_scale"].clone(),
                exponential_noise(seeds, offsets, 1000)]

    graph, outs = capture(step)
    res_start = res.clone()  # as the eager call left it (the capture runs nothing)
    for buf in (x, gu, case["qkv"]):
        buf.copy_(torch.randn(buf.shape, device="cuda", generator=gen))
    res.copy_(res_start)
    case["positions"].random_(0, 4096, generator=gen)
    offsets.fill_(5)
    graph.replay()
    replayed = [o.clone() for o in outs]
    res.copy_(res_start)
    eager = step()
    for a, b in zip(replayed, eager, strict=True):
        assert torch.equal(a, b)
