"""Paged split-KV decode attention (arle_kernels.decode_attention): the Triton kernel against its
torch reference, and the reference against a dense attention written out longhand.

GPU tests (skipped without CUDA) use realistic shapes; the interpreter check runs the same kernel
on tiny CPU tensors under TRITON_INTERPRET=1, in a subprocess (the variable must be set before
triton is first imported). Caches are poisoned: every slot no row owns (unused pages, the tail of
each row's last page, the page the tables are padded with) holds NaN, so a read past a mask
shows; outputs are filled with NaN before the run, so an unwritten element shows.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest
import torch
from helpers import capture, run_interpreter_check
from test_attention_ref import dense_causal

import arle_kernels.decode_attention_ref as decode_attention_module
from arle_kernels.decode_attention import decode_attention, pick_num_splits
from arle_kernels.decode_attention_ref import decode_attention_ref

PAGE = 16
FP8 = torch.float8_e4m3fn
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@dataclass
class Case:
    q: torch.Tensor  # [B, H, D]
    k_cache: torch.Tensor  # [P, PAGE, KVH, D], kv dtype (fp8 if quantised)
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None  # [P, PAGE, KVH] fp32, fp8 only
    v_scale: torch.Tensor | None
    k_plain: torch.Tensor  # the cache before quantisation (== k_cache unless fp8)
    v_plain: torch.Tensor
    page_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32
    scale: float

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k_cache, self.v_cache, self.page_table, self.seq_lens

    def scales(self) -> dict[str, torch.Tensor | None]:
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache's FP8 format: one scale per (token, KV head) = max(amax over D, 1e-6) / 448."""
    scale = x.float().abs().amax(-1).clamp_min(1e-6) / 448.0
    return (x.float() / scale[..., None]).to(FP8), scale


