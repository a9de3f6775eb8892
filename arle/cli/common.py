"""What every command shares: the logging/debug options, the engine options, error reporting.

`@arle_command(engine=True)` appends the shared options to a command's signature (typer reads
options from signatures), so `complete`, `serve` and `chat` spell them the same and report
errors the same way. The engine options are arle.config.ENGINE_OPTIONS, typed and defaulted by
EngineConfig's fields; the command receives a ready `config: EngineConfig` instead of them.

NOTE: nothing heavy is imported here (no torch): `arle --help` must stay fast.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, Literal, get_args, get_origin, get_type_hints

import typer

from arle import env
from arle.config import ENGINE_OPTIONS, EngineConfig, EngineOption
from arle.errors import ArleError, InvalidRequestError
from arle.logging import configure_logging, resolve_log_format
from arle.model.default import resolve_model_path


class LogFormatChoice(str, Enum):
    console = "console"
    json = "json"


@dataclass(frozen=True)
class GlobalOptions:
    """`--log-format` / `--debug` given before the command (`arle --debug complete ...`)."""

    log_format: LogFormatChoice | None = None
    debug: bool = False


LOGGING_PANEL = "Logging"
ENGINE_PANEL = "Engine"

LogFormatOption = Annotated[
    LogFormatChoice | None,
    typer.Option("--log-format", envvar=env.ARLE_LOG_FORMAT, rich_help_panel=LOGGING_PANEL,
                 help="Log lines on stderr: readable (console) or one JSON object per line."),
]
DebugOption = Annotated[
    bool,
    typer.Option("--debug", rich_help_panel=LOGGING_PANEL,
                 help="Show debug logs and the traceback of an error."),
]

_KW = inspect.Parameter.KEYWORD_ONLY


def _option(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(name, _KW, annotation=annotation, default=default)


_GLOBAL_PARAMS = [
    _option("log_format", LogFormatOption, None),
    _option("debug", DebugOption, False),
]


def _engine_param(opt: EngineOption) -> inspect.Parameter:
    """The typer option of one ENGINE_OPTIONS entry: type and default from EngineConfig's
    field (a Literal becomes a choice; an inverted flag's default is the field's negation)."""
    annotation, default = _HINTS[opt.field], _DEFAULTS[opt.field]
    if get_origin(annotation) is Literal:
        annotation = _choices(opt.field, annotation)
        default = annotation(default)
    elif opt.inverted:
        default = not default
    option = typer.Option(opt.flag, *opt.aliases, help=opt.help, metavar=opt.metavar,
                          min=opt.min, max=opt.max, rich_help_panel=ENGINE_PANEL)
    return _option(opt.param, Annotated[annotation, option], default)


def _choices(name: str, literal: Any) -> Any:
    """A str Enum of a Literal's values: typer shows and checks them as choices."""
    return Enum(name, [(value, value) for value in get_args(literal)], type=str)


def _field_value(opt: EngineOption, value: Any) -> Any:
    """The EngineConfig value of one engine flag's parsed value."""
    if isinstance(value, Enum):
        return value.value
    return not value if opt.inverted else value


_HINTS = get_type_hints(EngineConfig)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


SAMPLING_PANEL = "Sampling"


def panel_option(panel: str, *decls: str, help: str, **kw: Any) -> Any:
    """A typer option shown under `panel` in --help."""
    return typer.Option(*decls, help=help, rich_help_panel=panel, **kw)


def sampling_option(*decls: str, help: str, **kw: Any) -> Any:
    """A sampling option: the same panel in every command."""
    return panel_option(SAMPLING_PANEL, *decls, help=help, **kw)


def build_engine_config(flags: Mapping[str, Any], *, resolve_model: bool = True
                        ) -> EngineConfig:
    """The EngineConfig the engine flags describe (`flags`: each ENGINE_OPTIONS parameter's
    value). Resolves the model path first (unless told not to), so a missing model fails at
    once instead of after torch has loaded."""
    values = {opt.field: _field_value(opt, flags[opt.param]) for opt in ENGINE_OPTIONS}
    if resolve_model:
        values["model"] = str(resolve_model_path(values["model"]))
    try:
        return EngineConfig(**values)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from None


