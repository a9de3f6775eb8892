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
               "MistralForCausalLM": transformers.MistralConfig}
    return classes[arch](**{**BASE_CONFIG, **overrides, "architectures": [arch]})


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
