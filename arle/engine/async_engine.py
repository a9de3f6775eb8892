"""AsyncEngine: requests in, deltas out. One asyncio task runs the step loop.

Front ends (CLI, server, chat) talk to it through `generate()` and `abort()`, and read
`kv_pool`, `limits`, `state_pool()`, `snapshot()` and `model_info`; `arle.engine.build` makes
it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from arle.config import EngineConfig
from arle.engine.cache import CacheManager
from arle.engine.grammar import GrammarCompiler
from arle.engine.output import IncrementalDetokenizer, StopStringMatcher
from arle.engine.request import Delta, GenerateRequest, SamplingParams, TokenLogprob, Usage
from arle.engine.scheduler import Scheduler, SchedulerConfig
from arle.engine.sequence import Sequence, Status, Timeline
from arle.engine.speculative import accepted_drafts, make_drafter
from arle.engine.trace import build_trace
from arle.errors import ArleError, InvalidRequestError, OverloadedError
from arle.executor.base import Executor, KVPoolInfo, StepOutput
from arle.executor.plan import Row, StepPlan
from arle.logging import get_logger
from arle.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    pass

log = get_logger("arle.engine")


@dataclass
class _OutputState:
    detok: IncrementalDetokenizer
    stops: StopStringMatcher | None


def state_pool_info(executor: Executor) -> dict[str, Any] | None:
    """The executor's recurrent-state pool: slots, snapshots, bytes (None: no such pool)."""
    state = executor.state
    if state is None:
        return None
    return {"slots": executor.num_slots, "snapshots": executor.num_snapshots,
            "slot_bytes": state.slot_bytes, "bytes": state.nbytes}


def text_chars(prompt: object, messages: list[dict[str, Any]] | None) -> int:
    """The characters of a request's text: a text prompt's, or the messages' contents (text
    parts included); a token-id prompt has none."""
    if isinstance(prompt, str):
        return len(prompt)
    total = 0
    for m in messages or ():
        content = m.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p["text"]) for p in content
                         if isinstance(p, dict) and isinstance(p.get("text"), str))
    return total


#: why a request ends: (finish_reason, stop_reason)
_End = tuple[str, str | int]


def _text_and_end(seq: Sequence, token: int) -> tuple[str, _End | None]:
    """The text a new output token adds, and why the request ends with it (None: it goes
    on). At the end, what was held back comes out too (an incomplete UTF-8 tail, a partial
    stop string)."""
    state: _OutputState = seq.output_state
    params = seq.params
    end: _End | None = None
    text, matched = "", None
    if token in seq.eos_ids:
        end = ("stop", "eos")
    elif token in params.stop_token_ids:
        end = ("stop", token)
    else:
        text = state.detok.push([token])
        if state.stops is not None and text:
            text, matched = state.stops.feed(text)
            if matched is not None:
                end = ("stop", matched)
    if end is None:
        if seq.num_output >= params.max_tokens:
            end = ("length", "max_tokens")
        elif len(seq.tokens) >= seq.max_total_tokens:
            end = ("length", "context")
    if end is None or matched is not None:
        return text, end
    tail = state.detok.flush()
    if state.stops is None:
        return text + tail, end
    more, matched = state.stops.feed(tail)
    if matched is not None:
        return text + more, ("stop", matched)
    return text + more + state.stops.flush(), end


def _account(tl: Timeline, row: Row, exec_us: float, width: int, admission_us: float) -> None:
    """A step's time and tokens into its request's timeline, by phase."""
    tl.batch_width = max(tl.batch_width, width)
    if row.is_prefill:
        tl.prefill_us += exec_us
        tl.prefill_tokens += row.num_tokens
    else:
        tl.decode_us += exec_us
        tl.decode_tokens += row.num_tokens
    tl.admission_us += admission_us


