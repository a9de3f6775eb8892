"""A chat conversation: the system message, the turns, and its JSON file (`/save`, `/load`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arle.errors import ArleError

FORMAT = "arle.chat.v1"
ROLES = ("user", "assistant")


class ConversationFileError(ArleError):
    """A conversation file that cannot be written or read back."""

    exit_code = 2


@dataclass
class Message:
    role: str
    content: str
    #: An answer cut short by Ctrl-C. NOTE: it stays in the history (the model sees it on the
    #: next turn) but is marked, so a reader of the saved file knows it is partial.
    interrupted: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.interrupted:
            out["interrupted"] = True
        return out


@dataclass
class Conversation:
    system: str | None = None
    messages: list[Message] = field(default_factory=list)

    def add(self, role: str, content: str, interrupted: bool = False) -> None:
        self.messages.append(Message(role, content, interrupted))

    def reset(self) -> None:
        """Forget the turns; the system message stays."""
        self.messages.clear()

    def pop_answer(self) -> Message | None:
        """Remove the last answer (for `/retry`); None when the last message is not one."""
        if self.messages and self.messages[-1].role == "assistant":
            return self.messages.pop()
        return None

    def for_model(self) -> list[dict[str, Any]]:
        """The chat messages a backend sends: OpenAI-style role/content dicts, nothing else."""
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        return head + [{"role": m.role, "content": m.content} for m in self.messages]

    # ---- files ------------------------------------------------------------------------------
    def to_json(self, **extra: Any) -> dict[str, Any]:
        return {"format": FORMAT, "system": self.system,
                "messages": [m.to_json() for m in self.messages], **extra}

    def save(self, path: str | Path, **extra: Any) -> Path:
        """Write the conversation (plus `extra` keys, e.g. model and settings) as JSON."""
        path = Path(path).expanduser()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.to_json(**extra), indent=2, ensure_ascii=False) + "\n")
        except OSError as e:
            raise ConversationFileError(f"cannot write {path}: {e.strerror or e}") from None
        return path

    @classmethod
    def from_json(cls, data: Any, source: object = "conversation") -> Conversation:
        def bad(why: str) -> ConversationFileError:
            return ConversationFileError(f"{source}: not an arle conversation ({why})")

        if not isinstance(data, dict):
            raise bad("expected a JSON object")
        system = data.get("system")
        if system is not None and not isinstance(system, str):
            raise bad("'system' must be a string or null")
        raw = data.get("messages")
        if not isinstance(raw, list):
            raise bad("'messages' must be a list")
        conv = cls(system=system)
        for i, m in enumerate(raw):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str):
                raise bad(f"message {i} needs a string 'content'")
            role = m.get("role")
            if role == "system" and i == 0 and system is None:
                conv.system = m["content"]  # an OpenAI-style list with the system message first
                continue
            if role not in ROLES:
                raise bad(f"message {i} has role {role!r}; expected one of {', '.join(ROLES)}")
            conv.add(role, m["content"], bool(m.get("interrupted", False)))
        return conv

    @classmethod
    def load(cls, path: str | Path) -> tuple[Conversation, dict[str, Any]]:
        """The conversation in a file written by `save`, and the whole JSON object."""
        path = Path(path).expanduser()
        try:
            data = json.loads(path.read_text())
        except OSError as e:
            raise ConversationFileError(f"cannot read {path}: {e.strerror or e}") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConversationFileError(f"{path}: not valid JSON ({e})") from None
        return cls.from_json(data, path), data
