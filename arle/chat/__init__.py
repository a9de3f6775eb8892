"""`arle chat`'s core: the conversation, the backends (engine in-process or a server), the loop."""

from arle.chat.backends import ChatBackend, EngineBackend, RemoteBackend, TurnStats
from arle.chat.conversation import Conversation, Message
from arle.chat.session import ChatSession

__all__ = ["ChatBackend", "ChatSession", "Conversation", "EngineBackend", "Message",
           "RemoteBackend", "TurnStats"]
