"""The MoE MLP (arle_kernels.moe): the torch reference against transformers' `qwen3_moe`
router and experts on random weights (bf16 and FP8 blocks), then each Triton kernel against
the reference (interpreter, tiny shapes; GPU, Qwen3-30B-A3B's shapes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import capture, hf_fp8_dequantize, run_interpreter_check
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeConfig,
    Qwen3MoeSparseMoeBlock,
)

from arle_kernels.fp8 import quantize_fp8_groups
from arle_kernels.fp8_ref import FP8
from arle_kernels.moe import (
    MOE_GEMV_MAX_TOKENS,
    MOE_W8A8_MIN_TOKENS,
    ROUTE_ALIGN_MAX_TOKENS,
    ROUTE_ONE_WARP_MAX_TOKENS,
    MoeConfig,
    MoeTile,
    _moe_experts,
    _route_tile,
    fused_moe,
    fused_moe_unreduced,
    moe_align,
    moe_gemv_tiles,
    moe_route,
    moe_route_align,
    moe_token_classes,
    pick_moe_config,
    routing_launch,
)
from arle_kernels.moe_ref import (
    fused_moe_ref,
    moe_align_ref,
    moe_experts_ref,
    moe_experts_w8a8_ref,
    moe_max_blocks,
    moe_route_ref,
)
from arle_kernels.split_sums import MAX_ROWS, SplitSums, take

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# ---------------------------------------------------------------------------------------------
# the reference against transformers
# ---------------------------------------------------------------------------------------------


def hf_block(h: int, inter: int, e: int, k: int, norm: bool, impl: str, dtype: torch.dtype,
             seed: int = 0) -> Qwen3MoeSparseMoeBlock:
    """transformers' MoE block with unit-gain random weights (std 1/sqrt(fan_in)) and a router
    sharp enough that the top-k are well apart (ties are made on purpose, elsewhere)."""
    cfg = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=inter, num_experts=e,
                         num_experts_per_tok=k, norm_topk_prob=norm)
    cfg._experts_implementation = impl
    block = Qwen3MoeSparseMoeBlock(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5 * 4)
    return block.to(dtype)


def run_both(moe: Qwen3MoeSparseMoeBlock, x: torch.Tensor, **fp8: object) -> tuple:
    """(fused_moe_ref, transformers' block) on x; FP8 weights for the ref where given."""
    ex = moe.experts
    logits = F.linear(x, moe.gate.weight)  # the router's own linear
    with torch.no_grad():
        want = moe(x[None])[0]
        if fp8:
            w13, w2 = fp8["w13"], fp8["w2"]
        else:
            w13, w2 = ex.gate_up_proj, ex.down_proj
        got = fused_moe_ref(x, logits, w13, w2, moe.gate.top_k, moe.gate.norm_topk_prob,
                            fp8.get("w13_scale"), fp8.get("w2_scale"), fp8.get("block"))
    return got, want


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("norm", [True, False])
def test_ref_matches_transformers_fp32(norm: bool, impl: str) -> None:
    block = hf_block(48, 40, 8, 2, norm, impl, torch.float32)
    x = torch.randn(13, 48, generator=torch.Generator().manual_seed(1))
    got, want = run_both(block, x)
    assert got.dtype == x.dtype and got.shape == x.shape
    # NOTE: fp32 roundings in another order (the BLAS picks its kernel by CPU and shape: on an
    # AMD EPYC 2e-5 apart at outputs of 241, elementwise far past 1e-6 where the top-k sum
    # cancels), so norm-wise: measured 1e-7; a wrong expert or weight gives about 1
    assert rel(got, want) < 1e-6, rel(got, want)


@pytest.mark.parametrize("norm", [True, False])
def test_ref_matches_transformers_bf16(norm: bool) -> None:
    """transformers' default experts (grouped_mm): the same roundings, so the same bits up to
    the fp32 order of the top-k sum (at most one bf16 ulp, rarely)."""
    block = hf_block(64, 32, 8, 4, norm, "grouped_mm", torch.bfloat16)
    x = torch.randn(17, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    got, want = run_both(block, x)
    assert got.dtype == torch.bfloat16
    differ = (got != want).float().mean().item()
    assert differ <= 0.01, differ
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-3)


def test_route_ref_matches_transformers_router_with_ties() -> None:
    """Tied logits (identical router rows) pick and order experts as transformers' router."""
    block = hf_block(32, 16, 8, 3, True, "eager", torch.float32)
    with torch.no_grad():
        block.gate.weight[5] = block.gate.weight[2]
        block.gate.weight[6] = block.gate.weight[2]
        block.gate.weight[1] = 0.0  # logit 0 for every token, tied with a zero row below
        block.gate.weight[7] = 0.0
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(3))
    x[4] = 0.0  # every logit 0: all experts tied
    logits = F.linear(x, block.gate.weight)
    for norm in (True, False):
        block.gate.norm_topk_prob = norm
        _, hf_weights, hf_ids = block.gate(x)
        weights, ids = moe_route_ref(logits, 3, norm)
        assert torch.equal(ids, hf_ids)
        assert torch.equal(weights, hf_weights)
    got, want = run_both(block, x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int], gen: torch.Generator,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 weights [..., N, K] and power-of-two block scales [..., ceil(N/bn), ceil(K/bk)]
    (as a checkpoint stores them), edge blocks partial."""
    n, k = w.shape[-2:]
    bn, bk = block
    scale = 2.0 ** torch.randint(-9, -4, (*w.shape[:-2], -(-n // bn), -(-k // bk)),
                                 generator=gen).float()
    full = scale.repeat_interleave(bn, -2).repeat_interleave(bk, -1)[..., :n, :k]
    return (w / full).clamp(-448, 448).to(FP8), scale


def test_ref_fp8_matches_transformers_dequantized() -> None:
    """FP8 experts: the same as transformers' experts on weights it dequantised itself."""
    h, inter, e, block = 64, 48, 4, (16, 32)
    hf = hf_block(h, inter, e, 2, True, "grouped_mm", torch.float32)
    gen = torch.Generator().manual_seed(4)
    w13, s13 = quantize_blocks(torch.randn(e, 2 * inter, h, generator=gen) * 0.2, block, gen)
    w2, s2 = quantize_blocks(torch.randn(e, h, inter, generator=gen) * 0.2, block, gen)
    with torch.no_grad():
        hf.experts.gate_up_proj.copy_(hf_fp8_dequantize(w13, s13, list(block),
                                                             torch.float32))
        hf.experts.down_proj.copy_(hf_fp8_dequantize(w2, s2, list(block), torch.float32))
    x = torch.randn(11, h, generator=gen)
    got, want = run_both(hf, x, w13=w13, w2=w2, w13_scale=s13, w2_scale=s2, block=block)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# the rules
