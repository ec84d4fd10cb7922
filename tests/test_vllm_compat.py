"""vLLM's server extras work: /version, /ping, CORS, several served model names, request logging,
vLLM's metric names, a --chat-template and a --generation-config in requests, the Grafana
dashboard's series, /reset_prefix_cache (the launch lines and flags themselves:
tests/test_vllm_cli.py)."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

from common.args import EngineArgs
from server.cli import build_parser
from tests.server_fixtures import TINY_MODEL

# ---- the HTTP side, on the fake engine ----

@pytest.fixture()
def client_for():
    from transformers import AutoTokenizer

    from server.api_server import build_app
    from tests.server_fixtures import FakeEngine

    tok = AutoTokenizer.from_pretrained(TINY_MODEL)

    def make(argv: list[str], names: list[str] | None = None):
        engine = FakeEngine(tok)
        if names:
            engine.model_name, engine.model_names = names[0], names
        app = build_app(engine, build_parser().parse_args(["--model", str(TINY_MODEL), *argv]))
        return engine, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    return make


def test_invocations_route_by_the_body(client_for):
    """SageMaker's POST /invocations: chat with `messages`, completions with `prompt`, the /v1
    routes' errors otherwise; behind --api-key like /v1."""
    async def run():
        _, c = client_for(["--api-key", "k"])
        auth = {"Authorization": "Bearer k"}
        async with c:
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            assert (await c.post("/invocations", json=chat)).status_code == 401
            r = await c.post("/invocations", json=chat, headers=auth)
            assert r.status_code == 200 and r.json()["object"] == "chat.completion"
            r = await c.post("/invocations", json={"prompt": "hi", "max_tokens": 3}, headers=auth)
            assert r.status_code == 200 and r.json()["object"] == "text_completion"
            assert r.json()["usage"]["completion_tokens"] == 3
            for body, param in (({"input": "hi"}, "messages"), ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
                                ({**chat, "n": 0}, "n")):
                r = await c.post("/invocations", json=body, headers=auth)
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            r = await c.post("/invocations", content=b"{nope", headers=auth)
            assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]

    asyncio.run(run())


def test_version_and_ping(client_for):
    async def run():
        engine, c = client_for([])
        async with c:
            v = await c.get("/version")
            assert v.status_code == 200 and v.json()["version"]
            for method in ("GET", "POST"):  # /health's answer: an empty 200, as vLLM's
                pong = await c.request(method, "/ping")
                assert pong.status_code == 200 and pong.content == b""
            head = await c.head("/health")  # load balancers' probe: the status, no body
            assert head.status_code == 200 and head.content == b""
            for method, path, allow in (("POST", "/health", "GET, HEAD"), ("PUT", "/ping", "GET, POST"),
                                        ("GET", "/v1/completions", "POST")):
                r = await c.request(method, path)  # a 405 names the methods the path has (RFC 9110)
                assert (r.status_code, r.headers.get("allow")) == (405, allow), (method, path)
            engine.errored = True
            assert (await c.get("/ping")).status_code == 503
            assert (await c.head("/health")).status_code == 503

    asyncio.run(run())


def test_cors_only_when_asked(client_for):
    async def run():
        pre = {"Origin": "https://a.example", "Access-Control-Request-Method": "POST"}
        _, plain = client_for([])
        async with plain:
            r = await plain.get("/version", headers={"Origin": "https://a.example"})
            assert "access-control-allow-origin" not in r.headers
        _, c = client_for(["--allowed-origins", '["https://a.example"]', "--allowed-methods", '["GET", "POST"]',
                           "--allow-credentials"])
        async with c:
            r = await c.options("/v1/completions", headers=pre)
            assert r.status_code == 200
            assert r.headers["access-control-allow-origin"] == "https://a.example"
            assert r.headers["access-control-allow-credentials"] == "true"
            assert "POST" in r.headers["access-control-allow-methods"]
            r = await c.options("/v1/completions", headers={**pre, "Origin": "https://b.example"})
            assert r.status_code == 400  # an origin not in the list

    asyncio.run(run())


