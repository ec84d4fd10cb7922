"""Prometheus metrics for one app: engine state read at scrape time plus per-request latencies.

Each app owns its `CollectorRegistry` so that several servers (tests) in one process do not
share series. Every series is exported twice: under our own `mla_serve_` names, and under the
names vLLM's V1 engine exports (`vllm:num_requests_running`, `vllm:time_to_first_token_seconds`,
...), labelled as vLLM labels them, `model_name` (the served model name) and `engine` (the DP rank:
"0" without -dp; under -dp one series per rank, a request's under the rank that ran it), so that
dashboards and autoscalers written for vLLM read this server unchanged. `vllm:request_queue_time_seconds`
(time from arrival in the engine to first admission) and the per-request phase and size
histograms (`vllm:request_prefill_time_seconds`, ..., `vllm:request_prompt_tokens`,
`vllm:request_max_num_generation_tokens`) exist under vLLM's names only, and so does
`vllm:gpu_cache_usage_perc`, vLLM's older name of the KV cache usage that its example Grafana
dashboard still queries.

Per-request phases are timed on the front end, per choice, as vLLM times each engine request:
admission = arrival + the engine's queue time; prefill = admission to first token; decode =
first to last token; inference = admission to last token.

The prompt token counter counts as vLLM counts it, in the engine core: a request's prompt when its
first output comes (each choice of an n > 1 request). vLLM's generated token counter counts here, on
the front end, the tokens each choice returns, as vLLM's output processor does: the engine core
samples a token or two past the one that completed a stop string (the front end matches stop
strings), which our own `mla_serve_generation_tokens_total` (the engine's work) still counts.

Under --api-server-count N (server/api_servers.py) each API server process counts its own requests
in prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR, set before the process imports
it), and /metrics, whichever process answers, sums every process's counters and histograms; the
engine's gauges and counters come with every core message to every process, so each reads them
itself.
"""

from __future__ import annotations

import gzip
import os
import time

from prometheus_client import (GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, Counter,
                               Histogram, generate_latest)
from prometheus_client.exposition import choose_encoder
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from engine.outputs import RequestOutput

PREFIX = "mla_serve"
VLLM = "vllm:"
LABELS = ["model_name", "engine"]  # of every vLLM series, as vLLM labels them
FINISH_REASONS = ("stop", "length", "abort", "error")
# our own (mla_serve_) latency histograms: fine steps from 1 ms, for a decode's few-ms tokens
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# vLLM's bucket boundaries for its series (vllm/v1/metrics), so that dashboards' and alerts' `le`
# values match: time to first token; inter-token latency and time per output token; and the
# request latencies (end to end, queue, prefill, decode, inference)
_VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                      5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                     7.5, 10.0, 20.0, 40.0, 80.0)
_PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                  60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's buckets of per-request token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