# ---------------------------------------------------------------------------------------------

def test_align_ref_groups_pairs_by_expert() -> None:
    ids = torch.tensor([[3, 0], [0, 2], [3, 0], [1, 3]])
    sorted_ids, block_expert = moe_align_ref(ids, num_experts=5, block_m=2)
    s = sorted_ids.tolist()
    # expert 0: pairs 1, 2, 5 (two blocks), 1: 6, 2: 3, 3: 0, 4, 7 (two blocks); 8 = padding
    assert s[:12] == [1, 2, 5, 8, 6, 8, 3, 8, 0, 4, 7, 8]
    assert block_expert.tolist()[:6] == [0, 0, 1, 2, 3, 3]
    assert all(e == -1 for e in block_expert.tolist()[6:])
    assert len(block_expert) == moe_max_blocks(4, 2, 5, 2)


@pytest.mark.parametrize("t,k,e,bm", [(1, 8, 128, 16), (3, 2, 4, 4), (64, 8, 128, 16),
                                      (2048, 8, 128, 64), (5, 2, 8, 3)])
def test_max_blocks_bounds_every_routing(t: int, k: int, e: int, bm: int) -> None:
    """moe_max_blocks >= the blocks of the worst routings: every token on its own experts
    (most groups, each padded), and random ones."""
    worst = torch.arange(t * k).remainder(e).view(t, k)
    gen = torch.Generator().manual_seed(t)
    for ids in [worst] + [torch.rand(t, e, generator=gen).topk(k).indices for _ in range(3)]:
        blocks = sum(-(-c // bm) for c in torch.bincount(ids.reshape(-1), minlength=e).tolist())
        assert blocks <= moe_max_blocks(t, k, e, bm)


def test_pick_config() -> None:
    """Token classes: the GEMV (one block per expert), then tensor cores: FP8 W8A8 (swapped
    below MOE_W8A8_MIN_TOKENS), bf16 unswapped; FP8 K steps inside one scale block."""
    gemv_classes = [(t, block) for t in range(1, MOE_GEMV_MAX_TOKENS + 1)
                    for block in (None, (128, 128))]
    for t, block in gemv_classes:
        cfg = pick_moe_config(t, 8, 128, 2048, 768, block)
        assert cfg.kind == "gemv" and cfg.block_m >= t
        assert (cfg.block_m == 1) == (t == 1)  # the direct path: one token only
        run = 16 if block else 8  # a lane's 16-byte load
        # (rows of x, rows of W): all rows share one expert's W; one token's down as the
        # model runs it takes a pair a program (into split-sum slots; `fused_moe`'s sum of
        # the pairs in one program holds 8 times the sums)
        for tile, rows, w_rows in ((cfg.up, cfg.block_m, 1), (cfg.down, cfg.block_m, 1)):
            lanes = 32 * tile.num_warps
            assert w_rows * tile.block_n * tile.block_k // run >= lanes  # runs for every lane
            assert rows * tile.block_n * tile.block_k // run <= 8 * lanes  # <= 8 fp32 sums
    for t in (MOE_GEMV_MAX_TOKENS + 1, MOE_W8A8_MIN_TOKENS - 1, MOE_W8A8_MIN_TOKENS, 8192):
        for block in ((128, 128), (16, 16)):
            cfg = pick_moe_config(t, 8, 128, 2048, 768, block)
            assert cfg.kind == "w8a8" and 16 <= cfg.block_m <= 64
            assert cfg.swap == (t < MOE_W8A8_MIN_TOKENS)  # swapped at about a pair an expert
            assert block[1] % cfg.up.block_k == 0 and block[1] % cfg.down.block_k == 0
        if t > MOE_GEMV_MAX_TOKENS:
            assert pick_moe_config(t, 8, 128, 2048, 768, None).kind == "mma"


@pytest.mark.parametrize("block", [None, (128, 128)])
def test_token_classes_cover_every_config(block: tuple[int, int] | None) -> None:
    """A warm-up running moe_token_classes meets every config of 1..max_tokens tokens, and
    every routing launch (one token on one warp, fused with the align, 16 tokens a program),
    once."""
    args = (8, 128, 2048, 768, block)
    classes = moe_token_classes(*args, max_tokens=4096)

    def launches(t: int) -> tuple[MoeConfig, tuple[int, int]]:
        cfg = pick_moe_config(t, *args)
        return cfg, routing_launch(t, cfg, 128)

    assert classes[0] == 1 and len({launches(t) for t in classes}) == len(classes)
    assert {launches(t) for t in range(1, 4097)} == {launches(t) for t in classes}
    routings = {launches(t)[1] for t in classes}
    assert routings == {_route_tile(1, 128), (0, 0), _route_tile(4096, 128)}
    assert launches(ROUTE_ALIGN_MAX_TOKENS + 1)[1] == _route_tile(4096, 128)


# ---------------------------------------------------------------------------------------------
# interpreter (CPU): every kernel against its ref on tiny shapes
# ---------------------------------------------------------------------------------------------

def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all(), "NaN/inf in the output"
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def lowest_first_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The top-k experts, equal probabilities taken lowest expert first (a stable sort)."""
    probs = torch.softmax(logits.float(), dim=-1)
    return torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]


def check_route(logits: torch.Tensor, k: int, ties: bool) -> None:
    for renorm in (True, False):
        weights, ids = moe_route(logits, k, renorm)
        want_w, want_ids = moe_route_ref(logits, k, renorm)
        assert ids.dtype == torch.int32 and weights.dtype == logits.dtype
        if ties:  # (the CPU's torch.topk orders ties its own way: the rule, longhand)
            assert torch.equal(ids.long(), lowest_first_topk(logits, k))
            want_w = torch.softmax(logits.float(), -1).gather(1, ids.long())
            if renorm:
                want_w = want_w / want_w.sum(-1, keepdim=True)
            want_w = want_w.to(logits.dtype)
        else:
            assert torch.equal(ids.long(), want_ids), (ids, want_ids)
        # fp32: exp and the sum's order, a few ulps; 16-bit: one rounding of those
        tol = 1e-6 if logits.dtype == torch.float32 else 2.0 ** -10
        torch.testing.assert_close(weights, want_w, rtol=tol, atol=0.0)


def check_align(ids: torch.Tensor, e: int, bm: int) -> None:
    sorted_ids, block_expert = moe_align(ids.to(torch.int32), e, bm)
    want_ids, want_blocks = moe_align_ref(ids, e, bm)
    assert torch.equal(block_expert, want_blocks), (block_expert, want_blocks)
    used = int((block_expert >= 0).sum()) * bm
    assert torch.equal(sorted_ids[:used], want_ids[:used])


def check_route_align(logits: torch.Tensor, k: int, bm: int) -> None:
    """moe_route_align's one launch: the bits of moe_route, then moe_align on its ids."""
    for renorm in (True, False):
        weights, ids, sorted_ids, blocks = moe_route_align(logits, k, renorm, bm)
        want_w, want_ids = moe_route(logits, k, renorm)
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
        want_sorted, want_blocks = moe_align(want_ids, logits.shape[1], bm)
        assert torch.equal(blocks, want_blocks), (blocks, want_blocks)
        used = int((want_blocks >= 0).sum()) * bm
        assert used > 0 and torch.equal(sorted_ids[:used], want_sorted[:used])


def make_experts(e: int, h: int, inter: int, gen: torch.Generator,
                 block: tuple[int, int] | None) -> dict:
    """Expert weights of unit gain: [E, 2I, H] and [E, H, I]; FP8 with power-of-two block
    scales where block is given."""
    w13 = torch.randn(e, 2 * inter, h, generator=gen) * h ** -0.5
    w2 = torch.randn(e, h, inter, generator=gen) * inter ** -0.5
    if block is None:
        return {"w13": w13, "w2": w2}
    w13, s13 = quantize_blocks(w13, block, gen)
    w2, s2 = quantize_blocks(w2, block, gen)
    return {"w13": w13, "w2": w2, "w13_scale": s13, "w2_scale": s2, "block": block}


def check_experts(x: torch.Tensor, logits: torch.Tensor, k: int, experts: dict,
                  cfg: MoeConfig) -> None:
    weights, ids = moe_route_ref(logits, k, True)
    got = _moe_experts(x, weights, ids, experts["w13"], experts["w2"],
                       experts.get("w13_scale"), experts.get("w2_scale"),
                       experts.get("block"), cfg)
    what = f"{cfg.kind} T={x.shape[0]} {x.dtype} block={experts.get('block')}"
    assert got.dtype == x.dtype and got.shape == x.shape, what
    if cfg.kind == "w8a8":
        # with the kernel's own activation quantisation (the interpreter rounds to e4m3 its
        # own way; quantize_fp8_groups is checked against its ref in test_kernels_fp8)
        want = moe_experts_w8a8_ref(x, weights, ids, **experts, quantize=quantize_fp8_groups)
    else:
        want = moe_experts_ref(x, weights, ids, **experts)
    tol = 1e-5 if x.dtype == torch.float32 else 3e-3
    assert rel(got, want) < tol, (what, rel(got, want))
    if x.shape[0] <= MAX_ROWS:  # the top-k sum left in split-sum slots: the same sum
        sums = _moe_experts(x, weights, ids, experts["w13"], experts["w2"],
                            experts.get("w13_scale"), experts.get("w2_scale"),
                            experts.get("block"), cfg, sums=True)
        assert isinstance(sums, SplitSums) and sums.slots.shape[:2] == (k, x.shape[0]), what
        taken = take(sums)
        assert taken.dtype == x.dtype and rel(taken, got) < tol / 10, (what, rel(taken, got))
        assert not sums.slots.any(), "the consumer leaves the slots zero"


def interp_check_moe() -> None:
    """Under TRITON_INTERPRET=1: routing (random and tied logits), the align, and the expert
    kernels (GEMV, tensor cores; bf16-style and FP8 W8A16 / W8A8 weights with partial scale
    blocks) against the refs on odd token counts, in fp32 and fp16 (the interpreter's bf16 dots
    are wrong)."""
    gen = torch.Generator().manual_seed(8)
    for dtype in (torch.float32, torch.float16):
        for t, e, k in ((1, 8, 2), (7, 6, 3), (33, 60, 4), (5, 4, 1)):
            logits = (torch.randn(t, e, generator=gen) * 2).to(dtype)
            check_route(logits, k, ties=False)
        tied = torch.randint(0, 3, (9, 8), generator=gen).to(dtype)
        tied[0] = 0.0
        for k in (1, 2, 3):
            check_route(tied, k, ties=True)
            check_route(tied[:3], k, ties=True)  # decode's launch: a token on one warp
    for t, e, k, bm in ((1, 8, 2, 1), (3, 4, 2, 4), (7, 8, 2, 16), (33, 5, 2, 4),
                        (70, 8, 2, 16), (17, 8, 8, 2)):
        check_align(torch.rand(t, e, generator=gen).topk(k).indices, e, bm)
    check_align(torch.zeros(5, 1, dtype=torch.long), 4, 2)  # every pair on one expert
    # (60 experts: 16 tokens a routing chunk, so 33 tokens take three; tied logits)
    for t, e, k, bm in ((2, 8, 2, 2), (33, 60, 4, 16), (9, 128, 8, 16)):
        check_route_align(torch.randn(t, e, generator=gen).half(), k, bm)
    check_route_align(torch.randint(0, 3, (20, 8), generator=gen).half(), 3, 4)

    h, inter = 40, 24  # 16-blocks: partial in both projections' K and N
    tiny = MoeTile(16, 16, num_stages=1)
    for block, e in ((None, 8), ((16, 16), 4), ((16, 16), 8)):
        experts = make_experts(e, h, inter, gen, block)
        for dtype in (torch.float32, torch.float16) if e == 4 or block is None else (torch.float16,):
            ex = {k: (v.to(dtype) if k in ("w13", "w2") and block is None else v)
                  for k, v in experts.items()}
            # (e = 4, 40 tokens: ~20 pairs an expert, groups over two blocks of 16)
            for t in (1, 3, 17) if e == 8 else (3, 40):
                x = torch.randn(t, h, generator=gen).to(dtype)
                logits = torch.randn(t, e, generator=gen).to(dtype)
                kinds = ["mma"] + (["w8a8"] if block else [])
                cfgs = [MoeConfig(kind, 16, tiny, tiny, swap) for kind in kinds
                        for swap in (False, True)]
                if t <= 4:  # (a K chunk of 64: several scale groups, K's tail masked)
                    cfgs += [MoeConfig("gemv", triton_pow2(t), tiny, tiny),
                             MoeConfig("gemv", 4, MoeTile(16, 64), MoeTile(8, 64))]
                if t == 40:  # wider tiles: N past the projections' widths
                    cfgs += [MoeConfig("mma", 16, MoeTile(32, 16), MoeTile(64, 16), swap)
                             for swap in (False, True)]
                for cfg in cfgs:
                    check_experts(x, logits, 2, ex, cfg)
                if t == 1:  # the one-token path (no align, the top-k sum fused in down)
                    for k in (1, 2, 3):
                        for up, down in ((tiny, tiny), (MoeTile(16, 64), MoeTile(8, 32)),
                                         (MoeTile(4, 32), MoeTile(2, 16))):
                            check_experts(x, logits, k, ex, MoeConfig("gemv", 1, up, down))
    check_one_token(gen)
    # the dispatchers: each token class's kernel, routed by moe_route
    experts = make_experts(8, h, inter, gen, (16, 16))
    for t in (1, 2, 9, MOE_W8A8_MIN_TOKENS):
        x = torch.randn(t, h, generator=gen)
        logits = torch.randn(t, 8, generator=gen)
        got = fused_moe(x, logits, experts["w13"], experts["w2"], 2, True,
                        experts["w13_scale"], experts["w2_scale"], (16, 16))
        w, ids = moe_route(logits, 2, True)
        cfg = pick_moe_config(t, 2, 8, h, inter, (16, 16))
        want = _moe_experts(x, w, ids, experts["w13"], experts["w2"], experts["w13_scale"],
                            experts["w2_scale"], (16, 16), cfg)
        assert torch.equal(got, want), t
    empty = fused_moe(x[:0], logits[:0], experts["w13"], experts["w2"], 2, True,
                      experts["w13_scale"], experts["w2_scale"], (16, 16))
    assert empty.shape == (0, h)


def check_one_token(gen: torch.Generator) -> None:
    """The one-token path where every K chunk is whole (no masks): FP8 runs in several scale
    groups a chunk, pairs of one expert repeated; `fused_moe` at T = 1 (its picked config,
    the same bits as `_moe_experts` with it) against the ref."""
    h, inter, block = 64, 32, (16, 16)
    experts = make_experts(4, h, inter, gen, block)
    x = torch.randn(1, h, generator=gen).half()
    logits = torch.randn(1, 4, generator=gen).half()
    for up, down in ((MoeTile(16, 32), MoeTile(16, 32)), (MoeTile(32, 64), MoeTile(8, 16))):
        check_experts(x, logits, 3, experts, MoeConfig("gemv", 1, up, down))
    weights, _ = moe_route_ref(logits, 2, True)
    same = torch.tensor([[1, 1]])  # (not from a router: one expert twice)
    got = _moe_experts(x, weights, same, experts["w13"], experts["w2"], experts["w13_scale"],
                       experts["w2_scale"], block, MoeConfig("gemv", 1, *[MoeTile(16, 32)] * 2))
    want = moe_experts_ref(x, weights, same, **experts)
    assert rel(got, want) < 3e-3, rel(got, want)
    cfg = pick_moe_config(1, 3, 4, h, inter, block)
    assert cfg.kind == "gemv" and cfg.block_m == 1
    got = fused_moe(x, logits, experts["w13"], experts["w2"], 3, True, experts["w13_scale"],
                    experts["w2_scale"], block)
    w, ids = moe_route(logits, 3, True)
    want = _moe_experts(x, w, ids, experts["w13"], experts["w2"], experts["w13_scale"],
                        experts["w2_scale"], block, cfg)
    assert torch.equal(got, want)
    ref = fused_moe_ref(x, logits, experts["w13"], experts["w2"], 3, True,
                        experts["w13_scale"], experts["w2_scale"], block)
    assert rel(got, ref) < 3e-3, rel(got, ref)


def triton_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def test_moe_kernels_interpreter() -> None:
    run_interpreter_check("test_kernels_moe", "interp_check_moe")


# ---------------------------------------------------------------------------------------------
# GPU: Qwen3-30B-A3B's experts (E = 128, top-8, H = 2048, I = 768), bf16 and FP8 blocks
# ---------------------------------------------------------------------------------------------

A3B = {"e": 128, "k": 8, "h": 2048, "inter": 768}


def gpu_experts(fp8: bool, seed: int = 0) -> dict:
    """Qwen3-30B-A3B's experts on the GPU: FP8 with block scales, or bf16 (the activations'
    dtype, as a bf16 model holds them)."""
    gen = torch.Generator().manual_seed(seed)
    experts = make_experts(A3B["e"], A3B["h"], A3B["inter"], gen, (128, 128) if fp8 else None)
    if not fp8:
        experts = {k: v.bfloat16() for k, v in experts.items()}
    return {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in experts.items()}


def gpu_inputs(t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, A3B["h"], generator=gen, device="cuda").bfloat16()
    logits = (torch.randn(t, A3B["e"], generator=gen, device="cuda") * 2).bfloat16()
    return x, logits


def assert_same_routing(weights: torch.Tensor, ids: torch.Tensor, want_w: torch.Tensor,
                        want_ids: torch.Tensor) -> None:
    """The experts torch.topk picks on the GPU (on a tie at the k-th value, the lowest ones)
    with the same weights, in descending order. NOTE: among equal weights the order may
    differ (CUDA's sort of the k picked is unstable): that moves only the fp32 order of the
    top-k sum."""
    assert torch.equal(ids.long().sort(-1).values, want_ids.sort(-1).values)
    # bf16 weights: the fp32 weight may sit an fp32 ulp away, then round the other way
    torch.testing.assert_close(weights.float(), want_w.float(), rtol=2.0 ** -7, atol=0.0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 4, 33, 4096])
def test_route_and_align_gpu(t: int) -> None:
    _, logits = gpu_inputs(t)
    for renorm in (True, False):
        w, ids = moe_route(logits, A3B["k"], renorm)
        assert_same_routing(w, ids, *moe_route_ref(logits, A3B["k"], renorm))
        for bm in (16, 64):
            sorted_ids, blocks = moe_align(ids, A3B["e"], bm)
            want_sorted, want_blocks = moe_align_ref(ids.cpu(), A3B["e"], bm)
            assert torch.equal(blocks.cpu(), want_blocks)
            used = int((want_blocks >= 0).sum()) * bm
            assert torch.equal(sorted_ids.cpu()[:used], want_sorted[:used])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [2, 8, ROUTE_ALIGN_MAX_TOKENS])
