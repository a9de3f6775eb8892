"""What third-party clients send, against `arle serve` on a tiny random model (one character per
token): echo and prompt logprobs, score-only requests, prompt lists, n > 1 sharing the prompt's
pages, continuous usage, the accepted-and-ignored fields, the tokenizer routes, /v1/models/{id}.
The prompt logprobs' values are checked against transformers in test_prompt_logprobs.py and
test_clients.py."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from served import ServerProcess, arle_server, write_tiny_model

pytestmark = pytest.mark.slow

PAGE = 16  # the default page size


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tiny = write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with arle_server(["--model", str(tiny), "--max-model-len", "1024",
                      "--kv-cache-tokens", "16384", "--served-model-name", "tiny"], log) as s:
        yield s


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def post(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def sse(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def ids_of(http: httpx.Client, text: str) -> list[int]:
    out: list[int] = post(http, "/tokenize", {"prompt": text, "add_special_tokens": False})[
        "tokens"]
    return out


def test_echo_with_logprobs_as_lm_eval_sends_it(http: httpx.Client) -> None:
    """lm-eval's loglikelihood request: token-id prompts, echo, logprobs 1, max_tokens 1."""
    prompts = [ids_of(http, "The cat sat on the"), ids_of(http, "A dog ran")]
    out = post(http, "/v1/completions", {"model": "tiny", "prompt": prompts, "echo": True,
                                         "logprobs": 1, "max_tokens": 1, "temperature": 0,
                                         "seed": 1234})
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for choice, ids, text in zip(out["choices"], prompts, ["The cat sat on the", "A dog ran"],
                                 strict=True):
        lp = choice["logprobs"]
        assert choice["text"].startswith(text)
        assert len(lp["tokens"]) == len(ids) + 1  # the prompt, then the new token
        assert "".join(lp["tokens"]) == choice["text"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for tok, p, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:],
                               lp["top_logprobs"][1:], strict=True):
            assert p <= 0 and len(top) == 1
            # the one alternative is the likeliest: never below the token's own logprob
            assert max(top.values()) >= p - 1e-5
            if tok in top:
                assert math.isclose(top[tok], p, abs_tol=1e-5)
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i])
                                     for i in range(len(lp["tokens"]))]
    assert out["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    assert out["usage"]["completion_tokens"] == 2


def test_score_only_and_the_same_scores_streamed(http: httpx.Client) -> None:
    body = {"prompt": "Hello, world", "echo": True, "logprobs": 2, "max_tokens": 0}
    out = post(http, "/v1/completions", body)
    choice = out["choices"][0]
    assert choice["text"] == "Hello, world" and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len("Hello, world")
    assert out["usage"]["completion_tokens"] == 0
    assert out["usage"]["prompt_tokens"] == len("Hello, world")
    chunks = sse(http, "/v1/completions", body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello, world"
    assert chunks[0]["choices"][0]["logprobs"] == choice["logprobs"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # echo without logprobs: the prompt's text, no scoring
    plain = post(http, "/v1/completions", {"prompt": "Hi", "echo": True, "max_tokens": 3,
                                           "temperature": 0})
    assert plain["choices"][0]["text"].startswith("Hi")
    assert plain["choices"][0]["logprobs"] is None


def test_a_scored_prompt_is_recomputed_not_read_from_the_cache(
        http: httpx.Client, server: ServerProcess) -> None:
    prompt = "x" * (4 * PAGE) + "tail of the prompt"
    post(http, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    again = post(http, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 4 * PAGE
    scored = post(http, "/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True,
                                            "logprobs": 0})
    assert scored["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert all(p is not None for p in scored["choices"][0]["logprobs"]["token_logprobs"][1:])


def test_n_choices_share_the_prompt_and_differ_by_seed(
        http: httpx.Client, server: ServerProcess) -> None:
    prompt = "n choices " + "y" * (5 * PAGE)
    out = post(http, "/v1/completions", {"prompt": prompt, "n": 3, "max_tokens": 12,
                                         "temperature": 1.0, "seed": 7})
    choices = out["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert len({c["text"] for c in choices}) == 3, "a seed derived per choice: they differ"
    # choice 0 alone, with the same seed, is the same as choice 0 of n
    one = post(http, "/v1/completions", {"prompt": prompt, "max_tokens": 12,
                                         "temperature": 1.0, "seed": 7})
    assert one["choices"][0]["text"] == choices[0]["text"]
    assert out["usage"]["prompt_tokens"] == len(prompt)  # the prompt counts once
    assert out["usage"]["completion_tokens"] == 36
    # the followers reused the leader's pages (their traces: matched tokens)
    rid = out["id"]
    traces = [e for e in server.events() if e.get("event") == "request_trace"
              and str(e.get("request_id", "")).startswith(rid)]
    matched = sorted(t["prefix"]["matched_tokens"] for t in traces)
    assert len(matched) == 3 and matched[0] == 0
    assert matched[1] == matched[2] == (len(prompt) - 1) // PAGE * PAGE


def test_n_streams_chunks_for_every_index_with_continuous_usage(http: httpx.Client) -> None:
    chunks = sse(http, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 5,
        "temperature": 0, "stream_options": {"include_usage": True,
                                             "continuous_usage_stats": True}})
    body = chunks[:-1]
    assert {c["choices"][0]["index"] for c in body} == {0, 1}
    for c in body:
        assert len(c["choices"]) == 1 and c["usage"]["prompt_tokens"] > 0
    done = [c for c in body if c["choices"][0]["finish_reason"] is not None]
    assert sorted(c["choices"][0]["index"] for c in done) == [0, 1]
    # usage grows per choice as its tokens come
    for i in (0, 1):
        seen = [c["usage"]["completion_tokens"] for c in body if c["choices"][0]["index"] == i]
        assert seen == sorted(seen) and seen[-1] == 5
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10


def test_harmless_fields_are_accepted_and_ignored(server: ServerProcess) -> None:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        extra = {"metadata": {"run": "a"}, "service_tier": "auto", "store": False,
                 "user": "u1", "reasoning_effort": "low", "prompt_cache_key": "k",
                 "safety_identifier": "s"}
        plain = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "same"}], max_tokens=6,
            temperature=0)
        ignored = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "same"}], max_tokens=6,
            temperature=0, **extra)  # type: ignore[call-overload]
        assert ignored.choices[0].message.content == plain.choices[0].message.content


