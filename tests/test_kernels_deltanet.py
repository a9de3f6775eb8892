"""Gated DeltaNet kernels (arle_kernels.deltanet).

- CPU: the torch refs against transformers' own `qwen3_5` functions (`causal_conv1d_fn` /
  `causal_conv1d_update`, `l2norm`, `torch_chunk_gated_delta_rule` /
  `torch_recurrent_gated_delta_rule`, `Qwen3_5RMSNormGated`) on random inputs: a row from a
  zero state is HF's prefill, a row from a state is HF's cached decode (or multi-token update),
  rows cut into pieces equal one row, boundary snapshots equal a run stopped there, a step of
  mixed rows equals its rows run one by one, and the chunked torch form equals the recurrence.
- Interpreter (CPU, a subprocess with TRITON_INTERPRET=1): `interp_check_*` run the Triton op
  (decode kernel, chunked and token-by-token extend paths) and the gated norm against the refs
  on tiny shapes (Hk 2 / Hv 4 / d 16 or 32, and Hk 1 / Hv 3 / dk 8 / dv 24 with a conv of 3):
  odd row lengths, rows shorter than the conv, rows crossing page boundaries (page size 4 and
  16), several slots, padding rows and padding tokens, two blocks of value columns; fp32 data,
  and fp16 (the model-dtype roundings; not bf16: the interpreter truncates fp32 to bf16).
- sm_90 builds (CPU, no GPU needed): every kernel variant the op launches at Qwen3.5-4B's
  shapes compiles for an H200 and fits its shared memory.
- GPU (skipped without CUDA): Qwen3.5-4B's shapes in bf16 (decode at batch 1/8/64, a mixed
  step with a 4096-token prompt), fp32 with IEEE dots, CUDA-graph replays, the gated norm.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import capture, run_interpreter_check
from torch import Tensor

from arle_kernels import deltanet, deltanet_ref
from arle_kernels.deltanet import gated_delta, gated_rms_norm
from arle_kernels.deltanet_ref import (
    Keep,
    chunk_delta_rule_ref,
    delta_rule_ref,
    gated_delta_ref,
    gated_rms_norm_ref,
)

hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


# ---------------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    hk: int = 2
    hv: int = 4
    dk: int = 16
    dv: int = 16
    k: int = 4  # conv kernel

    @property
    def c(self) -> int:
        return 2 * self.hk * self.dk + self.hv * self.dv


TINY = Shape()
ODD = Shape(hk=1, hv=3, dk=8, dv=24, k=3)  # one key head for three value heads


@dataclass
class Layer:
    """A layer's weights and a pool of state slots."""

    shape: Shape
    conv_weight: Tensor  # [C, K]
    a_log: Tensor
    dt_bias: Tensor
    conv_state: Tensor  # [S, C, K-1]
    ssm_state: Tensor  # [S, Hv, dk, dv] fp32

    def clone_states(self) -> tuple[Tensor, Tensor]:
        return self.conv_state.clone(), self.ssm_state.clone()


def make_layer(shape: Shape, dtype: torch.dtype, slots: int = 4, seed: int = 0,
               zero_states: bool = False) -> Layer:
    gen = torch.Generator().manual_seed(seed)
    c, hv = shape.c, shape.hv
    conv_weight = (torch.randn(c, shape.k, generator=gen) / shape.k ** 0.5).to(dtype)
    # decays from long memory (g ~ -0.001 a token) to short (~ -1): the state must carry
    # across chunks for a test to see it
    a_log = torch.empty(hv).uniform_(-5.0, 0.5, generator=gen).to(dtype)
    dt_bias = (torch.randn(hv, generator=gen) * 0.5 - 2.0).to(dtype)
    conv_state = torch.randn(slots, c, shape.k - 1, generator=gen).to(dtype)
    ssm_state = torch.randn(slots, hv, shape.dk, shape.dv, generator=gen) * 0.3
    if zero_states:
        conv_state.zero_()
        ssm_state.zero_()
    return Layer(shape, conv_weight, a_log, dt_bias, conv_state, ssm_state)


def make_inputs(shape: Shape, t: int, dtype: torch.dtype, seed: int = 1
                ) -> tuple[Tensor, Tensor, Tensor]:
    """mixed_qkv [T, C], a, b [T, Hv]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, shape.c, generator=gen).to(dtype)
    a = torch.randn(t, shape.hv, generator=gen).to(dtype)
    b = (torch.randn(t, shape.hv, generator=gen) * 2).to(dtype)
    return x, a, b


def run_ref(layer: Layer, x: Tensor, a: Tensor, b: Tensor, slots: list[int], seq_lens: list[int],
            lens: list[int], num_decode: int, page_size: int = 16,
            boundary: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """gated_delta_ref on the layer's states (modified in place); lens: the extend rows'."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    i32 = torch.int32
    bc, bs = boundary if boundary is not None else (None, None)
    return gated_delta_ref(x, a, b, layer.conv_weight, layer.a_log, layer.dt_bias,
                           layer.conv_state, layer.ssm_state, torch.tensor(slots, dtype=i32),
                           torch.tensor(seq_lens, dtype=i32), torch.tensor(cu, dtype=i32),
                           num_decode, max(lens, default=1), layer.shape.hk, page_size, bc, bs)


