#!/usr/bin/env python3
"""Write a random-weight Hugging Face model directory with a real Qwen3 shape.

For benchmarks and loader/parity tests on machines with no network (the GPU box): the config is
the real config.json of the named model, the tensors have the exact HF names, shapes and dtype,
and a small byte-level BPE tokenizer (trained here in about a second) stands in for the real one,
with the real special-token ids. Only the weight values (and the text the tokenizer knows) are
fake.

    python scripts/make_random_model.py qwen3-4b /tmp/models/qwen3-4b \\
        [--dtype bfloat16] [--seed 0] [--device cuda] [--shard-gb 4] [--check] [--force]
        [--layers N]

Names: qwen3-0.6b, qwen3-4b, qwen3-8b, and `tiny` (2 layers, hidden 256: quick tests); the
mixture-of-experts Qwen3-30B-A3B (`qwen3-30b-a3b`, experts stored one by one, as released) and
the block-FP8 releases `qwen3-30b-a3b-fp8` (the Instruct-2507-FP8 layout) and `qwen3-4b-fp8`, with
`tiny-moe` / `tiny-moe-fp8` at test size; the 4-bit `qwen3-4b-awq` (Qwen's -AWQ layout), with
`tiny-awq`; the hybrid Qwen3.5 models `qwen3.5-0.8b`,
`qwen3.5-4b`, `qwen3.5-9b`, with `tiny-qwen3.5` at test size.

Qwen3.5 (Gated DeltaNet + gated attention): the published layout, `Qwen3_5ForConditionalGeneration`
with the text config under `text_config` (the fields of the released config.json files: 3 linear
layers then a full one, head dim 256 with a quarter rotating, rope theta 1e7, linear attention of
16 key heads of 128 and 16 or 32 value heads) and the text weights under
`model.language_model.*`, and the multi-token prediction head's under `mtp.*` as released
(`--speculative mtp` drafts with it; transformers skips them). The vision tower's weights are not
written (a text engine does not read them), only its `vision_config`. Qwen3.5's vocabulary (248320) and special ids (<|endoftext|> 248044,
<|im_start|> 248045, <|im_end|> 248046). Its zero-centred norms (x * (1 + w)) get w =
0.1*N(0,1); A_log and dt_bias transformers' initialisation (log U(0.01, 16), ones).

FP8 (the Qwen FP8 releases' format): every linear weight but lm_head and the routers' gates is
float8_e4m3fn with `weight_scale_inv` fp32 [ceil(N/128), ceil(K/128)] beside it. Each block's
scale is a power of two (1, 2 or 4 times the smallest that holds 4.5 std of the weight), drawn
per block: the real weights keep their N(0, 1/fan_in) spread, a kernel that reads the wrong
block's scale shows, and any dequantisation (transformers' included) is exact. --dtype is the
dtype of the unquantized tensors.

Weights (why these scales): linear weights are N(0, 1/fan_in) (std 0.0198 for Qwen3-4B's q_proj:
the usual 0.02 at these sizes, but it keeps `tiny` from going flat), so every projection keeps its
input's scale and each layer's attention and MLP visibly move the residual stream: logits depend
on the whole context, not only on the last token (which matters for catching attention bugs). The
embedding and lm_head are N(0, (3/sqrt(hidden))^2), so the final-normed hidden state (rms ~1)
gives logits with a std of ~3 over the vocab (the 0.02 init would give ~1 for Qwen3-4B): a mean
top-1/top-2 gap of 0.6-1.2 instead of ~0.2, and a softmax less flat than noise, though far flatter
than a trained model's. Norm weights are 1 + 0.1*N(0,1) (positive, not the identity, so a loader
that skipped them would show). `--check` measures these with a transformers forward, including
how often transformers' own bf16 and fp32 forwards agree on the top-1 token: that, not the logit
scale, bounds greedy agreement between a bf16 engine and a reference (bf16 rounding perturbs the
hidden state by a few percent of its size, and the logits move with it). Compare engines on
teacher-forced logits (max |diff|, top-k overlap, KL) and against that ceiling.
Measured on the H200 (transformers 5.17, 4 x 64 random ids): logit std 3.0, mean top-2 gap 0.57
(8B) to 0.91 (4B), top-1 probability 6-10%, bf16-vs-fp32 top-1 agreement 94-96%.

Each tensor is drawn from its own generator, seeded from (--seed, tensor name): the weights do not
depend on the shard layout or the order of writing, but CPU and CUDA generators differ, so the
same seed gives different weights on --device cpu and --device cuda.

Speed: tensors are drawn on --device, copied to the host one at a time and streamed into the
safetensors files by one thread per shard (the format is an 8-byte header length, a JSON header
and the raw bytes, so no second host copy is needed). The tokenizer is trained on the running
interpreter's standard-library sources: it differs between Python versions, which only changes
how text is split, never the model's shapes or special ids. It knows ~16k ids: the rest of the
151936 (which a random model generates freely) decode to nothing. Qwen3-8B (16.4 GB) takes ~14 s
to write on the H200 box, ~20 s with interpreter start-up.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import sysconfig
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

VOCAB_SIZE = 151936
#: Qwen's special tokens, at their real ids (the real vocab has 151643 BPE tokens before them).
SPECIAL_TOKENS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
BOS_ID, EOS_ID = 151643, 151645

#: Qwen3.5's vocabulary and special tokens (its tokenizer has 248077 ids; the embedding 248320).
QWEN3_5_VOCAB_SIZE = 248320
QWEN3_5_SPECIAL_TOKENS = {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046}

#: Fields shared by the real Qwen3 config.json files (Qwen/Qwen3-*, transformers 4.51 era).
_QWEN3_BASE: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "head_dim": 128,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "use_sliding_window": False,
    "use_cache": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "vocab_size": VOCAB_SIZE,
}


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, tied: bool,
           **extra: Any) -> dict[str, Any]:
    return {**_QWEN3_BASE, "hidden_size": hidden, "intermediate_size": intermediate,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "max_window_layers": layers,
            "tie_word_embeddings": tied, **extra}


def _qwen3_5(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
             value_heads: int, tied: bool, vision: dict[str, Any], head_dim: int = 256,
             key_heads: int = 16, linear_dim: int = 128) -> dict[str, Any]:
    """A Qwen3.5 config.json as released (Qwen/Qwen3.5-*): the multimodal wrapper, the text
    model's fields under `text_config`, every 4th layer full attention."""
    eos = QWEN3_5_SPECIAL_TOKENS["<|endoftext|>"]
    text = {
        "model_type": "qwen3_5_text", "attention_bias": False, "attention_dropout": 0.0,
        "attn_output_gate": True, "bos_token_id": eos, "eos_token_id": eos, "dtype": "bfloat16",
        "full_attention_interval": 4, "head_dim": head_dim, "hidden_act": "silu",
        "hidden_size": hidden, "initializer_range": 0.02, "intermediate_size": intermediate,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                        for i in range(layers)],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": linear_dim,
        "linear_num_key_heads": key_heads, "linear_num_value_heads": value_heads,
        "linear_value_head_dim": linear_dim, "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144, "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False, "num_attention_heads": heads,
        "num_hidden_layers": layers, "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-06,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                            "rope_type": "default", "rope_theta": 10000000,
                            "partial_rotary_factor": 0.25},
        "tie_word_embeddings": tied, "use_cache": True, "vocab_size": QWEN3_5_VOCAB_SIZE,
    }
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "image_token_id": 248056, "video_token_id": 248057,
            "vision_start_token_id": 248053, "vision_end_token_id": 248054,
            "tie_word_embeddings": tied, "transformers_version": "4.57.0.dev0",
            "text_config": text,
            "vision_config": {"model_type": "qwen3_5", "deepstack_visual_indexes": [],
                              "hidden_act": "gelu_pytorch_tanh", "in_channels": 3,
                              "initializer_range": 0.02, "num_position_embeddings": 2304,
                              "patch_size": 16, "spatial_merge_size": 2,
                              "temporal_patch_size": 2, **vision, "out_hidden_size": hidden}}