def test_route_align_gpu(t: int) -> None:
    """The routing and the align in one launch (decode batches): moe_route's and moe_align's
    outputs, bit for bit, also on tied logits."""
    _, logits = gpu_inputs(t)
    ties = torch.randint(0, 3, logits.shape, device="cuda").bfloat16()
    for lg in (logits, ties):
        for bm in (16, 64):
            check_route_align(lg, A3B["k"], bm)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [ROUTE_ONE_WARP_MAX_TOKENS, 64])
def test_route_ties_as_torch_topk_gpu(t: int) -> None:
    """Tied logits (few distinct values; a row all equal): torch.topk's picks on the GPU, at
    both of moe_route's launches."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randint(0, 3, (t, A3B["e"]), generator=gen, device="cuda").bfloat16()
    logits[0] = 0.0
    w, ids = moe_route(logits, A3B["k"], True)
    assert_same_routing(w, ids, *moe_route_ref(logits, A3B["k"], True))
    assert torch.equal(ids.long(), lowest_first_topk(logits, A3B["k"]))  # the kernel's rule


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("t", [1, 2, 3, 4, 8, 33, 64, 65, 512, 2048])
def test_fused_moe_gpu(t: int, fp8: bool) -> None:
    """fused_moe against the ref (W8A8 against its own ref too) at Qwen3-30B-A3B's shapes."""
    experts = gpu_experts(fp8)
    x, logits = gpu_inputs(t)
    got = fused_moe(x, logits, top_k=A3B["k"], renormalize=True, **experts)
    want = fused_moe_ref(x, logits, top_k=A3B["k"], renormalize=True, **experts)
    assert got.dtype == torch.bfloat16
    cfg = pick_moe_config(t, A3B["k"], A3B["e"], A3B["h"], A3B["inter"], experts.get("block"))
    if cfg.kind == "w8a8":
        w, ids = moe_route_ref(logits, A3B["k"], True)
        # NOTE: the ref's quantisation of the bf16 intermediate: where it sits one bf16 ulp off
        # the kernel's, its e4m3 rounding may flip (1/16 apart); measured 0.013-0.015 on H200
        assert rel(got, moe_experts_w8a8_ref(x, w, ids, **experts,
                                             quantize=quantize_fp8_groups)) < 2e-2
        assert rel(got, want) < 6e-2
    else:
        assert rel(got, want) < 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("t", [1, 4, 8])
