"""4-bit weights for the GPU's W4A16 kernels, in plain torch: the layout (packing,
unpacking) and the reference kernels/w4a16.py's kernels are tested against."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from arle_kernels.quant import Int4Groups

#: a 4-bit weight's run (`_gemv_w4_kernel`): 4 int32 words, one 16-byte load, 32 columns
W4_RUN = 4


#: the columns of a 4-bit run
W4_RUN_COLS = 32


@dataclass(frozen=True)
class W4Format:
    """What a packed weight [N, K / 8] int32 needs beside its words."""

    scales: Tensor  # [N, 2, K / group] fp16: scale, zero
    group: int

    @property
    def k(self) -> int:
        return self.scales.shape[2] * self.group

    @property
    def scale(self) -> Tensor:
        return self.scales[:, 0]

    @property
    def zero(self) -> Tensor:
        return self.scales[:, 1]


def attach_w4(weight: Tensor, fmt: W4Format) -> Tensor:
    weight.w4_format = fmt  # type: ignore[attr-defined]
    return weight


def w4_format(weight: Tensor) -> W4Format | None:
    return getattr(weight, "w4_format", None)


def w4_layout_ok(k: int, group: int) -> bool:
    """Whether a weight of K columns in groups of `group` has the W4A16 layout (runs of 32
    columns, each inside one group)."""
    return group % W4_RUN_COLS == 0 and k % group == 0


def _runs(t: Tensor) -> Tensor:
    """[N, K] -> [N, K / 32, 4, 8]: element [n, r, i, j] is column 32 r + 4 j + i (a run's
    word i, nibble j)."""
    n, k = t.shape
    return t.view(n, k // W4_RUN_COLS, 8, W4_RUN).transpose(2, 3)


def pack_w4(w: Int4Groups) -> Tensor:
    """The GPU layout of a loader's 4-bit groups (module docstring), on w's device, its format
    attached."""
    n, k = w.q.shape
    assert w4_layout_ok(k, w.group), (n, k, w.group)
    nib = _runs(w.q.to(torch.int32))
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=w.q.device)
    words = (nib << shifts).sum(dim=-1, dtype=torch.int32).view(n, k // 8)
    scales = torch.stack([w.scale.float(), w.zero.float()], dim=1).to(torch.float16)
    return attach_w4(words.contiguous(), W4Format(scales.contiguous(), w.group))


def nibbles(words: Tensor) -> Tensor:
    """int32 [..., C] -> uint8 [..., C, 8]: nibble i is bits 4i..4i+3 (AWQ's, GPTQ's words;
    ours hold runs, `unpack_w4`)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    return ((words[..., None] >> shifts) & 15).to(torch.uint8)


def unpack_w4(words: Tensor, fmt: W4Format, dtype: torch.dtype = torch.float32) -> Tensor:
    """The weight [N, K] in `dtype` ((q - 8) * scale + zero in fp32)."""
    n, k = words.shape[0], fmt.k
    q = torch.empty(n, k, dtype=torch.float32, device=words.device)
    _runs(q).copy_(nibbles(words).view(n, k // W4_RUN_COLS, W4_RUN, 8))
    g = fmt.group
    s, z = fmt.scale.float()[..., None], fmt.zero.float()[..., None]
    return ((q.view(n, -1, g) - 8) * s + z).view(n, k).to(dtype)


def w4_linear_ref(x: Tensor, weight: Tensor, fmt: W4Format, bias: Tensor | None = None
                  ) -> Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] in x's dtype, in fp32."""
    y = x.float() @ unpack_w4(weight, fmt).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
