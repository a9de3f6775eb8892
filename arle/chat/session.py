"""The chat loop: read a line, run a slash command or answer it, stream the answer.

Two ways in: `run_interactive` (prompt-toolkit: history file, multi-line input, completion of
the commands) and `run_piped` (stdin not a terminal: one message per line, exit at its end).
Both go through `handle(line)`, which is what the tests drive.

Ctrl-C during an answer: SIGINT is routed to `interrupt()` through the event loop while the
answer streams (the terminal is in cooked mode then); the partial answer stays in the history,
marked. At the prompt, prompt-toolkit reads Ctrl-C as a key: it clears the line.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import signal
import sys
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from arle.chat.backends import SAMPLING_SETTINGS, ChatBackend, TurnStats
from arle.chat.conversation import Conversation
from arle.engine.request import SamplingParams
from arle.errors import ArleError

DIM, RESET = "\x1b[2m", "\x1b[0m"
INTERRUPTED_MARK = "[interrupted]"
_OFF_VALUES = ("default", "none", "unset")


@dataclass(frozen=True)
class Command:
    name: str
    args: str
    help: str
    aliases: tuple[str, ...] = ()


COMMANDS = (
    Command("/help", "", "this list"),
    Command("/reset", "", "forget the conversation (the system message stays)", ("/clear",)),
    Command("/system", "[TEXT]", "set the system message; alone: show it; `/system -` drops it"),
    Command("/set", "[NAME VALUE]", "change a setting (`default` unsets it); alone: list them"),
    Command("/stats", "", "the last answer's numbers and the KV cache use"),
    Command("/model", "", "the model answering"),
    Command("/save", "PATH", "write the conversation as JSON"),
    Command("/load", "PATH", "continue a conversation saved with /save"),
    Command("/retry", "", "answer the last message again"),
    Command("/exit", "", "quit (also Ctrl-D)", ("/quit",)),
)
_BY_NAME = {name: c for c in COMMANDS for name in (c.name, *c.aliases)}
SETTING_NAMES = (*SAMPLING_SETTINGS, "stats")

KEYS_HELP = ("keys: Enter sends · Esc then Enter (or Alt-Enter) adds a line · pasted text stays "
             "one message · Up/Down browse history · Tab completes commands · Ctrl-C stops an "
             "answer or clears the line · Ctrl-D quits")


class CommandError(Exception):
    """A bad command or value: shown as one line, then back to the prompt."""


def parse_setting(name: str, value: str) -> Any:
    """The typed value of `/set NAME VALUE`, checked as SamplingParams would check it.
    None means: back to the default."""
    if name == "stats":
        if value.lower() in ("on", "true", "1", "yes"):
            return True
        if value.lower() in ("off", "false", "0", "no"):
            return False
        raise CommandError("/set stats: expected on or off")
    kind = SAMPLING_SETTINGS.get(name)
    if kind is None:
        raise CommandError(f"/set: unknown setting {name!r}; one of: {', '.join(SETTING_NAMES)}")
    if value.lower() in _OFF_VALUES:
        return None
    try:
        typed: Any = int(value) if kind is int else float(value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise CommandError(f"/set {name}: expected {what}, got {value!r}") from None
    try:
        SamplingParams(**{name: typed}).validate()
    except ArleError as e:
        raise CommandError(f"/set {e}") from None
    return typed


class ChatSession:
    """One chat: the conversation, the settings, the backend, and where output goes."""

    def __init__(self, backend: ChatBackend, *, conversation: Conversation | None = None,
                 settings: dict[str, Any] | None = None, show_stats: bool = True,
                 out: TextIO | None = None, status_out: TextIO | None = None,
                 color: bool | None = None) -> None:
        self.backend = backend
        self.conversation = conversation or Conversation()
        #: Sampling overrides; what is not here comes from the model (or the server).
        self.settings: dict[str, Any] = {k: v for k, v in (settings or {}).items()
                                         if v is not None}
        self.show_stats = show_stats
        self.out = out or sys.stdout
        #: Where the dim status line goes (stderr when stdout is piped, to keep it clean).
        self.status_out = status_out or self.out
        self.color = self.out.isatty() if color is None else color
        self.last_stats: TurnStats | None = None
        self._answer_task: asyncio.Task[str] | None = None
        self._interrupted = False

    # ---- output -----------------------------------------------------------------------------
    def _write(self, text: str, stream: TextIO | None = None) -> None:
        stream = stream or self.out
        stream.write(text)
        stream.flush()

    def _dim(self, text: str) -> str:
        return f"{DIM}{text}{RESET}" if self.color else text

    def say(self, line: str) -> None:
        self._write(line + "\n")

    # ---- one line of input ------------------------------------------------------------------
    async def handle(self, line: str) -> bool:
        """Run one line: a slash command or a message. False when the chat should end."""
        text = line.strip()
        if not text:
            return True
        if not text.startswith("/") or text.startswith("//"):
            # NOTE: `//` escapes a message that really begins with a slash.
            await self.send(line.replace("/", "", 1) if text.startswith("//") else line)
            return True
        try:
            return await self._command(text)
        except CommandError as e:
            self.say(str(e))
        except ArleError as e:
            self.say(f"error: {' '.join(str(e).splitlines())}")
        return True

    async def send(self, text: str) -> TurnStats | None:
        """Add a user message and answer it. None if the answer failed (the message is dropped
        again, so the history stays a valid conversation)."""
        self.conversation.add("user", text)
        stats = await self.answer()
        if stats is None:
            self.conversation.messages.pop()
        return stats

    async def answer(self) -> TurnStats | None:
        """Stream an answer to the conversation as it stands; add it to the history."""
        stats = TurnStats()
        pieces: list[str] = []
        self._interrupted = False

        async def consume() -> str:
            async for piece in self.backend.stream(self.conversation.for_model(),
                                                   dict(self.settings), stats):
                pieces.append(piece)
                self._write(piece)
            return "".join(pieces)

        self._answer_task = asyncio.ensure_future(consume())
        try:
            with self._sigint_interrupts():
                await self._answer_task
        except asyncio.CancelledError:
            if not self._interrupted:
                raise  # cancelled from outside (the chat is shutting down), not by Ctrl-C
        except ArleError as e:
            if pieces:
                self._write("\n")
            self.say(f"error: {' '.join(str(e).splitlines())}")
            if getattr(e, "param", None) == "prompt" and len(self.conversation.messages) > 1:
                # NOTE: the prompt is the whole conversation: once it outgrows the context,
                # every next message fails the same way until the history is cut.
                self.say("the conversation is too long for the model's context: "
                         "/reset starts over")
            return None
        finally:
            self._answer_task = None
        text = "".join(pieces)
        if self._interrupted:
            stats.finish_reason = "interrupted"
            self._write(("" if not text or text.endswith("\n") else " ")
                        + self._dim(INTERRUPTED_MARK))
        self._write("\n")
        self.conversation.add("assistant", text, interrupted=self._interrupted)
        self.last_stats = stats
        if self.show_stats:
            self._write(self._dim(status_line(stats)) + "\n", self.status_out)
        return stats

    @property
    def answering(self) -> bool:
        return self._answer_task is not None and not self._answer_task.done()

    def interrupt(self) -> bool:
        """Stop the answer being streamed (Ctrl-C). False when none is."""
        task = self._answer_task
        if task is None or task.done():
            return False
        self._interrupted = True
        task.cancel()
        return True

    @contextlib.contextmanager
    def _sigint_interrupts(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGINT, self.interrupt)
        except (NotImplementedError, RuntimeError, ValueError):
            yield  # not the main thread, or no signals here (Windows): Ctrl-C ends the chat
            return
        try:
            yield
        finally:
            loop.remove_signal_handler(signal.SIGINT)
            # NOTE: remove_signal_handler leaves Python's default handler, which raises
            # KeyboardInterrupt: at the prompt prompt-toolkit reads Ctrl-C as a key anyway.

    # ---- slash commands ---------------------------------------------------------------------
    async def _command(self, text: str) -> bool:
        name, _, rest = text.partition(" ")
        rest = rest.strip()
        cmd = _BY_NAME.get(name.lower())
        if cmd is None:
            raise CommandError(f"unknown command {name}; /help lists the commands")
        handlers: dict[str, Callable[[str], Awaitable[bool | None]]] = {
            "/help": self._help, "/reset": self._reset, "/system": self._system,
            "/set": self._set, "/stats": self._stats, "/model": self._model,
            "/save": self._save, "/load": self._load, "/retry": self._retry,
        }
        if cmd.name == "/exit":
            return False
        await handlers[cmd.name](rest)
        return True

    async def _help(self, _: str) -> None:
        for c in COMMANDS:
            names = " ".join(filter(None, [c.name, c.args]))
            alias = f" (also {', '.join(c.aliases)})" if c.aliases else ""
            self.say(f"  {names:<22} {c.help}{alias}")
        self.say(f"  settings: {', '.join(SETTING_NAMES)}")
        self.say(f"  {KEYS_HELP}")

    async def _reset(self, _: str) -> None:
        self.conversation.reset()
        self.say("conversation cleared")

    async def _system(self, rest: str) -> None:
        if not rest:
            self.say(f"system: {self.conversation.system!r}" if self.conversation.system
                     is not None else "system: the chat template's default")
            return
        self.conversation.system = None if rest == "-" else rest
        self.say("system message set" if rest != "-" else "system message dropped")

    async def _set(self, rest: str) -> None:
        if not rest:
            effective = self.backend.effective_settings(self.settings)
            for name, value in effective.items():
                shown = "default" if value is None else value
                mark = " (set)" if name in self.settings else ""
                self.say(f"  {name:<20} {shown}{mark}")
            self.say(f"  {'stats':<20} {'on' if self.show_stats else 'off'}")
            return
        name, _, value = rest.partition(" ")
        value = value.strip()
        if not value:
            raise CommandError(f"/set {name}: missing value; e.g. /set temperature 0.7")
        typed = parse_setting(name, value)
        if name == "stats":
            self.show_stats = bool(typed)
        elif typed is None:
            self.settings.pop(name, None)
        else:
            self.settings[name] = typed
        self.say(f"{name} = {'default' if typed is None else value}")

    async def _stats(self, _: str) -> None:
        s = self.last_stats
        if s is None:
            self.say("no answer yet")
        else:
            self.say(f"last answer: {status_line(s)}")
            if s.prompt_tokens:
                prompt = (f"prompt {s.prompt_tokens} tokens, {s.cached_tokens} from the prefix "
                          f"cache ({s.cached_tokens / s.prompt_tokens:.0%})")
            else:
                prompt = "prompt size not reported (the answer was cut short)"
            self.say(f"  {prompt}; total {s.total_ms:.0f} ms; finish {s.finish_reason}")
        kv = await self.backend.kv_usage()
        if kv is None:
            self.say("KV cache: not reported by this backend")
        else:
            self.say(f"KV cache: {kv['pages_used']}/{kv['pages_total']} pages in use "
                     f"({kv['pages_cached']} held by the prefix cache), "
                     f"{kv['page_size']} tokens a page; running {kv['running']}, "
                     f"waiting {kv['waiting']}")

    async def _model(self, _: str) -> None:
        for key, value in self.backend.info().items():
            self.say(f"  {key:<16} {value}")

    async def _save(self, rest: str) -> None:
        path = _one_path(rest, "/save")
        written = self.conversation.save(path, model=self.backend.model_name,
                                         settings=self.settings)
        self.say(f"saved {len(self.conversation.messages)} messages to {written}")

    async def _load(self, rest: str) -> None:
        path = _one_path(rest, "/load")
        conversation, data = Conversation.load(path)
        settings = data.get("settings")
        if isinstance(settings, dict):
            checked = {}
            for name, value in settings.items():
                if name in SAMPLING_SETTINGS and value is not None:
                    checked[name] = parse_setting(name, str(value))
            self.settings = checked
        self.conversation = conversation
        self.say(f"loaded {len(conversation.messages)} messages from {path}")

    async def _retry(self, _: str) -> None:
        messages = self.conversation.messages
        previous = self.conversation.pop_answer()
        if not messages or messages[-1].role != "user":
            if previous is not None:
                messages.append(previous)
            raise CommandError("/retry: no message to answer yet")
        if await self.answer() is None and previous is not None:
            self.conversation.messages.append(previous)

    # ---- the two loops ----------------------------------------------------------------------
    async def run_piped(self, lines: Iterable[str]) -> None:
        """One message (or command) per line until the input ends."""
        for line in lines:
            if not await self.handle(line.rstrip("\r\n")):
                return

    async def run_interactive(self, history_path: Path | None = None, **prompt_kw: Any) -> None:
        """The prompt-toolkit REPL until /exit or Ctrl-D. `prompt_kw` goes to PromptSession
        (tests pass `input=`/`output=`)."""
        prompt = make_prompt(history_path, **prompt_kw)
        self.say(self._dim(f"arle chat · {self.backend.model_name} · /help for commands, "
                           "Ctrl-D to quit"))
        while True:
            try:
                line = await prompt.prompt_async()
            except KeyboardInterrupt:
                continue  # Ctrl-C at the prompt: the line is cleared
            except EOFError:
                return
            if not await self.handle(line):
                return


def status_line(s: TurnStats) -> str:
    parts = [f"{s.completion_tokens} tokens"]
    if s.tokens_per_s is not None:
        parts.append(f"{s.tokens_per_s:.1f} tok/s")
    if s.tokens_per_step is not None:
        parts.append(f"{s.tokens_per_step:.2f} tok/step")
    if s.ttft_ms is not None:
        parts.append(f"TTFT {s.ttft_ms:.0f} ms")
    if s.prompt_tokens:
        parts.append(f"prefix {s.cached_tokens}/{s.prompt_tokens} cached")
    return " · ".join(parts)


def _one_path(rest: str, cmd: str) -> str:
    try:
        parts = shlex.split(rest)
    except ValueError as e:
        raise CommandError(f"{cmd}: {e}") from None
    if len(parts) != 1:
        raise CommandError(f"{cmd}: expected one PATH, e.g. {cmd} chat.json")
    return parts[0]


def make_prompt(history_path: Path | None, **prompt_kw: Any) -> Any:
    """A PromptSession: Enter sends, Esc+Enter inserts a newline, the history in a file,
    completion of the slash commands and of /set's names."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.completion import Completer, Completion
    from prompt_toolkit.history import FileHistory, InMemoryHistory
    from prompt_toolkit.key_binding import KeyBindings

    class SlashCompleter(Completer):
        def get_completions(self, document: Any, complete_event: Any) -> Iterator[Completion]:
            before = document.text_before_cursor
            if not before.startswith("/"):
                return
            if " " not in before:
                for name in _BY_NAME:
                    if name.startswith(before):
                        yield Completion(name, start_position=-len(before))
            elif before.startswith("/set ") and before.count(" ") == 1:
                word = before[5:]
                for name in SETTING_NAMES:
                    if name.startswith(word):
                        yield Completion(name, start_position=-len(word))

    keys = KeyBindings()

    @keys.add("escape", "enter")
    def _newline(event: Any) -> None:
        event.current_buffer.insert_text("\n")

    history: Any = InMemoryHistory()
    if history_path is not None:
        try:
            history_path.parent.mkdir(parents=True, exist_ok=True)
            history_path.touch()
            history = FileHistory(str(history_path))
        except OSError:
            pass  # NOTE: a read-only home must not stop the chat; `arle doctor` reports it
    return PromptSession(
        message=">>> ", history=history, completer=SlashCompleter(), key_bindings=keys,
        multiline=False, prompt_continuation="... ", complete_while_typing=False,
        enable_history_search=False, **prompt_kw)