class _EngineCollector:
    """Reads `engine.stats()` when Prometheus scrapes, so gauges are never stale."""

    def __init__(self, engine, model_name: str) -> None:
        self._engine = engine
        self._model_name = model_name

    def collect(self):
        s = self._engine.stats()
        engines = getattr(s, "per_engine", None) or [s]  # vLLM's series: one per DP rank
        # (our name, vLLM's name or None, help, the value from the engine's or a DP rank's stats)
        gauges = [
            ("num_requests_running", "num_requests_running", "Requests in the running batch",
             lambda e: e.num_running),
            ("num_requests_waiting", "num_requests_waiting", "Requests waiting to be scheduled",
             lambda e: e.num_waiting),
            ("kv_cache_usage_perc", "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1)",
             lambda e: e.kv_cache_usage),
            # vLLM's older name of the same gauge, which its example Grafana dashboard queries
            (None, "gpu_cache_usage_perc", "Fraction of KV cache blocks in use (0..1)",
             lambda e: e.kv_cache_usage),
            ("kv_cache_blocks_total", None, "KV cache blocks in the pool", lambda e: e.num_total_blocks),
            ("kv_cache_blocks_used", None, "KV cache blocks held by requests",
             lambda e: e.num_total_blocks - e.num_free_blocks),
        ]
        counters = [
            ("prompt_tokens", "prompt_tokens", "Prompt tokens processed", lambda e: e.prompt_tokens_total),
            # vLLM's generation_tokens is the front end's count (ServerMetrics.generated): ours is the
            # engine's, which also counts tokens sampled after a stop string ended the choice
            ("generation_tokens", None, "Tokens the engine generated", lambda e: e.generation_tokens_total),
            ("num_preemptions", "num_preemptions", "Requests preempted to free KV blocks",
             lambda e: e.num_preemptions),
            ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
             lambda e: e.prefix_cache_queries),
            ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache",
             lambda e: e.prefix_cache_hits),
            # vLLM's older names of the same two (deprecated there, still exported by 0.10)
            (None, "gpu_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
             lambda e: e.prefix_cache_queries),
            (None, "gpu_prefix_cache_hits", "Prompt tokens found in the prefix cache",
             lambda e: e.prefix_cache_hits),
        ]
        for family, rows in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, vllm_name, doc, value in rows:
                if name is not None:
                    m = family(f"{PREFIX}_{name}", doc)
                    m.add_metric([], float(value(s)))
                    yield m
                if vllm_name is not None:
                    m = family(f"{VLLM}{vllm_name}", doc, labels=LABELS)
                    for e in engines:
                        m.add_metric(self._labels(e), float(value(e)))
                    yield m
        if getattr(s, "spec", None) is not None:
            yield from self._spec_decode(s, engines)
        if getattr(s, "iteration_tokens", None) is not None:
            m = HistogramMetricFamily(f"{VLLM}iteration_tokens_total",
                                      "Tokens scheduled per engine step", labels=LABELS)
            for e in engines:
                bounds, counts, total = e.iteration_tokens
                cumulative, acc = [], 0
                for bound, count in zip([*(str(float(b)) for b in bounds), "+Inf"], counts):
                    acc += count
                    cumulative.append((bound, acc))
                m.add_metric(self._labels(e), cumulative, sum_value=total)
            yield m
        infos = [self._cache_config(e) for e in engines]
        if infos[0] is not None:
            m = GaugeMetricFamily(f"{VLLM}cache_config_info", "Information of the KV cache's configuration",
                                  labels=list(infos[0]))
            for info in infos:
                m.add_metric(list(info.values()), 1.0)
            yield m

    def _labels(self, e) -> list[str]:
        return [self._model_name, str(getattr(e, "engine_index", 0))]

    def _cache_config(self, s) -> dict | None:
        """vLLM's cache_config_info labels of one DP rank, from the engine's args (None for an
        engine without)."""
        args = getattr(self._engine, "args", None)
        if args is None:
            return None
        return {"engine": str(getattr(s, "engine_index", 0)),
                "block_size": str(args.block_size), "num_gpu_blocks": str(s.num_total_blocks),
                "cache_dtype": str(args.kv_cache_dtype), "enable_prefix_caching": str(args.enable_prefix_caching),
                "gpu_memory_utilization": str(args.gpu_memory_utilization)}


    def _spec_decode(self, s, engines):
        """vLLM's spec_decode counters (and ours): drafts verified, draft tokens, accepted draft
        tokens, and accepted tokens per draft position (label `position`, 0-based)."""
        rows = [("num_drafts", "Draft sequences verified (one per request and step)"),
                ("num_draft_tokens", "Draft tokens verified"),
                ("num_accepted_tokens", "Draft tokens accepted")]
        for name, doc in rows:
            m = CounterMetricFamily(f"{PREFIX}_spec_decode_{name}", doc)
            m.add_metric([], float(getattr(s.spec, name)))
            yield m
            m = CounterMetricFamily(f"{VLLM}spec_decode_{name}", doc, labels=LABELS)
            for e in engines:
                m.add_metric(self._labels(e), float(getattr(e.spec, name)))
            yield m
        doc = "Draft tokens accepted at each draft position"
        ours = CounterMetricFamily(f"{PREFIX}_spec_decode_num_accepted_tokens_per_pos", doc, labels=["position"])
        theirs = CounterMetricFamily(f"{VLLM}spec_decode_num_accepted_tokens_per_pos", doc,
                                     labels=[*LABELS, "position"])
        for pos, value in enumerate(s.spec.accepted_per_pos):
            ours.add_metric([str(pos)], float(value))
        for e in engines:
            for pos, value in enumerate(e.spec.accepted_per_pos):
                theirs.add_metric([*self._labels(e), str(pos)], float(value))
        yield ours
        yield theirs


