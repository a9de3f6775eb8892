"""POST /v1/responses (OpenAI's Responses API) as a translation onto the chat route.

A request becomes a chat completion request (`chat_body`): `instructions` a system message,
`input` (text, or a list of messages, `function_call` and `function_call_output` items) the
messages, `tools` / `tool_choice` / `text.format` / `max_output_tokens` their chat names. The
chat answer (a completion, or its stream of chunks) is turned into a response object, or into
the Responses stream events (`translate_stream`). What only a stateful server can do
(`previous_response_id`, `background`, stored responses) is refused with the parameter named.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import orjson

from arle.errors import InvalidRequestError

#: Accepted and ignored: they change nothing arle computes.
_IGNORED = ("store", "metadata", "user", "service_tier", "truncation", "include",
            "prompt_cache_key", "safety_identifier", "reasoning")
_REFUSED = ("previous_response_id", "background", "conversation", "prompt")
_SAMPLING = ("temperature", "top_p", "parallel_tool_calls", "seed", "stop", "top_k", "min_p",
             "presence_penalty", "frequency_penalty", "repetition_penalty", "model")
#: the Responses request fields arle reads, ignores or refuses by name
RESPONSES_FIELDS = frozenset({"input", "instructions", "tools", "tool_choice", "text",
                              "max_output_tokens", "stream", *_IGNORED, *_REFUSED, *_SAMPLING})


def chat_body(body: object) -> dict[str, Any]:
    """A chat completion request body for a Responses request body (InvalidRequestError naming
    the parameter for what cannot be translated)."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    for key in body:
        if key not in RESPONSES_FIELDS:
            raise InvalidRequestError(f"unknown or unsupported parameter: {key}", param=key)
    for key in _REFUSED:
        if body.get(key) is not None:
            raise InvalidRequestError(f"{key} is not supported (arle keeps no state between "
                                      "requests)", param=key)
    if "input" not in body:
        raise InvalidRequestError("missing required parameter: input", param="input")
    messages: list[dict[str, Any]] = []
    if body.get("instructions") is not None:
        messages.append({"role": "system", "content": body["instructions"]})
    messages += _messages(body["input"])
    out: dict[str, Any] = {k: body[k] for k in _SAMPLING if body.get(k) is not None}
    out["messages"] = messages
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        if not isinstance(body["tools"], list):
            raise InvalidRequestError("tools must be a list", param="tools")
        out["tools"] = [_tool(t, i) for i, t in enumerate(body["tools"])]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        out["tool_choice"] = choice
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        out["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": fmt.get("type")}
    if body.get("stream"):
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    return out


def _messages(items: Any) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise InvalidRequestError("input must be a string or a list of items", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidRequestError(f"input[{i}] must be an object", param=f"input.{i}")
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role"), "content": _content(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function", "function": {
                "name": item.get("name"), "arguments": item.get("arguments")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant message
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else orjson.dumps(
                            output).decode()})
        else:
            raise InvalidRequestError(f"input item type {kind!r} is not supported",
                                      param=f"input.{i}.type")
    return out


def _content(content: Any, i: int) -> Any:
    if not isinstance(content, list):
        return content
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text",
                                                                  "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequestError(f"input[{i}].content: unsupported part type {kind!r}",
                                      param=f"input.{i}.content")
        parts.append({"type": "text", "text": part.get("text")})
    return parts


def _tool(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidRequestError("only function tools are supported", param=f"tools.{i}.type")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


#: chat parameter -> the Responses parameter it came from, for errors (longest first)
_PARAMS = {"response_format.json_schema.schema": "text.format.schema",
           "response_format.json_schema": "text.format", "response_format.type":
           "text.format.type", "response_format": "text.format", "max_tokens":
           "max_output_tokens", "messages": "input", "tool_choice.function": "tool_choice"}


def renamed(e: InvalidRequestError) -> InvalidRequestError:
    """A chat route error, naming the Responses parameter the client wrote, in its `param`
    and in its message."""
    param = e.param or ""
    for chat, ours in _PARAMS.items():
        if param == chat or param.startswith(chat + "."):
            out = InvalidRequestError(str(e).replace(chat, ours), param=ours + param[len(chat):])
            out.http_status = e.http_status
            return out
    return e


# ---- the answer --------------------------------------------------------------------------------

def _usage(chat: dict[str, Any] | None) -> dict[str, Any] | None:
    if not chat:
        return None
    return {"input_tokens": chat["prompt_tokens"], "output_tokens": chat["completion_tokens"],
            "total_tokens": chat["total_tokens"],
            "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"][
                "cached_tokens"]},
            "output_tokens_details": {"reasoning_tokens": 0}}


