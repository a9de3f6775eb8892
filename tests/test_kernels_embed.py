"""The embedding lookup kernel (kernels/embed.py) against `F.embedding`.

- Interpreter (CI): hidden sizes below, at and past one block (masked tails), ids given
  directly and through a source (the token buffer at the rows' slots, int32 and int64),
  fp32 / bf16, ids out of range giving zeros.
- GPU: Qwen3-4B's shape (151936 x 2560, bf16) at 1, 8 and 64 rows, and in a CUDA graph whose
  replays read new ids from the token buffer.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from helpers import capture, run_interpreter_check

from arle_kernels.embed import embed
from arle_kernels.embed_ref import embed_ref

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def check(vocab: int, dim: int, rows: int, dtype: torch.dtype, device: str, seed: int) -> None:
    """embed against F.embedding: ids direct, and ids read from a source at slots."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, dim, generator=gen).to(dtype).to(device)
    ids = torch.randint(0, vocab, (rows,), generator=gen, dtype=torch.int32).to(device)
    got = embed(weight, ids)
    assert got.dtype == dtype and torch.equal(got, F.embedding(ids, weight)), (vocab, dim, rows)
    for source_dtype in (torch.int32, torch.int64):
        source = torch.randint(0, vocab, (2 * rows + 1,), generator=gen).to(source_dtype)
        source = source.to(device)
        slots = (torch.randperm(2 * rows + 1, generator=gen)[:rows]).to(torch.int32).to(device)
        want = F.embedding(source[slots.long()], weight)
        assert torch.equal(embed(weight, slots, source), want), (vocab, dim, rows, source_dtype)
        assert torch.equal(embed_ref(weight, slots, source), want)


def interp_check_embed() -> None:
    """Needs TRITON_INTERPRET=1 set before triton is imported."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for dtype in (torch.float32, torch.bfloat16):
        # (vocab, dim, rows): under one block; one block exactly; a block and a masked tail
        for vocab, dim, rows in ((50, 64, 3), (40, 1024, 2), (30, 1100, 4)):
            check(vocab, dim, rows, dtype, "cpu", seed=dim)
    weight = torch.randn(10, 48)
    got = embed(weight, torch.tensor([3, 10, -1, 9], dtype=torch.int32))
    assert torch.equal(got[0], weight[3]) and torch.equal(got[3], weight[9])
    assert not got[1:3].any(), "ids out of range give zeros"


@pytest.mark.slow
def test_interpreter() -> None:
    run_interpreter_check("test_kernels_embed", "interp_check_embed")


def test_reference_reads_source_at_ids() -> None:
    """The reference's own contract, on the CPU: source[ids] when a source is given."""
    weight = torch.arange(12.0).view(6, 2)
    source = torch.tensor([5, 0, 3], dtype=torch.int32)
    got = embed_ref(weight, torch.tensor([2, 0, 1], dtype=torch.int32), source)
    assert got.tolist() == [[6.0, 7.0], [10.0, 11.0], [0.0, 1.0]]


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_gpu_matches_torch(rows: int) -> None:
    check(151936, 2560, rows, torch.bfloat16, "cuda", seed=rows)


@needs_cuda
@pytest.mark.gpu
def test_gpu_cuda_graph() -> None:
    """Captured once, replayed after the token buffer changes: each replay reads the new ids."""
    weight = torch.randn(151936, 2560, device="cuda").to(torch.bfloat16)
    slots = torch.tensor([4, 0, 7, 2], dtype=torch.int32, device="cuda")
    buf = torch.zeros(9, dtype=torch.int32, device="cuda")
    graph, y = capture(lambda: embed(weight, slots, buf))
    for seed in (1, 2):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        buf.copy_(torch.randint(0, 151936, (9,), generator=gen, device="cuda").int())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, weight[buf[slots.long()].long()])
