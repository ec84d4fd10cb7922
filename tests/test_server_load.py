"""The HTTP server under load and at the edges of a request's life: a client that leaves
mid-stream or gives up (its request aborted, its KV blocks freed), 256 concurrent requests
(batched == alone), and the Prometheus metrics a request moves.

Every test runs against the fake engine in-process and against the real `serve` subprocess on the
tiny model (marked slow): the fixtures of tests/api_fixtures.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time

import httpx
import openai

from tests.api_fixtures import MAX_MODEL_LEN, PROMPTS, client, greedy, server
from tests.server_fixtures import OFFLINE_ENV, aborted_choices, metric

os.environ.update(OFFLINE_ENV)
FIXTURES = (server, client)  # pytest finds them here (tests/api_fixtures.py)


def _metrics(server) -> str:
    return httpx.get(f"{server.url}/metrics", timeout=30).text


def _wait_idle(server, timeout: float = 30.0) -> str:
    """Poll /metrics until no request runs and no KV block is held."""
    deadline = time.time() + timeout
    while True:
        m = _metrics(server)
        busy = (metric(m, "mla_serve_num_requests_running"), metric(m, "mla_serve_kv_cache_blocks_used"))
        if busy == (0, 0) or time.time() > deadline:
            assert busy == (0, 0), f"still running/holding blocks: {busy}"
            return m
        time.sleep(0.05)


def test_client_disconnect_aborts_and_frees_blocks(server):
    """A client that leaves gets its request aborted: counted as finished_reason="abort", its
    tokens stopped short of max_tokens, its KV blocks freed. How many tokens run before the
    disconnect depends on the machine's speed, so the bound is max_tokens, not a fraction of it."""
    url = f"{server.url}/v1/completions"
    max_tokens = MAX_MODEL_LEN - 16
    body = {"model": server.model, "prompt": PROMPTS[3], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    m0 = _wait_idle(server)
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", url, json={**body, "stream": True}) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data:")
                if events == 3:
                    break  # leaving the block drops the connection mid-stream
    m1 = _wait_idle(server)
    generated = metric(m1, "mla_serve_generation_tokens_total") - metric(m0, "mla_serve_generation_tokens_total")
    assert 3 <= generated < max_tokens, "the request ran on after its client left"
    assert aborted_choices(m1) == aborted_choices(m0) + 1
    # a non-streaming client that gives up once its request runs
    host, port = server.url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        deadline = time.time() + 30
        while metric(_metrics(server), "mla_serve_num_requests_running") == 0:
            assert time.time() < deadline, "the request never started"
            time.sleep(0.01)
    m2 = _wait_idle(server)
    generated = metric(m2, "mla_serve_generation_tokens_total") - metric(m1, "mla_serve_generation_tokens_total")
    assert generated < max_tokens, "the request ran on after its client left"
    assert aborted_choices(m2) == aborted_choices(m1) + 1
    assert greedy(openai.OpenAI(base_url=f"{server.url}/v1", api_key="x"), server, "ok").choices


def test_256_concurrent_requests(client, server):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(256)]

    async def run():
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(limits=limits, timeout=600) as c:
            async def one(p):
                return await c.post(f"{server.url}/v1/completions", json={
                    "model": server.model, "prompt": p, "max_tokens": 4, "temperature": 0,
                    "ignore_eos": True})
            return await asyncio.gather(*(one(p) for p in prompts))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 256
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in responses)
    for i in (0, 77, 255):  # batched under load == alone
        alone = greedy(client, server, prompts[i], max_tokens=4, extra_body={"ignore_eos": True})
        assert responses[i].json()["choices"][0]["text"] == alone.choices[0].text
    _wait_idle(server)


def test_metrics_count_requests_and_latencies(client, server):
    before = _metrics(server)
    r = greedy(client, server, PROMPTS[0], max_tokens=6, extra_body={"ignore_eos": True})
    after = _metrics(server)
    delta = {name: metric(after, name) - metric(before, name) for name in (
        "mla_serve_generation_tokens_total", "mla_serve_prompt_tokens_total",
        "mla_serve_time_to_first_token_seconds_count", "mla_serve_inter_token_latency_seconds_count",
        "mla_serve_e2e_request_latency_seconds_count")}
    assert delta["mla_serve_generation_tokens_total"] == 6
    assert delta["mla_serve_prompt_tokens_total"] == r.usage.prompt_tokens
    assert delta["mla_serve_time_to_first_token_seconds_count"] == 1
    assert delta["mla_serve_inter_token_latency_seconds_count"] == 5
    assert delta["mla_serve_e2e_request_latency_seconds_count"] == 1
    assert 'mla_serve_request_success_total{finished_reason="length"}' in after
    # vLLM's per-request histograms: one observation per finished choice
    label = f'{{engine="0",model_name="{server.model}"}}'
    vdelta = {name: metric(after, f"vllm:{name}{label}") - metric(before, f"vllm:{name}{label}")
              for name in ("request_prefill_time_seconds_count", "request_decode_time_seconds_count",
                           "request_inference_time_seconds_count",
                           "request_time_per_output_token_seconds_count",
                           "request_prompt_tokens_count", "request_prompt_tokens_sum",
                           "request_generation_tokens_count", "request_generation_tokens_sum",
                           "time_per_output_token_seconds_count",
                           "request_decode_time_seconds_sum", "request_inference_time_seconds_sum")}
    assert vdelta["request_prefill_time_seconds_count"] == vdelta["request_decode_time_seconds_count"] == 1
    assert vdelta["request_inference_time_seconds_count"] == 1
    assert vdelta["request_time_per_output_token_seconds_count"] == 1
    assert vdelta["request_prompt_tokens_count"] == vdelta["request_generation_tokens_count"] == 1
    assert vdelta["request_prompt_tokens_sum"] == r.usage.prompt_tokens
    assert vdelta["request_generation_tokens_sum"] == 6
    assert vdelta["time_per_output_token_seconds_count"] == 5
    assert 0 < vdelta["request_decode_time_seconds_sum"] <= vdelta["request_inference_time_seconds_sum"]
    if server.model == "tiny":  # the real engine: tokens per step, as vLLM's iteration_tokens_total
        steps = metric(after, f"vllm:iteration_tokens_total_count{label}") - \
            metric(before, f"vllm:iteration_tokens_total_count{label}")
        tokens = metric(after, f"vllm:iteration_tokens_total_sum{label}") - \
            metric(before, f"vllm:iteration_tokens_total_sum{label}")
        # the prompt (prefilled in one step) and 5 decode steps of one token; async scheduling
        # may launch one more step whose token is dropped
        assert 6 <= steps <= 7 and r.usage.prompt_tokens + 5 <= tokens <= r.usage.prompt_tokens + 6
        assert f'vllm:iteration_tokens_total_bucket{{engine="0",le="1.0",model_name="{server.model}"}}' in after
    assert 0 <= metric(after, "mla_serve_kv_cache_usage_perc") <= 1
    assert metric(after, "mla_serve_num_requests_waiting") == 0
