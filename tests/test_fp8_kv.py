"""FP8 (e4m3) KV cache quality on a trained model: teacher-forced logits with the cache stored in
FP8 (one fp32 scale per token and KV head) against the same model with a float32 cache.

Runs the references of the CUDA kernels (the same quantisation and dequantisation math; the
kernel tests hold the kernels to these references) on the default model, on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from helpers import load_script

from arle.model.loader import LoadedModel

teacher_forced_logits = load_script("check_gpu_parity").teacher_forced_logits

TEXTS = [
    "The history of the Roman Empire spans many centuries, beginning with the founding of the "
    "city and ending with the fall of Constantinople. During this time, the empire",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n"
    "        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\nfor i in range(10):\n",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight "
    "to synthesize foods from carbon dioxide and water. The process generally involves",
]


@pytest.mark.slow
def test_fp8_kv_keeps_a_trained_models_predictions(smol: LoadedModel) -> None:
    top1, kl = [], []
    for text in TEXTS:
        ids = smol.tokenizer.encode(text, add_special_tokens=False)
        ref = teacher_forced_logits(smol.model, ids)
        for chunk in (None, 1):  # the extend path and the decode path
            fp8 = teacher_forced_logits(smol.model, ids, chunk_size=chunk,
                                        kv_dtype=torch.float8_e4m3fn)
            lr, lq = ref.log_softmax(-1), fp8.log_softmax(-1)
            kl.append((lr.exp() * (lr - lq)).sum(-1).mean().item())
            top1.append((ref.argmax(-1) == fp8.argmax(-1)).float().mean().item())
    # Measured: top-1 0.96-1.0, KL 2.5e-3-5e-3 per prompt. A wrong scale or a lost sign gives
    # KL of order 1; an unquantised cache gives exactly 0, so the check also sees the rounding.
    assert sum(top1) / len(top1) >= 0.95 and min(top1) >= 0.9, top1
    assert 1e-4 < max(kl) < 0.02, kl
