"""The OpenAI wire format: request models (strict, unknown fields rejected) and the JSON of the
responses and stream chunks.

NOTE: pydantic checks *shapes and types* here; *ranges* (top_p <= 1, max_tokens >= 1, ...) are
checked once, by `SamplingParams.validate()`, so the server, the CLI and the engine agree on them.
A field the engine cannot honour is rejected with 400 naming it (`check_supported`), never ignored.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from arle.engine.request import Delta, SamplingParams, TokenLogprob, Usage
from arle.errors import InvalidRequestError

# NOTE: strict: "1" is not an int and 1.5 is not an int; floats reject NaN/inf. An int is
# accepted where a float is expected (JSON has one number type).
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

Stop = str | list[str] | None


class JSONSchemaFormat(BaseModel):
    model_config = _STRICT
    name: str = "response"
    description: str | None = None
    #: NOTE: named `schema` on the wire; the attribute avoids BaseModel.schema.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`response_format`: text, any JSON object, or JSON that validates against a schema."""

    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """What /v1/completions and /v1/chat/completions share."""

    model_config = _STRICT

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: Stop = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # NOTE: OpenAI's spec lets n, stream, echo and chat's logprobs be null (some clients send
    # every field): null means the default.
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = 1
    logit_bias: dict[str, float] | None = None

    def _sampling(self, engine_defaults: Any, max_tokens: int | None, logprobs: int | None,
                  default_max_tokens: int) -> SamplingParams:
        overrides: dict[str, Any] = {
            name: getattr(self, name)
            for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                         "frequency_penalty", "repetition_penalty", "seed")
        }
        stop = self.stop
        overrides.update(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens)
        params: SamplingParams = engine_defaults(**overrides)
        params.validate()
        return params

    def _check_common(self) -> None:
        if self.n not in (None, 1):
            raise InvalidRequestError(f"n must be 1 (arle returns one choice), got {self.n}",
                                      param="n")
        if self.logit_bias:
            raise InvalidRequestError("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options needs stream: true", param="stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    response_format: ResponseFormat | None = None
    prompt: str | list[int] | list[str]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    def check_supported(self) -> None:
        self._check_common()
        if self.echo:
            raise InvalidRequestError("echo is not supported", param="echo")
        if self.best_of not in (None, 1):
            raise InvalidRequestError("best_of must be 1", param="best_of")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        p = self.prompt
        if isinstance(p, list) and len(p) > 1 and isinstance(p[0], str):
            raise InvalidRequestError(
                f"a list of {len(p)} prompts: arle takes one prompt per request", param="prompt")

    @property
    def prompt_input(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            return str(p[0])
        return p  # type: ignore[return-value]

    def sampling_params(self, engine_defaults: Any, max_model_len: int) -> SamplingParams:
        return self._sampling(engine_defaults, self.max_tokens, self.logprobs, 16)


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = _STRICT
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    def check_supported(self) -> None:
        self._check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise InvalidRequestError("give max_tokens or max_completion_tokens, not both",
                                      param="max_completion_tokens")

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True, by_alias=True) for m in self.messages]

    def sampling_params(self, engine_defaults: Any, max_model_len: int) -> SamplingParams:
        limit = self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        try:
            # NOTE: no limit given: up to the context (the engine stops at max_model_len).
            return self._sampling(engine_defaults, limit, logprobs, max_model_len)
        except InvalidRequestError as e:
            # SamplingParams names its own fields; the error names the one the client wrote.
            aliases = {"logprobs": "top_logprobs"}
            if self.max_completion_tokens is not None:
                aliases["max_tokens"] = "max_completion_tokens"
            alias = aliases.get(e.param or "")
            if alias is None:
                raise
            raise InvalidRequestError(str(e).replace(e.param or "", alias, 1),
                                      param=alias) from None


def parse_request(model: type[CompletionRequest] | type[ChatCompletionRequest],
                  data: object) -> Any:
    """Validate a decoded JSON body; the first problem becomes an InvalidRequestError naming
    its parameter (`messages.0.role`, `top_p`, ...)."""
    if not isinstance(data, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        # NOTE: with unions, the deepest error is the informative one ("messages.0.content.0.zz
        # is not allowed" rather than "messages.0.content is not a string").
        err = max(e.errors(include_url=False), key=lambda x: len(x["loc"]))
        # NOTE: a union reports one error per branch; the location up to the first branch tag is
        # the parameter the client wrote.
        raw = list(err["loc"])
        # NOTE: an unknown key is the client's own text, kept whatever it looks like.
        keep_last = err["type"] == "extra_forbidden"
        loc = [str(p) for i, p in enumerate(raw)
               if not _is_branch_tag(p) or (keep_last and i == len(raw) - 1)]
        param = ".".join(loc) or None
        if err["type"] == "extra_forbidden":
            msg = f"unknown or unsupported parameter: {param}"
        elif err["type"] == "missing":
            msg = f"missing required parameter: {param}"
        else:
            msg = f"invalid value for {param}: {err['msg']}"
        raise InvalidRequestError(msg, param=param) from None
    req.check_supported()
    return req


def _is_branch_tag(part: object) -> bool:
    # pydantic names union branches like 'str', 'list[int]', 'function-after[...]'.
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none")
                                      or "[" in part or part in ("TextPart", "NamedToolChoice"))


# ---- responses -------------------------------------------------------------------------------


def usage_json(usage: Usage | None) -> dict[str, Any]:
    u = usage or Usage(0, 0)
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def finish_reason_json(delta: Delta) -> str | None:
    # NOTE: OpenAI knows stop / length; an aborted request ends like a stopped one.
    if delta.finish_reason is None:
        return None
    return "length" if delta.finish_reason == "length" else "stop"


def error_json(message: str, type_: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class Decoder:
    """Token id -> token text for logprobs (OpenAI shows each token as its text)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def text(self, token_id: int) -> str:
        return str(self._tok.decode([token_id], skip_special_tokens=False))


def completion_logprobs(lps: list[TokenLogprob], dec: Decoder, offset: int) -> dict[str, Any]:
    """The legacy completions logprobs object."""
    tokens = [dec.text(lp.token_id) for lp in lps]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    def top(lp: TokenLogprob) -> dict[str, float]:
        # NOTE: keyed by text, two tokens can collide (lone bytes all read as U+FFFD): keep
        # the first, the likelier (`top` is best first).
        out: dict[str, float] = {}
        for t, p in lp.top:
            out.setdefault(dec.text(t), p)
        return out

    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [top(lp) for lp in lps], "text_offset": offsets}


def chat_logprobs(lps: list[TokenLogprob], dec: Decoder) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = dec.text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, p) for t, p in lp.top]} for lp in lps],
            "refusal": None}


def now() -> int:
    return int(time.time())