def test_every_served_name_is_accepted(client_for):
    async def run():
        _, c = client_for([], names=["first", "second"])
        async with c:
            body = {"prompt": "hi", "max_tokens": 2}
            for name in ("first", "second"):
                r = await c.post("/v1/completions", json={**body, "model": name})
                assert r.status_code == 200 and r.json()["model"] == "first"
            r = await c.post("/v1/completions", json={**body, "model": "third"})
            assert r.status_code == 404 and "'first' or 'second'" in r.json()["error"]["message"]
            ids = [m["id"] for m in (await c.get("/v1/models")).json()["data"]]
            assert ids == ["first", "second"]

    asyncio.run(run())


def test_requests_are_logged_when_asked(caplog):
    from engine.async_llm import AsyncLLM
    from common.sampling_params import SamplingParams

    async def run(flag: bool) -> list[str]:
        llm = AsyncLLM(EngineArgs(model=str(TINY_MODEL), device="cpu", num_kv_blocks=32,
                                  enable_log_requests=flag))
        try:
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="engine.async_llm"):
                async for _ in llm.generate([5, 6, 7], SamplingParams(max_tokens=2), "req-1"):
                    pass
            return [r.getMessage() for r in caplog.records if "req-1" in r.getMessage()]
        finally:
            llm.shutdown()

    assert asyncio.run(run(False)) == []
    logged = asyncio.run(run(True))
    assert len(logged) == 1 and "3 prompt tokens" in logged[0]


def _sample(text: str, name: str) -> float:
    """The value of the one sample `name` (with its labels, as printed) in Prometheus text."""
    lines = [ln for ln in text.splitlines() if ln.startswith(name + " ")]
    assert len(lines) == 1, (name, lines)
    return float(lines[0].rsplit(" ", 1)[1])


def test_http_metrics_under_vllms_names(client_for):
    """http_requests_total and the latency and size series, per route template and status class;
    health checks and scrapes are not counted, a path no route serves is handler "none"."""
    async def run():
        _, c = client_for(["--max-request-body-bytes", "65536"])
        async with c:
            for _ in range(2):
                assert (await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})).status_code == 200
            assert (await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": -1})).status_code == 400
            stream_body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
            chunks = [ln async for ln in (await c.send(c.build_request(
                "POST", "/v1/chat/completions", json=stream_body), stream=True)).aiter_lines()]
            assert chunks[-2] == "data: [DONE]"
            assert (await c.get("/no/such/route")).status_code == 404
            for path in ("/health", "/ping", "/version", "/load"):
                await c.get(path)
            # refused by the body limit before routing: still counted under its route
            big = {"messages": [{"role": "user", "content": "x" * 70_000}]}
            assert (await c.post("/v1/chat/completions", json=big)).status_code == 413
            chat_sizes = (len(c.build_request("POST", "/v1/chat/completions", json=big).content)
                          + len(c.build_request("POST", "/v1/chat/completions", json=stream_body).content))
            sizes = sum(len(c.build_request("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": n}).content)
                        for n in (2, 2, -1))
            return (await c.get("/metrics")).text, sizes, chat_sizes

    text, sizes, chat_sizes = asyncio.run(run())
    assert _sample(text, 'http_request_size_bytes_sum{handler="/v1/completions"}') == sizes
    # Content-Length, also of the 413's body, which was never read in full
    assert _sample(text, 'http_request_size_bytes_sum{handler="/v1/chat/completions"}') == chat_sizes
    cmpl = 'handler="/v1/completions",method="POST"'
    assert _sample(text, f'http_requests_total{{{cmpl},status="2xx"}}') == 2
    assert _sample(text, f'http_requests_total{{{cmpl},status="4xx"}}') == 1
    assert _sample(text, 'http_requests_total{handler="/v1/chat/completions",method="POST",status="2xx"}') == 1
    assert _sample(text, 'http_requests_total{handler="/v1/chat/completions",method="POST",status="4xx"}') == 1
    assert _sample(text, 'http_requests_total{handler="none",method="GET",status="4xx"}') == 1
    assert _sample(text, f"http_request_duration_seconds_count{{{cmpl}}}") == 3
    assert _sample(text, "http_request_duration_highr_seconds_count") == 6
    assert _sample(text, 'http_request_size_bytes_count{handler="/v1/completions"}') == 3
    assert _sample(text, 'http_response_size_bytes_sum{handler="/v1/chat/completions"}') > 100
    assert not any(h in text for h in ('handler="/health"', 'handler="/ping"', 'handler="/metrics"'))


