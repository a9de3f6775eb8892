"""`arle serve` as a client sees it: a real server subprocess (a tiny random model, so it loads
and generates fast) driven by the official `openai` SDK and by raw HTTP for what the SDK hides
(status codes, headers, error bodies, disconnects). One server for the module; a second one,
small and keyed, for overload, auth and shutdown."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from served import OneTokenEngine, ServerProcess, arle_server

from arle.engine.request import Delta, GenerateRequest, Usage
from arle.server.app import create_app, openapi_schema
from arle.server.protocol import ChatCompletionRequest, CompletionRequest

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024
MAX_BODY = 65536


@pytest.fixture(scope="module")
def server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with arle_server(["--model", str(tiny_dir), "--max-model-len", str(MAX_MODEL_LEN),
                      "--kv-cache-tokens", "16384", "--max-running-requests", "64",
                      "--served-model-name", "tiny", "--max-body-bytes", str(MAX_BODY)],
                     log) as s:
        yield s


@pytest.fixture
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c


def stats(server: ServerProcess) -> dict[str, Any]:
    r = httpx.get(server.url + "/v1/stats", timeout=10)
    assert r.status_code == 200
    return dict(r.json())


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def pages_all_back(s: dict[str, Any]) -> bool:
    e = s["engine"]
    return (e["running"] == 0 and e["waiting"] == 0
            and e["kv_pages_free"] + e["kv_pages_evictable"] == e["kv_pages_total"])


# ---- the plain routes ----------------------------------------------------------------------------


def test_health_ready_models(server: ServerProcess, client: openai.OpenAI) -> None:
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    r = httpx.get(server.url + "/ready")
    assert r.status_code == 200 and r.json()["status"] == "ready"
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    card = models[0].model_dump()
    assert card["max_model_len"] == MAX_MODEL_LEN and card["vocab_size"] == 259  # the tokenizer's, not the padded 320
    spec = httpx.get(server.url + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(spec["paths"])


# ---- completions and chat through the SDK --------------------------------------------------------


def test_completion_and_stream_agree(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="tiny", prompt="Hello there", max_tokens=12,
                                      temperature=0, extra_body={"ignore_eos": True})
    choice = whole.choices[0]
    assert choice.finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens == len(b"Hello there")  # byte-level tokenizer
    chunks = list(client.completions.create(
        model="tiny", prompt="Hello there", max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    body = chunks[:-1]
    assert all(c.usage is None for c in body)
    assert [c.choices[0].finish_reason for c in body] == [None] * (len(body) - 1) + ["length"]
    assert "".join(c.choices[0].text for c in body) == choice.text


def test_token_id_prompt_and_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=3,
                                    temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    assert out.usage is not None and out.usage.prompt_tokens == 4
    lp = out.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs or []) == 3
    # NOTE: the legacy format keys alternatives by their text: two byte tokens that are not
    # UTF-8 on their own both read as U+FFFD and share a key.
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs or [])
    # Greedy: the chosen token is the likeliest, so its logprob is the best of its top list.
    for chosen, top in zip(lp.token_logprobs or [], lp.top_logprobs or [], strict=True):
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)


def test_completion_logprobs_zero(server: ServerProcess) -> None:
    """logprobs=0 asks for the chosen tokens' logprobs and no alternatives (0 is not False)."""
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 3, "temperature": 0,
            "ignore_eos": True, "logprobs": 0}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp is not None and len(lp["token_logprobs"]) == 3
    assert all(x <= 0 for x in lp["token_logprobs"]) and lp["top_logprobs"] == [{}] * 3
    r = httpx.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=30)
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    streamed = [x for e in events for x in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == pytest.approx(lp["token_logprobs"], abs=1e-4)


def test_null_means_default(server: ServerProcess) -> None:
    """OpenAI's spec lets n, stream, echo, best_of, suffix and logprobs be null; some clients
    send every field."""
    nulls = {"n": None, "stream": None, "stream_options": None, "stop": None, "seed": None}
    r = httpx.post(server.url + "/v1/completions", timeout=30, json={
        "prompt": "x", "max_tokens": 2, **nulls, "echo": None, "best_of": None,
        "suffix": None, "logprobs": None})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **nulls,
        "logprobs": None, "top_logprobs": None})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion"


