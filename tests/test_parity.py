"""arle's model code against Hugging Face transformers (an implementation we did not write).

Two sources of weights: the default SmolLM2 GGUF (quantized; both sides dequantize it to fp32),
and small random-weight checkpoints that transformers itself writes as sharded HF directories,
one per architecture and rope scaling type arle claims. arle's logits come through the engine's
paged-attention path (`teacher_forced_logits`), whole and in chunks that cross 16-token pages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run, run_many, tokens_of
from helpers import load_script, require_smollm2_gguf
from model_dirs import GENERATION_CONFIG, VOCAB_SIZE, hf_config, write_model_dir

from arle.model.loader import LoadedModel, load_model
from arle_kernels.quant import int_format

teacher_forced_logits = load_script("check_gpu_parity").teacher_forced_logits

transformers = pytest.importorskip("transformers")

#: None: the whole prompt in one chunk; 16: one page per chunk; 23: chunks straddle pages.
CHUNKS = (None, 16, 23)


def compare(ours: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Parity numbers of two [T, vocab] logit tensors (KL in float64: fp32 rounds it below 0)."""
    ours, ref = ours.double(), ref.double()
    lp_ref, lp_ours = ref.log_softmax(-1), ours.log_softmax(-1)
    kl = (lp_ref.exp() * (lp_ref - lp_ours)).sum(-1)
    top5 = [len(set(a.tolist()) & set(b.tolist())) / 5
            for a, b in zip(ours.topk(5).indices, ref.topk(5).indices, strict=True)]
    return {"max_diff": (ours - ref).abs().max().item(), "kl_mean": kl.mean().item(),
            "kl_max": kl.max().item(),
            "top1": (ours.argmax(-1) == ref.argmax(-1)).double().mean().item(),
            "top5": sum(top5) / len(top5)}


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _dtype_kwarg() -> dict[str, torch.dtype]:
    # transformers 5 renamed `torch_dtype` to `dtype`.
    major = int(transformers.__version__.split(".")[0])
    return {"dtype": torch.float32} if major >= 5 else {"torch_dtype": torch.float32}


# ---- the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) -----------------------------------

@pytest.fixture(scope="module")
def hf_smol() -> Any:
    """transformers' own GGUF loader and Llama code, fp32 (~13 s on 2 cores)."""
    path = require_smollm2_gguf()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, **_dtype_kwarg()).eval()


@pytest.fixture(scope="module")
def smol_prompts(smol: LoadedModel) -> dict[str, list[int]]:
    tok = smol.tokenizer

    def chat(text: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))

    return {
        "chat_short": chat("What is the capital of France?"),  # 37 tokens
        "chat_long": chat("Write a short poem about the sea, with rhymes, in four lines, and "
                          "explain the metaphor used in each line carefully."),  # 55
        "raw_repeat": tok.encode("The quick brown fox jumps over the lazy dog. " * 10),  # 101
        "raw_code": tok.encode(
            'def fibonacci(n):\n    """Return the n-th Fibonacci number, computed iteratively."""'
            "\n    if n < 2:\n        return n\n    a, b = 0, 1\n    for _ in range(n - 1):\n"
            "        a, b ="),  # 57
    }


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smol, hf_smol, smol_prompts):
    """fp32 against fp32, over the 4 prompts x 3 chunkings: max |diff| under 1e-3, KL(HF||arle)
    under 1e-9 on average and 1e-8 at most, the same top-1 and top-5. The bounds sit over 10x
    (diff) and 100x (KL) above what summation order gives; a wrong RoPE or q/k row order gives
    diffs of several units and KL ~0.1."""
    assert max(len(ids) for ids in smol_prompts.values()) > 6 * 16  # crosses several pages
    for name, ids in smol_prompts.items():
        assert 20 <= len(ids) <= 120, name
        ref = hf_logits(hf_smol, ids)
        for chunk in CHUNKS:
            got = compare(teacher_forced_logits(smol.model, ids, chunk_size=chunk), ref)
            where = f"{name} chunk={chunk}: {got}"
            assert got["max_diff"] < 1e-3, where
            assert got["kl_mean"] < 1e-9 and got["kl_max"] < 1e-8, where
            assert got["top1"] == 1.0, where
            assert got["top5"] >= 0.98, where


