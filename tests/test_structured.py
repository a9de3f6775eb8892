"""Structured output and tool calling through `arle serve`, driven by the openai SDK.

The default model (SmolLM2-135M) answers 20 schemas; a random-weight Qwen3 directory with a
Qwen3-style chat template shows that tools reach the prompt and that a history with tool calls
and tool results is templated.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from helpers import require_smollm2_gguf
from served import ServerProcess, arle_server

pytestmark = pytest.mark.slow


def obj(props: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False, **extra}


# NOTE: strings, numbers and arrays are bounded: a small model can write digits or repeat an
# item until max_tokens, and an output cut there is incomplete (finish_reason "length").
S = {"type": "string", "maxLength": 24}
INT = {"type": "integer", "minimum": -1000, "maximum": 100000}
NUM = {"type": "number", "minimum": -1000, "maximum": 1000}
SCHEMAS: list[dict[str, Any]] = [
    obj({"name": S}),
    obj({"name": S, "age": INT}),
    obj({"city": S, "population": {"type": "integer", "minimum": 0, "maximum": 10**10}}),
    obj({"price": NUM, "currency": {"enum": ["USD", "EUR", "GBP"]}}),
    obj({"ok": {"type": "boolean"}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"tags": {"type": "array", "items": S, "maxItems": 4}}),
    obj({"scores": {"type": "array", "items": INT, "minItems": 1,
                    "maxItems": 5}}),
    obj({"person": obj({"first": S, "last": S})}),
    obj({"book": obj({"title": S, "year": {"type": "integer", "minimum": 1000,
                                           "maximum": 2100}})}),
    obj({"points": {"type": "array", "items": obj({"x": NUM, "y": NUM}),
                    "maxItems": 3}}),
    obj({"answer": {"type": "integer", "minimum": 1, "maximum": 10}}),
    obj({"status": {"enum": ["open", "closed"]}, "count": INT}),
    obj({"note": {"type": ["string", "null"], "maxLength": 24}}),
    obj({"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "items": INT, "maxItems": 2}}}),
    obj({"user": obj({"id": INT, "roles": {
        "type": "array", "items": {"enum": ["admin", "dev", "guest"]}, "maxItems": 3}})}),
    {"type": "array", "items": obj({"k": S}), "minItems": 1, "maxItems": 3},
    obj({"temperature": {"type": "number", "minimum": -50, "maximum": 60},
         "unit": {"const": "C"}}),
    obj({"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    obj({"a": obj({"b": obj({"c": INT})}),
         "flag": {"type": "boolean"}}),
]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": obj({"city": S, "unit": {"enum": ["celsius", "fahrenheit"]}})}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time of a city", "parameters": obj(
        {"city": S})}}


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    path = require_smollm2_gguf()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    # NOTE: fp32 weights: the int4 path's prefill chunks past 48 rows and short ones run other
    # kernels (docs/performance.md), so a prompt's tail met again through the prefix cache
    # can flip a near-tie, and these tests ask the same question twice
    with arle_server(["--model", str(path), "--max-model-len", "2048", "--dtype", "float32",
                      "--kv-cache-tokens", "16384", "--max-running-requests", "20",
                      "--served-model-name", "smol"], log, timeout_s=600) as s:
        yield s


@pytest.fixture
def client(smol: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=smol.url + "/v1", api_key="x", max_retries=0,
                       timeout=300) as c:
        yield c


def test_json_schema_output_validates_for_20_schemas(client: openai.OpenAI) -> None:
    def ask(i: int) -> tuple[str, str | None]:
        r = client.chat.completions.create(
            model="smol", temperature=0, max_tokens=200,
            messages=[{"role": "user", "content": "Answer in JSON: tell me something."}],
            response_format={"type": "json_schema", "json_schema": {
                "name": f"s{i}", "schema": SCHEMAS[i], "strict": True}})
        return r.choices[0].message.content or "", r.choices[0].finish_reason

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        answers = list(pool.map(ask, range(len(SCHEMAS))))
    for schema, (text, finish) in zip(SCHEMAS, answers, strict=True):
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_on_completions_and_chat(client: openai.OpenAI) -> None:
    r = client.completions.create(model="smol", prompt="A JSON object about a cat:",
                                  max_tokens=200, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].text), dict)
    # sampled, any object: it may run to max_tokens; what it writes is JSON all the same
    c = client.chat.completions.create(model="smol", temperature=0.8, seed=1, max_tokens=40,
                                       messages=[{"role": "user", "content": "hi"}],
                                       response_format={"type": "json_object"})
    text = c.choices[0].message.content or ""
    if c.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{") and c.usage and c.usage.completion_tokens == 40


def test_named_tool_choice_streams_the_same_call(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        model="smol", temperature=0, max_tokens=200, tools=[WEATHER, TIME],
        messages=[{"role": "user", "content": "What's the weather in Paris?"}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.tool_calls and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments),
                        WEATHER["function"]["parameters"])
    assert r.choices[0].finish_reason == "stop"

    calls: dict[int, dict[str, Any]] = {}
    content = ""
    chunks = list(client.chat.completions.create(stream=True, **kw))
    for chunk in chunks:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or ():
            c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            if tc.id:
                assert c["id"] is None  # the id comes once, in the call's first delta
                c["id"] = tc.id
            if tc.function and tc.function.name:
                c["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                c["arguments"] += tc.function.arguments
    assert content == ""
    assert len(calls) == 1 and calls[0]["id"]
    assert (calls[0]["name"], calls[0]["arguments"]) == (call.function.name,
                                                        call.function.arguments)
    assert sum(1 for ch in chunks for c in ch.choices for _ in c.delta.tool_calls or ()) > 2


def test_required_tool_choice(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="smol", temperature=0, max_tokens=300, tools=[WEATHER, TIME],
        tool_choice="required", parallel_tool_calls=False,
        messages=[{"role": "user", "content": "What time is it in Tokyo?"}])
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls and len(calls) == 1
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    jsonschema.validate(json.loads(calls[0].function.arguments), tools[calls[0].function.name])



def test_required_cut_by_max_tokens_keeps_its_whole_calls(client: openai.OpenAI) -> None:
    """With parallel calls on, the small model repeats its call until max_tokens: the whole
    calls come back (not an empty answer), and the stream carries no empty deltas."""
    kw: dict[str, Any] = dict(model="smol", temperature=0, max_tokens=60, tools=[WEATHER],
                              tool_choice="required",
                              messages=[{"role": "user", "content": "Weather in Paris?"}])
    r = client.chat.completions.create(**kw)
    calls = r.choices[0].message.tool_calls or []
    assert r.choices[0].finish_reason in ("length", "tool_calls")
    whole = [c for c in calls if _parses(c.function.arguments)]
    assert whole, calls
    for c in whole:
        jsonschema.validate(json.loads(c.function.arguments), WEATHER["function"]["parameters"])
    chunks = list(client.chat.completions.create(**kw, stream=True))
    middle = [ch.choices[0].delta for ch in chunks[1:-1] if ch.choices]
    assert all(d.content or d.tool_calls for d in middle), middle
    streamed = {tc.index for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls
                or []}
    assert len(streamed) == len(calls)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def test_history_with_tool_results_answers(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="smol", max_tokens=20, temperature=0, tools=[WEATHER],
                                       messages=tool_history())
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def tool_history() -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]


def test_bad_tool_requests(smol: ServerProcess) -> None:
    base = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "nonsense"}}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "strict": True, "schema": {"$ref": "#"}}}},
         "response_format.json_schema.schema"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "loop", "parameters": {
            "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}}],
          "tool_choice": {"type": "function", "function": {"name": "loop"}}}, "tools"),
    ]
    with httpx.Client(base_url=smol.url, timeout=60) as http:
        for extra, param in cases:
            r = http.post("/v1/chat/completions", json={**base, **extra})
            assert r.status_code == 400, (extra, r.text)
            assert r.json()["error"]["param"] == param, (extra, r.text)


# ---- a Qwen3 template: tools reach the prompt ------------------------------------------------

#: The parts of Qwen3's chat template that concern tools (its system preamble, the assistant's
#: calls, the tool results), written for these tests.
QWEN3_TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}\
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}
{%- for tc in message.tool_calls or [] %}
{%- set tc = tc.function if tc.function is defined else tc %}
<tool_call>
{"name": "{{ tc.name }}", "arguments": {{ tc.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from model_dirs import hf_config, write_model_dir

    path = tmp_path_factory.mktemp("qwen3") / "qwen3"
    write_model_dir(path, hf_config("Qwen3ForCausalLM", max_position_embeddings=4096))
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(
        {**cfg, "chat_template": QWEN3_TOOLS_TEMPLATE}))
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with arle_server(["--model", str(path), "--served-model-name", "qwen3"], log) as s:
        yield s


def qwen3_prompt_tokens(path_template: str, messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]] | None) -> int:
    """What transformers' renderer makes of the same template and messages, in tokens (the
    byte tokenizer: one per byte, the ChatML markers one each)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], tools=tools,
                                        chat_template=path_template,
                                        add_generation_prompt=True)
    text = rendered[0]
    markers = sum(text.count(m) for m in ("<|im_start|>", "<|im_end|>"))
    body = text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    return markers + len(body.encode())


