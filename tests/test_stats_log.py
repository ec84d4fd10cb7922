"""vLLM's periodic stats line (server/stats_log.py) from an engine's counters."""

from __future__ import annotations

import logging
from dataclasses import replace
from types import SimpleNamespace

import pytest

from engine.async_llm import EngineStats
from server import stats_log
from server.stats_log import StatsLogger, stats_interval


def _stats(prompt=0, generated=0, running=0, waiting=0, usage=0.0, queries=0, hits=0, spec=None, index=0):
    return EngineStats(running, waiting, 10, 100, usage, 0, prompt, generated, queries, hits, 0,
                       spec=spec, engine_index=index)


class _Engine:
    def __init__(self, stats):
        self.now = stats

    def stats(self):
        return self.now


def _spec(drafts, drafted, accepted, per_pos):
    return SimpleNamespace(num_drafts=drafts, num_draft_tokens=drafted, num_accepted_tokens=accepted,
                           accepted_per_pos=per_pos)


def test_interval_figures_and_levels(monkeypatch):
    clock = iter([100.0, 110.0, 120.0])
    monkeypatch.setattr(stats_log.time, "monotonic", lambda: next(clock))
    engine = _Engine(_stats(prompt=500, generated=40, queries=64, hits=16))
    log = StatsLogger(engine)
    engine.now = _stats(prompt=1500, generated=240, running=3, waiting=1, usage=0.25, queries=164, hits=66)
    (level, line), = log.lines()
    assert level == logging.INFO
    assert line == ("Engine 000: Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 20.0 "
                    "tokens/s, Running: 3 reqs, Waiting: 1 reqs, GPU KV cache usage: 25.0%, Prefix cache "
                    "hit rate: 50.0%")  # the interval's 50 hits of 100 queries
    engine.now = replace(engine.now, num_running=0, num_waiting=0, kv_cache_usage=0.0)
    (level, line), = log.lines()  # nothing happened: debug, and no queries is a 0% rate
    assert level == logging.DEBUG and "Avg prompt throughput: 0.0 tokens/s" in line and "hit rate: 0.0%" in line


def test_one_line_per_dp_rank_and_speculative_acceptance(monkeypatch):
    clock = iter([0.0, 2.0])
    monkeypatch.setattr(stats_log.time, "monotonic", lambda: next(clock))
    ranks = [_stats(spec=_spec(0, 0, 0, [0, 0]), index=0), _stats(spec=_spec(0, 0, 0, [0, 0]), index=1)]
    engine = _Engine(SimpleNamespace(per_engine=ranks))
    log = StatsLogger(engine)
    engine.now = SimpleNamespace(per_engine=[
        _stats(generated=30, running=2, spec=_spec(10, 20, 15, [9, 6]), index=0),
        _stats(spec=_spec(0, 0, 0, [0, 0]), index=1)])
    lines = log.lines()
    assert [t.split(":")[0] for _, t in lines] == ["Engine 000", "SpecDecoding metrics", "Engine 001"]
    assert lines[1] == (logging.INFO, "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: "
                        "7.50 tokens/s, Drafted throughput: 10.00 tokens/s, Accepted: 15 tokens, Drafted: 20 "
                        "tokens, Per-position acceptance rate: 0.900, 0.600, Avg Draft acceptance rate: 75.0%")
    assert lines[2][0] == logging.DEBUG  # the idle rank


@pytest.mark.parametrize("value,want", [(None, 10.0), ("2.5", 2.5), ("0", None), ("-1", None),
                                        ("soon", None), ("inf", None), ("nan", None)])
def test_interval_from_vllms_variable(value, want, monkeypatch):
    if value is None:
        monkeypatch.delenv("VLLM_LOG_STATS_INTERVAL", raising=False)
    else:
        monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", value)
    if want is None:
        with pytest.raises(ValueError, match="VLLM_LOG_STATS_INTERVAL"):
            stats_interval()
    else:
        assert stats_interval() == want
