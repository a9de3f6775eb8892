"""The Triton extend (prefill) attention against its plain-torch reference, and the reference
against a dense causal attention written out longhand (an independent formula).

GPU tests use realistic shapes (Qwen3 head counts, D 128, bf16 and fp8, a 4096-token prompt
mixed with short rows and prefix hits); the interpreter check (`interp_check_extend_attention`)
runs tiny shapes in a subprocess with TRITON_INTERPRET=1. Every case scatters the rows' pages
with a random permutation and fills every cache slot no row owns (spare pages, the page-table
padding's page 0, the tails of the rows' last pages) with NaN, so a read outside a row, or an
unmasked one past seq_len, shows; outputs are NaN-poisoned before the launch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from helpers import run_interpreter_check
from test_attention_ref import dense_causal

from arle_kernels.extend_attention import _launch, block_tokens, extend_attention
from arle_kernels.extend_attention_ref import extend_attention_ref, plan_blocks

PAGE = 16
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (cached prefix, new tokens) per row: single tokens, page boundaries, a long prompt, prefix hits
GPU_ROWS = [(0, 1), (0, 17), (0, 4096), (5, 1), (33, 64), (1000, 513), (16, 16), (62, 100),
            (127, 200)]
INTERP_ROWS = [(0, 5), (7, 9), (16, 17), (30, 18), (9, 12)]


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(token, head) e4m3: scale = max(amax over D, 1e-6) / 448, stored = x / scale."""
    scale = x.float().abs().amax(-1).clamp_min(1e-6) / 448
    return (x.float() / scale[..., None]).to(torch.float8_e4m3fn), scale


@dataclass
class Case:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor
    cu_q_lens: torch.Tensor
    seq_lens: torch.Tensor
    max_q_len: int
    scale: float
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_plain: torch.Tensor | None = None  # fp8 cases: the cache before quantisation
    v_plain: torch.Tensor | None = None

    def args(self, q: torch.Tensor | None = None, plain: bool = False) -> tuple:
        k, v = (self.k_plain, self.v_plain) if plain else (self.k_cache, self.v_cache)
        return (self.q if q is None else q, k, v, self.page_table, self.cu_q_lens,
                self.seq_lens, self.scale, self.max_q_len)

    def scales(self) -> dict[str, torch.Tensor | None]:
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}


