"""Small random-weight Hugging Face model directories, written by transformers (not by arle), for
parity and loader tests.

Imported as `model_dirs` (tests/ is on sys.path). transformers is imported lazily: it costs ~4 s.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from helpers import load_script
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: Larger than the tokenizer (256 bytes + 3 specials), as real checkpoints pad their vocab.
VOCAB_SIZE = 384
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: What `generation_config.json` says; the engine must take these as its defaults.
GENERATION_CONFIG = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20,
                     "repetition_penalty": 1.05, "eos_token_id": [258, 256],
                     "bos_token_id": 256}

#: Shape shared by every tiny model: head_dim 32 (not hidden/heads), GQA 4:2.
BASE_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "bos_token_id": 256,
    "eos_token_id": 258,
}


#: Expert MLPs of the tiny MoE models: 8 experts of width 40 (not a multiple of FP8_BLOCK's
#: rows: gate and up of one expert do not meet on a block boundary), 3 routed per token.
MOE_CONFIG: dict[str, Any] = {"num_experts": 8, "num_experts_per_tok": 3,
                              "moe_intermediate_size": 40, "norm_topk_prob": True}
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)


def byte_tokenizer() -> Tokenizer:
    """A byte-level BPE with no merges: one token per byte, plus ChatML control tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in SPECIAL_TOKENS])
    return tok


def hf_config(arch: str, **overrides: Any) -> Any:
    """A transformers config object for `arch` (Qwen3ForCausalLM, LlamaForCausalLM, ...)."""
    import transformers

    classes = {"Qwen3ForCausalLM": transformers.Qwen3Config,
               "Qwen2ForCausalLM": transformers.Qwen2Config,
               "LlamaForCausalLM": transformers.LlamaConfig,
               "MistralForCausalLM": transformers.MistralConfig,
               "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig}
    base = {**BASE_CONFIG, **MOE_CONFIG} if arch in MOE_ARCHITECTURES else BASE_CONFIG
    return classes[arch](**{**base, **overrides, "architectures": [arch]})


def random_hf_model(config: Any, seed: int = 0) -> Any:
    """A transformers model for `config` with seeded random weights spread enough that greedy
    decoding has no near-ties, and norm weights / biases that are not their identity values (so
    a model that skipped them would not match)."""
    import transformers

    cls = getattr(transformers, config.architectures[0])
    model = cls(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():  # tied weights are listed once
        if "norm" in name:
            value = 1.0 + 0.2 * torch.randn(p.shape, generator=gen)
        elif name.endswith("bias"):
            value = 0.5 * torch.randn(p.shape, generator=gen)
        elif "embed_tokens" in name:
            value = torch.randn(p.shape, generator=gen) * (0.25 if config.tie_word_embeddings
                                                           else 1.0)
        elif "lm_head" in name:
            value = 0.25 * torch.randn(p.shape, generator=gen)
        else:
            value = torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5
        with torch.no_grad():
            p.copy_(value)
    return model


def write_model_dir(path: Path, config: Any, seed: int = 0,
                    max_shard_size: str = "400KB") -> Any:
    """Save a random model (sharded: a ~2 MB model in several files + index), tokenizer files and
    generation_config.json to `path`. Returns the in-memory transformers model."""
    model = random_hf_model(config, seed)
    save_checkpoint(model, path, max_shard_size)
    return model


def save_checkpoint(model: Any, path: Path, max_shard_size: str = "400KB") -> None:
    """A transformers model saved as a model directory: sharded weights, the byte tokenizer's
    files, generation_config.json."""
    model.save_pretrained(path, max_shard_size=max_shard_size)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "add_bos_token": False, "chat_template": CHAT_TEMPLATE,
    }))
    # Written by hand after save_pretrained (which writes its own): these exact values matter.
    (path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))


# ---- block-FP8 checkpoints (the Qwen FP8 releases' format) ----------------------------------

