"""Block-scaled FP8 checkpoints (the Qwen FP8 releases' format) against transformers.

Tiny random Qwen3-MoE and dense Qwen3 checkpoints quantized by the test helper
(`write_fp8_model_dir`: power-of-two scales per block, partial edge blocks, scales stored
before and after their weights). The reference is transformers fp32 on the dequantised weights:
a twin checkpoint that holds them, and, where every dimension is a whole number of blocks
(transformers derives the block from the grid, so it cannot read partial edge blocks), the FP8
directory itself, which transformers dequantises on a machine without a GPU.

On the CPU arle dequantises at load; on CUDA it keeps the weights FP8. That second layout runs
here too (`_keeps_fp8` forced, the torch references computing): its loaders and scale grids are
the GPU's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import load_script, run_interpreter_check
from model_dirs import (
    FP8_BLOCK,
    hf_config,
    qwen3_5_moe_config,
    read_tensors,
    write_fp8_model_dir,
    write_qwen3_5_moe_dir,
    write_tensors,
)
from moe_checks import (
    arle_cli,
    assert_cli_and_server_answer,
    assert_fp8_near_twin,
    assert_greedy_matches,
    assert_logits_match,
    gpu_shape_overrides,
    hf_from_dir,
    hf_logits,
    random_ids,
    teacher_forced_logits,
)

from arle.errors import ModelLoadError
from arle.model import loader
from arle.model.loader import load_model
from arle.model.moe import SparseMoE
from arle.model.parallel import FP8

transformers = pytest.importorskip("transformers")

#: id -> (architecture, config overrides, block). "edge": partial blocks (hidden 128 is 2 x 48
#: + 32 columns; expert width 40 is 32 + 8 rows); "exact": every dimension whole blocks.
CASES: dict[str, tuple[str, dict[str, Any], tuple[int, int]]] = {
    "moe_edge": ("Qwen3MoeForCausalLM", {}, FP8_BLOCK),
    "dense_edge": ("Qwen3ForCausalLM", {}, FP8_BLOCK),
    "moe_exact": ("Qwen3MoeForCausalLM", {"moe_intermediate_size": 64}, (32, 32)),
    "dense_exact": ("Qwen3ForCausalLM", {}, (32, 32)),
}


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """case -> (the FP8 checkpoint, its dequantised twin)."""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for i, (name, (arch, overrides, block)) in enumerate(CASES.items()):
        out[name] = (root / name, root / f"{name}_dequantised")
        write_fp8_model_dir(out[name][0], hf_config(arch, **overrides), out[name][1], block,
                            seed=30 + i)
    return out


def test_checkpoints_hold_fp8_weights_with_scales_in_both_orders(fp8_dirs: Any) -> None:
    path, _ = fp8_dirs["moe_edge"]
    files = read_tensors(path)
    flat = {k: v for ts in files.values() for k, v in ts.items()}
    where = {k: f for f, ts in files.items() for k in ts}
    fp8 = [k for k, v in flat.items() if v.dtype == torch.float8_e4m3fn]
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in fp8
    assert all(f"{k}_scale_inv" in flat for k in fp8)
    assert not any(k in fp8 for k in ("lm_head.weight", "model.layers.0.mlp.gate.weight"))
    # the scales file sorts first: its scales are read before their weights, the others after
    early = sorted(where.values())[0]
    assert 0 < sum(where[f"{k}_scale_inv"] == early for k in fp8) < len(fp8)
    # partial edge blocks: 40 expert rows in 2 blocks of 32, 128 columns in 3 of 48
    assert flat["model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv"].shape == (2, 3)


class _Events:
    """Stands in for a module's logger: the events it was given."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_logits_match_transformers(fp8_dirs: Any, case: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Against transformers on the dequantised twin; for the exact-block cases also against
    transformers' own dequantisation of the FP8 directory (identical logits: the same weights).
    Within fp32 summation order: max |diff| under 1e-4, the same top-1."""
    path, twin = fp8_dirs[case]
    log = _Events()
    monkeypatch.setattr(loader, "log", log)
    loaded = load_model(path, "float32")
    said = [fields for event, fields in log.events if event == "fp8_weights_dequantized"]
    assert len(said) == 1 and said[0]["dtype"] == "float32", log.events  # one log line
    assert all(p.dtype == torch.float32 for p in loaded.model.parameters())
    ref = hf_from_dir(twin)
    ids = random_ids(70)
    assert_logits_match(loaded, ref, ids)
    if case.endswith("exact"):
        assert torch.equal(hf_logits(hf_from_dir(path), ids), hf_logits(ref, ids))


@pytest.mark.parametrize("case", ["moe_edge", "moe_exact", "dense_edge"])
def test_fp8_kept_as_on_cuda(fp8_dirs: Any, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA layout: FP8 weights and fp32 scales (block rows, or one scale row per weight
    row where merged shards do not meet on a block boundary: width 40 in blocks of 32), the
    router gate and lm_head unquantized; computed by the FP8 torch references."""
    monkeypatch.setattr(loader, "_keeps_fp8", lambda device, block: True)
    path, twin = fp8_dirs[case]
    loaded = load_model(path, "float32")
    params = dict(loaded.model.named_parameters())
    assert params["layers.0.self_attn.qkv_proj.weight"].dtype == FP8
    assert params["layers.0.self_attn.qkv_proj.weight_scale_inv"].dtype == torch.float32
    assert params["lm_head.weight"].dtype == torch.float32
    mlp = loaded.model.layers[0].mlp
    if isinstance(mlp, SparseMoE):
        assert mlp.gate.weight.dtype == torch.float32
        assert mlp.experts.w13.dtype == mlp.experts.w2.dtype == FP8
        bn, bk = CASES[case][2]
        assert mlp.experts.block == ((1, bk) if case == "moe_edge" else (bn, bk))
    assert_logits_match(loaded, hf_from_dir(twin), random_ids(70), chunks=(None, 23))


