"""The embedding lookup in plain torch: the CPU executor's, and the reference
kernels/embed.py's kernel is tested against."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from arle_kernels.quant import int_format, int_rows


def embed_ref(weight: Tensor, ids: Tensor, source: Tensor | None = None) -> Tensor:
    """The reference: `F.embedding` of ids, or of source[ids] (an integer weight's rows
    dequantized)."""
    ids = ids if source is None else source[ids.long()]
    if (fmt := int_format(weight)) is not None:
        return int_rows(weight, fmt, ids)
    return F.embedding(ids, weight)
