"""`arle serve`: the OpenAI-compatible HTTP server (uvicorn, on the engine's event loop).

Start-up order: load the model, warm it (one short generation), bind, then log "listening on":
a client that sees the port open finds the server ready. SIGINT/SIGTERM stop accepting, let
running requests finish for `--grace-period` seconds (then end them: a stream gets an error
event and [DONE], a plain request a 503) and exit 0; a second SIGINT exits at once. What a
client may send and from where: docs/server.md (the checks live in arle/server/guards.py).

NOTE: uvicorn, the engine and torch are imported inside the command: `arle --help` stays fast.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import socket
import sys
from dataclasses import replace
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any

import typer

from arle import env
from arle.cli.common import arle_command
from arle.config import EngineConfig
from arle.errors import ArleError
from arle.logging import get_logger
from arle.server import DEFAULT_MAX_BODY_BYTES
from arle.server.connections import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEAD_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    ConnectionLimits,
)

if TYPE_CHECKING:
    from arle.engine.async_engine import AsyncEngine

SERVER_PANEL = "Server"
#: Seconds after the grace period at which uvicorn cancels what is left.
_SHUTDOWN_BACKSTOP_S = 5
log = get_logger("arle.server")


def _server_opt(*decls: str, help: str, **kw: Any) -> Any:
    return typer.Option(*decls, help=help, rich_help_panel=SERVER_PANEL, **kw)


@arle_command(engine=True, info_logs=True)
def serve(
    host: Annotated[str, _server_opt(
        "--host", help="Address to bind; 0.0.0.0 exposes the server to the network.")
    ] = "127.0.0.1",
    port: Annotated[int, _server_opt("--port", min=0, max=65535, help="TCP port.")] = 8000,
    api_key: Annotated[str | None, _server_opt(
        "--api-key", envvar=env.ARLE_API_KEY, show_envvar=True,
        help="Require 'Authorization: Bearer KEY' on /v1/* (default: no key).")] = None,
    served_model_name: Annotated[str | None, _server_opt(
        "--served-model-name",
        help="The model name clients send and see (default: the model file's name).")] = None,
    max_waiting: Annotated[int, _server_opt(
        "--max-waiting", min=1,
        help="Requests that may wait for admission; more get 503 with Retry-After.")
    ] = EngineConfig().max_waiting_requests,
    max_body_bytes: Annotated[int, _server_opt(
        "--max-body-bytes", min=1024, help="Largest request body; larger get 413.")
    ] = DEFAULT_MAX_BODY_BYTES,
    max_connections: Annotated[int, _server_opt(
        "--max-connections", min=1,
        help="Open connections held at most (lowered below the descriptor limit); past it the "
             "oldest idle one is closed, or, when all are busy, the new one gets 503.")
    ] = DEFAULT_MAX_CONNECTIONS,
    head_timeout: Annotated[float, _server_opt(
        "--head-timeout", min=0.1,
        help="Seconds a connection may take to send a request head (from opening, or from "
             "its last response); then it is closed (408 for a partial head).")
    ] = DEFAULT_HEAD_TIMEOUT_S,
    body_timeout: Annotated[float, _server_opt(
        "--body-timeout", min=0.1,
        help="Seconds a request body may take to arrive after its head; then the connection "
             "is closed.")] = DEFAULT_BODY_TIMEOUT_S,
    grace_period: Annotated[float, _server_opt(
        "--grace-period", min=0.0,
        help="Seconds running requests may take to finish after SIGINT/SIGTERM.")] = 30.0,
    allowed_origins: Annotated[list[str] | None, _server_opt(
        "--allowed-origins",
        help="A web origin (https://app.example:8080) whose pages may call the API, with CORS; "
             "repeat for several; '*' for any. Default: none, browser requests are refused.")
    ] = None,
    allowed_hosts: Annotated[list[str] | None, _server_opt(
        "--allowed-hosts",
        help="A Host header name the server answers to; repeat for several; '*' for any. "
             "Default: localhost, 127.0.0.1 and ::1 when bound to a loopback address, else any.")
    ] = None,
    *,
    config: EngineConfig,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (/v1/completions,
    /v1/chat/completions, /v1/models, /health, /ready, /metrics, /v1/stats)."""
    config = replace(config, max_waiting_requests=max_waiting, serving=True)
    from arle.server.app import ServerSettings
    from arle.server.guards import LOOPBACK_HOSTS, is_loopback

    hosts = (tuple(allowed_hosts) if allowed_hosts
             else LOOPBACK_HOSTS if is_loopback(host) else None)
    settings = ServerSettings(served_model_name=served_model_name, api_key=api_key or None,
                              max_body_bytes=max_body_bytes, allowed_hosts=hosts,
                              allowed_origins=tuple(allowed_origins or ()))
    limits = ConnectionLimits(max_connections, head_timeout, body_timeout)
    run_on_uvloop(_serve(config, settings, limits, host, port, grace_period))


