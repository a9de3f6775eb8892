"""Server metrics: Prometheus text for /metrics and the same numbers as JSON for /v1/stats.

Fed from two places only: each request's final `trace` dict (what the engine logs as
`request_trace`) plus the gaps between its deltas as the server saw them, and
`engine.snapshot()` read at scrape time (running, waiting, KV pages). NOTE: one registry per
server, never prometheus_client's global one, so two servers in one process (tests) do not clash.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from arle.gcwatch import PAUSES

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                1.0, 2.5, 5.0)
PHASES = ("admission", "prefill", "decode", "emit")


class _EngineCollector(Collector):
    """Gauges read from `engine.snapshot()` when scraped."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], prefix_hit_rate: Callable[[], float]
                 ) -> None:
        self._snapshot = snapshot
        self._hit_rate = prefix_hit_rate

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        snap = self._snapshot()
        used = snap["kv_pages_total"] - snap["kv_pages_free"]
        for name, doc, value in (
            ("arle_requests_running", "Requests decoding now.", snap["running"]),
            ("arle_requests_waiting", "Requests waiting for admission.", snap["waiting"]),
            ("arle_kv_pages_total", "KV cache pages in the pool.", snap["kv_pages_total"]),
            ("arle_kv_pages_used", "KV cache pages not on the free list (live or cached).", used),
            ("arle_kv_pages_free", "KV cache pages on the free list.", snap["kv_pages_free"]),
            ("arle_kv_pages_cached", "KV cache pages held by the prefix cache.",
             snap["kv_pages_cached"]),
            ("arle_kv_host_pages_total", "Pages of the host KV tier (--kv-host-cache-gb).",
             snap.get("kv_host_pages_total", 0)),
            ("arle_kv_host_pages_used", "Host KV tier pages holding evicted prefix pages.",
             snap.get("kv_host_pages_total", 0) - snap.get("kv_host_pages_free", 0)),
            ("arle_preemptions", "Requests preempted since start.", snap["preemptions"]),
            ("arle_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / all "
             "prompt tokens, since start.", self._hit_rate()),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        drafted = snap.get("spec_draft_tokens", 0)
        accepted = snap.get("spec_accepted_tokens", 0)
        for name, doc, value in (
            ("arle_spec_draft_tokens", "Draft tokens verified since start (--speculative).",
             drafted),
            ("arle_spec_accepted_tokens", "Draft tokens accepted since start.", accepted),
            ("arle_spec_verify_steps", "Verify rows run since start.",
             snap.get("spec_verify_steps", 0)),
            ("arle_kv_host_offloaded_pages", "KV pages moved to the host tier since start.",
             snap.get("kv_offloaded_pages", 0)),
            ("arle_kv_host_restored_pages", "KV pages copied back from the host tier.",
             snap.get("kv_restored_pages", 0)),
            ("arle_kv_host_copy_bytes", "Bytes the host tier's copies moved, both ways.",
             _tier_bytes(snap)),
            ("arle_kv_host_copy_seconds", "Device time of the host tier's copies.",
             snap.get("kv_host_copy_us", 0) / 1e6),
            ("arle_kv_device_hit_tokens", "Prompt tokens admitted from cached device pages.",
             snap.get("kv_device_hit_tokens", 0)),
            ("arle_kv_host_hit_tokens", "Prompt tokens admitted from host-tier pages.",
             snap.get("kv_host_hit_tokens", 0)),
            ("arle_kv_host_offloaded_snapshots", "Recurrent-state snapshots moved to the host "
             "tier since start (hybrid models).", snap.get("kv_offloaded_snapshots", 0)),
            ("arle_kv_host_snapshot_hits", "Requests that started from a host-tier snapshot.",
             snap.get("kv_host_snapshot_hits", 0)),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily("arle_spec_acceptance_rate", "Accepted / verified draft tokens "
                                "since start (0: none verified).",
                                value=accepted / drafted if drafted else 0.0)
        seconds = snap.get("kv_host_copy_us", 0) / 1e6
        yield GaugeMetricFamily("arle_kv_host_copy_bandwidth_bytes", "The host tier's copies: "
                                "bytes moved per second of their device time, since start "
                                "(0: none).", value=_tier_bytes(snap) / seconds if seconds else 0.0)


def _tier_bytes(snap: dict[str, Any]) -> float:
    """Bytes the host KV tier's copies moved since start, both ways."""
    pages = snap.get("kv_offloaded_pages", 0) + snap.get("kv_restored_pages", 0)
    return float(pages * snap.get("kv_host_page_bytes", 0))


class _GCCollector(Collector):
    """The cyclic GC's pauses (`arle.gcwatch.PAUSES`), read when scraped: each one stopped the
    event loop, and every request with it."""

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        total = CounterMetricFamily("arle_gc_pause_seconds", "Time the cyclic garbage collector "
                                    "held the process, by generation, since serving began.",
                                    labels=["generation"])
        count = CounterMetricFamily("arle_gc_collections", "Collections by generation since "
                                    "serving began.", labels=["generation"])
        longest = GaugeMetricFamily("arle_gc_pause_max_seconds", "The longest collection by "
                                    "generation since serving began.", labels=["generation"])
        for g in range(3):
            total.add_metric([str(g)], PAUSES.total_s[g])
            count.add_metric([str(g)], PAUSES.count[g])
            longest.add_metric([str(g)], PAUSES.max_s[g])
        yield from (total, count, longest)


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.started = time.time()
        self._snapshot = snapshot
        r = self.registry = CollectorRegistry()
        self.requests = Counter("arle_requests", "Finished requests.",
                                ["route", "finish_reason"], registry=r)
        self.http_errors = Counter("arle_http_errors", "Requests answered with an error status.",
                                   ["route", "status"], registry=r)
        self.prompt_tokens = Counter("arle_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=r)
        self.cached_tokens = Counter("arle_prompt_cached_tokens",
                                     "Prompt tokens served from the prefix cache.", registry=r)
        self.generation_tokens = Counter("arle_generation_tokens", "Generated tokens.",
                                         registry=r)
        self.phase_seconds = Counter(
            "arle_step_phase_seconds", "Wall time of engine step phases, summed over requests "
            "(the steps each request took part in).", ["phase"], registry=r)
        self.ttft = Histogram("arle_time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("arle_inter_token_latency_seconds",
                             "Gap between two consecutive outputs of a request.",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("arle_e2e_request_latency_seconds", "Request latency, end to end.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(snapshot, self.prefix_hit_rate))
        r.register(_GCCollector())
        self._prompt_sum = self._cached_sum = 0

    # ---- feeding ----------------------------------------------------------------------------
    def observe_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_finished(self, trace: dict[str, Any] | None) -> None:
        if not trace:
            return
        self.requests.labels(trace.get("route") or "engine",
                             trace.get("finish_reason") or "unknown").inc()
        prompt = trace.get("prompt_tokens") or 0
        cached = (trace.get("prefix") or {}).get("matched_tokens") or 0
        self._prompt_sum += prompt
        self._cached_sum += cached
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self.generation_tokens.inc(trace.get("completion_tokens") or 0)
        if trace.get("ttft_ms") is not None:
            self.ttft.observe(trace["ttft_ms"] / 1e3)
        if trace.get("total_ms") is not None:
            self.e2e.observe(trace["total_ms"] / 1e3)
        phases = ((trace.get("scheduler") or {}).get("phase_us") or {})
        for phase in PHASES:
            self.phase_seconds.labels(phase).inc((phases.get(phase) or 0) / 1e6)

    def observe_http_error(self, route: str, status: int) -> None:
        self.http_errors.labels(route, str(status)).inc()

    # ---- reading ----------------------------------------------------------------------------
    def prefix_hit_rate(self) -> float:
        return self._cached_sum / self._prompt_sum if self._prompt_sum else 0.0

    def prometheus_text(self) -> bytes:
        return generate_latest(self.registry)

    def stats(self) -> dict[str, Any]:
        """/v1/stats: the samples of /metrics as one JSON object (histograms as count, sum,
        mean), plus the engine snapshot as it is."""
        out: dict[str, Any] = {"uptime_s": round(time.time() - self.started, 3),
                               "engine": self._snapshot(),
                               # the cyclic GC: objects `arle serve` froze after start-up,
                               # full passes (generation 2) in the process's life, and the
                               # pauses of every generation since serving began
                               "gc": {"frozen_objects": gc.get_freeze_count(),
                                      "full_collections": gc.get_stats()[2]["collections"],
                                      "pauses": PAUSES.summary()}}
        for family in self.registry.collect():
            if family.type == "histogram":
                count = total = 0.0
                for s in family.samples:
                    if s.name.endswith("_count"):
                        count = s.value
                    elif s.name.endswith("_sum"):
                        total = s.value
                out[family.name] = {"count": int(count), "sum": total,
                                    "mean": total / count if count else None}
                continue
            samples = [s for s in family.samples if not s.name.endswith("_created")]
            if len(samples) == 1 and not samples[0].labels:
                out[family.name] = samples[0].value
            else:
                out[family.name] = [{**s.labels, "value": s.value} for s in samples]
        return out