def test_vllm_metric_names_with_model_name_label():
    """On the real engine (tiny model, in-process): vLLM's series, labelled with the served name,
    beside ours, counting one request the same; the queue time comes from the scheduler."""
    from engine.async_llm import AsyncLLM
    from server.api_server import build_app

    async def run():
        llm = AsyncLLM(EngineArgs(model=str(TINY_MODEL), device="cpu", num_kv_blocks=64,
                                  served_model_name=["tiny", "alias"]))
        try:
            app = build_app(llm, None)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                before = (await c.get("/metrics")).text
                body = {"model": "alias", "prompt": "Hello there", "max_tokens": 5, "ignore_eos": True,
                        "temperature": 0}
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 200
                after = (await c.get("/metrics")).text
                # then the same greedy request ended by a stop string inside its text: vLLM's
                # generated count is the tokens returned, not those the engine sampled past it
                text = r.json()["choices"][0]["text"]
                stop = await c.post("/v1/completions", json={**body, "stop": [text[1:3]]})
                await asyncio.sleep(0.3)  # the core's counters of its last step reach the front end
                return before, after, r.json()["usage"]["prompt_tokens"], stop.json(), (await c.get("/metrics")).text
        finally:
            llm.shutdown()

    before, after, prompt_tokens, stopped, last = asyncio.run(run())
    assert stopped["choices"][0]["finish_reason"] == "stop"
    returned = stopped["usage"]["completion_tokens"]
    assert _sample(last, 'vllm:generation_tokens_total{engine="0",model_name="tiny"}') == 5 + returned
    assert _sample(last, "mla_serve_generation_tokens_total") >= 5 + returned  # the engine's own work
    lab = '{engine="0",model_name="tiny"}'

    def delta(name):
        return _sample(after, name) - _sample(before, name)

    assert delta(f"vllm:generation_tokens_total{lab}") == 5 == delta("mla_serve_generation_tokens_total")
    assert delta(f"vllm:prompt_tokens_total{lab}") == prompt_tokens
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"vllm:{h}_count{lab}") == 1 == delta(f"mla_serve_{h}_count"), h
    assert delta(f"vllm:inter_token_latency_seconds_count{lab}") == 4
    assert delta(f"vllm:request_queue_time_seconds_count{lab}") == 1
    assert 0 <= delta(f"vllm:request_queue_time_seconds_sum{lab}") < 5
    assert _sample(after, 'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"}') == 1
    for g in ("num_requests_running", "num_requests_waiting"):
        assert _sample(after, f"vllm:{g}{lab}") == 0 == _sample(after, f"mla_serve_{g}")
    assert 0 <= _sample(after, f"vllm:kv_cache_usage_perc{lab}") <= 1
    for c in ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits"):
        assert f"vllm:{c}_total{lab}" in after, c


# ---- --chat-template and --generation-config in requests ----

def _recording(engine):
    """Record the SamplingParams of every request the fake engine gets."""
    seen, generate = [], engine.generate

    def record(prompt, params, request_id):
        seen.append(params)
        return generate(prompt, params, request_id)
    engine.generate = record
    return seen


def test_chat_template_replaces_the_tokenizers(client_for, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ '[' + m['content'] + ']' }}{% endfor %}")

    async def run(flag: str) -> tuple[str, str]:
        engine, c = client_for(["--chat-template", flag])
        async with c:
            body = {"messages": [{"role": "user", "content": "hi"}]}
            ids = (await c.post("/tokenize", json=body)).json()["tokens"]
            r = await c.post("/v1/chat/completions", json={**body, "max_tokens": 2})
            assert r.status_code == 200, r.text
            info = (await c.get("/tokenizer_info")).json()["chat_template"]
            return engine.tokenizer.decode(ids), info

    assert asyncio.run(run(str(path))) == ("[hi]", path.read_text())
    inline = "{{ 'inline:' + messages[0]['content'] }}"
    assert asyncio.run(run(inline)) == ("inline:hi", inline)


