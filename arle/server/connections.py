"""How long a client may take, and how many connections it may hold open.

A connection must send a whole request head within `head_timeout_s` of opening (or of its
previous response), and the body within `body_timeout_s` of the head; past either it is closed
(a partial head gets a 408 first). At most `max_connections` are open: past it, the oldest
connection with no request in flight is closed to make room (idle sockets and dripped heads
cannot lock a new client out), and only when every open connection has a request in flight is
the new one answered 503 and closed. Reaching the cap is logged once until the count falls
back below half of it. The cap sits below the process's descriptor limit (`descriptor_cap`),
so `accept` never fails for want of descriptors.
"""

from __future__ import annotations

import asyncio
import resource
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from arle.logging import get_logger

log = get_logger("arle.server")

#: Descriptors kept for everything but client sockets: model files, pipes, logs, the loop's own.
RESERVED_DESCRIPTORS = 256
DEFAULT_MAX_CONNECTIONS = 8192
DEFAULT_HEAD_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S


def descriptor_cap(wanted: int) -> int:
    """The most connections this process can hold: `wanted`, lowered below the descriptor
    limit. The soft limit is raised to the hard one first (as most servers do at start)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return max(1, min(wanted, soft - RESERVED_DESCRIPTORS))


class Connection(Protocol):
    """What the registry needs of a connection (the HTTP protocol object)."""

    def busy(self) -> bool: ...

    def close_idle(self) -> None: ...


class Registry:
    """The open connections, oldest first, and the cap over them."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._open: dict[Connection, None] = {}
        self._logged = False

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, conn: Connection) -> bool:
        """Register a new connection; False: every open one is busy and the cap is reached
        (the caller refuses this one). Evicts the oldest idle connection past the cap."""
        if len(self._open) >= self.cap:
            self._log_cap()
            victim = next((c for c in self._open if not c.busy()), None)
            if victim is None:
                return False
            self.remove(victim)
            victim.close_idle()
        self._open[conn] = None
        return True

    def remove(self, conn: Connection) -> None:
        self._open.pop(conn, None)
        if self._logged and len(self._open) < self.cap // 2:
            self._logged = False

    def _log_cap(self) -> None:
        if not self._logged:
            self._logged = True
            log.warning("connection_cap_reached", max_connections=self.cap,
                        hint="idle connections are closed to make room; raise "
                             "--max-connections or the descriptor limit (ulimit -n)")


class Deadline:
    """One timer at a time on a connection: armed, re-armed, cancelled."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._handle: asyncio.TimerHandle | None = None

    def arm(self, seconds: float, expired: Callable[[], None]) -> None:
        self.cancel()
        self._handle = self._loop.call_later(seconds, expired)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
