"""Constrained decoding: the grammar's mask inside the sampler, on the engine's real step path.

A random-weight model is the hard case: nothing but the mask makes its output JSON.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
import torch
from conftest import run

from arle.config import EngineConfig
from arle.engine.build import create_engine
from arle.engine.request import GenerateRequest, Grammar, SamplingParams
from arle.errors import InvalidRequestError
from arle.executor.grammar import apply_token_bitmask, bitmask_words

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "ok": {"type": "boolean"}},
    "required": ["name", "age", "tags", "ok"], "additionalProperties": False}


def test_the_bitmask_allows_exactly_its_bits() -> None:
    vocab = 70  # three words, the last one partly past the vocabulary
    allowed = {0, 5, 31, 32, 63, 69}
    words = [0] * bitmask_words(vocab)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    bitmask = torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in words],
                            [-1] * len(words)], dtype=torch.int32)
    logits = torch.randn(2, 100)  # a model vocabulary padded past the bitmask's 96 bits
    out = apply_token_bitmask(logits, bitmask)
    kept = {i for i in range(100) if out[0, i] > -float("inf")}
    assert kept == allowed
    assert torch.equal(out[0, sorted(allowed)], logits[0, sorted(allowed)])
    assert torch.equal(out[1, :96], logits[1, :96])
    assert torch.isinf(out[1, 96:]).all()


async def test_random_weights_follow_the_schema(tiny, make_engine) -> None:  # type: ignore[no-untyped-def]
    """Greedy, sampled and seeded requests side by side, with an unconstrained neighbour: every
    constrained output that ends by EOS parses and validates."""
    engine = make_engine(tiny, max_running_requests=8)
    grammar = Grammar("json_schema", SCHEMA)

    async def one(temperature: float, seed: int | None) -> tuple[str, str | None]:
        req = GenerateRequest(prompt="Give me a person:", grammar=grammar, params=SamplingParams(
            temperature=temperature, seed=seed, max_tokens=200))
        deltas = [d async for d in engine.generate(req)]
        return "".join(d.text for d in deltas), deltas[-1].finish_reason

    results = await asyncio.gather(one(0.0, None), one(1.0, 1), one(1.0, 2), one(0.7, None),
                                   run(engine, "hello", max_tokens=30))
    for text, finish in results[:4]:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert results[4][-1].finish_reason == "length"  # the neighbour is not constrained


async def test_json_object_and_a_cut_off(tiny, make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tiny)
    req = GenerateRequest(prompt="{", grammar=Grammar("json_object"),
                          params=SamplingParams(temperature=0.0, max_tokens=300))
    deltas = [d async for d in engine.generate(req)]
    text = "".join(d.text for d in deltas)
    if deltas[-1].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: a prefix of some JSON object
        assert text.startswith("{")
    req = GenerateRequest(prompt="x", grammar=Grammar("regex", "[0-9]{3}"),
                          params=SamplingParams(temperature=1.0, max_tokens=2, seed=3))
    deltas = [d async for d in engine.generate(req)]
    assert deltas[-1].finish_reason == "length"
    assert "".join(d.text for d in deltas).isdigit()


async def test_a_bad_schema_is_the_requests_fault(tiny, make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tiny)
    req = GenerateRequest(prompt="x", grammar=Grammar("json_schema", {"type": "nonsense"},
                                                      param="response_format.json_schema"))
    with pytest.raises(InvalidRequestError) as e:
        [d async for d in engine.generate(req)]
    assert e.value.param == "response_format.json_schema"
    deltas = await run(engine, "still fine", max_tokens=3)  # the engine goes on
    assert deltas[-1].finish_reason == "length"


async def test_steps_without_grammar_rows_start_no_mask_job(tiny, make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(tiny)
    masks = engine.executor.dev.grammar_masks
    started: list[int] = []
    start = masks.start

    def counted(rows, batch_size):  # type: ignore[no-untyped-def]
        started.append(len(rows))
        return start(rows, batch_size)

    masks.start = counted
    await run(engine, "plain", max_tokens=8)
    assert started == []
    req = GenerateRequest(prompt="x", grammar=Grammar("regex", "[ab]{6}"),
                          params=SamplingParams(temperature=0.0, max_tokens=20))
    deltas = [d async for d in engine.generate(req)]
    text = "".join(d.text for d in deltas)
    assert len(text) == 6 and set(text) <= {"a", "b"} and deltas[-1].finish_reason == "stop"
    assert started and all(n == 1 for n in started)


async def test_a_vocabulary_padded_past_the_tokenizers(tiny_dir) -> None:  # type: ignore[no-untyped-def]
    """A model whose embedding is wider than its tokenizer (320 ids, 259 tokens): the grammar's
    masks are as wide as the model's vocabulary (a mask of the tokenizer's width failed every
    constrained step), and no id past the tokenizer's is sampled."""
    config = EngineConfig(model=str(tiny_dir), kv_cache_tokens=4096)
    async with await create_engine(config) as engine:
        assert engine.model_info["vocab_size"] > engine.tokenizer.vocab_size
        req = GenerateRequest(prompt="{", grammar=Grammar("json_object"),
                              params=SamplingParams(temperature=1.0, max_tokens=40, seed=1))
        deltas = [d async for d in engine.generate(req)]
    assert deltas[-1].finish_reason in ("stop", "length"), deltas[-1].error
    ids = [t for d in deltas for t in d.token_ids]
    assert ids and max(ids) < engine.tokenizer.vocab_size
    assert "".join(d.text for d in deltas).startswith("{")
