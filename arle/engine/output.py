"""Turning generated token ids into text a client can be sent piece by piece.

Two small state machines, one per request:
- `IncrementalDetokenizer`: ids -> text, never emitting half a UTF-8 character.
- `StopStringMatcher`: text -> text, holding back what could still become a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Decode a growing list of ids into new text, a small window at a time.

    Two offsets into the ids: text up to `_read` has been emitted, and the window decoded starts
    at `_prefix` (the tokens of the last emitted piece), because a token decoded with no left
    context can come out differently (SentencePiece drops a leading space, a byte-level token may
    hold the tail of a character). New text = decode(window) minus decode(window up to `_read`).

    NOTE: while the decoded window ends in U+FFFD the last character is incomplete (emoji and CJK
    are split across byte-level tokens), so nothing is emitted and the window grows; after
    `MAX_HOLD` such tokens the ids are taken to be really broken and the text goes out as it is,
    which keeps each step O(window).
    """

    MAX_HOLD = 16

    def __init__(self, tokenizer: _Decoder, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_ids: list[int]) -> str:
        """Add generated ids; return the text that is now complete (maybe "")."""
        out = []
        for t in token_ids:  # one at a time, so a long hold cannot hide inside one push
            self._ids.append(t)
            out.append(self._step(force=False))
        return "".join(out)

    def flush(self) -> str:
        """At the end of a request: whatever is held, complete or not."""
        return self._step(force=True)

    def _step(self, force: bool) -> str:
        if self._read == len(self._ids):
            return ""
        window = self._ids[self._prefix:]
        skip = self._skip
        before = self._tok.decode(window[: self._read - self._prefix], skip_special_tokens=skip)
        text = self._tok.decode(window, skip_special_tokens=skip)
        held = len(self._ids) - self._read
        if text.endswith(_REPLACEMENT) and not force and held < self.MAX_HOLD:
            return ""
        # `text` starts with `before` for every decoder we use (both start at the same token).
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before):]


class StopStringMatcher:
    """Cut generated text at the first stop string, which is never emitted.

    Feed text as it is decoded; each feed returns what is safe to send now. The longest tail
    that is the start of some stop string is held back until it either completes a stop or
    cannot anymore, so a stop split across any number of feeds is still found.

    With several stops, the one that is complete first reading left to right wins (ties: the
    longer one); this answer does not depend on how the text was split into feeds.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.matched: str | None = None
        #: Per stop: the prefix lengths k (longest first) by the prefix's last character, so a
        #: feed tries only the prefixes that can end the text (see `_partial_tail`).
        self._prefix_ends: list[tuple[str, dict[str, list[int]]]] = []
        for stop in self._stops:
            ends: dict[str, list[int]] = {}
            for k in range(len(stop) - 1, 0, -1):
                ends.setdefault(stop[k - 1], []).append(k)
            self._prefix_ends.append((stop, ends))

    def feed(self, text: str) -> tuple[str, str | None]:
        """Return (text safe to emit, the stop string matched by this feed or None).

        After a match, further text is ignored.
        """
        if self.matched is not None:
            return "", None
        buf = self._held + text
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self._stops:
            i = buf.find(stop)
            if i >= 0:
                cand = (i + len(stop), -len(stop), stop)
                best = cand if best is None or cand < best else best
        if best is not None:
            end, neg_len, stop = best
            self._held, self.matched = "", stop
            return buf[: end + neg_len], stop
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        """At the end of a request with no match: the held-back text."""
        held, self._held = self._held, ""
        return held

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop."""
        if not buf:
            return 0
        best, last = 0, buf[-1]
        for stop, ends in self._prefix_ends:
            for k in ends.get(last, ()):
                if k <= best:
                    break
                if k <= len(buf) and buf.endswith(stop[:k]):
                    best = k
                    break
        return best
