"""`arle bench`'s core: a load generator for any OpenAI-compatible server (ours, vLLM, SGLang).

Workload `random`: each prompt is `input_len` token ids drawn uniformly from [0, vocab_size),
sent as a token-id prompt to /v1/completions (so its length is exact, no re-tokenization), with
`max_tokens=output_len` and `ignore_eos` (so each request generates exactly `output_len` tokens;
vLLM and SGLang accept `ignore_eos` too). The vocabulary size comes from `--vocab-size`, else
from arle's `/v1/models` card (`vocab_size`, an arle extension).

`backend` picks the request shape, so a number here and one from another load generator come
from the same requests (`REQUEST_SHAPES`): arle's own (token-id prompts, include_usage), SGLang
bench_serving's `sglang-oai` (/v1/completions, best_of 1, no stream_options) and
`sglang-oai-chat`, and guidellm's (/v1/chat/completions, max_completion_tokens, stop null,
ignore_eos, stream_options with continuous_usage_stats). The chat shapes send text: the random
ids become text through the server's /detokenize once, before the run, and the prompt's length is
what the server's usage reports.

Every request streams; the client times what a user sees: TTFT (first text), the gaps between
text chunks (ITL), TPOT ((e2e - ttft) / (output tokens - 1)) and e2e latency. The summary's field
names are those of SGLang's `bench_serving` JSON, so runs can be compared side by side.

NOTE: no torch, no engine: only httpx. The server under test may be anywhere (a URL).
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from arle.errors import ArleError


@dataclass(frozen=True)
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    api_key: str | None = None
    num_prompts: int = 100
    input_len: int = 256
    output_len: int = 64
    #: Most requests in flight at once (None: no bound).
    max_concurrency: int | None = None
    #: Requests per second, arrivals Poisson; inf sends them all at once.
    request_rate: float = math.inf
    warmup_requests: int = 1
    seed: int = 1
    vocab_size: int | None = None
    #: Per-request timeout in seconds.
    timeout_s: float = 600.0
    #: The request shape (`REQUEST_SHAPES`).
    backend: str = "arle"

    def __post_init__(self) -> None:
        if self.backend not in REQUEST_SHAPES:
            raise ArleError(f"unknown backend {self.backend!r}; one of "
                            f"{', '.join(REQUEST_SHAPES)}")
        for name in ("num_prompts", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ArleError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.request_rate <= 0:
            raise ArleError(f"request_rate must be > 0, got {self.request_rate}")


@dataclass
class RequestResult:
    prompt_len: int
    ok: bool = False
    output_len: int = 0
    #: Prompt tokens the server took from its prefix cache (usage.prompt_tokens_details).
    cached_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    #: Arrival time of each text chunk and how many tokens it stands for.
    chunk_times: list[tuple[float, int]] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True)
class RequestShape:
    """What one load generator sends: the route and the body, on top of model, prompt,
    max_tokens, greedy and stream."""

    route: str
    chat: bool
    extra: dict[str, Any]
    #: the output limit's field name
    limit: str = "max_tokens"

    def body(self, model: str, prompt: list[int] | str, output_len: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "temperature": 0.0, "stream": True,
                                self.limit: output_len, **self.extra}
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body


REQUEST_SHAPES: dict[str, RequestShape] = {
    "arle": RequestShape("/v1/completions", False, {
        "ignore_eos": True, "stream_options": {"include_usage": True}}),
    # SGLang's bench_serving, --backend sglang-oai / sglang-oai-chat
    "sglang-oai": RequestShape("/v1/completions", False, {"best_of": 1, "ignore_eos": True}),
    "sglang-oai-chat": RequestShape("/v1/chat/completions", True, {"ignore_eos": True}),
    # guidellm's openai_http backend with a fixed output length (chat completions)
    "guidellm": RequestShape("/v1/chat/completions", True, {
        "stop": None, "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        limit="max_completion_tokens"),
}


def _chunk_text(obj: dict[str, Any], chat: bool) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    if chat:
        return str((choices[0].get("delta") or {}).get("content") or "")
    return str(choices[0].get("text") or "")


class _InFlight:
    def __init__(self) -> None:
        self.now = self.max = 0

    def __enter__(self) -> None:
        self.now += 1
        self.max = max(self.max, self.now)

    def __exit__(self, *exc: object) -> None:
        self.now -= 1


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def discover(client: httpx.AsyncClient, cfg: BenchConfig) -> tuple[str, int]:
    """The model to ask for and the vocabulary size to draw prompt ids from."""
    try:
        resp = await client.get("/v1/models")
    except httpx.HTTPError as e:
        raise ArleError(f"cannot reach {cfg.base_url}: {e}") from None
    if resp.status_code != 200:
        raise ArleError(f"GET {cfg.base_url}/v1/models answered {resp.status_code}: "
                        f"{resp.text[:200]}")
    cards = resp.json().get("data") or []
    card = next((c for c in cards if cfg.model in (None, c.get("id"))), None)
    model = cfg.model or (card or {}).get("id")
    if not model:
        raise ArleError("the server lists no model; pass --model")
    vocab = cfg.vocab_size or (card or {}).get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise ArleError("the server does not say its vocabulary size; pass --vocab-size")
    return model, vocab


async def engine_counters(client: httpx.AsyncClient) -> tuple[int, int] | None:
    """arle's step count and device busy time (us) so far, from /v1/stats; None for a server
    that does not report them."""
    try:
        resp = await client.get("/v1/stats")
        if resp.status_code != 200:
            return None
        engine = resp.json().get("engine") or {}
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    steps, busy = engine.get("steps"), engine.get("device_us")
    return (steps, busy) if isinstance(steps, int) and isinstance(busy, int) else None


def random_prompts(cfg: BenchConfig, vocab_size: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(cfg.input_len)] for _ in range(count)]


async def as_text(client: httpx.AsyncClient, prompts: list[list[int]]) -> list[str]:
    """The prompts as text, through the server's /detokenize (for the chat shapes)."""
    out = []
    for ids in prompts:
        try:
            resp = await client.post("/detokenize", json={"tokens": ids})
        except httpx.HTTPError as e:
            raise ArleError(f"POST /detokenize: {e}") from None
        if resp.status_code != 200:
            raise ArleError(f"this backend sends text prompts and the server's /detokenize "
                            f"answered {resp.status_code}: {resp.text[:200]}")
        out.append(str(resp.json()["prompt"]))
    return out


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int] | str,
                      output_len: int, shape: RequestShape = REQUEST_SHAPES["arle"],
                      prompt_len: int = 0) -> RequestResult:
    """Stream one completion and time it. `prompt_len`: a text prompt's length in tokens
    (the server's usage, where it reports one, has the last word)."""
    result = RequestResult(prompt_len=len(prompt) if isinstance(prompt, list) else prompt_len)
    body = shape.body(model, prompt, output_len)
    start = last = time.perf_counter()
    chunks = 0
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", shape.route, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {text[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = orjson.loads(data)
                if "error" in obj:
                    result.error = str(obj["error"].get("message"))
                    return result
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                    result.prompt_len = obj["usage"].get("prompt_tokens") or result.prompt_len
                    details = obj["usage"].get("prompt_tokens_details") or {}
                    result.cached_tokens = int(details.get("cached_tokens") or 0)
                if not _chunk_text(obj, shape.chat):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                result.chunk_times.append((now, 1))
                last = now
                chunks += 1
    except (httpx.HTTPError, ValueError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e_s = time.perf_counter() - start
    result.output_len = usage_tokens if usage_tokens is not None else chunks
    if result.chunk_times and result.output_len > chunks:
        # Chunks that carried several tokens: credit the rest to the last chunk.
        t, n = result.chunk_times[-1]
        result.chunk_times[-1] = (t, n + result.output_len - chunks)
    result.ok = True
    return result


def _percentile(values: list[float], q: float) -> float:
    """numpy's default (linear) percentile."""
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in values_s] or [0.0]
    return {f"mean_{name}_ms": statistics.fmean(ms), f"median_{name}_ms": statistics.median(ms),
            f"std_{name}_ms": statistics.pstdev(ms),
            **{f"p{q}_{name}_ms": _percentile(ms, q) for q in (90, 95, 99)}}