def test_chat_and_stream_shape(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage is not None and whole.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].finish_reason is None
    usage_chunk, content = chunks[-1], chunks[1:-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 10
    reasons = [c.choices[0].finish_reason for c in content]
    assert reasons == [None] * (len(content) - 1) + ["length"]
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text == whole.choices[0].message.content


def test_stop_string_and_seed(client: openai.OpenAI) -> None:
    base = client.completions.create(model="tiny", prompt="abc", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) >= 4
    stop = base[2:4]
    cut = client.completions.create(model="tiny", prompt="abc", max_tokens=20, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == base[:base.index(stop)]
    runs = [client.completions.create(model="tiny", prompt="abc", max_tokens=16, temperature=1,
                                      seed=7, extra_body={"ignore_eos": True}).choices[0].text
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_64_concurrent_streams(server: ServerProcess) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str | None]:
        stream = await client.completions.create(
            model="tiny", prompt=f"stream {i}", max_tokens=16, temperature=0.8, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        tokens, reason = 0, None
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
        return tokens, reason

    async def main() -> list[tuple[int, str | None]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, i) for i in range(64))), 180)

    results = asyncio.run(main())
    assert results == [(16, "length")] * 64
    wait_for(lambda: pages_all_back(stats(server)), 5, "pages back after 64 streams")


# ---- the client goes away ------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_and_frees_pages(server: ServerProcess, stream: bool) -> None:
    before = stats(server)["engine"].get("finished_abort", 0)
    body = {"model": "tiny", "prompt": "a long story", "max_tokens": MAX_MODEL_LEN - 20,
            "ignore_eos": True, "stream": stream}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        if stream:
            with http.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                for _ in range(6):
                    next(lines)
                running = stats(server)["engine"]
                assert running["running"] == 1
                assert running["kv_pages_free"] + running["kv_pages_evictable"] \
                    < running["kv_pages_total"]
        else:
            # A non-streaming request: give up on it once the engine is running it.
            def send() -> None:
                with pytest.raises(httpx.TimeoutException):
                    http.post("/v1/completions", json=body, timeout=0.5)

            send()
    # Closing the connection aborts the request: its pages come back within a step or two.
    t0 = time.monotonic()
    wait_for(lambda: pages_all_back(stats(server)), 3, "the aborted request's pages")
    assert time.monotonic() - t0 < 1.0
    assert stats(server)["engine"]["finished_abort"] == before + 1


# ---- bad requests: each gets its status and error body; a good stream goes on ---------------------

LONG_PROMPT = list(range(10, 260)) * 5  # 1250 token ids > MAX_MODEL_LEN

