"""Tool calling on the chat route: what the template sees, what constrains the output, and the
model's tool-call syntax parsed back into OpenAI's `tool_calls`.

`tool_choice`:
- `none`: the tools are not shown to the model and nothing is parsed;
- `auto` (the default with tools): the tools go to the chat template (`tools` variable); the
  output is parsed for calls in the model's syntax: Qwen / Hermes `<tool_call>{...}</tool_call>`
  blocks, or one JSON object `{"name": ..., "parameters"|"arguments": {...}}` (Llama 3);
- `required` and a named function: the output is constrained by a grammar (arle.engine.grammar),
  so its arguments always validate against the tool's schema: a named function's output *is* its
  arguments; `required` answers a JSON array of {"name", "arguments"} (one item unless
  `parallel_tool_calls`), whatever syntax the model would have used.

Templates that know no tools (no `tools` / `tool_calls` in their source, e.g. ChatML) get the
tools as a system message and earlier calls as `<tool_call>` text, so the model still sees them.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from arle.engine.request import Grammar
from arle.errors import InvalidRequestError
from arle.server.protocol import ChatCompletionRequest, NamedToolChoice
from arle.server.structured import schema_grammar

Mode = Literal["auto", "required", "named"]
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolPlan:
    """How one chat request uses its tools."""

    mode: Mode
    tools: list[dict[str, Any]]  # OpenAI's tool objects, as the template takes them
    named: str | None = None
    grammar: Grammar | None = None
    #: parallel_tool_calls false: an answer's calls after its first are dropped
    parallel: bool = True

    @classmethod
    def of(cls, req: ChatCompletionRequest) -> ToolPlan | None:
        """None when the request has no tools or `tool_choice` is none. Raises
        InvalidRequestError naming the parameter for a choice that cannot be honoured."""
        choice = req.tool_choice
        if not req.tools:
            if choice not in (None, "none"):
                raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
            return None
        names = [t.function.name for t in req.tools]
        twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if twice is not None:
            raise InvalidRequestError(f"two tools are named {twice!r}: a call could not say "
                                      "which it means", param="tools")
        if choice == "none":
            return None
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        params = {t.function.name: t.function.parameters or {"type": "object", "properties": {}}
                  for t in req.tools}
        strict = {t.function.name: bool(t.function.strict) for t in req.tools}
        if choice in (None, "auto"):
            return cls("auto", tools, parallel=req.parallel_tool_calls is not False)
        if req.response_format is not None and req.response_format.type != "text":
            raise InvalidRequestError("response_format cannot be combined with a tool_choice "
                                      "that forces a call", param="response_format")
        if isinstance(choice, NamedToolChoice):
            name = choice.function.name
            if name not in params:
                raise InvalidRequestError(f"tool_choice names {name!r}, which is not in tools",
                                          param="tool_choice.function.name")
            return cls("named", tools, name,
                       schema_grammar(params[name], strict[name], "tools"))
        items = [{"type": "object", "properties": {"name": {"const": n}, "arguments": p},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for n, p in params.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return cls("required", tools, grammar=schema_grammar(schema, all(strict.values()),
                                                              "tools"))

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}


def prepare_messages(messages: list[dict[str, Any]], template: str | None,
                     tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: a call's arguments as an object (Llama 3's
    template writes them with `tojson`), and for templates that know no tools, the tools and the
    calls as text (module docstring)."""
    source = template or ""
    knows_calls = "tool_calls" in source
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            m["tool_calls"] = [_template_call(c) for c in calls]
            if not knows_calls:
                text = "\n".join(f"{_OPEN}\n{json.dumps(_wire_call(c), ensure_ascii=False)}\n"
                                 f"{_CLOSE}" for c in calls)
                content = m.get("content")
                m["content"] = ([*content, {"type": "text", "text": text}]
                                if isinstance(content, list)
                                else (content + "\n" if content else "") + text)
            if m.get("content") is None:
                m["content"] = ""  # NOTE: templates concatenate content; a call has none
        out.append(m)
    if tools and "tools" not in source:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        note = ("You may call one or more functions. The functions:\n" + listing + "\nTo call "
                f"one, answer {_OPEN}\n{{\"name\": <name>, \"arguments\": <object>}}\n{_CLOSE}")
        if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + note}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        # not JSON: the template gets the text as it came
        with contextlib.suppress(json.JSONDecodeError):
            fn["arguments"] = json.loads(args)
    return {**call, "function": fn}


def _wire_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = _template_call(call)["function"]
    return {"name": fn.get("name"), "arguments": fn.get("arguments")}


