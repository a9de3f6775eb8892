"""The OpenAI-compatible ASGI app around one AsyncEngine.

Why Starlette and not FastAPI: every byte of an error matters here (OpenAI's error body, 400 and
never 422, `param` naming the field, `Allow` / `Retry-After` / `WWW-Authenticate` headers), and
the streams need their own disconnect handling. FastAPI would validate and answer for us and we
would spend code undoing it; Starlette is the routing and request/response layer and nothing
more. The request models are pydantic (protocol.py) and /openapi.json is built from them.

Every response that is not a success goes through `error_response`, the one mapping from an
exception (arle.errors' `http_status` / `error_type`) to a status and OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import ctypes
import dataclasses
import functools
import hmac
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

import orjson
from pydantic.json_schema import models_json_schema
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from arle.engine.request import Delta, GenerateRequest, TokenLogprob, Usage
from arle.errors import ArleError, EngineStepError, InvalidRequestError, OverloadedError
from arle.logging import get_logger
from arle.server import DEFAULT_MAX_BODY_BYTES, protocol, tokenizer_api
from arle.server.guards import Guards, Refusal
from arle.server.metrics import CONTENT_TYPE, ServerMetrics
from arle.server.protocol import ChatCompletionRequest, CompletionRequest, Decoder
from arle.server.responses import RESPONSES_FIELDS, ResponseShape, chat_body, renamed
from arle.server.structured import response_format_grammar
from arle.server.tools import (
    ToolCallParser,
    ToolPlan,
    prepare_messages,
    tool_finish_reason,
    tool_message,
)

if TYPE_CHECKING:
    from arle.engine.async_engine import AsyncEngine

log = get_logger("arle.server")
T = TypeVar("T")



@dataclass
class ServerSettings:
    served_model_name: str | None = None
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    #: Seconds a client should wait after a 503.
    retry_after_s: int = 1
    #: Host header names answered (see guards.py); None: any.
    allowed_hosts: tuple[str, ...] | None = None
    #: Web origins whose pages may call the API (CORS); "*": any.
    allowed_origins: tuple[str, ...] = ()


@dataclass
class ServerState:
    engine: AsyncEngine
    settings: ServerSettings
    metrics: ServerMetrics
    model_name: str
    ready: bool = False
    shutting_down: bool = False
    decoder: Decoder = field(init=False)

    def __post_init__(self) -> None:
        self.decoder = Decoder(self.engine.tokenizer)


# ---- errors ------------------------------------------------------------------------------------


class HTTPError(ArleError):
    """An HTTP-level refusal (401, 404, 405, 413) with its own status, type and headers."""

    def __init__(self, status: int, message: str, error_type: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.http_status = status
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = headers or {}


class EndedByServer(OverloadedError):
    """The server ended the request (shutting down); the engine logged its trace already."""


class ClientGone(Exception):
    """The client disconnected; nobody is left to answer."""


class JSONResponse(Response):
    """JSON through orjson: fast, and a non-finite float (a -inf logprob) becomes null instead
    of failing the response."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(exc: BaseException, retry_after_s: int = 1) -> JSONResponse:
    """The one mapping from an exception to an HTTP error response."""
    if isinstance(exc, ArleError):
        status, type_, message = exc.http_status, exc.error_type, str(exc)
    else:
        status, type_, message = 500, "internal_error", f"internal error: {exc!r}"
    headers = dict(getattr(exc, "headers", None) or {})
    if isinstance(exc, OverloadedError):
        headers.setdefault("Retry-After", str(retry_after_s))
    body = protocol.error_json(message, type_, getattr(exc, "param", None),
                               getattr(exc, "code", None))
    return JSONResponse(body, status_code=status, headers=headers)


# ---- helpers -----------------------------------------------------------------------------------