def test_models_by_id(http: httpx.Client) -> None:
    r = http.get("/v1/models/tiny")
    assert r.status_code == 200 and r.json()["id"] == "tiny" and r.json()["object"] == "model"
    r = http.get("/v1/models/org/other-model")
    assert r.status_code == 404
    assert r.json()["error"] == {"message": r.json()["error"]["message"],
                                 "type": "invalid_request_error", "param": "model",
                                 "code": "model_not_found"}


def test_tokenizer_routes(http: httpx.Client) -> None:
    out = post(http, "/tokenize", {"prompt": "abc", "return_token_strs": True})
    assert out["count"] == 3 and len(out["tokens"]) == 3 and out["max_model_len"] == 1024
    assert out["token_strs"] == ["a", "b", "c"]
    assert post(http, "/detokenize", {"tokens": out["tokens"]}) == {"prompt": "abc"}
    chat = post(http, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    text = post(http, "/detokenize", {"tokens": chat["tokens"]})["prompt"]
    assert "<|im_start|>" in text and "hi" in text
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == 1024
    # lm-eval's remote tokenizer takes the EOS id as the first id of its string: one token
    assert len(ids_of(http, info["eos_token"])) == 1


def test_openapi_lists_the_new_routes(http: httpx.Client) -> None:
    paths = http.get("/openapi.json").json()["paths"]
    assert {"/tokenize", "/detokenize", "/tokenizer_info", "/v1/models/{model}"} <= set(paths)