class ResponseShape:
    """One response's id and echo of the request, and the chat answer turned into it."""

    def __init__(self, body: dict[str, Any], model: str, created: int) -> None:
        self.id = f"resp_{uuid.uuid4().hex[:24]}"
        self.msg_id = f"msg_{uuid.uuid4().hex[:24]}"
        self.body, self.model, self.created = body, model, created

    def envelope(self, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None, finish: str | None) -> dict[str, Any]:
        b = self.body
        fmt = (b.get("text") or {}).get("format") or {"type": "text"}
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "model": self.model, "output": output,
                "incomplete_details": ({"reason": "max_output_tokens"} if finish == "length"
                                       else None),
                "error": None, "instructions": b.get("instructions"),
                "max_output_tokens": b.get("max_output_tokens"),
                "parallel_tool_calls": b.get("parallel_tool_calls", True),
                "temperature": b.get("temperature"), "top_p": b.get("top_p"),
                "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools", []),
                "text": {"format": fmt}, "metadata": b.get("metadata") or {},
                "usage": usage}

    def _message(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}

    @staticmethod
    def _call(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
        return {"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                "status": status}

    def response(self, chat: dict[str, Any]) -> dict[str, Any]:
        """A chat completion -> the response object."""
        choice = chat["choices"][0]
        message = choice["message"]
        output = []
        if message.get("content"):
            output.append(self._message(message["content"]))
        output += [self._call(c) for c in message.get("tool_calls") or ()]
        finish = choice["finish_reason"]
        return self.envelope("incomplete" if finish == "length" else "completed", output,
                             _usage(chat.get("usage")), finish)

    async def translate_stream(self, chunks: AsyncGenerator[bytes, None]
                               ) -> AsyncGenerator[bytes, None]:
        """The chat stream's SSE chunks -> the Responses stream's events. NOTE: closing this
        closes the chat stream, which aborts the request."""
        try:
            async for event in self._events(chunks):
                yield event
        finally:
            await chunks.aclose()

    async def _events(self, chunks: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
        seq = 0

        def event(kind: str, **data: Any) -> bytes:
            nonlocal seq
            seq += 1
            payload = {"type": kind, "sequence_number": seq - 1, **data}
            return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

        yield event("response.created", response=self.envelope("in_progress", [], None, None))
        yield event("response.in_progress", response=self.envelope("in_progress", [], None, None))
        text, text_open, finish, usage = "", False, None, None
        output: list[dict[str, Any]] = []
        calls: dict[int, dict[str, Any]] = {}  # chat call index -> (output index, the call)
        async for raw in chunks:
            if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
                continue
            chunk = orjson.loads(raw[6:])
            if "error" in chunk:
                yield event("error", message=chunk["error"]["message"], code=None, param=None)
                return
            if chunk.get("usage"):
                usage = _usage(chunk["usage"])
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    if not text_open:
                        text_open = True
                        output.append(self._message("", "in_progress"))
                        index = len(output) - 1
                        yield event("response.output_item.added", output_index=index,
                                    item=output[-1])
                        yield event("response.content_part.added", item_id=self.msg_id,
                                    output_index=index, content_index=0,
                                    part={"type": "output_text", "text": "", "annotations": []})
                    text += delta["content"]
                    yield event("response.output_text.delta", item_id=self.msg_id,
                                output_index=_index_of(output, self.msg_id), content_index=0,
                                delta=delta["content"])
                for tc in delta.get("tool_calls") or ():
                    if tc["index"] not in calls:
                        call = {"id": tc["id"], "function": {"name": tc["function"]["name"],
                                                             "arguments": ""}}
                        calls[tc["index"]] = call
                        output.append(self._call(call, "in_progress"))
                        yield event("response.output_item.added", output_index=len(output) - 1,
                                    item=output[-1])
                    call = calls[tc["index"]]
                    fragment = tc["function"].get("arguments") or ""
                    if fragment:
                        call["function"]["arguments"] += fragment
                        item_id = f"fc_{call['id']}"
                        yield event("response.function_call_arguments.delta", item_id=item_id,
                                    output_index=_index_of(output, item_id), delta=fragment)
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
        for index, item in enumerate(output):
            if item["type"] == "message":
                output[index] = self._message(text)
                yield event("response.output_text.done", item_id=self.msg_id,
                            output_index=index, content_index=0, text=text)
                yield event("response.content_part.done", item_id=self.msg_id,
                            output_index=index, content_index=0,
                            part=output[index]["content"][0])
            else:
                call = next(c for c in calls.values() if f"fc_{c['id']}" == item["id"])
                output[index] = self._call(call)
                yield event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=index, arguments=call["function"]["arguments"])
            yield event("response.output_item.done", output_index=index, item=output[index])
        status = "incomplete" if finish == "length" else "completed"
        yield event(f"response.{status}", response=self.envelope(status, output, usage, finish))


def _index_of(output: list[dict[str, Any]], item_id: str) -> int:
    return next(i for i, item in enumerate(output) if item["id"] == item_id)