def _json_error(body: bytearray, e: orjson.JSONDecodeError) -> str:
    """What is wrong with a body orjson refused: its first byte that is not UTF-8 (orjson
    calls every such byte a surrogate), else the JSON error."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as u:
        return (f"the request body is not valid UTF-8: byte {u.start} "
                f"(0x{body[u.start]:02x}): {u.reason}")
    return f"malformed JSON body: {e}"


#: Request fields a trace may name: what the routes define (a client's unknown field stays out).
_FIELDS = frozenset({*protocol.CompletionRequest.model_fields,
                     *protocol.ChatCompletionRequest.model_fields,
                     *tokenizer_api.TokenizeRequest.model_fields, *RESPONSES_FIELDS})


def _trace_fields(route: str, status: int, exc: BaseException) -> dict[str, Any]:
    """A refused request's trace: its route, status, error type, code and the field it names.
    NOTE: a client's mistake (4xx) is told in the client's words (an unknown field, a schema
    pointer, a Host header): its message is logged at debug only, so an info log holds no
    text a client chose."""
    error_type = getattr(exc, "error_type", "internal_error")
    param = getattr(exc, "param", None)
    fields: dict[str, Any] = {"route": route, "status": status, "error": error_type,
                              "code": getattr(exc, "code", None),
                              "param": param if str(param).split(".")[0] in _FIELDS else None}
    if status >= 500:
        fields["message"] = str(exc)
    else:
        log.debug("request_refused", route=route, message=str(exc))
    return fields


#: A request body this large leaves the heap trimmed after it (`HeapTrim`).
LARGE_BODY_BYTES = 1 << 20


def _large_body(request: Request) -> bool:
    """A body of LARGE_BODY_BYTES or more, or of a length not given ahead (chunked); a request
    with no body (GET /health) is not one."""
    length = request.headers.get("content-length")
    if length is None:
        return "chunked" in request.headers.get("transfer-encoding", "")
    return not length.isdigit() or int(length) >= LARGE_BODY_BYTES


class HeapTrim:
    """Give the C heap's free pages back to the OS once large request bodies are gone
    (glibc's malloc_trim): their pieces (the socket's reads, the body's growth) are scattered
    through the heap, so freed they would stay the server's for good, a burst of large
    requests leaving it hundreds of MB larger. At most one trim queued at a time."""

    def __init__(self) -> None:
        self._queued = False
        self._trim: Any = None
        with contextlib.suppress(OSError, AttributeError):
            self._trim = ctypes.CDLL("libc.so.6").malloc_trim

    def soon(self) -> None:
        if self._trim is None or self._queued:
            return
        self._queued = True
        asyncio.get_running_loop().call_later(0.05, self._run)

    def _run(self) -> None:
        self._queued = False
        self._trim(0)


async def _until_disconnect(receive: Receive, aw: Awaitable[T]) -> T:
    """Await `aw`, cancelling it if the client disconnects first (then raise ClientGone).

    NOTE: cancelling the task that iterates `engine.generate()` runs the generator's `finally`,
    which aborts the request: its pages return before the next step is planned.
    """
    task: asyncio.Future[T] = asyncio.ensure_future(aw)

    async def watch() -> None:
        while True:
            if (await receive())["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    both: set[asyncio.Future[Any]] = {task, watcher}
    try:
        await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we were cancelled (shutdown past its grace period): pass it on
        watcher.cancel()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise
    watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise ClientGone()
    return task.result()


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


class SSEResponse(Response):
    """A text/event-stream response that stops (and closes its source, aborting the request)
    as soon as the client goes away."""

    def __init__(self, chunks: AsyncGenerator[bytes, None]) -> None:
        super().__init__(media_type="text/event-stream")
        self.chunks = chunks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})

        async def pump() -> None:
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await _until_disconnect(receive, pump())
        except (ClientGone, OSError):
            pass
        finally:
            await self.chunks.aclose()


# ---- the app -----------------------------------------------------------------------------------


class _Handlers:
    def __init__(self, state: ServerState) -> None:
        self.s = state

    # -- checks --
    def _auth(self, request: Request) -> None:
        key = self.s.settings.api_key
        if not key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                 key.encode()):
            raise HTTPError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                            "authentication_error", code="invalid_api_key",
                            headers={"WWW-Authenticate": 'Bearer realm="arle"'})

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self._model_names():
            raise HTTPError(404, f"the model {model!r} does not exist; this server serves "
                                 f"{self.s.model_name!r}", "invalid_request_error",
                            param="model", code="model_not_found")

    def _model_names(self) -> set[str]:
        return {self.s.model_name, self.s.engine.model_name}

    async def _read_json(self, request: Request) -> Any:
        limit = self.s.settings.max_body_bytes
        too_big = HTTPError(413, f"the request body is over the limit of {limit} bytes",
                            "invalid_request_error", code="request_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_big
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise too_big
        except ClientDisconnect:
            raise ClientGone from None
        try:
            return orjson.loads(bytes(body))
        except orjson.JSONDecodeError as e:
            raise InvalidRequestError(_json_error(body, e)) from None

    # -- plain routes --
    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        if self.s.ready and not self.s.shutting_down:
            return JSONResponse({"status": "ready", "model": self.s.model_name})
        status = "shutting_down" if self.s.shutting_down else "loading"
        return JSONResponse({"status": status}, status_code=503,
                            headers={"Retry-After": str(self.s.settings.retry_after_s)})

    async def metrics(self, request: Request) -> Response:
        return Response(self.s.metrics.prometheus_text(), media_type=CONTENT_TYPE)

    async def stats(self, request: Request) -> Response:
        self._auth(request)
        return JSONResponse({"model": self.s.model_name, **self.s.metrics.stats()})

    def _model_card(self) -> dict[str, Any]:
        info = self.s.engine.model_info
        return {"id": self.s.model_name, "object": "model",
                "created": int(self.s.metrics.started), "owned_by": "arle",
                "root": info.get("path"), "max_model_len": self.s.engine.max_model_len,
                # NOTE: an arle extension: `arle bench` draws random prompt token ids below it.
                "vocab_size": self.s.engine.tokenizer.vocab_size}

    async def models(self, request: Request) -> Response:
        self._auth(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        self._auth(request)
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    # -- the tokenizer (tokenizer_api.py) --
    async def tokenize(self, request: Request) -> Response:
        self._auth(request)
        req = protocol.parse_request(tokenizer_api.TokenizeRequest, await self._read_json(request))
        self._check_model(req.model)
        engine = self.s.engine
        messages = ([m.model_dump(exclude_none=True) for m in req.messages]
                    if req.messages is not None else None)
        engine.check_text_fits(req.prompt, messages)
        return JSONResponse(await asyncio.to_thread(tokenizer_api.tokenize, engine.tokenizer,
                                                    req, engine.max_model_len))

    async def detokenize(self, request: Request) -> Response:
        self._auth(request)
        req = protocol.parse_request(tokenizer_api.DetokenizeRequest,
                                     await self._read_json(request))
        self._check_model(req.model)
        return JSONResponse(await asyncio.to_thread(tokenizer_api.detokenize,
                                                    self.s.engine.tokenizer, req))

    async def tokenizer_info(self, request: Request) -> Response:
        self._auth(request)
        engine = self.s.engine
        return JSONResponse(tokenizer_api.tokenizer_info(engine.tokenizer, engine.max_model_len))

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_schema())

    # -- generation --
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def responses(self, request: Request) -> Response:
        """The Responses API, translated onto the chat route (arle.server.responses)."""
        self._auth(request)
        self.s.engine.check_admission()  # before the body is read: a burst is refused at once
        body = await self._read_json(request)
        translated = chat_body(body)
        shape = ResponseShape(body, self.s.model_name, protocol.now())
        try:
            return await self._generate(request, chat=True, body=translated, shape=shape)
        except InvalidRequestError as e:
            raise renamed(e) from None

    async def _generate(self, request: Request, chat: bool, body: Any = None,
                        shape: ResponseShape | None = None) -> Response:
        if body is None:
            self._auth(request)
            self.s.engine.check_admission()  # before the body is read: a burst is refused at once
            body = await self._read_json(request)
        model_cls = ChatCompletionRequest if chat else CompletionRequest
        req = protocol.parse_request(model_cls, body)
        self._check_model(req.model)
        if chat and req.reasoning_effort is not None:
            self._check_reasoning_effort()
        engine = self.s.engine
        params = req.sampling_params(engine.default_params, engine.max_model_len)
        if self.s.shutting_down:
            raise OverloadedError("the server is shutting down")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        tools = ToolPlan.of(req) if chat else None
        grammar = (tools.grammar if tools is not None and tools.grammar is not None
                   else response_format_grammar(req.response_format))
        template = getattr(engine.tokenizer, "chat_template", None)
        messages = (prepare_messages(req.message_dicts(), template,
                                     tools.tools if tools else None) if chat else None)
        prompts: list[str | list[int] | None] = [None] if chat else list(req.prompts)
        n = req.num_choices
        many = len(prompts) * n > 1
        choices: list[_Choice] = []
        for prompt in prompts:
            leader: _Choice | None = None
            for j in range(n):
                p = req.choice_params(params, j)
                if leader is not None:  # the leader scores the prompt for all its choices
                    p = dataclasses.replace(p, prompt_logprobs=None)
                i = len(choices)
                greq = GenerateRequest(
                    prompt=prompt, messages=messages, params=p,
                    request_id=f"{rid}-{i}" if many else rid, route=request.url.path,
                    stream=bool(req.stream),
                    add_special_tokens=True if chat else req.add_special_tokens,
                    strict_max_tokens=_max_tokens_given(req, chat), grammar=grammar,
                    tools=tools.tools if tools else None)
                choices.append(_Choice(i, greq, leader, ToolCallParser(tools) if tools else None))
                leader = leader or choices[-1]
        run = _Run(self.s, request.url.path, rid, chat, req, choices)
        # NOTE: every choice's first delta is awaited before any byte is sent, so a request the
        # engine refuses (prompt too long, queue full) gets a real status, not a broken stream.
        try:
            await run.start(request.receive)
        except InvalidRequestError as e:
            if e.param == "max_tokens" and chat and req.max_completion_tokens is not None:
                raise InvalidRequestError(str(e).replace("max_tokens", "max_completion_tokens", 1),
                                          param="max_completion_tokens") from None
            raise
        if shape is not None:
            if req.stream:
                return SSEResponse(shape.translate_stream(run.stream()))
            return JSONResponse(shape.response(
                await _until_disconnect(request.receive, run.collect())))
        if req.stream:
            return SSEResponse(run.stream())
        return JSONResponse(await _until_disconnect(request.receive, run.collect()))

    def _check_reasoning_effort(self) -> None:
        """reasoning_effort is ignored where the chat template has no thinking switch; where it
        has one, ignoring it would give a different answer than asked."""
        template = self.s.engine.tokenizer.chat_template or ""
        if "enable_thinking" in template or "reasoning_effort" in template:
            raise InvalidRequestError("reasoning_effort is not supported for this model (its "
                                      "chat template has a thinking switch arle does not set "
                                      "from it)", param="reasoning_effort")


@dataclass(eq=False)
class _Choice:
    """One choice of a request: one engine request. With n > 1 the first choice of a prompt
    leads: the others start once its first delta is out, when its prefill has put the prompt's
    pages in the prefix cache, so they share its K/V instead of computing their own."""

    index: int
    greq: GenerateRequest
    leader: _Choice | None
    #: chat with tools: the output parsed into tool calls (arle.server.tools)
    tools: ToolCallParser | None = None
    gen: AsyncGenerator[Delta, None] | None = None
    first: Delta | None = None
    usage: Usage | None = None
    finished: bool = False
    closed: bool = False
    #: When the previous token arrived; None until the first (its wait is TTFT, not ITL).
    last_t: float | None = None

    @property
    def prompt_delta(self) -> Delta:
        """The delta with the prompt's logprobs (the leader's first)."""
        first = (self.leader or self).first
        assert first is not None
        return first


class _Run:
    """A request's choices' deltas turned into OpenAI JSON (whole, or as stream chunks)."""

    def __init__(self, state: ServerState, route: str, rid: str, chat: bool, req: Any,
                 choices: list[_Choice]) -> None:
        self.s, self.route, self.rid, self.chat, self.req = state, route, rid, chat, req
        self.choices = choices
        self.created = protocol.now()
        self.model = state.model_name
        self.echo = not chat and bool(req.echo)
        self.score_only = not chat and req.score_only

    # -- the choices' lives --
    async def start(self, receive: Receive) -> None:
        """Start the leaders, then (after their first deltas) the others; raise (aborting all)
        if the engine refuses any."""
        try:
            for group in ([c for c in self.choices if c.leader is None],
                          [c for c in self.choices if c.leader is not None]):
                for c in group:
                    c.gen = cast(AsyncGenerator[Delta, None], self.s.engine.generate(c.greq))
                firsts = await _until_disconnect(receive, asyncio.gather(
                    *(_first(c) for c in group), return_exceptions=True))
                for c, first in zip(group, firsts, strict=True):
                    if isinstance(first, BaseException):
                        raise first
                    c.first = first
        except BaseException as e:
            for c in self.choices:
                await self._close(c, note=isinstance(e, ClientGone))
            raise

    async def _close(self, c: _Choice, note: bool = True) -> None:
        """End choice c's engine request (an abort, unless it finished). Idempotent."""
        if c.closed or c.gen is None:
            return
        c.closed = True
        if note:
            self._note_if_aborted(c)
        await c.gen.aclose()

    async def _end_all(self, tasks: Sequence[asyncio.Future[Any]]) -> None:
        """Cancel the choices' tasks and close every engine request. NOTE: a task cancelled
        before it ran never runs its `finally`: the requests are closed here too."""
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in self.choices:
            await self._close(c)

    def _seen(self, c: _Choice, delta: Delta) -> None:
        if delta.token_ids:
            now = time.perf_counter()
            if c.last_t is not None:
                self.s.metrics.observe_gap(now - c.last_t)
            c.last_t = now
        if delta.finish_reason is not None:
            c.finished = True
            c.usage = delta.usage
            self.s.metrics.observe_finished(delta.trace)

    def _note_if_aborted(self, c: _Choice) -> None:
        if not c.finished:
            self.s.metrics.requests.labels(self.route, "abort").inc()
            log.info("request_aborted", request_id=c.greq.request_id, route=self.route,
                     error="ended before it finished (client gone or server shutting down)")

    async def _deltas(self, c: _Choice) -> AsyncGenerator[Delta, None]:
        """Choice c's deltas, from its first; closes its engine request at the end."""
        assert c.gen is not None and c.first is not None
        delta = c.first
        try:
            while True:
                self._seen(c, delta)
                if delta.finish_reason == "error":
                    raise EngineStepError(delta.error or "generation failed")
                yield delta
                if delta.finish_reason is not None:
                    return
                delta = await c.gen.__anext__()
        finally:
            await self._close(c)

    # -- JSON --
    def _logprobs(self, lps: list[TokenLogprob] | None, offset: int) -> dict[str, Any] | None:
        # NOTE: not `in (None, False)`: 0 == False, and completions' logprobs=0 asks for the
        # chosen tokens' logprobs.
        if lps is None or self.req.logprobs is None or self.req.logprobs is False:
            return None
        dec = self.s.decoder
        return (protocol.chat_logprobs(lps, dec) if self.chat
                else protocol.completion_logprobs(lps, dec, offset))

    def _echo(self, c: _Choice) -> tuple[str, dict[str, Any] | None]:
        """An echoed prompt: its text and (logprobs asked) its logprobs object."""
        prompt = c.greq.prompt
        first = c.prompt_delta
        ids = first.prompt_token_ids
        text = prompt if isinstance(prompt, str) else self.s.decoder.decode(list(prompt or ()))
        if first.prompt_logprobs is None or ids is None:
            return text, None
        return text, protocol.completion_logprobs(first.prompt_logprobs, self.s.decoder, 0, ids)

    def _usage(self, usage: Usage | None) -> Usage | None:
        """A choice's usage as reported: a score-only request's dropped token does not count."""
        if usage is None or not self.score_only:
            return usage
        return dataclasses.replace(usage, completion_tokens=0)

    def _total_usage(self) -> dict[str, Any]:
        """Each prompt counts once (its choices share it), every choice's completion."""
        prompt = completion = cached = 0
        for c in self.choices:
            u = self._usage(c.usage)
            if u is None:
                continue
            completion += u.completion_tokens
            if c.leader is None:
                prompt += u.prompt_tokens
                cached += u.cached_tokens
        return protocol.usage_json(Usage(prompt, completion, cached))

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.rid, "object": kind + (".chunk" if chunk and self.chat else ""),
                "created": self.created, "model": self.model, "system_fingerprint": None,
                "choices": choices}

    def _finish(self, c: _Choice, choice: dict[str, Any], delta: Delta) -> None:
        if self.score_only:  # the prompt is all there is: cut at max_tokens 0
            choice["finish_reason"], choice["stop_reason"] = "length", None
            return
        reason = protocol.finish_reason_json(delta)
        choice["finish_reason"] = (reason if c.tools is None
                                   else tool_finish_reason(c.tools, reason))
        choice["stop_reason"] = delta.stop_reason

    def _chat_delta(self, c: _Choice, text: str, last: bool) -> dict[str, Any]:
        """A stream chunk's `delta`: the content, and with tools the calls completed so far."""
        if c.tools is None:
            return {"content": text} if text or not last else {}
        content, calls = c.tools.feed(text)
        if last:
            more, more_calls = c.tools.finish()
            content, calls = content + more, calls + more_calls
        out: dict[str, Any] = {}
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
        return out

    # -- a whole answer --
    async def collect(self) -> dict[str, Any]:
        tasks = [asyncio.ensure_future(self._collect(c)) for c in self.choices]
        try:
            choices = await asyncio.gather(*tasks)
        finally:  # one choice failed, or the client left: the others end too
            await self._end_all(tasks)
        return {**self._envelope(list(choices), chunk=False), "usage": self._total_usage()}

    async def _collect(self, c: _Choice) -> dict[str, Any]:
        text: list[str] = []
        lps: list[TokenLogprob] = []
        delta = c.first
        async for delta in self._deltas(c):
            text.append(delta.text)
            lps.extend(delta.logprobs or ())
        assert delta is not None
        if delta.error is not None:  # aborted by the server (shutting down)
            raise EndedByServer(delta.error)
        if self.score_only:
            text, lps = [], []
        out = "".join(text)
        logprobs = self._logprobs(lps if lps else None, 0)
        if self.chat:
            message = ({"role": "assistant", "content": out} if c.tools is None
                       else tool_message(c.tools, out))
            choice: dict[str, Any] = {"index": c.index, "message": message, "logprobs": logprobs}
        else:
            if self.echo:
                echo, echo_lps = self._echo(c)
                out = echo + out
                logprobs = _join_logprobs(echo_lps, logprobs, self.req.logprobs is not None)
            choice = {"index": c.index, "text": out, "logprobs": logprobs}
        self._finish(c, choice, delta)
        return choice

    # -- a stream --
    async def stream(self) -> AsyncGenerator[bytes, None]:
        """The choices' chunks as they come (each names its choice's index), then the usage
        chunk (include_usage) and [DONE]."""
        queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()

        async def pump(c: _Choice) -> None:
            try:
                async for chunk in self._chunks(c):
                    queue.put_nowait(chunk)
            except Exception as e:
                queue.put_nowait(e)
            finally:
                queue.put_nowait(None)

        tasks: list[asyncio.Future[None]] = []
        try:
            if self.chat:
                for c in self.choices:
                    assert c.first is not None and c.first.usage is not None
                    yield self._chunk([{"index": c.index,
                                        "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}],
                                      dataclasses.replace(c.first.usage, completion_tokens=0))
            tasks = [asyncio.ensure_future(pump(c)) for c in self.choices]
            live = len(tasks)
            while live:
                item = await queue.get()
                if item is None:
                    live -= 1
                elif isinstance(item, BaseException):
                    # NOTE: a failed step, or the server shutting down past its grace period
                    err = (item if isinstance(item, (EngineStepError, EndedByServer))
                           else EngineStepError(f"generation failed: {item!r}"))
                    yield _sse(protocol.error_json(str(err), err.error_type))
                    break
                else:
                    yield item
            else:
                if self.req.include_usage:
                    yield _sse({**self._envelope([], chunk=True), "usage": self._total_usage()})
            yield _DONE
        finally:
            await self._end_all(tasks)

    def _chunk(self, choices: list[dict[str, Any]], usage: Usage | None) -> bytes:
        body = self._envelope(choices, chunk=True)
        if self.req.continuous_usage:
            body["usage"] = protocol.usage_json(self._usage(usage))
        elif self.req.include_usage:
            body["usage"] = None
        return _sse(body)

    async def _chunks(self, c: _Choice) -> AsyncGenerator[bytes, None]:
        offset = 0
        first = True
        async for delta in self._deltas(c):
            last = delta.finish_reason is not None
            if last and delta.error is not None:  # aborted by the server (shutting down)
                raise EndedByServer(delta.error)
            text, lps = delta.text, delta.logprobs
            if self.score_only:
                text, lps = "", None
            logprobs = self._logprobs(lps, offset)
            if first and self.echo:
                echo, echo_lps = self._echo(c)
                logprobs = _join_logprobs(echo_lps, logprobs, self.req.logprobs is not None)
                text = echo + text
            chat = self._chat_delta(c, text, last) if self.chat else None
            # NOTE: text the tool parser holds (a call not yet whole) makes no chunk
            shown = bool(chat) if chat is not None else bool(text)
            if shown or last or lps or (first and self.echo):
                d: dict[str, Any] = {"index": c.index}
                if chat is not None:
                    d["delta"] = chat
                else:
                    d["text"] = text
                d["logprobs"] = logprobs
                d["finish_reason"] = None
                if last:
                    self._finish(c, d, delta)
                offset += len(text)
                yield self._chunk([d], delta.usage)
            first = False


async def _first(c: _Choice) -> Delta:
    assert c.gen is not None
    return await c.gen.__anext__()


def _join_logprobs(head: dict[str, Any] | None, tail: dict[str, Any] | None,
                   asked: bool) -> dict[str, Any] | None:
    """An echoed prompt's logprobs object followed by the completion's (offsets shifted)."""
    if not asked:
        return None
    empty: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                             "text_offset": []}
    head, tail = head or empty, tail or empty
    shift = sum(len(t) for t in head["tokens"])
    return {"tokens": head["tokens"] + tail["tokens"],
            "token_logprobs": head["token_logprobs"] + tail["token_logprobs"],
            "top_logprobs": head["top_logprobs"] + tail["top_logprobs"],
            "text_offset": head["text_offset"] + [o + shift for o in tail["text_offset"]]}


def _max_tokens_given(req: Any, chat: bool) -> bool:
    """Whether the client set the output length: then a prompt that leaves less room is a 400
    (as OpenAI and vLLM answer). Not set: up to the rest of the context (chat), or OpenAI's
    default of 16 (completions), cut where the context ends."""
    if chat:
        return req.max_tokens is not None or req.max_completion_tokens is not None
    return req.max_tokens is not None and "max_tokens" in req.model_fields_set


def create_app(engine: AsyncEngine, settings: ServerSettings | None = None) -> Starlette:
    """The app; `app.state.arle` is its ServerState (the server flips `ready` once warm)."""
    settings = settings or ServerSettings()
    state = ServerState(engine, settings, ServerMetrics(engine.snapshot),
                        settings.served_model_name or engine.model_name)
    h = _Handlers(state)

    def route(path: str, fn: Callable[[Request], Awaitable[Response]], method: str) -> Route:
        async def endpoint(request: Request) -> Response:
            try:
                return await fn(request)
            except ClientGone:
                return Response(status_code=499)  # nobody reads it; ends the ASGI call cleanly
            except Exception as e:
                return _fail(request, e)
            finally:
                if _large_body(request):
                    trim.soon()
        return Route(path, endpoint, methods=[method])

    trim = HeapTrim()

    def _fail(request: Request, exc: BaseException) -> Response:
        resp = error_response(exc, settings.retry_after_s)
        # NOTE: an unknown path is the client's text: one label for all of them, or every
        # scanner's guess would add a metric series for good.
        path = request.url.path
        state.metrics.observe_http_error(path if path in known else "unmatched", resp.status_code)
        # NOTE: a request refused before the engine saw it still leaves one trace line.
        fields = _trace_fields(path if path in known else "unmatched", resp.status_code, exc)
        # NOTE: a client's mistake (4xx) and an overload (503) are the server working as
        # meant: below error level.
        if isinstance(exc, EndedByServer):
            pass  # its one line is the engine's trace
        elif isinstance(exc, OverloadedError):
            log.warning("request_trace", **fields)
        elif resp.status_code >= 500:
            log.error("request_trace", **fields, exc_info=not isinstance(exc, ArleError))
        else:
            log.info("request_trace", **fields)
        return resp

    def refused(path: str, refusal: Refusal) -> None:
        route = path if path in known else "unmatched"
        state.metrics.observe_http_error(route, refusal.status)
        log.info("request_trace", route=route, status=refusal.status, error=refusal.error_type,
                 code=refusal.code, param=None)
        log.debug("request_refused", route=route, message=refusal.message)

    async def http_exception(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            err = HTTPError(404, f"no route {request.method} {request.url.path}",
                            "not_found_error", code="not_found")
        elif exc.status_code == 405:
            allow = (exc.headers or {}).get("Allow", "")
            err = HTTPError(405, f"method {request.method} is not allowed on "
                                 f"{request.url.path} (allowed: {allow})",
                            "invalid_request_error", code="method_not_allowed",
                            headers={"Allow": allow})
        else:
            err = HTTPError(exc.status_code, str(exc.detail), "invalid_request_error",
                            headers=dict(exc.headers or {}))
        return _fail(request, err)

    routes = [
        route("/health", h.health, "GET"),
        route("/ready", h.ready, "GET"),
        route("/metrics", h.metrics, "GET"),
        route("/openapi.json", h.openapi, "GET"),
        route("/v1/models", h.models, "GET"),
        route("/v1/models/{model:path}", h.model, "GET"),
        route("/tokenize", h.tokenize, "POST"),
        route("/detokenize", h.detokenize, "POST"),
        route("/tokenizer_info", h.tokenizer_info, "GET"),
        route("/v1/stats", h.stats, "GET"),
        route("/v1/completions", h.completions, "POST"),
        route("/v1/chat/completions", h.chat_completions, "POST"),
        route("/v1/responses", h.responses, "POST"),
    ]
    known = {r.path for r in routes}
    guards = Middleware(Guards, allowed_hosts=settings.allowed_hosts,
                        allowed_origins=settings.allowed_origins, on_refused=refused)
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_exception},
                    middleware=[guards])
    app.state.arle = state
    app.state.on_refused = refused  # for the refusals of the HTTP parser (guards.py)
    return app