@pytest.fixture(scope="module")
def smol_int4() -> LoadedModel:
    """The default model as `arle` runs it on the CPU: Q4_1 as int4, the Q8_0 embedding as
    int8 per row."""
    return load_model(require_smollm2_gguf(), "auto", "cpu")


def test_default_model_stays_integer_unless_a_dtype_is_asked(smol, smol_int4):
    """`--dtype auto` on the CPU keeps the file's bits (every linear int4, the tied embedding
    int8); `--dtype float32` dequantizes everything (the `smol` fixture)."""
    formats = [type(int_format(p)).__name__ for p in smol_int4.model.parameters()]
    assert formats.count("Int4Format") == 4 * smol_int4.config.num_layers
    assert formats.count("Int8Format") == 1
    assert smol_int4.num_parameters == smol.num_parameters
    assert smol_int4.num_bytes < smol.num_bytes / 5
    assert all(int_format(p) is None for p in smol.model.parameters())


@pytest.mark.slow
def test_default_model_int4_logits_near_transformers(smol, smol_int4, hf_smol, smol_prompts):
    """The integer path against the same weights dequantized to fp32, in transformers (its
    GGUF loader) and in arle, over the 4 prompts x 3 chunkings. What it rounds: activations
    and every linear's output to bf16, the file's fp16 scales and zeros to bf16 (2e-3 of each
    weight), the Q8_0 embedding and head to int8 per row (1.2e-2); whole-prompt chunks also
    expand the int4 weights to bf16. Measured: KL mean <= 3.9e-3, max 2.1e-2, top-1 >= 0.94,
    top-5 >= 0.95 (max |diff| 1.7, logits span ~34); the bounds sit 2.5x above. A wrong zero
    point, group or nibble order gives KL over 1."""
    for name, ids in smol_prompts.items():
        ref_hf, ref_ours = hf_logits(hf_smol, ids), teacher_forced_logits(smol.model, ids)
        for chunk in CHUNKS:
            ours = teacher_forced_logits(smol_int4.model, ids, chunk_size=chunk)
            for ref_name, ref in (("transformers", ref_hf), ("arle fp32", ref_ours)):
                got = compare(ours, ref)
                where = f"{name} chunk={chunk} vs {ref_name}: {got}"
                assert got["kl_mean"] < 1e-2 and got["kl_max"] < 0.1, where
                assert got["top1"] >= 0.85 and got["top5"] >= 0.9, where


@pytest.mark.slow
async def test_smollm2_greedy_matches_transformers_generate(smol, hf_smol, smol_prompts,
                                                            make_engine):
    """24 greedy tokens, EOS ignored, through the whole engine (prefill, decode steps, cache).
    The smallest top-1/top-2 logit gap HF meets on these paths is 0.05: far above the ~1e-4
    difference between the two, so equality is not luck."""
    engine = make_engine(smol)
    # All four at once: one batch (prefills then decode rows together) keeps this test short.
    batch = await run_many(engine, list(smol_prompts.values()), max_tokens=24, ignore_eos=True)
    for (name, ids), deltas in zip(smol_prompts.items(), batch, strict=True):
        ours = tokens_of(deltas)
        out = hf_smol.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                               dtype=torch.long), do_sample=False, max_new_tokens=24,
                               eos_token_id=None, pad_token_id=smol.tokenizer.pad_token_id)
        assert ours == out[0, len(ids):].tolist(), name


# ---- small random checkpoints written by transformers --------------------------------------

