"""Prometheus metrics for one app: engine state read at scrape time plus per-request latencies.

Each app owns its `CollectorRegistry` so that several servers (tests) in one process do not
share series.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.outputs import RequestOutput

PREFIX = "mla_serve"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector:
    """Reads `engine.stats()` when Prometheus scrapes, so gauges are never stale."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def collect(self):
        s = self._engine.stats()
        gauges = [
            ("num_requests_running", "Requests in the running batch", s.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled", s.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1)", s.kv_cache_usage),
            ("kv_cache_blocks_total", "KV cache blocks in the pool", s.num_total_blocks),
            ("kv_cache_blocks_used", "KV cache blocks held by requests",
             s.num_total_blocks - s.num_free_blocks),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(f"{PREFIX}_{name}", doc)
            g.add_metric([], float(value))
            yield g
        counters = [
            ("prompt_tokens", "Prompt tokens processed", s.prompt_tokens_total),
            ("generation_tokens", "Tokens generated", s.generation_tokens_total),
            ("num_preemptions", "Requests preempted to free KV blocks", s.num_preemptions),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
             s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache", s.prefix_cache_hits),
        ]
        for name, doc, value in counters:
            c = CounterMetricFamily(f"{PREFIX}_{name}", doc)
            c.add_metric([], float(value))
            yield c


class ServerMetrics:
    """Registry of one app: engine gauges/counters and HTTP-side latency histograms."""

    def __init__(self, engine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                              "Time from request arrival to its first generated token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds",
                             "Time between successive engine outputs of a request, per token",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds",
                             "Time from request arrival to its last token",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.success = Counter(f"{PREFIX}_request_success", "Finished choices by finish reason",
                               ["finished_reason"], registry=self.registry)

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Latency bookkeeping of one HTTP request (possibly several engine requests)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics
        self._arrival = time.perf_counter()
        self._last: dict[int, float] = {}  # prompt index -> time of its previous output
        self._finished_choices = 0
        self._closed = False

    def observe(self, prompt_idx: int, out: RequestOutput) -> None:
        """Record one engine output of prompt `prompt_idx`."""
        now = time.perf_counter()
        new_tokens = max((len(o.delta_token_ids) for o in out.outputs), default=0)
        if new_tokens:
            prev = self._last.get(prompt_idx)
            if prev is None:
                self._m.ttft.observe(now - self._arrival)
            else:
                per_token = (now - prev) / new_tokens
                for _ in range(new_tokens):
                    self._m.itl.observe(per_token)
            self._last[prompt_idx] = now
        if out.finished:
            self._m.e2e.observe(now - self._arrival)
            for o in out.outputs:
                self._m.success.labels(finished_reason=o.finish_reason or "unknown").inc()
                self._finished_choices += 1

    def close(self, num_choices: int) -> None:
        """The HTTP request is over: its choices that never finished (client gone, fault) were
        aborted and count as finished_reason="abort"."""
        if self._closed:
            return
        self._closed = True
        aborted = num_choices - self._finished_choices
        if aborted > 0:
            self._m.success.labels(finished_reason="abort").inc(aborted)