def openapi_schema() -> dict[str, Any]:
    """OpenAPI 3.1 for the routes, with the request bodies' JSON schema from protocol.py."""
    return copy.deepcopy(_openapi_schema())


@functools.cache
def _openapi_schema() -> dict[str, Any]:
    _, defs = models_json_schema(
        [(CompletionRequest, "validation"), (ChatCompletionRequest, "validation"),
         (tokenizer_api.TokenizeRequest, "validation"),
         (tokenizer_api.DetokenizeRequest, "validation")],
        ref_template="#/components/schemas/{model}")
    error = {"description": "An error (OpenAI's body)", "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    schemas = {**defs.get("$defs", {}), "ErrorResponse": {
        "type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": {"type": ["string", "null"]},
                           "code": {"type": ["string", "null"]}}}}}}

    def get(summary: str) -> dict[str, Any]:
        return {"get": {"summary": summary, "responses": {
            "200": {"description": "OK", "content": {"application/json": {"schema": {}}}},
            "default": error}}}

    def post(summary: str, model: str) -> dict[str, Any]:
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{model}"}}}},
            "responses": {"200": {"description": "A completion, or an SSE stream with "
                                                 "stream: true"},
                          "400": error, "401": error, "404": error, "413": error,
                          "503": error, "default": error}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "arle", "version": "1", "description": "OpenAI-compatible API"},
        "paths": {
            "/v1/completions": post("Text completion", "CompletionRequest"),
            "/v1/chat/completions": post("Chat completion", "ChatCompletionRequest"),
            "/v1/models": get("The served model"),
            "/v1/models/{model}": {"get": {**get("The served model by its id (404 for "
                                                 "another)")["get"], "parameters": [{
                "name": "model", "in": "path", "required": True,
                "schema": {"type": "string"}}]}},
            "/tokenize": post("Text or chat messages to token ids (vLLM's shape)",
                              "TokenizeRequest"),
            "/detokenize": post("Token ids to text (vLLM's shape)", "DetokenizeRequest"),
            "/tokenizer_info": get("The tokenizer's special tokens and chat template"),
            "/v1/stats": get("Server and engine statistics (JSON)"),
            "/health": get("Liveness"),
            "/ready": get("Readiness: the model is loaded and warm"),
        },
        "components": {"schemas": schemas},
    }