# ---------------------------------------------------------------------------------------------
# transformers' computation of one row
# ---------------------------------------------------------------------------------------------

def hf_row(layer: Layer, x: Tensor, a: Tensor, b: Tensor, slot: int | None, chunked: bool
           ) -> tuple[Tensor, Tensor, Tensor]:
    """One sequence through HF's functions, from the slot's states (None: zero states, HF's
    prefill). -> (o [n, Hv, dv], conv state [C, K-1], ssm state)."""
    sh, n = layer.shape, x.shape[0]
    km1 = sh.k - 1
    w = layer.conv_weight
    if slot is None:
        conv = hf.causal_conv1d_fn(x.T[None], w, None, activation="silu")
        tail = F.pad(x.T, (km1, 0))[:, -km1:]
        init = None
    else:  # HF's cache keeps K inputs, the oldest of which no output reads
        cache = torch.cat([torch.zeros_like(layer.conv_state[slot][:, :1]),
                           layer.conv_state[slot]], 1)[None].clone()
        conv = hf.causal_conv1d_update(x.T[None], cache, w, None, activation="silu")
        tail = cache[0, :, 1:]
        init = layer.ssm_state[slot][None].clone()
    mixed = conv.transpose(1, 2)
    kd = sh.hk * sh.dk
    # NOTE: q and k repeated to the value heads, as HF's layer does before the rule (its rule
    # functions take unrepeated heads only from transformers 5.2x on)
    q = mixed[..., :kd].reshape(1, n, sh.hk, sh.dk).repeat_interleave(sh.hv // sh.hk, dim=2)
    k = mixed[..., kd:2 * kd].reshape(1, n, sh.hk, sh.dk).repeat_interleave(sh.hv // sh.hk, 2)
    v = mixed[..., 2 * kd:].reshape(1, n, sh.hv, sh.dv)
    beta = b[None].sigmoid()
    g = -layer.a_log.float().exp() * F.softplus(a[None].float() + layer.dt_bias)
    rule = hf.torch_chunk_gated_delta_rule if chunked else hf.torch_recurrent_gated_delta_rule
    o, state = rule(q, k, v, g=g, beta=beta, initial_state=init, output_final_state=True,
                    use_qk_l2norm_in_kernel=True)
    return o[0], tail, state[0]


def assert_close(out: Tensor, ref: Tensor, dtype: torch.dtype, what: str = "") -> None:
    """fp32: 1e-4 relative to the tensor's scale; 16-bit: at most 2% of the elements an ulp of
    that scale off, none 8 ulps (a conv sum rounded the other way, e.g. by HF's bf16 conv in
    another order, moves everything after it by an ulp or so)."""
    o, r = out.float(), ref.float()
    assert not o.isnan().any(), what
    scale = r.abs().max().clamp_min(1e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(o, r, atol=1e-4 * scale.item(), rtol=1e-4, msg=what)
    else:
        ulp = 2.0 ** -(7 if dtype == torch.bfloat16 else 10) * scale
        err = (o - r).abs()
        assert (err > ulp).float().mean() <= 0.02, f"{what}: {err.max()}"
        assert err.max() <= 8 * ulp, f"{what}: {err.max()} of {scale}"


DTYPES = [torch.float32, torch.bfloat16]


# ---------------------------------------------------------------------------------------------
# refs vs transformers
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [TINY, ODD])
@pytest.mark.parametrize("n", [1, 2, 37, 130])
def test_ref_prefill_matches_hf(shape: Shape, dtype: torch.dtype, n: int) -> None:
    """One row from zero states = HF's prefill (its chunked rule and its recurrent one)."""
    layer = make_layer(shape, dtype, zero_states=True)
    x, a, b = make_inputs(shape, n, dtype)
    for chunked in (True, False):
        o_hf, conv_hf, ssm_hf = hf_row(layer, x, a, b, None, chunked)
        conv, ssm = layer.clone_states()
        lay = Layer(shape, layer.conv_weight, layer.a_log, layer.dt_bias, conv, ssm)
        out = run_ref(lay, x, a, b, [2], [n], [n], 0)
        assert out.dtype == dtype and out.shape == (n, shape.hv, shape.dv)
        assert_close(out, o_hf, dtype, f"out chunked={chunked}")
        assert torch.equal(conv[2], conv_hf)
        assert_close(ssm[2], ssm_hf, torch.float32 if dtype == torch.float32 else dtype, "ssm")
        # other slots untouched
        assert torch.equal(conv[[0, 1, 3]], layer.conv_state[[0, 1, 3]])
        assert torch.equal(ssm[[0, 1, 3]], layer.ssm_state[[0, 1, 3]])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [TINY, ODD])
@pytest.mark.parametrize("n", [1, 3, 70])
def test_ref_continuation_matches_hf(shape: Shape, dtype: torch.dtype, n: int) -> None:
    """A row from a slot's states = HF's cached decode (causal_conv1d_update and the recurrent
    rule from the state), as a decode row (n = 1) and as an extend row."""
    layer = make_layer(shape, dtype)
    x, a, b = make_inputs(shape, n, dtype)
    o_hf, conv_hf, ssm_hf = hf_row(layer, x, a, b, 1, chunked=False)
    for decode in ([True, False] if n == 1 else [False]):
        conv, ssm = layer.clone_states()
        lay = Layer(shape, layer.conv_weight, layer.a_log, layer.dt_bias, conv, ssm)
        out = run_ref(lay, x, a, b, [1], [100], [] if decode else [n], 1 if decode else 0)
        assert_close(out, o_hf, dtype, "out")
        assert torch.equal(conv[1], conv_hf)
        assert_close(ssm[1], ssm_hf, torch.float32 if dtype == torch.float32 else dtype, "ssm")


def test_ref_l2norm_and_norm_match_hf() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 16, generator=gen)
    torch.testing.assert_close(deltanet_ref.l2norm_ref(x), hf.l2norm(x), rtol=0, atol=0)
    for dtype in DTYPES:
        norm = hf.Qwen3_5RMSNormGated(24, eps=1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(24, generator=gen))
        h = torch.randn(7, 24, generator=gen).to(dtype)
        z = torch.randn(7, 24, generator=gen).to(dtype)
        with torch.no_grad():
            want = norm(h, z)
        got = gated_rms_norm_ref(h, z, norm.weight.detach(), 1e-6)
        assert got.dtype == dtype
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ref_pieces_equal_one_row(dtype: torch.dtype) -> None:
    """A row cut into pieces (later pieces continue from the slot's states, decode rows among
    them) = the row in one piece: outputs and final states."""
    shape = TINY
    layer = make_layer(shape, dtype)
    n = 75
    x, a, b = make_inputs(shape, n, dtype)
    start = 9  # the slot already holds 9 positions
    whole = make_layer(shape, dtype)
    out = run_ref(whole, x, a, b, [3], [start + n], [n], 0)
    pieces = []
    done = 0
    for piece, decode in ((1, True), (1, False), (30, False), (1, True), (42, False)):
        sl = slice(done, done + piece)
        pieces.append(run_ref(layer, x[sl], a[sl], b[sl], [3], [start + done + piece],
                              [] if decode else [piece], 1 if decode else 0))
        done += piece
    assert done == n
    assert_close(torch.cat(pieces), out, dtype, "out")
    assert torch.equal(layer.conv_state, whole.conv_state)
    assert_close(layer.ssm_state, whole.ssm_state, torch.float32, "ssm")


