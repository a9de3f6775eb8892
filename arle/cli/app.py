"""The `arle` command: the typer app, its global options and its commands.

NOTE: this module and everything it imports at the top stay light (no torch, no tokenizers):
`arle --help` must answer in well under a second. Commands import the engine when they run.
"""

from __future__ import annotations

from typing import Annotated

import typer

import arle
from arle.cli.bench import bench
from arle.cli.chat import chat
from arle.cli.common import DebugOption, GlobalOptions, LogFormatOption
from arle.cli.complete import complete
from arle.cli.diagnostics import doctor, warmup
from arle.cli.serve import serve

app = typer.Typer(
    name="arle",
    help="arle: a small, fast LLM inference engine. One-shot completions, an interactive "
         "chat, an OpenAI-compatible server and its benchmark, and diagnostics.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"arle {arle.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    version: Annotated[bool, typer.Option(
        "--version", is_eager=True, callback=_print_version, help="Print the version and exit.",
    )] = False,
    log_format: LogFormatOption = None,
    debug: DebugOption = False,
) -> None:
    # The commands accept --log-format/--debug too; these apply when a command leaves them out.
    ctx.obj = GlobalOptions(log_format=log_format, debug=debug)


app.command("complete")(complete)
app.command("serve")(serve)
app.command("bench")(bench)
app.command("chat")(chat)
app.command("warmup")(warmup)
app.command("doctor")(doctor)


def main() -> None:
    app(prog_name="arle")