BAD: list[tuple[str, str, bytes | dict[str, Any], int, str | None]] = [
    ("POST", "/v1/completions", b'{"prompt": "x", ', 400, None),
    ("POST", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, None),
    ("POST", "/v1/completions", b'["a list"]', 400, None),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("POST", "/v1/completions", {"prompt": "x", "top_k": -5}, 400, "top_k"),
    ("POST", "/v1/completions", {"prompt": "x", "frequency_penalty": 3}, 400,
     "frequency_penalty"),
    ("POST", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("POST", "/v1/completions", {"prompt": "x", "n": 1000}, 400, "n"),
    ("POST", "/v1/completions", {"prompt": ["x"] * 100, "n": 2}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "echo": True, "max_tokens": 0, "logprobs": 30},
     400, "logprobs"),
    ("POST", "/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("POST", "/v1/completions", {"prompt": "x", "bogus": 1}, 400, "bogus"),
    ("POST", "/v1/completions", {"prompt": "x", "stop": ["ok", 1]}, 400, "stop.1"),
    ("POST", "/v1/completions", {"prompt": "x", "stream": True,
                                 "stream_options": {"continuous_usage": True}}, 400,
     "stream_options.continuous_usage"),
    ("POST", "/v1/completions", {"prompt": "x", "metadata": {"a": 1}}, 400, "metadata.a"),
    ("GET", "/v1/models/gpt-17", b"", 404, "model"),
    ("POST", "/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]},
     400, "prompt"),
    ("POST", "/tokenize", {"text": "x"}, 400, "text"),
    ("POST", "/detokenize", {"tokens": [1, -4]}, 400, "tokens"),
    ("POST", "/detokenize", {"tokens": "12"}, 400, "tokens"),
    ("POST", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": LONG_PROMPT}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": "x", "stream": True, "logprobs": 99}, 400,
     "logprobs"),
    ("POST", "/v1/completions", {"prompt": "x", "model": "gpt-17"}, 404, "model"),
    ("POST", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.0.role"),
    ("POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     400, "tools.0.function"),
    ("POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "zz": 1}]}]},
     400, "messages.0.content.0.zz"),
    ("POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, None),
    ("POST", "/v1/nothing", {}, 404, None),
    ("GET", "/v1/completions", b"", 405, None),
    ("DELETE", "/v1/models", b"", 405, None),
    ("POST", "/v1/completions", {"prompt": "x" * (MAX_BODY + 10)}, 413, None),
    # The engine's range checks name the field the client wrote, not SamplingParams' own.
    ("POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 25},
     400, "top_logprobs"),
]


def _send(http: httpx.Client, method: str, path: str, body: bytes | dict[str, Any]
          ) -> httpx.Response:
    if isinstance(body, dict):
        return http.request(method, path, json=body)
    return http.request(method, path, content=body,
                        headers={"content-type": "application/json"})


def test_bad_requests_while_a_good_stream_runs(server: ServerProcess) -> None:
    good: dict[str, Any] = {}

    def run_good() -> None:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                           timeout=60) as c:
            chunks = list(c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "keep going"}],
                max_tokens=300, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True}))
        good["usage"] = chunks[-1].usage
        good["reason"] = chunks[-2].choices[0].finish_reason

    thread = threading.Thread(target=run_good)
    thread.start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            for method, path, body, status, param in BAD:
                r = _send(http, method, path, body)
                where = f"{method} {path} {str(body)[:80]}"
                assert r.status_code == status, (where, r.text)
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}, where
                assert err["code"] is None or isinstance(err["code"], str), (where, err)
                assert err["message"] and err["type"], where
                if param is not None:
                    assert err["param"] == param, (where, err)
                if status == 405:
                    assert r.headers["allow"], where
                if status == 413:
                    assert str(MAX_BODY) in err["message"]
                if body is not None and isinstance(body, dict) and body.get("prompt") \
                        is LONG_PROMPT:
                    assert str(len(LONG_PROMPT)) in err["message"]
                    assert str(MAX_MODEL_LEN) in err["message"]
    finally:
        thread.join(60)
    assert not thread.is_alive()
    assert good["usage"].completion_tokens == 300 and good["reason"] == "length"


def test_traces_carry_route_and_error(server: ServerProcess, client: openai.OpenAI) -> None:
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "t"}],
                                   max_tokens=2)
    httpx.post(server.url + "/v1/completions", json={"prompt": "x", "top_p": 7})
    wait_for(lambda: any(e.get("status") == 400 for e in server.events()), 5, "a 400 trace")
    traces = [e for e in server.events() if e.get("event") == "request_trace"]
    chat = [t for t in traces if t.get("route") == "/v1/chat/completions"]
    assert chat and chat[-1]["error"] is None and chat[-1]["completion_tokens"] >= 1
    bad = [t for t in traces if t.get("status") == 400]
    assert bad[-1]["route"] == "/v1/completions" and bad[-1]["param"] == "top_p"
    assert bad[-1]["error"] == "invalid_request_error"


def test_info_logs_hold_no_text_a_client_chose(server: ServerProcess) -> None:
    """A refused request's trace names the route, status, error type and a known field; what
    the client wrote (an unknown field's name, a path, a schema) stays out of info logs."""
    marks = ["zzfieldmark", "zzpathmark", "zzschemamark"]
    httpx.post(server.url + "/v1/completions", json={"prompt": "x", marks[0]: 1})
    httpx.get(server.url + "/" + marks[1])
    httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {
                "$ref": "#/$defs/" + marks[2]}}}})
    wait_for(lambda: sum(e.get("event") == "request_trace" and e.get("status") in (400, 404)
                         for e in server.events()) >= 3, 5, "three refusal traces")
    text = server.log_path.read_text(errors="replace")
    assert not [m for m in marks if m in text], text[-3000:]


