"""Qwen3.5 (hybrid: Gated DeltaNet + gated attention) against transformers' `qwen3_5` code on
the same weights, in fp32 (an implementation we did not write; its torch fallbacks, as NOTES.md
says: no `fla` / `causal_conv1d` here).

Layer level: the Gated DeltaNet layer through a small backend of its own state slots (calling
`ops.gated_delta`) against `Qwen3_5GatedDeltaNet` with its cache (prefill from a zero state, a
second chunk over the state, decode steps; the states it leaves); the gated attention through
the executor's paged attention against `Qwen3_5Attention`; the zero-centred norm; the partial
rotary table against transformers' multimodal rotary at text positions.
Model level: tiny random checkpoints in both layouts (`Qwen3_5ForConditionalGeneration` with
a vision stub and MTP tensors, `Qwen3_5ForCausalLM`) load, and their teacher-forced logits
through the engine's step path are transformers'; greedy decoding through the engine too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_many, tokens_of
from helpers import assert_within_bf16, load_script, run_interpreter_check
from model_dirs import (
    QWEN3_5_GPU_SHAPE,
    QWEN3_5_LAYOUTS,
    fp8_dequantize,
    fp8_quantize,
    qwen3_5_config,
    write_qwen3_5_dir,
)
from moe_checks import assert_cli_and_server_answer

from arle.executor.paged import DeviceStep, KVCache, PagedAttention
from arle.logging import configure_logging
from arle.model.config import ModelConfig
from arle.model.decoder import DecoderLM
from arle.model.deltanet import GatedDeltaNet, QKVZLinear
from arle.model.layers import Attention, QKVGateLinear, RMSNorm
from arle.model.loader import LoadedModel, load_model
from arle.model.parallel import SINGLE, fp8_weights, linear
from arle_kernels.ops import REFERENCE, Ops

transformers = pytest.importorskip("transformers")
hf_qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

PARITY = load_script("check_gpu_parity")
make_random_model = load_script("make_random_model")

#: the checkpoints' seed: its random logits have no near-tie on the prompt (smallest top-2 gap
#: 0.0023 against differences of ~5e-5), so top-1 agreement is a real check
SEED = 7
PROMPT_LEN = 70  # crosses four 16-token pages


def random_ids(n: int, seed: int = 1) -> list[int]:
    # 259 = the tokenizer's 256 bytes + 3 specials
    return torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def q35_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random Qwen3.5 checkpoint per layout (same seed: the multimodal one's extra
    vision parameters give it other weights)."""
    root = tmp_path_factory.mktemp("qwen3_5")
    out = {}
    for arch in QWEN3_5_LAYOUTS:
        out[arch] = root / arch
        write_qwen3_5_dir(out[arch], arch, seed=SEED)
    return out


def hf_from_dir(path: Path) -> Any:
    """transformers' model of a checkpoint, in the class its config names."""
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()


def hf_text_model(hf: Any) -> Any:
    """The decoder stack (`Qwen3_5TextModel`) inside either layout."""
    inner = hf.model
    return inner.language_model if hasattr(inner, "language_model") else inner


@pytest.fixture(scope="module")
def causal(q35_dirs: dict[str, Path]) -> tuple[LoadedModel, Any]:
    """The text-only checkpoint: arle's model (fp32) and transformers'."""
    path = q35_dirs["Qwen3_5ForCausalLM"]
    return load_model(path, "float32"), hf_from_dir(path)


