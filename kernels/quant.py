"""Integer weights on the CPU: 4-bit groups and 8-bit rows, through PyTorch's own packed
matmuls. The weight tensor carries its format (`attach_int`), as an FP8 weight its scales:
the products (`arle_kernels.linear`) see only the weight.

- **int4** (GGUF Q4_0/Q4_1/Q4_K, AWQ, GPTQ): a 4-bit q per weight and, per `group` consecutive
  columns of a row, a scale and a zero: w = (q - 8) * scale + zero (`Int4Groups`, the form
  every loader produces). Packed by `aten._convert_weight_to_int4pack_for_cpu` into
  [N/64, K, 32] bytes (NOTE: torch's layout, pinned by tests/test_quant.py: the low nibble of
  byte j of row block b, column k is W[64b + j, k], the high one W[64b + 32 + j, k]), with
  scales and zeros [K/group, N, 2] in bf16.
- **int8**: w = q * scale[row] (`quantize_int8_rows`), for the 5-8 bit formats.

Both kernels run fast only with bf16 activations and bf16 scales (fp32 or fp16 ones are
10-40x slower on torch 2.13, or refused): x is rounded to bf16, y returned in x's dtype.
Up to `PACKED_MAX_ROWS` rows (decode) the packed kernels run: they read 4 or 8 bits a
weight. Past it (prefill chunks) those kernels are compute-bound at half fp32's rate, so the
weight is expanded to bf16 once per call (W^T, straight from the packed bytes: a nibble split
and one fused multiply-add) and multiplied by torch's bf16 GEMM (oneDNN, AMX where the CPU has
it), its cost shared by all the rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

#: rows of torch's int4 pack block (N is padded to a multiple)
PACK_ROWS = 64
#: the most rows a product runs through the packed kernels; more expand the weight to bf16
#: (2 cores, SmolLM2's shapes: at 32 rows the packed kernel takes 0.6x the expansion's time,
#: at 64 1.1x, at 512 4.8x)
PACKED_MAX_ROWS = 48


@dataclass(frozen=True)
class Int4Groups:
    """A 4-bit weight as the loaders read it: q [N, K] uint8 in 0..15, scale and zero
    [N, K / group] fp32; w = (q - 8) * scale + zero."""

    q: Tensor
    scale: Tensor
    zero: Tensor
    group: int

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        n, k = self.q.shape
        q = self.q.view(n, k // self.group, self.group).float() - 8
        return (q * self.scale[..., None] + self.zero[..., None]).view(n, k).to(dtype)


@dataclass(frozen=True)
class Int4Format:
    """What a packed int4 weight [N_pad, K / 2] uint8 needs beside its bytes."""

    scale_zero: Tensor  # [K / group, N_pad, 2] bf16
    group: int
    n: int  # the weight's rows (N_pad: rounded up to PACK_ROWS)
    dtype: torch.dtype  # the model's compute dtype (of an embedding row)


@dataclass(frozen=True)
class Int8Format:
    """What an int8 weight [N, K] needs beside it: w = q * scale[row]."""

    scale: Tensor  # [N] bf16
    dtype: torch.dtype


def attach_int(weight: Tensor, fmt: Int4Format | Int8Format) -> Tensor:
    weight.int_format = fmt  # type: ignore[attr-defined]
    return weight


def int_format(weight: Tensor) -> Int4Format | Int8Format | None:
    """The integer format a weight carries, or None (a float or FP8 weight)."""
    return getattr(weight, "int_format", None)


def pack_int4(w: Int4Groups, dtype: torch.dtype = torch.float32) -> Tensor:
    """The packed weight for `int4_linear`, its format attached."""
    n = w.q.shape[0]
    pad = -n % PACK_ROWS
    q, scale, zero = (F.pad(t, (0, 0, 0, pad)) for t in (w.q, w.scale, w.zero))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1)
    scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).to(torch.bfloat16)
    return attach_int(packed, Int4Format(scale_zero.contiguous(), w.group, n, dtype))


def unpack_int4(packed: Tensor) -> Tensor:
    """q of a packed weight, transposed: [K, N_pad] uint8 (the layout the module doc names)."""
    rows, half_k = packed.shape
    src = packed.view(rows // PACK_ROWS, 2 * half_k, PACK_ROWS // 2).transpose(0, 1)
    return torch.cat([src & 15, src >> 4], dim=2).view(2 * half_k, rows)


def int4_weight_t(packed: Tensor, fmt: Int4Format) -> Tensor:
    """W^T [K, N_pad] in bf16: (q - 8) * scale + zero as one fused multiply-add from the bf16
    scales (the fp32 zero - 8 scale rounded to bf16 once more)."""
    q_t = unpack_int4(packed)
    k, rows = q_t.shape
    scale = fmt.scale_zero[..., 0].contiguous()  # NOTE: strided operands slow addcmul 2x
    offset = (fmt.scale_zero[..., 1].float() - 8 * scale.float()).to(torch.bfloat16)
    w = q_t.view(k // fmt.group, fmt.group, rows).to(torch.bfloat16)
    return torch.addcmul(offset[:, None], w, scale[:, None]).view(k, rows)


def int4_linear(x: Tensor, packed: Tensor, fmt: Int4Format, bias: Tensor | None = None
                ) -> Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype."""
    rows = _bf16_rows(x)
    if rows.shape[0] <= PACKED_MAX_ROWS:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, fmt.group,
                                                       fmt.scale_zero)
    else:
        y = torch.mm(rows, int4_weight_t(packed, fmt))
    return _out(y if y.shape[1] == fmt.n else y[:, :fmt.n], x, bias)


