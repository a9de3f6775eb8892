"""4-bit safetensors checkpoints (AWQ's GEMM layout, GPTQ without act-order) on the CPU: tiny
random models written as AutoAWQ and AutoGPTQ pack them, against their dequantized twins in
transformers (fp32)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import load_script
from model_dirs import hf_config, write_int4_model_dir

from arle.errors import ModelLoadError
from arle.model.loader import load_model
from arle_kernels.quant import Int4Format, int_format

transformers = pytest.importorskip("transformers")
teacher_forced_logits = load_script("check_gpu_parity").teacher_forced_logits

CASES = [("awq", "Qwen3ForCausalLM", 128), ("gptq", "LlamaForCausalLM", 128),
         ("gptq", "Qwen3ForCausalLM", 32)]


@pytest.fixture(scope="module")
def int4_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """(method, arch, group) -> (checkpoint dir, transformers model of the dequantized twin)."""
    out = {}
    for method, arch, group in CASES:
        root = tmp_path_factory.mktemp(f"{method}-{arch}-{group}")
        write_int4_model_dir(root / "q", hf_config(arch), root / "twin", method, group)
        twin = transformers.AutoModelForCausalLM.from_pretrained(root / "twin").float().eval()
        out[f"{method}-{arch}-{group}"] = (root / "q", twin)
    return out


def _kl_top1(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    lp_ref, lp = ref.double().log_softmax(-1), ours.double().log_softmax(-1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
    return kl.mean().item(), kl.max().item(), (ours.argmax(-1) == ref.argmax(-1)).double().mean().item()


IDS = [5, 77, 300, 12, 99, 256, 1, 45, 200, 13] * 5


@pytest.mark.parametrize("case", [f"{m}-{a}-{g}" for m, a, g in CASES])
def test_dequantized_matches_transformers_on_the_twin(int4_dirs, case):
    """--dtype float32 unpacks the checkpoint to the twin's weights exactly: logits to fp32
    summation order (max |diff| 1e-4). A wrong nibble order, zero offset or group gives
    diffs of whole units."""
    path, twin = int4_dirs[case]
    loaded = load_model(path, "float32")
    assert all(int_format(p) is None for p in loaded.model.parameters())
    with torch.no_grad():
        ref = twin(torch.tensor([IDS])).logits[0].float()
    got = teacher_forced_logits(loaded.model, IDS)
    assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("case", [f"{m}-{a}-{g}" for m, a, g in CASES])
def test_int4_logits_near_transformers_on_the_twin(int4_dirs, case):
    """--dtype auto keeps every linear int4 (its group: the checkpoint's) and its logits stay
    near the twin's: bf16 activations, outputs, scales and zeros (a 2^-9 rounding each) give
    KL mean 1.2-1.6e-4, max 4.4e-4, top-1 0.96-1 (measured, 50 positions); the whole prompt
    in one chunk (the bf16 expansion: W and its offset zero - 8 scale rounded once more) up
    to 7e-4 and 2.2e-3 (AWQ). The bounds sit about 3x above that, one flipped near-tie in 10
    allowed. A wrong nibble order or zero point gives KL over 0.1."""
    path, twin = int4_dirs[case]
    loaded = load_model(path, "auto")
    fmts = [int_format(p) for p in loaded.model.parameters()]
    int4 = [f for f in fmts if isinstance(f, Int4Format)]
    assert len(int4) == 4 * loaded.config.num_layers
    assert {f.group for f in int4} == {int(case.rsplit("-", 1)[1])}
    with torch.no_grad():
        ref = twin(torch.tensor([IDS])).logits[0].float()
    for chunk in (None, 7, 1):
        kl_mean, kl_max, top1 = _kl_top1(teacher_forced_logits(loaded.model, IDS,
                                                               chunk_size=chunk), ref)
        assert kl_mean < 2e-3 and kl_max < 7e-3 and top1 >= 0.9, (chunk, kl_mean, kl_max, top1)


def _with_quantization(src: Path, dst: Path, **changes: Any) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_act_order_gptq_is_refused_with_the_reason(int4_dirs, tmp_path):
    path = _with_quantization(int4_dirs["gptq-LlamaForCausalLM-128"][0], tmp_path / "m",
                              desc_act=True)
    with pytest.raises(ModelLoadError, match=r"'gptq' with desc_act \(act-order\).*g_idx"):
        load_model(path)


def test_g_idx_out_of_order_is_refused(int4_dirs, tmp_path):
    """A checkpoint whose g_idx is not row // group (act-order under a desc_act false
    config) is refused by name, not read wrong."""
    from model_dirs import read_tensors, write_tensors

    path = Path(shutil.copytree(int4_dirs["gptq-LlamaForCausalLM-128"][0], tmp_path / "m"))
    files = read_tensors(path)
    for tensors in files.values():
        for name in [n for n in tensors if n.endswith("down_proj.g_idx")]:
            tensors[name] = tensors[name].flip(0).contiguous()
    write_tensors(path, files)
    with pytest.raises(ModelLoadError, match="down_proj: g_idx is not row // group_size"):
        load_model(path)


@pytest.mark.parametrize(("changes", "says"), [({"bits": 8}, "bits 8"),
                                               ({"group_size": -1}, "group_size -1")])
def test_unread_settings_are_refused_by_name(int4_dirs, tmp_path, changes, says):
    path = _with_quantization(int4_dirs["awq-Qwen3ForCausalLM-128"][0], tmp_path / "m",
                              **changes)
    with pytest.raises(ModelLoadError, match=f"'awq' with {says}"):
        load_model(path)