def _vision(depth: int, hidden: int, heads: int, intermediate: int) -> dict[str, Any]:
    return {"depth": depth, "hidden_size": hidden, "num_heads": heads,
            "intermediate_size": intermediate}


#: The Qwen3.5 releases (their config.json fields; the 4B's vision tower from copies of it).
_QWEN3_5_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3.5-0.8b": _qwen3_5(1024, 3584, 24, 8, 2, 16, True, _vision(12, 768, 12, 3072)),
    "qwen3.5-4b": _qwen3_5(2560, 9216, 32, 16, 4, 32, True, _vision(24, 1024, 16, 4096)),
    "qwen3.5-9b": _qwen3_5(4096, 12288, 32, 16, 4, 32, False, _vision(27, 1152, 16, 4304)),
    # Not a real model: the Qwen3.5 layout at test size (4 layers, the last full attention).
    "tiny-qwen3.5": _qwen3_5(256, 512, 4, 4, 2, 8, True, _vision(1, 64, 2, 128), head_dim=64,
                             key_heads=4, linear_dim=32),
}


#: The FP8 releases' quantization_config (Qwen/Qwen3-*-FP8).
FP8_BLOCK = (128, 128)


def _qwen3_moe(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
               experts: int, active: int, expert_size: int, **extra: Any) -> dict[str, Any]:
    """A Qwen3-MoE config.json (Qwen/Qwen3-30B-A3B-Instruct-2507's fields)."""
    return {**_qwen3(hidden, intermediate, layers, heads, kv_heads, tied=False),
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "num_experts": experts, "num_experts_per_tok": active,
            "moe_intermediate_size": expert_size, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": False,
            "router_aux_loss_coef": 0.001, **extra}


