"""Mixture-of-experts models (Qwen3-MoE; the Qwen3.5-MoE shared expert) against transformers.

Tiny random checkpoints written by transformers itself: every layer MoE, MoE every other layer
with a dense layer forced by `mlp_only_layers`, bf16-stored weights, experts stacked in 3-D
tensors (transformers 5's own layout), and routers whose logits tie. The SparseMoE module alone
against transformers' Qwen3MoeSparseMoeBlock and Qwen3_5MoeSparseMoeBlock (shared expert), and
the hybrid Qwen3.5-MoE (Gated DeltaNet and gated attention layers, each with experts and a
shared expert) whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from model_dirs import (
    MOE_GPU_SHAPE,
    QWEN3_5_MOE_LAYOUTS,
    hf_config,
    qwen3_5_moe_config,
    read_tensors,
    write_model_dir,
    write_qwen3_5_moe_dir,
    write_tensors,
)
from moe_checks import (
    assert_cli_and_server_answer,
    assert_greedy_matches,
    assert_logits_match,
    hf_from_dir,
    random_ids,
    teacher_forced_logits,
)

from arle.model.config import ModelConfig
from arle.model.decoder import DecoderLM
from arle.model.layers import MLP
from arle.model.loader import load_model
from arle.model.moe import SparseMoE, unfuse_experts
from arle.model.parallel import SINGLE
from arle_kernels.ops import REFERENCE

transformers = pytest.importorskip("transformers")

#: id -> config overrides of the tiny Qwen3-MoE (3 layers, 8 experts of width 40, top 3)
CASES: dict[str, dict[str, Any]] = {
    "all_moe": {},
    # MoE where (layer + 1) % 2 == 0, but layer 3: layer 1 only; the rest dense (width 256)
    "sparse_step": {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]},
    "top1_unnormalised": {"num_experts_per_tok": 1, "norm_topk_prob": False},
}


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for i, (name, overrides) in enumerate(CASES.items()):
        out[name] = root / name
        write_model_dir(out[name], hf_config("Qwen3MoeForCausalLM", **overrides), seed=10 + i)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_moe_logits_match_transformers(moe_dirs: dict[str, Path], case: str) -> None:
    """Within fp32 summation order of transformers: max |diff| under 1e-4 (logit std ~2.8),
    the same top-1, at every chunking."""
    loaded = load_model(moe_dirs[case], "float32")
    assert loaded.config.architecture == "Qwen3MoeForCausalLM"
    assert_logits_match(loaded, hf_from_dir(moe_dirs[case]), random_ids(70))


def test_sparse_step_and_mlp_only_layers_pick_the_mlps(moe_dirs: dict[str, Path]) -> None:
    """The layers transformers makes MoE (its config rule), and no others, hold experts."""
    ours = load_model(moe_dirs["sparse_step"], "float32").model
    hf = hf_from_dir(moe_dirs["sparse_step"])
    hf_moe = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
    assert hf_moe == [False, True, False, False]
    assert [isinstance(layer.mlp, SparseMoE) for layer in ours.layers] == hf_moe
    assert all(isinstance(layer.mlp, MLP) for layer, moe in zip(ours.layers, hf_moe,
                                                                strict=True) if not moe)


async def test_moe_greedy_matches_transformers_generate(moe_dirs: dict[str, Path],
                                                        make_engine: Any) -> None:
    path = moe_dirs["all_moe"]
    await assert_greedy_matches(load_model(path, "float32"), hf_from_dir(path), make_engine)


def test_bf16_stored_weights(moe_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A bf16 checkpoint (as the releases are): both sides upcast the same bf16 values."""
    files = read_tensors(moe_dirs["all_moe"])
    write_model_dir(tmp_path, hf_config("Qwen3MoeForCausalLM"), seed=10)
    write_tensors(tmp_path, {f: {k: v.bfloat16() for k, v in ts.items()}
                             for f, ts in files.items()})
    loaded = load_model(tmp_path, "float32")
    assert_logits_match(loaded, hf_from_dir(tmp_path), random_ids(70), chunks=(None, 23))