def _bf16_rows(x: Tensor) -> Tensor:
    """x as the [rows, K] bf16 the kernels take."""
    return (x if x.dim() == 2 else x.reshape(-1, x.shape[-1])).to(torch.bfloat16)


def _out(y: Tensor, x: Tensor, bias: Tensor | None) -> Tensor:
    """A kernel's y [rows, N] in x's dtype and leading shape, plus the bias."""
    y = y.to(x.dtype)
    if x.dim() != 2:
        y = y.view(*x.shape[:-1], y.shape[-1])
    return y.add_(bias) if bias is not None else y


def quantize_int8_rows(w: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """w [N, K] as int8 with one bf16 scale per row (its absmax / 127, rounded up to a bf16:
    the kernel multiplies by exactly the scale q was rounded against), format attached."""
    amax = w.float().abs().amax(dim=1).clamp_min(1e-30)
    scale = _bf16_at_least(amax / 127)
    q = torch.round(w.float() / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return attach_int(q, Int8Format(scale, dtype))


def _bf16_at_least(x: Tensor) -> Tensor:
    """The smallest bf16 >= x (x > 0, fp32)."""
    b = x.to(torch.bfloat16)
    low = b.float() < x
    return torch.where(low, torch.nextafter(b, torch.full_like(b, float("inf"))), b)


def int8_linear(x: Tensor, q: Tensor, fmt: Int8Format, bias: Tensor | None = None) -> Tensor:
    """x [..., K] @ (q * scale)^T (+ bias) -> [..., N] in x's dtype."""
    rows = _bf16_rows(x)
    if rows.shape[0] <= PACKED_MAX_ROWS:
        y = torch.ops.aten._weight_int8pack_mm(rows, q, fmt.scale)
    else:
        y = F.linear(rows, q.to(torch.bfloat16)) * fmt.scale
    return _out(y, x, bias)


def int8_rows(q: Tensor, fmt: Int8Format, ids: Tensor) -> Tensor:
    """Rows `ids` of an int8 weight, dequantized (an embedding lookup) in the model dtype."""
    return (q[ids].float() * fmt.scale[ids].float()[:, None]).to(fmt.dtype)


def int4_rows(packed: Tensor, fmt: Int4Format, ids: Tensor) -> Tensor:
    """Rows `ids` of a packed int4 weight, dequantized (an embedding lookup)."""
    k = packed.shape[1] * 2
    blocks = packed.view(-1, k, PACK_ROWS // 2)
    b, j = ids // PACK_ROWS, ids % PACK_ROWS
    byte = blocks[b, :, j % (PACK_ROWS // 2)]  # [T, K]
    q = torch.where((j < PACK_ROWS // 2)[:, None], byte & 15, byte >> 4).float() - 8
    sz = fmt.scale_zero[:, ids].float()  # [K / group, T, 2]
    scale = sz[..., 0].t().repeat_interleave(fmt.group, dim=1)
    zero = sz[..., 1].t().repeat_interleave(fmt.group, dim=1)
    return (q * scale + zero).to(fmt.dtype)


def int_linear(x: Tensor, weight: Tensor, fmt: Int4Format | Int8Format,
               bias: Tensor | None = None) -> Tensor:
    """x @ W^T (+ bias) for an integer weight, by its format."""
    if isinstance(fmt, Int4Format):
        return int4_linear(x, weight, fmt, bias)
    return int8_linear(x, weight, fmt, bias)


def int_rows(weight: Tensor, fmt: Int4Format | Int8Format, ids: Tensor) -> Tensor:
    """Rows `ids` of an integer weight in the model dtype (an embedding lookup)."""
    if isinstance(fmt, Int4Format):
        return int4_rows(weight, fmt, ids.long())
    return int8_rows(weight, fmt, ids.long())
