"""Teacher-forced logits of arle (bf16, Triton path) against transformers on the same weights.

    python scripts/check_gpu_parity.py MODEL --out parity.json [--prompts 4 --len 512]

MODEL: a Hugging Face directory (random weights: random token ids as prompts, `--prompts` of
`--len` tokens) or a GGUF file (transformers dequantizes it as arle does; trained weights:
English prompts, chat-templated questions and plain text, `TEXTS`). Reference: transformers
in float32. For scale, transformers' own bf16 run is compared with the same reference: arle
is right when its error is of the same size as transformers' bf16 error (a block-FP8 checkpoint:
transformers on its dequantized twin, `dequantized_twin`). Also reports FP8
(e4m3) KV against bf16 KV (the quality check of --kv-cache-dtype fp8_e4m3). Prefill in one
chunk, in chunks of 64 (extend over a cached prefix), and token by token (the decode kernel)
over the last `--decode-len` positions.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stamp import stamp

from arle.executor.paged import DeviceStep, KVCache, PagedAttention, StatePool
from arle.model.decoder import DecoderLM
from arle.model.loader import LoadedModel, load_model
from arle_kernels.decode_attention import pick_num_splits

#: Questions (chat-templated) and plain text, for a model with trained weights.
QUESTIONS = (
    "What is the capital of France?",
    "Write a short poem about the sea, with rhymes, in four lines, and explain the metaphor "
    "used in each line.",
    "Explain how a hash table works and when it is a poor choice.",
)
TEXTS = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in "
    "Germany and France built wooden machines that riders pushed along with their feet. Pedals "
    "came later, fixed to the front wheel, and the wheel grew larger so that one turn of the "
    "pedals carried the rider further. The result, the penny-farthing, was fast but dangerous: "
    "a rider sat high above the road and fell forward at the smallest obstacle. The safety "
    "bicycle of the 1880s solved this with two wheels of equal size and a chain that drove the "
    "rear wheel, and within a decade it had become a common sight in the cities of Europe.",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
    "    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n"
    "        else:\n            out.append(b[j])\n            j += 1\n"
    "    out.extend(a[i:])\n    out.extend(b[j:])\n    return out\n\n\n"
    "def test_merge_sorted():\n    assert merge_sorted([1, 3, 5], [2, 4]) == [1, 2, 3, 4, 5]\n",
    "Photosynthesis is the process by which green plants turn light into chemical energy. In "
    "the chloroplasts, chlorophyll absorbs mostly red and blue light, and the energy splits "
    "water molecules, releasing oxygen. The hydrogen and the energy captured are then used to "
    "turn carbon dioxide from the air into sugars, which the plant uses to grow. Nearly all "
    "the oxygen in the atmosphere, and most of the food that animals eat, comes from this "
    "process, which is why forests and oceans matter so much to the climate.",
)


def teacher_forced_logits(model: DecoderLM, token_ids: list[int], page_size: int = 16,
                          chunk_size: int | None = None, kv_dtype: torch.dtype | None = None
                          ) -> torch.Tensor:
    """Logits [T, vocab] (float32) at every position of `token_ids`, through the engine's path
    with the model's kernels (`model.ops`): prefilled in chunks of `chunk_size` (each chunk an
    extend row over the cached prefix); chunk_size 1 runs every token through decode attention
    instead. A hybrid model's recurrent state carries from chunk to chunk in slot 0. For parity
    checks against other implementations."""
    cfg = model.config
    device = next(model.parameters()).device
    dtype = model.dtype
    n = len(token_ids)
    num_pages = -(-n // page_size)
    kv = KVCache.for_model(cfg, num_pages, page_size, kv_dtype or dtype, device)
    state = StatePool.for_model(cfg, 2, 0, dtype, device)
    row_slot = torch.zeros(1, dtype=torch.int32, device=device)
    # NOTE: pages in reverse order, so a wrong page-table lookup cannot pass by accident.
    table = torch.arange(num_pages - 1, -1, -1, dtype=torch.int32, device=device)[None]
    rotary = model.rotary_table(n)
    ids = torch.tensor(token_ids, dtype=torch.int32, device=device)
    chunk = chunk_size or n
    out = []
    with torch.inference_mode():
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            pos = torch.arange(start, end, dtype=torch.int32, device=device)
            slots = table[0, pos // page_size] * page_size + pos % page_size
            decode = chunk == 1
            cu = [0] if decode else [0, end - start]  # the extend rows' (none when decoding)
            step = DeviceStep(ids[start:end], pos, slots,
                              torch.tensor([end], dtype=torch.int32, device=device),
                              torch.tensor(cu, dtype=torch.int32, device=device),
                              table, num_decode=1 if decode else 0, max_q_len=end - start,
                              num_splits=pick_num_splits(1, cfg.num_kv_heads, end),
                              slots=row_slot)
            backend = PagedAttention(kv, step, rotary, model, state, page_size)
            out.append(model.logits(model(step.input_ids, backend)))
    return torch.cat(out)


def text_prompts(loaded: LoadedModel) -> list[list[int]]:
    """`QUESTIONS` in the model's chat template, then `TEXTS`, then the texts twice over as
    one (~800 tokens: the decode kernel splits its context), as token ids."""
    tok = loaded.tokenizer
    return ([tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
             for q in QUESTIONS] + [tok.encode(t) for t in (*TEXTS, "\n\n".join(TEXTS * 2))])


def hf_model(model: str | Path, dtype: torch.dtype) -> Any:
    """transformers' model of the same weights (a directory, or a GGUF that it dequantizes),
    on the GPU."""
    import transformers

    path = Path(model)
    auto: Any = transformers.AutoModelForCausalLM  # its stubs mistype from_pretrained
    if path.suffix == ".gguf":
        hf = auto.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:  # straight onto the GPU: an FP8 checkpoint keeps its FP8 path only there
        hf = auto.from_pretrained(str(path), dtype=dtype, device_map="cuda")
    return hf.cuda().eval()


def dequantized_twin(model: Path, out: Path) -> Path:
    """A block-FP8 checkpoint's twin with every weight dequantized to bf16 (weight x its
    block's scale) and no quantization_config: the reference's weights are the values arle's
    FP8 kernels hold. (The random checkpoints' scales are powers of two: this is exact.)"""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((model / "config.json").read_text())
    block = cfg.pop("quantization_config")["weight_block_size"]
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in model.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(str(f))
            for name in [n for n in tensors if n.endswith(".weight_scale_inv")]:
                w = name[: -len("_scale_inv")]
                scale = tensors.pop(name).repeat_interleave(block[0], 0)
                scale = scale.repeat_interleave(block[1], 1)
                rows, cols = tensors[w].shape
                tensors[w] = (tensors[w].float() * scale[:rows, :cols]).to(torch.bfloat16)
            save_file(tensors, str(out / f.name))
        elif f.is_file() and f.name not in ("config.json", "model.safetensors.index.json"):
            (out / f.name).write_bytes(f.read_bytes())
    index = model / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {k: v for k, v in data["weight_map"].items()
                              if not k.endswith("_scale_inv")}
        (out / index.name).write_text(json.dumps(data))
    return out


def is_fp8(model: str | Path) -> bool:
    path = Path(model)
    if path.suffix == ".gguf":
        return False
    cfg = json.loads((path / "config.json").read_text())
    return cfg.get("quantization_config", {}).get("quant_method") == "fp8"


def hf_logits(hf: Any, prompts: list[list[int]]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [hf(torch.tensor([ids], device="cuda")).logits[0].float() for ids in prompts]


def compare(logits: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    a, b = logits.float(), ref.float()
    la, lb = a.log_softmax(-1), b.log_softmax(-1)
    return {"max_abs": (a - b).abs().max().item(), "rel": ((a - b).norm() / b.norm()).item(),
            "kl_mean": (lb.exp() * (lb - la)).sum(-1).mean().item(),
            "top1": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
            "top5_overlap": _topk_overlap(a, b, 5)}


def _topk_overlap(a: torch.Tensor, b: torch.Tensor, k: int) -> float:
    ta, tb = a.topk(k, -1).indices, b.topk(k, -1).indices
    return (ta[:, :, None] == tb[:, None, :]).any(-1).float().mean().item()


def _mean(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: (max if k == "max_abs" else lambda v: sum(v) / len(v))([r[k] for r in rows])
            for k in rows[0]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--len", type=int, default=512)
    p.add_argument("--decode-len", type=int, default=64)
    p.add_argument("--twin-dir", default="/tmp/fp8_twin",
                   help="where an FP8 checkpoint's dequantized reference is written")
    args = p.parse_args()

    t0 = time.perf_counter()
    loaded = load_model(args.model, "bfloat16", "cuda")
    ours = loaded.model
    if Path(args.model).suffix == ".gguf":
        prompts = text_prompts(loaded)
    else:
        vocab = min(ours.config.vocab_size, 100_000)
        rng = random.Random(0)
        prompts = [[rng.randrange(vocab) for _ in range(args.len)] for _ in range(args.prompts)]
    results: dict[str, list[dict[str, float]]] = {}

    skipped: dict[str, str] = {}  # comparisons that could not run here, and why

    def add(name: str, m: dict[str, float]) -> None:
        results.setdefault(name, []).append(m)

    refs: list[torch.Tensor] = []
    hf_bf16: list[torch.Tensor] = []
    # NOTE: an FP8 checkpoint's reference is transformers on its dequantized twin: the fp32 run
    # is then exact arithmetic on arle's weight values, and arle's own error is its activations'
    reference = (dequantized_twin(Path(args.model), Path(args.twin_dir)) if is_fp8(args.model)
                 else Path(args.model))
    for dtype in (torch.float32, torch.bfloat16):
        hf = hf_model(reference, dtype)
        outs = hf_logits(hf, prompts)
        del hf
        torch.cuda.empty_cache()
        if dtype == torch.float32:
            refs = outs
        else:
            for o, r in zip(outs, refs, strict=True):
                add("transformers_bf16_vs_fp32", compare(o, r))
            hf_bf16 = outs
    if reference != Path(args.model):
        # the yardstick of an FP8 checkpoint: transformers' own FP8 path (W8A8, activations
        # quantized per token and 128 columns, as arle's prefill GEMMs) against the same reference
        # NOTE: that path needs the `kernels` package (fetched from the Hub): without it the
        # run goes on with the dequantized twin's bf16 error as the yardstick, and says why
        try:
            hf = hf_model(args.model, torch.bfloat16)
            for o, r in zip(hf_logits(hf, prompts), refs, strict=True):
                add("transformers_fp8_vs_fp32", compare(o, r))
            del hf
        except ImportError as e:
            skipped["transformers_fp8"] = str(e).splitlines()[0]
            print(f"transformers' FP8 path skipped: {skipped['transformers_fp8']}")
        torch.cuda.empty_cache()
    for ids, ref, hb in zip(prompts, refs, hf_bf16, strict=True):
        n = min(args.decode_len, len(ids))
        whole = teacher_forced_logits(ours, ids)
        add("arle_bf16_vs_transformers_fp32", compare(whole, ref))
        add("arle_bf16_vs_transformers_bf16", compare(whole, hb))
        add("arle_chunks64_vs_transformers_fp32",
            compare(teacher_forced_logits(ours, ids, chunk_size=64), ref))
        # token by token through the decode kernel: the last n positions (prefix prefilled)
        decode = teacher_forced_logits(ours, ids, chunk_size=1)[-n:]
        add("arle_decode_vs_transformers_fp32", compare(decode, ref[-n:]))
        # the same positions through the prefill path (FP8: W8A8 GEMMs) and the decode path
        # (FP8: W8A16 GEMVs)
        add("arle_decode_vs_arle_prefill", compare(decode, whole[-n:]))
        fp8 = teacher_forced_logits(ours, ids, kv_dtype=torch.float8_e4m3fn)
        add("arle_fp8kv_vs_arle_bf16kv", compare(fp8, whole))
        add("arle_fp8kv_vs_transformers_fp32", compare(fp8, ref))
    summary = {k: _mean(v) for k, v in results.items()}
    out: dict[str, Any] = {**stamp(), "model": args.model, "reference": str(reference), "prompts": len(prompts),
                           "prompt_lens": [len(ids) for ids in prompts],
                           "decode_len": args.decode_len, "seconds": time.perf_counter() - t0,
                           "gpu": torch.cuda.get_device_name(), "summary": summary,
                           "skipped": skipped, "per_prompt": results}
    Path(args.out).write_text(json.dumps(out, indent=1))
    for k, v in summary.items():
        print(f"{k:<40} " + "  ".join(f"{m} {x:.4g}" for m, x in v.items()))


if __name__ == "__main__":
    main()
