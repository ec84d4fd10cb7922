"""scripts/bench_serving.py: percentile and summary math on synthetic timings, flag checks.

No server is started here (the server tests do that); the streaming path was checked by hand
against `serve` (see RESULTS.md, "Serving benchmark").
"""

from __future__ import annotations

import math
import os
import random
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))

import bench_serving as bs  # noqa: E402
import serving_report as sr  # noqa: E402


def test_percentile_matches_numpy_linear():
    rng = random.Random(1)
    for n in (1, 2, 3, 10, 101):
        xs = [rng.expovariate(3.0) for _ in range(n)]
        for q in (0, 1, 37.5, 50, 99, 100):
            assert sr.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)


def test_percentile_hand_values_and_limits():
    assert sr.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5  # unsorted input, between ranks
    assert sr.percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert sr.percentile([], 50) is None
    with pytest.raises(ValueError, match="q must be in"):
        sr.percentile([1.0], 101)


def _req(ttft, gaps, tokens, prompt=8):
    return bs.RequestResult(ttft=ttft, e2e=ttft + sum(gaps), itl=list(gaps), output_tokens=tokens,
                            prompt_tokens=prompt)


def test_summary_on_synthetic_timings():
    # two requests of 5 tokens: TPOT = (e2e - ttft) / 4 = mean of their 4 gaps each
    a = _req(0.100, [0.010] * 4, 5)
    b = _req(0.300, [0.020, 0.020, 0.040, 0.040], 5)
    failed = bs.RequestResult(error="HTTP 500: boom")
    s = sr.summarize([a, b, failed], duration_s=2.0, output_len=5)
    assert (s["completed"], s["failed"], s["wrong_output_len"]) == (2, 1, 0)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(5.0)
    assert s["total_token_throughput"] == pytest.approx(13.0)
    assert s["ttft"]["mean_ms"] == pytest.approx(200.0)
    assert s["ttft"]["p50_ms"] == pytest.approx(200.0)
    assert s["ttft"]["p99_ms"] == pytest.approx(100.0 + 200.0 * 0.99)
    assert s["tpot"]["mean_ms"] == pytest.approx((10.0 + 30.0) / 2)
    assert s["itl"]["p50_ms"] == pytest.approx(15.0)  # 8 gaps: four 10, two 20, two 40
    assert s["itl"]["mean_ms"] == pytest.approx(1e3 * (0.04 + 0.12) / 8)
    assert s["e2e"]["p50_ms"] == pytest.approx(1e3 * (0.14 + 0.42) / 2)
    assert s["errors"] == ["HTTP 500: boom"]


def test_summary_edge_cases():
    one_token = _req(0.05, [], 1)  # no TPOT or ITL for a single token
    short = _req(0.05, [0.01, 0.01], 3)
    s = sr.summarize([one_token, short], duration_s=1.0, output_len=3)
    assert s["wrong_output_len"] == 1
    assert s["tpot"]["mean_ms"] == pytest.approx(10.0)  # only `short` has a TPOT
    none = sr.summarize([bs.RequestResult(error="x")], duration_s=1.0, output_len=3)
    assert none["completed"] == 0 and none["ttft"]["p50_ms"] is None
    assert "-" in sr.table([{"load": "rate inf", "summary": none}])
    with pytest.raises(ValueError, match="duration_s"):
        sr.summarize([], duration_s=0.0, output_len=3)


@pytest.mark.parametrize("argv, match", [
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--warmup-requests", "0"], "--warmup-requests must be >= 1"),
    (["--request-rate", "0"], "request rates must be > 0"),
    (["--sweep-concurrency", "1", "0"], "concurrencies must be >= 1"),
    (["--sweep-rate", "1", "--sweep-concurrency", "2"], "not both"),
    (["--base-url", "http://10.1.2.3:8000/v1"], "not a loopback address"),
])
def test_bad_flags(argv, match):
    _, a = bs.parse_args(argv)
    with pytest.raises(ValueError, match=match):
        bs.check_args(a)


def test_good_flags_and_loopback():
    _, a = bs.parse_args(["--base-url", "http://[::1]:9000/v1", "--sweep-rate", "1", "inf"])
    bs.check_args(a)
    assert math.isinf(a.sweep_rate[1])
    assert bs.is_loopback("http://localhost:8000/v1") and not bs.is_loopback("http://example.com/v1")
    _, a = bs.parse_args(["--base-url", "http://10.1.2.3:8000/v1", "--allow-remote"])
    bs.check_args(a)