def test_auto_renders_tools_through_the_template(qwen3: ServerProcess) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with openai.OpenAI(base_url=qwen3.url + "/v1", api_key="x", max_retries=0,
                       timeout=120) as client:
        plain = client.chat.completions.create(model="qwen3", messages=messages, max_tokens=4)
        r = client.chat.completions.create(model="qwen3", messages=messages, max_tokens=4,
                                           tools=[WEATHER], tool_choice="auto")
        none = client.chat.completions.create(model="qwen3", messages=messages, max_tokens=4,
                                              tools=[WEATHER], tool_choice="none")
        history = client.chat.completions.create(model="qwen3", messages=tool_history(),
                                                 max_tokens=4, tools=[WEATHER])
    assert r.usage and plain.usage and none.usage and history.usage
    assert r.usage.prompt_tokens == qwen3_prompt_tokens(QWEN3_TOOLS_TEMPLATE, messages, [WEATHER])
    assert plain.usage.prompt_tokens == qwen3_prompt_tokens(QWEN3_TOOLS_TEMPLATE, messages, None)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    # what arle hands the template: a call's arguments as an object, its null content as ""
    history_dicts = tool_history()
    history_dicts[1]["content"] = ""
    history_dicts[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris",
                                                                  "unit": "celsius"}
    assert history.usage.prompt_tokens == qwen3_prompt_tokens(
        QWEN3_TOOLS_TEMPLATE, history_dicts, [WEATHER])
    assert history.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_call_parsing() -> None:
    """The model's syntaxes -> tool_calls, whole or fed a character at a time."""
    from arle.server.tools import ToolCallParser, ToolPlan, tool_message

    plan = ToolPlan("auto", [WEATHER, TIME])
    qwen = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n'
            '</tool_call>')
    llama = '{"name": "get_time", "parameters": {"city": "Lima"}}'
    for text, content, calls in [
        (qwen, "Let me check.\n", [("get_weather", {"city": "Oslo"}),
                                   ("get_time", {"city": "Rome"})]),
        (llama, None, [("get_time", {"city": "Lima"})]),
        ("no <tool_call here", "no <tool_call here", []),
        ('{"name": "unknown", "parameters": {}}', '{"name": "unknown", "parameters": {}}', []),
        ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
        ("cut <tool_call>\n{\"name\"", "cut <tool_call>\n{\"name\"", []),
    ]:
        msg = tool_message(ToolCallParser(plan), text)
        assert msg["content"] == content, text
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
               for c in msg.get("tool_calls", [])]
        assert got == calls, text
        stream = ToolCallParser(plan)
        streamed, deltas = "", []
        for ch in text:
            c, d = stream.feed(ch)
            streamed, deltas = streamed + c, deltas + d
        c, d = stream.finish()
        streamed, deltas = streamed + c, deltas + d
        assert streamed == (content or ""), text
        assembled: dict[int, list[str]] = {}
        for d in deltas:
            entry = assembled.setdefault(d["index"], ["", ""])
            entry[0] += d["function"].get("name", "")
            entry[1] += d["function"]["arguments"]
        assert [(n, json.loads(a)) for n, a in assembled.values()] == calls
    single = tool_message(ToolCallParser(ToolPlan("auto", [WEATHER, TIME], parallel=False)), qwen)
    assert [c["function"]["name"] for c in single["tool_calls"]] == ["get_weather"]



