"""One decoder skeleton for every family: Llama, Qwen2/3, Qwen3-MoE, Qwen3.5.

Each layer is a token mixer (attention, or a Gated DeltaNet layer where `layer_types` says so)
and an MLP (dense, or experts where `ModelConfig.is_moe`), chosen per layer index from the
config; a family is its config fields, not a copy of this file. The model sees a flat batch of
tokens (prefill chunks and decode rows mixed); attention reads and writes the paged KV cache,
and Gated DeltaNet its request's state slot, through the backend the executor passes in.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch
from torch import nn

from arle.model.config import ModelConfig
from arle.model.parallel import (
    SINGLE,
    MergedColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    linear,
    linear_silu_and_mul,
)
from arle.model.rope import RotaryEmbedding
from arle_kernels.ops import REFERENCE, Ops
from arle_kernels.split_sums import SplitSums

#: merged projection -> the checkpoint's projections it holds, as (name, shard id)
HFShards = dict[str, tuple[tuple[str, "str | int"], ...]]


class AttentionBackend(Protocol):
    """One step's attention, set up by the executor: q/k norms and rotary at the step's
    positions, this step's K/V into the paged cache, then attention over each row's pages.
    `layer` is the layer's index among the full-attention layers (its KV cache entry)."""

    #: the model's kernels (a mixer's glue beside what the backend does: the gated norm)
    ops: Ops

    def attend(self, layer: int, qkv: torch.Tensor | SplitSums, q_norm: torch.Tensor | None,
               k_norm: torch.Tensor | None) -> torch.Tensor:
        """qkv [T, (H + 2 KVH) * D] (or its SplitSums) -> attention output [T, H * D]."""
        ...

    def gated_delta(self, layer: int, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    conv_weight: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
                    ) -> torch.Tensor:
        """A Gated DeltaNet layer's recurrence over this step's rows (`layer`: its index among
        the linear layers, its entry in each request's state slot): the causal conv of
        mixed_qkv [T, conv_dim] continuing the slot's conv state, SiLU, q/k L2-normalised,
        beta = sigmoid(b), g = -exp(a_log) * softplus(a + dt_bias) (a, b [T, value heads]),
        and the delta rule from the slot's recurrent state. Leaves both states at each row's
        end. -> [T, value heads * value head dim], in mixed_qkv's dtype."""
        ...


class RMSNorm(nn.Module):
    """A weight holder: the norm itself is `ops.rms_norm` / `ops.add_rms_norm` (fp32 statistics,
    scaled in the model dtype, as HF Llama/Qwen do).

    zero_centered (Qwen3.5): checkpoints store w and the norm scales by 1 + w in fp32 with one
    rounding at the end (HF's Qwen3_5RMSNorm). The weight holds 1 + w, made at load, in fp32:
    the ops scale by an fp32 weight in fp32 before they round (arle_kernels.fused)."""

    def __init__(self, dim: int, eps: float, zero_centered: bool = False) -> None:
        super().__init__()
        self.eps = eps
        dtype = torch.float32 if zero_centered else None  # None: the model's (default) dtype
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        if zero_centered:
            self.weight.weight_loader = load_one_plus  # type: ignore[attr-defined]


def load_one_plus(param: nn.Parameter, loaded: torch.Tensor, shard: str | int | None = None
                  ) -> None:
    """A zero-centred norm's checkpoint weight w in as 1 + w (fp32, as HF's `1.0 + w.float()`)."""
    if loaded.shape != param.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(1.0 + loaded.float())


def kv_replicas(num_kv_heads: int, tp: int) -> dict[str | int, int]:
    """Ranks sharing each KV head where there are fewer KV heads than ranks (each rank keeps
    one: `tp / kv_heads` ranks hold the same), for the k and v projections."""
    n = tp // num_kv_heads if num_kv_heads < tp else 1
    return {"k": n, "v": n}


