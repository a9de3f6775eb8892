"""What a request asks of the sampler, and what it reports per token.

Below the executor (which samples) and the engine (which validates and re-exports them), so
that every layer can name them without importing upwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from arle.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping. temperature 0 means greedy."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    #: None: no logprobs; 0: the chosen token's only; N: also the top N alternatives.
    logprobs: int | None = None
    #: The prompt's own logprobs (the first token has none): None, or as `logprobs` says.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    MAX_LOGPROBS = 20
    #: OpenAI's range for temperature.
    MAX_TEMPERATURE = 2.0
    #: Bounds on what a request may ask the stop matcher to watch for (OpenAI allows 4 stop
    #: strings; a few more serve eval harnesses that send one per few-shot separator).
    MAX_STOP_STRINGS = 16
    MAX_STOP_CHARS = 256
    MAX_STOP_TOKEN_IDS = 1024
    MAX_TOP_K = 2**31 - 1
    MAX_REPETITION_PENALTY = 2.0

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first bad field."""

        def bad(name: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{name} {why}, got {getattr(self, name)!r}", param=name)

        def finite(name: str) -> None:
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise bad(name, "must be a finite number")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):
            finite(name)
        if not 0 <= self.temperature <= self.MAX_TEMPERATURE:
            raise bad("temperature", f"must be in [0, {self.MAX_TEMPERATURE:g}]")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k <= self.MAX_TOP_K:
            raise bad("top_k", f"must be an integer in [-1, {self.MAX_TOP_K}] "
                               "(-1 or 0 disables it)")
        if not 0 < self.repetition_penalty <= self.MAX_REPETITION_PENALTY:
            raise bad("repetition_penalty", f"must be in (0, {self.MAX_REPETITION_PENALTY:g}]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise bad("seed", "must be an integer >= 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            raise bad("logprobs", f"must be in [0, {self.MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS:
            raise bad("prompt_logprobs", f"must be in [0, {self.MAX_LOGPROBS}]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        # NOTE: the messages give the counts, not the values: the values can be huge.
        if len(self.stop) > self.MAX_STOP_STRINGS:
            raise InvalidRequestError(f"stop has {len(self.stop)} strings; at most "
                                      f"{self.MAX_STOP_STRINGS} are allowed", param="stop")
        longest = max(map(len, self.stop), default=0)
        if longest > self.MAX_STOP_CHARS:
            raise InvalidRequestError(f"a stop string has {longest} characters; at most "
                                      f"{self.MAX_STOP_CHARS} are allowed", param="stop")
        if len(self.stop_token_ids) > self.MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                f"stop_token_ids has {len(self.stop_token_ids)} ids; at most "
                f"{self.MAX_STOP_TOKEN_IDS} are allowed", param="stop_token_ids")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    #: (token_id, logprob) of the top alternatives, best first; empty unless asked for.
    top: tuple[tuple[int, float], ...] = ()
