"""Logging: structlog for our events, stdlib `logging` routed through the same renderer.

Two formats, chosen by `configure_logging` (or `ARLE_LOG_FORMAT`):
- console: one readable line per event, colored only when stderr is a terminal;
- json: one JSON object per line (orjson), with `timestamp` (ISO 8601, UTC), `level`, `event`.

NOTE: logs only ever go to stderr; stdout carries the answer (`arle complete` streams text there).
The stream is looked up at write time, not at configure time, so a swapped `sys.stderr`
(pytest's capsys, click's CliRunner) gets the lines.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any, Literal, cast

import orjson
import structlog
from structlog.typing import FilteringBoundLogger, Processor

from arle import env

LogFormat = Literal["console", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("console", "json")

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}

_write_lock = threading.Lock()
_configured = False


def _write_line(line: str) -> None:
    # NOTE: one write per line under a lock, so lines of the engine thread and the event loop
    # never interleave mid-line.
    stream = sys.stderr
    with _write_lock:
        stream.write(line + "\n")
        stream.flush()


class _StderrLogger:
    """The structlog "logger" at the end of the chain: writes the rendered line to stderr."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name

    def msg(self, message: str) -> None:
        _write_line(message)

    log = debug = info = warning = warn = error = critical = exception = fatal = msg


def _logger_factory(name: str | None = None, *_args: Any) -> _StderrLogger:
    return _StderrLogger(name)


def _add_logger_name(logger: Any, _method: str, event_dict: Any) -> Any:
    name = getattr(logger, "name", None)
    if name:
        event_dict.setdefault("logger", name)
    return event_dict


class _StderrHandler(logging.Handler):
    """Root handler that renders stdlib records with structlog's renderer (see configure)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            _write_line(self.format(record))
        except Exception:
            self.handleError(record)


def _orjson_dumps(obj: Any, **kwargs: Any) -> str:
    # orjson returns bytes; our sink is the text stderr, shared with the console renderer.
    return orjson.dumps(obj, **kwargs).decode()


def _level_number(level: str | int) -> int:
    if isinstance(level, int):
        return level
    try:
        return _LEVELS[level.lower()]
    except KeyError:
        raise ValueError(f"unknown log level {level!r}; use one of {', '.join(_LEVELS)}") from None


def resolve_log_format(fmt: str | None) -> LogFormat:
    """`fmt`, else `ARLE_LOG_FORMAT`, else "console"."""
    value = fmt or env.log_format() or "console"
    if value not in LOG_FORMATS:
        raise ValueError(f"unknown log format {value!r}; use one of {', '.join(LOG_FORMATS)}")
    return cast(LogFormat, value)


def _traceback_formatter(level_no: int, colors: bool) -> Any:
    """Tracebacks without the frames' local variables, which hold what clients sent (a request
    body, a prompt); with them only at debug level. In color only where the log is."""
    if structlog.dev.rich is None:
        return structlog.dev.plain_traceback
    return structlog.dev.RichTracebackFormatter(
        show_locals=level_no <= logging.DEBUG, color_system="truecolor" if colors else None)


def configure_logging(fmt: LogFormat | None = None, level: str | int = "info") -> None:
    """Set up structlog and route stdlib logging through it. Safe to call again: it replaces
    the previous set-up instead of adding to it."""
    global _configured
    fmt = resolve_log_format(fmt)
    level_no = _level_number(level)

    if fmt == "json":
        timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
        renderer: Processor = structlog.processors.JSONRenderer(serializer=_orjson_dumps)
        # A traceback becomes one string field, so the event stays one line.
        exc_processors: list[Processor] = [structlog.processors.format_exc_info]
    else:
        timestamper = structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False)
        colors = sys.stderr.isatty()
        renderer = structlog.dev.ConsoleRenderer(
            colors=colors, exception_formatter=_traceback_formatter(level_no, colors))
        exc_processors = []  # the console renderer prints tracebacks itself

    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        timestamper,
    ]
    structlog.configure(
        processors=[*shared, _add_logger_name, structlog.processors.StackInfoRenderer(),
                    *exc_processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=_logger_factory,
        # NOTE: no caching, so a later configure_logging() also applies to loggers made before.
        cache_logger_on_first_use=False,
    )

    # Libraries (transformers, asyncio, ...) log through stdlib logging: show only warnings and
    # worse, rendered like our own events.
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name, *exc_processors],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _StderrHandler)]:
        root.removeHandler(handler)
    handler = _StderrHandler()
    handler.setFormatter(formatter)
    root.addHandler(handler)
    root.setLevel(max(logging.WARNING, level_no))
    _configured = True
    _settings[:] = [fmt, level_no]


#: what the last configure_logging() set: [format, level] (tensor-parallel ranks repeat it)
_settings: list[Any] = ["console", logging.INFO]


def logging_settings() -> tuple[LogFormat, int]:
    """The format and level the last `configure_logging` set."""
    return _settings[0], _settings[1]


def get_logger(name: str) -> FilteringBoundLogger:
    """A structlog logger whose events carry `logger=name`. Configures defaults on first use,
    so library users never get structlog's default (stdout) output."""
    if not _configured:
        configure_logging()
    # NOTE: structlog returns a lazy proxy that rebuilds its logger from the current config on
    # every call (no caching), so module-level loggers follow a later configure_logging().
    return cast(FilteringBoundLogger, structlog.get_logger(name))