def tp_problems(cfg: ModelConfig, tp: int) -> list[str]:
    """What does not split over `tp` ranks (empty: the model splits)."""
    if tp == 1:
        return []
    sizes = {"num_attention_heads": cfg.num_heads, "intermediate_size": cfg.intermediate_size}
    if cfg.moe is not None:
        sizes["moe_intermediate_size"] = cfg.moe.intermediate_size
        if cfg.moe.shared_expert_intermediate_size:
            sizes["shared_expert_intermediate_size"] = cfg.moe.shared_expert_intermediate_size
    la = cfg.linear_attention
    if la is not None and cfg.linear_layers:
        sizes["linear_num_key_heads"] = la.num_key_heads
        sizes["linear_num_value_heads"] = la.num_value_heads
    out = [f"{name} {n} does not divide by {tp}" for name, n in sizes.items() if n % tp]
    kvh = cfg.num_kv_heads
    if cfg.attention_layers and (kvh % tp if kvh >= tp else tp % kvh):
        out.append(f"num_key_value_heads {kvh} neither divides by {tp} nor divides it")
    return out


class QKVGateLinear(MergedColumnParallelLinear):
    """Gated attention's q, k, v and output gate in one GEMM, each row [q | k | v | gate]: the
    backend reads q, k, v as one block of the row, the gate follows. The checkpoint's q_proj
    (shard "q") holds query and gate interleaved per head ([heads, 2, head_dim] rows, HF's
    `view(..., -1, head_dim * 2).chunk(2)`): its loader takes them apart."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool, tp: TPGroup) -> None:
        self.head_dim = head_dim
        super().__init__(hidden, {"q": num_heads * head_dim, "k": num_kv_heads * head_dim,
                                  "v": num_kv_heads * head_dim, "gate": num_heads * head_dim},
                         bias=bias, tp=tp, replicas=kv_replicas(num_kv_heads, tp.size))

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor,
                   shard: str | int | None = None) -> None:
        if shard != "q":
            return super().load_shard(param, loaded, shard)
        d = self.head_dim
        if loaded.shape[0] % (2 * d):
            raise ValueError(f"q_proj with {loaded.shape[0]} rows is not query | gate per head")
        pairs = loaded.reshape(-1, 2, d, *loaded.shape[1:])  # [heads, (query, gate), D, ...]
        for i, key in enumerate(("q", "gate")):
            super().load_shard(param, pairs[:, i].reshape(-1, *loaded.shape[1:]), key)

    def load_scale(self, param: nn.Parameter, loaded: torch.Tensor,
                   shard: str | int | None = None) -> None:
        """An FP8 q_proj's scale grid, taken apart as its rows are: whole blocks of a head's
        query rows, then of its gate rows (a block straddling the two cannot be split)."""
        if shard != "q":
            return super().load_scale(param, loaded, shard)
        assert self.ckpt_block is not None
        bn, d = self.ckpt_block[0], self.head_dim
        if d % bn or loaded.dim() != 2 or loaded.shape[0] % (2 * d // bn):
            raise ValueError(f"q_proj's scale grid {tuple(loaded.shape)} does not split into "
                             f"query and gate blocks (head dim {d}, blocks of {bn} rows)")
        pairs = loaded.reshape(-1, 2, d // bn, loaded.shape[1])
        for i, key in enumerate(("q", "gate")):
            super().load_scale(param, pairs[:, i].reshape(-1, loaded.shape[1]), key)


class Attention(nn.Module):
    """Full attention over the paged KV cache; with `attn_output_gate` (Qwen3.5) the query
    projection also gives a gate per head: o_proj(attention * sigmoid(gate))."""

    HF_SHARDS: ClassVar[HFShards] = {"qkv_proj": (("q_proj", "q"), ("k_proj", "k"),
                                                  ("v_proj", "v"))}

    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup) -> None:
        super().__init__()
        #: NOTE: the KV cache's entry: the layer's index among the full-attention layers
        self.layer = cfg.attention_layers.index(layer)
        self.num_heads = cfg.num_heads // tp.size
        self.num_kv_heads = max(1, cfg.num_kv_heads // tp.size)
        self.head_dim = cfg.head_dim
        d = cfg.head_dim
        self.gated = cfg.attn_output_gate
        self.qkv_width = (self.num_heads + 2 * self.num_kv_heads) * d  # this rank's q, k, v
        self.qkv_proj = (
            QKVGateLinear(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, d,
                          cfg.attention_bias, tp) if self.gated else
            MergedColumnParallelLinear(
                cfg.hidden_size,
                {"q": cfg.num_heads * d, "k": cfg.num_kv_heads * d, "v": cfg.num_kv_heads * d},
                bias=cfg.attention_bias, tp=tp, replicas=kv_replicas(cfg.num_kv_heads, tp.size)))
        # Llama/Qwen3 `attention_bias` covers o_proj too; Qwen2's q/k/v biases do not.
        o_bias = cfg.attention_bias and cfg.architecture != "Qwen2ForCausalLM"
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, bias=o_bias, tp=tp)
        zc = cfg.norm_zero_centered
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, zc) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, zc) if cfg.qk_norm else None

    def qk_norm_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The per-head q / k RMSNorm weights (Qwen3), or None, None."""
        return (self.q_norm.weight if self.q_norm is not None else None,
                self.k_norm.weight if self.k_norm is not None else None)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor | SplitSums, torch.Tensor | None]:
        """(q | k | v [T, qkv_width] for `backend.attend`, the output gate [T, H * D] or
        None). NOTE: ungated, qkv may stay split sums: the backend's q/k norm + rope adds them
        up (arle_kernels.split_sums); gated, both are column slices of one GEMM's output."""
        if not self.gated:
            return self.qkv_proj.forward_unreduced(x), None
        y = self.qkv_proj(x)
        return y[:, :self.qkv_width], y[:, self.qkv_width:]

    def forward(self, x: torch.Tensor, backend: AttentionBackend) -> torch.Tensor | SplitSums:
        # NOTE: the output may stay split sums: the next add_rms_norm adds them up
        qkv, gate = self.project(x)
        attn = backend.attend(self.layer, qkv, *self.qk_norm_weights())
        if gate is not None:  # in the model's dtype, as HF: sigmoid rounded, then the product
            attn = attn * torch.sigmoid(gate)
        return self.o_proj.forward_unreduced(attn)