def _fp8(cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with the FP8 releases' quantization_config: lm_head and each MoE layer's router
    gate stay unquantized."""
    gates = [f"model.layers.{i}.mlp.gate" for i in range(cfg["num_hidden_layers"])
             if _is_moe(cfg, i)]
    return {**cfg, "quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "weight_block_size": list(FP8_BLOCK), "modules_to_not_convert": ["lm_head", *gates]}}


#: AWQ's group along K (Qwen's -AWQ releases)
AWQ_GROUP = 128


def _awq(cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` as Qwen's -AWQ releases: 4-bit GEMM layout, group 128, fp16."""
    return {**cfg, "torch_dtype": "float16", "quantization_config": {
        "bits": 4, "group_size": AWQ_GROUP, "modules_to_not_convert": None,
        "quant_method": "awq", "version": "gemm", "zero_point": True}}


def _is_moe(cfg: dict[str, Any], layer: int) -> bool:
    """transformers' qwen3_moe rule: every decoder_sparse_step-th layer, but mlp_only_layers."""
    return (cfg.get("num_experts", 0) > 0 and layer not in cfg.get("mlp_only_layers", ())
            and (layer + 1) % cfg.get("decoder_sparse_step", 1) == 0)


#: name -> config of the MoE models (bf16), and of the block-FP8 models (name + "-fp8" where
#: the release is also FP8)
_MOE_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b-fp8": _qwen3_moe(2048, 6144, 48, 32, 4, 128, 8, 768, rope_theta=10000000,
                                    max_position_embeddings=262144),
    "qwen3-4b-fp8": _qwen3(2560, 9728, 36, 32, 8, tied=True),
    # Not a real model: the Qwen3-MoE layout at test size, layer 1 dense (mlp_only_layers).
    "tiny-moe-fp8": _qwen3_moe(256, 512, 3, 4, 2, 8, 2, 128, head_dim=64, mlp_only_layers=[1]),
}
_UNQUANTIZED = {"qwen3-30b-a3b": "qwen3-30b-a3b-fp8", "tiny-moe": "tiny-moe-fp8"}


CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, 8, tied=True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, 8, tied=True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, 8, tied=False),
    # Not a real model: the Qwen3 layout at test size (same vocab, tokenizer and special ids).
    "tiny": _qwen3(256, 512, 2, 4, 2, tied=True, head_dim=64),
    **{name: _fp8(cfg) for name, cfg in _MOE_CONFIGS.items()},
    "qwen3-4b-awq": _awq(_qwen3(2560, 9728, 36, 32, 8, tied=True)),
    "tiny-awq": _awq(_qwen3(256, 512, 2, 4, 2, tied=True, head_dim=64)),
    **{name: _MOE_CONFIGS[fp8] for name, fp8 in _UNQUANTIZED.items()},
    **_QWEN3_5_CONFIGS,
}

#: Qwen3's generation_config.json.
GENERATION_CONFIG: dict[str, Any] = {
    "bos_token_id": BOS_ID, "pad_token_id": BOS_ID, "eos_token_id": [EOS_ID, BOS_ID],
    "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
    "transformers_version": "4.51.0",
}
#: Qwen3.5's: the same sampling, its own ids (it stops at <|im_end|> or <|endoftext|>).
QWEN3_5_GENERATION_CONFIG: dict[str, Any] = {
    **GENERATION_CONFIG, "bos_token_id": QWEN3_5_SPECIAL_TOKENS["<|endoftext|>"],
    "pad_token_id": QWEN3_5_SPECIAL_TOKENS["<|endoftext|>"],
    "eos_token_id": [QWEN3_5_SPECIAL_TOKENS["<|im_end|>"],
                     QWEN3_5_SPECIAL_TOKENS["<|endoftext|>"]],
}


def is_qwen3_5(cfg: dict[str, Any]) -> bool:
    return "text_config" in cfg

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

#: Qwen2/3's pre-tokenizer split (as in their tokenizer.json), so text splits like the real one.
_QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TOKENIZER_VOCAB = 16000
_CORPUS_CHARS = 4_000_000

