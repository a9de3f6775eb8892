"""One decoder skeleton for every family: Llama, Qwen2/3, Qwen3-MoE, Qwen3.5.

Each layer is a token mixer (attention, or a Gated DeltaNet layer where `layer_types` says so)
and an MLP (dense, or experts where `ModelConfig.is_moe`), chosen per layer index from the
config; a family is its config fields, not a copy of this file. The model sees a flat batch of
tokens (prefill chunks and decode rows mixed); attention reads and writes the paged KV cache,
and Gated DeltaNet its request's state slot, through the backend the executor passes in.
"""

from __future__ import annotations

import torch
from torch import nn

from arle.model.config import ModelConfig
from arle.model.deltanet import GatedDeltaNet
from arle.model.layers import MLP, Attention, AttentionBackend, RMSNorm
from arle.model.moe import SparseMoE
from arle.model.parallel import SINGLE, ReplicatedLinear, TPGroup, VocabParallelEmbedding
from arle.model.rope import RotaryEmbedding
from arle_kernels.ops import REFERENCE, Ops
from arle_kernels.split_sums import SplitSums


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


def make_mixer(cfg: ModelConfig, layer: int, tp: TPGroup) -> nn.Module:
    """The layer's token mixer: attention, or Gated DeltaNet where `layer_types` says so."""
    if cfg.is_linear(layer):
        return GatedDeltaNet(cfg, layer, tp)
    return Attention(cfg, layer, tp)


def make_mlp(cfg: ModelConfig, layer: int, tp: TPGroup) -> nn.Module:
    """The layer's MLP: dense, or experts where `cfg.is_moe(layer)`."""
    if cfg.is_moe(layer):
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


class MTPHead(nn.Module):
    """Qwen3.5's multi-token prediction head (checkpoint `mtp.*`), the drafter of
    `--speculative mtp`. At position p it reads the model's final hidden state h_p and the
    embedding of the token at p + 1, and gives the hidden state whose logits (the model's
    lm_head) predict the token at p + 2:
        x = fc([norm_e(embed(t_{p+1})) | norm_h(h_p)]); x = layer(x); out = norm(x)
    `layer` is a full-attention decoder layer with its own KV cache entry (the last). Chained,
    its output stands for h and its prediction for the token, one position further."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        h, eps, zc = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_zero_centered
        self.fc = ReplicatedLinear(2 * h, h)
        self.pre_fc_norm_embedding = RMSNorm(h, eps, zc)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, zc)
        # NOTE: built as the last full-attention layer (its MLP's kind), writing KV entry
        # `len(attention_layers)`, past the model's
        layer = DecoderLayer(cfg, cfg.attention_layers[-1], tp)
        assert isinstance(layer.mixer, Attention)
        layer.mixer.layer = len(cfg.attention_layers)
        self.layers = nn.ModuleList([layer])
        self.norm = RMSNorm(h, eps, zc)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, backend: AttentionBackend,
                ops: Ops) -> torch.Tensor:
        """The next tokens' embeddings [T, H] and the hidden states [T, H] at their positions
        (the backend's) -> the head's hidden states [T, H], after its norm."""
        e = ops.rms_norm(embeds, self.pre_fc_norm_embedding.weight, self.pre_fc_norm_embedding.eps)
        h = ops.rms_norm(hidden, self.pre_fc_norm_hidden.weight, self.pre_fc_norm_hidden.eps)
        x, residual = self.layers[0](self.fc(torch.cat([e, h], dim=-1)), None, backend, ops)
        return ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]


class DecoderLM(nn.Module):
    """Token ids at positions -> hidden states; `logits()` projects only the rows that sample."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        #: the activations' dtype (the default dtype it is built under: integer or FP8 weights
        #: may hold another)
        self.dtype = torch.get_default_dtype()
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
        #: Qwen3.5's multi-token prediction head, where it runs (`ModelConfig.with_mtp`)
        self.mtp = MTPHead(cfg, tp) if cfg.with_mtp else None
        #: The kernels (`ops_for` its device: set on loading and by the executor).
        self.ops: Ops = REFERENCE

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, backend: AttentionBackend,
                id_source: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden]. Positions live in the backend.
        id_source: the ids are id_source[input_ids] (the CUDA decode graphs pass their rows'
        slots and the token buffer: the embedding kernel reads the ids there itself)."""
        x: torch.Tensor | SplitSums = self.embed(input_ids, id_source)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(x, residual, backend, self.ops)
        assert residual is not None
        return self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def embed(self, input_ids: torch.Tensor, id_source: torch.Tensor | None = None
              ) -> torch.Tensor | SplitSums:
        """The tokens' embeddings (with TP, this rank's part to be summed: SplitSums)."""
        return self.embed_tokens.lookup(self.ops.embed, input_ids, id_source)

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
        y = self.ops.linear(hidden, self.lm_head.weight, None)
        return y.float() if upcast else y

    def checkpoint_names(self) -> dict[int, list[str]]:
        """id(parameter) -> the checkpoint names it loads (`weight_targets` inverted)."""
        names: dict[int, list[str]] = {}
        for name, (param, _) in self.weight_targets().items():
            names.setdefault(id(param), []).append(name)
        return names

    def weight_targets(self) -> dict[str, tuple[nn.Parameter, str | int | None]]:
        """Checkpoint (HF) tensor name -> (parameter, shard id) it loads into.

        A parameter's checkpoint name is its own (under `model.`, but lm_head), except in a
        module that says otherwise: `HF_SHARDS` (a merged projection loads several of the
        checkpoint's, each as a shard) or `hf_weights(prefix)` (any other mapping, e.g. experts
        stored one by one)."""
        out: dict[str, tuple[nn.Parameter, str | int | None]] = {}
        claimed: set[int] = set()

        def hf(name: str) -> str:
            return name if name.startswith(("lm_head", "mtp.")) else f"model.{name}"

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
