"""The `request_trace` record: one per request, from timestamps the engine takes anyway."""

from __future__ import annotations

from typing import Any

from arle.engine.sequence import Sequence


def _per_s(count: int, ms: float) -> float:
    return round(count / (ms / 1e3), 3) if ms > 0 else 0.0


def build_trace(seq: Sequence, *, active: int, waiting: int) -> dict[str, Any]:
    """ARLE's request_trace fields. Step phase times are the wall time of the steps this
    request took part in, by phase: what it waited on, not a share of the batch."""
    t = seq.timeline
    total_ms = (t.finished - t.created) * 1e3
    ttft_ms = (t.first_token - t.created) * 1e3 if t.first_token else None
    completion = seq.num_output
    return {
        "request_id": seq.request_id,
        "route": seq.route,
        "stream": seq.stream,
        "prompt_bytes": seq.prompt_bytes,
        "prompt_tokens": seq.num_prompt,
        "completion_tokens": completion,
        "total_tokens": seq.num_prompt + completion,
        "finish_reason": seq.finish_reason,
        "stop_reason": seq.stop_reason,
        "error": seq.error,
        "ttft_ms": None if ttft_ms is None else round(ttft_ms, 3),
        "total_ms": round(total_ms, 3),
        "throughput": {
            "completion_tokens_per_s_e2e": _per_s(completion, total_ms),
            "prompt_tokens_per_s_at_ttft": _per_s(seq.num_prompt, ttft_ms or 0.0),
            "total_tokens_per_s_e2e": _per_s(seq.num_prompt + completion, total_ms),
        },
        "preprocess": _preprocess(seq),
        "prefix": _prefix(seq),
        "scheduler": _scheduler(seq, active, waiting),
        # speculative decoding: drafts verified, drafts kept, verify steps (None: it drafted
        # nothing, as with --speculative off)
        "spec": seq.spec.trace() if seq.spec is not None else None,
    }


def _preprocess(seq: Sequence) -> dict[str, Any]:
    t = seq.timeline
    wait_us = (t.admitted - t.tokenized) * 1e6 if t.admitted else None
    return {"tokenize_us": round(t.tokenize_us),
            "wait_us": None if wait_us is None else round(wait_us),
            "queue_depth": t.queue_depth}


def _prefix(seq: Sequence) -> dict[str, Any]:
    matched = max(seq.matched_tokens, 0)
    return {"matched_tokens": matched,
            "device_hit_tokens": matched - seq.host_hit_tokens,
            "host_hit_tokens": seq.host_hit_tokens,
            "computed_tokens": seq.num_prompt - matched,
            "resume_prefill_tokens": seq.timeline.prefill_tokens,
            "hit_rate": round(matched / seq.num_prompt, 4) if seq.num_prompt else 0.0,
            "state_restored": seq.state_restored}


def _scheduler(seq: Sequence, active: int, waiting: int) -> dict[str, Any]:
    t = seq.timeline
    phases = {"admission": round(t.admission_us), "prefill": round(t.prefill_us),
              "decode": round(t.decode_us), "emit": round(t.emit_us)}
    phases["total"] = sum(phases.values())
    return {"active": active, "waiting": waiting, "batch_width": t.batch_width,
            "prefill_tokens": t.prefill_tokens, "decode_tokens": t.decode_tokens,
            "preemptions": seq.num_preemptions, "phase_us": phases}
