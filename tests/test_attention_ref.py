"""The plain-torch paged attention (the CPU executor's, and what the Triton kernels are checked
against) against a dense, unpaged causal attention written out longhand: a step's mixed batch,
its decode rows through `decode_attention_ref` and its extend rows through
`extend_attention_ref`."""

from __future__ import annotations

import itertools
from unittest.mock import patch

import pytest
import torch

import arle_kernels.extend_attention_ref as extend_ref
from arle_kernels.decode_attention_ref import (
    RUN_MIN_KEYS,
    attend_run,
    decode_attention_ref,
    run_is_exact,
)
from arle_kernels.extend_attention_ref import extend_attention_ref


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, D] are the last n of L positions; k/v [L, KVH, D]. Float64, loops, no SDPA."""
    n, h, _ = q.shape
    length, kvh, _ = k.shape
    out = torch.empty(n, h, q.shape[2], dtype=torch.float64)
    for i in range(n):
        pos = length - n + i
        for head in range(h):
            kv = head // (h // kvh)
            s = (k[: pos + 1, kv].double() @ q[i, head].double()) * scale
            out[i, head] = torch.softmax(s, 0) @ v[: pos + 1, kv].double()
    return out


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_mixed_batch_matches_dense(heads: int, kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    page_size, d, num_pages = 16, 32, 64
    # rows: 3 decode rows, then extend rows of odd sizes crossing page boundaries
    seq_lens = [1, 17, 40, 5, 33, 64]
    q_lens = [1, 1, 1, 5, 20, 16]
    nd = 3
    k_cache = torch.randn(num_pages, page_size, kv_heads, d, generator=gen)
    v_cache = torch.randn(num_pages, page_size, kv_heads, d, generator=gen)
    perm = torch.randperm(num_pages, generator=gen).tolist()  # scattered pages
    tables, full_k, full_v = [], [], []
    for length in seq_lens:
        n_pages = -(-length // page_size)
        pages, perm = perm[:n_pages], perm[n_pages:]
        tables.append(pages + [0] * (8 - n_pages))
        full_k.append(k_cache[pages].flatten(0, 1)[:length])
        full_v.append(v_cache[pages].flatten(0, 1)[:length])
    table = torch.tensor(tables, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(sum(q_lens), heads, d, generator=gen)
    scale = d ** -0.5
    out = torch.cat([
        decode_attention_ref(q[:nd], k_cache, v_cache, table[:nd], lens[:nd], scale, 1),
        extend_attention_ref(q[nd:], k_cache, v_cache, table[nd:],
                             torch.tensor([0, *itertools.accumulate(q_lens[nd:])],
                                          dtype=torch.int32),
                             lens[nd:], scale, max(q_lens[nd:]))])
    start = 0
    for r, n in enumerate(q_lens):
        ref = dense_causal(q[start:start + n], full_k[r], full_v[r], scale)
        torch.testing.assert_close(out[start:start + n].double(), ref, atol=1e-5, rtol=1e-5)
        start += n


@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("lens", [[300], [1], [0, 260, 17], [256, 511, 700]])
def test_decode_rows_read_in_place_match_dense(lens: list[int], scattered: bool) -> None:
    """The one-row-at-a-time path (an fp32 cache: consecutive pages read in place as one
    view, others gathered) against the dense attention, on tables of 3 runs or of a run and
    scattered pages, partial last pages and an empty row (zeros); and a row's numbers do not
    depend on where its pages lie: the same K/V in one run give the same bits."""
    gen = torch.Generator().manual_seed(sum(lens))
    page_size, heads, kv_heads, d, num_pages = 16, 6, 2, 32, 160
    k_cache = torch.randn(num_pages, page_size, kv_heads, d, generator=gen)
    v_cache = torch.randn(num_pages, page_size, kv_heads, d, generator=gen)
    width = max(-(-n // page_size) for n in lens)
    free = list(range(num_pages))
    tables = []
    for n in lens:
        n_pages = -(-n // page_size)
        if scattered:  # half in one run, the rest every other page
            run = n_pages // 2
            pages = free[:run] + free[run + 3:run + 3 + 2 * (n_pages - run):2]
        else:  # three runs, a gap of one page between them
            third = -(-n_pages // 3)
            pages = [p for i in range(3) for p in free[i * (third + 1):][:third]][:n_pages]
        free = [p for p in free if p not in pages]
        tables.append(pages + [0] * (width - n_pages))
    q = torch.randn(len(lens), heads, d, generator=gen)
    scale = d ** -0.5
    got = decode_attention_ref(q, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32),
                               torch.tensor(lens, dtype=torch.int32), scale, 1)
    for r, n in enumerate(lens):
        if n == 0:
            assert torch.equal(got[r], torch.zeros_like(got[r]))
            continue
        pages = tables[r][:-(-n // page_size)]
        k = k_cache[pages].flatten(0, 1)[:n]
        v = v_cache[pages].flatten(0, 1)[:n]
        ref = dense_causal(q[r:r + 1], k, v, scale)[0]
        torch.testing.assert_close(got[r].double(), ref, atol=1e-5, rtol=1e-5)
        n_pages = len(pages)
        one_run = list(range(num_pages - n_pages, num_pages))  # the same K/V, moved
        k_moved, v_moved = k_cache.clone(), v_cache.clone()
        k_moved[one_run], v_moved[one_run] = k_cache[pages], v_cache[pages]
        moved = decode_attention_ref(q[r:r + 1], k_moved, v_moved,
                                     torch.tensor([one_run], dtype=torch.int32),
                                     torch.tensor([n], dtype=torch.int32), scale, 1)
        assert torch.equal(moved[0], got[r])


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (6, 2, 32)])
@pytest.mark.parametrize("first,n,scattered", [(RUN_MIN_KEYS, 9, False), (300, 8, True),
                                               (1000, 4, False), (20, 5, False)])
def test_verify_row_gets_its_decode_rows_bits(first: int, n: int, scattered: bool, heads: int,
                                              kv_heads: int, d: int) -> None:
    """A verify row (n tokens over a cached prefix, one extend row) gives each token the bits
    of a decode row of that token, whether it attends as one run (`attend_run`, from
    RUN_MIN_KEYS keys where this machine's BLAS allows it) or token by token: what keeps
    greedy speculation's tokens and logprobs those of speculation off."""
    gen = torch.Generator().manual_seed(first + n)
    page_size, seq_len = 16, first + n - 1
    n_pages = -(-seq_len // page_size)
    num_pages = 2 * n_pages + 4
    k_cache = torch.randn(num_pages, page_size, kv_heads, d, generator=gen)
    v_cache = torch.randn(num_pages, page_size, kv_heads, d, generator=gen)
    pages = list(range(1, 2 * n_pages + 1, 2) if scattered else range(2, n_pages + 2))
    table = torch.tensor([pages], dtype=torch.int32)
    q = torch.randn(n, heads, d, generator=gen)
    scale = d ** -0.5
    runs = []
    with patch.object(extend_ref, "attend_run", side_effect=lambda *a: (runs.append(a),
                                                                          attend_run(*a))):
        got = extend_attention_ref(q, k_cache, v_cache, table,
                                   torch.tensor([0, n], dtype=torch.int32),
                                   torch.tensor([seq_len], dtype=torch.int32), scale, n)
    rows = decode_attention_ref(q, k_cache, v_cache, table.expand(n, -1),
                                torch.arange(first, seq_len + 1, dtype=torch.int32), scale, 1)
    assert torch.equal(got, rows)
    exact = run_is_exact(kv_heads, heads // kv_heads, d, torch.float32)
    assert len(runs) == (first >= RUN_MIN_KEYS and exact)
