"""Where `arle chat` gets its answers: the engine in this process, or a running arle server.

Both stream an answer's text for a list of chat messages and fill a `TurnStats` as they go, so
an answer cut short (Ctrl-C: the consumer cancels) still has its partial numbers.
NOTE: the engine and httpx are imported lazily: `arle --help` must not pay for them.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol, cast

from arle.errors import ArleError, EngineStepError

if TYPE_CHECKING:
    import httpx

    from arle.engine.async_engine import AsyncEngine
    from arle.engine.request import Delta

#: What `/set` may change, with its type: the SamplingParams a chat user cares about.
SAMPLING_SETTINGS: dict[str, type] = {
    "temperature": float, "top_p": float, "top_k": int, "min_p": float, "max_tokens": int,
    "seed": int, "repetition_penalty": float, "frequency_penalty": float,
    "presence_penalty": float,
}


@dataclass
class TurnStats:
    """One answer's numbers: tokens, the prefix-cache hit and timings (ms, from the request's
    start as the client sees it unless the engine's trace says better)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: float | None = None
    total_ms: float = 0.0
    finish_reason: str | None = None
    #: speculative decoding: drafts the answer kept (None: it drafted nothing)
    accepted_drafts: int | None = None

    @property
    def tokens_per_step(self) -> float | None:
        """Tokens per decode step (speculative decoding: a verify step keeps its accepted
        drafts and one token more); None without speculation."""
        steps = self.completion_tokens - 1 - (self.accepted_drafts or 0)
        if self.accepted_drafts is None or steps < 1:
            return None
        return (self.completion_tokens - 1) / steps

    @property
    def tokens_per_s(self) -> float | None:
        """Decode speed: the tokens after the first over the time after the first."""
        if self.ttft_ms is None or self.completion_tokens < 2 or self.total_ms <= self.ttft_ms:
            return None
        return (self.completion_tokens - 1) / ((self.total_ms - self.ttft_ms) / 1e3)

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["tokens_per_s"] = self.tokens_per_s
        out["tokens_per_step"] = self.tokens_per_step
        return out


class ChatBackend(Protocol):
    #: The model's name, for `/model` and saved conversations.
    model_name: str

    def stream(self, messages: list[dict[str, Any]], settings: dict[str, Any],
               stats: TurnStats) -> AsyncIterator[str]:
        """The answer's text, piece by piece. Closing the iterator stops the answer."""
        ...

    def info(self) -> dict[str, Any]:
        """What `/model` shows."""
        ...

    def effective_settings(self, overrides: dict[str, Any]) -> dict[str, Any]:
        """Each of SAMPLING_SETTINGS with the value an answer uses (None: the server's)."""
        ...

    async def kv_usage(self) -> dict[str, Any] | None:
        """The engine's KV cache use, for `/stats`; None when unknown."""
        ...

    async def close(self) -> None: ...


class EngineBackend:
    """Answers from an AsyncEngine in this process (the same event loop as the prompt)."""

    def __init__(self, engine: AsyncEngine, route: str = "cli.chat") -> None:
        self.engine = engine
        self.route = route
        self.model_name = engine.model_name

    async def stream(self, messages: list[dict[str, Any]], settings: dict[str, Any],
                     stats: TurnStats) -> AsyncIterator[str]:
        from arle.engine.request import GenerateRequest

        request = GenerateRequest(messages=messages, params=self.engine.default_params(**settings),
                                  route=self.route, stream=True)
        start = time.perf_counter()
        # NOTE: aclosing: when our consumer is cancelled, the engine's generator is closed at
        # once, which aborts the request and frees its pages.
        generator = cast("AsyncGenerator[Delta, None]", self.engine.generate(request))
        async with contextlib.aclosing(generator) as deltas:
            async for delta in deltas:
                stats.total_ms = (time.perf_counter() - start) * 1e3
                stats.completion_tokens += len(delta.token_ids)
                if delta.text:
                    if stats.ttft_ms is None:
                        stats.ttft_ms = stats.total_ms
                    yield delta.text
                if delta.finish_reason is None:
                    continue
                stats.finish_reason = delta.finish_reason
                if delta.usage is not None:
                    stats.prompt_tokens = delta.usage.prompt_tokens
                    stats.completion_tokens = delta.usage.completion_tokens
                    stats.cached_tokens = delta.usage.cached_tokens
                trace = delta.trace or {}
                if trace.get("ttft_ms") is not None:
                    stats.ttft_ms = trace["ttft_ms"]
                if trace.get("spec"):
                    stats.accepted_drafts = trace["spec"]["accepted"]
                if delta.error or delta.finish_reason == "error":
                    raise EngineStepError(delta.error or "generation failed")

    def info(self) -> dict[str, Any]:
        pool = self.engine.kv_pool
        return {"model": self.model_name, **self.engine.model_info,
                "max_model_len": self.engine.max_model_len,
                "kv_cache_tokens": pool.num_tokens}

    def effective_settings(self, overrides: dict[str, Any]) -> dict[str, Any]:
        params = self.engine.default_params(**overrides)
        return {name: getattr(params, name) for name in SAMPLING_SETTINGS}

    async def kv_usage(self) -> dict[str, Any] | None:
        snap = self.engine.snapshot()
        pool = self.engine.kv_pool
        return {"pages_total": snap["kv_pages_total"],
                "pages_used": snap["kv_pages_total"] - snap["kv_pages_free"],
                "pages_cached": snap["kv_pages_cached"], "page_size": pool.page_size,
                "running": snap["running"], "waiting": snap["waiting"]}

    async def close(self) -> None:
        await self.engine.close()


