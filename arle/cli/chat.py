"""`arle chat`: an interactive chat on the engine in this process, or on a server (`--url`).

The loop itself lives in `arle.chat`; this file turns flags into a backend and a session.
NOTE: the engine, prompt-toolkit and httpx are imported when the command runs, not at import.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from arle import env
from arle.cli.common import arle_command, panel_option, sampling_option
from arle.config import EngineConfig

CHAT_PANEL = "Chat"


def _chat_opt(*decls: str, help: str, **kw: Any) -> Any:
    return panel_option(CHAT_PANEL, *decls, help=help, **kw)



@arle_command(engine=True, resolve_model=False, one_request=True)
def chat(
    url: Annotated[str | None, _chat_opt(
        "--url", metavar="URL",
        help="Chat with a running server (e.g. http://127.0.0.1:8000) instead of loading the "
             "model here.")] = None,
    api_key: Annotated[str | None, _chat_opt(
        "--api-key", envvar=env.ARLE_API_KEY, help="Bearer token for --url.")] = None,
    system: Annotated[str | None, _chat_opt(
        "--system", help="The system message (default: the chat template's).")] = None,
    load: Annotated[Path | None, _chat_opt(
        "--load", metavar="PATH", help="Start from a conversation saved with /save.")] = None,
    history: Annotated[Path | None, _chat_opt(
        "--history", metavar="PATH",
        help="Input history file (default: $XDG_DATA_HOME/arle/chat_history).")] = None,
    no_stats: Annotated[bool, _chat_opt(
        "--no-stats", help="No status line after each answer (/set stats on brings it back).")
    ] = False,
    max_tokens: Annotated[int, sampling_option(
        "--max-tokens", min=1, help="Most tokens of one answer.")] = 1024,
    temperature: Annotated[float | None, sampling_option(
        "--temperature", min=0.0, help="Sampling temperature (default: the model's).")] = None,
    top_p: Annotated[float | None, sampling_option("--top-p", help="Nucleus sampling mass.")] = None,
    top_k: Annotated[int | None, sampling_option("--top-k", help="Sample among the k likeliest.")
                     ] = None,
    seed: Annotated[int | None, sampling_option("--seed", help="Seed of the sampling.")] = None,
    *,
    config: EngineConfig,
) -> None:
    """Chat with the model in the terminal.

    Enter sends; Esc then Enter adds a line; Ctrl-C stops an answer; Ctrl-D or /exit quits;
    /help lists the commands. With stdin not a terminal, each line is one message.
    """
    from arle.chat.conversation import Conversation
    from arle.chat.session import parse_setting

    settings: dict[str, Any] = {}
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature),
                        ("top_p", top_p), ("top_k", top_k), ("seed", seed)):
        if value is not None:
            try:
                settings[name] = parse_setting(name, str(value))
            except Exception as e:
                raise typer.BadParameter(str(e), param_hint=f"--{name.replace('_', '-')}"
                                         ) from None
    conversation = Conversation.load(load)[0] if load is not None else Conversation()
    if system is not None:
        conversation.system = system
    asyncio.run(_chat(config, url, api_key, conversation, settings, not no_stats, history))


async def _chat(config: EngineConfig, url: str | None, api_key: str | None, conversation: Any,
                settings: dict[str, Any], show_stats: bool, history: Path | None) -> None:
    from arle.chat.backends import ChatBackend, EngineBackend, RemoteBackend
    from arle.chat.session import ChatSession
    from arle.paths import chat_history_path

    interactive = sys.stdin.isatty()
    backend: ChatBackend
    if url is not None:
        remote = RemoteBackend(url, api_key)
        try:
            await remote.connect()
        except BaseException:
            await remote.close()
            raise
        backend = remote
    else:
        from arle.engine.build import create_engine  # NOTE: lazy: loads torch

        if interactive:
            sys.stderr.write("loading the model...\n")
        backend = EngineBackend(await create_engine(config))
    session = ChatSession(backend, conversation=conversation, settings=settings,
                          show_stats=show_stats,
                          status_out=sys.stdout if interactive else sys.stderr)
    try:
        if interactive:
            await session.run_interactive(history or chat_history_path())
        else:
            await session.run_piped(sys.stdin)
    finally:
        await backend.close()