# ---- config ---------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", QWEN3_5_LAYOUTS)
def test_config_reads_both_layouts(q35_dirs: dict[str, Path], arch: str) -> None:
    raw = json.loads((q35_dirs[arch] / "config.json").read_text())
    assert ("text_config" in raw) == (arch == "Qwen3_5ForConditionalGeneration")
    cfg = ModelConfig.from_hf(raw, "config.json")
    text = qwen3_5_config(arch)
    text = text.text_config if arch == "Qwen3_5ForConditionalGeneration" else text
    assert cfg.architecture == arch
    assert cfg.layer_types == tuple(text.layer_types)
    assert cfg.attention_layers == (1, 4) and cfg.linear_layers == (0, 2, 3)
    assert (cfg.head_dim, cfg.rotary_dim, cfg.rope_theta) == (64, 16, 10000.0)
    assert cfg.attn_output_gate and cfg.norm_zero_centered and cfg.qk_norm
    assert cfg.tie_word_embeddings
    la = cfg.linear_attention
    assert la is not None
    assert (la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim,
            la.conv_kernel) == (text.linear_num_key_heads, text.linear_num_value_heads,
                                text.linear_key_head_dim, text.linear_value_head_dim,
                                text.linear_conv_kernel_dim)
    assert la.conv_dim == 2 * 2 * 32 + 4 * 24


REAL = {"qwen3.5-0.8b": (1024, 3584, 24, 8, 2, 16, True),
        "qwen3.5-4b": (2560, 9216, 32, 16, 4, 32, True),
        "qwen3.5-9b": (4096, 12288, 32, 16, 4, 32, False)}


@pytest.mark.parametrize("name", list(REAL))
def test_random_model_configs_are_the_real_ones(name: str) -> None:
    """scripts/make_random_model.py's Qwen3.5 configs: transformers reads them as the published
    shapes (hidden, intermediate, layers, heads, linear value heads, tied), and so does arle."""
    raw = make_random_model.CONFIGS[name]
    hidden, inter, layers, heads, kv_heads, v_heads, tied = REAL[name]
    hf = transformers.Qwen3_5Config(**{k: v for k, v in raw.items() if k != "architectures"})
    t = hf.text_config
    assert (t.hidden_size, t.intermediate_size, t.num_hidden_layers, t.num_attention_heads,
            t.num_key_value_heads, t.linear_num_value_heads) == (hidden, inter, layers, heads,
                                                                 kv_heads, v_heads)
    assert (t.head_dim, t.linear_num_key_heads, t.linear_key_head_dim, t.linear_value_head_dim,
            t.linear_conv_kernel_dim, t.vocab_size) == (256, 16, 128, 128, 4, 248320)
    assert t.layer_types == ["linear_attention"] * 3 + ["full_attention"] + t.layer_types[4:]
    assert t.layer_types.count("full_attention") == layers // 4
    assert t.rope_parameters["rope_theta"] == 1e7
    assert t.rope_parameters["partial_rotary_factor"] == 0.25
    assert bool(t.tie_word_embeddings) == tied and bool(raw["tie_word_embeddings"]) == tied
    cfg = ModelConfig.from_hf(raw, name)
    assert cfg.architecture == "Qwen3_5ForConditionalGeneration"
    assert (cfg.hidden_size, cfg.num_layers, cfg.rotary_dim, cfg.tie_word_embeddings,
            len(cfg.attention_layers)) == (hidden, layers, 64, tied, layers // 4)
    assert cfg.eos_token_ids == (248044,)


@pytest.mark.parametrize("name", [*REAL, "tiny-qwen3.5"])
def test_random_model_layout_is_transformers(name: str) -> None:
    """The tensors make_random_model writes are transformers' `Qwen3_5ForConditionalGeneration`
    text model's (names and shapes, `model.language_model.*`), lm_head where untied; the vision
    tower's are left out. The MTP head's (`mtp.*`, which transformers has no module for) are a
    full-attention layer's under `mtp.layers.0.`, fc [hidden, 2 hidden] and three norms."""
    raw = make_random_model.CONFIGS[name]
    config = transformers.Qwen3_5Config(**{k: v for k, v in raw.items() if k != "architectures"})
    with torch.device("meta"):
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()
                if not k.startswith("model.visual.")}
    if raw["tie_word_embeddings"]:
        expected.pop("lm_head.weight")
    written = {s.name: s.shape for s in make_random_model.tensor_specs(raw)}
    mtp = {k: written.pop(k) for k in list(written) if k.startswith("mtp.")}
    assert written == expected
    text = raw["text_config"]
    full = f"model.language_model.layers.{text['layer_types'].index('full_attention')}."
    h = text["hidden_size"]
    assert mtp == {"mtp.fc.weight": (h, 2 * h),
                   **{f"mtp.{n}.weight": (h,) for n in ("pre_fc_norm_embedding",
                                                         "pre_fc_norm_hidden", "norm")},
                   **{"mtp.layers.0." + k.removeprefix(full): v for k, v in expected.items()
                      if k.startswith(full)}}


