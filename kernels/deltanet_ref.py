"""Gated DeltaNet (Qwen3.5's linear-attention layers) in plain torch: the CPU executor's,
the references kernels/deltanet.py's kernels are tested against, and the speculative verify
rows' kept states (`Keep`) both executors share. kernels/deltanet.py's docstring gives the
math."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

#: transformers' `l2norm` epsilon for q and k
L2_EPS = 1e-6


@dataclass(frozen=True)
class Keep:
    """Rows whose state after each of their tokens is kept (speculative decoding's verify rows:
    the state at the last accepted draft is restored from here): `entries` [R] int32, each
    row's entry in the buffers (-1: none; decode rows have none); `conv` [E, P, C, K-1] and
    `ssm` [E, P, Hv, dk, dv] fp32, the state after the row's token i at [entry, i]. The slot's
    state still ends at the row's end. `others`: the step's slots with the kept rows' at -1,
    what the other launches run (None: made here; a step makes it once for all its layers)."""

    entries: Tensor
    conv: Tensor
    ssm: Tensor
    others: Tensor | None = None


def kept_out(slots: Tensor, entries: Tensor) -> Tensor:
    """The slots with those of rows that keep their states (entries >= 0) at -1."""
    return torch.where(entries >= 0, -1, slots)


def row_spans(num_tokens: int, num_decode: int, cu_q_lens: list[int]) -> list[tuple[int, int]]:
    """Each row's (first token, token count): decode row i is token i; extend row j's tokens
    are num_decode + cu_q_lens[j] .. num_decode + cu_q_lens[j + 1]."""
    spans = [(i, 1) for i in range(num_decode)]
    spans += [(num_decode + s, e - s) for s, e in itertools.pairwise(cu_q_lens)]
    assert all(s + n <= num_tokens for s, n in spans), "rows past the tokens"
    return spans


def l2norm_ref(x: Tensor) -> Tensor:
    """transformers' `l2norm` over the last dim (fp32 in, fp32 out)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def conv_silu_ref(seq: Tensor, weight: Tensor, n: int) -> Tensor:
    """The last n outputs of the causal depthwise conv over seq [C, K-1+n] (model dtype) with
    weight [C, K], then SiLU: [C, n] in seq's dtype (sum in fp32, rounded; SiLU rounded)."""
    k = weight.shape[1]
    s, w = seq.float(), weight.float()
    acc = torch.zeros(seq.shape[0], n, dtype=torch.float32, device=seq.device)
    for j in range(k):
        acc += w[:, j:j + 1] * s[:, j:j + n]
    return F.silu(acc.to(seq.dtype).float()).to(seq.dtype)


