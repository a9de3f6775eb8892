"""What every command shares: the logging/debug options, the engine options, error reporting.

`@arle_command(engine=True)` appends the shared options to a command's signature (typer reads
options from signatures), so `complete`, `serve` and `chat` spell them the same and report
errors the same way. The command receives a ready `config: EngineConfig` instead of the flags.

NOTE: nothing heavy is imported here (no torch): `arle --help` must stay fast.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, cast

import typer

from arle.config import DEVICE_DEFAULTS, SERVING_DEFAULTS, Device, DType, EngineConfig, KVCacheDType
from arle.errors import ArleError, InvalidRequestError
from arle.logging import configure_logging, resolve_log_format
from arle.model.default import resolve_model_path


class LogFormatChoice(str, Enum):
    console = "console"
    json = "json"


class DTypeChoice(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class DeviceChoice(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class KVCacheDTypeChoice(str, Enum):
    auto = "auto"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"
    fp8_e4m3 = "fp8_e4m3"


@dataclass(frozen=True)
class GlobalOptions:
    """`--log-format` / `--debug` given before the command (`arle --debug complete ...`)."""

    log_format: LogFormatChoice | None = None
    debug: bool = False


LOGGING_PANEL = "Logging"
ENGINE_PANEL = "Engine"

LogFormatOption = Annotated[
    LogFormatChoice | None,
    typer.Option("--log-format", envvar="ARLE_LOG_FORMAT", rich_help_panel=LOGGING_PANEL,
                 help="Log lines on stderr: readable (console) or one JSON object per line."),
]
DebugOption = Annotated[
    bool,
    typer.Option("--debug", rich_help_panel=LOGGING_PANEL,
                 help="Show debug logs and the traceback of an error."),
]

_KW = inspect.Parameter.KEYWORD_ONLY
_D = EngineConfig()  # NOTE: the flags' defaults are EngineConfig's, never restated here.


def _by_device(name: str) -> str:
    """The help text's default of a device-dependent field, from DEVICE_DEFAULTS."""
    cpu, cuda = DEVICE_DEFAULTS[name]
    return f"default: {cpu} on CPU, {cuda} on CUDA"


