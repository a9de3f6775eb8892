"""Small random-weight Hugging Face model directories, written by transformers (not by arle), for
parity and loader tests.

Imported as `model_dirs` (tests/ is on sys.path). transformers is imported lazily: it costs ~4 s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
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
    model.save_pretrained(path, max_shard_size=max_shard_size)
    byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "add_bos_token": False, "chat_template": CHAT_TEMPLATE,
    }))
    # Written by hand after save_pretrained (which writes its own): these exact values matter.
    (path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return model


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
    """Whether the FP8 releases quantize this checkpoint tensor: the linear weights, but the
    embeddings, lm_head, norms and the routers' gates."""
    return (name.endswith("_proj.weight")
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
                        seed: int = 0) -> None:
    """A random model (`write_model_dir`) with its linear weights in block FP8, as the FP8
    releases store them, and at `twin` the same model with those weights dequantised (fp32,
    no quantization_config): what transformers runs as the reference.

    Scales land in both orders: every other one beside its weight (read after it), the rest in
    a file of scales that sorts first (read before its weight)."""
    for out in (path, twin):
        write_model_dir(out, config, seed)
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
    layers = range(cfg["num_hidden_layers"])
    cfg["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": ["lm_head", *(f"model.layers.{i}.mlp.gate" for i in layers)]}
    (path / "config.json").write_text(json.dumps(cfg))