class MLP(nn.Module):
    HF_SHARDS: ClassVar[HFShards] = {"gate_up_proj": (("gate_proj", 0), ("up_proj", 1))}

    def __init__(self, cfg: ModelConfig, tp: TPGroup, intermediate_size: int | None = None
                 ) -> None:
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, {0: inter, 1: inter}, tp=tp)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, tp=tp)

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor | SplitSums:
        return self.down_proj.forward_unreduced(linear_silu_and_mul(x, self.gate_up_proj.weight,
                                                                    ops.silu_and_mul))


def make_mixer(cfg: ModelConfig, layer: int, tp: TPGroup) -> nn.Module:
    """The layer's token mixer: attention, or Gated DeltaNet where `layer_types` says so."""
    if cfg.is_linear(layer):
        from arle.model.deltanet import GatedDeltaNet

        return GatedDeltaNet(cfg, layer, tp)
    return Attention(cfg, layer, tp)


def make_mlp(cfg: ModelConfig, layer: int, tp: TPGroup) -> nn.Module:
    """The layer's MLP: dense, or experts where `cfg.is_moe(layer)`."""
    if cfg.is_moe(layer):
        from arle.model.moe import SparseMoE

        return SparseMoE(cfg, tp)
    return MLP(cfg, tp)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPGroup) -> None:
        super().__init__()
        zc = cfg.norm_zero_centered
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zc)
        # NOTE: named as the checkpoints name them (`self_attn` / `linear_attn`), so the
        # parameter names are the checkpoint's
        mixer = make_mixer(cfg, layer, tp)
        self.is_linear = cfg.is_linear(layer)
        if self.is_linear:
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zc)
        self.mlp = make_mlp(cfg, layer, tp)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if self.is_linear else self.self_attn

    def forward(self, x: torch.Tensor | SplitSums, residual: torch.Tensor | None,
                backend: AttentionBackend, ops: Ops) -> tuple[torch.Tensor | SplitSums, torch.Tensor]:
        """(x, residual) -> (this layer's MLP output, the residual stream before it).

        NOTE: the residual add is fused into the next norm (`ops.add_rms_norm`): the stream is
        x + residual, rounded to the model dtype, exactly as `h = h + f(h)` in HF's code."""
        norm = self.input_layernorm
        if residual is None:
            assert isinstance(x, torch.Tensor), "the first layer takes the embeddings"
            residual, h = x, ops.rms_norm(x, norm.weight, norm.eps)
        else:
            h, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        h = self.mixer(h, backend)
        norm = self.post_attention_layernorm
        h, residual = ops.add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(h, ops), residual