def _stack_experts(files: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One file with the experts of each layer stacked as transformers 5 holds them."""
    flat = {k: v for ts in files.values() for k, v in ts.items()}
    out = {k: v for k, v in flat.items() if ".experts." not in k}
    for prefix in sorted({k.split("experts.")[0] for k in flat if ".experts." in k}):
        n = len({k for k in flat if k.startswith(prefix + "experts.")}) // 3
        one = [{p: flat[f"{prefix}experts.{e}.{p}.weight"] for p in ("gate_proj", "up_proj",
                                                                    "down_proj")}
               for e in range(n)]
        out[prefix + "experts.gate_up_proj"] = torch.stack(
            [torch.cat([w["gate_proj"], w["up_proj"]]) for w in one])
        out[prefix + "experts.down_proj"] = torch.stack([w["down_proj"] for w in one])
    return out


def test_stacked_expert_checkpoint_loads_the_same(moe_dirs: dict[str, Path],
                                                  tmp_path: Path) -> None:
    """transformers 5's 3-D expert tensors (`experts.gate_up_proj` [E, 2I, H], gate rows
    first, `experts.down_proj` [E, H, I]) give the same model as experts one by one."""
    one_by_one = load_model(moe_dirs["all_moe"], "float32")
    write_model_dir(tmp_path, hf_config("Qwen3MoeForCausalLM"), seed=10)
    write_tensors(tmp_path, {"model.safetensors": _stack_experts(read_tensors(moe_dirs["all_moe"]))})
    stacked = load_model(tmp_path, "float32")
    ids = random_ids(40)
    assert torch.equal(teacher_forced_logits(stacked.model, ids),
                       teacher_forced_logits(one_by_one.model, ids))
    # transformers reads that layout too, and agrees
    assert_logits_match(stacked, hf_from_dir(tmp_path), ids, chunks=(None,))


def test_tied_router_logits_pick_as_transformers(tmp_path: Path) -> None:
    """Tied router logits: layer 0's gate repeats rows (experts 4-7 score as 0-3), layer 1's
    is zero (all eight tie), so torch.topk's order among equals decides which experts run.
    Both sides must pick the same ones: the logits agree as closely as untied ones do."""
    config = hf_config("Qwen3MoeForCausalLM", num_hidden_layers=2)
    write_model_dir(tmp_path, config, seed=20)
    files = read_tensors(tmp_path)
    for tensors in files.values():
        for name, t in tensors.items():
            if name == "model.layers.0.mlp.gate.weight":
                t[4:] = t[:4]
            elif name == "model.layers.1.mlp.gate.weight":
                t.zero_()
    write_tensors(tmp_path, files)
    assert_logits_match(load_model(tmp_path, "float32"), hf_from_dir(tmp_path), random_ids(70))


# ---- the SparseMoE module alone -------------------------------------------------------------

def _ours_like(block: Any, config: Any) -> SparseMoE:
    """Our SparseMoE for transformers' `config`, holding the weights of its MoE `block` (loaded
    through the model's own checkpoint-name mapping and weight loaders)."""
    cfg = ModelConfig.from_hf(config.to_dict(), "test")
    ours = SparseMoE(cfg, SINGLE)
    ours.config = cfg  # what DecoderLM.weight_targets reads
    targets = DecoderLM.weight_targets(ours)  # type: ignore[arg-type]
    for name, t in block.state_dict().items():
        split = unfuse_experts(f"model.{name}", t)
        for one, w in split if split is not None else [(f"model.{name}", t)]:
            param, shard = targets.pop(one)
            param.weight_loader(param, w, shard)  # type: ignore[attr-defined]
    assert not targets, f"not loaded: {sorted(targets)}"
    return ours