@pytest.mark.slow
def test_tiny_random_qwen3_5_matches_transformers(tmp_path: Path) -> None:
    """`tiny-qwen3.5` as the script writes it (bf16 files, Qwen3.5's vocabulary and special
    ids): arle and transformers (AutoModelForCausalLM, which reads the multimodal layout as a
    text model) give the same teacher-forced logits in fp32; the tokenizer's special ids are
    Qwen3.5's."""
    make_random_model.write_model_dir("tiny-qwen3.5", tmp_path, "bfloat16", device="cpu")
    ours = load_model(tmp_path, "float32")
    assert ours.config.eos_token_ids == (248044,)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, 248320, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = hf_logits(hf, ids)
    got = PARITY.teacher_forced_logits(ours.model, ids, chunk_size=16)
    m = PARITY.compare(got, ref)
    assert m["max_abs"] < 1e-3 and m["top1"] == 1.0, m
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        248044, 248045, 248046]
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [248046, 248044]


# ---- partial rotary ---------------------------------------------------------------------------

@pytest.mark.parametrize("real", [False, True], ids=["tiny", "qwen3.5-4b"])
def test_rotary_table_is_transformers_text_rotary(real: bool) -> None:
    """With text-only positions (the three mrope axes equal) transformers' multimodal rotary
    is the ordinary one over the first rotary_dim dims: arle's table holds its cos and sin.
    With distinct axes it is not, so the comparison does go through the mrope code."""
    if real:
        raw = make_random_model.CONFIGS["qwen3.5-4b"]
        text_cfg = transformers.Qwen3_5Config(
            **{k: v for k, v in raw.items() if k != "architectures"}).text_config
        cfg = ModelConfig.from_hf(raw, "4b")
    else:
        text_cfg = qwen3_5_config("Qwen3_5ForCausalLM")
        cfg = ModelConfig.from_hf({**text_cfg.to_dict(), "architectures": ["Qwen3_5ForCausalLM"]},
                                  "tiny")
    n, rot = 300, cfg.rotary_dim
    rotary = hf_qwen3_5.Qwen3_5TextRotaryEmbedding(text_cfg)
    x = torch.zeros(1, n, 8)
    cos, sin = rotary(x, text_positions(n))  # [1, n, rot]: the pairs' values twice
    assert cos.shape == (1, n, rot)
    table = DecoderLM(cfg).rotary_table(n) if not real else _table(cfg, n)
    assert table.shape == (n, rot) and table.dtype == torch.float32
    # NOTE: both compute angles pos * inv_freq in fp32 (the inverse frequencies from float64
    # here, fp32 there): they differ by a few ulps of an angle up to n, so much in cos / sin
    for hf_part, ours in ((cos[0], table[:, :rot // 2]), (sin[0], table[:, rot // 2:])):
        for half in hf_part.chunk(2, dim=-1):
            torch.testing.assert_close(ours, half, rtol=0, atol=n * 2.0 ** -22)
    axes = torch.stack([torch.arange(n), torch.zeros(n, dtype=torch.long),
                        torch.zeros(n, dtype=torch.long)])[:, None]
    mixed, _ = rotary(x, axes)
    assert not torch.allclose(mixed[0, :, :rot // 2], table[:, :rot // 2])


def text_positions(n: int) -> torch.Tensor:
    """Positions 0..n-1 of one text row on the three mrope axes ([3, 1, n]: what transformers'
    multimodal rotary takes in every version; newer ones also take [1, n])."""
    return torch.arange(n)[None, None].expand(3, 1, n)


def _table(cfg: ModelConfig, n: int) -> torch.Tensor:
    """The rotary table of a model too big to build: its rotary module alone."""
    from arle.model.rope import RotaryEmbedding

    cos, sin = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling).cos_sin(
        torch.arange(n))
    return torch.cat([cos, sin], dim=-1)


# ---- zero-centred norm ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centred_norm_is_transformers(dtype: torch.dtype) -> None:
    """The checkpoint's w loads as 1 + w in fp32; `ops.rms_norm` / `add_rms_norm` with it give
    `Qwen3_5RMSNorm` exactly, in fp32 and bf16 (a bf16 checkpoint, as published)."""
    gen = torch.Generator().manual_seed(5)
    w = (0.3 * torch.randn(256, generator=gen)).to(dtype)
    ours = RMSNorm(256, 1e-6, zero_centered=True)
    ours.weight.weight_loader(ours.weight, w.to(ours.weight.dtype), None)  # type: ignore
    assert ours.weight.dtype == torch.float32
    assert torch.equal(ours.weight, 1.0 + w.float())
    ref = hf_qwen3_5.Qwen3_5RMSNorm(256, eps=1e-6).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(w)
        x = (3 * torch.randn(17, 256, generator=gen)).to(dtype)
        r = torch.randn(17, 256, generator=gen).to(dtype)
        assert torch.equal(REFERENCE.rms_norm(x, ours.weight, ours.eps), ref(x))
        y, res = REFERENCE.add_rms_norm(x, r.clone(), ours.weight, ours.eps)
        assert torch.equal(y, ref(x + r)) and torch.equal(res, x + r)


# ---- the layers ------------------------------------------------------------------------------

def one_row_step(start: int, end: int, table: torch.Tensor, page_size: int = 16,
                 slot: int = 0) -> DeviceStep:
    """One request's tokens [start, end) as a step: a decode row (one token) or an extend row."""
    pos = torch.arange(start, end, dtype=torch.int32)
    kv_slots = table[0, pos // page_size] * page_size + pos % page_size
    decode = end - start == 1
    return DeviceStep(pos.clone(), pos, kv_slots, torch.tensor([end], dtype=torch.int32),
                      torch.tensor([0] if decode else [0, end - start], dtype=torch.int32),
                      table, num_decode=int(decode), max_q_len=end - start, num_splits=2,
                      slots=torch.tensor([slot], dtype=torch.int32))


class SlotBackend:
    """A Gated DeltaNet layer's backend of its own: conv / delta-rule states for `slots`
    request slots of every linear layer, the step's one row on `slot`, `ops.gated_delta`."""

    def __init__(self, cfg: ModelConfig, slots: int = 3, slot: int = 1,
                 ops: Ops = REFERENCE) -> None:
        la = cfg.linear_attention
        assert la is not None
        n = len(cfg.linear_layers)
        self.ops, self.slot, self.num_k_heads = ops, slot, la.num_key_heads
        self.conv = torch.zeros(n, slots, la.conv_dim, la.conv_kernel - 1)
        self.ssm = torch.zeros(n, slots, la.num_value_heads, la.key_head_dim,
                               la.value_head_dim)
        self.step: DeviceStep | None = None

    def gated_delta(self, layer: int, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    conv_weight: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
                    ) -> torch.Tensor:
        s = self.step
        assert s is not None
        out = self.ops.gated_delta(
            mixed_qkv, a, b, conv_weight, a_log, dt_bias, self.conv[layer], self.ssm[layer],
            torch.tensor([self.slot], dtype=torch.int32), s.seq_lens, s.cu_q_lens,
            s.num_decode, s.max_q_len, self.num_k_heads, 16)
        return out.reshape(out.shape[0], -1)


#: a prompt's chunks as the engine runs them: a prefill from nothing, a second chunk over the
#: first's state / KV (not page-aligned), then three decode steps
CHUNKS = ((0, 37), (37, 50), (50, 51), (51, 52), (52, 53))


def test_gated_delta_net_layer_matches_transformers(causal: tuple[LoadedModel, Any]) -> None:
    """Layer 2 (the second linear layer: state entry 1), each chunk against transformers'
    layer with its cache and against its one pass over the whole sequence; the states it
    leaves are transformers' (conv: its last K - 1 inputs); other slots stay untouched.
    Within fp32 summation order: 1e-5 on outputs of rms ~0.5."""
    ours, hf = causal
    cfg = ours.config
    mixer = ours.model.layers[2].mixer
    assert isinstance(mixer, GatedDeltaNet) and mixer.layer == 1
    hf_layer = hf_text_model(hf).layers[2].linear_attn
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(CHUNKS[-1][1], cfg.hidden_size, generator=gen)
    backend = SlotBackend(cfg)
    cache = transformers.DynamicCache(config=hf.config)
    with torch.no_grad():
        whole = hf_layer(x[None])[0]
        for start, end in CHUNKS:
            backend.step = one_row_step(start, end, torch.zeros(1, 4, dtype=torch.int32))
            got = mixer(x[start:end], backend)
            # (the cache by position: transformers renamed the argument in 5.2x)
            ref = hf_layer(x[None, start:end], cache)[0]
            assert got.shape == ref.shape
            where = f"tokens {start}:{end}"
            assert (got - ref).abs().max() < 1e-5, where
            assert (got - whole[start:end]).abs().max() < 1e-5, where
    hf_conv = cache.layers[2].conv_states[0]  # [1, C, K]: its last K inputs
    hf_ssm = cache.layers[2].recurrent_states[0]
    torch.testing.assert_close(backend.conv[1, 1], hf_conv[0, :, 1:], rtol=0, atol=0)
    torch.testing.assert_close(backend.ssm[1, 1], hf_ssm[0], rtol=1e-5, atol=1e-6)
    for slot in (0, 2):
        assert not backend.conv[:, slot].any() and not backend.ssm[:, slot].any()
    assert not backend.conv[(0, 2), :].any()  # other layers' entries


def test_gated_attention_layer_matches_transformers(causal: tuple[LoadedModel, Any]) -> None:
    """Layer 4 (the second full-attention layer: KV entry 1) through the executor's paged
    attention (pages in reverse order), each chunk against transformers' layer over the whole
    sequence: q/k zero-centred norms, partial rotary, GQA, the sigmoid output gate."""
    ours, hf = causal
    cfg = ours.config
    attn = ours.model.layers[4].mixer
    assert isinstance(attn, Attention) and attn.layer == 1 and attn.gated
    text = hf_text_model(hf)
    hf_attn = text.layers[4].self_attn
    n = CHUNKS[-1][1]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, cfg.hidden_size, generator=gen)
    pages = -(-n // 16)
    kv = KVCache.for_model(cfg, pages, 16, torch.float32, torch.device("cpu"))
    table = torch.arange(pages - 1, -1, -1, dtype=torch.int32)[None]
    rotary = ours.model.rotary_table(n)
    mask = torch.full((n, n), -math.inf).triu(1)[None, None]
    with torch.no_grad():
        pos_emb = text.rotary_emb(x[None], text_positions(n))
        ref = hf_attn(x[None], pos_emb, mask)[0][0]
        for start, end in CHUNKS:
            backend = PagedAttention(kv, one_row_step(start, end, table), rotary, ours.model)
            got = attn(x[start:end], backend)
            assert (got - ref[start:end]).abs().max() < 1e-5, f"tokens {start}:{end}"


@pytest.mark.parametrize("block", [(32, 48), (64, 128)])
def test_fp8_projections_split_their_scale_grids(block: tuple[int, int]) -> None:
    """Block-FP8 q_proj (query and gate rows per head) and in_proj_qkv (q | k | v) kept FP8: the
    merged projections take their weights and scale grids apart alike, so each output column
    is the dequantised checkpoint's (blocks of 32 and 64 rows: 1 and 2 per 64-row head)."""
    gen = torch.Generator().manual_seed(9)
    hidden, h, kvh, d = 128, 4, 2, 64

    def fp8(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, scale = fp8_quantize(torch.randn(rows, hidden, generator=gen) / 11, block)
        return q, scale, fp8_dequantize(q, scale, block)

    with fp8_weights(block):
        attn = QKVGateLinear(hidden, h, kvh, d, False, SINGLE)
        dn = QKVZLinear(hidden, {"q": 64, "k": 64, "v": 128, "z": 96}, SINGLE)
    x = torch.randn(5, hidden, generator=gen)
    q_proj, k_proj, v_proj = fp8(2 * h * d), fp8(kvh * d), fp8(kvh * d)
    for shard, (w, scale, _) in zip("qkv", (q_proj, k_proj, v_proj), strict=True):
        attn.weight.weight_loader(attn.weight, w, shard)  # type: ignore[attr-defined]
        attn.weight_scale_inv.weight_loader(attn.weight_scale_inv, scale, shard)  # type: ignore
    query_gate = q_proj[2].view(h, 2, d, hidden)
    expected = torch.cat([query_gate[:, 0].reshape(-1, hidden), k_proj[2], v_proj[2],
                          query_gate[:, 1].reshape(-1, hidden)])
    assert attn.weight.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(linear(x, attn.weight), x @ expected.T)
    qkv, z = fp8(256), fp8(96)
    for shard, (w, scale, _) in (("qkv", qkv), ("z", z)):
        dn.weight.weight_loader(dn.weight, w, shard)  # type: ignore[attr-defined]
        dn.weight_scale_inv.weight_loader(dn.weight_scale_inv, scale, shard)  # type: ignore
    torch.testing.assert_close(linear(x, dn.weight), x @ torch.cat([qkv[2], z[2]]).T)


# ---- the model: both checkpoint layouts ------------------------------------------------------

@pytest.mark.parametrize("arch", QWEN3_5_LAYOUTS)
def test_checkpoint_loads_and_skips_the_unused_parts(q35_dirs: dict[str, Path], arch: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Every text tensor lands where it belongs (q_proj's query and gate rows apart, the conv
    [C, 1, K] as [C, K], norms as 1 + w); the vision tower and MTP head are skipped, in one log
    line; tied embeddings share one tensor."""
    configure_logging(level="info")  # (a CLI test before may have raised the level)
    capsys.readouterr()
    ours = load_model(q35_dirs[arch], "float32")
    err = capsys.readouterr().err
    multimodal = arch == "Qwen3_5ForConditionalGeneration"
    assert err.count("weights_not_used") == (1 if multimodal else 0)
    if multimodal:
        from safetensors import safe_open

        with safe_open(q35_dirs[arch] / "mtp.safetensors", "pt") as f:
            heads = len(list(f.keys()))
        assert f"multi-token_prediction_head={heads}" in err and "vision_tower=" in err
    hf = hf_from_dir(q35_dirs[arch])
    theirs = hf_text_model(hf)
    m = ours.model
    assert m.lm_head.weight.data_ptr() == m.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(m.embed_tokens.weight, theirs.embed_tokens.weight, rtol=0, atol=0)
    attn, hf_attn = m.layers[1].mixer, theirs.layers[1].self_attn
    q_gate = hf_attn.q_proj.weight.view(4, 2, 64, -1)
    d = 64
    expected = torch.cat([q_gate[:, 0].reshape(4 * d, -1), hf_attn.k_proj.weight,
                          hf_attn.v_proj.weight, q_gate[:, 1].reshape(4 * d, -1)])
    assert torch.equal(attn.qkv_proj.weight, expected)
    assert torch.equal(attn.q_norm.weight, 1.0 + hf_attn.q_norm.weight)
    dn, hf_dn = m.layers[0].mixer, theirs.layers[0].linear_attn
    assert torch.equal(dn.conv1d.weight, hf_dn.conv1d.weight[:, 0])
    assert torch.equal(dn.in_proj_qkvz.weight, torch.cat([hf_dn.in_proj_qkv.weight,
                                                          hf_dn.in_proj_z.weight]))
    assert torch.equal(dn.in_proj_ba.weight, torch.cat([hf_dn.in_proj_b.weight,
                                                        hf_dn.in_proj_a.weight]))
    assert torch.equal(dn.norm.weight, hf_dn.norm.weight)  # the gated norm: not zero-centred
    assert torch.equal(m.norm.weight, 1.0 + theirs.norm.weight)


@pytest.mark.parametrize("arch", QWEN3_5_LAYOUTS)
def test_teacher_forced_logits_match_transformers(q35_dirs: dict[str, Path], arch: str) -> None:
    """arle fp32 through the engine's step path (paged attention, the state slot carried from
    chunk to chunk) against transformers fp32: prefill whole, in chunks of 16 (each from a page
    boundary's state) and 23 (across pages), and (the multimodal layout) token by token.
    Bound: max |diff| 1e-4 (logit std ~2.9), the same top-1. transformers differs from itself
    by half that between its whole pass and its token-by-token cached one: the floor of fp32
    here (its chunked delta rule solves triangular systems; the recurrence does not)."""
    ours = load_model(q35_dirs[arch], "float32")
    ids = random_ids(PROMPT_LEN)
    ref = hf_logits(hf_from_dir(q35_dirs[arch]), ids)
    top2 = ref.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3, "a near-tie: top-1 would be luck"
    chunks = (None, 16, 23, 1) if arch == "Qwen3_5ForConditionalGeneration" else (None, 16, 23)
    for chunk in chunks:
        got = PARITY.teacher_forced_logits(ours.model, ids, chunk_size=chunk)
        m = {**PARITY.compare(got, ref), "kl_mean": kl_mean(got, ref)}
        where = f"chunk={chunk}: {m}"
        assert m["max_abs"] <= 1e-4, where
        assert m["top1"] == 1.0, where
        assert m["kl_mean"] < 1e-9, where


def kl_mean(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean KL(ref || ours) over positions, in float64 (fp32 rounds it below 0)."""
    lp_ref, lp_ours = ref.double().log_softmax(-1), ours.double().log_softmax(-1)
    return (lp_ref.exp() * (lp_ref - lp_ours)).sum(-1).mean().item()


def hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


async def test_greedy_matches_transformers_generate(q35_dirs: dict[str, Path],
                                                    make_engine: Any) -> None:
    """24 greedy tokens, EOS ignored, through the whole engine (prefill chunks, decode steps,
    the state slots), for prompts decoding together, against transformers' `generate`."""
    path = q35_dirs["Qwen3_5ForConditionalGeneration"]
    loaded = load_model(path, "float32")
    hf = hf_from_dir(path)
    prompts = [random_ids(n, seed) for n, seed in ((40, 1), (23, 2), (70, 3))]
    engine = make_engine(loaded)
    batch = await run_many(engine, prompts, max_tokens=24, ignore_eos=True)
    for ids, deltas in zip(prompts, batch, strict=True):
        # NOTE: the checkpoint's generation_config.json asks for a repetition penalty
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                          dtype=torch.long), do_sample=False, max_new_tokens=24,
                          repetition_penalty=1.0, eos_token_id=None, pad_token_id=0)
        assert tokens_of(deltas) == out[0, len(ids):].tolist()


@pytest.mark.slow
def test_cli_and_server_answer_from_a_qwen3_5_directory(q35_dirs: dict[str, Path],
                                                        tmp_path: Path) -> None:
    """`arle complete` from the published layout answers with transformers' greedy tokens
    (with the directory's repetition penalty), and `arle serve` with the same text."""
    path = q35_dirs["Qwen3_5ForConditionalGeneration"]
    assert_cli_and_server_answer(path, hf_from_dir(path), tmp_path / "serve.log")


# ---- the Triton kernels (interpreter, CPU) ---------------------------------------------------

def interp_check_model() -> None:
    """The tiny model through the Triton kernels (`triton_ops`: Gated DeltaNet, the fused
    norms and partial-rotary q/k store, paged attention) against the torch references, prefill
    whole, in chunks of 16, and token by token; run under TRITON_INTERPRET=1 on the CPU."""
    import tempfile

    from arle_kernels.ops import triton_ops

    with tempfile.TemporaryDirectory() as tmp:
        write_qwen3_5_dir(Path(tmp), "Qwen3_5ForCausalLM", seed=SEED)
        model = load_model(tmp, "float32").model
    ids = random_ids(40)
    ref = PARITY.teacher_forced_logits(model, ids)
    model.ops = triton_ops()
    for chunk, n in ((None, 40), (16, 40), (1, 12)):
        got = PARITY.teacher_forced_logits(model, ids[:n], chunk_size=chunk)
        assert (got - ref[:n]).abs().max() < 1e-4, chunk
        assert torch.equal(got.argmax(-1), ref[:n].argmax(-1)), chunk


@pytest.mark.slow
def test_model_through_the_triton_kernels_under_the_interpreter() -> None:
    """The Triton kernels agree with their torch references within 1e-4 (the kernels' fp32
    sums run in another order), the same top-1."""
    run_interpreter_check("test_qwen3_5", "interp_check_model")


# ---- bf16: within transformers' own bf16 error -----------------------------------------------

@pytest.mark.parametrize("arch", QWEN3_5_LAYOUTS)
def test_bf16_logits_within_transformers_bf16_error(q35_dirs: dict[str, Path], arch: str) -> None:
    """arle bf16 (the torch references) against transformers fp32, held to transformers' own
    bf16 error. Measured: relative error 0.040-0.049 where transformers' is 0.036-0.044, KL
    0.005-0.007 where its is 0.004-0.006."""
    path = q35_dirs[arch]
    ids = random_ids(PROMPT_LEN)
    ref = hf_logits(hf_from_dir(path), ids)
    hf16 = getattr(transformers, arch).from_pretrained(path, dtype=torch.bfloat16).eval()
    hf_bf16 = PARITY.compare(hf_logits(hf16, ids), ref)
    ours = load_model(path, "bfloat16")
    for chunk in (None, 16):
        assert_within_bf16(PARITY.teacher_forced_logits(ours.model, ids, chunk_size=chunk), ref,
                           hf_bf16, hf_bf16["top1"] - 0.03, chunk)


# ---- on the GPU (skipped without one: the lent H200 runs these) -----------------------------



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_logits_within_transformers_bf16_error(tmp_path: Path) -> None:
    """The Triton path (bf16) against transformers fp32 on the GPU, held to transformers' own
    bf16 error: prefill whole, in chunks of 37 (extend rows from a carried state), and token by
    token (the decode kernels), over 300 tokens."""
    write_qwen3_5_dir(tmp_path, "Qwen3_5ForConditionalGeneration", seed=3, **QWEN3_5_GPU_SHAPE)
    ours = load_model(tmp_path, "bfloat16", "cuda")
    ids = random_ids(300)
    ref, hf16 = (PARITY.hf_logits(PARITY.hf_model(tmp_path, dtype), [ids])[0]
                 for dtype in (torch.float32, torch.bfloat16))
    hf_bf16 = PARITY.compare(hf16, ref)
    for chunk in (None, 37, 1):
        assert_within_bf16(PARITY.teacher_forced_logits(ours.model, ids, chunk_size=chunk), ref,
                           hf_bf16, hf_bf16["top1"] - 0.03, chunk)
