"""Teacher-forced logits of arle (bf16, Triton path) against transformers on the same weights.

    python scripts/check_gpu_parity.py MODEL_DIR --out parity.json [--prompts 4 --len 512]

Reference: transformers in float32. For scale, transformers' own bf16 run is compared with the
same reference: arle is right when its error is of the same size as transformers' bf16 error.
Also reports FP8 (e4m3) KV against bf16 KV (the quality check of --kv-cache-dtype fp8_e4m3).
Prefill in one chunk, in chunks of 64 (extend over a cached prefix), and token by token (the
decode kernel) over the last `--decode-len` positions.
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

from arle.executor.paged import teacher_forced_logits
from arle.model.loader import load_model


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
    args = p.parse_args()
    import transformers

    t0 = time.perf_counter()
    ours = load_model(args.model, "bfloat16", "cuda").model
    vocab = min(ours.config.vocab_size, 100_000)
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.len)] for _ in range(args.prompts)]
    results: dict[str, list[dict[str, float]]] = {}

    def add(name: str, m: dict[str, float]) -> None:
        results.setdefault(name, []).append(m)

    refs = []
    auto: Any = transformers.AutoModelForCausalLM  # its stubs mistype from_pretrained
    for dtype in (torch.float32, torch.bfloat16):
        hf = auto.from_pretrained(args.model, dtype=dtype)
        hf = hf.cuda().eval()
        with torch.no_grad():
            outs = [hf(torch.tensor([ids], device="cuda")).logits[0].float() for ids in prompts]
        del hf
        torch.cuda.empty_cache()
        if dtype == torch.float32:
            refs = outs
        else:
            for o, r in zip(outs, refs, strict=True):
                add("transformers_bf16_vs_fp32", compare(o, r))
            hf_bf16 = outs
    n = args.decode_len
    for ids, ref, hb in zip(prompts, refs, hf_bf16, strict=True):
        whole = teacher_forced_logits(ours, ids)
        add("arle_bf16_vs_transformers_fp32", compare(whole, ref))
        add("arle_bf16_vs_transformers_bf16", compare(whole, hb))
        add("arle_chunks64_vs_transformers_fp32",
            compare(teacher_forced_logits(ours, ids, chunk_size=64), ref))
        # token by token through the decode kernel: the last n positions (prefix prefilled)
        decode = teacher_forced_logits(ours, ids, chunk_size=1)[-n:]
        add("arle_decode_vs_transformers_fp32", compare(decode, ref[-n:]))
        fp8 = teacher_forced_logits(ours, ids, kv_dtype=torch.float8_e4m3fn)
        add("arle_fp8kv_vs_arle_bf16kv", compare(fp8, whole))
        add("arle_fp8kv_vs_transformers_fp32", compare(fp8, ref))
    summary = {k: _mean(v) for k, v in results.items()}
    out: dict[str, Any] = {"model": args.model, "prompts": args.prompts, "len": args.len,
                           "decode_len": n, "seconds": time.perf_counter() - t0,
                           "gpu": torch.cuda.get_device_name(), "summary": summary,
                           "per_prompt": results}
    Path(args.out).write_text(json.dumps(out, indent=1))
    for k, v in summary.items():
        print(f"{k:<40} " + "  ".join(f"{m} {x:.4g}" for m, x in v.items()))


if __name__ == "__main__":
    main()
