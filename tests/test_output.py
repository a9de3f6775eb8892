"""Incremental detokenization and stop strings."""

from __future__ import annotations

import itertools
import random

import pytest
from helpers import smollm2_tokenizer

from arle.engine.output import IncrementalDetokenizer, StopStringMatcher
from arle.model.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "   three leading spaces, then  two, then a tab\tand a newline\n",
    "😀 grin, 👍🏽 thumbs with skin tone, 👨‍👩‍👧‍👦 family (ZWJ), 🏳️‍🌈 and flags 🇫🇷🇯🇵🇺🇸",
    "你好，世界！这是一个用来测试中文分词的句子。日本語も少し。한국어도.",
    "Àccénts: naïve café, Straße, ñandú, Ελληνικά, русский текст",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)  # 🐍\n",
    "<|im_start|>assistant\nSure! 🎉<|im_end|>\n",
    "emoji at the very end 🤖",
    "🤖",
    "math: ∑ᵢ xᵢ² ≤ ∞, → ⇒ ∀x∃y; 10,000.5 ± 0.1",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return smollm2_tokenizer()


def _stream(tok: Tokenizer, ids: list[int], chunk: int = 1, skip: bool = True) -> list[str]:
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces = [det.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return [*pieces, det.flush()]


def test_test_texts_really_split_characters(tok: Tokenizer) -> None:
    """Guard: the texts must contain characters spread over several tokens, or the hold path
    below would go untested."""
    ids = tok.encode("🤖")
    assert len(ids) > 1 and "\ufffd" in tok.decode(ids[:1])


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode(tok: Tokenizer, text: str, skip: bool) -> None:
    ids = tok.encode(text)
    expected = tok.decode(ids, skip_special_tokens=skip)
    for chunk in (1, 2, 3, 7):
        pieces = _stream(tok, ids, chunk, skip)
        assert "".join(pieces) == expected
        assert not any("\ufffd" in p for p in pieces), pieces


def test_incomplete_tail_is_held_then_flushed(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🤖")
    det = IncrementalDetokenizer(tok)
    out = det.push(ids[:-1])  # the emoji's last byte is missing
    assert "\ufffd" not in out and out.startswith("ok")
    assert det.flush() == tok.decode(ids[:-1])[len(out):]  # the partial char, as decode shows it
    assert det.flush() == ""


def test_broken_bytes_are_not_held_forever(tok: Tokenizer) -> None:
    # 0xF0 starts a 4-byte character; 40 of them in a row never complete one.
    lead = tok.token_to_id("ð")
    assert lead is not None and tok.decode([lead]) == "\ufffd"
    det = IncrementalDetokenizer(tok)
    pieces = [det.push([lead]) for _ in range(40)]
    assert any(pieces[: IncrementalDetokenizer.MAX_HOLD + 1])
    assert "".join(pieces) + det.flush() == tok.decode([lead] * 40)


class _CountingDecoder:
    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.longest = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_cost_per_token_is_a_window(tok: Tokenizer) -> None:
    ids = tok.encode("".join(TEXTS) * 20)
    assert len(ids) > 2000
    counting = _CountingDecoder(tok)
    det = IncrementalDetokenizer(counting)
    text = "".join(det.push([i]) for i in ids) + det.flush()
    assert text == tok.decode(ids)
    assert counting.longest <= 8


# --- stop strings -------------------------------------------------------------------------------


def _run(stops: list[str], chunks: list[str]) -> tuple[str, str | None]:
    m = StopStringMatcher(stops)
    out = []
    for c in chunks:
        text, hit = m.feed(c)
        out.append(text)
        if hit is not None:
            return "".join(out), hit
    return "".join(out) + m.flush(), None


def _reference(stops: list[str], text: str) -> tuple[str, str | None]:
    """Read left to right; the first stop to be complete wins (ties: the longer)."""
    for end in range(1, len(text) + 1):
        for stop in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(stop):
                return text[: end - len(stop)], stop
    return text, None


def _splits(text: str, parts: int) -> list[list[str]]:
    out = []
    for cuts in itertools.combinations(range(1, len(text)), parts - 1):
        bounds = [0, *cuts, len(text)]
        out.append([text[a:b] for a, b in itertools.pairwise(bounds)])
    return out


def test_stop_split_across_every_boundary() -> None:
    text = "Say hi<|end|> then more"
    for parts in (1, 2, 3):
        for chunks in _splits(text, parts):
            m = StopStringMatcher(["<|end|>"])
            emitted = ""
            for c in chunks:
                out, hit = m.feed(c)
                assert "<" not in out and "|" not in out, chunks  # no part of the stop leaks
                emitted += out
                if hit:
                    break
            assert (emitted, hit) == ("Say hi", "<|end|>"), chunks


def test_char_by_char_and_overlapping_prefix() -> None:
    assert _run(["aab"], list("aaab")) == ("a", "aab")
    assert _run(["aab"], ["aaab"]) == ("a", "aab")
    m = StopStringMatcher(["aab"])
    assert m.feed("aa") == ("", None)  # could still become "aab"
    assert m.feed("a") == ("a", None)  # "aaa": only the last two can
    assert m.feed("b") == ("", "aab")
    assert m.feed("more") == ("", None)  # done: later text is ignored


def test_multiple_stops_earliest_wins() -> None:
    assert _run(["world", "hello"], ["say hello world"]) == ("say ", "hello")
    assert _run(["world", "hello"], list("say hello world")) == ("say ", "hello")
    # Nested stops: the one complete first wins, however the text is split.
    for chunks in [["abcd"], list("abcd"), ["ab", "cd"]]:
        assert _run(["abcd", "bc"], chunks) == ("a", "bc")
    assert _run(["ab", "abc"], ["xabc"]) == ("x", "ab")


def test_no_match_flushes_everything() -> None:
    for chunks in (["a<|en", "d", "|"], ["<", "|", "e"], ["plain text"]):
        assert _run(["<|end|>"], chunks) == ("".join(chunks), None)
    m = StopStringMatcher(["<|end|>"])
    assert m.feed("x <|e") == ("x ", None)
    assert m.flush() == "<|e"
    assert _run([], ["any", "thing"]) == ("anything", None)


def test_stops_against_reference_fuzz() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choices("ab", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choices("abc", k=rng.randint(0, 14)))
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, max(0, len(text) - 1))))
        bounds = [0, *cuts, len(text)]
        chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
        assert _run(stops, chunks) == _reference(stops, text), (stops, chunks)
