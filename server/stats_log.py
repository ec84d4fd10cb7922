"""The periodic stats line vLLM's server logs, from the engine's counters.

Every `VLLM_LOG_STATS_INTERVAL` seconds (vLLM's variable; default 10), one line per engine (DP
rank) in vLLM's words: prompt and generation throughput over the interval, running and waiting
requests, KV cache usage and the interval's prefix cache hit rate; with speculative decoding a
second line of the interval's acceptance. At INFO while anything happens, at DEBUG when the
engine sat idle through the interval, as vLLM does. `--disable-log-stats` turns it off (the same
figures stay on /metrics). Only the first API server process logs it: the engine's counters reach
every process alike.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

logger = logging.getLogger("server.stats")
DEFAULT_INTERVAL = 10.0


def stats_interval() -> float:
    """VLLM_LOG_STATS_INTERVAL in seconds (> 0), or the default; ValueError naming it."""
    raw = os.environ.get("VLLM_LOG_STATS_INTERVAL")
    if raw is None:
        return DEFAULT_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"VLLM_LOG_STATS_INTERVAL={raw!r}: must be a number of seconds > 0")
    return value


class StatsLogger:
    """Differences of the engine's counters between two calls of `log`."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self._last = self._snapshot()
        self._t = time.monotonic()

    def _snapshot(self) -> list:
        s = self._engine.stats()
        return s.per_engine or [s]

    def lines(self) -> list[tuple[int, str]]:
        """(log level, text) of each line for the interval since the last call."""
        now, engines = time.monotonic(), self._snapshot()
        dt = max(now - self._t, 1e-9)
        out = []
        for d, (e, p) in enumerate(zip(engines, self._last)):
            prompt = e.prompt_tokens_total - p.prompt_tokens_total
            generated = e.generation_tokens_total - p.generation_tokens_total
            queries = e.prefix_cache_queries - p.prefix_cache_queries
            hits = e.prefix_cache_hits - p.prefix_cache_hits
            busy = prompt or generated or e.num_running or e.num_waiting
            level = logging.INFO if busy else logging.DEBUG
            out.append((level, f"Engine {d:03d}: Avg prompt throughput: {prompt / dt:.1f} tokens/s, "
                               f"Avg generation throughput: {generated / dt:.1f} tokens/s, "
                               f"Running: {e.num_running} reqs, Waiting: {e.num_waiting} reqs, "
                               f"GPU KV cache usage: {100 * e.kv_cache_usage:.1f}%, "
                               f"Prefix cache hit rate: {100 * hits / queries if queries else 0.0:.1f}%"))
            if e.spec is not None and p.spec is not None:
                spec = self._spec_line(e.spec, p.spec, dt)
                if spec is not None:
                    out.append((level, spec))
        self._last, self._t = engines, now
        return out

    @staticmethod
    def _spec_line(s, p, dt: float) -> str | None:
        drafts = s.num_drafts - p.num_drafts
        if drafts <= 0:
            return None
        drafted = s.num_draft_tokens - p.num_draft_tokens
        accepted = s.num_accepted_tokens - p.num_accepted_tokens
        per_pos = [a - b for a, b in zip(s.accepted_per_pos, p.accepted_per_pos)]
        rates = ", ".join(f"{a / drafts:.3f}" for a in per_pos)
        return (f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
                f"Accepted throughput: {accepted / dt:.2f} tokens/s, Drafted throughput: "
                f"{drafted / dt:.2f} tokens/s, Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
                f"Per-position acceptance rate: {rates}, Avg Draft acceptance rate: "
                f"{100 * accepted / drafted if drafted else 0.0:.1f}%")

    def log(self) -> None:
        for level, text in self.lines():
            logger.log(level, "%s", text)


async def log_stats_every(engine, interval: float) -> None:
    """`StatsLogger.log` every `interval` seconds until cancelled."""
    stats = StatsLogger(engine)
    while True:
        await asyncio.sleep(interval)
        stats.log()