def test_generation_config_sets_defaults_of_unset_fields(client_for, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
         "repetition_penalty": 1.1, "max_new_tokens": 3}))

    async def run(argv: list[str]):
        engine, c = client_for(argv)
        seen = _recording(engine)
        async with c:
            r = await c.post("/v1/completions", json={"prompt": "hi"})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == seen[0].max_tokens
            await c.post("/v1/completions",
                         json={"prompt": "hi", "temperature": 0, "max_tokens": 5, "top_k": -1})
            await c.post("/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": "hi"}]})
            await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4})
        return seen

    plain, given, chat, chat_given = asyncio.run(run(["--generation-config", str(tmp_path)]))
    got = (plain.temperature, plain.top_p, plain.top_k, plain.min_p, plain.repetition_penalty,
           plain.max_tokens)
    assert got == (0.6, 0.95, 20, 0.05, 1.1, 3)
    # a field the request sets keeps its value, however it compares with the default
    assert (given.temperature, given.max_tokens, given.top_p) == (0.0, 5, 0.95)
    assert given.top_k <= 0  # the request's -1 (off) stands, not the default 20
    assert (chat.temperature, chat.max_tokens) == (0.6, 3)
    assert chat_given.max_tokens == 4
    # `vllm` and the fake engine's `auto` (it has no model directory) leave the API's defaults
    for argv in (["--generation-config", "vllm"], []):
        plain = asyncio.run(run(argv))[0]
        assert (plain.temperature, plain.top_p, plain.top_k, plain.max_tokens) == (1.0, 1.0, 0, 16)


def test_generation_config_auto_reads_the_model_directory(tmp_path):
    from server.overrides import load_generation_defaults

    # the bundled model's file has none of the keys: its defaults are the API's (lm_eval and
    # the tests that rely on server defaults see no change)
    assert json.loads((TINY_MODEL / "generation_config.json").read_text()).keys() & {
        "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens"} == set()
    assert load_generation_defaults("auto", str(TINY_MODEL)) == {}
    assert load_generation_defaults("auto", str(tmp_path)) == {}  # no file: no defaults
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.3, "top_k": 5}')
    assert load_generation_defaults("auto", str(tmp_path)) == {"temperature": 0.3, "top_k": 5}
    assert load_generation_defaults("vllm", str(tmp_path)) == {}
    (tmp_path / "generation_config.json").write_text('{"temperature": -5}')
    with pytest.raises(ValueError, match=r"--generation-config: .*temperature.*got -5"):
        load_generation_defaults("auto", str(tmp_path))


# Every series the example dashboard in vLLM's repository queries
# (examples/online_serving/prometheus_grafana/grafana.json, the version without the V0 swap and
# CPU-cache panels), each with its model_name label.
GRAFANA_SERIES = [
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_sum", "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
]