@pytest.mark.parametrize("page_size", [4, 16])
def test_ref_boundary_is_the_state_at_the_page_boundary(page_size: int) -> None:
    """A row that crosses page boundaries leaves in boundary_* the states after its last
    boundary, which are those of a run that stopped there; a row that crosses none writes
    nothing there."""
    dtype, shape = torch.float32, TINY
    start, n = 6, 100  # positions 6..105
    x, a, b = make_inputs(shape, n, dtype)
    layer = make_layer(shape, dtype)
    nan_bc = torch.full_like(layer.conv_state, float("nan"))
    nan_bs = torch.full_like(layer.ssm_state, float("nan"))
    bc, bs = nan_bc.clone(), nan_bs.clone()
    run_ref(layer, x, a, b, [2], [start + n], [n], 0, page_size, (bc, bs))
    p = (start + n) // page_size * page_size
    stopped = make_layer(shape, dtype)
    m = p - start
    run_ref(stopped, x[:m], a[:m], b[:m], [2], [p], [m], 0, page_size)
    assert torch.equal(bc[2], stopped.conv_state[2])
    assert_close(bs[2], stopped.ssm_state[2], torch.float32, "boundary ssm")
    assert bc[[0, 1, 3]].isnan().all() and bs[[0, 1, 3]].isnan().all()
    # ending exactly on a boundary: the snapshot is the final state
    bc, bs = nan_bc.clone(), nan_bs.clone()
    again = make_layer(shape, dtype)
    run_ref(again, x[:m], a[:m], b[:m], [2], [p], [m], 0, page_size, (bc, bs))
    assert torch.equal(bc[2], again.conv_state[2]) and torch.equal(bs[2], again.ssm_state[2])
    # no boundary crossed (positions p+1 .. p+2): nothing written
    bc, bs = nan_bc.clone(), nan_bs.clone()
    run_ref(again, x[:2], a[:2], b[:2], [2], [p + 2], [2], 0, page_size, (bc, bs))
    assert bc.isnan().all() and bs.isnan().all()