def test_metrics_and_stats(server: ServerProcess, client: openai.OpenAI) -> None:
    client.completions.create(model="tiny", prompt="metrics", max_tokens=4)
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ("arle_requests_total", "arle_prompt_tokens_total", "arle_generation_tokens_total",
                 "arle_time_to_first_token_seconds_bucket",
                 "arle_inter_token_latency_seconds_bucket",
                 "arle_e2e_request_latency_seconds_bucket", "arle_requests_running",
                 "arle_requests_waiting", "arle_kv_pages_used", "arle_kv_pages_free",
                 "arle_prefix_cache_hit_rate", 'arle_step_phase_seconds_total{phase="decode"}',
                 'arle_gc_pause_seconds_total{generation="2"}',
                 'arle_gc_collections_total{generation="0"}',
                 'arle_gc_pause_max_seconds{generation="1"}'):
        assert name in text, name
    s = stats(server)
    assert s["arle_generation_tokens"] >= 4
    assert s["arle_time_to_first_token_seconds"]["count"] >= 1
    assert s["engine"]["kv_pages_total"] > 0
    # `arle serve` froze what start-up left (the cyclic GC's full passes skip it)
    assert s["gc"]["frozen_objects"] > 10_000 and isinstance(s["gc"]["full_collections"], int)
    # and times the collections since: serving a request allocates enough for a few young ones
    young = s["gc"]["pauses"]["gen0"]
    assert young["count"] >= 1 and 0.0 < young["max_ms"] <= young["total_ms"]


# ---- fuzz: whatever the schema allows (and more), never a 5xx, never a hang -------------------------

SCHEMA = schemathesis.openapi.from_dict(openapi_schema())
#: NOTE: one test per operation, each with its own id (schemathesis' own parametrize gives all
#: of them one node id, and pytest-xdist then runs only one of them)
OPERATIONS = {op.label: op for op in (r.ok() for r in SCHEMA.get_all_operations())}


@pytest.mark.parametrize("label", sorted(OPERATIONS))
def test_fuzz_openapi(label: str, server: ServerProcess) -> None:
    @given(case=OPERATIONS[label].as_strategy())
    @settings(max_examples=40, deadline=None, phases=[Phase.generate], database=None,
              suppress_health_check=list(HealthCheck))
    def check(case: Any) -> None:
        body = case.body if isinstance(case.body, dict) else None
        if body is not None and isinstance(body.get("max_tokens"), int):
            body["max_tokens"] = min(body["max_tokens"], 64)  # bound the time, not the validation
        if body is not None and isinstance(body.get("n"), int) and body["n"] > 2:
            body["n"] = 2
        start = time.monotonic()
        response = case.call(base_url=server.url, timeout=30)
        assert response.status_code < 500, (case.body, response.text[:300])
        assert time.monotonic() - start < 30
        if response.status_code >= 400:
            assert set(response.json()["error"]) >= {"message", "type"}

    check()


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=8)
_BASES = {"/v1/completions": {"prompt": "fuzz", "max_tokens": 4},
          "/v1/chat/completions": {"messages": [{"role": "user", "content": "fuzz"}],
                                   "max_tokens": 4}}
_KEYS = sorted({*CompletionRequest.model_fields, *ChatCompletionRequest.model_fields})


@given(path=st.sampled_from(sorted(_BASES)),
       overrides=st.dictionaries(st.sampled_from(_KEYS), _JSON, max_size=3))
@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_fuzz_wrong_types_and_values(server: ServerProcess, path: str,
                                     overrides: dict[str, Any]) -> None:
    """A valid body with a few parameters replaced by arbitrary JSON: a 200 or a 4xx with
    the error body, in bounded time."""
    body = {**_BASES[path], **overrides}
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 64:
        body["max_tokens"] = 64
    if isinstance(body.get("max_completion_tokens"), int) and body["max_completion_tokens"] > 64:
        body["max_completion_tokens"] = 64
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code < 500, (body, r.text[:300])
    if r.status_code >= 400:
        assert r.json()["error"]["message"]


# ---- a failing engine step: 500 for its requests, the server goes on ------------------------------


class _FailingEngine(OneTokenEngine):
    """Its first request fails inside a step (after one token), the ones after succeed."""

    def __init__(self) -> None:
        self.calls = 0

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Delta]:
        self.calls += 1
        rid = req.request_id or "r"
        yield Delta(rid, text="t", token_ids=[1])
        if self.calls % 2 == 1:
            yield Delta(rid, finish_reason="error", error="engine step failed: boom",
                        usage=Usage(1, 1), trace={"route": req.route, "error": "boom"})
        else:
            yield Delta(rid, text="u", token_ids=[2], finish_reason="length",
                        usage=Usage(1, 2), trace={"route": req.route, "error": None})