# ---- /v1/responses: the chat route behind OpenAI's Responses API -------------------------------

def test_responses_text_and_stream_agree(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="smol", instructions="Answer briefly.", input="Say hello.",
                              max_output_tokens=12, temperature=0)
    r = client.responses.create(**kw)
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.output_text and r.status in ("completed", "incomplete")
    assert r.usage is not None and r.usage.output_tokens <= 12 and r.usage.input_tokens > 5
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == f"response.{r.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == r.output_text
    assert events[-1].response.output_text == r.output_text  # type: ignore[union-attr]


def test_responses_tools_and_structured_text(client: openai.OpenAI) -> None:
    fn = {"type": "function", **WEATHER["function"]}
    r = client.responses.create(model="smol", input="Weather in Oslo?", tools=[fn],  # type: ignore[list-item]
                                tool_choice={"type": "function", "name": "get_weather"},
                                temperature=0, max_output_tokens=100)
    call = r.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    events = list(client.responses.create(
        model="smol", input="Weather in Oslo?", tools=[fn],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
        max_output_tokens=100, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == call.arguments
    follow = client.responses.create(model="smol", tools=[fn], max_output_tokens=5,  # type: ignore[list-item]
                                     input=[{"role": "user", "content": "Weather in Oslo?"},
                                            {"type": "function_call", "call_id": call.call_id,
                                             "name": call.name, "arguments": call.arguments},
                                            {"type": "function_call_output",
                                             "call_id": call.call_id, "output": "21 C"}])
    assert follow.status in ("completed", "incomplete")
    schema = SCHEMAS[3]
    j = client.responses.create(model="smol", input="A price, please.", temperature=0,
                                max_output_tokens=100, text={"format": {
                                    "type": "json_schema", "name": "price", "schema": schema,
                                    "strict": True}})
    jsonschema.validate(json.loads(j.output_text), schema)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="smol", input="x", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_messages_for_a_template_without_tools() -> None:
    from arle.server.tools import prepare_messages

    call = tool_history()[1]["tool_calls"][0]
    out = prepare_messages([
        {"role": "system", "content": [{"type": "text", "text": "Be nice."}]},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "assistant", "content": [{"type": "text", "text": "So:"}], "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21"}], None, [WEATHER])
    block = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
             '"unit": "celsius"}}\n</tool_call>')
    assert out[0]["role"] == "system" and "get_weather" in out[0]["content"]
    assert out[1]["content"] == [{"type": "text", "text": "Be nice."}]
    assert out[2]["content"] == block
    assert out[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris",
                                                                "unit": "celsius"}
    assert out[3]["content"] == [{"type": "text", "text": "So:"}, {"type": "text", "text": block}]
    assert out[4] == {"role": "tool", "tool_call_id": "call_1", "content": "21"}