def test_ref_mixed_rows_equal_rows_alone() -> None:
    """A step of decode rows, extend rows (one empty) and a padding row (slot -1) = each row
    alone, padding tokens 0 and no state written for them."""
    dtype, shape = torch.float32, ODD
    slots = [4, 0, -1, 2, 5, 1]
    lens = [1, 1, 1, 5, 0, 67]  # 3 decode rows, then 3 extend rows
    nd = 3
    seq_lens = [10, 1, 1, 5, 3, 90]
    t = sum(lens)
    x, a, b = make_inputs(shape, t, dtype)
    layer = make_layer(shape, dtype, slots=6)
    alone = make_layer(shape, dtype, slots=6)
    bound = (torch.zeros_like(layer.conv_state), torch.zeros_like(layer.ssm_state))
    bound_alone = (torch.zeros_like(layer.conv_state), torch.zeros_like(layer.ssm_state))
    out = run_ref(layer, x, a, b, slots, seq_lens, lens[nd:], nd, 16, bound)
    tok = 0
    for slot, n, end in zip(slots, lens, seq_lens, strict=True):
        if slot >= 0 and n:
            sl = slice(tok, tok + n)
            want = run_ref(alone, x[sl], a[sl], b[sl], [slot], [end], [n], 0, 16, bound_alone)
            torch.testing.assert_close(out[sl], want, rtol=0, atol=0)
        elif n:
            assert (out[tok:tok + n] == 0).all()
        tok += n
    assert torch.equal(layer.conv_state, alone.conv_state)
    assert torch.equal(layer.ssm_state, alone.ssm_state)
    assert all(torch.equal(u, w) for u, w in zip(bound, bound_alone, strict=True))
    assert bound[1][1].abs().sum() > 0  # the 67-token row crossed position 80