class RemoteError(ArleError):
    """The server could not be reached or answered with an error."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        #: The request parameter the server's error names (OpenAI's error JSON), if any.
        self.param = param


class RemoteBackend:
    """Answers from a running arle (or any OpenAI-compatible) server: POST
    /v1/chat/completions with `stream: true`, read as server-sent events."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None,
                 client: httpx.AsyncClient | None = None, timeout_s: float = 600.0) -> None:
        import httpx

        base = url.rstrip("/")
        self.base_url = base.removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = client or httpx.AsyncClient(
            base_url=self.base_url, headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=10.0))
        self.model_name = model or "default"
        self._model_flag = model

    async def connect(self) -> None:
        """Check that the server answers and learn its model's name (GET /v1/models)."""
        data = await self._get_json("/v1/models")
        models = data.get("data") if isinstance(data, dict) else None
        if self._model_flag is None and models and isinstance(models[0], dict):
            self.model_name = str(models[0].get("id", self.model_name))

    async def _get_json(self, path: str) -> Any:
        import httpx

        try:
            resp = await self.client.get(path)
        except httpx.HTTPError as e:
            raise RemoteError(f"cannot reach the server at {self.base_url}: {e!s}") from None
        if resp.status_code != 200:
            raise RemoteError(_error_message(resp.status_code, resp.text))
        try:
            return resp.json()
        except ValueError:
            raise RemoteError(f"{self.base_url}{path}: the answer is not JSON") from None

    async def stream(self, messages: list[dict[str, Any]], settings: dict[str, Any],
                     stats: TurnStats) -> AsyncIterator[str]:
        import httpx

        body = {"model": self.model_name, "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}, **settings}
        start = time.perf_counter()
        try:
            async with self._post_chat(body) as resp:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, comments (": ping"), event names
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    stats.total_ms = (time.perf_counter() - start) * 1e3
                    text = _apply_chunk(_parse_chunk(data), stats)
                    if text:
                        if stats.ttft_ms is None:
                            stats.ttft_ms = stats.total_ms
                        yield text
        except httpx.HTTPError as e:
            raise RemoteError(f"the server at {self.base_url} failed: {e!s}") from None

    @contextlib.asynccontextmanager
    async def _post_chat(self, body: dict[str, Any]) -> AsyncIterator[httpx.Response]:
        """POST /v1/chat/completions; the streaming response once it is a 200."""
        async with self.client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code == 200:
                yield resp
                return
            text = (await resp.aread()).decode(errors="replace")
        param = _error_param(text)
        if resp.status_code == 400 and param == "max_tokens" and "max_tokens" in body:
            # NOTE: max_tokens is a cap in `arle chat`, as with the in-process engine; an
            # OpenAI-style server refuses it when the conversation leaves less room, so ask
            # again without it: up to the rest of the context.
            async with self._post_chat({k: v for k, v in body.items() if k != "max_tokens"}
                                       ) as again:
                yield again
            return
        raise RemoteError(_error_message(resp.status_code, text), param)

    def info(self) -> dict[str, Any]:
        return {"model": self.model_name, "server": self.base_url}

    def effective_settings(self, overrides: dict[str, Any]) -> dict[str, Any]:
        return {name: overrides.get(name) for name in SAMPLING_SETTINGS}

    async def kv_usage(self) -> dict[str, Any] | None:
        return None  # NOTE: the OpenAI API has no such number; the server's /metrics does.

    async def close(self) -> None:
        await self.client.aclose()


def _parse_chunk(data: str) -> dict[str, Any]:
    try:
        chunk = json.loads(data)
    except ValueError:
        raise RemoteError(f"the server sent a malformed event: {data[:80]!r}") from None
    if not isinstance(chunk, dict):
        raise RemoteError(f"the server sent a malformed event: {data[:80]!r}")
    if "error" in chunk:
        err = chunk["error"]
        raise RemoteError(str(err.get("message", err) if isinstance(err, dict) else err))
    return chunk


def _apply_chunk(chunk: dict[str, Any], stats: TurnStats) -> str:
    """The text of one chat.completion.chunk; its finish reason and usage go into `stats`."""
    text = []
    for choice in chunk.get("choices") or []:
        content = (choice.get("delta") or {}).get("content")
        if content:
            text.append(content)
            stats.completion_tokens += 1  # NOTE: a guess until the usage chunk gives the count
        if choice.get("finish_reason"):
            stats.finish_reason = choice["finish_reason"]
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        stats.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        stats.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        stats.cached_tokens = int(details.get("cached_tokens") or 0)
    return "".join(text)


def _error_param(body: str) -> str | None:
    try:
        param = json.loads(body)["error"]["param"]
    except (ValueError, KeyError, TypeError):
        return None
    return param if isinstance(param, str) else None


def _error_message(status: int, body: str) -> str:
    """The server's one-line error message (OpenAI error JSON), else the status and body."""
    try:
        err = json.loads(body).get("error")
        message = err.get("message") if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        message = None
    return f"server error {status}: {message or body.strip()[:200] or 'no details'}"