#: Rows x columns per scale in the tiny FP8 models: hidden 128 and width 40 give partial edge
#: blocks in both directions (128 = 2 x 48 + 32 columns; 40 = 32 + 8 rows).
FP8_BLOCK = (32, 48)
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def fp8_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] as (float8_e4m3fn [N, K], fp32 scales [ceil(N/bn), ceil(K/bk)]), the real weight
    being q * scale per block. Scales are powers of two: dequantising is then exact in bf16 and
    fp32 alike, whoever does it."""
    bn, bk = block
    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk)
    padded[:n, :k] = w.float()
    amax = padded.view(rows, bn, cols, bk).abs().amax(dim=(1, 3))
    scale = torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-30) / FP8_MAX)))
    q = (w.float() / _per_element(scale, block, n, k)).to(torch.float8_e4m3fn)
    return q, scale


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The real weight (fp32) of an FP8 weight and its block scales."""
    return q.float() * _per_element(scale, block, *q.shape)


def _per_element(scale: torch.Tensor, block: tuple[int, int], n: int, k: int) -> torch.Tensor:
    return scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]


def fp8_quantized(name: str) -> bool:
    """Whether the FP8 releases quantize this checkpoint tensor: the linear weights (Gated
    DeltaNet's in_proj_qkv and in_proj_z too), but the embeddings, lm_head, norms, the routers'
    and shared experts' gates and Gated DeltaNet's in_proj_a / in_proj_b."""
    return (re.search(r"(_proj|in_proj_qkv|in_proj_z)\.weight$", name) is not None
            and not any(part in name for part in ("embed_tokens", "lm_head", "norm")))


def read_tensors(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """A checkpoint's tensors, per safetensors file name."""
    from safetensors.torch import load_file

    return {f.name: load_file(f) for f in sorted(path.glob("*.safetensors"))}


def write_tensors(path: Path, files: dict[str, dict[str, torch.Tensor]]) -> None:
    """Replace a checkpoint's safetensors files (and index) by `files`."""
    from safetensors.torch import save_file

    for old in path.glob("*.safetensors"):
        old.unlink()
    weight_map = {}
    for file, tensors in files.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / file),
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    total = sum(t.numel() * t.element_size() for ts in files.values() for t in ts.values())
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))


def write_fp8_model_dir(path: Path, config: Any, twin: Path, block: tuple[int, int] = FP8_BLOCK,
                        seed: int = 0,
                        write: Callable[[Path, Any, int], Any] = write_model_dir) -> None:
    """A random model (`write(path, config, seed)`) with its linear weights in block FP8, as
    the FP8 releases store them, and at `twin` the same model with those weights dequantised
    (fp32, no quantization_config): what transformers runs as the reference.

    Scales land in both orders: every other one beside its weight (read after it), the rest in
    a file of scales that sorts first (read before its weight)."""
    for out in (path, twin):
        write(out, config, seed)
    files = read_tensors(path)
    twin_files = read_tensors(twin)
    early: dict[str, torch.Tensor] = {}
    quantized = 0
    for file, tensors in files.items():
        for name in [n for n in sorted(tensors) if fp8_quantized(n)]:
            q, scale = fp8_quantize(tensors[name], block)
            tensors[name] = q
            (tensors if quantized % 2 == 0 else early)[f"{name}_scale_inv"] = scale
            twin_files[file][name] = fp8_dequantize(q, scale, block)
            quantized += 1
    write_tensors(path, {"model-00000-scales.safetensors": early, **files})
    write_tensors(twin, twin_files)
    cfg = json.loads((path / "config.json").read_text())
    layers = range(cfg.get("text_config", cfg)["num_hidden_layers"])
    cfg["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": ["lm_head", *(f"model.layers.{i}.mlp.gate" for i in layers)]}
    (path / "config.json").write_text(json.dumps(cfg))


# ---- Qwen3.5 (hybrid: Gated DeltaNet + gated attention) -------------------------------------

