"""`--quantization fp8`: a floating-point checkpoint's linears quantized at load to the FP8
releases' layout (128 x 128 block-scaled e4m3), run by the FP8 kernels.

The reference is transformers fp32 on the same weights rounded through FP8 (a twin checkpoint
holding dequant(quant(w)) for every converted linear). On the CPU the FP8 layout runs with
`_keeps_fp8` forced (the torch references computing), as in tests/test_fp8_weights.py; a plain
CPU load is refused, with the reason.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from model_dirs import hf_config, read_tensors, write_model_dir, write_tensors
from moe_checks import assert_logits_match, hf_from_dir, random_ids

from arle.errors import ModelLoadError
from arle.model import loader
from arle.model.loader import load_model
from arle.model.moe import SparseMoE
from arle.model.parallel import FP8
from arle_kernels.fp8_ref import FP8_MAX, fp8_dequant_ref, quantize_fp8_blocks

pytest.importorskip("transformers")

BLOCK = (128, 128)


@pytest.mark.parametrize("shape", [(256, 128), (300, 200), (40, 7)])
def test_block_quantization_rounds_each_weight_to_e4m3(shape: tuple[int, int]) -> None:
    """Each weight comes back within half an e4m3 step of its block's scale grid (3 mantissa
    bits: 2^-4 relative; below 2^-6, the subnormals' fixed step), each block's largest |w| maps
    to 448 exactly, and partial edge blocks get their own scale."""
    gen = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, generator=gen) * 3
    q, scale = quantize_fp8_blocks(w, BLOCK)
    assert q.dtype == FP8 and q.shape == w.shape
    assert scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    back = fp8_dequant_ref(q, scale, BLOCK)
    per = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:shape[0], :shape[1]]
    assert ((back - w).abs() <= w.abs() * 2**-4 + per * 2**-10).all()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            assert scale[i, j] == blk.abs().max() / FP8_MAX
    assert q.float().abs().max() == FP8_MAX


def _round_trip_twin(src: Path, dst: Path) -> Path:
    """A copy of the checkpoint whose converted linears (2-D weights of the decoder layers but
    the router gate) hold their FP8 round trip, in fp32."""
    shutil.copytree(src, dst)
    files = read_tensors(dst)
    for tensors in files.values():
        for name, t in tensors.items():
            if (name.startswith("model.layers.") and t.dim() == 2
                    and not name.endswith("mlp.gate.weight")):
                tensors[name] = fp8_dequant_ref(*quantize_fp8_blocks(t, BLOCK), BLOCK)
    write_tensors(dst, files)
    return dst


@pytest.fixture(scope="module")
def float_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """arch -> (a float checkpoint, its FP8 round-trip twin)."""
    root = tmp_path_factory.mktemp("quantize_fp8")
    out = {}
    for i, arch in enumerate(("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")):
        path = root / arch
        write_model_dir(path, hf_config(arch), seed=60 + i)
        out[arch] = (path, _round_trip_twin(path, root / f"{arch}_twin"))
    return out


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
def test_quantized_at_load_matches_transformers_on_the_rounded_weights(
        float_dirs: dict[str, tuple[Path, Path]], arch: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every linear of the layers FP8 with its block scales, the router gate, embeddings and
    lm_head as they were; the logits those of transformers on the FP8-rounded weights."""
    monkeypatch.setattr(loader, "_keeps_fp8", lambda device, block: True)
    path, twin = float_dirs[arch]
    loaded = load_model(path, "float32", quantization="fp8")
    params = dict(loaded.model.named_parameters())
    assert params["layers.0.self_attn.qkv_proj.weight"].dtype == FP8
    assert params["layers.0.self_attn.o_proj.weight_scale_inv"].dtype == torch.float32
    assert params["lm_head.weight"].dtype == params["embed_tokens.weight"].dtype == torch.float32
    mlp = loaded.model.layers[0].mlp
    if isinstance(mlp, SparseMoE):
        assert mlp.gate.weight.dtype == torch.float32
        assert mlp.experts.w13.dtype == mlp.experts.w2.dtype == FP8
    else:
        assert params["layers.0.mlp.down_proj.weight"].dtype == FP8
    assert_logits_match(loaded, hf_from_dir(twin), random_ids(70), chunks=(None, 23))


def test_quantization_fp8_is_refused_where_it_cannot_run(
        float_dirs: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    """On the CPU (no FP8 kernels), and for a GGUF file, with what to do instead."""
    path, _ = float_dirs["Qwen3ForCausalLM"]
    with pytest.raises(ModelLoadError, match="need a CUDA device"):
        load_model(path, "float32", quantization="fp8")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(gguf, quantization="fp8")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "Qwen3ForCausalLM"])
def test_quantized_at_load_on_cuda_against_the_rounded_twin(tmp_path: Path, arch: str) -> None:
    """On CUDA: FP8 weights (the memory plan sees under 0.6x the bf16 bytes) through the FP8
    kernels, against the FP8-rounded twin in bf16 (`assert_fp8_near_twin`'s bounds: those of
    an FP8 checkpoint against its dequantised twin)."""
    from moe_checks import assert_fp8_near_twin, gpu_shape_overrides

    path = tmp_path / "float"
    write_model_dir(path, hf_config(arch, **gpu_shape_overrides(arch)), seed=7,
                    max_shard_size="50MB")
    twin = _round_trip_twin(path, tmp_path / "twin")
    assert_fp8_near_twin(load_model(path, "bfloat16", "cuda", quantization="fp8"),
                         load_model(twin, "bfloat16", "cuda"))