#: id -> (architecture, config overrides, prompt length). Prompt lengths cross 16-token pages.
CASES: dict[str, tuple[str, dict[str, Any], int]] = {
    "qwen3": ("Qwen3ForCausalLM", {}, 70),
    "qwen3_tied": ("Qwen3ForCausalLM", {"tie_word_embeddings": True}, 70),
    "llama": ("LlamaForCausalLM", {"attention_bias": False}, 70),
    "llama_tied": ("LlamaForCausalLM", {"tie_word_embeddings": True}, 40),
    # attention_bias in Llama means q/k/v *and* o_proj biases
    "llama_bias": ("LlamaForCausalLM", {"attention_bias": True}, 40),
    "qwen2_bias": ("Qwen2ForCausalLM", {}, 70),  # q/k/v bias, none on o_proj
    "mistral": ("MistralForCausalLM", {"sliding_window": None}, 40),
    "linear": ("Qwen3ForCausalLM", {"rope_parameters": {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, 70),
    # original context 64 and head_dim 32: the three llama3 bands (kept, smoothed, divided) and
    # yarn's ramp (dims 0..5 of 16) all occur.
    "llama3": ("LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 500000.0}}, 70),
    "yarn": ("Qwen3ForCausalLM", {"max_position_embeddings": 256, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "rope_theta": 10000.0}}, 70),
    # NOTE: HF's dynamic NTK keeps the plain base inside the trained context and stretches it for
    # the current length past it; arle (as vLLM) stretches it once, for factor x that context.
    # The two agree exactly when HF sees a sequence of factor x max_position_embeddings tokens,
    # so compare there (64 = 2 x 32); inside the context they differ by design.
    "dynamic": ("Qwen3ForCausalLM", {"max_position_embeddings": 32, "rope_parameters": {
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, 64),
}


def random_ids(n: int, seed: int = 1) -> list[int]:
    # 259 = the tokenizer's 256 bytes + 3 specials; the embedding rows above it stay unused.
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every CASES checkpoint, written once (~0.1 s each after transformers is imported)."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, (arch, overrides, _) in CASES.items():
        out[name] = root / name
        write_model_dir(out[name], hf_config(arch, **overrides), seed=len(out))
    return out


def hf_from_dir(path: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(path, **_dtype_kwarg()).eval()


def test_checkpoints_are_sharded_with_index(hf_dirs):
    """The fixture really exercises the sharded path (an index naming several files)."""
    for path in hf_dirs.values():
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) >= 3
        assert not (path / "model.safetensors").exists()


@pytest.mark.parametrize("case", list(CASES))
def test_hf_checkpoint_logits_match_transformers(hf_dirs, case):
    """max |diff| under 1e-4 (logit std ~2.9) and mean KL under 1e-9 for every case and
    chunking: what summation order leaves. Dropping the rope scaling alone gives diffs of
    several units and KL above 0.05; skipping the RMSNorm weights fails every case."""
    arch, _, n = CASES[case]
    ours = load_model(hf_dirs[case], "float32")
    assert ours.config.architecture == arch
    ids = random_ids(n)
    ref = hf_logits(hf_from_dir(hf_dirs[case]), ids)
    for chunk in CHUNKS:
        got = compare(teacher_forced_logits(ours.model, ids, chunk_size=chunk), ref)
        where = f"chunk={chunk}: {got}"
        assert got["max_diff"] < 1e-4, where
        assert got["kl_mean"] < 1e-9, where
        assert got["top1"] == 1.0 and got["top5"] == 1.0, where


def test_tied_checkpoint_shares_embedding_and_head(hf_dirs):
    tied = load_model(hf_dirs["qwen3_tied"], "float32").model
    untied = load_model(hf_dirs["qwen3"], "float32").model
    assert tied.lm_head.weight.data_ptr() == tied.embed_tokens.weight.data_ptr()
    assert not torch.equal(untied.lm_head.weight, untied.embed_tokens.weight)


def test_yarn_without_original_context_defaults_like_transformers(hf_dirs, tmp_path):
    """transformers takes max_position_embeddings as the pretrained context when a yarn config
    omits original_max_position_embeddings; arle must too."""
    import shutil

    path = tmp_path / "yarn"
    shutil.copytree(hf_dirs["yarn"], path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["rope_parameters"]["original_max_position_embeddings"]
    cfg["max_position_embeddings"] = 64
    (path / "config.json").write_text(json.dumps(cfg))
    ids = random_ids(40)
    got = compare(teacher_forced_logits(load_model(path, "float32").model, ids),
                  hf_logits(hf_from_dir(path), ids))
    assert got["max_diff"] < 1e-4 and got["top1"] == 1.0, got


def test_mistral_sliding_window_caps_the_context(tmp_path):
    """arle has no sliding-window attention: it limits the context to the window, inside which
    full causal attention is what transformers' sliding mask computes too."""
    config = hf_config("MistralForCausalLM", sliding_window=48)
    write_model_dir(tmp_path, config)
    ours = load_model(tmp_path, "float32")
    assert ours.config.max_position_embeddings == 48
    ids = random_ids(48)
    got = compare(teacher_forced_logits(ours.model, ids, chunk_size=23),
                  hf_logits(hf_from_dir(tmp_path), ids))
    assert got["max_diff"] < 1e-4 and got["top1"] == 1.0, got


@pytest.mark.parametrize("case", ["qwen3", "qwen2_bias"])
async def test_hf_checkpoint_greedy_matches_transformers_generate(hf_dirs, case, make_engine):
    loaded = load_model(hf_dirs[case], "float32")
    engine = make_engine(loaded)
    hf = hf_from_dir(hf_dirs[case])
    for seed, n in ((2, 21), (3, 50)):
        ids = random_ids(n, seed)
        ours = tokens_of(await run(engine, ids, max_tokens=24, ignore_eos=True))
        # NOTE: generation_config.json's repetition_penalty would apply to HF's greedy too.
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, n, dtype=torch.long),
                          do_sample=False, max_new_tokens=24, eos_token_id=None, pad_token_id=0,
                          repetition_penalty=1.0)
        assert ours == out[0, n:].tolist()


async def test_generation_config_defaults_reach_the_engine(hf_dirs, make_engine):
    loaded = load_model(hf_dirs["qwen3"], "float32")
    engine = make_engine(loaded)
    hf_gen = transformers.GenerationConfig.from_pretrained(hf_dirs["qwen3"])
    params = engine.default_params()
    for key in ("temperature", "top_p", "top_k", "repetition_penalty"):
        assert getattr(params, key) == getattr(hf_gen, key) == GENERATION_CONFIG[key], key
    assert engine.default_params(temperature=0.0, top_k=None).temperature == 0.0
    assert engine.default_params(top_k=None).top_k == 20  # None means "not given"
    # every id generation_config lists ends generation (as HF's generate stops on any of them)
    assert set(hf_gen.eos_token_id) <= loaded.tokenizer.eos_token_ids
    assert loaded.config.vocab_size == VOCAB_SIZE


def test_bias_layout_follows_transformers(hf_dirs):
    """Qwen2: q/k/v biases only; Llama with attention_bias: o_proj's too. The fixture's biases
    and norm weights are far from zero/one, so skipping one would break the parity above."""
    qwen2 = dict(load_model(hf_dirs["qwen2_bias"], "float32").model.named_parameters())
    assert "layers.0.self_attn.qkv_proj.bias" in qwen2
    assert "layers.0.self_attn.o_proj.bias" not in qwen2
    llama = dict(load_model(hf_dirs["llama_bias"], "float32").model.named_parameters())
    assert "layers.0.self_attn.o_proj.bias" in llama
    assert (qwen2["layers.0.input_layernorm.weight"] - 1).abs().mean() > 0.1
    assert qwen2["layers.0.self_attn.qkv_proj.bias"].abs().mean() > 0.1
