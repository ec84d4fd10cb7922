"""Inputs found by fuzzing the server (2026-12-05), each once a 500, a stall of every other request,
or unbounded growth: JSON nested past the parser, huge choice lists, invented HTTP methods, large
whole responses and huge prompts' tokenizing (tests/test_server_robustness.py has the rest)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import transformers

from server.api_server import build_app
from tests.server_fixtures import TINY_MODEL, FakeEngine, InProcessServer, assert_error, post


@pytest.fixture(scope="module")
def fake():
    engine = FakeEngine(transformers.AutoTokenizer.from_pretrained(TINY_MODEL), max_model_len=128)
    with InProcessServer(build_app(engine)) as s:
        s.engine = engine
        yield s


def test_nesting_beyond_the_json_parser_is_a_400(fake):
    deep = "[" * 5000 + "]" * 5000
    assert_error(post(fake, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "guided_json": deep}),
                 400, "guided_json")
    assert_error(post(fake, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                "structured_outputs": {"json": deep}}), 400, "structured_outputs")
    for body, says in (('{"prompt":"hi","x":' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
                       ('{"prompt":"hi","max_tokens":1' + "0" * 4400 + "}", "a number too long to parse"),
                       (b'{"prompt":"\xff"}', "not valid JSON text")):
        for path in ("/invocations", "/v1/completions"):
            r = httpx.post(f"{fake.url}{path}", content=body, headers={"content-type": "application/json"},
                           timeout=60)
            assert r.status_code == 400 and says in r.json()["error"]["message"], (path, r.text)


def test_forced_tool_output_nested_beyond_the_parser_is_no_call():
    from server.tool_calls import forced_calls
    assert forced_calls("[" * 5000) is None  # incomplete: stopped by max_tokens
    assert forced_calls("[" * 5000 + "]" * 5000) is None


def test_guided_choice_count_is_bounded(fake):
    from server.request_fields import MAX_CHOICES
    many = [f"c{i}" for i in range(MAX_CHOICES + 1)]
    for body in ({"guided_choice": many}, {"structured_outputs": {"choice": many}}):
        err = assert_error(post(fake, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **body}), 400)
        assert f"at most {MAX_CHOICES}" in err["message"], err
    r = post(fake, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "guided_choice": many[:MAX_CHOICES]})
    assert r.status_code == 200, r.text
    from server.request_fields import MAX_CHOICE_CHARS
    long = ["x" * (MAX_CHOICE_CHARS // 2), "y" * (MAX_CHOICE_CHARS // 2 + 1)]
    err = assert_error(post(fake, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "guided_choice": long}), 400)
    assert f"{MAX_CHOICE_CHARS + 1} characters in all; at most {MAX_CHOICE_CHARS}" in err["message"], err


def test_invented_http_methods_share_one_metrics_label(fake):
    with socket.create_connection(("127.0.0.1", fake.port)) as s:
        for i in range(3):
            s.sendall(f"X{i:05d} /v1/models HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            time.sleep(0.05)
    text = httpx.get(f"{fake.url}/metrics", timeout=30).text
    assert "X00001" not in text and 'method="other"' in text


def test_a_large_whole_response_is_built_off_the_event_loop(fake, monkeypatch):
    """Past OFF_LOOP_ENTRIES tokens and alternatives the body is built on a worker thread; the
    answer is the same as built inline."""
    import server.handler as handler
    body = {"prompt": [[5, 6]] * 2, "n": 3, "max_tokens": 40, "logprobs": 5, "seed": 1, "temperature": 1.0}
    inline = post(fake, "/v1/completions", body).json()
    threads, to_thread = [], handler.asyncio.to_thread

    async def counting(fn, *a, **k):
        threads.append(fn.__name__)
        return await to_thread(fn, *a, **k)
    monkeypatch.setattr(handler, "OFF_LOOP_ENTRIES", 0)
    monkeypatch.setattr(handler.asyncio, "to_thread", counting)  # asyncio's own: undone at teardown
    off = post(fake, "/v1/completions", body).json()
    assert "whole" in threads and {k: v for k, v in off.items() if k not in ("id", "created")} == \
        {k: v for k, v in inline.items() if k not in ("id", "created")}


def test_huge_texts_tokenize_in_a_lane_of_their_own():
    """Eight prompts past LARGE_CHARS queue on the large lane's one thread; a small prompt's
    tokenizing still gets a thread at once (with one pool of 6 threads it waited for all eight)."""
    import asyncio

    from common.offload import LARGE_CHARS, off_loop
    release = threading.Event()

    async def go():
        big = [asyncio.create_task(off_loop(LARGE_CHARS + 1, release.wait, 30)) for _ in range(8)]
        await asyncio.sleep(0.05)
        try:
            return await asyncio.wait_for(off_loop(10, lambda: threading.current_thread().name), 10)
        finally:
            release.set()
            await asyncio.gather(*big)
    assert asyncio.run(go()).startswith("tokenize_")


def test_an_empty_body_is_named(fake):
    for path in ("/v1/completions", "/v1/chat/completions"):
        err = assert_error(post(fake, path, b""), 400)
        assert err["message"].startswith("request body is empty"), err


def test_a_long_unknown_path_is_not_echoed_whole(fake):
    r = httpx.get(f"{fake.url}/{'a' * 60_000}", timeout=30)
    err = assert_error(r, 404)
    assert len(err["message"]) < 300 and "(60001 characters)" in err["message"], err
