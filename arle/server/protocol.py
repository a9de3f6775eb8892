"""The OpenAI wire format: request models (strict, unknown fields rejected) and the JSON of the
responses and stream chunks.

NOTE: pydantic checks *shapes and types* here; *ranges* (top_p <= 1, max_tokens >= 1, ...) are
checked once, by `SamplingParams.validate()`, so the server, the CLI and the engine agree on them.
A field the engine cannot honour is rejected with 400 naming it (`check_supported`), never ignored;
a field that changes nothing arle computes (`IGNORED_FIELDS`) is accepted and logged at debug.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from arle.engine.request import Delta, SamplingParams, TokenLogprob, Usage
from arle.errors import InvalidRequestError
from arle.logging import get_logger

log = get_logger("arle.server")

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


#: Fields accepted and ignored: none changes what arle computes (bookkeeping for OpenAI's own
#: platform, a cache-routing hint, a latency hint whose output must equal the plain answer).
#: `reasoning_effort` is ignored only for a chat template without a thinking switch (app.py).
IGNORED_FIELDS = ("metadata", "service_tier", "store", "user", "safety_identifier",
                  "prompt_cache_key", "prediction", "reasoning_effort")

#: At most this many choices (prompts x n) per request: each is an engine request.
MAX_CHOICES = 128


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    #: vLLM's: every chunk carries the usage so far (guidellm sends it).
    continuous_usage_stats: bool = False
    #: OpenAI's padding of chunks against length side channels: no effect on the text.
    include_obfuscation: bool | None = None


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
    n: int | None = 1
    logit_bias: dict[str, float] | None = None
    # accepted and ignored (IGNORED_FIELDS)
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    store: bool | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None

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
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            raise InvalidRequestError(f"n must be in [1, {MAX_CHOICES}], got {self.n}",
                                      param="n")
        ignored = [name for name in IGNORED_FIELDS if getattr(self, name) is not None]
        if ignored:
            log.debug("ignored_fields", fields=ignored)
        if self.logit_bias:
            raise InvalidRequestError("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options needs stream: true", param="stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def num_choices(self) -> int:
        return self.n or 1

    def choice_params(self, params: SamplingParams, i: int) -> SamplingParams:
        """Choice i's params: with a seed, choice i > 0 draws from seed + i, so the choices
        differ while each stays reproducible."""
        if i == 0 or params.seed is None:
            return params
        return replace(params, seed=params.seed + i)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    response_format: ResponseFormat | None = None
    #: One prompt (text or token ids), or a list of them: one choice per prompt (times n).
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    def check_supported(self) -> None:
        self._check_common()
        if self.best_of is not None and self.best_of != self.num_choices:
            # NOTE: best_of > n would rank the candidates by their logprob: not implemented
            raise InvalidRequestError(f"best_of must equal n ({self.num_choices}), got "
                                      f"{self.best_of}", param="best_of")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError("max_tokens 0 (score the prompt only) needs echo: true",
                                      param="max_tokens")
        total = len(self.prompts) * self.num_choices
        if total > MAX_CHOICES:
            raise InvalidRequestError(f"{len(self.prompts)} prompts x n={self.num_choices} is "
                                      f"{total} choices, over {MAX_CHOICES}", param="prompt")

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice group (a list of ids is one prompt)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], (str, list)):
            return list(p)
        return [p]  # type: ignore[list-item]

    @property
    def score_only(self) -> bool:
        """max_tokens 0 with echo: the prompt and its logprobs, no new token."""
        return self.max_tokens == 0

    def sampling_params(self, engine_defaults: Any, max_model_len: int) -> SamplingParams:
        # NOTE: a score-only request samples one token at the end of its prefill (no extra
        # forward pass) and the server drops it: the engine always samples at least one.
        max_tokens = 1 if self.score_only else self.max_tokens
        params = self._sampling(engine_defaults, max_tokens, self.logprobs, 16)
        if self.echo and self.logprobs is not None:
            params = replace(params, prompt_logprobs=self.logprobs)
        return params


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


def parse_request(model: type[Any], data: object) -> Any:
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
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body: `code` is a string or null, never a number."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class Decoder:
    """Token id -> token text for logprobs (OpenAI shows each token as its text)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def text(self, token_id: int) -> str:
        return str(self._tok.decode([token_id], skip_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """A prompt's ids as text, special tokens kept (an echo shows what the model read)."""
        return str(self._tok.decode(ids, skip_special_tokens=False))


def completion_logprobs(lps: Sequence[TokenLogprob | None], dec: Decoder, offset: int,
                        ids: Sequence[int] = ()) -> dict[str, Any]:
    """The legacy completions logprobs object. A None entry (an echoed prompt's first token:
    nothing before it scores it) is token `ids[i]` with null logprob and null alternatives."""
    tokens = [dec.text(ids[i] if lp is None else lp.token_id) for i, lp in enumerate(lps)]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    def top(lp: TokenLogprob | None) -> dict[str, float] | None:
        # NOTE: keyed by text, two tokens can collide (lone bytes all read as U+FFFD): keep
        # the first, the likelier (`top` is best first).
        if lp is None:
            return None
        out: dict[str, float] = {}
        for t, p in lp.top:
            out.setdefault(dec.text(t), p)
        return out

    return {"tokens": tokens, "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
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
