"""What the GPU engine tests compare: greedy tokens with their top-2 margin, and two greedy runs
equal up to a bf16 near-tie.

Imported as `gpu_checks` (tests/ is on sys.path).
"""

from __future__ import annotations

import asyncio
from typing import Any

from conftest import run


async def greedy_with_margins(engine: Any, prompts: list[list[int]], n: int
                              ) -> list[list[tuple[int, float]]]:
    """Greedy tokens of each prompt (run concurrently) with the top-1 minus top-2 logprob."""
    async def one(p: list[int]) -> list[tuple[int, float]]:
        out = []
        for d in await run(engine, p, max_tokens=n, ignore_eos=True, logprobs=2):
            for lp in d.logprobs or []:
                assert lp is not None and len(lp.top) == 2
                out.append((lp.token_id, lp.top[0][1] - lp.top[1][1]))
        return out
    return list(await asyncio.gather(*(one(p) for p in prompts)))


def assert_same_up_to_near_ties(a: list[tuple[int, float]], b: list[tuple[int, float]],
                                tie: float = 0.2) -> None:
    """Identical tokens, or identical until a step where the top two were within `tie` (bf16
    GEMMs round differently at other batch sizes: a near-tie may flip, nothing else may).

    NOTE: `tie` is of the size of bf16's own logit error: transformers' bf16 forward of a random
    Qwen3-4B differs from its fp32 one by up to 0.37 in the logits, and a flip at a margin of
    0.0625 between batch sizes 1 and 16 has been seen on the H200."""
    assert len(a) == len(b), (len(a), len(b))
    for i, ((ta, ma), (tb, _)) in enumerate(zip(a, b, strict=True)):
        if ta != tb:
            assert ma < tie, (f"token {i} differs ({ta} vs {tb}) with a top-2 margin of "
                              f"{ma:.3f} (near-tie bound {tie:.3f})")
            return