@pytest.mark.parametrize("stream", [False, True])
async def test_step_failure_is_500_and_serving_goes_on(stream: bool) -> None:
    app = create_app(_FailingEngine())  # type: ignore[arg-type]
    app.state.arle.ready = True
    body = {"prompt": "x", "max_tokens": 4, "stream": stream}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test") as http:
        r = await http.post("/v1/completions", json=body)
        if stream:
            assert r.status_code == 200  # the headers were sent with the first token
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            err = json.loads(events[-2])["error"]
            assert err["type"] == "internal_error" and "boom" in err["message"]
        else:
            assert r.status_code == 500
            err = r.json()["error"]
            assert err["type"] == "internal_error" and "boom" in err["message"]
        ok = await http.post("/v1/completions", json={**body, "stream": False})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "tu"


async def test_itl_metric_and_unknown_paths() -> None:
    """ITL counts the gaps between tokens (not the wait for the first: that is TTFT), and
    unknown paths share one metric label (a scanner must not grow /metrics for good)."""
    engine = _FailingEngine()
    engine.calls = 1  # the next request succeeds with two tokens
    app = create_app(engine)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test") as http:
        r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "tu"
        for path in ("/a", "/b/c", "/wp-login.php"):
            assert (await http.get(path)).status_code == 404
        bad_model = {"prompt": "x", "model": "nope"}
        assert (await http.post("/v1/completions", json=bad_model)).status_code == 404
        s = (await http.get("/v1/stats")).json()
    assert s["arle_inter_token_latency_seconds"]["count"] == 1
    errors = {(e["route"], e["status"]): e["value"] for e in s["arle_http_errors"]}
    assert errors == {("unmatched", "404"): 3.0, ("/v1/completions", "404"): 1.0}


# ---- a second server: small queue, an API key, shutdown ------------------------------------------


@pytest.fixture(scope="module")
def small(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("serve-small") / "serve.log"
    with arle_server(["--model", str(tiny_dir), "--max-running-requests", "1",
                      "--max-waiting", "1", "--api-key", "sekret", "--grace-period", "20",
                      "--kv-cache-tokens", "8192"], log) as s:
        yield s


AUTH = {"Authorization": "Bearer sekret"}


def test_api_key(small: ServerProcess) -> None:
    body = {"prompt": "x", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        r = httpx.post(small.url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401, headers
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(small.url + "/v1/models").status_code == 401
    assert httpx.get(small.url + "/health").status_code == 200
    with openai.OpenAI(base_url=small.url + "/v1", api_key="sekret", max_retries=0) as c:
        assert c.completions.create(model=c.models.list().data[0].id, prompt="x",
                                    max_tokens=2).usage is not None
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=small.url + "/v1", api_key="nope",
                          max_retries=0).models.list()


def test_full_queue_gets_503_with_retry_after(small: ServerProcess) -> None:
    long = {"prompt": "busy", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=small.url, headers=AUTH, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=long) as running:
            assert running.status_code == 200
            waiting: dict[str, Any] = {}

            def queue_one() -> None:
                with httpx.Client(base_url=small.url, headers=AUTH, timeout=30) as h2:
                    waiting["status"] = h2.post("/v1/completions",
                                                json={"prompt": "wait", "max_tokens": 2}
                                                ).status_code

            thread = threading.Thread(target=queue_one)
            thread.start()
            wait_for(lambda: http.get("/v1/stats").json()["engine"]["waiting"] == 1, 10,
                     "a waiting request")
            r = http.post("/v1/completions", json={"prompt": "one too many", "max_tokens": 2})
            assert r.status_code == 503
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "overloaded_error"
        # The running stream is gone (disconnected): the waiting request runs and succeeds.
        thread.join(30)
    assert waiting["status"] == 200


def test_sigterm_finishes_running_requests_and_exits_0(small: ServerProcess) -> None:
    body = {"prompt": "last words", "max_tokens": 200, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=small.url, headers=AUTH, timeout=60) as http, \
            http.stream("POST", "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        next(lines)
        small.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]"
    usage = json.loads(rest[-2][len("data: "):])["usage"]
    assert usage["completion_tokens"] == 200
    assert small.stop(None, timeout_s=30) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(small.url + "/health", timeout=5)


def test_a_body_that_is_not_utf8_is_named_so(server: ServerProcess) -> None:
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "\xff\xfe"}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "not valid UTF-8: byte 12 (0xff)" in message and "surrogate" not in message, message