def _randomize(block: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in block.parameters():
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


def test_sparse_moe_matches_qwen3_moe_block() -> None:
    """The routed experts (no shared one) against Qwen3MoeSparseMoeBlock, with tied router
    rows; swapping two tied experts' weights changes the result, so the picks are tested."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = hf_config("Qwen3MoeForCausalLM")
    block = Qwen3MoeSparseMoeBlock(config).eval()
    _randomize(block, 0)
    with torch.no_grad():
        block.gate.weight[5] = block.gate.weight[1]
    x = torch.randn(1, 64, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = block(x)[0]
    got = _ours_like(block, config)(x[0], REFERENCE)
    assert (got - want).abs().max().item() < 1e-5
    with torch.no_grad():  # the tie decides: the other expert of the pair gives another output
        gu, down = block.experts.gate_up_proj, block.experts.down_proj
        gu[[1, 5]], down[[1, 5]] = gu[[5, 1]].clone(), down[[5, 1]].clone()
        assert (block(x)[0] - want).abs().max().item() > 1e-2


def _qwen3_5_moe_config() -> Any:
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        vocab_size=384, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=40, shared_expert_intermediate_size=72, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        architectures=["Qwen3_5MoeForCausalLM"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_moe_with_shared_expert_matches_qwen3_5_moe_block(dtype: torch.dtype) -> None:
    """Qwen3.5-MoE's block: routed experts (always renormalised) plus the shared expert scaled
    by sigmoid(shared_expert_gate(x)). fp32: within 1e-5; bf16: within bf16's rounding of the
    output (both compute in bf16, rounding at slightly different places)."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    config = _qwen3_5_moe_config()
    block = Qwen3_5MoeSparseMoeBlock(config).eval()
    _randomize(block, 2)
    ours = _ours_like(block, config)
    assert ours.renormalize and ours.shared_expert is not None
    block, ours = block.to(dtype), ours.to(dtype)
    x = torch.randn(1, 64, config.hidden_size, generator=torch.Generator().manual_seed(3))
    x = x.to(dtype)
    with torch.no_grad():
        want = block(x)[0].float()
        no_shared = want - (torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
                            )[0].float()
    got = ours(x[0], REFERENCE).float()
    bound = 1e-5 if dtype == torch.float32 else 2e-2 * want.abs().max().item()
    assert (got - want).abs().max().item() <= bound
    assert (no_shared - want).abs().max().item() > 10 * bound  # the shared path counts


# ---- Qwen3.5-MoE: the hybrid layers with expert MLPs ------------------------------------------

@pytest.fixture(scope="module")
def q35_moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Both checkpoint layouts of one tiny random Qwen3.5-MoE (the same weights)."""
    root = tmp_path_factory.mktemp("qwen3_5_moe")
    for arch in QWEN3_5_MOE_LAYOUTS:
        write_qwen3_5_moe_dir(root / arch, qwen3_5_moe_config(arch), seed=40)
    return {arch: root / arch for arch in QWEN3_5_MOE_LAYOUTS}


@pytest.mark.parametrize("arch", QWEN3_5_MOE_LAYOUTS)
def test_qwen3_5_moe_logits_match_transformers(q35_moe_dirs: dict[str, Path], arch: str) -> None:
    """Every layer (3 Gated DeltaNet, 2 full attention) has routed experts and a shared one.
    Within fp32 summation order of transformers (its Gated DeltaNet recurrence sums in another
    order): max |diff| under 1e-4, the same top-1."""
    loaded = load_model(q35_moe_dirs[arch], "float32")
    assert loaded.config.architecture == arch
    assert all(isinstance(layer.mlp, SparseMoE) and layer.mlp.shared_expert is not None
               for layer in loaded.model.layers)
    assert_logits_match(loaded, hf_from_dir(q35_moe_dirs[arch]), random_ids(70))


async def test_qwen3_5_moe_greedy_matches_transformers_generate(q35_moe_dirs: dict[str, Path],
                                                                make_engine: Any) -> None:
    path = q35_moe_dirs["Qwen3_5MoeForCausalLM"]
    await assert_greedy_matches(load_model(path, "float32"), hf_from_dir(path), make_engine)


@pytest.mark.slow
def test_cli_and_server_answer_from_a_moe_directory(moe_dirs: dict[str, Path],
                                                    tmp_path: Path) -> None:
    path = moe_dirs["all_moe"]
    assert_cli_and_server_answer(path, hf_from_dir(path), tmp_path / "serve.log")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_moe_on_cuda_matches_transformers(tmp_path: Path) -> None:
    """arle bf16 on CUDA (its MoE kernels) against transformers fp32 on the same weights, no
    worse than transformers' own bf16 run: 1.5x its relative error, 2x its KL, top-1 within 2
    points; in one chunk, in chunks of 37 and token by token."""
    from helpers import assert_within_bf16, load_script

    parity = load_script("check_gpu_parity")
    write_model_dir(tmp_path, hf_config("Qwen3MoeForCausalLM", **MOE_GPU_SHAPE), seed=6)
    ours = load_model(tmp_path, "bfloat16", "cuda")
    ids = random_ids(300)
    ref, hf16 = (parity.hf_logits(parity.hf_model(tmp_path, dtype), [ids])[0]
                 for dtype in (torch.float32, torch.bfloat16))
    hf_bf16 = parity.compare(hf16, ref)
    for chunk in (None, 37, 1):
        assert_within_bf16(teacher_forced_logits(ours.model, ids, chunk_size=chunk), ref,
                           hf_bf16, min(hf_bf16["top1"] - 0.02, 0.97), chunk)
