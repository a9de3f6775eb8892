"""Exp(1) noise for seeded sampling, the CPU stream: one torch generator a row, seeded
from (seed, offset) by `mix_seed` (kernels/noise.py draws the CUDA stream)."""

from __future__ import annotations

import torch
from torch import Tensor

_MASK64 = (1 << 64) - 1


def splitmix64(z: int) -> int:
    """SplitMix64's output function: a well-mixed 64-bit integer from any 64-bit one."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def mix_seed(seed: int, offset: int) -> int:
    """The torch generator seed of a seeded row's draw at `offset`:
    splitmix64(splitmix64(seed) + offset).

    NOTE: torch's CPU generator (mt19937) keeps only the low 32 bits of its seed; splitmix64's
    low bits are as well mixed as its high ones, so that costs nothing but the 2^-32 chance
    that two draws share noise."""
    return splitmix64((splitmix64(seed & _MASK64) + offset) & _MASK64)


def exponential_noise_ref(seeds: Tensor, offsets: Tensor, vocab: int,
                          out_dtype: torch.dtype = torch.float32) -> Tensor:
    """The CPU stream: one torch generator per row, seeded with `mix_seed(seed, offset)`,
    drawing `exponential_` over the vocab (the draws the CPU sampler makes for seeded rows),
    floored at float32's tiny so every value is > 0. Reads seeds/offsets on the host."""
    out = torch.empty(seeds.shape[0], vocab, dtype=torch.float32, device=seeds.device)
    for row, (seed, offset) in enumerate(zip(seeds.tolist(), offsets.tolist(), strict=True)):
        gen = torch.Generator(device=seeds.device)
        gen.manual_seed(mix_seed(seed, offset))
        out[row] = torch.empty(vocab, device=seeds.device).exponential_(generator=gen)
    return out.clamp_min_(torch.finfo(torch.float32).tiny).to(out_dtype)