def make_case(seed: int, seq_lens: list[int], heads: int, kv_heads: int, d: int,
              dtype: torch.dtype, fp8: bool, device: str, poison: bool = True,
              num_pages: int | None = None, max_pages: int | None = None,
              q_std: float = 1.5, page: int = PAGE) -> Case:
    """Rows' pages (of `page` tokens) drawn from a random permutation of the pool (never the
    identity); tables padded with an unused page. `dtype` is q's and the unquantised cache's."""
    gen = torch.Generator(device=device).manual_seed(seed)
    need = [-(-n // page) for n in seq_lens]
    total = num_pages if num_pages is not None else sum(need) + 3
    width = max_pages if max_pages is not None else max([*need, 1]) + 2
    assert sum(need) < total and max(need, default=0) <= width
    perm = torch.randperm(total, generator=gen, device=device)
    if torch.equal(perm, torch.arange(total, device=device)):
        perm = perm.roll(1)
    pad_page = int(perm[-1])  # owned by no row
    table = torch.full((len(seq_lens), width), pad_page, dtype=torch.int32, device=device)
    used = torch.zeros(total * page, dtype=torch.bool, device=device)
    start = 0
    for row, (length, n) in enumerate(zip(seq_lens, need, strict=True)):
        table[row, :n] = perm[start:start + n]
        start += n
        pos = torch.arange(length, device=device)
        used[table[row, pos // page].long() * page + pos % page] = True
    k = torch.randn(total, page, kv_heads, d, generator=gen, device=device).to(dtype)
    v = torch.randn(total, page, kv_heads, d, generator=gen, device=device).to(dtype)
    if poison:
        k.view(-1, kv_heads, d)[~used] = float("nan")
        v.view(-1, kv_heads, d)[~used] = float("nan")
    q = (torch.randn(len(seq_lens), heads, d, generator=gen, device=device) * q_std).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    if not fp8:
        return Case(q, k, v, None, None, k, v, table, lens, d ** -0.5)
    k8, ks = quantize_fp8(k)
    v8, vs = quantize_fp8(v)
    return Case(q, k8, v8, ks, vs, k, v, table, lens, d ** -0.5)


def row_errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """Worst per-row ||out - ref|| / ||ref|| and the max abs diff; NaN anywhere fails."""
    assert torch.isfinite(out).all(), "NaN/inf in the output (unwritten or read a poisoned slot)"
    diff = (out.double() - ref.double()).flatten(1)
    rel = diff.norm(dim=1) / ref.double().flatten(1).norm(dim=1).clamp_min(1e-12)
    return float(rel.max()), float(diff.abs().max())


def check_kernel(case: Case, num_splits: int, tol: float, loose_tol: float | None = None,
                 out: torch.Tensor | None = None,
                 config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Run the kernel (with `config`, or its own) into a NaN-poisoned output, compare to the
    reference on the same cache, and (fp8) to the reference on the unquantised cache with
    `loose_tol`."""
    if out is None:
        out = torch.empty_like(case.q)
    out.fill_(float("nan"))
    got = decode_attention(*case.args(), case.scale, num_splits, **case.scales(), out=out,
                           config=config)
    assert got.data_ptr() == out.data_ptr() and got.dtype == case.q.dtype
    ref = decode_attention_ref(*case.args(), case.scale, num_splits, **case.scales())
    rel, max_abs = row_errors(got, ref)
    what = f"splits={num_splits} lens={case.seq_lens.tolist()[:8]}"
    assert rel < tol, f"{what}: rel {rel:.2e} (max abs {max_abs:.2e}) vs reference"
    if loose_tol is not None:
        plain = decode_attention_ref(case.q, case.k_plain, case.v_plain, case.page_table,
                                     case.seq_lens, case.scale, 1)
        rel, max_abs = row_errors(got, plain)
        assert rel < loose_tol, f"{what}: rel {rel:.2e} (max abs {max_abs:.2e}) vs unquantised"
    return got


# ---- CPU: the reference itself ---------------------------------------------------------------

@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1), (28, 4)])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("row_chunks", [False, True])
def test_reference_matches_dense(heads: int, kv_heads: int, fp8: bool, row_chunks: bool,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """decode_attention_ref == the longhand attention of each row's last token over its
    gathered tokens, in float64, on the dequantised cache for fp8; also a row at a time (the
    chunks long rows take)."""
    if row_chunks:
        monkeypatch.setattr(decode_attention_module, "REF_CHUNK_ELEMENTS", 1)
    lens = [1, 15, 16, 17, 40, 100]
    case = make_case(heads + kv_heads, lens, heads, kv_heads, 32, torch.float64, fp8, "cpu",
                     poison=False)
    k_deq, v_deq = case.k_cache.double(), case.v_cache.double()
    if fp8:
        assert case.k_scale is not None and case.v_scale is not None
        k_deq, v_deq = k_deq * case.k_scale[..., None], v_deq * case.v_scale[..., None]
        # the quantisation really is lossy, and the dequantised values are near the originals
        assert 0 < (k_deq - case.k_plain).abs().max() < 0.1 * case.k_plain.abs().max()
    got = decode_attention_ref(*case.args(), case.scale, 4, **case.scales())
    assert got.dtype == torch.float64
    for row, length in enumerate(lens):
        pos = torch.arange(length)
        pages, offs = case.page_table[row, pos // PAGE].long(), pos % PAGE
        want = dense_causal(case.q[row:row + 1], k_deq[pages, offs], v_deq[pages, offs],
                            case.scale)
        torch.testing.assert_close(got[row:row + 1], want, atol=1e-10, rtol=1e-10)


def test_reference_zero_length_row_and_out() -> None:
    """A seq_len-0 row (a graph batch's padding row) gives zeros; `out` is written and returned."""
    case = make_case(3, [0, 17], 4, 2, 16, torch.float32, False, "cpu")
    out = torch.full_like(case.q, float("nan"))
    got = decode_attention_ref(*case.args(), case.scale, 1, out=out)
    assert got is out
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isfinite(out[1]).all()


def test_pick_num_splits() -> None:
    for batch in (1, 2, 3, 8, 17, 64, 256):
        for length in (1, 100, 4096, 32768):
            s = pick_num_splits(batch, 8, length)
            assert 1 <= s <= 32 and s & (s - 1) == 0
            assert s == 1 or length // s >= 64  # splits keep >= 64 tokens
    assert pick_num_splits(1, 8, 32768) == 32  # batch 1, long context: fill the SMs
    assert pick_num_splits(1, 8, 100) == 1  # too short to split
    assert pick_num_splits(64, 8, 32768) == 1  # 512 programs already fill 132 SMs
    assert pick_num_splits(8, 8, 4096) == 8  # 8 x 8 x 8 = 512 programs: ~2 waves of 264
    assert pick_num_splits(1, 8, 4096, num_sms=16) == 4


# ---- interpreter (CI, CPU) -------------------------------------------------------------------

def interp_check_decode_attention() -> None:
    """Tiny shapes through the Triton kernel on CPU; needs TRITON_INTERPRET=1 set before triton
    is imported. fp16/fp32 dot operands (bf16 dots are wrong in the interpreter)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    # 0 is a padding row (zeros); 200 spans several 64-token blocks, so splits really merge
    lens = [1, 17, 40, 0, 200]
    case = make_case(1, lens, 4, 2, 16, torch.float16, False, "cpu")
    for splits in (1, 2, 4):
        out = check_kernel(case, splits, 1e-3)
        assert torch.equal(out[3], torch.zeros_like(out[3]))
    # one row (the merge loads every split's o with its lse): all splits live, and one live
    # split beside empty ones (their o is zeros, their weight 0)
    for row_lens, splits in (([200], 4), ([40], 4), ([0], 2)):
        check_kernel(make_case(5, row_lens, 4, 2, 16, torch.float16, False, "cpu"), splits, 1e-3)
    # other block sizes, as scripts/bench_kernels.py decode tries them (16 = one page a step)
    for config in ((16, 2, 1), (128, 4, 2)):
        check_kernel(case, 2, 1e-3, config=config)
    # pages longer than a block: a block's tokens share one page, at offsets that depend on
    # where the block starts (the kernel's other branch for page numbers and slots)
    case = make_case(3, [1, 17, 40, 0, 200], 4, 2, 16, torch.float16, False, "cpu", page=64)
    for splits in (1, 3):
        check_kernel(case, splits, 1e-3, config=(32, 2, 1))
    # fp32, GQA group 3 (padded to 16 rows), a non-power-of-two split count
    case = make_case(2, [130, 1, 33], 6, 2, 32, torch.float32, False, "cpu")
    check_kernel(case, 3, 1e-4)
    # strided q and out (views into wider buffers); the rest of `out`'s buffer is untouched
    wide_q = torch.randn(3, 6, 64)
    wide_q[:, :, :32] = case.q
    case.q = wide_q[:, :, :32]
    wide_out = torch.full((3, 6, 64), 7.0)
    check_kernel(case, 2, 1e-4, out=wide_out[:, :, 32:])
    assert (wide_out[:, :, :32] == 7.0).all()
    # fp8 KV with fp16 q: tight against the same quantised cache, loose against the original
    case = make_case(4, [1, 17, 40, 150], 4, 2, 32, torch.float16, True, "cpu")
    for splits in (1, 2):
        check_kernel(case, splits, 1e-3, loose_tol=0.1)


@pytest.mark.slow
def test_interpreter() -> None:
    run_interpreter_check("test_kernels_decode_attention", "interp_check_decode_attention")


# ---- GPU -------------------------------------------------------------------------------------

def gpu_lens(batch: int) -> list[int]:
    """One long row (32768) and the page-boundary lengths first, then random ones."""
    rng = random.Random(batch)
    lens = [rng.randint(1, 2048) for _ in range(batch)]
    special = [32768, 1, 4097, 15, 16, 17]
    lens[: min(batch, len(special))] = special[:batch]
    rng.shuffle(lens)
    return lens


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3, 17, 64])
@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (16, 8), (8, 8), (28, 4)])
@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_matches_reference(batch: int, heads: int, kv_heads: int, d: int, fp8: bool) -> None:
    case = make_case(batch * 1000 + heads + d, gpu_lens(batch), heads, kv_heads, d,
                     torch.bfloat16, fp8, "cuda")
    picked = pick_num_splits(batch, kv_heads, max(gpu_lens(batch)))
    for splits in sorted({1, 4, 16, 32, picked}):
        check_kernel(case, splits, 1e-2, loose_tol=0.1 if fp8 else None)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_head_dim_256(fp8: bool) -> None:
    case = make_case(7, [1, 300, 4097], 16, 2, 256, torch.bfloat16, fp8, "cuda")
    for splits in (1, 8):
        check_kernel(case, splits, 1e-2, loose_tol=0.1 if fp8 else None)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.float32, 1e-4)])
def test_gpu_other_dtypes(dtype: torch.dtype, tol: float) -> None:
    """fp16, and fp32 (dots in IEEE fp32, not tf32)."""
    case = make_case(8, [1, 17, 999, 2048, 16], 32, 8, 128, dtype, False, "cuda")
    for splits in (1, 8):
        check_kernel(case, splits, tol)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_cuda_graph_replay(fp8: bool) -> None:
    """Capture once with static buffers; new seq_lens, page tables, q and cache contents each
    replay (incl. a padding row of length 0); the graph's output follows them."""
    batch, heads, kv_heads, d, num_pages, width = 8, 32, 8, 128, 600, 260
    cases = [make_case(seed, lens, heads, kv_heads, d, torch.bfloat16, fp8, "cuda",
                       num_pages=num_pages, max_pages=width)
             for seed, lens in [(11, [5, 4096, 1, 700, 17, 16, 33, 2000]),
                                (12, [4096, 1, 15, 0, 1234, 64, 65, 300]),
                                (13, [1, 2, 3, 4, 5, 6, 7, 8])]]
    static = make_case(10, [1] * batch, heads, kv_heads, d, torch.bfloat16, fp8, "cuda",
                       num_pages=num_pages, max_pages=width)
    splits = pick_num_splits(batch, kv_heads, 4096)
    out = torch.empty_like(static.q)

    def step() -> None:
        decode_attention(*static.args(), static.scale, splits, **static.scales(), out=out)

    graph, _ = capture(step)
    for case in cases:
        for name in ("q", "k_cache", "v_cache", "k_scale", "v_scale", "page_table", "seq_lens"):
            dst, src = getattr(static, name), getattr(case, name)
            if dst is not None:
                dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = decode_attention_ref(*case.args(), case.scale, 1, **case.scales())
        rel, max_abs = row_errors(out, ref)
        assert rel < 1e-2, f"replay lens={case.seq_lens.tolist()}: rel {rel:.2e} ({max_abs:.2e})"
        padding = (case.seq_lens == 0).nonzero().flatten().tolist()
        for row in padding:
            assert torch.equal(out[row], torch.zeros_like(out[row]))
