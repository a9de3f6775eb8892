"""A GEMV's output left as split sums (kernels/split_sums.py) and the kernels that take them.

- CPU: the reference consumer `take` (slot order, rounding, zeros left), the buffers' reuse
  and recovery, and the reference ops with SplitSums against the same ops on the summed y.
- Interpreter (CI): `_launch(..., sums=True)` on both tensor-core kernels, then `add_rms_norm`
  and `qk_norm_rope_store_kv` taking the sums: the same bits as those kernels on y summed by
  `take`, and the slots zero after (padding rows of the rope kernel included).
- GPU: the same on Qwen3-4B's shapes in bf16 (o_proj / down: four K splits, two slots; qkv:
  two splits, one slot), determinism over runs, and a CUDA graph replaying the chain.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import capture, run_interpreter_check
from test_kernels_fused import fresh_caches, make_qk_case
from torch import Tensor

from arle_kernels import split_sums
from arle_kernels.fused import add_rms_norm, qk_norm_rope_store_kv
from arle_kernels.fused_ref import add_rms_norm_ref, qk_norm_rope_store_kv_ref
from arle_kernels.gemv import GemvConfig, _launch, gemv_ref, gemv_split_sums
from arle_kernels.split_sums import MAX_ROWS, SplitSums, slot_buffer, take

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_sums(slots: int, m: int, n: int, dtype: torch.dtype, device: str,
              seed: int = 0) -> SplitSums:
    """Slots of a kept buffer filled with random partial sums, as a producer leaves them."""
    gen = torch.Generator(device=device).manual_seed(seed)
    buf = slot_buffer(torch.device(device), slots, m, n)
    buf.copy_(torch.randn(slots, m, n, generator=gen, device=device))
    return SplitSums(buf, dtype)


def summed(sums: SplitSums) -> Tensor:
    """y of sums without taking them (slot order, rounded): what a consumer must see."""
    total = sums.slots[0].clone()
    for s in range(1, sums.slots.shape[0]):
        total += sums.slots[s]
    return total.to(sums.dtype)


# ---- CPU: the reference consumer and the buffers -----------------------------------------------

def test_take_sums_in_slot_order_rounds_and_leaves_zeros() -> None:
    sums = make_sums(3, 4, 40, torch.bfloat16, "cpu")
    s0, s1, s2 = (sums.slots[i].clone() for i in range(3))
    y = take(sums)
    assert y.dtype == torch.bfloat16 and y.shape == (4, 40) == sums.shape
    assert torch.equal(y, ((s0 + s1) + s2).to(torch.bfloat16))
    assert not sums.slots.any(), "take leaves the slots zero"
    plain = torch.randn(2, 3)
    assert take(plain) is plain


def test_slot_buffer_is_kept_and_a_pending_one_is_cleared() -> None:
    dev = torch.device("cpu")
    first = slot_buffer(dev, 2, 4, 24)
    first.fill_(1.0)  # a producer's sums ...
    take(SplitSums(first, torch.float32))  # ... taken: zeros, not pending
    again = slot_buffer(dev, 2, 8, 24)
    assert again.data_ptr() == first.data_ptr() and again.shape == (2, 8, 24)
    again.fill_(5.0)  # pending, and never taken (a step that failed before its consumer)
    third = slot_buffer(dev, 2, 8, 24)
    assert not third.any(), "a buffer left pending is zeroed before its next producer"
    take(SplitSums(third, torch.float32))
    with pytest.raises(AssertionError, match=f"up to {MAX_ROWS} rows"):
        slot_buffer(dev, 2, MAX_ROWS + 1, 24)


def test_reference_ops_take_split_sums() -> None:
    gen = torch.Generator().manual_seed(1)
    sums = make_sums(2, 3, 64, torch.bfloat16, "cpu", seed=2)
    y = summed(sums)
    w = (torch.rand(64, generator=gen) + 0.5).to(torch.bfloat16)
    res = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    res_plain = res.clone()
    out, r = add_rms_norm_ref(sums, res, w, 1e-6)
    out_plain, _ = add_rms_norm_ref(y, res_plain, w, 1e-6)
    assert torch.equal(out, out_plain) and torch.equal(r, res_plain)
    assert not sums.slots.any()

    case = make_qk_case(5, 4, 2, 16, torch.bfloat16, True, "cpu", seed=3, num_pages=4,
                        page_size=4, max_pos=32)
    qkv = case.pop("qkv")
    sums = make_sums(1, 5, qkv.shape[1], torch.bfloat16, "cpu", seed=4)
    caches, caches_plain = (fresh_caches({**case, "qkv": qkv}, torch.bfloat16, 4, 4, "cpu")
                            for _ in range(2))
    q_plain = qk_norm_rope_store_kv_ref(summed(sums), **case, **caches_plain)
    q = qk_norm_rope_store_kv_ref(sums, **case, **caches)
    assert torch.equal(q, q_plain)
    assert torch.equal(caches["k_cache"].nan_to_num(), caches_plain["k_cache"].nan_to_num())
    assert not sums.slots.any()


# ---- the kernels: one check, on CPU under the interpreter and on the GPU --------------------------

def check_chain(m: int, n: int, k: int, dtype: torch.dtype, device: str, cfg: GemvConfig | None,
                slots: int, tol: float) -> None:
    """x @ W^T as SplitSums (cfg through _launch, or gemv's pick), then add_rms_norm taking it:
    `slots` slots, y close to the fp32 product, the norm's output and residual the same bits
    as add_rms_norm on y summed by take, and the slots zero after."""
    gen = torch.Generator(device=device).manual_seed(m * 7 + n)
    x = torch.randn(m, k, generator=gen, device=device).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) * k ** -0.5).to(dtype)
    got = gemv_split_sums(x, w) if cfg is None else _launch(x, w, None, None, cfg, sums=True)
    assert isinstance(got, SplitSums), f"{cfg}: expected split sums"
    assert got.slots.shape == (slots, m, n) and got.dtype == dtype
    y = summed(got)
    ref = gemv_ref(x, w)
    err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < tol, f"M={m} N={n} K={k} {cfg}: rel {err:.2e}"
    again = gemv_split_sums(x, w) if cfg is None else _launch(x, w, None, None, cfg, sums=True)
    assert isinstance(again, SplitSums) and again.slots.data_ptr() == got.slots.data_ptr()
    # NOTE: the same buffer, now holding two products' sums: still pending, so the producer
    # zeroed it first (the recovery path) and the sums are this run's: the same bits
    assert torch.equal(summed(again), y), "pairs of splits added in either order: same bits"

    w_norm = (torch.rand(n, generator=gen, device=device) + 0.5).to(dtype)
    res = torch.randn(m, n, generator=gen, device=device).to(dtype)
    res_plain = res.clone()
    out, r = add_rms_norm(again, res, w_norm, 1e-6)
    out_plain, r_plain = add_rms_norm(y, res_plain, w_norm, 1e-6)
    assert torch.equal(out, out_plain) and torch.equal(r, r_plain)
    assert not again.slots.any(), "add_rms_norm leaves the slots zero"


def check_rope_chain(t: int, h: int, kvh: int, d: int, dtype: torch.dtype, slots: int,
                     device: str) -> None:
    """qk_norm_rope_store_kv taking SplitSums of qkv: q and the caches the same bits as the
    kernel on y summed by take; every slot zero after, padding rows (slot -1) included."""
    page_size, num_pages = 4, 8
    case = make_qk_case(t, h, kvh, d, dtype, True, device, seed=t + slots, num_pages=num_pages,
                        page_size=page_size, max_pos=64)
    qkv = case.pop("qkv")
    sums = make_sums(slots, t, qkv.shape[1], dtype, device, seed=t)
    caches, caches_plain = (fresh_caches({**case, "qkv": qkv}, dtype, num_pages, page_size,
                                         device) for _ in range(2))
    q_plain = qk_norm_rope_store_kv(summed(sums), **case, **caches_plain)
    q = qk_norm_rope_store_kv(sums, **case, **caches)
    assert torch.equal(q, q_plain)
    for name in ("k_cache", "v_cache"):  # NaN where nothing was written, in both
        assert torch.equal(caches[name].nan_to_num(7.0), caches_plain[name].nan_to_num(7.0))
    assert not sums.slots.any(), "the rope kernel leaves the slots zero"


def interp_check_split_sums() -> None:
    """Under TRITON_INTERPRET=1 on CPU, tiny shapes (fp16: the interpreter's bf16 dot is
    broken): the cp.async and TMA kernels with 2-5 K splits (odd counts: the last split alone
    in its slot), and both consumers."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for tma in (False, True):
        for m, k, split, slots in ((3, 256, 2, 1), (8, 256, 4, 2), (16, 256, 4, 2),
                                   (5, 288, 3, 2), (8, 320, 5, 3)):
            cfg = GemvConfig(block_n=64 if tma else 16, block_k=32, num_warps=4 if tma else 1,
                             num_stages=2, split_k=split, mma=True, tma=tma)
            check_chain(m, 40, k, torch.float16, "cpu", cfg, slots, 1e-3)
    # with a bias there are no split sums: y, reduced by the reduce kernel
    cfg = GemvConfig(block_n=16, block_k=32, num_warps=1, split_k=3, mma=True)
    x, w, b = torch.randn(3, 96).half(), torch.randn(40, 96).half(), torch.randn(40).half()
    y = _launch(x, w, b, None, cfg, sums=True)
    assert isinstance(y, Tensor) and torch.allclose(y.float(), gemv_ref(x, w, b).float(),
                                                    atol=5e-2, rtol=1e-2)
    for t, slots in ((1, 1), (5, 2)):
        check_rope_chain(t, 4, 2, 32, torch.float16, slots, "cpu")


def test_kernels_under_the_interpreter() -> None:
    run_interpreter_check("test_split_sums", "interp_check_split_sums")


#: Qwen3-4B: (N, K) and the slots gemv's pick leaves at 3..16 rows on the H200
SHAPES = {"qkv": (6144, 2560, 1), "o_proj": (2560, 4096, 2), "down": (2560, 9728, 2)}


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [3, 8, 16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gpu_split_sums(shape: str, m: int) -> None:
    from arle_kernels.gemv import tma_available

    if not tma_available():
        pytest.skip("the slot counts are the TMA configs'")
    n, k, slots = SHAPES[shape]
    check_chain(m, n, k, torch.bfloat16, "cuda", None, slots, 1e-2)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 16])
