"""What the MoE and FP8-weight tests check on each tiny checkpoint: arle's logits and greedy
tokens against transformers on the same weights, and that `arle complete` / `arle serve` answer
from the directory as the engine does.

Imported as `moe_checks` (tests/ is on sys.path).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import torch
from conftest import run, tokens_of
from gpu_checks import assert_same_up_to_near_ties
from helpers import arle_env, load_script
from served import arle_server

from arle.model.loader import LoadedModel

teacher_forced_logits = load_script("check_gpu_parity").teacher_forced_logits

#: None: the whole prompt in one chunk; 16: one page per chunk; 23: chunks straddle pages.
CHUNKS = (None, 16, 23)
#: a prompt for the CLI and the server: 44 byte tokens, then 8 greedy ones
PROMPT = "Experts, routed: the top k of a softmax, sum."
NEW_TOKENS = 8


def random_ids(n: int, seed: int = 1) -> list[int]:
    # 259 = the tokenizer's 256 bytes + 3 specials; the embedding rows above it stay unused.
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


#: a tiny model's KV pool: sized, not a share of the GPU (on a GPU shared with other test
#: processes that share may not be free)
SMALL_KV = ("--kv-cache-tokens", "16384")


def hf_from_dir(path: Path) -> Any:
    """transformers' model of a directory in fp32; an FP8 one dequantized by transformers as it
    loads (on a machine with a GPU it would otherwise run its FP8 kernels, from the Hub)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, **load_script("bench_hf").fp8_dequantized(path)).eval()


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def assert_logits_match(loaded: LoadedModel, ref: Any, ids: list[int],
                        chunks: tuple[int | None, ...] = CHUNKS) -> float:
    """Teacher-forced logits of every chunking within 1e-4 of transformers' (fp32, same weights)
    with the same top-1 everywhere; returns the largest |diff| seen."""
    want = hf_logits(ref, ids)
    worst = 0.0
    for chunk in chunks:
        got = teacher_forced_logits(loaded.model, ids, chunk_size=chunk)
        diff = (got - want).abs().max().item()
        top1 = (got.argmax(-1) == want.argmax(-1)).double().mean().item()
        assert diff <= 1e-4 and top1 == 1.0, f"chunk={chunk}: max |diff| {diff}, top-1 {top1}"
        worst = max(worst, diff)
    return worst


def gpu_shape_overrides(arch: str) -> dict[str, Any]:
    """MOE_GPU_SHAPE's fields for `arch` (the expert ones only for an MoE)."""
    from model_dirs import MOE_GPU_SHAPE

    return {k: v for k, v in MOE_GPU_SHAPE.items() if arch.startswith("Qwen3Moe")
            or k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")}


def assert_fp8_near_twin(fp8: LoadedModel, twin: LoadedModel) -> None:
    """An FP8 model on CUDA (half the bytes of its bf16 twin) against that twin, teacher-forced
    token by token (W8A16 GEMVs: top-1 >= 95%, mean KL < 0.02, the FP8 KV test's bound), and in
    one chunk and in chunks of 37 (W8A8 GEMMs, activations quantised to e4m3 per token and 128
    columns: 3 mantissa bits. Measured on the H200 at KL 0.020 / top-1 94% dense and KL 0.036 /
    top-1 90% MoE, whose routing flips amplify it; bound: KL < 0.06, top-1 >= 85%. A wrong
    block scale or block index gives a KL above 1.)"""
    compare = load_script("check_gpu_parity").compare
    assert fp8.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert fp8.num_bytes < 0.6 * twin.num_bytes
    ids = random_ids(300)
    got = {chunk: compare(teacher_forced_logits(fp8.model, ids, chunk_size=chunk),
                          teacher_forced_logits(twin.model, ids, chunk_size=chunk))
           for chunk in (None, 37, 1)}
    bounds = {None: (0.85, 0.06), 37: (0.85, 0.06), 1: (0.95, 0.02)}
    for chunk, (top1, kl) in bounds.items():
        assert got[chunk]["top1"] >= top1 and got[chunk]["kl_mean"] < kl, (chunk, got)


def hf_greedy_with_margins(ref: Any, ids: list[int], n: int, repetition_penalty: float = 1.0
                           ) -> list[tuple[int, float]]:
    """transformers' greedy tokens, each with its top-2 margin in the scores it was picked
    from (after the repetition penalty)."""
    out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                       dtype=torch.long), do_sample=False, max_new_tokens=n, eos_token_id=None,
                       pad_token_id=0, repetition_penalty=repetition_penalty,
                       output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    top2 = [s[0].float().topk(2).values for s in out.scores]
    return [(t, (v[0] - v[1]).item()) for t, v in zip(tokens, top2, strict=True)]


def hf_greedy(ref: Any, ids: list[int], n: int, repetition_penalty: float = 1.0) -> list[int]:
    return [t for t, _ in hf_greedy_with_margins(ref, ids, n, repetition_penalty)]


async def assert_greedy_matches(loaded: LoadedModel, ref: Any, make_engine: Any) -> None:
    """24 greedy tokens through the engine (prefill, decode steps, cache), EOS ignored, equal to
    transformers' generate, for a short and a long (page-crossing) prompt."""
    engine = make_engine(loaded)
    for seed, n in ((2, 21), (3, 50)):
        ids = random_ids(n, seed)
        ours = tokens_of(await run(engine, ids, max_tokens=24, ignore_eos=True))
        assert ours == hf_greedy(ref, ids, 24), f"prompt of {n}"


def arle_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "arle", *args], env=arle_env(), capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


def cli_greedy(path: Path) -> tuple[list[int], str]:
    """`arle complete --raw` of PROMPT from the directory: its token ids and text."""
    proc = arle_cli("complete", "-m", str(path), PROMPT, "--raw", "--max-tokens",
                    str(NEW_TOKENS), "--ignore-eos", "--json", "--logprobs", "0", *SMALL_KV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["usage"]["completion_tokens"] == NEW_TOKENS, out
    return [lp["token_id"] for lp in out["logprobs"]], out["text"]


def served_greedy(path: Path, log: Path) -> str:
    """`arle serve` of the directory: the text of a greedy /v1/completions of PROMPT."""
    with arle_server(["--model", str(path), "--served-model-name", "m", *SMALL_KV],
                     log) as server:
        r = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": "m", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0,
            "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == NEW_TOKENS, body
    return str(body["choices"][0]["text"])


def assert_cli_and_server_answer(path: Path, ref: Any, log: Path) -> None:
    """`arle complete` answers with transformers' greedy tokens (the directory's
    generation_config repetition penalty applies to both) up to a bf16 near-tie (a GPU runs
    the model in bf16), and `arle serve` with the same text."""
    from arle.model.tokenizer import Tokenizer

    ids, text = cli_greedy(path)
    prompt_ids = Tokenizer.from_hf_dir(path).encode(PROMPT)
    penalty = json.loads((path / "generation_config.json").read_text())["repetition_penalty"]
    want = hf_greedy_with_margins(ref, prompt_ids, NEW_TOKENS, penalty)
    assert_same_up_to_near_ties(want, [(t, 0.0) for t in ids])
    assert served_greedy(path, log) == text
