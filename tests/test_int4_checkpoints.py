"""4-bit safetensors checkpoints (AWQ's GEMM layout, GPTQ without act-order) on the CPU and in
the GPU's W4A16 layout: tiny random models written as AutoAWQ and AutoGPTQ pack them, against
their dequantized twins in transformers (fp32)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import load_script, run_interpreter_check
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


# ---- the GPU's layout (W4A16 kernels), run on the CPU by the torch reference --------------------

def _w4_loaded(path: Path, dtype: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The checkpoint as CUDA keeps it (`_keeps_int`, `_w4_layout` forced): W4A16 weights."""
    from arle.model import loader

    monkeypatch.setattr(loader, "_keeps_int", lambda *a, **k: True)
    monkeypatch.setattr(loader, "_w4_layout", lambda device: True)
    return load_model(path, dtype)


@pytest.mark.parametrize("case", [f"{m}-{a}-{g}" for m, a, g in CASES])
def test_w4a16_layout_near_transformers_on_the_twin(int4_dirs, case, monkeypatch):
    """Every linear held as the GPU holds it (int32 words, fp16 scale and offset per group)
    and its logits, fp32 activations through `w4_linear_ref`, near the twin's: the fp16
    scale and offset (a 2^-11 rounding each) are the only difference (measured KL < 1e-6)."""
    from arle_kernels.w4a16_ref import w4_format

    path, twin = int4_dirs[case]
    loaded = _w4_loaded(path, "float32", monkeypatch)
    w4 = [f for f in (w4_format(p) for p in loaded.model.parameters()) if f is not None]
    assert len(w4) == 4 * loaded.config.num_layers
    assert {f.group for f in w4} == {int(case.rsplit("-", 1)[1])}
    with torch.no_grad():
        ref = twin(torch.tensor([IDS])).logits[0].float()
    for chunk in (None, 1):
        kl_mean, kl_max, top1 = _kl_top1(teacher_forced_logits(loaded.model, IDS,
                                                               chunk_size=chunk), ref)
        assert kl_mean < 1e-5 and kl_max < 1e-4 and top1 == 1.0, (chunk, kl_mean, kl_max)


def interp_check_w4a16_model() -> None:
    """Under TRITON_INTERPRET=1: an AWQ checkpoint in the GPU's layout through the Triton ops
    (the W4A16 GEMV for one-token chunks, the GEMM for the prompt) gives the torch references'
    logits (fp32 activations)."""
    import tempfile
    from dataclasses import replace

    from arle.model import loader
    from arle_kernels import gemv
    from arle_kernels.ops import triton_ops

    loader._keeps_int = lambda *a, **k: True  # type: ignore[assignment]
    loader._w4_layout = lambda device: True  # type: ignore[assignment]
    # NOTE: 16 rows a GEMV program, not 1: the interpreter runs programs one by one in Python
    # (the chosen tiles are test_kernels_w4a16's)
    chosen = gemv.w4_gemv_config
    gemv.w4_gemv_config = (  # type: ignore[assignment]
        lambda m, n, k, glu=False: replace(chosen(m, n, k, glu), block_n=16))
    with tempfile.TemporaryDirectory() as tmp:
        write_int4_model_dir(Path(tmp) / "q", hf_config("Qwen3ForCausalLM"), Path(tmp) / "twin",
                             "awq", 128)
        loaded = load_model(Path(tmp) / "q", "float32")
    ids = IDS[:12]
    want = {c: teacher_forced_logits(loaded.model, ids, chunk_size=c) for c in (None, 1)}
    loaded.model.ops = triton_ops()
    for chunk, ref in want.items():
        got = teacher_forced_logits(loaded.model, ids, chunk_size=chunk)
        assert (got - ref).abs().max().item() < 1e-3, (chunk, (got - ref).abs().max())


def test_w4a16_model_through_the_triton_kernels_under_the_interpreter():
    run_interpreter_check("test_int4_checkpoints", "interp_check_w4a16_model")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", [f"{m}-{a}-{g}" for m, a, g in CASES])
def test_w4a16_on_cuda_near_the_twin(int4_dirs, case):
    """On CUDA the weights stay 4-bit (W4A16 kernels, bf16 activations): logits against the
    twin in transformers fp32, teacher-forced in one chunk (the GEMM) and token by token (the
    GEMV): bf16's roundings, the int4-on-CPU test's bounds."""
    from arle_kernels.w4a16_ref import w4_format

    path, twin = int4_dirs[case]
    loaded = load_model(path, "bfloat16", "cuda")
    assert sum(w4_format(p) is not None for p in loaded.model.parameters()) == \
        4 * loaded.config.num_layers
    with torch.no_grad():
        ref = twin(torch.tensor([IDS])).logits[0].float()
    for chunk in (None, 7, 1):
        kl_mean, kl_max, top1 = _kl_top1(teacher_forced_logits(loaded.model, IDS,
                                                               chunk_size=chunk).cpu(), ref)
        assert kl_mean < 2e-3 and kl_max < 7e-3 and top1 >= 0.9, (chunk, kl_mean, kl_max, top1)


@pytest.mark.slow
def test_random_awq_model_loads_as_a_release(tmp_path):
    """make_random_model.py's `tiny-awq` (the layout its `qwen3-4b-awq` has, for the GPU
    figures): every projection stays int4 at group 128, and its greedy tokens equal those of
    the same checkpoint dequantized."""
    mrm = load_script("make_random_model")
    mrm.main(["tiny-awq", str(tmp_path / "m")])
    loaded = load_model(tmp_path / "m", "auto")
    int4 = [f for f in (int_format(p) for p in loaded.model.parameters())
            if isinstance(f, Int4Format)]
    assert len(int4) == 4 * loaded.config.num_layers and {f.group for f in int4} == {128}
    full = load_model(tmp_path / "m", "float32")
    ids = IDS[:20]
    kl_mean, _, top1 = _kl_top1(teacher_forced_logits(loaded.model, ids),
                                teacher_forced_logits(full.model, ids))
    assert kl_mean < 2e-3 and top1 >= 0.9, (kl_mean, top1)