#: The tiny Qwen3.5 text model: 5 layers, full attention at 1 and 4 (so a layer's index among
#: its kind differs from its index), head dim 64 with a quarter (16) rotating, Gated DeltaNet
#: with 2 key heads of 32 serving 4 value heads of 24 (dk != dv), kernel 4; tied embeddings.
QWEN3_5_TEXT: dict[str, Any] = {
    **BASE_CONFIG, "num_hidden_layers": 5, "head_dim": 64,
    "layer_types": ["linear_attention", "full_attention", "linear_attention",
                    "linear_attention", "full_attention"],
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
    "linear_value_head_dim": 24, "linear_conv_kernel_dim": 4, "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2],
                        "mrope_interleaved": True},
}
#: Real kernel shapes for the GPU tests, in models small enough to be quick: head dim 128, GQA 4:1,
#: qk-norm (Qwen3); with 16 experts of 256 (Qwen3-MoE: whole 128 x 128 FP8 blocks); head dim 256
#: (64 rotating) and Gated DeltaNet heads of 128, 2 value heads per key head, the 3 + 1 layer
#: pattern twice (Qwen3.5).
GPU_SHAPE: dict[str, Any] = {"hidden_size": 512, "intermediate_size": 1024,
                             "num_hidden_layers": 4, "num_attention_heads": 8,
                             "num_key_value_heads": 2, "head_dim": 128,
                             "max_position_embeddings": 4096, "tie_word_embeddings": False}
MOE_GPU_SHAPE: dict[str, Any] = {**GPU_SHAPE, "num_experts": 16, "num_experts_per_tok": 4,
                                 "moe_intermediate_size": 256}
QWEN3_5_GPU_SHAPE: dict[str, Any] = {
    **GPU_SHAPE, "num_hidden_layers": 8, "head_dim": 256,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
    "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                        "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                        "mrope_interleaved": True}}
#: A vision tower stub for the multimodal layout (arle skips its weights).
QWEN3_5_VISION: dict[str, Any] = {"depth": 1, "hidden_size": 32, "num_heads": 2,
                                  "intermediate_size": 64, "patch_size": 4,
                                  "temporal_patch_size": 2, "spatial_merge_size": 2,
                                  "out_hidden_size": 128, "num_position_embeddings": 16}
QWEN3_5_LAYOUTS = ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM")


def qwen3_5_config(arch: str = "Qwen3_5ForConditionalGeneration", **overrides: Any) -> Any:
    """A transformers Qwen3.5 config in one of the two layouts (`QWEN3_5_LAYOUTS`): the
    published multimodal one (text under `text_config`, a vision stub) or the text-only one."""
    import transformers

    text = {**QWEN3_5_TEXT, **overrides}
    if arch == "Qwen3_5ForCausalLM":
        return transformers.Qwen3_5TextConfig(**text, architectures=[arch])
    assert arch == "Qwen3_5ForConditionalGeneration", arch
    return transformers.Qwen3_5Config(
        text_config=text, vision_config=QWEN3_5_VISION, architectures=[arch],
        tie_word_embeddings=text["tie_word_embeddings"])