def test_gpu_rope_takes_split_sums(t: int) -> None:
    check_rope_chain(t, 32, 8, 128, torch.bfloat16, 1, "cuda")


@needs_cuda
@pytest.mark.gpu
def test_gpu_split_sums_in_a_cuda_graph() -> None:
    """o_proj -> add_rms_norm captured once and replayed on new inputs: every replay matches
    the eager chain (the slots are zero again at each replay's start)."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    n, k, _ = SHAPES["o_proj"]
    x = torch.randn(8, k, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=gen, device="cuda") * k ** -0.5).bfloat16()
    w_norm = (torch.rand(n, generator=gen, device="cuda") + 0.5).bfloat16()
    res = torch.zeros(8, n, device="cuda").bfloat16()

    def chain() -> Tensor:
        return add_rms_norm(gemv_split_sums(x, w), res, w_norm, 1e-6)[0]

    graph, out = capture(chain)  # eager first: the slot buffer is made outside the capture
    for i in range(3):
        x.copy_(torch.randn(8, k, generator=gen, device="cuda"))
        start = torch.randn(8, n, generator=gen, device="cuda").bfloat16()
        res.copy_(start)
        graph.replay()
        res_eager = start.clone()
        want = add_rms_norm(gemv_ref(x, w).float().to(torch.bfloat16), res_eager, w_norm,
                            1e-6)[0]
        err = ((out.float() - want.float()).norm() / want.float().norm()).item()
        assert err < 1e-2, f"replay {i}: rel {err:.2e}"
    torch.cuda.synchronize()
    assert not any(buf.any() for buf in split_sums._BUFFERS.values()), "slots left non-zero"