def test_expert_kinds_agree_gpu(t: int, fp8: bool) -> None:
    """The same tokens through every kernel kind (GEMV, tensor cores and their swapped
    product, W8A8 for FP8; at one token the direct GEMV and the sorted one)."""
    experts = gpu_experts(fp8, seed=2)
    x, logits = gpu_inputs(t, seed=2)
    w, ids = moe_route_ref(logits, A3B["k"], True)
    want = moe_experts_ref(x, w, ids, **experts)
    block = experts.get("block")
    gemv = pick_moe_config(t, A3B["k"], A3B["e"], A3B["h"], A3B["inter"], block)
    tile = MoeTile(64, 128 if fp8 else 64)
    cfgs = [gemv] + [MoeConfig(kind, 16, tile, tile, swap)
                     for kind in ("mma", "w8a8")[:1 + fp8] for swap in (False, True)]
    if t == 1:
        cfgs.append(MoeConfig("gemv", 2, *moe_gemv_tiles(2, fp8)))
    for cfg in cfgs:
        got = _moe_experts(x, w, ids, experts["w13"], experts["w2"], experts.get("w13_scale"),
                           experts.get("w2_scale"), block, cfg)
        assert rel(got, want) < (6e-2 if cfg.kind == "w8a8" else 1e-2), cfg


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("t", [1, 2, 8, 32])
def test_unreduced_top_k_sum_gpu(t: int) -> None:
    """fused_moe_unreduced's split-sum slots, taken, give fused_moe's output (the top-k sum
    in fp32 either way, rounded once)."""
    experts = gpu_experts(True, seed=3)
    x, logits = gpu_inputs(t, seed=3)
    want = fused_moe(x, logits, top_k=A3B["k"], renormalize=True, **experts)
    got = fused_moe_unreduced(x, logits, top_k=A3B["k"], renormalize=True, **experts)
    assert isinstance(got, SplitSums)
    assert rel(take(got), want) < 1e-3


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("t", [1, 8])
def test_fused_moe_graph_gpu(t: int, fp8: bool) -> None:
    """Captured in a CUDA graph (a decode step): replays follow new tokens and new routings."""
    experts = gpu_experts(fp8)
    x, logits = gpu_inputs(t)
    graph, out = capture(lambda: fused_moe(x, logits, top_k=A3B["k"], renormalize=True,
                                           **experts))
    x2, logits2 = gpu_inputs(t, seed=5)
    x.copy_(x2)
    logits.copy_(logits2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused_moe(x, logits, top_k=A3B["k"], renormalize=True, **experts))


@pytest.mark.gpu
@needs_cuda
def test_one_token_slots_graph_gpu() -> None:
    """Batch-1 decode as the model runs it: the routing, gate_up and down (into split-sum
    slots, its first chunk of W loaded before gate_up ends, with PDL) and the slots' sum, in
    a CUDA graph, replayed on new tokens and routings, against the ref."""
    experts = gpu_experts(True, seed=6)
    x, logits = gpu_inputs(1, seed=6)

    def layer() -> torch.Tensor:
        got = fused_moe_unreduced(x, logits, top_k=A3B["k"], renormalize=True, **experts)
        assert isinstance(got, SplitSums)
        return take(got)
    graph, out = capture(layer)
    for seed in (7, 8):
        x2, logits2 = gpu_inputs(1, seed=seed)
        x.copy_(x2)
        logits.copy_(logits2)
        graph.replay()
        torch.cuda.synchronize()
        want = fused_moe_ref(x, logits, top_k=A3B["k"], renormalize=True, **experts)
        assert rel(out, want) < 1e-2, seed
        assert torch.equal(out, layer())