@pytest.mark.parametrize("dtype", DTYPES)
def test_ops_compose_to_hf_layer(dtype: torch.dtype) -> None:
    """transformers' whole `Qwen3_5GatedDeltaNet` module, each sequence with its own cache
    (prefill, cached decode, multi-token continuation), against the projections + the
    gated_delta and gated_rms_norm refs over steps that mix the two sequences' pieces as
    decode and extend rows: the interface (conv weight [C, K], [q | k | v] order, heads,
    z and the norm per value head) is the model's."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        vocab_size=100)
    torch.manual_seed(0)
    layer = hf.Qwen3_5GatedDeltaNet(cfg, 0).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(-5.0, 0.5, generator=gen))
            elif name == "dt_bias":
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 - 2.0)
            elif name == "norm.weight":
                p.copy_(1 + torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    layer = layer.to(dtype)
    sh = Shape(hk=2, hv=4, dk=16, dv=16, k=4)
    # per step: (sequence, tokens, decode row?); the steps' rows: decode rows first
    steps = [[(0, 7, False), (1, 5, False)], [(0, 1, True), (1, 2, False)],
             [(1, 1, True), (0, 3, False)], [(0, 1, True), (1, 1, True)]]
    total = [sum(n for step in steps for s, n, _ in step if s == seq) for seq in (0, 1)]
    hidden = [torch.randn(1, t, 64, generator=gen).to(dtype) for t in total]
    caches = [hf.DynamicCache(config=cfg) for _ in (0, 1)]
    conv = torch.zeros(2, sh.c, sh.k - 1, dtype=dtype)
    ssm = torch.zeros(2, sh.hv, sh.dk, sh.dv)
    done = [0, 0]
    w = {name: p.detach() for name, p in layer.named_parameters()}
    for step in steps:
        pieces = [(seq, hidden[seq][0, done[seq]:done[seq] + n]) for seq, n, _ in step]
        x = torch.cat([h for _, h in pieces])
        mixed = F.linear(x, w["in_proj_qkv.weight"])
        z = F.linear(x, w["in_proj_z.weight"])
        a, b = F.linear(x, w["in_proj_a.weight"]), F.linear(x, w["in_proj_b.weight"])
        nd = sum(decode for _, _, decode in step)
        ext = [n for _, n, decode in step if not decode]
        cu = torch.tensor([0, *itertools.accumulate(ext)], dtype=torch.int32)
        i32 = torch.int32
        slots = torch.tensor([seq for seq, _, _ in step], dtype=i32)
        seq_lens = torch.tensor([done[seq] + n for seq, n, _ in step], dtype=i32)
        o = gated_delta_ref(mixed, a, b, w["conv1d.weight"].squeeze(1), w["A_log"],
                            w["dt_bias"], conv, ssm, slots, seq_lens, cu, nd, max(ext, default=1),
                            sh.hk, 16)
        o = gated_rms_norm_ref(o.reshape(-1, sh.dv), z.reshape(-1, sh.dv), w["norm.weight"],
                               cfg.rms_norm_eps)
        ours = F.linear(o.reshape(x.shape[0], -1), w["out_proj.weight"])
        tok = 0
        for seq, h in pieces:
            with torch.no_grad():
                # (the cache by position: transformers renamed the argument in 5.2x)
                want = layer(h[None], caches[seq])[0]
            assert_close(ours[tok:tok + h.shape[0]], want, dtype, f"step {step}, seq {seq}")
            tok += h.shape[0]
            done[seq] += h.shape[0]


@pytest.mark.parametrize("n", [1, 63, 64, 65, 200])
def test_chunked_ref_equals_recurrence(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    h, dk, dv = 3, 16, 8
    q = deltanet_ref.l2norm_ref(torch.randn(n, h, dk, generator=gen)) * dk ** -0.5
    k = deltanet_ref.l2norm_ref(torch.randn(n, h, dk, generator=gen))
    v = torch.randn(n, h, dv, generator=gen)
    g = -torch.rand(n, h, generator=gen) * 2
    beta = torch.rand(n, h, generator=gen)
    s0 = torch.randn(h, dk, dv, generator=gen)
    o1, s1, _ = delta_rule_ref(q, k, v, g, beta, s0)
    for chunk in (64, 16):
        o2, s2 = chunk_delta_rule_ref(q, k, v, g, beta, s0, chunk)
        torch.testing.assert_close(o2, o1, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(s2, s1, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Triton vs the refs
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    """A step's rows: decode rows (slot, seq_len), then extend rows (slot, seq_len, tokens);
    pad_tokens past the rows (an extend graph's padding)."""

    decode: tuple[tuple[int, int], ...] = ()
    extend: tuple[tuple[int, int, int], ...] = ()
    pad_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(n for _, _, n in self.extend) + self.pad_tokens

    def tensors(self, device: str) -> tuple[Tensor, Tensor, Tensor]:
        """(slots, seq_lens, cu_q_lens), int32."""
        slots = [s for s, _ in self.decode] + [s for s, _, _ in self.extend]
        lens = [e for _, e in self.decode] + [e for _, e, _ in self.extend]
        cu = [0]
        for _, _, n in self.extend:
            cu.append(cu[-1] + n)

        def i32(v: list[int]) -> Tensor:
            return torch.tensor(v, dtype=torch.int32, device=device)
        return i32(slots), i32(lens), i32(cu)

    def row_tokens(self) -> Tensor:
        """The tokens that belong to a row (the rest are left unwritten)."""
        return torch.arange(self.num_tokens - self.pad_tokens)


def compare_step(shape: Shape, step: Step, dtype: torch.dtype, device: str, page_size: int,
                 boundary: bool = True, slots: int = 8, seed: int = 0,
                 keep: tuple[int, ...] | None = None, **kw: object) -> None:
    """The Triton op against gated_delta_ref on one step: outputs, both states of every slot,
    the boundary tensors and (keep: each row's entry, -1 none) the kept states (NaN where
    nothing may be written)."""
    layer = make_layer(shape, dtype, slots=slots, seed=seed)
    x, a, b = make_inputs(shape, step.num_tokens, dtype, seed=seed + 1)
    args = [t.to(device) for t in (x, a, b, layer.conv_weight, layer.a_log, layer.dt_bias)]
    idx = step.tensors(device)
    results = []
    kept: list[Keep] = []
    for op in (gated_delta_ref, gated_delta):
        conv, ssm = (t.to(device) for t in layer.clone_states())
        bnd = ((torch.full_like(conv, float("nan")), torch.full_like(ssm, float("nan")))
               if boundary else (None, None))
        extra = dict(kw) if op is gated_delta else {}
        if keep is not None:
            positions = max(n for _, _, n in step.extend)
            kept.append(Keep(torch.tensor(keep, dtype=torch.int32, device=device),
                             *(torch.full((max(keep) + 1, positions, *t.shape[1:]), float("nan"),
                                          dtype=t.dtype, device=device) for t in (conv, ssm))))
            extra["keep"] = kept[-1]
        out = op(*args, conv, ssm, *idx, len(step.decode),
                 max((n for _, _, n in step.extend), default=1), shape.hk, page_size, *bnd,
                 **extra)
        results.append((out, conv, ssm, *bnd))
    (o_r, c_r, s_r, bc_r, bs_r), (o_t, c_t, s_t, bc_t, bs_t) = results
    if kept:
        (ref, got), tol = kept, torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        assert torch.equal(got.conv.isnan(), ref.conv.isnan()), f"kept conv written {step}"
        assert torch.equal(got.ssm.isnan(), ref.ssm.isnan()), f"kept ssm written {step}"
        assert torch.equal(got.conv.nan_to_num(), ref.conv.nan_to_num()), f"kept conv {step}"
        assert_close(got.ssm.nan_to_num().cpu(), ref.ssm.nan_to_num().cpu(), tol,
                     f"kept ssm {step}")
    rows = step.row_tokens().to(device)
    assert_close(o_t[rows].cpu(), o_r[rows].cpu(), dtype, f"out {step}")
    assert torch.equal(c_t, c_r), f"conv state {step}"
    state_tol = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    assert_close(s_t.cpu(), s_r.cpu(), state_tol, f"ssm state {step}")
    if boundary:
        assert bc_t is not None and bc_r is not None and bs_t is not None and bs_r is not None
        assert torch.equal(bc_t.isnan(), bc_r.isnan()) and torch.equal(bs_t.isnan(), bs_r.isnan())
        assert torch.equal(bc_t.nan_to_num(), bc_r.nan_to_num()), f"boundary conv {step}"
        assert_close(bs_t.nan_to_num().cpu(), bs_r.nan_to_num().cpu(), state_tol,
                     f"boundary ssm {step}")


#: decode rows: some land on a page boundary (seq_len a multiple of 4), one padding row
DECODE = Step(decode=((3, 9), (0, 8), (-1, 1), (5, 1), (6, 16)))
#: extend rows of odd lengths from fresh and continued slots: shorter than the conv, crossing
#: no / one / several page boundaries, an empty row, a padding row, padding tokens
EXTEND = Step(extend=((2, 7, 7), (4, 70, 67), (1, 3, 2), (7, 5, 0), (-1, 9, 5), (0, 150, 131)),
              pad_tokens=3)
MIXED = Step(decode=((3, 40), (6, 12)), extend=((0, 21, 1), (5, 100, 35), (1, 64, 64)))
#: EXTEND's kinds of rows, shorter, for the token-by-token recurrence (chunked=False), which the
#: interpreter runs a token at a time: none / one / several page boundaries at page 16
SHORT_EXTEND = Step(extend=((2, 7, 7), (4, 30, 27), (1, 3, 2), (7, 5, 0), (-1, 9, 5),
                            (0, 50, 36)), pad_tokens=3)
#: a verify step (speculative decoding): decode rows, verify rows whose states are kept (one
#: crossing a page boundary of 4, one shorter than the conv), a prompt chunk beside them,
#: padding tokens; VERIFY_KEEP: each row's kept-state entry (-1: none)
VERIFY = Step(decode=((3, 9),), extend=((2, 7, 4), (4, 30, 5), (6, 12, 9), (1, 3, 2)),
              pad_tokens=2)
VERIFY_KEEP = (-1, 0, 2, -1, 1)


def interp_check_deltanet() -> None:
    """Under TRITON_INTERPRET=1: every path of the op against the ref, fp32, and fp16 (the
    model-dtype roundings; NOTE: not bf16: the interpreter truncates fp32 to bf16)."""
    for page_size in (4, 16):
        for step in (DECODE, EXTEND, MIXED):
            compare_step(TINY, step, torch.float32, "cpu", page_size)
    for step in (DECODE, MIXED):
        compare_step(TINY, step, torch.float16, "cpu", 4)
    compare_step(TINY, MIXED, torch.float32, "cpu", 16, boundary=False)
    compare_step(TINY, SHORT_EXTEND, torch.float32, "cpu", 16, chunked=False)
    for chunked in (True, False):
        compare_step(TINY, VERIFY, torch.float32, "cpu", 4, keep=VERIFY_KEEP, chunked=chunked)
    wide = Shape(hk=2, hv=4, dk=32, dv=32)  # two blocks of value columns per head
    compare_step(wide, MIXED, torch.float32, "cpu", 4, block_v=16)
    compare_step(wide, Step(extend=((4, 30, 27), (-1, 9, 5)), pad_tokens=1), torch.float32,
                 "cpu", 16, block_v=16, chunked=False)  # (a page boundary, a padding row)
    compare_step(wide, VERIFY, torch.float16, "cpu", 4, block_v=16, keep=VERIFY_KEEP)
    for step in (DECODE, EXTEND):  # one key head for 3 value heads, conv of 3, dv 24
        compare_step(ODD, step, torch.float32, "cpu", 4)


def interp_check_gated_rms_norm() -> None:
    gen = torch.Generator().manual_seed(5)
    for n, d in ((7, 16), (33, 24)):
        x = torch.randn(n, d, generator=gen)
        z = torch.randn(n, d, generator=gen)
        w = torch.randn(d, generator=gen)
        got, want = gated_rms_norm(x, z, w, 1e-6), gated_rms_norm_ref(x, z, w, 1e-6)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        xs = torch.randn(n, 2 * d, generator=gen)[:, :d]  # strided rows
        torch.testing.assert_close(gated_rms_norm(xs, z, w, 1e-6),
                                   gated_rms_norm_ref(xs, z, w, 1e-6), rtol=1e-6, atol=1e-6)


def test_deltanet_kernels_interpreted() -> None:
    run_interpreter_check("test_kernels_deltanet", "interp_check_deltanet")


def test_gated_rms_norm_interpreted() -> None:
    run_interpreter_check("test_kernels_deltanet", "interp_check_gated_rms_norm")


# ---------------------------------------------------------------------------------------------
# sm_90 builds of what the op launches at Qwen3.5-4B's shapes (no GPU needed)
# ---------------------------------------------------------------------------------------------

#: Qwen3.5-4B's Gated DeltaNet: 16 key heads, 32 value heads, head dims 128, conv kernel 4
QWEN35_4B = Shape(hk=16, hv=32, dk=128, dv=128, k=4)
#: an H100/H200 block's shared memory
SM90_SHARED = 227 * 1024


def _sm90_build(kernel: object, launch: deltanet.Launch, consts: dict[str, object],
                fp32: tuple[str, ...] = ()) -> int:
    """Compile `kernel` for sm_90 with these constexprs (pointers: int32 metadata, fp32 where
    named, the rest bf16): its shared memory in bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)  # type: ignore[attr-defined]
    ints = ("slots_ptr", "seq_lens_ptr", "cu_ptr", "cnt_ptr", "keep_ptr")
    sig: dict[str, str] = {}
    values: dict[tuple[int, ...], object] = {}
    for i, name in enumerate(names):
        if name in consts:
            sig[name], values[(i,)] = "constexpr", consts[name]
        elif name.endswith("_ptr"):
            sig[name] = "*i32" if name in ints else "*fp32" if name in fp32 else "*bf16"
        else:
            sig[name] = "fp32" if name in ("scale", "eps") else "i32"
    built = triton.compile(ASTSource(kernel, sig, values, {}), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": launch.num_warps,
                                    "num_stages": launch.num_stages})
    return int(built.metadata.shared)


def test_kernels_build_for_sm90(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    sh = QWEN35_4B
    heads = {"HK": sh.hk, "G": sh.hv // sh.hk, "DK": sh.dk, "DV": sh.dv, "BK": sh.dk}
    conv = {"K": sh.k, "KP": sh.k}
    state = ("ss_ptr", "bss_ptr", "ks_ptr")
    prep = ("w_ptr", "u_ptr", "qg_ptr", "kd_ptr", "p_ptr", "g_ptr")
    builds = {
        **{f"recurrent {launch}": (deltanet._recurrent_kernel, launch, {
            **heads, **conv, "BV": launch.block_v, "NV": sh.dv // launch.block_v,
            "VARLEN": False, "BOUNDARY": True, "KEEP": False, "PDL": True}, state)
           for launch in (deltanet.DECODE_SMALL, deltanet.DECODE_MID, deltanet.DECODE_LARGE)},
        "recurrent keep": (deltanet._recurrent_kernel, deltanet.DECODE_SMALL, {
            **heads, **conv, "BV": deltanet.DECODE_SMALL.block_v,
            "NV": sh.dv // deltanet.DECODE_SMALL.block_v, "VARLEN": True, "BOUNDARY": True,
            "KEEP": True, "PDL": False}, state),
        "conv": (deltanet._conv_kernel, deltanet.CONV, {
            "K": sh.k, "BT": deltanet.CONV_TOKENS, "BC": deltanet.CONV_CHANNELS}, ()),
        "prep": (deltanet._chunk_prep_kernel, deltanet.PREP, {
            **heads, "BDV": sh.dv, "BT": deltanet.CHUNK, "DOT": deltanet.DOT_PRECISION}, prep),
        "rule": (deltanet._chunk_rule_kernel, deltanet.RULE, {
            **heads, **conv, "BV": deltanet.RULE.block_v, "BT": deltanet.CHUNK,
            "BOUNDARY": True, "DOT": deltanet.DOT_PRECISION}, state + prep),
        "norm": (deltanet._gated_rms_norm_kernel, deltanet.Launch(0, 4), {
            "BR": 16, "BD": sh.dv, "W_FP32": False, "PDL": True}, ()),
    }
    for name, (kernel, launch, consts, fp32) in builds.items():
        shared = _sm90_build(kernel, launch, consts, fp32)
        assert shared <= SM90_SHARED, f"{name}: {shared} bytes of shared memory"


# ---------------------------------------------------------------------------------------------
# GPU: Qwen3.5-4B's shapes
# ---------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def decode_step(batch: int, seed: int) -> Step:
    """batch decode rows on shuffled slots, some landing on a page boundary (seq_len a
    multiple of 16), the last a padding row (slot -1) when batch > 1."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(batch + 4, generator=gen)[:batch].tolist()
    lens = torch.randint(1, 5000, (batch,), generator=gen)
    lens[::3] = lens[::3] // 16 * 16 + 16
    rows = [(s, int(n)) for s, n in zip(slots, lens.tolist(), strict=True)]
    if batch > 1:
        rows[-1] = (-1, 1)
    return Step(decode=tuple(rows))


#: a 4096-token prompt from a fresh slot, continued prompts (one crossing many page
#: boundaries, one a single token), decode rows, padding tokens
GPU_MIXED = Step(decode=((5, 300), (2, 32)),
                 extend=((0, 4096, 4096), (1, 700, 123), (3, 17, 1), (4, 250, 37)),
                 pad_tokens=5)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8, 64])