class ServerMetrics:
    """Registry of one app: engine gauges/counters and HTTP-side latency histograms."""

    def __init__(self, engine, model_name: str | None = None) -> None:
        self.model_name = model_name or engine.model_name
        # vLLM's per-request series exist for each DP rank from the start, as vLLM's do
        self.num_engines = getattr(getattr(engine, "args", None), "data_parallel_size", 1)
        # the per-request metrics are made in `registry`; /metrics renders `exposed`: the same
        # registry, or in multiprocess mode every process's files read afresh
        self.registry = CollectorRegistry()
        self.exposed = self.registry
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client.multiprocess import MultiProcessCollector

            self.exposed = CollectorRegistry()
            MultiProcessCollector(self.exposed)
        else:  # one process: its own process_*, python_info and python_gc_* series, as vLLM's
            for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):  # default registry
                self.exposed.register(collector)
        self.exposed.register(_EngineCollector(engine, self.model_name))
        self.ttft = self._histogram("time_to_first_token_seconds",
                                    "Time from request arrival to its first generated token", _VLLM_TTFT_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds",
                                   "Time between successive engine outputs of a request, per token",
                                   _VLLM_ITL_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds", "Time from request arrival to its last token",
                                   _PHASE_BUCKETS)
        self.queue = self._vllm_histogram("request_queue_time_seconds",
                                          "Time a request waited in the engine before its first step",
                                          _PHASE_BUCKETS)
        self.tpot = self._vllm_histogram("time_per_output_token_seconds",
                                         "Time per output token (vLLM's older name of the inter-token latency)",
                                         _VLLM_ITL_BUCKETS)
        self.request_tpot = self._vllm_histogram(
            "request_time_per_output_token_seconds",
            "Per choice: decode time / (generated tokens - 1)", _VLLM_ITL_BUCKETS)
        self.prefill = self._vllm_histogram("request_prefill_time_seconds",
                                            "Per choice: admission to first token", _PHASE_BUCKETS)
        self.decode = self._vllm_histogram("request_decode_time_seconds",
                                           "Per choice: first to last token", _PHASE_BUCKETS)
        self.inference = self._vllm_histogram("request_inference_time_seconds",
                                              "Per choice: admission to last token", _PHASE_BUCKETS)
        max_len = self.max_model_len = getattr(engine, "max_model_len", None) or 1 << 20
        self.prompt_tokens = self._vllm_histogram("request_prompt_tokens",
                                                  "Prompt tokens of each finished choice",
                                                  token_buckets(max_len))
        self.generation_tokens = self._vllm_histogram("request_generation_tokens",
                                                      "Tokens generated by each finished choice",
                                                      token_buckets(max_len))
        self.max_generation_tokens = self._vllm_histogram(
            "request_max_num_generation_tokens",
            "Per engine request (prompt): the most tokens any of its n choices generated",
            token_buckets(max_len))
        self.params_n = self._vllm_histogram("request_params_n", "The n of each finished request",
                                             [1, 2, 5, 10, 20])
        self.params_max_tokens = self._vllm_histogram("request_params_max_tokens",
                                                      "The max_tokens of each finished request (unset: "
                                                      "what the context left)", token_buckets(max_len))
        self.prefill_computed = self._vllm_histogram(
            "request_prefill_kv_computed_tokens",
            "Per finished choice: prompt tokens computed in its prefill (not found in the prefix cache)",
            token_buckets(max_len))
        cached = Counter(f"{VLLM}prompt_tokens_cached", "Prompt tokens of finished choices found in the "
                         "prefix cache", LABELS, registry=self.registry)
        self.cached = [cached.labels(self.model_name, str(d)) for d in range(self.num_engines)]
        generated = Counter(f"{VLLM}generation_tokens", "Tokens generated (those returned: a choice's "
                            "tokens up to the one that completed its stop string)", LABELS, registry=self.registry)
        self.generated = [generated.labels(self.model_name, str(d)) for d in range(self.num_engines)]
        self.success = Counter(f"{PREFIX}_request_success", "Finished choices by finish reason",
                               ["finished_reason"], registry=self.registry)
        self.vllm_success = Counter(f"{VLLM}request_success", "Finished choices by finish reason",
                                    [*LABELS, "finished_reason"], registry=self.registry)
        for reason in FINISH_REASONS:  # every series from the start, as vLLM's
            self.success.labels(finished_reason=reason)
            for d in range(self.num_engines):
                self.vllm_success.labels(self.model_name, str(d), reason)

    def _histogram(self, name: str, doc: str, vllm_buckets) -> tuple[Histogram, PerEngine]:
        """Our histogram (our buckets) and vLLM's (labelled, its buckets), observed together."""
        ours = Histogram(f"{PREFIX}_{name}", doc, buckets=_LATENCY_BUCKETS, registry=self.registry)
        return ours, self._vllm_histogram(name, doc, vllm_buckets)

    def _vllm_histogram(self, name: str, doc: str, buckets) -> PerEngine:
        return PerEngine(Histogram(f"{VLLM}{name}", doc, LABELS, buckets=buckets, registry=self.registry),
                         self.model_name, self.num_engines)

    def tracker(self, n: int = 1, max_tokens: int | None = None, log_output=None) -> RequestTracker:
        return RequestTracker(self, n, max_tokens, log_output)

    def render(self) -> bytes:
        return generate_latest(self.exposed)

    def render_for(self, accept: str | None, accept_encoding: str | None) -> tuple[bytes, str, str | None]:
        """(body, content type, content encoding or None) as prometheus_client's handler answers
        a scrape: the OpenMetrics text format when Accept asks for it, else Prometheus' text
        format; gzip-compressed when Accept-Encoding allows it."""
        encoder, content_type = choose_encoder(accept or "")
        body = encoder(self.exposed)
        if "gzip" in (accept_encoding or ""):
            return gzip.compress(body), content_type, "gzip"
        return body, content_type, None


