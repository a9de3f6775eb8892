"""Greedy sampling on the GPU (kernels/greedy.py) against torch.argmax + the index write.

- Interpreter (CI): small vocabularies and blocks so rows cross several chunks and a chunk
  several loop steps: ties at the maximum (the first index wins, across lanes and steps), rows
  of -inf (index 0), NaN (the first NaN wins, as torch's argmax) and +inf, fp32 / fp16 / bf16;
  the token buffer gets each row's pick at its slot and nothing else changes.
- GPU: Qwen3's vocabulary (151936) at 1, 8 and 64 rows in bf16 and fp32, against torch.argmax
  on the same device, and inside a CUDA graph.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import capture, run_interpreter_check

from arle_kernels.greedy import _BLOCK, _chunk, greedy_pick
from arle_kernels.greedy_ref import greedy_pick_ref

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_logits(rows: int, vocab: int, dtype: torch.dtype, device: str,
                seed: int = 0) -> torch.Tensor:
    """Random logits with the hard rows first: 1 has many ties at its maximum, 2 is all -inf,
    3 has two NaNs, 4 two +infs (as many of them as there are rows)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen, device=device)
    if rows > 1:
        x[1] = x[1].clamp(max=0.5)
    if rows > 2:
        x[2] = float("-inf")
    if rows > 3:
        x[3, vocab // 2] = x[3, vocab // 3] = float("nan")
    if rows > 4:
        x[4, vocab - 1] = x[4, 7] = float("inf")
    return x.to(dtype)


def check(logits: torch.Tensor, block: int | None = None) -> None:
    """greedy_pick against the reference: the same ids, the same token buffer."""
    rows = logits.shape[0]
    gen = torch.Generator().manual_seed(rows)
    slots = (torch.randperm(rows, generator=gen) * 2).to(torch.int32).to(logits.device)
    buf = torch.full((2 * rows + 1,), -5, dtype=torch.int32, device=logits.device)
    ref_buf = buf.clone()
    got = greedy_pick(logits, slots, buf) if block is None else greedy_pick(
        logits, slots, buf, block=block)
    ref = greedy_pick_ref(logits, slots, ref_buf)
    what = f"{rows} x {logits.shape[1]} {logits.dtype}"
    assert got.dtype == torch.int64 and torch.equal(got, ref), f"{what}: {got} vs {ref}"
    assert torch.equal(buf, ref_buf), f"{what}: token buffer {buf} vs {ref_buf}"


def interp_check_greedy() -> None:
    """Needs TRITON_INTERPRET=1 set before triton is imported."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        # (rows, vocab, block): one chunk of one step; several chunks; chunks of several steps
        for rows, vocab, block in ((1, 37, 16), (3, 100, 16), (5, 300, 32), (3, 9000, 16)):
            check(make_logits(rows, vocab, dtype, "cpu", seed=rows), block)


@pytest.mark.slow
def test_interpreter() -> None:
    run_interpreter_check("test_kernels_greedy", "interp_check_greedy")


def test_reference_is_torch_argmax() -> None:
    """The reference's own contract, on the CPU: argmax ids, written at the slots only."""
    x = make_logits(4, 50, torch.float32, "cpu")
    buf = torch.full((9,), -5, dtype=torch.int32)
    ids = greedy_pick_ref(x, torch.tensor([8, 0, 2, 4], dtype=torch.int32), buf)
    assert torch.equal(ids, x.argmax(-1))
    i = ids.tolist()
    assert buf.tolist() == [i[1], -5, i[2], -5, i[3], -5, -5, -5, i[0]]


def test_chunks_stay_short() -> None:
    """The first pass's programs take at most two loop steps at any batch (more rows: more
    programs), ~256 programs in all at least (half that after rounding a chunk up to whole
    blocks), and a row's chunks fit the finish kernel's one variant (S_PAD: a row in
    one-block chunks)."""
    vocab = 151936
    for rows in (1, 3, 8, 64, 256):
        chunk = _chunk(rows, vocab)
        assert chunk % _BLOCK == 0 and _BLOCK <= chunk <= 2 * _BLOCK, (rows, chunk)
        chunks = -(-vocab // chunk)
        assert 2 * rows * chunks >= 256, (rows, chunks)
        assert chunks <= -(-vocab // _BLOCK)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_gpu_matches_torch(rows: int, dtype: torch.dtype) -> None:
    check(make_logits(rows, 151936, dtype, "cuda", seed=rows))


@needs_cuda
@pytest.mark.gpu
def test_gpu_cuda_graph() -> None:
    """Captured once, replayed on new logits: each replay picks the new argmax."""
    logits = make_logits(8, 151936, torch.bfloat16, "cuda")
    slots = torch.arange(8, dtype=torch.int32, device="cuda")
    buf = torch.zeros(9, dtype=torch.int32, device="cuda")
    graph, ids = capture(lambda: greedy_pick(logits, slots, buf))
    for seed in (1, 2):
        logits.copy_(make_logits(8, 151936, torch.bfloat16, "cuda", seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(ids, logits.float().argmax(-1))
        assert torch.equal(buf[:8], ids.int())
