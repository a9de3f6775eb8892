"""What a caller hands the engine and what it gets back.

These types are the whole public surface of the engine: front ends (CLI, server, chat) build a
`GenerateRequest`, iterate `AsyncEngine.generate()` and read `Delta`s. `SamplingParams` and
`TokenLogprob` live in `arle.sampling` (the executor uses them too) and are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from arle.sampling import SamplingParams, TokenLogprob

__all__ = ["Delta", "FinishReason", "GenerateRequest", "Grammar", "SamplingParams",
           "TokenLogprob", "Usage"]

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class Grammar:
    """A constraint on the output, enforced token by token (arle.engine.grammar)."""

    kind: Literal["json_schema", "json_object", "lark", "regex"]
    #: the JSON schema (a dict), the Lark grammar or the regex; None for json_object
    source: Any = None
    #: the request parameter it came from, named in errors
    param: str = "response_format"


@dataclass
class GenerateRequest:
    """One generation. Give exactly one of `prompt` (text or token ids) or `messages` (chat)."""

    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None
    #: Where the request came from, for its trace ("cli.complete", "/v1/chat/completions", ...).
    route: str = "engine"
    stream: bool = True
    #: Text prompts: prepend BOS etc. as the tokenizer says. Chat prompts always use the template.
    add_special_tokens: bool = True
    #: max_tokens is the caller's demand (an API client gave it): refuse a request whose prompt
    #: leaves less room than that. Otherwise it is a cap, and generation stops at the context.
    strict_max_tokens: bool = False
    #: Constrain the output to a grammar (structured output, forced tool calls).
    grammar: Grammar | None = None
    #: Chat prompts: tool definitions (OpenAI's `tools` list) for the chat template.
    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Delta:
    """A piece of output. Every delta carries the usage so far; the last has `finish_reason`."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    #: `params.prompt_logprobs`: one entry per prompt token (the first None: nothing before
    #: it to score it by), on the first delta only.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    #: the prompt's ids, beside `prompt_logprobs`
    prompt_token_ids: list[int] | None = None
    finish_reason: FinishReason | None = None
    #: What stopped it: the matched stop string, the stop token id, "eos", "max_tokens", "context".
    stop_reason: str | int | None = None
    usage: Usage | None = None
    #: The request's trace (the same dict logged as `request_trace`), on the last delta only.
    trace: dict[str, Any] | None = None
    error: str | None = None