class DecoderLM(nn.Module):
    """Token ids at positions -> hidden states; `logits()` projects only the rows that sample."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        #: the config as this rank holds it: its share of the heads (the KV cache, the state
        #: pool and the attention backend are sized by it)
        self.rank_config = cfg.shard(tp.size)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_zero_centered)
        # NOTE: partial rotary (Qwen3.5) turns the first rotary_dim dims of each head only
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        self.lm_head = (self.embed_tokens if cfg.tie_word_embeddings
                        else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp))
        #: The kernels (`ops_for` its device: set on loading and by the executor).
        self.ops: Ops = REFERENCE

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, backend: AttentionBackend,
                id_source: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden]. Positions live in the backend.
        id_source: the ids are id_source[input_ids] (the CUDA decode graphs pass their rows'
        slots and the token buffer: the embedding kernel reads the ids there itself)."""
        x: torch.Tensor | SplitSums = self.embed_tokens.lookup(self.ops.embed, input_ids,
                                                               id_source)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(x, residual, backend, self.ops)
        assert residual is not None
        return self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def rotary_table(self, max_positions: int) -> torch.Tensor:
        """cos | sin for positions [0, max_positions): [max_positions, rotary_dim] float32 (the
        rotary_dim / 2 pairs of the rotated dims), the table `ops.qk_norm_rope_store_kv`
        reads."""
        cos, sin = self.rotary.cos_sin(torch.arange(max_positions,
                                                    device=self.rotary.inv_freq.device))
        return torch.cat([cos, sin], dim=-1).contiguous()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, *, upcast: bool = True) -> torch.Tensor:
        """lm_head(hidden): fp32, or (upcast=False) in the model's dtype, for a consumer that
        upcasts only what it needs (the CUDA decode graphs: the greedy pick reads bf16).
        NOTE: with TP, this rank's vocabulary range only (`TPGroup.gather_columns`)."""
        y = linear(hidden, self.lm_head.weight)
        return y.float() if upcast else y

    def weight_targets(self) -> dict[str, tuple[nn.Parameter, str | int | None]]:
        """Checkpoint (HF) tensor name -> (parameter, shard id) it loads into.

        A parameter's checkpoint name is its own (under `model.`, but lm_head), except in a
        module that says otherwise: `HF_SHARDS` (a merged projection loads several of the
        checkpoint's, each as a shard) or `hf_weights(prefix)` (any other mapping, e.g. experts
        stored one by one)."""
        out: dict[str, tuple[nn.Parameter, str | int | None]] = {}
        claimed: set[int] = set()

        def hf(name: str) -> str:
            return name if name.startswith("lm_head") else f"model.{name}"

        for mod_name, module in self.named_modules():
            prefix = f"{mod_name}." if mod_name else ""
            custom = getattr(module, "hf_weights", None)
            if custom is not None:
                for key, (param, shard) in custom(hf(prefix)).items():
                    out[key] = (param, shard)
                    claimed.add(id(param))
            for merged, shards in getattr(module, "HF_SHARDS", {}).items():
                for kind, param in getattr(module, merged).named_parameters():
                    for theirs, shard in shards:
                        out[hf(f"{prefix}{theirs}.{kind}")] = (param, shard)
                    claimed.add(id(param))
        for name, p in self.named_parameters():
            if id(p) not in claimed:
                out[hf(name)] = (p, None)
        if self.config.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        return out