def test_vocab_and_context_checks():
    assert bs.resolve_vocab({"vocab_size": 506, "max_model_len": 2048}, None, 64, 16) == 506
    assert bs.resolve_vocab({}, 1000, 64, 16) == 1000
    with pytest.raises(ValueError, match="--vocab-size"):
        bs.resolve_vocab({}, None, 64, 16)
    with pytest.raises(ValueError, match="max_model_len 2048"):
        bs.resolve_vocab({"vocab_size": 506, "max_model_len": 2048}, None, 2040, 16)


@pytest.mark.parametrize("extra", [
    [], ["--kernel-plan", "torch"], ["--no-enable-prefix-caching"], ["--async-scheduling"],
    ["--no-async-scheduling", "--enforce-eager"], ["--skip-tokenizer-init"],
    ["--max-num-seqs", "64", "--max-num-batched-tokens", "4096", "--max-model-len", "2048"],
    ["--enable-expert-parallel"],
])
def test_http_vs_offline_runs_serve_with_the_offline_engine_settings(extra):
    """bench_http_vs_offline.py starts `serve` with the EngineArgs bench_throughput.py builds:
    every field equal, so that the HTTP / offline ratio compares the same engine."""
    import dataclasses

    import argparse

    import bench_http_vs_offline as hvo
    from bench_common import add_engine_flags, engine_kwargs

    from common.args import EngineArgs
    from server.cli import build_parser, engine_args_from

    a = hvo.parse_args(extra)
    offline = EngineArgs(**engine_kwargs(a))
    served = engine_args_from(build_parser().parse_args(hvo.engine_argv(a, serve=True) + ["--port", "8000"]))
    # and the offline scripts take the same argv back into the same settings
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert EngineArgs(**engine_kwargs(p.parse_args(hvo.engine_argv(a)))) == offline
    diff = {f.name: (getattr(offline, f.name), getattr(served, f.name))
            for f in dataclasses.fields(EngineArgs) if getattr(offline, f.name) != getattr(served, f.name)}
    assert diff == {}


class _FakeResponse:
    status_code = 200

    async def aiter_lines(self):
        for line in ('data: {"choices": [{"text": ""}], "usage": null}', "",
                     'data: {"choices": [], "usage": {"completion_tokens": 1, "prompt_tokens": 3}}', "",
                     "data: [DONE]"):
            yield line


class _FakeClient:
    """httpx.AsyncClient.stream look-alike: records each request's body and how many tasks
    existed when it reached the 'server'."""

    def __init__(self, log):
        self.log = log

    def stream(self, method, url, content=None, headers=None, **kw):
        log = self.log

        class _CM:
            async def __aenter__(self):
                import asyncio
                log.append((content, headers, len(asyncio.all_tasks())))
                return _FakeResponse()

            async def __aexit__(self, *exc):
                return False
        return _CM()


def test_run_load_at_rate_inf_sends_each_request_before_making_the_next():
    import asyncio
    import json
    n = 50
    log = []
    t = bs.Target("http://127.0.0.1:1/v1/completions", {"Authorization": "Bearer k"}, "m", 1, 0.0, 60)
    prompts = [[i, i + 1, i + 2] for i in range(n)]
    results, _ = asyncio.run(bs.run_load(_FakeClient(log), t, prompts, float("inf"), None, 0))
    assert all(r.ok and r.output_tokens == 1 for r in results)
    assert len(log) == n
    # request 0 went out while a few tasks existed (the load's, request 0's and its wait_for's,
    # request 1's), not after all n had been made
    assert log[0][2] <= 5
    body = json.loads(log[0][0])
    assert body == {"model": "m", "prompt": [0, 1, 2], "max_tokens": 1, "ignore_eos": True,
                    "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    assert log[0][1] == {"Authorization": "Bearer k", "Content-Type": "application/json"}
    assert sorted(json.loads(c)["prompt"][0] for c, _, _ in log) == list(range(n))


def test_client_shards_share_requests_round_robin():
    import asyncio
    import httpx

    async def main():
        async with bs.ClientShards(3, httpx.Limits(max_connections=4), httpx.Timeout(1.0)) as cs:
            picked = [cs[i] for i in range(7)]
            assert len({id(c) for c in picked}) == 3
            assert picked[0] is picked[3] is picked[6] and picked[1] is picked[4]
        assert all(c.is_closed for c in picked)
    asyncio.run(main())
    assert (bs.shard_count(1), bs.shard_count(32), bs.shard_count(33), bs.shard_count(1000)) == (1, 1, 2, 32)