LOGIT_STD = 3.0  # target std of the logits over the vocab (see the module docstring)
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
              torch.int32: "I32", torch.float8_e4m3fn: "F8_E4M3"}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    #: normal std for weights; None for norm weights (1 + 0.1*N(0,1), or `init`'s)
    std: float | None
    #: "weight": an FP8 weight (of std `std`); "scale": the fp32 block scales of the FP8 weight
    #: `name` without "_scale_inv" (`shape` is its grid); "qweight", "qzeros" (int32, 8 nibbles
    #: each), "scales" (fp16): an AWQ linear's parts; "": a tensor in the model's dtype
    fp8: str = ""
    #: the values of a tensor with no std: "" norm weights 1 + 0.1*N(0,1); "zero_centred"
    #: 0.1*N(0,1) (Qwen3.5's norms scale by 1 + w); "a_log" log U(0.01, 16), "ones" (Gated
    #: DeltaNet's A_log and dt_bias, as transformers initialises them)
    init: str = ""

    def dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return _PART_DTYPES.get(self.fp8, model_dtype)

    def nbytes(self, element_size: int) -> int:
        """Bytes in a file whose unquantized tensors take `element_size` bytes per element."""
        dt = _PART_DTYPES.get(self.fp8)
        return math.prod(self.shape) * (dt.itemsize if dt is not None else element_size)


#: the dtypes of quantized checkpoints' parts (`TensorSpec.fp8`)
_PART_DTYPES = {"weight": torch.float8_e4m3fn, "scale": torch.float32, "qweight": torch.int32,
                "qzeros": torch.int32, "scales": torch.float16}



def tensor_specs(cfg: dict[str, Any]) -> list[TensorSpec]:
    """Every tensor of the HF Qwen3 checkpoint, in the order HF writes them."""
    if is_qwen3_5(cfg):
        return _qwen3_5_specs(cfg)
    h = cfg["hidden_size"]
    hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    emb_std = LOGIT_STD / math.sqrt(h)

    def linear(name: str, out: int, inp: int) -> TensorSpec:
        return TensorSpec(name, (out, inp), inp ** -0.5)

    specs = [TensorSpec("model.embed_tokens.weight", (cfg["vocab_size"], h), emb_std)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            TensorSpec(p + "input_layernorm.weight", (h,), None),
            linear(p + "self_attn.q_proj.weight", nq * hd, h),
            linear(p + "self_attn.k_proj.weight", nkv * hd, h),
            linear(p + "self_attn.v_proj.weight", nkv * hd, h),
            linear(p + "self_attn.o_proj.weight", h, nq * hd),
            TensorSpec(p + "self_attn.q_norm.weight", (hd,), None),
            TensorSpec(p + "self_attn.k_norm.weight", (hd,), None),
            TensorSpec(p + "post_attention_layernorm.weight", (h,), None),
            *_mlp_specs(cfg, i),
        ]
    specs.append(TensorSpec("model.norm.weight", (h,), None))
    if not cfg["tie_word_embeddings"]:
        specs.append(TensorSpec("lm_head.weight", (cfg["vocab_size"], h), emb_std))
    method = cfg.get("quantization_config", {}).get("quant_method")
    return _fp8_specs(specs) if method == "fp8" else _awq_specs(specs) if method == "awq" else specs


def _qwen3_5_specs(cfg: dict[str, Any]) -> list[TensorSpec]:
    """The tensors of a Qwen3.5 release: the text model's (`model.language_model.*`, lm_head
    when untied; per layer its mixer's, MLP and norms), then the MTP head's (`mtp.*`)."""
    t = cfg["text_config"]
    h = t["hidden_size"]
    emb_std = LOGIT_STD / math.sqrt(h)
    root = "model.language_model."
    specs = [TensorSpec(root + "embed_tokens.weight", (t["vocab_size"], h), emb_std)]
    for i, kind in enumerate(t["layer_types"]):
        specs += _qwen3_5_layer(t, f"{root}layers.{i}.", kind)
    specs.append(TensorSpec(root + "norm.weight", (h,), None, init="zero_centred"))
    if not t["tie_word_embeddings"]:
        specs.append(TensorSpec("lm_head.weight", (t["vocab_size"], h), emb_std))
    return specs + qwen3_5_mtp_specs(t)