def random_qwen3_5_model(config: Any, seed: int = 0) -> Any:
    """`random_hf_model`, with Qwen3.5's own parameters drawn for a useful test: zero-centred
    norms (stored w, scaling by 1 + w) around 0 (gain ~1: logits of std ~3, as the other tiny
    models'), decays exp(g) mostly in 0.3-0.98 (the state carries several tokens and none is
    forgotten at once)."""
    model = random_hf_model(config, seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    zero_centred = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm")
    for name, p in model.named_parameters():
        if "visual" in name:
            continue
        if any(f".{n}." in name for n in zero_centred) or name.endswith("model.norm.weight"):
            value = 0.2 * torch.randn(p.shape, generator=gen)
        elif name.endswith("A_log"):
            value = torch.empty(p.shape).uniform_(0.05, 0.8, generator=gen).log()
        elif name.endswith("dt_bias"):
            value = 0.5 * torch.randn(p.shape, generator=gen)
        else:
            continue
        with torch.no_grad():
            p.copy_(value)
    return model


def write_qwen3_5_dir(path: Path, arch: str = "Qwen3_5ForConditionalGeneration", seed: int = 0,
                      **overrides: Any) -> Any:
    """A random tiny Qwen3.5 checkpoint as transformers saves it (sharded), in `arch`'s layout,
    with tokenizer files; the multimodal layout also carries the MTP head's tensors (a shard
    of their own, in the index: `write_mtp_head`). Returns the in-memory transformers model."""
    config = qwen3_5_config(arch, **overrides)
    model = random_qwen3_5_model(config, seed)
    save_checkpoint(model, path)
    if arch == "Qwen3_5ForConditionalGeneration":
        write_mtp_head(path, seed)
    return model


def write_mtp_head(path: Path, seed: int) -> None:
    """The multi-token prediction head a Qwen3.5 release carries (`mtp.*`, drawn as
    scripts/make_random_model.py draws it), in a shard of its own, and `mtp_num_hidden_layers`
    in config.json (transformers skips the head; arle runs it with `--speculative mtp`)."""
    from safetensors.torch import save_file

    make = load_script("make_random_model")
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    config_path.write_text(json.dumps(config, indent=2))
    mtp = {spec.name: make.make_tensor(spec, seed, torch.float32, torch.device("cpu"))
           for spec in make.qwen3_5_mtp_specs(config["text_config"])}
    save_file(mtp, str(path / "mtp.safetensors"), metadata={"format": "pt"})
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update(dict.fromkeys(mtp, "mtp.safetensors"))
    index_path.write_text(json.dumps(index))


# ---- Qwen3.5-MoE (hybrid layers with expert MLPs and a shared expert) ----------------------

#: The tiny Qwen3.5 text model (`QWEN3_5_TEXT`) with the tiny MoE's experts (`MOE_CONFIG`; the
#: router always renormalises) and a shared expert of width 72.
QWEN3_5_MOE: dict[str, Any] = {
    **QWEN3_5_TEXT, **{k: v for k, v in MOE_CONFIG.items() if k != "norm_topk_prob"},
    "shared_expert_intermediate_size": 72}
QWEN3_5_MOE_LAYOUTS = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")


def qwen3_5_moe_config(arch: str = "Qwen3_5MoeForConditionalGeneration",
                       **overrides: Any) -> Any:
    """A transformers Qwen3.5-MoE config in one of `QWEN3_5_MOE_LAYOUTS`."""
    import transformers

    text = {**QWEN3_5_MOE, **overrides}
    if arch == "Qwen3_5MoeForCausalLM":
        return transformers.Qwen3_5MoeTextConfig(**text, architectures=[arch])
    assert arch == "Qwen3_5MoeForConditionalGeneration", arch
    return transformers.Qwen3_5MoeConfig(
        text_config=text, vision_config=QWEN3_5_VISION, architectures=[arch],
        tie_word_embeddings=text["tie_word_embeddings"])


def write_qwen3_5_moe_dir(path: Path, config: Any, seed: int = 0) -> Any:
    """A random tiny Qwen3.5-MoE checkpoint as transformers saves it (sharded, experts one by
    one) with tokenizer files; weights drawn as `random_qwen3_5_model` draws them. Returns the
    in-memory transformers model."""
    model = random_qwen3_5_model(config, seed)
    save_checkpoint(model, path)
    return model


# ---- 4-bit checkpoints: AWQ (GEMM layout) and GPTQ, as AutoAWQ and AutoGPTQ pack them --------

def int4_quantize(w: torch.Tensor, group: int, symmetric: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] in groups of `group` columns -> (q [N, K], zero [N, K / group] int64 in 0..15,
    scale [N, K / group] fp16); w ~ (q - zero) * scale. Symmetric: zero 8 (GPTQ's sym)."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    if symmetric:
        scale = (g.abs().amax(-1) / 7).clamp(min=1e-6).half()
        zero = torch.full(scale.shape, 8, dtype=torch.int64)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-6).half()
        zero = torch.round(-lo / scale.float()).clamp(0, 15).long()
    q = (torch.round(g / scale.float()[..., None]) + zero[..., None]).clamp(0, 15).long()
    return q.view(n, k), zero, scale


def int4_dequantize(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor,
                    group: int) -> torch.Tensor:
    zeros, scales = (t.repeat_interleave(group, dim=1) for t in (zero, scale.float()))
    return (q - zeros).float() * scales


def _int32(x: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the int32 tensor with those bits."""
    import numpy as np

    return torch.from_numpy(x.numpy().astype(np.uint32).view(np.int32))


def pack_awq(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """AutoAWQ's WQLinear_GEMM: qweight [K, N / 8], qzeros [K / g, N / 8] (8 output columns to
    an int32, nibble i holding column order[i]), scales [K / g, N] fp16."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)

    def cols(x: torch.Tensor) -> torch.Tensor:  # [R, N] -> [R, N / 8]
        x = x.view(x.shape[0], -1, 8)
        out = torch.zeros(x.shape[:2], dtype=torch.int64)
        for i, c in enumerate(order):
            out |= x[:, :, c] << (4 * i)
        return _int32(out)

    return {"qweight": cols(q.t()), "qzeros": cols(zero.t()), "scales": scale.t().contiguous()}


def pack_gptq(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor,
              group: int) -> dict[str, torch.Tensor]:
    """AutoGPTQ's format: qweight [K / 8, N] (8 consecutive input rows to an int32, row 8r + i
    at nibble i), qzeros [K / g, N / 8] holding zero - 1, in column order, scales [K / g, N],
    g_idx [K] = row // group (no act-order)."""
    q_kn = q.t()
    k = q_kn.shape[0]
    rows = torch.zeros(k // 8, q_kn.shape[1], dtype=torch.int64)
    for i in range(8):
        rows |= q_kn[i::8] << (4 * i)
    z = (zero.t() - 1).view(zero.shape[1], -1, 8)
    zeros = torch.zeros(z.shape[:2], dtype=torch.int64)
    for i in range(8):
        zeros |= (z[:, :, i] & 15) << (4 * i)
    return {"qweight": _int32(rows), "qzeros": _int32(zeros), "scales": scale.t().contiguous(),
            "g_idx": (torch.arange(k) // group).to(torch.int32)}


def write_int4_model_dir(path: Path, config: Any, twin: Path, method: str, group: int = 128,
                         seed: int = 0) -> None:
    """A random model with its linear weights in 4-bit `method` ("awq": asymmetric, GEMM
    layout; "gptq": symmetric, desc_act false, the original zero - 1 format), and at `twin`
    the same model with those weights dequantized (fp32, no quantization_config)."""
    for out in (path, twin):
        write_model_dir(out, config, seed)
    files, twin_files = read_tensors(path), read_tensors(twin)
    for file, tensors in files.items():
        for name in [n for n in sorted(tensors) if fp8_quantized(n)]:
            q, zero, scale = int4_quantize(tensors.pop(name), group, symmetric=method == "gptq")
            parts = (pack_awq(q, zero, scale) if method == "awq"
                     else pack_gptq(q, zero, scale, group))
            base = name.removesuffix(".weight")
            tensors.update({f"{base}.{part}": t for part, t in parts.items()})
            twin_files[file][name] = int4_dequantize(q, zero, scale, group)
    write_tensors(path, files)
    write_tensors(twin, twin_files)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
         "version": "gemm"} if method == "awq" else
        {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
         "sym": True, "checkpoint_format": "gptq"})
    (path / "config.json").write_text(json.dumps(cfg))
