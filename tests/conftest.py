"""Fixtures shared by the engine tests: the default model loaded once, a tiny random model that
shares its tokenizer, and a factory for engines around either."""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import require_smollm2_gguf

from arle.config import EngineConfig
from arle.engine.async_engine import AsyncEngine
from arle.engine.build import engine_from_loaded
from arle.engine.request import Delta, GenerateRequest, SamplingParams
from arle.model.config import ModelConfig
from arle.model.decoder import DecoderLM
from arle.model.loader import LoadedModel, load_model
from arle.threads import torch_thread

if os.environ.get("PYTEST_XDIST_WORKER"):
    # NOTE: under pytest-xdist every worker, and each process it starts (servers, CLIs, ranks),
    # keeps to one torch thread: the workers' OpenMP teams spin while idle, and two or more
    # of them on a 2-core machine slow each other's tests tenfold.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smol() -> LoadedModel:
    """SmolLM2-135M-Instruct from the default GGUF, fp32 (~7 s, once per session). Loaded on the
    engine's torch thread, as create_engine does (see torch_thread)."""
    path = require_smollm2_gguf()
    return torch_thread().submit(load_model, path, "float32", "cpu").result()


def tiny_config(vocab_size: int, **overrides: Any) -> ModelConfig:
    base = {
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": vocab_size, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 2048, "tie_word_embeddings": False,
    }
    return ModelConfig.from_hf({**base, **overrides}, "tiny")


@pytest.fixture(scope="session")
def tiny(smol: LoadedModel) -> LoadedModel:
    """A 2-layer random Qwen3 with SmolLM2's tokenizer: fast and deterministic. Its logits have a
    std of ~2: spread enough that greedy has no near-ties, flat enough that sampling varies."""
    gen = torch.Generator().manual_seed(0)
    model = DecoderLM(tiny_config(smol.config.vocab_size))
    for name, p in model.named_parameters():
        if "norm" in name:
            continue
        fan_in = p.shape[-1]
        scale = 1.0 if "embed" in name else 0.25 if "lm_head" in name else fan_in ** -0.5
        p.data.copy_(torch.randn(p.shape, generator=gen) * scale)
    return replace(smol, model=model.eval(), config=model.config, name="tiny",
                   path=Path("tiny"), generation_defaults={})


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama directory for `arle serve` (served.write_tiny_model), per module."""
    from served import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture
async def make_engine() -> AsyncIterator[Callable[..., AsyncEngine]]:
    """Build engines around a LoadedModel; after the test every engine is closed and its cache
    must hold the invariant with no request live: each page free or published, none lost."""
    engines: list[AsyncEngine] = []

    def build(loaded: LoadedModel, **config: Any) -> AsyncEngine:
        config.setdefault("kv_cache_tokens", 4096)
        engine = engine_from_loaded(EngineConfig(**config), loaded)
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        await engine.close()
    for engine in engines:
        assert_all_pages_back(engine)


async def run(engine: AsyncEngine, prompt: str | list[int] | None = None,
              messages: list[dict[str, Any]] | None = None, **params: Any) -> list[Delta]:
    """All deltas of one request."""
    params.setdefault("temperature", 0.0)
    req = GenerateRequest(prompt=prompt, messages=messages, params=SamplingParams(**params))
    return [d async for d in engine.generate(req)]


def tokens_of(deltas: list[Delta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def text_of(deltas: list[Delta]) -> str:
    return "".join(d.text for d in deltas)


async def run_many(engine: AsyncEngine, prompts: list[Any], **params: Any) -> list[list[Delta]]:
    return list(await asyncio.gather(*(run(engine, p, **params) for p in prompts)))


async def run_together(engine: AsyncEngine, prompts: list[Any],
                       **params: Any) -> list[list[Delta]]:
    """`run_many`, with every request queued before the engine's first step. Tokenizing happens
    in threads, so a batch otherwise reaches the scheduler in pieces whose split follows the
    machine's load, and a step's row count picks kernels (packed int4 up to PACKED_MAX_ROWS,
    bf16-expanded above) whose numbers differ: a test comparing two engines' logprobs needs
    the same steps in both."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "_ensure_loop", lambda: None)
        tasks = [asyncio.ensure_future(run(engine, p, **params)) for p in prompts]
        while len(engine.scheduler.waiting) < len(prompts) and not any(t.done() for t in tasks):
            await asyncio.sleep(0.001)
    engine._ensure_loop()
    return list(await asyncio.gather(*tasks))


async def cancel_mid_stream(engine: AsyncEngine, req: GenerateRequest, timeout: float = 30,
                            check: Callable[[], None] | None = None) -> None:
    """Stream `req` until its first output, cancel it 50 ms later (`check` runs just before),
    and return once the cancellation has reached the consumer."""
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(req):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), timeout)
    await asyncio.sleep(0.05)
    if check is not None:
        check()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def assert_all_pages_back(engine: AsyncEngine) -> None:
    """Every page is free or cached (none private, none lost), every slot free."""
    engine.cache.check([])
    assert engine.cache.num_available == engine.cache.num_pages


#: The modules that take longest on a 2-core CPU (20-60 s each), longest first. pytest-xdist
#: hands out modules in the order they are collected: these go first, so that the processes
#: end together instead of one waiting on the other's long module at the end.
LONGEST_MODULES = ("test_clients", "test_speculative", "test_tensor_parallel",
                   "test_kernels_deltanet", "test_fp8_weights", "test_qwen3_5",
                   "test_kernels_moe", "test_parity", "test_kernels_fp8")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest modules first (a stable sort: the order within a module stays).
    NOTE: test ids are unique: pytest-xdist schedules tests by id, and of tests that share
    one it runs a single test, silently."""
    counts = Counter(item.nodeid for item in items)
    repeated = sorted(nodeid for nodeid, n in counts.items() if n > 1)
    if repeated:
        raise pytest.UsageError(f"tests share an id (pytest-xdist would run one): {repeated}")

    def rank(item: pytest.Item) -> int:
        name = item.path.stem
        return LONGEST_MODULES.index(name) if name in LONGEST_MODULES else len(LONGEST_MODULES)

    items.sort(key=rank)