class AsyncEngine:
    """Continuous batching over a paged KV cache, with the executor overlapped (see `_loop`)."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, executor: Executor,
                 model_name: str, max_model_len: int,
                 generation_defaults: dict[str, Any] | None = None,
                 model_info: dict[str, Any] | None = None, moe: bool = False) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.executor = executor
        self.model_name = model_name
        self.model_info = model_info or {}
        self.generation_defaults = generation_defaults or {}
        pool = executor.kv_pool
        # NOTE: a request never needs more pages than the pool has, so admission cannot deadlock.
        self.max_model_len = min(max_model_len, pool.num_tokens - 1)
        self.cache = CacheManager(pool.num_pages, pool.page_size, executor.num_slots,
                                  config.enable_prefix_cache, hybrid=executor.state is not None,
                                  num_snapshots=executor.num_snapshots,
                                  host_pages=pool.host_pages,
                                  host_snapshots=pool.host_snapshots)
        # NOTE: the device defaults are filled in already (`EngineConfig.for_device`).
        assert config.max_running_requests is not None and config.max_batched_tokens is not None
        assert config.chunked_prefill_size is not None
        self.scheduler = Scheduler(SchedulerConfig(
            max_running_requests=min(config.max_running_requests, executor.num_slots),
            max_batched_tokens=config.max_batched_tokens,
            chunked_prefill_size=min(config.chunked_prefill_size, config.max_batched_tokens),
            max_waiting_requests=config.max_waiting_requests,
            overlap_restores=executor.overlaps_restores), self.cache,
            drafter=make_drafter(config, hybrid=executor.state is not None, moe=moe))
        self._requests: dict[str, Sequence] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._closed = False
        #: Requests past the waiting bound's check and not yet in the scheduler's queue.
        self._admitting = 0
        self._ids = itertools.count()
        self.stats: collections.Counter[str] = collections.Counter()
        self.grammars = GrammarCompiler(tokenizer, self.model_info.get("vocab_size", 0))
        log.info("scheduler_settings", max_running_requests=self.scheduler.config.max_running_requests,
                 max_batched_tokens=config.max_batched_tokens,
                 chunked_prefill_size=self.scheduler.config.chunked_prefill_size,
                 max_waiting_requests=config.max_waiting_requests,
                 max_model_len=self.max_model_len, page_size=pool.page_size,
                 prefix_cache=config.enable_prefix_cache, overlap=config.overlap,
                 speculative=self.speculation())

    def default_params(self, **overrides: Any) -> SamplingParams:
        """SamplingParams from the model's generation_config, then the caller's non-None values."""
        names = {f.name for f in fields(SamplingParams)}
        base = {k: v for k, v in self.generation_defaults.items()
                if k in names and k != "max_tokens" and v is not None}
        base.update({k: v for k, v in overrides.items() if v is not None})
        for key in ("stop", "stop_token_ids"):
            if key in base and not isinstance(base[key], tuple):
                base[key] = tuple(base[key])
        return SamplingParams(**base)

    # ---- the public surface -----------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[Delta]:
        """Yield deltas until one has finish_reason. Raises InvalidRequestError before any
        output for a bad request and OverloadedError when the waiting queue is full.
        Cancelling the consumer (or closing this iterator) aborts the request."""
        self._check_request(request)
        seq = await self._enqueue(request)
        try:
            while True:
                item = await seq.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if not seq.finished:
                self.abort(seq.request_id)

    def _check_request(self, request: GenerateRequest) -> None:
        """What can be refused before any work: a closed engine, bad parameters, a full queue."""
        if self._closed:
            raise ArleError("the engine is shut down")
        request.params.validate()
        if request.params.prompt_logprobs is not None and self.config.tensor_parallel_size > 1:
            # NOTE: each rank holds a slice of the vocabulary: scoring would need the gather
            # that only the sampled rows get
            raise InvalidRequestError("prompt logprobs (echo) are not supported with "
                                      "--tensor-parallel-size > 1", param="echo")
        self.check_text_fits(request.prompt, request.messages)
        self.check_admission()

    def check_text_fits(self, prompt: object, messages: list[dict[str, Any]] | None) -> None:
        """Refuse, before tokenizing it, a text too long for the context whatever its tokens
        (`Tokenizer.min_tokens`)."""
        chars = text_chars(prompt, messages)
        least = self.tokenizer.min_tokens(chars)
        if least >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt's {chars} characters are at least {least} tokens, but the context "
                f"is {self.max_model_len} tokens",
                param="prompt" if messages is None else "messages")

    async def _enqueue(self, request: GenerateRequest) -> Sequence:
        """Tokenize the prompt and compile its grammar off the loop, check them, and queue
        the request for the scheduler."""
        # NOTE: a request counts as waiting from here, through its tokenization (a thread hop
        # during which others arrive), until it is in the scheduler's queue: the bound holds
        # under any burst.
        self._admitting += 1
        try:
            t_created = time.perf_counter()
            ids, nbytes = await asyncio.to_thread(self._tokenize, request)
            matcher = (await asyncio.to_thread(self.grammars.matcher, request.grammar)
                       if request.grammar is not None else None)
            t_tok = time.perf_counter()
            self._check_prompt(ids, request)
            rid = request.request_id or f"req-{uuid.uuid4().hex[:12]}"
            if rid in self._requests:
                raise InvalidRequestError(f"request id {rid!r} is already running",
                                          param="request_id")
            if self._closed:
                raise ArleError("the engine is shut down")
        finally:
            self._admitting -= 1
        seq = self._new_sequence(request, rid, ids, nbytes, matcher)
        seq.timeline.created, seq.timeline.tokenized = t_created, t_tok
        seq.timeline.tokenize_us = (t_tok - t_created) * 1e6
        self._requests[rid] = seq
        self.scheduler.add(seq)
        self._ensure_loop()
        self._wake.set()
        return seq

    def _new_sequence(self, request: GenerateRequest, rid: str, ids: list[int], nbytes: int,
                      matcher: Any) -> Sequence:
        params = request.params
        seq = Sequence(request_id=rid, prompt_ids=ids, params=params,
                       max_total_tokens=self.max_model_len,
                       # NOTE: a grammar ends at EOS whatever ignore_eos says: the mask allows it
                       # only where the output is complete
                       eos_ids=(frozenset() if params.ignore_eos and matcher is None
                                else self.tokenizer.eos_token_ids),
                       route=request.route, stream=request.stream, prompt_bytes=nbytes,
                       grammar=matcher)
        drafter = self.scheduler.drafter
        # NOTE: penalties count every sampled token and a grammar advances on each: their
        # rows never verify drafts
        if drafter is not None and matcher is None and not params.has_penalties:
            seq.spec = drafter.start()
        seq.timeline.queue_depth = len(self.scheduler.waiting)
        seq.output_state = _OutputState(
            IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
            StopStringMatcher(params.stop) if params.stop else None)
        return seq

    def check_admission(self) -> None:
        """Raise OverloadedError when the waiting bound is reached. `generate()` checks it; a
        front end may check it first, before it reads and parses a request it must refuse."""
        waiting = len(self.scheduler.waiting) + self._admitting
        if waiting >= self.scheduler.config.max_waiting_requests:
            self.stats["rejected_overloaded"] += 1
            raise OverloadedError(
                f"server overloaded: {waiting} requests waiting "
                f"(max_waiting_requests={self.scheduler.config.max_waiting_requests})")

    def _check_prompt(self, ids: list[int], request: GenerateRequest) -> None:
        """Refuse a prompt that is empty, holds unknown ids, or leaves no room to generate."""
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens but the context is {self.max_model_len} tokens "
                f"(it must leave room for at least one new token)", param="prompt")
        if any(not 0 <= t < self.tokenizer.vocab_size for t in ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.tokenizer.vocab_size})",
                                      param="prompt")
        room = self.max_model_len - len(ids)
        if request.strict_max_tokens and request.params.max_tokens > room:
            raise InvalidRequestError(
                f"max_tokens is {request.params.max_tokens} but the prompt has {len(ids)} tokens "
                f"and the context is {self.max_model_len} tokens: at most {room} new tokens fit",
                param="max_tokens")

    def abort(self, request_id: str, error: str | None = None) -> bool:
        """Stop a request now; its pages return at once. False if it is not running.
        With `error`, the request ends with it (its trace is logged as a warning): the caller
        ended it, not the client."""
        seq = self._requests.get(request_id)
        if seq is None or seq.finished:
            return False
        self._finish(seq, "abort", "abort", error=error)
        return True

    def abort_all(self, error: str) -> int:
        """Abort every request (running and waiting) with `error`; how many there were."""
        return sum(self.abort(rid, error) for rid in list(self._requests))

    async def close(self) -> None:
        """Abort everything, stop the loop and the executor."""
        self._closed = True
        for rid in list(self._requests):
            self.abort(rid)
        if self._loop_task is not None:
            self._wake.set()
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._loop_task
            self._loop_task = None
        await asyncio.to_thread(self.executor.close)

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- what front ends and diagnostics read ----------------------------------------------
    @property
    def kv_pool(self) -> KVPoolInfo:
        """The KV pool's pages, page size, bytes and format."""
        return self.executor.kv_pool

    @property
    def limits(self) -> SchedulerConfig:
        """The scheduling limits in force (the config's, resolved for the device)."""
        return self.scheduler.config

    def speculation(self) -> dict[str, Any] | None:
        """The drafter and its rule in force (None: speculation off)."""
        d = self.scheduler.drafter
        if d is None:
            return None
        return {"method": self.config.speculative, **asdict(d.config)}

    def state_pool(self) -> dict[str, Any] | None:
        """A hybrid model's recurrent-state pool (None: no Gated DeltaNet layers)."""
        return state_pool_info(self.executor)

    def snapshot(self) -> dict[str, Any]:
        """Live numbers for /v1/stats, /metrics and `arle chat`'s /stats."""
        c = self.cache
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_pages_total": c.num_pages,
            "kv_pages_free": c.pages.num_free,
            "kv_pages_cached": c.radix.num_pages,
            "kv_pages_evictable": c.radix.num_evictable,
            "kv_host_pages_total": c.num_host_pages,
            "kv_host_pages_free": c.host.num_free,
            "kv_host_page_bytes": (self.executor.kv_pool.host_bytes // c.num_host_pages
                                   if c.num_host_pages else 0),
            **{f"kv_{k}": v for k, v in c.stats.items()},
            "preemptions": self.scheduler.num_preemptions,
            **self.stats,
        }

    # ---- the loop ---------------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._loop(),
                                                                     name="arle-engine-loop")

    async def _loop(self) -> None:
        """Run the steps. NOTE: a step's errors fail that step's requests (`_fail_step`); an
        error anywhere else in the loop is a bug of ours: it fails every request, logged,
        rather than leave them waiting on a loop that is gone (the next request starts a new
        one)."""
        try:
            await self._steps()
        except Exception as e:
            log.exception("engine_loop_failed", error=repr(e), requests=len(self._requests))
            for seq in list(self._requests.values()):
                if not seq.finished:
                    self._finish(seq, "error", None, error=f"engine loop failed: {e!r}")

    async def _steps(self) -> None:
        """Schedule step N+1 while step N runs; then process step N's output.

        NOTE: with overlap, step N+1 is planned before step N's tokens are known: a request that
        finishes at step N still has a row in N+1, whose output is dropped (see _process).
        """
        inflight: collections.deque[tuple[StepPlan, asyncio.Future[StepOutput]]] = (
            collections.deque())
        overlap = 2 if self.config.overlap else 1
        while not self._closed:
            # NOTE: a request about to draft needs its last token: the next step waits for
            # the one in flight (and a verify step's kept states are restored before any
            # later step writes them)
            depth = 1 if inflight and self.scheduler.wants_step_back() else overlap
            plan = self.scheduler.schedule() if len(inflight) < depth else None
            if plan is not None:
                try:
                    inflight.append((plan, asyncio.ensure_future(self.executor.launch(plan))))
                except Exception as e:  # a bad plan fails its own requests only
                    self._fail_step(plan, e)
                    continue
                if len(inflight) < depth and self.scheduler.has_work():
                    continue
            if inflight:
                done_plan, handle = inflight.popleft()
                try:
                    out = await handle
                except Exception as e:
                    self._fail_step(done_plan, e)
                    continue
                self._process(done_plan, out)
            elif plan is None:
                self._wake.clear()
                if not self.scheduler.has_work():
                    await self._wake.wait()
                else:  # work that cannot be scheduled yet: wait for news, never spin
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), 0.05)

    def _process(self, plan: StepPlan, out: StepOutput) -> None:
        exec_us = out.exec_s * 1e6
        # NOTE: the device's busy time over the server's life: against a run's wall time, what
        # the host (scheduling, HTTP, the client) left the device idle (`arle bench` reports it)
        self.stats["steps"] += 1
        self.stats["device_us"] += round(exec_us)
        self.stats["kv_host_copy_us"] += round(out.copy_s * 1e6)
        admitted = {ns.slot for ns in plan.new_slots}
        k = scored = chained = 0
        for row in plan.rows:
            seq: Sequence = row.owner
            seq.num_inflight -= 1
            _account(seq.timeline, row, exec_us, len(plan.rows),
                     plan.schedule_us if row.slot in admitted else 0.0)
            if row.score_targets:
                if seq.prompt_scores is not None:
                    seq.prompt_scores.extend(out.prompt_scores[scored])
                scored += 1
            n = row.num_samples
            if not n:
                continue
            tokens = out.token_ids[k:k + n]
            lps: list[TokenLogprob | None] = (out.logprobs[k:k + n] if out.logprobs
                                              else [None] * n)
            k += n
            if row.mtp_drafts:
                chained += 1
                if seq.spec is not None:
                    seq.spec.next_drafts = out.drafts[chained - 1]
            if seq.finished:
                continue  # the extra step of a request that finished one step earlier
            if row.spec:
                tokens = tokens[:self._verified(seq, row, tokens) + 1]
            self._emit(seq, tokens, lps)

    def _emit(self, seq: Sequence, tokens: list[int], lps: list[TokenLogprob | None]) -> None:
        """A row's new tokens, in order, until one ends the request."""
        t1 = time.perf_counter()
        for token, lp in zip(tokens, lps, strict=False):
            try:
                self._on_token(seq, token, lp)
            except Exception as e:  # NOTE: one request's output that cannot be processed (an
                # id its detokenizer rejects) fails that request only; raised here it would end
                # the loop, and every request would wait forever
                if not seq.finished:
                    self._finish(seq, "error", None, error=f"token {token}: {e!r}")
            if seq.finished:
                break
        seq.timeline.emit_us += (time.perf_counter() - t1) * 1e6

    def _verified(self, seq: Sequence, row: Row, sampled: list[int]) -> int:
        """A verify row's outcome: how many of its drafts it keeps (the positions past them go
        back before any token is emitted: a request that ends in the run releases only K/V
        of accepted tokens)."""
        assert row.input_ids is not None
        accepted = accepted_drafts(row.input_ids[-row.spec:], sampled)
        self.scheduler.verified(seq, row, accepted)
        self.stats["spec_verify_steps"] += 1
        self.stats["spec_draft_tokens"] += row.spec
        self.stats["spec_accepted_tokens"] += accepted
        return accepted

    def _on_token(self, seq: Sequence, token: int, lp: TokenLogprob | None) -> None:
        seq.tokens.append(token)
        if not seq.timeline.first_token:
            seq.timeline.first_token = time.perf_counter()
        self.stats["generated_tokens"] += 1
        text, reason = _text_and_end(seq, token)
        delta = Delta(seq.request_id, text, [token], [lp] if lp is not None else None,
                      usage=Usage(seq.num_prompt, seq.num_output, max(seq.matched_tokens, 0)))
        if seq.prompt_scores is not None:
            delta.prompt_logprobs = [None, *seq.prompt_scores]
            delta.prompt_token_ids = seq.prompt_ids
            seq.prompt_scores = None
        if reason is None:
            seq.queue.put_nowait(delta)
        else:
            self._finish(seq, reason[0], reason[1], delta)

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None,
                delta: Delta | None = None, error: str | None = None) -> None:
        """Mark finished, give its memory back, emit the last delta and the trace."""
        seq.status = Status.FINISHED
        seq.finish_reason = reason  # type: ignore[assignment]
        seq.stop_reason = stop_reason
        seq.error = error
        seq.timeline.finished = time.perf_counter()
        self.scheduler.remove(seq)
        self._requests.pop(seq.request_id, None)
        self.stats[f"finished_{reason}"] += 1
        trace = build_trace(seq, active=len(self.scheduler.running),
                            waiting=len(self.scheduler.waiting))
        if error is not None and reason == "abort":
            log.warning("request_trace", **trace)
        elif error is not None:
            log.error("request_trace", **trace)
        else:
            log.info("request_trace", **trace)
        delta = delta or Delta(seq.request_id)
        delta.finish_reason = reason  # type: ignore[assignment]
        delta.stop_reason = stop_reason
        delta.error = error
        delta.usage = Usage(seq.num_prompt, seq.num_output, max(seq.matched_tokens, 0))
        delta.trace = trace
        seq.queue.put_nowait(delta)

    def _fail_step(self, plan: StepPlan, exc: BaseException) -> None:
        """A step failed: its requests fail with the error; the engine goes on."""
        log.error("step_failed", step=plan.step_id, error=repr(exc), rows=len(plan.rows))
        for row in plan.rows:
            seq: Sequence = row.owner
            seq.num_inflight -= 1
            if not seq.finished:
                self._finish(seq, "error", None, error=f"engine step failed: {exc!r}")

    # ---- tokenization (worker thread) --------------------------------------------------------
    def _tokenize(self, request: GenerateRequest) -> tuple[list[int], int]:
        if (request.prompt is None) == (request.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")
        if request.messages is not None:
            # NOTE: special tokens' text inside message content stays text (encode_chat); a
            # raw text prompt is the caller's to shape, special tokens included.
            extra = {} if request.tools is None else {"tools": request.tools}
            ids, text = self.tokenizer.encode_chat(request.messages, add_generation_prompt=True,
                                                   **extra)
            return ids, len(text.encode())
        if isinstance(request.prompt, str):
            return (self.tokenizer.encode(request.prompt, request.add_special_tokens),
                    len(request.prompt.encode()))
        ids = list(request.prompt)  # type: ignore[arg-type]
        if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
            raise InvalidRequestError("prompt token ids must be integers", param="prompt")
        return ids, 0