def _error(message: str) -> None:
    # NOTE: exactly one line, whatever the message holds: scripts read the last stderr line.
    sys.stderr.write("error: " + " ".join(message.splitlines()) + "\n")
    sys.stderr.flush()


@contextmanager
def report_errors(debug: bool) -> Iterator[None]:
    """Turn an exception into one `error: ...` line on stderr and the exit status.

    ArleError: its message and `exit_code`; Ctrl-C: 130, quietly; anything else: exit 1 as an
    internal error. With `debug` the traceback is printed first.
    """
    try:
        yield
    except (typer.Exit, typer.Abort, typer.TyperException):
        raise  # typer's own exits and usage errors: typer reports them
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except BrokenPipeError:
        # The reader of stdout went away (`arle complete ... | head`): stop quietly. Point
        # stdout at devnull so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise typer.Exit(141) from None
    except ArleError as e:
        if debug:
            traceback.print_exc()
        _error(str(e))
        raise typer.Exit(e.exit_code) from None
    except Exception as e:
        if debug:
            traceback.print_exc()
        _error(f"internal error: {e!r}")
        raise typer.Exit(1) from None


def arle_command(*, engine: bool = False, resolve_model: bool = True, one_request: bool = False,
                 info_logs: bool = False) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Decorate a command: add `--log-format`/`--debug` (and the engine options when `engine`),
    configure logging, report errors. With `engine`, the command takes `config: EngineConfig`;
    `resolve_model=False` leaves the model path to be resolved when an engine is built (for a
    command that may not build one, like `chat --url`). `one_request`: the command runs one
    request at a time, so its engine takes one running request unless the flag says otherwise
    (on CUDA: one decode graph to capture and no extend graphs, so it starts sooner).
    `info_logs`: console logs keep info events too (a server's start-up and its one
    `request_trace` per request); other commands' console logs show warnings only."""

    def decorate(fn: Callable[..., None]) -> Callable[..., None]:
        own = [p for p in inspect.signature(fn, eval_str=True).parameters.values()
               if p.name != "config"]
        ctx_param = _option("_arle_ctx", typer.Context, inspect.Parameter.empty)
        engine_params = [_engine_param(opt) for opt in ENGINE_OPTIONS] if engine else []
        params = [*own, *engine_params, *_GLOBAL_PARAMS, ctx_param]

        @functools.wraps(fn)
        def command(**kwargs: Any) -> None:
            ctx: typer.Context = kwargs.pop("_arle_ctx")
            root = ctx.find_root().obj
            outer = root if isinstance(root, GlobalOptions) else GlobalOptions()
            log_format = kwargs.pop("log_format") or outer.log_format
            debug = kwargs.pop("debug") or outer.debug
            engine_flags = {p.name: kwargs.pop(p.name) for p in engine_params}
            with report_errors(debug):
                fmt = resolve_log_format(log_format.value if log_format else None)
                # NOTE: console logs are for a person reading the answer: warnings only (info
                # lines would interleave with the streamed text), but a server's, which
                # prints no answer. JSON logs are for machines and keep the info events
                # (`request_trace`).
                level = ("debug" if debug else "info" if fmt == "json" or info_logs
                         else "warning")
                configure_logging(fmt, level)
                if engine:
                    if one_request and engine_flags["max_running_requests"] is None:
                        engine_flags["max_running_requests"] = 1
                    kwargs["config"] = build_engine_config(engine_flags,
                                                           resolve_model=resolve_model)
                fn(**kwargs)

        # NOTE: typer builds the options from the signature and the annotations: present the
        # full parameter list with evaluated annotations, and drop `__wrapped__` so nothing
        # reads `fn`'s own signature instead.
        del command.__wrapped__
        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate
