"""`arle complete PROMPT`: one completion, streamed to stdout (or one JSON object with --json).

NOTE: the engine (and with it torch) is imported inside `_generate`, so `arle --help` and the
argument errors stay fast.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import orjson
import typer

from arle.cli.common import arle_command, panel_option, sampling_option
from arle.config import EngineConfig
from arle.engine.request import SamplingParams
from arle.errors import EngineStepError, InvalidRequestError

if TYPE_CHECKING:
    from arle.engine.request import Delta, TokenLogprob

OUTPUT_PANEL = "Prompt and output"



def _output_opt(*decls: str, help: str, **kw: Any) -> Any:
    return panel_option(OUTPUT_PANEL, *decls, help=help, **kw)


@dataclass
class _Result:
    """What the deltas of one request add up to."""

    request_id: str = ""
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    last: Delta | None = None


@arle_command(engine=True, one_request=True)
def complete(
    prompt: Annotated[str, typer.Argument(
        help="The prompt; '-' reads it from stdin.", show_default=False)],
    max_tokens: Annotated[int, sampling_option(
        "--max-tokens", min=1, help="Most tokens to generate.")] = 256,
    temperature: Annotated[float, sampling_option(
        "--temperature", min=0.0,
        help="0 is greedy: a one-shot answer is deterministic unless you ask otherwise.")] = 0.0,
    top_p: Annotated[float | None, sampling_option(
        "--top-p", help="Nucleus sampling mass (default: the model's, else 1).")] = None,
    top_k: Annotated[int | None, sampling_option(
        "--top-k", help="Sample among the k likeliest; 0 disables (default: the model's).")] = None,
    min_p: Annotated[float | None, sampling_option(
        "--min-p", help="Drop tokens below min_p x the top probability.")] = None,
    seed: Annotated[int | None, sampling_option(
        "--seed", help="Seed of this request's sampling (reproducible output).")] = None,
    stop: Annotated[list[str] | None, sampling_option(
        "--stop", help="Stop before this string; repeat for several.")] = None,
    ignore_eos: Annotated[bool, sampling_option(
        "--ignore-eos", help="Go on past the end-of-sequence token.")] = False,
    system: Annotated[str | None, _output_opt(
        "--system", help="A system message (default: the chat template's).")] = None,
    raw: Annotated[bool, _output_opt(
        "--raw", help="No chat template: tokenize the prompt as is.")] = False,
    json_out: Annotated[bool, _output_opt(
        "--json", help="Print one JSON object at the end instead of streaming text.")] = False,
    logprobs: Annotated[int | None, _output_opt(
        "--logprobs", metavar="N", min=0, max=SamplingParams.MAX_LOGPROBS,
        help="With --json: each token's logprob and the top N alternatives.")] = None,
    *,
    config: EngineConfig,
) -> None:
    """Complete PROMPT once and print the answer.

    The answer streams to stdout as it is generated; logs go to stderr.
    """
    text = sys.stdin.read().removesuffix("\n") if prompt == "-" else prompt
    if raw and system is not None:
        raise InvalidRequestError("--system needs the chat template; it cannot go with --raw")
    overrides: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": ignore_eos,
                                 "stop": tuple(stop or ()), "seed": seed, "logprobs": logprobs,
                                 "temperature": temperature}
    # Unset knobs are left out so the model's generation_config defaults apply.
    for name, value in (("top_p", top_p), ("top_k", top_k), ("min_p", min_p)):
        if value is not None:
            overrides[name] = value
    # Bad values fail here, before the model loads.
    SamplingParams(**overrides).validate()

    messages: list[dict[str, Any]] | None = None
    if not raw:
        messages = [{"role": "system", "content": system}] if system is not None else []
        messages.append({"role": "user", "content": text})
    asyncio.run(_generate(config, text if raw else None, messages, overrides, json_out))


async def _generate(config: EngineConfig, prompt: str | None,
                    messages: list[dict[str, Any]] | None, overrides: dict[str, Any],
                    json_out: bool) -> None:
    from arle.engine.build import create_engine  # NOTE: lazy: loads torch
    from arle.engine.request import GenerateRequest

    engine = await create_engine(config)
    try:
        request = GenerateRequest(prompt=prompt, messages=messages,
                                  params=engine.default_params(**overrides),
                                  route="cli.complete", stream=True)
        result = _Result()
        finished = False
        try:
            async for delta in engine.generate(request):
                result.request_id = delta.request_id
                result.last = delta
                if delta.logprobs:
                    result.logprobs.extend(delta.logprobs)
                if delta.text:
                    result.text.append(delta.text)
                    if not json_out:
                        sys.stdout.write(delta.text)
                        sys.stdout.flush()
            finished = True
        finally:
            # End the streamed text with a newline, also when an error cuts it short.
            if not json_out and (finished or result.text):
                sys.stdout.write("\n")
                sys.stdout.flush()
        last = result.last
        if last is not None and (last.error or last.finish_reason == "error"):
            raise EngineStepError(last.error or "generation failed")
        if json_out:
            sys.stdout.write(orjson.dumps(_json_result(result, engine.model_name)).decode() + "\n")
            sys.stdout.flush()
    finally:
        await engine.close()


def _json_result(result: _Result, model: str) -> dict[str, Any]:
    last = result.last
    usage = last.usage if last else None
    trace = (last.trace if last else None) or {}
    out: dict[str, Any] = {
        "text": "".join(result.text),
        "finish_reason": last.finish_reason if last else None,
        "stop_reason": last.stop_reason if last else None,
        "usage": {
            "prompt_tokens": usage.prompt_tokens if usage else 0,
            "completion_tokens": usage.completion_tokens if usage else 0,
            "total_tokens": usage.total_tokens if usage else 0,
            "cached_tokens": usage.cached_tokens if usage else 0,
        },
        "timings": {
            "ttft_ms": trace.get("ttft_ms"),
            "total_ms": trace.get("total_ms"),
            "tokens_per_s": (trace.get("throughput") or {}).get("completion_tokens_per_s_e2e"),
        },
        "model": model,
        "request_id": result.request_id,
    }
    if result.logprobs:
        out["logprobs"] = [
            {"token_id": lp.token_id, "logprob": lp.logprob,
             "top": [{"token_id": t, "logprob": p} for t, p in lp.top]}
            for lp in result.logprobs
        ]
    return out
