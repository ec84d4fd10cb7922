"""vLLM's front-end flags (server/frontend_options.py): --enable-prompt-tokens-details,
--enable-force-include-usage, --return-tokens-as-token-ids, --enable-request-id-headers,
--max-log-len and --enable-server-load-tracking with GET /load; on the fake engine, and the
cached-token count once on the real one."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
import transformers

from common.args import EngineArgs
from server.api_server import build_app
from server.cli import build_parser
from tests.server_fixtures import TINY_MODEL, FakeEngine

CACHED = 2  # the prompt tokens CachedEngine says the prefix cache held, per prompt
NEW_FLAGS = ["--enable-prompt-tokens-details", "--enable-force-include-usage",
             "--return-tokens-as-token-ids", "--enable-request-id-headers", "--max-log-len",
             "--enable-server-load-tracking"]


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(TINY_MODEL)


class CachedEngine(FakeEngine):
    """The fake engine, reporting CACHED prompt tokens found in the prefix cache."""

    async def generate(self, prompt, params, request_id):
        async for out in super().generate(prompt, params, request_id):
            out.num_cached_tokens = CACHED
            yield out


def client(engine, *flags: str) -> httpx.AsyncClient:
    app = build_app(engine, build_parser().parse_args(["--model", str(TINY_MODEL), *flags]))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def run(coro):
    return asyncio.run(coro)


def events(r: httpx.Response) -> list[dict]:
    """The JSON events of an SSE body ([DONE] checked and dropped)."""
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", data
    return [json.loads(d) for d in data[:-1]]


CMPL = {"prompt": ["hi", "there"], "max_tokens": 3}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def test_prompt_tokens_details(tok):
    async def go(*flags):
        async with client(CachedEngine(tok), *flags) as c:
            whole = [(await c.post("/v1/completions", json=CMPL)).json()["usage"],
                     (await c.post("/v1/chat/completions", json=CHAT)).json()["usage"]]
            opts = {"stream": True, "stream_options": {"continuous_usage_stats": True}}
            streamed = [events(await c.post("/v1/completions", json={**CMPL, **opts})),
                        events(await c.post("/v1/chat/completions", json={**CHAT, **opts}))]
        return whole, streamed

    whole, streamed = run(go("--enable-prompt-tokens-details"))
    # completions: over its two prompts; chat: its one
    assert [u["prompt_tokens_details"] for u in whole] == [{"cached_tokens": 2 * CACHED},
                                                          {"cached_tokens": CACHED}]
    for chunks, want in zip(streamed, (2 * CACHED, CACHED)):
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] == {
            "cached_tokens": want}
        # as vLLM: the usage so far of each chunk has no details, the final usage has
        assert all("prompt_tokens_details" not in ch["usage"] for ch in chunks[:-1])
    whole, streamed = run(go())
    assert all("prompt_tokens_details" not in u for u in whole)
    assert all("prompt_tokens_details" not in ch["usage"] for s in streamed for ch in s)


def test_prompt_tokens_details_from_the_real_prefix_cache():
    from engine.async_llm import AsyncLLM

    async def go():
        llm = AsyncLLM(EngineArgs(model=str(TINY_MODEL), device="cpu", num_kv_blocks=32))
        try:
            async with client(llm, "--enable-prompt-tokens-details") as c:
                body = {"prompt": list(range(10, 50)), "max_tokens": 1}  # 40 tokens: 2 full blocks
                return [(await c.post("/v1/completions", json=body)).json()["usage"]
                        for _ in range(2)]
        finally:
            llm.shutdown()

    first, second = run(go())
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["prompt_tokens_details"] == {"cached_tokens": 32}


@pytest.mark.parametrize("path,body", [("/v1/completions", CMPL), ("/v1/chat/completions", CHAT)])
def test_force_include_usage(tok, path, body):
    async def go(*flags, **extra):
        async with client(FakeEngine(tok), *flags) as c:
            return events(await c.post(path, json={**body, "stream": True, **extra}))

    # vLLM's forced usage: the usage so far in every chunk and a usage chunk at the end, whatever
    # stream_options says
    for extra in ({}, {"stream_options": {"include_usage": False}}):
        chunks = run(go("--enable-force-include-usage", **extra))
        assert all(ch["usage"]["prompt_tokens"] > 0 for ch in chunks)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == (
            3 * len(body.get("prompt", [0])))
        assert sum(ch["choices"] == [] for ch in chunks) == 1
    chunks = run(go())
    assert all(ch["usage"] is None for ch in chunks) and all(ch["choices"] for ch in chunks)


def test_return_tokens_as_token_ids(tok):
    async def go(*flags, **extra):
        async with client(FakeEngine(tok), *flags) as c:
            cmpl = (await c.post("/v1/completions", json={
                "prompt": "hello there", "max_tokens": 3, "logprobs": 2, "echo": True,
                "prompt_logprobs": 1, "temperature": 0, **extra})).json()["choices"][0]
            chat = (await c.post("/v1/chat/completions", json={
                **CHAT, "logprobs": True, "top_logprobs": 2, "temperature": 0,
                **extra})).json()["choices"][0]["logprobs"]["content"]
            return cmpl, chat

    cmpl, chat = run(go("--return-tokens-as-token-ids"))
    lp = cmpl["logprobs"]
    ids = tok("hello there")["input_ids"]
    assert lp["tokens"][:len(ids)] == [f"token_id:{t}" for t in ids]  # the echoed prompt too
    assert all(t.startswith("token_id:") for t in lp["tokens"])
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"][1:] for k in top)
    # vLLM's prompt_logprobs keep each token's text in decoded_token
    row = cmpl["prompt_logprobs"][1]
    assert row[str(ids[1])]["decoded_token"] == tok.decode([ids[1]])
    for e in chat:
        tid = int(e["token"].removeprefix("token_id:"))
        # as vLLM: the sampled token's bytes are its own (its text's where whole), an
        # alternative's its shown name's
        assert bytes(e["bytes"]).decode("utf-8", errors="replace") == tok.decode([tid])
        for alt in e["top_logprobs"]:
            assert alt["token"].startswith("token_id:") and bytes(alt["bytes"]).decode() == alt["token"]
    # a request's own false wins over the flag; without the flag tokens are text
    for flags, extra in ((["--return-tokens-as-token-ids"], {"return_tokens_as_token_ids": False}),
                         ([], {})):
        cmpl, chat = run(go(*flags, **extra))
        assert not any(t.startswith("token_id:") for t in cmpl["logprobs"]["tokens"])
        assert not any(e["token"].startswith("token_id:") for e in chat)


def test_request_id_headers(tok):
    async def go(*flags):
        async with client(FakeEngine(tok), *flags) as c:
            return [await c.post("/v1/completions", json=CMPL, headers={"X-Request-Id": "trace-7"}),
                    await c.post("/v1/chat/completions", json=CHAT),
                    await c.post("/v1/completions", json={**CMPL, "model": "nope"}),
                    await c.get("/health"),
                    await c.post("/v1/completions", json=CMPL, headers={"X-Request-Id": "x" * 8000})]

    echoed, generated, refused, health, oversized = run(go("--enable-request-id-headers"))
    # refused as too long (400 naming the limit), and not echoed back
    assert oversized.status_code == 400 and "at most 256" in oversized.json()["error"]["message"]
    assert len(oversized.headers["x-request-id"]) == 32
    assert echoed.headers["x-request-id"] == "trace-7" and echoed.json()["id"] == "cmpl-trace-7"
    rid = generated.headers["x-request-id"]
    assert len(rid) == 32 and int(rid, 16) >= 0  # a fresh uuid4 hex
    assert refused.status_code == 404 and len(refused.headers["x-request-id"]) == 32
    assert health.headers["x-request-id"] not in (rid, refused.headers["x-request-id"])
    assert all("x-request-id" not in r.headers for r in run(go()))


def test_max_log_len(tok, caplog):
    async def go(*flags):
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="server.frontend_options"):
            async with client(FakeEngine(tok), *flags) as c:
                await c.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 1})
                await c.post("/v1/completions", json={"prompt": [5, 6, 7, 8, 9], "max_tokens": 1})
                await c.post("/v1/chat/completions", json=CHAT)
        return [r.getMessage() for r in caplog.records if r.name == "server.frontend_options"]

    logged = run(go("--enable-log-requests", "--max-log-len", "3"))
    assert len(logged) == 3
    assert "prompt: 'hel', prompt_token_ids: None" in logged[0]
    assert "prompt: None, prompt_token_ids: [5, 6, 7]" in logged[1]
    assert logged[2].startswith("request chatcmpl-") and "prompt_token_ids: [" in logged[2]
    assert len(logged[2].split("prompt_token_ids: [")[1].rstrip("]").split(", ")) == 3
    full = run(go("--enable-log-requests"))
    assert "prompt: 'hello world'" in full[0] and "[5, 6, 7, 8, 9]" in full[1]
    assert run(go("--max-log-len", "3")) == []  # nothing without --enable-log-requests


def test_log_outputs(tok, caplog):
    """--enable-log-outputs (with --enable-log-requests): each finished choice's text and token
    ids, cut to --max-log-len, and its finish reason, streamed or not, as vLLM logs them."""
    async def go(*flags):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="server.frontend_options"):
            async with client(FakeEngine(tok), *flags) as c:
                r = await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "n": 2})
                s = await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "stream": True})
                assert r.status_code == s.status_code == 200
        return r.json(), [r.getMessage() for r in caplog.records if "Generated response" in r.getMessage()]

    body, logged = run(go("--enable-log-requests", "--enable-log-outputs", "--max-log-len", "2"))
    assert len(logged) == 3 and all("finish_reason: length" in m for m in logged)
    assert logged[0].startswith("Generated response cmpl-") and "#0: output: " in logged[0] and "#1: " in logged[1]
    assert f"output: {body['choices'][0]['text'][:2]!r}, output_token_ids: [" in logged[0]
    assert len(logged[0].split("output_token_ids: [")[1].split("]")[0].split(", ")) == 2
    assert run(go("--enable-log-outputs"))[1] == []  # nothing without --enable-log-requests


@pytest.mark.parametrize("value,needle", [("-3", "--max-log-len must be >= 0"),
                                          ("abc", "argument --max-log-len: invalid int value")])
def test_bad_max_log_len_names_the_flag(tok, value, needle, capsys):
    from server.cli import main

    try:
        code = main(["--max-log-len", value, "--device", "cpu"])
    except SystemExit as e:  # argparse's own refusal
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("serve: error:") and needle in err[0], err
    with pytest.raises(ValueError, match="--max-log-len"):  # build_app checks it too
        build_app(FakeEngine(tok), type("Args", (), {"max_log_len": -1})())


def test_server_load(tok):
    async def go(*flags):
        async with client(FakeEngine(tok, step_delay=0.1), *flags) as c:  # each stream ~1 s
            before = (await c.get("/load")).json()
            body = {"prompt": "hi", "max_tokens": 10}
            streams = [asyncio.create_task(c.post("/v1/completions", json={**body, "stream": True})),
                       asyncio.create_task(c.post("/v1/chat/completions", json={
                           **CHAT, "max_tokens": 10}))]
            # Poll while both streams run (no fixed sleep to race): the count reaches 2 once both
            # requests are in, and no stream can end before its ten 0.1 s steps.
            during = {"server_load": -1}
            for _ in range(50):
                during = (await c.get("/load")).json()
                if during["server_load"] == 2 or all(t.done() for t in streams):
                    break
                await asyncio.sleep(0.01)
            await asyncio.gather(*streams)
            await c.post("/v1/completions", json={**body, "model": "nope"})  # a 404 is counted too
            after = (await c.get("/load")).json()
        return before, during, after

    assert run(go("--enable-server-load-tracking")) == (
        {"server_load": 0}, {"server_load": 2}, {"server_load": 0})
    assert run(go()) == ({"server_load": 0},) * 3  # vLLM's /load without tracking


def test_server_load_counts_behind_a_root_path():
    """uvicorn hands the app a path with --root-path in front (and the prefix in root_path):
    the load count matches the route below it."""
    from server.vllm_compat import LoadTrackingMiddleware
    state = type("State", (), {"server_load_metrics": 0})()
    seen = []

    async def app(scope, receive, send):
        seen.append(state.server_load_metrics)
    mw = LoadTrackingMiddleware(app, state)
    for path, root in (("/llm/v1/completions", "/llm"), ("/v1/chat/completions", ""),
                       ("/llm/health", "/llm"), ("/llm/v1/completions", "")):
        run(mw({"type": "http", "method": "POST", "path": path, "root_path": root}, None, None))
    assert seen == [1, 1, 0, 0] and state.server_load_metrics == 0


def test_help_explains_each_flag():
    p = build_parser()
    for flag in NEW_FLAGS:
        (action,) = [a for a in p._actions if flag in a.option_strings]
        assert len(action.help.split()) >= 8, flag
    text = p.format_help()
    assert all(flag in text for flag in NEW_FLAGS)