def test_grafana_dashboard_series_are_served(client_for):
    async def run() -> str:
        _, c = client_for([], names=["dash"])
        async with c:
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "n": 2})
            assert r.status_code == 200
            return (await c.get("/metrics")).text

    text = asyncio.run(run())
    lines = text.splitlines()
    for name in GRAFANA_SERIES:
        assert any(ln.startswith(name + "{") and 'model_name="dash"' in ln for ln in lines), name
    assert _sample(text, 'vllm:request_max_num_generation_tokens_count{engine="0",model_name="dash"}') == 1
    # the n = 2 request is two engine requests to vLLM: each choice's latencies observed on its own
    for name, count in (("time_to_first_token_seconds", 2), ("e2e_request_latency_seconds", 2),
                        ("inter_token_latency_seconds", 4), ("request_params_n", 1)):
        assert _sample(text, f'vllm:{name}_count{{engine="0",model_name="dash"}}') == count, name
    assert _sample(text, 'vllm:request_max_num_generation_tokens_sum{engine="0",model_name="dash"}') == 3
    for reason in ("stop", "abort", "error"):  # every finish reason's series exists from the start, as vLLM's
        series = f'vllm:request_success_total{{engine="0",finished_reason="{reason}",model_name="dash"}}'
        assert _sample(text, series) == 0
    assert _sample(text, 'vllm:gpu_cache_usage_perc{engine="0",model_name="dash"}') == _sample(
        text, 'vllm:kv_cache_usage_perc{engine="0",model_name="dash"}')
    for kind in ("queries", "hits"):  # vLLM's older names, beside the current ones
        assert _sample(text, f'vllm:gpu_prefix_cache_{kind}_total{{engine="0",model_name="dash"}}') == _sample(
            text, f'vllm:prefix_cache_{kind}_total{{engine="0",model_name="dash"}}')
    # vLLM's bucket boundaries (vllm/v1/metrics), so that alerts' `le` values match
    for name, top, count in (("time_to_first_token_seconds", "2560.0", 22),
                             ("inter_token_latency_seconds", "80.0", 19),
                             ("time_per_output_token_seconds", "80.0", 19),
                             ("e2e_request_latency_seconds", "7680.0", 21),
                             ("request_queue_time_seconds", "7680.0", 21)):
        bounds = [ln.split('le="')[1].split('"')[0] for ln in lines if ln.startswith(f"vllm:{name}_bucket{{")]
        assert bounds[-2:] == [top, "+Inf"] and len(bounds) == count + 1, (name, bounds)


def test_reset_prefix_cache_route_on_the_real_engine():
    """POST /reset_prefix_cache (and SGLang's /flush_cache): a prompt sent after it hits none of
    the blocks cached before it, and blocks cached after it hit again; behind --api-key."""
    from types import SimpleNamespace

    from engine.async_llm import AsyncLLM
    from server.api_server import build_app

    def hits(text: str) -> float:
        return _sample(text, 'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"}')

    async def run():
        llm = AsyncLLM(EngineArgs(model=str(TINY_MODEL), device="cpu", num_kv_blocks=64, block_size=16,
                                  served_model_name=["tiny"]))
        try:
            app = build_app(llm, SimpleNamespace(api_key="k"))
            auth = {"Authorization": "Bearer k"}
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                async def send() -> float:
                    r = await c.post("/v1/completions", headers=auth,
                                     json={"prompt": list(range(5, 45)), "max_tokens": 2})
                    assert r.status_code == 200
                    await asyncio.sleep(0.2)  # the core's stats of that step reach the front end
                    return hits((await c.get("/metrics")).text)
                seen = [await send(), await send()]  # the second hits the first's 2 full blocks
                assert (await c.post("/reset_prefix_cache")).status_code == 401
                r = await c.post("/reset_prefix_cache?reset_running_requests=true", headers=auth)
                assert r.status_code == 200
                seen.append(await send())  # nothing found
                seen.append(await send())  # the blocks cached after the reset
                assert (await c.get("/flush_cache", headers=auth)).status_code == 200
                seen.append(await send())
                bad = await c.post("/reset_prefix_cache?reset_running_requests=maybe", headers=auth)
                return seen, bad, (await c.get("/metrics")).text
        finally:
            llm.shutdown()
    seen, bad, text = asyncio.run(run())
    assert [b - a for a, b in zip(seen, seen[1:])] == [32, 0, 32, 0], seen
    # per finished request: the prompt tokens found in the cache, and those its prefill computed
    lab = '{engine="0",model_name="tiny"}'
    assert _sample(text, f"vllm:prompt_tokens_cached_total{lab}") == hits(text) == 64
    assert _sample(text, f"vllm:request_prefill_kv_computed_tokens_count{lab}") == 5
    assert _sample(text, f"vllm:request_prefill_kv_computed_tokens_sum{lab}") == 5 * 40 - 64
    assert bad.status_code == 400 and "reset_running_requests" in bad.text