@dataclass
class ToolCallParser:
    """Model output -> (content, tool calls), fed as text arrives; the same object serves a
    whole answer (one feed, then `finish`) and a stream (a feed per delta).

    Each `feed` / `finish` returns the content to emit now and the OpenAI stream deltas of the
    tool calls completed by it (a call's header, then its arguments: one fragment in auto and
    required modes; a fragment per token for a named function).
    """

    plan: ToolPlan
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    _held: str = ""
    #: required: where the next call of the array starts in `_held` (0: before the "[")
    _next: int = 0
    _in_call: bool = False
    _json_answer: bool | None = None  # auto: does the answer start like a JSON call?

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        mode = self.plan.mode
        if mode == "named":
            return "", self._named(text)
        self._held += text
        if mode == "required":
            return "", self._array(final=False)
        if self._json_answer is None and self._held.strip():
            self._json_answer = self._held.lstrip().startswith("{")
        if self._json_answer is not False:
            return "", []  # a JSON call (Llama 3) is known only once whole: at the end
        return self._scan(final=False)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        mode = self.plan.mode
        if mode == "named":
            return "", []
        if mode == "required":
            return "", self._array(final=True)
        held, self._held = self._held, ""
        if self._json_answer:
            obj = _parse_json(held)
            if isinstance(obj, dict) and obj.get("name") in self.plan.names:
                args = obj.get("parameters", obj.get("arguments", {}))
                return "", self._add([(obj["name"], args)])
            return self._text(held), []
        self._held = held
        return self._scan(final=True)

    # ---- the three syntaxes ------------------------------------------------------------------
    def _named(self, text: str) -> list[dict[str, Any]]:
        deltas = []
        if not self.calls:
            self.calls.append({"id": call_id(), "type": "function",
                               "function": {"name": self.plan.named, "arguments": ""}})
            deltas.append(_header(0, self.calls[0]))
        if text:
            self.calls[0]["function"]["arguments"] += text
            deltas.append({"index": 0, "function": {"arguments": text}})
        return deltas

    def _array(self, final: bool) -> list[dict[str, Any]]:
        """required: the answer is a JSON array of calls; each call is taken as soon as it is
        whole. At the end, a call cut off (max_tokens) is given as OpenAI gives one: its name
        and the arguments' text so far."""
        held, i = self._held, self._next
        if i == 0:
            i = len(held) - len(held.lstrip())
            if held[i:i + 1] != "[":
                return []
            i += 1
        calls: list[tuple[Any, Any]] = []
        while True:
            j = i + len(held[i:]) - len(held[i:].lstrip(" \t\n\r,"))
            try:
                call, end = _DECODER.raw_decode(held, j)
            except json.JSONDecodeError:
                break
            if isinstance(call, dict):
                calls.append((call.get("name"), call.get("arguments")))
            i = end
        self._next = i
        cut = _CUT_CALL.match(held, i) if final else None
        name = json.loads(f'"{cut[1]}"') if cut is not None else None
        if cut is not None and name in self.plan.names:
            calls.append((name, cut[2].rstrip()))
        return self._add(calls)

    def _scan(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """Qwen / Hermes blocks: text outside them is content; a partial `<tool_call>` at the
        end is held until it completes or cannot."""
        content: str = ""
        deltas: list[dict[str, Any]] = []
        while True:
            if self._in_call:
                end = self._held.find(_CLOSE)
                if end < 0:
                    if final:  # an unfinished call: give the text back as it is
                        content += self._text(_OPEN + self._held)
                        self._held = ""
                    return content, deltas
                body, self._held = self._held[:end], self._held[end + len(_CLOSE):]
                self._in_call = False
                obj = _parse_json(body)
                if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                    deltas += self._add([(obj["name"], obj.get("arguments", {}))])
                else:
                    content += self._text(_OPEN + body + _CLOSE)
                continue
            start = self._held.find(_OPEN)
            if start >= 0:
                content += self._text(self._held[:start])
                self._held = self._held[start + len(_OPEN):]
                self._in_call = True
                continue
            keep = 0 if final else _partial_tail(self._held, _OPEN)
            content += self._text(self._held[:len(self._held) - keep])
            self._held = self._held[len(self._held) - keep:]
            return content, deltas

    def _text(self, text: str) -> str:
        # NOTE: the whitespace around calls is the syntax's, not the answer's
        if self.calls and not text.strip():
            return ""
        self.content += text
        return text

    def _add(self, calls: list[tuple[Any, Any]]) -> list[dict[str, Any]]:
        deltas = []
        for name, args in calls:
            if self.calls and not self.plan.parallel:
                break
            text = args if isinstance(args, str) else compact_json(args)
            call = {"id": call_id(), "type": "function",
                    "function": {"name": str(name), "arguments": text}}
            index = len(self.calls)
            self.calls.append(call)
            deltas += [_header(index, call), {"index": index, "function": {"arguments": text}}]
        return deltas


_DECODER = json.JSONDecoder()
#: a call of the required array cut off: its name and the start of its arguments
_CUT_CALL = re.compile(
    r'[\s,]*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(.*)\Z', re.DOTALL)


def compact_json(value: Any) -> str:
    """A call's arguments as every mode gives them: JSON with no spaces between tokens (as
    OpenAI writes them, and as the constrained modes generate them), non-ASCII as is."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _header(index: int, call: dict[str, Any]) -> dict[str, Any]:
    return {"index": index, "id": call["id"], "type": "function",
            "function": {"name": call["function"]["name"], "arguments": ""}}


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text.strip())
    except json.JSONDecodeError:
        return None


def _partial_tail(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def tool_message(parser: ToolCallParser, text: str) -> dict[str, Any]:
    """The assistant message of a whole answer: content, and its tool calls if any."""
    parser.feed(text)
    parser.finish()
    content: str | None = parser.content
    if parser.calls and not (content or "").strip():
        content = None  # OpenAI: a message that only calls tools has null content
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if parser.calls:
        message["tool_calls"] = parser.calls
    return message


def tool_finish_reason(parser: ToolCallParser, reason: str | None) -> str | None:
    """OpenAI's `tool_calls` where the model chose to call (auto, required); a named function
    ends with `stop`, as OpenAI's forced calls do."""
    if reason == "stop" and parser.calls and parser.plan.mode != "named":
        return "tool_calls"
    return reason