def run_on_uvloop(main: Any) -> Any:
    """asyncio.run, on uvloop where it is installed (the benchmarks that stand in for
    `arle serve` run this way too)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    if hasattr(uvloop, "run"):  # uvloop >= 0.18
        return uvloop.run(main)
    return asyncio.run(main)


async def _warm_up(engine: AsyncEngine) -> None:
    """The warm-up passes `arle warmup` reports: their one-time costs are paid before readiness."""
    from arle.diagnostics import Phase, warmup_passes

    phases: list[Phase] = []
    if not await warmup_passes(engine, phases):
        failed = next(p for p in phases if not p.ok)
        raise ArleError(f"warm-up failed in phase {failed.name}: {failed.error}")
    if engine.config.device == "cuda":
        from arle_kernels.jit import watch_compiles

        watch_compiles(lambda kernel: log.warning("triton_kernel_built_after_warmup",
                                                  kernel=kernel[:2000]))


async def _serve(config: EngineConfig, settings: Any, limits: ConnectionLimits, host: str,
                 port: int, grace_period: float) -> None:
    import uvicorn

    from arle.engine.build import create_engine
    from arle.gcwatch import PAUSES, freeze_start_up, thaw
    from arle.server import MAX_HEADER_BYTES
    from arle.server.app import create_app
    from arle.server.guards import limited_http_protocol

    engine = await create_engine(config)
    try:
        await _warm_up(engine)
        app = create_app(engine, settings)
        # NOTE: start-up leaves many long-lived objects behind (the compiled kernels and their
        # caches, the graphs' bookkeeping); frozen, they are no longer walked by the cyclic
        # GC's full passes while serving. One process serves one engine: nothing frozen
        # would be freed later anyway. The pauses left are timed from here on.
        freeze_start_up()
        PAUSES.start()
        state = app.state.arle
        loop = asyncio.get_running_loop()

        def grace_over() -> None:
            n = engine.abort_all(f"the server is shutting down: the grace period of "
                                 f"{grace_period:g}s is over")
            if n:
                log.warning("grace_period_over", aborted=n)

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: FrameType | None) -> None:
                first = not self.should_exit
                super().handle_exit(sig, frame)
                # NOTE: uvicorn re-raises a caught signal after shutting down (exit status
                # 130/143); a graceful stop is a success here: exit 0.
                self._captured_signals.clear()
                state.shutting_down = True
                if first:
                    log.info("shutting_down", signal=signal.Signals(sig).name,
                             grace_period_s=grace_period)
                    # NOTE: arle ends what is still running when the grace period is over, so
                    # each stream gets an error event and [DONE]; uvicorn's own deadline (which
                    # cancels the handlers mid-write) is only a backstop, a little later.
                    loop.call_soon_threadsafe(loop.call_later, grace_period, grace_over)

        sock = _bind(host, port)
        uv_config = uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="off", server_header=False,
            timeout_graceful_shutdown=math.ceil(grace_period) + _SHUTDOWN_BACKSTOP_S,
            http=limited_http_protocol(app.state.on_refused, limits=limits),
            h11_max_incomplete_event_size=MAX_HEADER_BYTES)
        server = Server(uv_config)
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started:
            state.ready = True
            url = f"http://{_url_host(host)}:{sock.getsockname()[1]}"
            log.info("listening", url=url, model=state.model_name, pid=os.getpid())
            _announce(f"listening on {url} (model {state.model_name})")
        await task
    finally:
        await engine.close()
        # NOTE: what start-up froze is never collected; at exit, objects of native extensions
        # still alive make their modules print leak reports (Triton's nanobind: ~30 lines).
        thaw()
    log.info("stopped")


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a busy port is one clear error (uvicorn would
    exit the process from inside its task)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise ArleError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _announce(line: str) -> None:
    """The readiness line for a person: on stderr, unless logs are JSON (then the `listening`
    event is the line)."""
    import structlog

    processors = structlog.get_config().get("processors", [])
    if not any(isinstance(p, structlog.processors.JSONRenderer) for p in processors):
        sys.stderr.write(f"arle: {line}\n")
        sys.stderr.flush()