def qwen3_5_mtp_specs(t: dict[str, Any]) -> list[TensorSpec]:
    """The multi-token prediction head of a Qwen3.5 release (`mtp.*`, `mtp_num_hidden_layers`
    layers): fc [hidden, 2 hidden] over [embedding | hidden state], its two input norms, a
    gated-attention decoder layer as the text model's, its final norm."""
    h = t["hidden_size"]
    layers = [s for i in range(t.get("mtp_num_hidden_layers", 0))
              for s in _qwen3_5_layer(t, f"mtp.layers.{i}.", "full_attention")]
    if not layers:
        return []
    return [TensorSpec("mtp.fc.weight", (h, 2 * h), (2 * h) ** -0.5),
            *(TensorSpec(f"mtp.{n}.weight", (h,), None, init="zero_centred")
              for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden")),
            *layers, TensorSpec("mtp.norm.weight", (h,), None, init="zero_centred")]


def _qwen3_5_layer(t: dict[str, Any], p: str, kind: str) -> list[TensorSpec]:
    """One Qwen3.5 decoder layer's tensors under prefix `p`: its mixer (Gated DeltaNet or gated
    attention), its dense MLP and zero-centred norms."""
    h, hd = t["hidden_size"], t["head_dim"]
    nq, nkv = t["num_attention_heads"], t["num_key_value_heads"]

    def linear(name: str, out: int, inp: int) -> TensorSpec:
        return TensorSpec(name, (out, inp), inp ** -0.5)

    def norm(name: str, n: int) -> TensorSpec:
        return TensorSpec(name, (n,), None, init="zero_centred")

    if kind == "linear_attention":
        hk, hv = t["linear_num_key_heads"], t["linear_num_value_heads"]
        dk, dv, kernel = (t["linear_key_head_dim"], t["linear_value_head_dim"],
                          t["linear_conv_kernel_dim"])
        conv = 2 * hk * dk + hv * dv
        a = p + "linear_attn."
        mixer = [linear(a + "in_proj_qkv.weight", conv, h),
                 linear(a + "in_proj_z.weight", hv * dv, h),
                 linear(a + "in_proj_b.weight", hv, h),
                 linear(a + "in_proj_a.weight", hv, h),
                 TensorSpec(a + "conv1d.weight", (conv, 1, kernel), kernel ** -0.5),
                 TensorSpec(a + "dt_bias", (hv,), None, init="ones"),
                 TensorSpec(a + "A_log", (hv,), None, init="a_log"),
                 TensorSpec(a + "norm.weight", (dv,), None),  # gated: not zero-centred
                 linear(a + "out_proj.weight", h, hv * dv)]
    else:
        a = p + "self_attn."
        mixer = [linear(a + "q_proj.weight", 2 * nq * hd, h),  # query and gate per head
                 linear(a + "k_proj.weight", nkv * hd, h),
                 linear(a + "v_proj.weight", nkv * hd, h),
                 linear(a + "o_proj.weight", h, nq * hd),
                 norm(a + "q_norm.weight", hd),
                 norm(a + "k_norm.weight", hd)]
    inter = t["intermediate_size"]
    mlp = [linear(p + "mlp.gate_proj.weight", inter, h),
           linear(p + "mlp.up_proj.weight", inter, h),
           linear(p + "mlp.down_proj.weight", h, inter)]
    return [norm(p + "input_layernorm.weight", h), *mixer,
            norm(p + "post_attention_layernorm.weight", h), *mlp]


def _mlp_specs(cfg: dict[str, Any], layer: int, root: str = "model.") -> list[TensorSpec]:
    """A layer's MLP: dense, or (`_is_moe`) the router gate and the experts one by one."""
    h, p = cfg["hidden_size"], f"{root}layers.{layer}.mlp."

    def swiglu(prefix: str, inter: int) -> list[TensorSpec]:
        return [TensorSpec(prefix + "gate_proj.weight", (inter, h), h ** -0.5),
                TensorSpec(prefix + "up_proj.weight", (inter, h), h ** -0.5),
                TensorSpec(prefix + "down_proj.weight", (h, inter), inter ** -0.5)]

    if not _is_moe(cfg, layer):
        return swiglu(p, cfg["intermediate_size"])
    experts = cfg["num_experts"]
    return [TensorSpec(p + "gate.weight", (experts, h), h ** -0.5),
            *(s for e in range(experts)
              for s in swiglu(f"{p}experts.{e}.", cfg["moe_intermediate_size"]))]


def _fp8_specs(specs: list[TensorSpec]) -> list[TensorSpec]:
    """The FP8 releases' tensors: each projection's weight FP8, its block scales after it."""
    out = []
    for spec in specs:
        if not spec.name.endswith("_proj.weight"):
            out.append(spec)
            continue
        out += [TensorSpec(spec.name, spec.shape, spec.std, "weight"),
                TensorSpec(spec.name + "_scale_inv", _fp8_grid(spec.shape), spec.std, "scale")]
    return out


def _awq_specs(specs: list[TensorSpec]) -> list[TensorSpec]:
    """AWQ's GEMM layout: each projection [N, K] as qweight [K, N/8] and qzeros [K/g, N/8]
    int32 (8 nibbles each), scales [K/g, N] fp16."""
    out = []
    for spec in specs:
        if not spec.name.endswith("_proj.weight"):
            out.append(spec)
            continue
        (n, k), base = spec.shape, spec.name.removesuffix(".weight")
        out += [TensorSpec(base + ".qweight", (k, n // 8), spec.std, "qweight"),
                TensorSpec(base + ".qzeros", (k // AWQ_GROUP, n // 8), spec.std, "qzeros"),
                TensorSpec(base + ".scales", (k // AWQ_GROUP, n), spec.std, "scales")]
    return out


def _make_awq(spec: TensorSpec, seed: int, device: torch.device) -> torch.Tensor:
    """An AWQ part: uniform nibbles (q; the packing order does not matter for random ones),
    zero points 6-9, scales that give w = (q - z) s the std of the float weight (q's std over
    0..15 is 4.6)."""
    assert spec.std is not None
    gen = torch.Generator(device=device)
    gen.manual_seed(zlib.crc32(f"{seed}/{spec.name}".encode()))
    if spec.fp8 == "scales":
        s = spec.std / 4.6 * (0.75 + 0.5 * torch.rand(spec.shape, generator=gen, device=device))
        return s.to(torch.float16)
    lo, hi = (0, 16) if spec.fp8 == "qweight" else (6, 10)
    nib = torch.randint(lo, hi, (*spec.shape, 8), generator=gen, device=device,
                        dtype=torch.int64)
    shifts = torch.arange(0, 32, 4, device=device)
    words = (nib << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _fp8_grid(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(-(-n // b) for n, b in zip(shape, FP8_BLOCK, strict=True))


def _fp8_scales(weight: str, grid: tuple[int, ...], std: float, seed: int,
                device: torch.device) -> torch.Tensor:
    """The block scales of FP8 weight `weight` (the same whichever of the weight and its scale
    asks): 1, 2 or 4 times the smallest power of two that holds 4.5 std in e4m3's range."""
    gen = torch.Generator(device=device)
    gen.manual_seed(zlib.crc32(f"{seed}/{weight}/scale".encode()))
    smallest = 2.0 ** math.ceil(math.log2(4.5 * std / 448.0))
    return smallest * torch.exp2(torch.randint(0, 3, grid, generator=gen, device=device).float())


def _make_fp8(spec: TensorSpec, seed: int, device: torch.device) -> torch.Tensor:
    assert spec.std is not None
    if spec.fp8 == "scale":
        return _fp8_scales(spec.name.removesuffix("_scale_inv"), spec.shape, spec.std, seed,
                           device)
    w = make_tensor(TensorSpec(spec.name, spec.shape, spec.std), seed, torch.float32, device)
    n, k = spec.shape
    scale = _fp8_scales(spec.name, _fp8_grid(spec.shape), spec.std, seed, device)
    per_element = scale.repeat_interleave(FP8_BLOCK[0], 0).repeat_interleave(FP8_BLOCK[1], 1)
    return (w / per_element[:n, :k]).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)


def make_tensor(spec: TensorSpec, seed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Draw one tensor; its values depend only on (seed, name, shape, device type)."""
    if spec.fp8 in ("qweight", "qzeros", "scales"):
        return _make_awq(spec, seed, device)
    if spec.fp8:
        return _make_fp8(spec, seed, device)
    gen = torch.Generator(device=device)
    # NOTE: 32 bits: the CPU generator (mt19937) ignores the seed's higher bits.
    gen.manual_seed(zlib.crc32(f"{seed}/{spec.name}".encode()))
    x = torch.randn(spec.shape, generator=gen, device=device, dtype=torch.float32)
    if spec.init == "zero_centred":
        x = (0.1 * x).clamp_(min=-0.9)
    elif spec.init == "a_log":
        x = torch.empty(spec.shape, device=device).uniform_(0.01, 16, generator=gen).log_()
    elif spec.init == "ones":
        x = torch.ones(spec.shape, device=device)
    elif spec.std is None:
        x = (1.0 + 0.1 * x).clamp_(min=0.1)
    else:
        x *= spec.std
    return x.to(dtype)


def plan_shards(specs: list[TensorSpec], element_size: int,
                max_bytes: int) -> list[list[TensorSpec]]:
    """Greedy, in order: a new shard when the next tensor would overflow this one."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        n = spec.nbytes(element_size)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
    return shards


def write_safetensors(path: Path, specs: list[TensorSpec], dtype: torch.dtype,
                      produce: Callable[[TensorSpec], torch.Tensor]) -> None:
    """Stream tensors into a safetensors file: the header is known from the shapes alone."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        n = spec.nbytes(dtype.itemsize)
        header[spec.name] = {"dtype": _ST_DTYPES[spec.dtype(dtype)], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # NOTE: the data must start 8-byte aligned
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for spec in specs:
            t = produce(spec).contiguous().cpu()
            assert tuple(t.shape) == spec.shape and t.dtype == spec.dtype(dtype), spec.name
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)


def write_weights(out: Path, cfg: dict[str, Any], dtype: torch.dtype, seed: int,
                  device: torch.device, shard_bytes: int) -> int:
    """All shards (+ model.safetensors.index.json when more than one); returns the bytes."""
    specs = tensor_specs(cfg)
    shards = plan_shards(specs, dtype.itemsize, shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])

    def produce(spec: TensorSpec) -> torch.Tensor:
        return make_tensor(spec, seed, dtype, device)

    # Threads overlap drawing, the device-to-host copy and the file write of different shards
    # (all three release the GIL).
    workers = max(1, min(len(shards), os.cpu_count() or 1, 8))
    with ThreadPoolExecutor(workers) as pool:
        jobs = [pool.submit(write_safetensors, out / name, shard, dtype, produce)
                for name, shard in zip(names, shards, strict=True)]
        for job in jobs:
            job.result()
    total = sum(s.nbytes(dtype.itemsize) for s in specs)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total,
                              "total_parameters": sum(math.prod(s.shape) for s in specs)},
                 "weight_map": {s.name: name for name, shard in zip(names, shards, strict=True)
                                for s in shard}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def _corpus() -> list[str]:
    """The first few MB of the running interpreter's standard-library sources, sorted by name."""
    texts: list[str] = []
    size = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        size += len(text)
        if size >= _CORPUS_CHARS:
            break
    if not texts:  # an interpreter without sources: a tokenizer of bytes and a few merges
        texts = ["def main():\n    return 'hello world'\n" * 100]
    return texts


def build_tokenizer(vocab_size: int = VOCAB_SIZE,
                    special_tokens: dict[str, int] | None = None) -> Any:
    """A Qwen-style byte-level BPE (NFC, Qwen's split regex, byte-level) trained on a local
    corpus, with Qwen's special tokens at their real ids (beyond the trained ids, a gap)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    special = special_tokens or SPECIAL_TOKENS
    assert max(special.values()) < vocab_size
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    # NOTE: a special token takes the model-vocab id of the same string when it has one, so
    # putting them in the BPE vocab is what pins their ids (an added token would get id 16000).
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    vocab.update(special)
    # NOTE: every model id decodes to text: ids the trained BPE does not reach get filler words
    # (" #<id>", never produced by encoding). A random model samples from the whole vocabulary;
    # with empty strings there, a streaming client would see no text and mis-time TTFT/ITL.
    taken = set(vocab)
    for i in sorted(set(range(vocab_size)) - set(vocab.values())):
        word = f"\u0120#{i}"  # \u0120 is byte-level BPE's space
        while word in taken:
            word += "~"
        vocab[word] = i
        taken.add(word)
    data["added_tokens"] = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True} for t, i in special.items()]
    tok = Tokenizer.from_str(json.dumps(data))
    for t, i in special.items():
        assert tok.token_to_id(t) == i and tok.encode(t).ids == [i], t
    return tok


def write_tokenizer(out: Path, cfg: dict[str, Any]) -> None:
    if is_qwen3_5(cfg):
        build_tokenizer(QWEN3_5_VOCAB_SIZE, QWEN3_5_SPECIAL_TOKENS).save(
            str(out / "tokenizer.json"))
    else:
        build_tokenizer(cfg["vocab_size"]).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        # NOTE: not Qwen2Tokenizer: transformers 5 rebuilds that class's pipeline from the vocab
        # instead of reading tokenizer.json; this one reads tokenizer.json as it is.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False, "add_prefix_space": False,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "model_max_length": 131072, "chat_template": CHAT_TEMPLATE,
    }, indent=2) + "\n")


def with_layers(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """`cfg` cut to its first `layers` decoder layers (the same layer kinds in the same order):
    the real shapes at a size a reference implementation can run beside arle on one GPU."""
    if "text_config" in cfg:
        return {**cfg, "text_config": with_layers(cfg["text_config"], layers)}
    out = {**cfg, "num_hidden_layers": layers}
    if "layer_types" in cfg:
        out["layer_types"] = cfg["layer_types"][:layers]
    if "max_window_layers" in cfg:
        out["max_window_layers"] = layers
    if "quantization_config" in cfg:  # the routers of the dropped layers
        keep = [m for m in cfg["quantization_config"]["modules_to_not_convert"]
                if not m.startswith("model.layers.") or int(m.split(".")[2]) < layers]
        out["quantization_config"] = {**cfg["quantization_config"], "modules_to_not_convert": keep}
    return out


def write_model_dir(name: str, out: Path, dtype: str = "bfloat16", seed: int = 0,
                    device: str = "cpu", shard_gb: float = 4.0, force: bool = False,
                    layers: int | None = None) -> int:
    """Write config, weights, generation config and tokenizer; returns the weight bytes.
    `layers`: only the first N decoder layers of the named model (see `with_layers`)."""
    if name not in CONFIGS:
        raise SystemExit(f"unknown model {name!r} (choose from {', '.join(CONFIGS)})")
    out.mkdir(parents=True, exist_ok=True)
    old = [*out.glob("*.safetensors"), *out.glob("model.safetensors.index.json")]
    if old and not force:
        raise SystemExit(f"{out} already holds weights (pass --force to replace them)")
    for path in old:  # stale shards of another layout would confuse loaders
        path.unlink()
    cfg = {**CONFIGS[name], "torch_dtype": dtype}
    if layers is not None:
        cfg = with_layers(cfg, layers)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen_config = QWEN3_5_GENERATION_CONFIG if is_qwen3_5(cfg) else GENERATION_CONFIG
    (out / "generation_config.json").write_text(json.dumps(gen_config, indent=2) + "\n")
    write_tokenizer(out, cfg)
    with torch.no_grad():
        return write_weights(out, cfg, _DTYPES[dtype], seed, torch.device(device),
                             int(shard_gb * 1e9))


def check_logits(out: Path, device: str, seq_len: int = 64) -> dict[str, float]:
    """Forward random ids through transformers (bf16, then fp32) and describe the logits."""
    import transformers

    # transformers 5 renamed `torch_dtype` to `dtype` (4.56+ accepts both, older only the first).
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    kw: dict[str, Any] = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": torch.bfloat16}
    auto: Any = transformers.AutoModelForCausalLM
    try:  # straight onto the device; older versions need accelerate for device_map
        model = auto.from_pretrained(out, device_map=device, **kw)
    except (ImportError, ValueError):
        model = auto.from_pretrained(out, **kw).to(device)
    model.eval()
    gen = torch.Generator().manual_seed(0)
    vocab = model.get_output_embeddings().weight.shape[0]  # (a multimodal config nests it)
    ids = torch.randint(0, vocab, (4, seq_len), generator=gen).to(device)
    changed = ids.clone()
    changed[:, 0] = (changed[:, 0] + 1) % vocab
    with torch.no_grad():
        logits = model(ids).logits.float()
        logits2 = model(changed).logits.float()
        ref = model.float()(ids).logits
    top2 = ref.topk(2, dim=-1).values
    gap = top2[..., 0] - top2[..., 1]
    return {
        "logit_std": ref.std(dim=-1).mean().item(),
        "top2_gap_mean": gap.mean().item(),
        "top2_gap_below_0.05": (gap < 0.05).float().mean().item(),
        "top1_prob_mean": ref.softmax(-1).amax(-1).mean().item(),
        # how much the last position's logits move when only the first token changes
        "context_effect": ((logits2[:, -1] - logits[:, -1]).std()
                           / logits[:, -1].std()).item(),
        "bf16_vs_fp32_rel_err": ((logits - ref).std() / ref.std()).item(),
        "bf16_vs_fp32_top1_agree": (logits.argmax(-1) == ref.argmax(-1)).float().mean().item(),
    }


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", choices=sorted(CONFIGS))
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shard-gb", type=float, default=4.0, help="max shard size (GB, 1e9 bytes)")
    ap.add_argument("--force", action="store_true", help="replace existing weights in OUT")
    ap.add_argument("--layers", type=int, help="keep only the first N decoder layers")
    ap.add_argument("--check", action="store_true",
                    help="afterwards, load with transformers and print the logits' spread")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    weight_bytes = write_model_dir(args.name, args.out, args.dtype, args.seed, args.device,
                                   args.shard_gb, args.force, args.layers)
    took = time.perf_counter() - t0
    print(f"wrote {args.name} to {args.out} in {took:.1f} s: {weight_bytes / 1e9:.2f} GB of "
          f"weights, {_dir_bytes(args.out) / 1e9:.2f} GB on disk "
          f"({weight_bytes / 1e9 / took:.2f} GB/s)")
    if args.check:
        t0 = time.perf_counter()
        stats = check_logits(args.out, args.device)
        print(f"check ({time.perf_counter() - t0:.1f} s): "
              + ", ".join(f"{k} {v:.3f}" for k, v in stats.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