def make_case(rows: list[tuple[int, int]], heads: int, kv_heads: int, d: int,
              dtype: torch.dtype, device: str, *, fp8: bool = False, seed: int = 0,
              cache_view: bool = False, extra_q_len: int = 0) -> Case:
    """Random q and cache for rows of (prefix, q_len). fp8: the cache quantised (q in dtype).
    cache_view: K and V are strided views into one [pages, 2, page, KVH, D] tensor."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in rows]
    n_pages = [-(-s // PAGE) for s in seq_lens]
    num_pages = sum(n_pages) + 3  # page 0 (the table's padding) and two spare pages
    kv = torch.randn(num_pages, 2, PAGE, kv_heads, d, generator=gen)
    owned = torch.zeros(num_pages, PAGE, dtype=torch.bool)
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(rows), max(n_pages) + 2, dtype=torch.int32)
    for r, s in enumerate(seq_lens):
        pages, perm = perm[:n_pages[r]], perm[n_pages[r]:]
        table[r, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        for i in range(s):
            owned[pages[i // PAGE], i % PAGE] = True
    kv[~owned[:, None].expand(-1, 2, -1)] = float("nan")
    t = sum(n for _p, n in rows)
    q = torch.randn(t, heads, d, generator=gen) * 2  # logits of std ~2: a peaky softmax
    case = Case(
        q=q.to(dtype).to(device),
        k_cache=kv[:, 0], v_cache=kv[:, 1],
        page_table=table.to(device),
        cu_q_lens=torch.tensor([0] + [n for _p, n in rows], dtype=torch.int32).cumsum(0)
        .to(torch.int32).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        max_q_len=max(n for _p, n in rows) + extra_q_len, scale=d ** -0.5)
    if fp8:
        k8, ks = quantize_fp8(case.k_cache)
        v8, vs = quantize_fp8(case.v_cache)
        case.k_plain, case.v_plain = case.k_cache.to(dtype).to(device), case.v_cache.to(dtype).to(
            device)
        case.k_cache, case.v_cache = k8.to(device), v8.to(device)
        case.k_scale, case.v_scale = ks.to(device), vs.to(device)
    elif cache_view:
        kv = kv.to(dtype).to(device)
        case.k_cache, case.v_cache = kv[:, 0], kv[:, 1]
    else:
        case.k_cache = case.k_cache.to(dtype).contiguous().to(device)
        case.v_cache = case.v_cache.to(dtype).contiguous().to(device)
    return case


def check(case: Case, out: torch.Tensor, *, rel_tol: float, abs_tol: float,
          plain: bool = False) -> None:
    """`out` against the reference in fp32 (plain: on the unquantised cache)."""
    assert not out.isnan().any(), "unwritten or NaN outputs"
    ref = extend_attention_ref(*case.args(case.q.float(), plain),
                               **({} if plain else case.scales()))
    diff = (out.float() - ref).abs()
    rel = float(diff.norm() / ref.norm())
    cu = case.cu_q_lens.tolist()
    per_row = [round(float(diff[a:b].max()), 5) for a, b in itertools.pairwise(cu) if b > a]
    assert rel < rel_tol and float(diff.max()) < abs_tol, (
        f"rel {rel:.2e} (tol {rel_tol}), max abs per row {per_row} (tol {abs_tol})")


def run_kernel(case: Case, config: tuple[int, int, int, int] | None = None,
               blocks: bool = False) -> torch.Tensor:
    """The kernel into a NaN-poisoned output (config: explicit block sizes via `_launch`).
    blocks: the work as a (row, token block) list (`plan_blocks`) with 7 padding entries, as a
    CUDA graph of a padded batch runs it, instead of the grid over rows."""
    out = torch.full_like(case.q, float("nan"))
    table = None
    if blocks:
        group = case.q.shape[1] // case.k_cache.shape[2]
        block_t = (config[0] // group if config is not None else
                   block_tokens(case.q.shape[2], group, case.k_scale is not None))
        cu, lens = case.cu_q_lens.tolist(), case.seq_lens.tolist()
        q_lens = [b - a for a, b in itertools.pairwise(cu)]
        need = sum(-(-q // block_t) for q in q_lens)
        table = torch.tensor(plan_blocks(q_lens, lens, block_t, need + 7), dtype=torch.int32,
                             device=case.q.device)
    if config is None:
        res = extend_attention(*case.args(), **case.scales(), out=out, blocks=table)
    else:
        res = _launch(*case.args(), case.k_scale, case.v_scale, out, *config, blocks=table)
    assert res is out
    return out


def test_plan_blocks() -> None:
    """Every token block of every row once, the longest work first, padding at the end."""
    flat = plan_blocks([5, 0, 33, 1], [5, 40, 100, 70], 16, 9)
    pairs = list(zip(flat[::2], flat[1::2], strict=True))
    assert sorted(pairs[:5]) == [(0, 0), (2, 0), (2, 1), (2, 2), (3, 0)]
    assert pairs[5:] == [(-1, 0)] * 4
    # by the keys its last token sees: row 2's blocks (100, 99, 83), row 3 (70), row 0 (5)
    assert pairs[:5] == [(2, 2), (2, 1), (2, 0), (3, 0), (0, 0)]
    with pytest.raises(AssertionError):
        plan_blocks([33], [33], 16, 2)


# --- CPU: the reference against the longhand formula ------------------------------------------

@pytest.mark.parametrize("heads,kv_heads,fp8", [(4, 4, False), (8, 2, False), (6, 2, True)])
def test_ref_matches_dense(heads: int, kv_heads: int, fp8: bool) -> None:
    rows = [(0, 5), (7, 9), (16, 17), (40, 1), (3, 30)]
    case = make_case(rows, heads, kv_heads, 32, torch.float32, "cpu", fp8=fp8, seed=heads)
    out = extend_attention_ref(*case.args(), **case.scales())
    k, v = case.k_cache, case.v_cache
    if fp8:  # dequantise the whole cache here, independently of the reference's own gather
        assert case.k_scale is not None and case.v_scale is not None
        k = k.float() * case.k_scale[..., None]
        v = v.float() * case.v_scale[..., None]
    cu = case.cu_q_lens.tolist()
    for r, seq_len in enumerate(case.seq_lens.tolist()):
        pos = torch.arange(seq_len)
        pages, offs = case.page_table[r, pos // PAGE].long(), pos % PAGE
        want = dense_causal(case.q[cu[r]:cu[r + 1]], k[pages, offs], v[pages, offs], case.scale)
        torch.testing.assert_close(out[cu[r]:cu[r + 1]].double(), want, atol=1e-5, rtol=1e-5)


# --- interpreter (CPU, subprocess with TRITON_INTERPRET=1) ------------------------------------

def interp_check_extend_attention() -> None:
    """Tiny shapes through the Triton kernel under the interpreter; raises on a mismatch. Small
    blocks (16 x 16) so a row crosses several token and key blocks, and the default rule."""
    small = (16, 16, 4, 1)
    # fp32, GQA 2: small blocks, then the public wrapper's own config
    case = make_case(INTERP_ROWS, 4, 2, 16, torch.float32, "cpu", seed=1)
    check(case, run_kernel(case, small), rel_tol=1e-4, abs_tol=1e-4)
    check(case, run_kernel(case), rel_tol=1e-4, abs_tol=1e-4)
    # the same work as a (row, token block) list with padding entries (CUDA graphs)
    check(case, run_kernel(case, small, blocks=True), rel_tol=1e-4, abs_tol=1e-4)
    # fp16, D 32, K/V strided views of one tensor, grid sized past the longest row, an empty row
    rows = [*INTERP_ROWS, (9, 0)]
    case = make_case(rows, 4, 2, 32, torch.float16, "cpu", seed=2, cache_view=True,
                     extra_q_len=9)
    check(case, run_kernel(case, small), rel_tol=1e-3, abs_tol=5e-3)
    # a group of 3 heads (tile rows 15 of 16 used)
    case = make_case(INTERP_ROWS, 6, 2, 16, torch.float32, "cpu", seed=3)
    check(case, run_kernel(case, small), rel_tol=1e-4, abs_tol=1e-4)
    # fp8 KV, fp16 q: against the same quantised cache, and loosely against the unquantised one
    case = make_case(INTERP_ROWS, 4, 2, 16, torch.float16, "cpu", fp8=True, seed=4)
    out = run_kernel(case, small)
    check(case, out, rel_tol=1e-3, abs_tol=5e-3)
    check(case, out, rel_tol=5e-2, abs_tol=2e-1, plain=True)


@pytest.mark.slow
def test_interpreter() -> None:
    run_interpreter_check("test_kernels_extend_attention", "interp_check_extend_attention")


# --- GPU ----------------------------------------------------------------------------------------

@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("heads,kv_heads,d", [(32, 8, 128), (16, 8, 128), (8, 8, 128),
                                              (28, 4, 128), (32, 8, 64), (16, 2, 64)])
def test_gpu_mixed_batch(heads: int, kv_heads: int, d: int) -> None:
    case = make_case(GPU_ROWS, heads, kv_heads, d, torch.bfloat16, "cuda", seed=heads + d)
    out = run_kernel(case)
    check(case, out, rel_tol=1e-2, abs_tol=5e-2)
    # the block list does the same work per program: the same bits
    assert torch.equal(run_kernel(case, blocks=True), out)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (28, 4)])
def test_gpu_fp8(heads: int, kv_heads: int) -> None:
    case = make_case(GPU_ROWS, heads, kv_heads, 128, torch.bfloat16, "cuda", fp8=True,
                     seed=heads)
    out = run_kernel(case)
    check(case, out, rel_tol=1e-2, abs_tol=5e-2)
    # the quantisation's own error (e4m3 keeps 3 mantissa bits): 5.1e-2 measured on an H200
    check(case, out, rel_tol=8e-2, abs_tol=3e-1, plain=True)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_short_rows(fp8: bool) -> None:
    """Only short rows (a tile of 64 rows holds 16 tokens x 4 heads: q_len 16 fills it), an
    empty row, a grid sized past the longest row."""
    rows = [(100, 1), (37, 16), (2000, 8), (15, 0), (0, 3), (4095, 16)]
    case = make_case(rows, 32, 8, 128, torch.bfloat16, "cuda", fp8=fp8, seed=7, extra_q_len=5)
    check(case, run_kernel(case), rel_tol=1e-2, abs_tol=5e-2)


@needs_cuda
@pytest.mark.gpu
def test_gpu_head_dim_256_and_fp16() -> None:
    rows = [(0, 300), (77, 45), (512, 1)]
    case = make_case(rows, 8, 2, 256, torch.bfloat16, "cuda", seed=11)
    check(case, run_kernel(case), rel_tol=1e-2, abs_tol=5e-2)
    case = make_case(rows, 16, 8, 128, torch.float16, "cuda", seed=12, cache_view=True)
    check(case, run_kernel(case), rel_tol=1e-3, abs_tol=1e-2)