def _option(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(name, _KW, annotation=annotation, default=default)


def _engine_opt(*decls: str, help: str, **kw: Any) -> Any:
    return typer.Option(*decls, help=help, rich_help_panel=ENGINE_PANEL, **kw)


_GLOBAL_PARAMS = [
    _option("log_format", LogFormatOption, None),
    _option("debug", DebugOption, False),
]

_ENGINE_PARAMS = [
    _option("model", Annotated[str | None, _engine_opt(
        "--model", "-m", metavar="PATH",
        help="A Hugging Face model directory or a .gguf file "
             "(default: $ARLE_MODEL, else the SmolLM2-135M package).")], None),
    _option("dtype", Annotated[DTypeChoice, _engine_opt(
        "--dtype", help="Weight and activation dtype; auto: the model's (float32 on CPU).")],
        DTypeChoice(_D.dtype)),
    _option("device", Annotated[DeviceChoice, _engine_opt(
        "--device", help="auto: cuda if available, else cpu.")], DeviceChoice(_D.device)),
    _option("max_model_len", Annotated[int | None, _engine_opt(
        "--max-model-len", min=1,
        help="Longest prompt + output of a request (default: the model's context length).")],
        _D.max_model_len),
    _option("max_running_requests", Annotated[int | None, _engine_opt(
        "--max-running-requests", min=1,
        help=f"Most requests decoding at once ({_by_device('max_running_requests')}; 1 for "
             "`arle complete` and `arle chat`, which run one at a time).")],
        _D.max_running_requests),
    _option("max_batched_tokens", Annotated[int | None, _engine_opt(
        "--max-batched-tokens", min=1,
        help=f"Token budget of one engine step ({_by_device('max_batched_tokens')}; "
             f"{SERVING_DEFAULTS['max_batched_tokens'][1]} for `arle serve` on CUDA).")],
        _D.max_batched_tokens),
    _option("chunked_prefill_size", Annotated[int | None, _engine_opt(
        "--chunked-prefill-size", min=1,
        help="Longest prefill chunk of one request per step "
             f"({_by_device('chunked_prefill_size')}).")],
        _D.chunked_prefill_size),
    _option("kv_cache_tokens", Annotated[int | None, _engine_opt(
        "--kv-cache-tokens", min=1,
        help="KV cache size in tokens (default: sized from memory).")], _D.kv_cache_tokens),
    _option("no_prefix_cache", Annotated[bool, _engine_opt(
        "--no-prefix-cache", help="Do not reuse the KV cache of shared prompt prefixes.")],
        not _D.enable_prefix_cache),
    _option("disable_overlap", Annotated[bool, _engine_opt(
        "--disable-overlap", help="Schedule the next step only after the current one ran.")],
        not _D.overlap),
    _option("threads", Annotated[int | None, _engine_opt(
        "--threads", min=1, help="CPU threads for torch (default: torch's).")], _D.num_threads),
    _option("mem_fraction_static", Annotated[float, _engine_opt(
        "--mem-fraction-static", min=0.05, max=0.99,
        help="CUDA: share of GPU memory for weights, activations and the KV pool.")],
        _D.mem_fraction_static),
    _option("kv_cache_dtype", Annotated[KVCacheDTypeChoice, _engine_opt(
        "--kv-cache-dtype", help="CUDA: KV cache format (auto: the model dtype).")],
        KVCacheDTypeChoice(_D.kv_cache_dtype)),
    _option("disable_cuda_graph", Annotated[bool, _engine_opt(
        "--disable-cuda-graph", help="CUDA: run decode steps eagerly (no graph replay).")],
        not _D.cuda_graph),
    _option("cuda_graph_max_bs", Annotated[int | None, _engine_opt(
        "--cuda-graph-max-bs", min=1,
        help="CUDA: largest decode batch captured (default: --max-running-requests).")],
        _D.cuda_graph_max_bs),
]
_ENGINE_NAMES = [p.name for p in _ENGINE_PARAMS]


SAMPLING_PANEL = "Sampling"


def panel_option(panel: str, *decls: str, help: str, **kw: Any) -> Any:
    """A typer option shown under `panel` in --help."""
    return typer.Option(*decls, help=help, rich_help_panel=panel, **kw)


def sampling_option(*decls: str, help: str, **kw: Any) -> Any:
    """A sampling option: the same panel in every command."""
    return panel_option(SAMPLING_PANEL, *decls, help=help, **kw)


def build_engine_config(
    *, model: str | None, dtype: DTypeChoice, device: DeviceChoice, max_model_len: int | None,
    max_running_requests: int | None, max_batched_tokens: int | None,
    chunked_prefill_size: int | None, kv_cache_tokens: int | None, no_prefix_cache: bool,
    disable_overlap: bool, threads: int | None, mem_fraction_static: float = _D.mem_fraction_static,
    kv_cache_dtype: KVCacheDTypeChoice = KVCacheDTypeChoice.auto,
    disable_cuda_graph: bool = False, cuda_graph_max_bs: int | None = None,
    resolve_model: bool = True,
) -> EngineConfig:
    """The EngineConfig the engine flags describe. Resolves the model path first (unless told
    not to), so a missing model fails at once instead of after torch has loaded."""
    path = str(resolve_model_path(model)) if resolve_model else model
    try:
        return EngineConfig(
            model=path, dtype=cast(DType, dtype.value), device=cast(Device, device.value),
            max_model_len=max_model_len, max_running_requests=max_running_requests,
            max_batched_tokens=max_batched_tokens, chunked_prefill_size=chunked_prefill_size,
            kv_cache_tokens=kv_cache_tokens, enable_prefix_cache=not no_prefix_cache,
            overlap=not disable_overlap, num_threads=threads,
            mem_fraction_static=mem_fraction_static,
            kv_cache_dtype=cast(KVCacheDType, kv_cache_dtype.value),
            cuda_graph=not disable_cuda_graph, cuda_graph_max_bs=cuda_graph_max_bs,
        )
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


def arle_command(*, engine: bool = False, resolve_model: bool = True, one_request: bool = False
                 ) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Decorate a command: add `--log-format`/`--debug` (and the engine options when `engine`),
    configure logging, report errors. With `engine`, the command takes `config: EngineConfig`;
    `resolve_model=False` leaves the model path to be resolved when an engine is built (for a
    command that may not build one, like `chat --url`). `one_request`: the command runs one
    request at a time, so its engine takes one running request unless the flag says otherwise
    (on CUDA: one decode graph, no extend graphs, a second less to start: docs/benchmarks)."""

    def decorate(fn: Callable[..., None]) -> Callable[..., None]:
        own = [p for p in inspect.signature(fn, eval_str=True).parameters.values()
               if p.name != "config"]
        ctx_param = _option("_arle_ctx", typer.Context, inspect.Parameter.empty)
        params = [*own, *(_ENGINE_PARAMS if engine else []), *_GLOBAL_PARAMS, ctx_param]

        @functools.wraps(fn)
        def command(**kwargs: Any) -> None:
            ctx: typer.Context = kwargs.pop("_arle_ctx")
            root = ctx.find_root().obj
            outer = root if isinstance(root, GlobalOptions) else GlobalOptions()
            log_format = kwargs.pop("log_format") or outer.log_format
            debug = kwargs.pop("debug") or outer.debug
            engine_flags = ({name: kwargs.pop(name) for name in _ENGINE_NAMES if name in kwargs}
                            if engine else {})
            with report_errors(debug):
                fmt = resolve_log_format(log_format.value if log_format else None)
                # NOTE: console logs are for a person reading the answer: warnings only (info
                # lines would interleave with the streamed text). JSON logs are for machines
                # and keep the info events (`request_trace`).
                level = "debug" if debug else "info" if fmt == "json" else "warning"
                configure_logging(fmt, level)
                if engine:
                    if one_request and engine_flags["max_running_requests"] is None:
                        engine_flags["max_running_requests"] = 1
                    kwargs["config"] = build_engine_config(**engine_flags,
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