class PerEngine:
    """A vLLM histogram's series of each DP rank (label values made once)."""

    def __init__(self, metric: Histogram, model_name: str, num_engines: int) -> None:
        self._series = [metric.labels(model_name, str(d)) for d in range(num_engines)]

    def at(self, engine: int) -> Histogram:
        return self._series[engine]


def _observe(pair: tuple[Histogram, PerEngine], engine: int, value: float) -> None:
    pair[0].observe(value)
    pair[1].at(engine).observe(value)


class RequestTracker:
    """Latency bookkeeping of one HTTP request: each choice (an engine request) timed on its own,
    as vLLM times each engine request; the per-prompt series once the prompt's choices are done."""

    def __init__(self, metrics: ServerMetrics, n: int = 1, max_tokens: int | None = None,
                 log_output=None) -> None:
        self._m = metrics
        self._log_output = log_output  # called with each prompt's final output (--enable-log-outputs)
        self._n, self._max_tokens = n, max_tokens  # the request's, for vLLM's request_params_*
        self._arrival = time.perf_counter()
        self._queued: dict[tuple[int, int], float] = {}  # (prompt, choice) -> its queue time
        # (prompt index, choice index) -> [time of first token, time of last token, tokens]
        self._choices: dict[tuple[int, int], list] = {}
        self._done: set[tuple[int, int]] = set()  # choices whose finish was recorded
        self._most: dict[int, int] = {}  # prompt index -> the most tokens one of its choices made
        self._finished_choices = 0
        self._closed = False
        self._engine = 0  # the DP rank of the prompt's first choice admitted (0 until then)
        self._choice_engine: dict[tuple[int, int], int] = {}  # unfinished choices seen -> their DP rank

    def observe(self, prompt_idx: int, out: RequestOutput) -> None:
        """Record one engine output of prompt `prompt_idx`."""
        now = time.perf_counter()
        self._engine = out.engine_index
        for o in out.outputs:
            key, ce = (prompt_idx, o.index), o.engine_index  # each choice under its own DP rank
            if key in self._done:
                continue
            self._choice_engine[key] = ce
            if o.queue_time is not None and key not in self._queued:
                self._queued[key] = o.queue_time
                self._m.queue.at(ce).observe(o.queue_time)
            new_tokens = len(o.delta_token_ids)
            if new_tokens:
                self._m.generated[ce].inc(new_tokens)
                c = self._choices.get(key)
                if c is None:
                    _observe(self._m.ttft, ce, now - self._arrival)
                    self._choices[key] = [now, now, new_tokens]
                else:
                    per_token = (now - c[1]) / new_tokens
                    for _ in range(new_tokens):
                        _observe(self._m.itl, ce, per_token)
                        self._m.tpot.at(ce).observe(per_token)
                    c[1] = now
                    c[2] += new_tokens
            if o.finish_reason is not None:
                self._finish(key, o.finish_reason, ce, now, len(out.prompt_token_ids), out.num_cached_tokens)
        if out.finished:  # per engine request of vLLM's that stands for the prompt
            if self._log_output is not None:
                self._log_output(out)
            e = out.engine_index
            self._m.max_generation_tokens.at(e).observe(self._most.pop(prompt_idx, 0))
            self._m.params_n.at(e).observe(self._n)
            self._m.params_max_tokens.at(e).observe(
                self._max_tokens if self._max_tokens is not None
                else max(0, self._m.max_model_len - len(out.prompt_token_ids)))

    def _finish(self, key: tuple[int, int], reason: str, ce: int, now: float, prompt_tokens: int,
                cached_tokens: int) -> None:
        """A choice's end: its end-to-end latency, phases, sizes, prefix cache share and finish reason."""
        self._done.add(key)
        self._choice_engine.pop(key, None)
        _observe(self._m.e2e, ce, now - self._arrival)
        first, last, tokens = self._choices.pop(key, (None, None, 0))
        self._most[key[0]] = max(self._most.get(key[0], 0), tokens)
        self._m.prompt_tokens.at(ce).observe(prompt_tokens)
        cached_tokens = min(cached_tokens, prompt_tokens)
        self._m.prefill_computed.at(ce).observe(prompt_tokens - cached_tokens)
        self._m.cached[ce].inc(cached_tokens)
        self._m.generation_tokens.at(ce).observe(tokens)
        if first is not None:
            admitted = self._arrival + self._queued.get(key, 0.0)
            self._m.prefill.at(ce).observe(max(0.0, first - admitted))
            self._m.decode.at(ce).observe(last - first)
            self._m.inference.at(ce).observe(max(0.0, last - admitted))
            if tokens > 1:
                self._m.request_tpot.at(ce).observe((last - first) / (tokens - 1))
        self._m.success.labels(finished_reason=reason).inc()
        self._m.vllm_success.labels(self._m.model_name, str(ce), reason).inc()
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
            # each under its own DP rank where an output named it, the rest under the prompt's
            engines = list(self._choice_engine.values())[:aborted]
            engines += [self._engine] * (aborted - len(engines))
            for d in sorted(set(engines)):
                self._m.vllm_success.labels(self._m.model_name, str(d), "abort").inc(engines.count(d))