def test_responses_request_becomes_a_chat_request() -> None:
    from arle.errors import InvalidRequestError
    from arle.server.responses import chat_body

    body = chat_body({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                  {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                  {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "ok"}],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"}, "store": False,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}})
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    assert body["max_tokens"] == 9 and body["temperature"] == 0 and "store" not in body
    assert body["tools"] == [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}}
    for bad, param in [({"input": "x", "previous_response_id": "r"}, "previous_response_id"),
                       ({"input": "x", "bogus": 1}, "bogus"), ({}, "input"),
                       ({"input": [{"type": "image"}]}, "input.0.type"),
                       ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type")]:
        with pytest.raises(InvalidRequestError) as e:
            chat_body(bad)
        assert e.value.param == param


def test_required_calls_come_out_as_each_is_whole_and_survive_a_cut() -> None:
    """tool_choice "required" cut by max_tokens: every whole call is returned, each streamed
    as soon as its closing brace arrives; the call that was cut comes as OpenAI gives one on
    `length` (its name, the arguments so far)."""
    from arle.server.tools import ToolCallParser, ToolPlan, tool_message

    plan = ToolPlan("required", [WEATHER, TIME])
    whole = ['{"name":"get_weather","arguments":{"city":"Paris"}}',
             '{"name":"get_time","arguments":{"city":"Rome"}}']
    text = "[" + ",".join(whole) + ',{"name":"get_weather","arguments":{"city":"Ly'
    stream = ToolCallParser(plan)
    seen_at: list[int] = []
    deltas: list[dict[str, Any]] = []
    for i, ch in enumerate(text):
        _, d = stream.feed(ch)
        if d:
            seen_at.append(i)
        deltas += d
    assert seen_at == [len(whole[0]), len(whole[0]) + 1 + len(whole[1])]  # at each "}"
    _, last = stream.finish()
    deltas += last
    msg = tool_message(ToolCallParser(plan), text)
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]
    assert calls == [("get_weather", '{"city":"Paris"}'), ("get_time", '{"city":"Rome"}'),
                     ("get_weather", '{"city":"Ly')]
    streamed: dict[int, str] = {}
    for d in deltas:
        streamed[d["index"]] = streamed.get(d["index"], "") + d["function"]["arguments"]
    assert list(streamed.values()) == [a for _, a in calls]


def test_arguments_are_compact_json_in_every_mode() -> None:
    """One rule for a call's arguments string, whatever the mode: JSON with no spaces."""
    from arle.server.tools import ToolCallParser, ToolPlan, tool_message

    spaced = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    want = '{"city":"Paris","unit":"celsius"}'
    for plan, text in [(ToolPlan("auto", [WEATHER]), f"<tool_call>\n{spaced}\n</tool_call>"),
                       (ToolPlan("auto", [WEATHER]), spaced.replace("arguments", "parameters")),
                       (ToolPlan("required", [WEATHER]), f"[{spaced}]"),
                       (ToolPlan("named", [WEATHER], "get_weather"), want)]:
        msg = tool_message(ToolCallParser(plan), text)
        assert msg["tool_calls"][0]["function"]["arguments"] == want, (plan.mode, text)


def test_responses_errors_name_the_responses_parameters(smol: ServerProcess) -> None:
    """A bad `text.format` schema on /v1/responses is named as the client wrote it."""
    body = {"input": "x", "max_output_tokens": 2, "text": {"format": {
        "type": "json_schema", "name": "x", "strict": True, "schema": {"$ref": "#"}}}}
    r = httpx.post(smol.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "text.format.schema", err
    assert "response_format" not in err["message"], err