def test_gpu_decode_qwen35_4b(batch: int) -> None:
    compare_step(QWEN35_4B, decode_step(batch, batch), torch.bfloat16, "cuda", 16,
                 slots=batch + 4)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "recurrent"])
def test_gpu_extend_qwen35_4b(chunked: bool) -> None:
    compare_step(QWEN35_4B, GPU_MIXED, torch.bfloat16, "cuda", 16, chunked=chunked)


@needs_cuda
@pytest.mark.gpu
def test_gpu_verify_rows_keep_their_states_qwen35_4b() -> None:
    """Verify rows of 5 tokens keeping each token's state (one crossing a page boundary)
    beside a decode row and a prompt chunk."""
    step = Step(decode=((5, 300),), extend=((0, 35, 5), (1, 700, 5), (3, 90, 40), (2, 19, 5)),
                pad_tokens=3)
    compare_step(QWEN35_4B, step, torch.bfloat16, "cuda", 16, keep=(-1, 0, 3, -1, 1))


@needs_cuda
@pytest.mark.gpu
def test_gpu_fp32_with_ieee_dots(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 data and IEEE dots: the kernels agree with the ref to fp32 rounding (the TF32
    default is the only approximation of the bf16 tests above)."""
    monkeypatch.setattr(deltanet, "DOT_PRECISION", "ieee")
    compare_step(QWEN35_4B, GPU_MIXED, torch.float32, "cuda", 16)
    compare_step(QWEN35_4B, decode_step(64, 3), torch.float32, "cuda", 16, slots=68)


def check_graph_replay(sh: Shape, step: Step, dtype: torch.dtype, device: str,
                       record: Callable[[Callable[[], Tensor]], tuple[Any, Tensor]]) -> None:
    """The op recorded once (`record`: a CUDA graph's capture) on static buffers; each replay
    with new inputs, slots (the same rows and tokens) and states follows the ref."""
    layer = make_layer(sh, dtype, slots=16, seed=7)
    static = [t.to(device) for t in make_inputs(sh, step.num_tokens, dtype)]
    weights = [t.to(device) for t in (layer.conv_weight, layer.a_log, layer.dt_bias)]
    conv, ssm = (t.to(device) for t in layer.clone_states())
    bc, bs = torch.zeros_like(conv), torch.zeros_like(ssm)
    idx = [t.clone() for t in step.tensors(device)]
    nd, mq = len(step.decode), max((n for _, _, n in step.extend), default=1)

    def run() -> Tensor:
        return gated_delta(*static, *weights, conv, ssm, *idx, nd, mq, sh.hk, 16, bc, bs)

    graph, out = record(run)
    rows = step.row_tokens().to(device)
    for seed in (1, 2):
        new = [t.to(device) for t in make_inputs(sh, step.num_tokens, dtype, seed=seed + 10)]
        fresh = make_layer(sh, dtype, slots=16, seed=seed + 20)
        for dst, src in zip([*static, conv, ssm], [*new, fresh.conv_state, fresh.ssm_state],
                            strict=True):
            dst.copy_(src)
        perm = torch.randperm(16, generator=torch.Generator().manual_seed(seed)).tolist()
        idx[0].copy_(torch.tensor([perm[s] if s >= 0 else -1 for s in idx[0].tolist()]))
        c_ref, s_ref = conv.clone(), ssm.clone()
        bc_ref, bs_ref = torch.zeros_like(bc), torch.zeros_like(bs)
        want = gated_delta_ref(*new, *weights, c_ref, s_ref, *idx, nd, mq, sh.hk, 16, bc_ref,
                               bs_ref)
        bc.zero_()
        bs.zero_()
        graph.replay()
        assert_close(out[rows].cpu(), want[rows].cpu(), dtype, f"replay {seed}")
        assert torch.equal(conv, c_ref) and torch.equal(bc, bc_ref)
        assert_close(ssm.cpu(), s_ref.cpu(), dtype, "ssm")
        assert_close(bs.cpu(), bs_ref.cpu(), dtype, "boundary ssm")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("step", [decode_step(8, 1), GPU_MIXED], ids=["decode", "mixed"])
def test_gpu_cuda_graph_replay(step: Step) -> None:
    check_graph_replay(QWEN35_4B, step, torch.bfloat16, "cuda", capture)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 4096])
def test_gpu_gated_rms_norm(t: int) -> None:
    """Qwen3.5-4B's [T * 32 heads, 128] in bf16: the ref's value, or up to two bf16 ulps from it
    on at most 1% of the elements (the ref rounds to bf16 three times, as transformers does: a
    normalised value one ulp apart, times weight and gate, ends up to one more ulp apart)."""
    gen = torch.Generator(device="cuda").manual_seed(t)
    n, d = t * 32, 128
    x = (torch.randn(n, d, device="cuda", generator=gen) * 2).bfloat16()
    z = torch.randn(n, d, device="cuda", generator=gen).bfloat16()
    w = (torch.rand(d, device="cuda", generator=gen) + 0.5).bfloat16()
    got, want = gated_rms_norm(x, z, w, 1e-6), gated_rms_norm_ref(x, z, w, 1e-6)
    diff = (got.float() - want.float()).abs()
    two_ulps = want.float().abs().clamp_min(1e-30) * 2.0 ** -6
    assert (diff <= two_ulps).all(), diff.max()
    assert (diff > 0).float().mean() <= 0.01