def test_modules_to_not_convert_stay_unquantized(fp8_dirs: Any, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Where FP8 is kept, a module that `modules_to_not_convert` names (transformers' rule: from
    the start to a dot boundary, or a suffix) holds the compute dtype (its checkpoint weight,
    quantized here, is dequantised at load); "mlp.gate" does not name "mlp.gate_proj"."""
    monkeypatch.setattr(loader, "_keeps_fp8", lambda device, block: True)
    path, twin = fp8_dirs["dense_edge"]
    path = Path(shutil.copytree(path, tmp_path / "model"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = [
        "lm_head", "model.layers.0.self_attn.o_proj", "down_proj", "mlp.gate"]
    (path / "config.json").write_text(json.dumps(cfg))
    loaded = load_model(path, "float32")
    dtypes = {n: p.dtype for n, p in loaded.model.named_parameters()}
    assert dtypes["layers.0.self_attn.o_proj.weight"] == torch.float32
    assert dtypes["layers.1.self_attn.o_proj.weight"] == FP8
    assert dtypes["layers.1.mlp.down_proj.weight"] == torch.float32
    assert dtypes["layers.1.mlp.gate_up_proj.weight"] == FP8
    assert "layers.0.self_attn.o_proj.weight_scale_inv" not in dtypes
    assert_logits_match(loaded, hf_from_dir(twin), random_ids(70), chunks=(23,))


def test_fp8_kept_where_the_kernels_take_the_block() -> None:
    """On CUDA, blocks whose columns the FP8 kernels step through (powers of two from 16: the
    releases' 128 x 128); other blocks are dequantised at load, as on the CPU."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert loader._keeps_fp8(cuda, (128, 128)) and loader._keeps_fp8(cuda, (32, 32))
    assert not loader._keeps_fp8(cuda, FP8_BLOCK) and not loader._keeps_fp8(cuda, (128, 8))
    assert not loader._keeps_fp8(cpu, (128, 128))


@pytest.mark.parametrize("case", ["moe_edge", "dense_edge"])
async def test_fp8_greedy_matches_transformers_generate(fp8_dirs: Any, case: str,
                                                        make_engine: Any) -> None:
    path, twin = fp8_dirs[case]
    await assert_greedy_matches(load_model(path, "float32"), hf_from_dir(twin), make_engine)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["moe_edge", "dense_edge"])
def test_cli_and_server_answer_from_an_fp8_directory(fp8_dirs: Any, case: str,
                                                     tmp_path: Path) -> None:
    path, twin = fp8_dirs[case]
    assert_cli_and_server_answer(path, hf_from_dir(twin), tmp_path / "serve.log")


@pytest.fixture(scope="module")
def q35_moe_fp8(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Qwen3.5-MoE in block FP8 (published multimodal layout), and its twin."""
    root = tmp_path_factory.mktemp("qwen3_5_moe_fp8")
    config = qwen3_5_moe_config("Qwen3_5MoeForConditionalGeneration")
    write_fp8_model_dir(root / "fp8", config, root / "twin", FP8_BLOCK, seed=41,
                        write=write_qwen3_5_moe_dir)
    return root / "fp8", root / "twin"


def test_qwen3_5_moe_fp8_logits_match_transformers(q35_moe_fp8: tuple[Path, Path]) -> None:
    """The hybrid MoE's FP8 weights (attention, Gated DeltaNet's in_proj_qkv / in_proj_z /
    out_proj, experts, the shared expert) dequantised at load: logits within 1e-4 of
    transformers' on the dequantised twin."""
    path, twin = q35_moe_fp8
    flat = {k: v for ts in read_tensors(path).values() for k, v in ts.items()}
    layer = "model.language_model.layers.0"
    assert flat[f"{layer}.linear_attn.in_proj_qkv.weight"].dtype == FP8
    assert flat[f"{layer}.mlp.shared_expert.up_proj.weight"].dtype == FP8
    assert flat[f"{layer}.linear_attn.in_proj_a.weight"].dtype == torch.float32
    assert_logits_match(load_model(path, "float32"), hf_from_dir(twin), random_ids(70))


def test_qwen3_5_moe_fp8_kept_as_on_cuda(q35_moe_fp8: tuple[Path, Path],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA layout of the hybrid MoE: gated attention's q_proj scale rows taken apart as
    its weight rows are (query | gate per head), Gated DeltaNet's projections FP8 where the
    checkpoint has scales (in_proj_a / in_proj_b not)."""
    monkeypatch.setattr(loader, "_keeps_fp8", lambda device, block: True)
    path, twin = q35_moe_fp8
    loaded = load_model(path, "float32")
    dtypes = {n: p.dtype for n, p in loaded.model.named_parameters()}
    assert dtypes["layers.1.self_attn.qkv_proj.weight"] == FP8
    deltanet = {d for n, d in dtypes.items() if n.startswith("layers.0.linear_attn.")}
    assert {FP8, torch.float32} <= deltanet
    assert_logits_match(loaded, hf_from_dir(twin), random_ids(70), chunks=(23,))


def interp_check_fp8_moe() -> None:
    """A tiny FP8 MoE kept FP8 (`_keeps_fp8` forced) through the Triton kernels (`triton_ops`'
    fused_moe, `fp8_linear`) against the torch references: prefill whole and in chunks of 16
    (the experts W8A8: within its rounding), and 2 tokens one by one (a first token, then one
    with a cached prefix, W8A16: within summation order; each Triton launch is seconds under
    the interpreter). Blocks of 32 x 32 (the kernels take power-of-two blocks, as the
    releases' 128 x 128): expert width 40 gives w13 one scale row per weight row and w2 a
    partial column block. Run under TRITON_INTERPRET=1 on the CPU (fp32: the interpreter's bf16
    dots are wrong)."""
    import tempfile

    from arle_kernels.ops import triton_ops

    loader._keeps_fp8 = lambda device, block: True  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as tmp:
        path, twin = Path(tmp) / "fp8", Path(tmp) / "twin"
        write_fp8_model_dir(path, hf_config("Qwen3MoeForCausalLM", num_hidden_layers=2), twin,
                            (32, 32), seed=3)
        model = load_model(path, "float32").model
    assert model.layers[0].mlp.experts.block == (1, 32)
    ids = random_ids(24)
    ref = teacher_forced_logits(model, ids)
    model.ops = triton_ops()
    for chunk, n in ((None, 24), (16, 24), (1, 2)):
        got = teacher_forced_logits(model, ids[:n], chunk_size=chunk)
        if chunk == 1:  # the GEMVs: W8A16, exact up to fp32 summation order
            assert (got - ref[:n]).abs().max() < 1e-4
            assert torch.equal(got.argmax(-1), ref[:n].argmax(-1))
            continue
        # 3-64 tokens: the experts W8A8, their activations rounded to e4m3 (3 mantissa bits)
        # per token and 32 columns; bounded as assert_fp8_near_twin bounds W8A8 (measured
        # here: KL 0.005, top-1 23 of 24)
        kl = F.kl_div(got.log_softmax(-1), ref[:n].log_softmax(-1), log_target=True,
                      reduction="none").sum(-1).mean()
        top1 = (got.argmax(-1) == ref[:n].argmax(-1)).float().mean()
        assert kl < 0.06 and top1 >= 0.85, (chunk, kl, top1)


@pytest.mark.slow
def test_fp8_moe_through_the_triton_kernels_under_the_interpreter() -> None:
    """The FP8 expert kernels agree with their torch references: within fp32 summation order
    one token at a time, within W8A8's rounding in chunks."""
    run_interpreter_check("test_fp8_weights", "interp_check_fp8_moe")


# ---- what is refused -----------------------------------------------------------------------

def _broken_copy(fp8_dirs: Any, tmp_path: Path, edit: Any) -> Path:
    path = Path(shutil.copytree(fp8_dirs["dense_edge"][0], tmp_path / "model"))
    files = read_tensors(path)
    for tensors in files.values():
        edit(tensors)
    write_tensors(path, files)
    return path


def test_fp8_weight_without_its_scale(fp8_dirs: Any, tmp_path: Path) -> None:
    name = "model.layers.1.mlp.down_proj.weight"
    path = _broken_copy(fp8_dirs, tmp_path, lambda ts: ts.pop(f"{name}_scale_inv", None))
    with pytest.raises(ModelLoadError, match=f"FP8 tensor '{name}' has no {name}_scale_inv"):
        load_model(path, "float32")


def test_scale_without_its_weight(fp8_dirs: Any, tmp_path: Path) -> None:
    name = "model.layers.1.mlp.down_proj.weight"
    path = _broken_copy(fp8_dirs, tmp_path, lambda ts: ts.pop(name, None))
    with pytest.raises(ModelLoadError, match=f"{name}_scale_inv has no FP8 weight"):
        load_model(path, "float32")


def test_scale_grid_of_another_block(fp8_dirs: Any, tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"

    def edit(ts: dict[str, torch.Tensor]) -> None:
        if name in ts:
            ts[name] = torch.ones(2, 2)

    with pytest.raises(ModelLoadError, match="not the \\(32, 48\\) block grid"):
        load_model(_broken_copy(fp8_dirs, tmp_path, edit), "float32")


@pytest.mark.slow
@pytest.mark.parametrize(("quantization", "says"), [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
     "'awq' with version 'gemv'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True},
     "'gptq' with desc_act"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "'fp8 (per-tensor scales)'"),
])
def test_unread_formats_are_refused_by_name(fp8_dirs: Any, tmp_path: Path,
                                            quantization: dict[str, Any], says: str) -> None:
    """`arle complete` on a checkpoint in a format arle does not read: one line on stderr that
    names the format, a non-zero exit, nothing on stdout."""
    path = Path(shutil.copytree(fp8_dirs["dense_edge"][1], tmp_path / "model"))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": quantization}))
    proc = arle_cli("complete", "-m", str(path), "hi", "--max-tokens", "1")
    assert proc.returncode != 0 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert f"unsupported quantization {says}" in lines[0], lines[0]


# ---- scripts/make_random_model.py: the real configs, for the GPU figures ------------------

RANDOM_MODELS = ("qwen3-30b-a3b", "qwen3-30b-a3b-fp8", "qwen3-4b-fp8", "tiny-moe", "tiny-moe-fp8")


def _released_layout(state: dict[str, tuple[int, ...]], fp8: bool) -> dict[str, tuple[int, ...]]:
    """transformers' in-memory tensors as a release stores them: experts one by one (its
    `experts.gate_up_proj` [E, 2I, H] is each expert's gate rows, then its up rows) and, in
    FP8, a `weight_scale_inv` grid of 128 x 128 blocks beside each projection."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in state.items():
        if name.endswith("experts.gate_up_proj"):
            for e in range(shape[0]):
                for proj in ("gate_proj", "up_proj"):
                    out[f"{name.removesuffix('gate_up_proj')}{e}.{proj}.weight"] = (
                        shape[1] // 2, shape[2])
        elif name.endswith("experts.down_proj"):
            for e in range(shape[0]):
                out[f"{name.removesuffix('down_proj')}{e}.down_proj.weight"] = shape[1:]
        else:
            out[name] = shape
    if fp8:
        out.update({f"{n}_scale_inv": (-(-s[0] // 128), -(-s[1] // 128))
                    for n, s in list(out.items()) if n.endswith("_proj.weight")})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", RANDOM_MODELS)
def test_random_model_layout_matches_the_releases(name: str) -> None:
    """Names and shapes: transformers' model of the config (on the meta device), in the
    releases' layout; FP8 weights and fp32 scales where the FP8 releases have them."""
    mrm = load_script("make_random_model")
    cfg = mrm.CONFIGS[name]
    fp8 = "quantization_config" in cfg
    config = transformers.AutoConfig.for_model(
        **{k: v for k, v in cfg.items() if k != "quantization_config"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    state = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg["tie_word_embeddings"]:
        state.pop("lm_head.weight")
    specs = mrm.tensor_specs(cfg)
    assert {s.name: s.shape for s in specs} == _released_layout(state, fp8)
    kinds = {s.fp8 for s in specs}
    assert kinds == ({"", "weight", "scale"} if fp8 else {""})
    if name == "qwen3-30b-a3b-fp8":  # the release's ~31 GB
        assert 31.0e9 < sum(s.nbytes(2) for s in specs) < 31.3e9


@pytest.mark.slow
def test_random_fp8_moe_loads_as_transformers_dequantises_it(tmp_path: Path) -> None:
    """`tiny-moe-fp8` (dense layer 1, 128 x 128 blocks): per-block power-of-two scales that vary
    (1, 2 or 4 times the smallest), and arle's logits within 1e-4 of transformers', which
    dequantises the directory itself."""
    mrm = load_script("make_random_model")
    mrm.write_model_dir("tiny-moe-fp8", tmp_path, "bfloat16", device="cpu")
    flat = {k: v for ts in read_tensors(tmp_path).values() for k, v in ts.items()}
    scale = flat["model.layers.0.mlp.experts.3.down_proj.weight_scale_inv"]
    assert scale.dtype == torch.float32 and scale.shape == (2, 1)
    ratios = set()
    for scales in (v for k, v in flat.items() if k.endswith("_scale_inv")):
        assert torch.equal(scales.log2(), scales.log2().round())
        ratios |= set((scales / scales.min()).flatten().tolist())
    assert ratios == {1.0, 2.0, 4.0}
    assert flat["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    ours = load_model(tmp_path, "float32")
    assert isinstance(ours.model.layers[0].mlp, SparseMoE)
    assert not isinstance(ours.model.layers[1].mlp, SparseMoE)
    ids = torch.randint(0, 151936, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    assert_logits_match(ours, hf_from_dir(tmp_path), ids, chunks=(None, 16))


# ---- on the GPU (skipped without one: the lent H200 runs these) -----------------------------



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "Qwen3ForCausalLM"])
def test_fp8_on_cuda_against_its_dequantised_twin(tmp_path: Path, arch: str) -> None:
    """On CUDA the weights stay FP8 (half the bytes of bf16) and the FP8 kernels run them:
    their logits against the same model with the dequantised weights in bf16
    (`assert_fp8_near_twin`'s bounds)."""
    path, twin = tmp_path / "fp8", tmp_path / "twin"
    write_fp8_model_dir(path, hf_config(arch, **gpu_shape_overrides(arch)), twin, (128, 128),
                        seed=5)
    assert_fp8_near_twin(load_model(path, "bfloat16", "cuda"),
                         load_model(twin, "bfloat16", "cuda"))
