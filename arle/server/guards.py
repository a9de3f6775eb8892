"""What every HTTP request passes before a route sees it: the checks that keep a server on a
developer's machine safe from web pages, and the limits on request heads.

`Guards` is an ASGI middleware, in this order:
1. head limits: at most MAX_HEADERS headers and MAX_HEADER_BYTES bytes of path and headers (431);
2. Host: when the server is bound to a loopback address, the Host header must name it
   (localhost, 127.0.0.1 or [::1], any port), or one of `--allowed-hosts` (421). A page served
   from a DNS name that the attacker points at 127.0.0.1 (DNS rebinding) sends its own name;
3. Origin: a browser request from a page whose origin is not in `--allowed-origins` is refused
   (403): without it, any page could POST to the local server (a `text/plain` form needs no CORS
   preflight). Allowed origins get CORS headers and their preflights (OPTIONS) an answer;
4. Content-Type: a POST must say `application/json` (415), the other half of refusing forms.

`limited_http_protocol` bounds the head where it is read (uvicorn's httptools parser keeps no
limit of its own): the memory a client can make the server hold for headers is bounded too.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from arle.server import MAX_HEADER_BYTES, MAX_HEADERS
from arle.server.connections import ConnectionLimits, Deadline, Registry, descriptor_cap
from arle.server.protocol import error_json

#: The Host names a loopback-bound server answers to by default.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
_CORS_METHODS = b"GET, POST, OPTIONS"
_PREFLIGHT_MAX_AGE = b"600"


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str
    error_type: str
    code: str


#: Called with (path, refusal) for each request refused here: the app logs and counts it.
OnRefused = Callable[[str, Refusal], None]


def is_loopback(host: str) -> bool:
    """Whether a bind address only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name in a Host header, without its port: 'localhost:8000' -> 'localhost',
    '[::1]:8000' -> '::1'."""
    value = header.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    return value.rpartition(":")[0] if value.count(":") == 1 else value


def normalize_origin(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


class Guards:
    """The ASGI middleware (see the module's docstring).

    `allowed_hosts`: None accepts any Host; "*" in it too. `allowed_origins`: "*" accepts any.
    """

    def __init__(self, app: ASGIApp, *, allowed_hosts: Iterable[str] | None,
                 allowed_origins: Iterable[str], on_refused: OnRefused | None = None,
                 max_headers: int = MAX_HEADERS, max_header_bytes: int = MAX_HEADER_BYTES
                 ) -> None:
        self.app = app
        hosts = None if allowed_hosts is None else {host_name(h) for h in allowed_hosts}
        self.hosts = None if hosts is None or "*" in hosts else frozenset(hosts)
        origins = {normalize_origin(o) for o in allowed_origins}
        self.any_origin = "*" in origins
        self.origins = frozenset(origins)
        self.on_refused = on_refused
        self.max_headers = max_headers
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        refusal = self._head_refusal(scope, headers)
        if refusal is not None:
            await self._refuse(scope, send, refusal)
            return
        found = {k: v for k, v in headers if k in (b"host", b"origin", b"content-type",
                                                   b"access-control-request-method")}
        refusal = self._host_refusal(found.get(b"host"))
        origin = found.get(b"origin")
        allowed_origin: bytes | None = None
        if refusal is None and origin is not None:
            name = origin.decode("latin-1")
            if not (self.any_origin or normalize_origin(name) in self.origins):
                refusal = Refusal(403, f"requests from the web origin {name!r} are not allowed "
                                       "(arle serve --allowed-origins)",
                                  "permission_error", "origin_not_allowed")
            else:
                allowed_origin = b"*" if self.any_origin else origin
        if refusal is None and allowed_origin is not None and scope["method"] == "OPTIONS" \
                and b"access-control-request-method" in found:
            await self._preflight(scope, send, allowed_origin)
            return
        if refusal is None and scope["method"] == "POST":
            refusal = _content_type_refusal(found.get(b"content-type"))
        if refusal is not None:
            await self._refuse(scope, send, refusal, allowed_origin)
            return
        if allowed_origin is None:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()),
                                      *_cors_headers(allowed_origin)]
            await send(message)

        await self.app(scope, receive, send_with_cors)

    # -- checks --
    def _head_refusal(self, scope: Scope, headers: list[tuple[bytes, bytes]]) -> Refusal | None:
        if len(headers) > self.max_headers:
            return Refusal(431, f"the request has {len(headers)} headers; at most "
                                f"{self.max_headers} are allowed",
                           "invalid_request_error", "request_headers_too_large")
        size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") \
            + sum(len(k) + len(v) + 4 for k, v in headers)
        if size > self.max_header_bytes:
            return Refusal(431, f"the request's path and headers are {size} bytes; at most "
                                f"{self.max_header_bytes} are allowed",
                           "invalid_request_error", "request_headers_too_large")
        return None

    def _host_refusal(self, host: bytes | None) -> Refusal | None:
        if self.hosts is None or host is None:  # NOTE: browsers always send Host
            return None
        text = host.decode("latin-1")
        if host_name(text) in self.hosts:
            return None
        return Refusal(421, f"the Host header {text!r} does not name this server "
                            "(arle serve --allowed-hosts)", "invalid_request_error",
                       "host_not_allowed")

    # -- answers --
    async def _preflight(self, scope: Scope, send: Send, origin: bytes) -> None:
        asked = next((v for k, v in scope["headers"]
                      if k == b"access-control-request-headers"), b"authorization, content-type")
        headers = [*_cors_headers(origin), (b"access-control-allow-methods", _CORS_METHODS),
                   (b"access-control-allow-headers", asked),
                   (b"access-control-max-age", _PREFLIGHT_MAX_AGE), (b"content-length", b"0")]
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b""})

    async def _refuse(self, scope: Scope, send: Send, refusal: Refusal,
                      origin: bytes | None = None) -> None:
        if self.on_refused is not None:
            self.on_refused(scope.get("path", ""), refusal)
        body = refusal_body(refusal)
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        if origin is not None:
            headers += _cors_headers(origin)
        if refusal.status == 431:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def refusal_body(refusal: Refusal) -> bytes:
    return orjson.dumps(error_json(refusal.message, refusal.error_type, None, refusal.code))


def _cors_headers(origin: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"access-control-allow-origin", origin), (b"vary", b"Origin"),
            (b"access-control-expose-headers", b"Retry-After")]


def _content_type_refusal(value: bytes | None) -> Refusal | None:
    media = (value or b"").split(b";", 1)[0].strip().lower()
    if media == b"application/json":
        return None
    shown = value.decode("latin-1") if value is not None else "none"
    return Refusal(415, f"the request body must be JSON sent with 'Content-Type: "
                        f"application/json' (got {shown!r})", "invalid_request_error",
                   "unsupported_media_type")


def _raw_response(status: str, refusal: Refusal) -> bytes:
    body = refusal_body(refusal)
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: "
            f"{len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def limited_http_protocol(on_refused: OnRefused | None = None,
                          max_headers: int = MAX_HEADERS,
                          max_header_bytes: int = MAX_HEADER_BYTES,
                          limits: ConnectionLimits | None = None) -> Any:
    """uvicorn's httptools protocol with the head limits applied while it is parsed: past them
    the client gets 431 and the connection closes; nothing more of that request is kept. With
    `limits`, the deadlines and the connection cap of arle/server/connections.py too.
    "h11" when httptools is missing (then `uvicorn.Config(h11_max_incomplete_event_size=...)`
    bounds the head, answering 400; no deadlines, no cap)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "h11"
    registry = Registry(descriptor_cap(limits.max_connections)) if limits is not None else None

    def refuse(refusal: Refusal) -> None:
        if on_refused is not None:
            on_refused("unmatched", refusal)

    class LimitedHttpTools(HttpToolsProtocol):
        """NOTE: httptools gathers a header's pieces before `on_header` sees it, so the bytes
        are counted as they arrive (`data_received`) while a head is being read."""

        _in_head = False
        _head_bytes = 0
        _head_count = 0
        _refused = False
        #: a request's head is read and its response not yet finished
        _busy = False

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._deadline = Deadline(self.loop)
            if registry is not None and not registry.admit(self):
                self._refused = True
                refusal = Refusal(503, f"the server holds its most connections "
                                  f"({registry.cap}), each with a request in flight; retry",
                                  "server_error", "too_many_connections")
                refuse(refusal)
                transport.write(_raw_response("503 Service Unavailable", refusal))
                transport.close()
                return
            self._arm_head()

        def connection_lost(self, exc: Exception | None) -> None:
            if registry is not None:
                registry.remove(self)
            self._deadline.cancel()
            super().connection_lost(exc)

        def busy(self) -> bool:
            return self._busy

        def close_idle(self) -> None:
            self._deadline.cancel()
            self.transport.close()

        def _arm_head(self) -> None:
            if limits is not None:
                self._deadline.arm(limits.head_timeout_s, self._head_expired)

        def _head_expired(self) -> None:
            """No whole head in time: a partial one gets 408, a silent connection just ends."""
            if self._in_head and not self._refused:
                self._refused = True
                assert limits is not None
                refusal = Refusal(408, f"the request head did not arrive within "
                                  f"{limits.head_timeout_s:g} s (--head-timeout)",
                                  "invalid_request_error", "request_timeout")
                refuse(refusal)
                self.transport.write(_raw_response("408 Request Timeout", refusal))
            self.transport.close()

        def _body_expired(self) -> None:
            """The body did not arrive in time: the connection ends; the route sees the client
            leave."""
            self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._head_bytes, self._head_count = True, 0, 0

        def _over(self, nbytes: int, headers: int) -> bool:
            if self._refused:
                return True
            self._head_bytes += nbytes
            self._head_count += headers
            if self._head_count > max_headers:
                message = f"the request has over {max_headers} headers"
            elif self._head_bytes > max_header_bytes:
                message = f"the request's path and headers are over {max_header_bytes} bytes"
            else:
                return False
            self._refused = True
            refusal = Refusal(431, message + "; that is the limit", "invalid_request_error",
                              "request_headers_too_large")
            refuse(refusal)
            self.transport.write(_raw_response("431 Request Header Fields Too Large", refusal))
            self.transport.close()
            return True

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            super().data_received(data)
            if self._in_head:  # still in a head after this chunk: all of it was head bytes
                self._over(len(data), 0)

        def on_header(self, name: bytes, value: bytes) -> None:
            if not self._over(0, 1):
                super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head = False
            if self._refused:
                return
            self._busy = True
            if limits is not None:
                self._deadline.arm(limits.body_timeout_s, self._body_expired)
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if not self._refused:
                self._deadline.cancel()
                super().on_message_complete()

        def on_response_complete(self) -> None:
            pipelined = bool(self.pipeline)
            super().on_response_complete()
            self._busy = pipelined
            if not pipelined and not self.transport.is_closing():
                self._arm_head()

    return LimitedHttpTools