def gates_ref(a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """(g, beta), fp32: g = -exp(a_log) * softplus(a + dt_bias), beta = sigmoid(b) in b's dtype."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.sigmoid().float()


def delta_rule_ref(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                   snap_at: int = 0) -> tuple[Tensor, Tensor, Tensor | None]:
    """The gated delta rule token by token, fp32: q, k [n, H, dk] (already normed, scaled and
    repeated to the value heads), v [n, H, dv], g, beta [n, H], state [H, dk, dv] (not
    modified). -> (o [n, H, dv], the state at the end, the state after the first snap_at
    tokens (None when snap_at is 0))."""
    s = state.clone()
    out = torch.empty_like(v)
    snap = None
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        kv = torch.einsum("hk,hkv->hv", k[t], s)
        delta = (v[t] - kv) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t], s)
        if t + 1 == snap_at:
            snap = s.clone()
    return out, s, snap


def chunk_delta_rule_ref(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                         state: Tensor, chunk: int = 64) -> tuple[Tensor, Tensor]:
    """`delta_rule_ref` (no snapshot) in chunks of `chunk` tokens, fp32: within a chunk the
    updates are solved at once (the UT transform: (I + tril(diag(beta) K K^T * decay, -1))^-1),
    then one state read and one state update per chunk. The same function as the recurrence up
    to fp32 rounding; many times faster for long rows."""
    n = k.shape[0]
    out = torch.empty_like(v)
    s = state.clone()
    for c0 in range(0, n, chunk):
        c1 = min(c0 + chunk, n)
        qc, kc, vc = (x[c0:c1].transpose(0, 1) for x in (q, k, v))  # [H, L, d]
        bc, gc = beta[c0:c1].T, g[c0:c1].T.cumsum(-1)  # [H, L]
        decay = (gc[:, :, None] - gc[:, None, :]).tril().exp().tril()  # [H, L, L], i >= j
        kk = (bc[:, :, None] * (kc @ kc.transpose(1, 2))) * decay
        eye = torch.eye(c1 - c0, device=q.device)
        a = eye + kk.tril(-1)
        # u = A^-1 (beta v - beta exp(G) K S): each token's correction, the state read folded in
        rhs = bc[:, :, None] * (vc - (gc.exp()[:, :, None] * kc) @ s)
        u = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
        out[c0:c1] = ((gc.exp()[:, :, None] * qc) @ s
                      + ((qc @ kc.transpose(1, 2)) * decay) @ u).transpose(0, 1)
        last = gc[:, -1:]
        s = s * last.exp()[:, :, None] + (kc * (last - gc).exp()[:, :, None]).transpose(1, 2) @ u
    return out, s


#: pieces of rows of at least this many tokens run `chunk_delta_rule_ref` in the reference,
#: shorter ones the recurrence (token by token: fast enough for a decode step)
REF_CHUNK_MIN = 64


def gated_delta_ref(mixed_qkv: Tensor, a: Tensor, b: Tensor, conv_weight: Tensor,
                    a_log: Tensor, dt_bias: Tensor, conv_state: Tensor, ssm_state: Tensor,
                    slots: Tensor, seq_lens: Tensor, cu_q_lens: Tensor, num_decode: int,
                    max_q_len: int, num_k_heads: int, page_size: int,
                    boundary_conv: Tensor | None = None,
                    boundary_ssm: Tensor | None = None, *, keep: Keep | None = None) -> Tensor:
    """A Gated DeltaNet layer's conv + SiLU + L2 norms + gates + delta rule over a step's rows
    (module docstring), each from and back into its state slot. mixed_qkv [T, C], a, b [T, Hv],
    conv_weight [C, K], a_log, dt_bias [Hv], conv_state [S, C, K-1], ssm_state [S, Hv, dk, dv]
    fp32, slots, seq_lens [R] int32, cu_q_lens [R - num_decode + 1] -> [T, Hv, dv] in
    mixed_qkv's dtype (tokens of no row: 0). keep: rows whose states after each token are kept
    (`Keep`): they run token by token, each token as a one-token row. Reads the lengths on the
    host; max_q_len unused."""
    t, c = mixed_qkv.shape
    hv, (dk, dv), hk = a.shape[1], ssm_state.shape[2:], num_k_heads
    assert c == 2 * hk * dk + hv * dv and hv % hk == 0, (c, hk, hv, dk, dv)
    assert (boundary_conv is None) == (boundary_ssm is None)
    out = mixed_qkv.new_zeros(t, hv, dv)
    g_all, beta_all = gates_ref(a, b, a_log, dt_bias)

    def row(start: int, n: int, slot: int, end: int) -> None:
        snap = 0
        if boundary_ssm is not None:
            p = end // page_size * page_size
            snap = p - (end - n) if p > end - n else 0
        seq = torch.cat([conv_state[slot], mixed_qkv[start:start + n].T.to(conv_state.dtype)], 1)
        x = conv_silu_ref(seq, conv_weight, n).T.float()  # [n, C]
        q = l2norm_ref(x[:, :hk * dk].reshape(n, hk, dk)) * dk ** -0.5
        k = l2norm_ref(x[:, hk * dk:2 * hk * dk].reshape(n, hk, dk))
        q, k = (y.repeat_interleave(hv // hk, 1) for y in (q, k))
        v = x[:, 2 * hk * dk:].reshape(n, hv, dv)
        g, beta = g_all[start:start + n], beta_all[start:start + n]
        state = ssm_state[slot]
        cut = [0, snap, n] if snap else [0, n]
        outs = []
        for i0, i1 in itertools.pairwise(cut):
            rule = chunk_delta_rule_ref if i1 - i0 >= REF_CHUNK_MIN else _recurrent
            o, state = rule(q[i0:i1], k[i0:i1], v[i0:i1], g[i0:i1], beta[i0:i1], state)
            outs.append(o)
            if i1 == snap and boundary_ssm is not None and boundary_conv is not None:
                boundary_ssm[slot] = state
                boundary_conv[slot] = seq[:, snap:snap + seq.shape[1] - n]
        out[start:start + n] = torch.cat(outs).to(out.dtype)
        ssm_state[slot] = state
        conv_state[slot] = seq[:, n:]

    spans = row_spans(t, num_decode, [int(x) for x in cu_q_lens.tolist()])
    entries = keep.entries.tolist() if keep is not None else [-1] * len(spans)
    for (start, n), slot, end, entry in zip(spans, slots.tolist(), seq_lens.tolist(), entries,
                                            strict=True):
        if n == 0 or slot < 0:
            continue
        if entry < 0:
            row(start, n, slot, end)
            continue
        assert keep is not None
        for i in range(n):
            row(start + i, 1, slot, end - n + i + 1)
            keep.conv[entry, i] = conv_state[slot]
            keep.ssm[entry, i] = ssm_state[slot]
    return out


def _recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
               ) -> tuple[Tensor, Tensor]:
    o, s, _ = delta_rule_ref(q, k, v, g, beta, state)
    return o, s


def gated_rms_norm_ref(x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' `Qwen3_5RMSNormGated`: x [N, D] normalised in fp32, rounded to x's dtype,
    times the weight (in the weight's dtype: a model's, so x's), times silu(z) in fp32, rounded
    to x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(x.dtype)
    return (h * F.silu(z.float())).to(x.dtype)