def summarize(cfg: BenchConfig, model: str, results: list[RequestResult], duration_s: float,
              max_in_flight: int, engine: tuple[int, int] | None = None) -> dict[str, Any]:
    """engine: the server's steps and device busy time (us) during the run, if it says."""
    ok = [r for r in results if r.ok]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    dur = max(duration_s, 1e-9)
    tpots = [(r.e2e_s - r.ttft_s) / (r.output_len - 1) for r in ok if r.output_len > 1]
    # Peak output rate: tokens by the whole second (since the start) they arrived in.
    first = min((t for r in ok for t, _ in r.chunk_times), default=0.0)
    per_second: dict[int, int] = {}
    for r in ok:
        for t, n in r.chunk_times:
            per_second[int(t - first)] = per_second.get(int(t - first), 0) + n
    out: dict[str, Any] = {
        "backend": cfg.backend, "dataset_name": "random", "model": model,
        "base_url": cfg.base_url, "num_prompts": cfg.num_prompts,
        "random_input_len": cfg.input_len, "random_output_len": cfg.output_len,
        "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
        "max_concurrency": cfg.max_concurrency, "warmup_requests": cfg.warmup_requests,
        "duration": duration_s, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        # NOTE: prompt tokens the server did not prefill (its prefix cache had them): a second
        # run with the same seed against one server measures mostly this (where reported)
        "total_cached_input_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": len(ok) / dur, "input_throughput": total_in / dur,
        "output_throughput": total_out / dur, "total_throughput": (total_in + total_out) / dur,
        **_stats("e2e_latency", [r.e2e_s for r in ok]),
        **_stats("ttft", [r.ttft_s for r in ok]),
        **_stats("tpot", tpots),
        **_stats("itl", [g for r in ok for g in r.itl_s]),
        # SGLang's "concurrency": the mean number of requests in flight.
        "concurrency": sum(r.e2e_s for r in ok) / dur,
        "max_output_tokens_per_s": float(max(per_second.values(), default=0)),
        "max_concurrent_requests": max_in_flight,
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    if engine is not None:
        # NOTE: arle only. The device's busy share of the run: what is left is time the host
        # side (the engine loop, HTTP, this client) kept the device waiting
        out["server_steps"] = engine[0]
        out["server_device_busy"] = engine[1] / 1e6 / dur
    return out


async def run_bench(cfg: BenchConfig, progress: Callable[[], None] | None = None
                    ) -> dict[str, Any]:
    """Warm up, then send `num_prompts` requests as configured; the summary dict."""
    limit = cfg.max_concurrency or cfg.num_prompts
    limits = httpx.Limits(max_connections=limit + 1, max_keepalive_connections=limit + 1)
    async with httpx.AsyncClient(base_url=cfg.base_url.rstrip("/"), limits=limits,
                                 timeout=httpx.Timeout(cfg.timeout_s, connect=10.0),
                                 headers=_headers(cfg.api_key)) as client:
        model, vocab = await discover(client, cfg)
        shape = REQUEST_SHAPES[cfg.backend]

        async def prompts_of(ids: list[list[int]]) -> list[list[int]] | list[str]:
            return await as_text(client, ids) if shape.chat else ids

        for prompt in await prompts_of(random_prompts(cfg, vocab, cfg.warmup_requests,
                                                      cfg.seed + 1)):
            warm = await one_request(client, model, prompt, min(cfg.output_len, 16), shape,
                                     cfg.input_len)
            if not warm.ok:
                raise ArleError(f"the warm-up request failed: {warm.error}")
        prompts = await prompts_of(random_prompts(cfg, vocab, cfg.num_prompts, cfg.seed))
        gate = asyncio.Semaphore(limit)
        in_flight = _InFlight()
        rng = random.Random(cfg.seed)

        async def send(prompt: list[int] | str) -> RequestResult:
            async with gate:
                with in_flight:
                    r = await one_request(client, model, prompt, cfg.output_len, shape,
                                          cfg.input_len)
            if progress is not None:
                progress()
            return r

        before = await engine_counters(client)
        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.ensure_future(send(prompt)))
            if not math.isinf(cfg.request_rate):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        after = await engine_counters(client) if before is not None else None
    engine = (after[0] - before[0], after[1] - before[1]) if before and after else None
    return summarize(cfg, model, list(results), duration, in_flight.max, engine)


def format_summary(s: dict[str, Any]) -> str:
    """The table printed at the end (SGLang's layout)."""
    rows: list[tuple[str, Any]] = [
        ("Backend", s["backend"]), ("Model", s["model"]),
        ("Traffic request rate", s["request_rate"]),
        ("Max request concurrency", s["max_concurrency"] or "not set"),
        ("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
        ("Benchmark duration (s)", s["duration"]),
        ("Total input tokens", s["total_input_tokens"]),
        ("Input tokens from the prefix cache", s["total_cached_input_tokens"]),
        ("Total generated tokens", s["total_output_tokens"]),
        ("Request throughput (req/s)", s["request_throughput"]),
        ("Input token throughput (tok/s)", s["input_throughput"]),
        ("Output token throughput (tok/s)", s["output_throughput"]),
        ("Peak output token throughput (tok/s)", s["max_output_tokens_per_s"]),
        ("Peak concurrent requests", s["max_concurrent_requests"]),
        ("Total token throughput (tok/s)", s["total_throughput"]),
        ("Concurrency", s["concurrency"]),
    ]
    if "server_steps" in s:
        rows += [("Server steps", s["server_steps"]),
                 ("Server device busy (share of the run)", s["server_device_busy"])]
    lines = ["{:=^56}".format(" Serving Benchmark Result ")]
    for label, value in rows:
        lines.append(f"{label + ':':<42}{_fmt(value):>14}")
    for title, key, short in (("End-to-End Latency", "e2e_latency", "E2E Latency"),
                              ("Time to First Token", "ttft", "TTFT"),
                              ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
                              ("Inter-Token Latency", "itl", "ITL")):
        lines.append("{:-^56}".format(f" {title} "))
        for stat in ("mean", "median", "std", "p90", "p95", "p99"):
            lines.append(f"{f'{stat.capitalize()} {short} (ms):':<42}"
                         f"{_fmt(s[f'{stat}_{key}_ms']):>14}")
    lines.append("=" * 56)
    for err in s["errors"]:
        lines.append(f"error: {err}")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)
