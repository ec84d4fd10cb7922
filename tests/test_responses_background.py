"""Background responses (`POST /v1/responses` with `background: true`): answered at once as
queued, run as a task, polled with GET until final, cancelled by POST .../cancel or DELETE, on a
fake engine whose tokens take a while."""

from __future__ import annotations

import os
import time

import httpx
import pytest
import transformers

from tests.server_fixtures import OFFLINE_ENV, TINY_MODEL, FakeEngine, assert_error
from tests.test_responses_api import GREEDY, _server, create, text_of

os.environ.update(OFFLINE_ENV)


@pytest.fixture(scope="module")
def slow():
    """A fake engine taking 20 ms a token, the store at its defaults."""
    engine = FakeEngine(transformers.AutoTokenizer.from_pretrained(TINY_MODEL), max_model_len=1024,
                        step_delay=0.02)
    with _server(engine, []) as s:
        s.engine = engine
        yield s


def get(server, rid: str, status: int = 200) -> dict:
    r = httpx.get(f"{server.url}/v1/responses/{rid}", timeout=30)
    assert r.status_code == status, r.text
    return r.json()


def poll(server, rid: str, until, timeout: float = 20.0) -> dict:
    """GET the response until `until(response)` holds."""
    end = time.monotonic() + timeout
    while True:
        r = get(server, rid)
        if until(r) or time.monotonic() > end:
            return r
        time.sleep(0.02)


def test_a_background_response_is_queued_then_polled_to_its_end(slow):
    body = {"input": "hi", "max_output_tokens": 6, **GREEDY}
    r = create(slow, {**body, "background": True})
    assert r["status"] == "queued" and r["background"] is True and r["output"] == [] and r["usage"] is None
    items = httpx.get(f"{slow.url}/v1/responses/{r['id']}/input_items", timeout=30).json()["data"]
    assert [it["content"][0]["text"] for it in items] == ["hi"]  # kept from the start
    done = poll(slow, r["id"], lambda x: x["status"] not in ("queued", "in_progress"))
    assert done["status"] == "incomplete" and done["background"] is True  # cut by max_output_tokens
    assert done["usage"]["output_tokens"] == 6
    fg = create(slow, body)  # the same request in the foreground
    assert fg["background"] is False and text_of(done) == text_of(fg)
    # finished: it continues a conversation, and it can no longer be cancelled
    nxt = create(slow, {"input": "more", "previous_response_id": r["id"], "max_output_tokens": 1})
    assert nxt["previous_response_id"] == r["id"]
    assert_error(httpx.post(f"{slow.url}/v1/responses/{r['id']}/cancel"), 400, "response_id")


def test_cancel_stops_a_running_background_response(slow):
    r = create(slow, {"input": "hi", "max_output_tokens": 500, "background": True})
    running = poll(slow, r["id"], lambda x: x["status"] == "in_progress")
    assert running["status"] == "in_progress"
    # a running response does not continue a conversation yet
    err = assert_error(httpx.post(f"{slow.url}/v1/responses", json={
        "input": "x", "previous_response_id": r["id"]}), 400, "previous_response_id")
    assert "still running" in err["message"]
    c = httpx.post(f"{slow.url}/v1/responses/{r['id']}/cancel", timeout=30)
    assert c.status_code == 200 and c.json()["status"] == "cancelled", c.text
    assert get(slow, r["id"])["status"] == "cancelled"
    assert any(rid.startswith(r["id"]) for rid in slow.engine.aborted)  # the engine let it go
    again = httpx.post(f"{slow.url}/v1/responses/{r['id']}/cancel", timeout=30)  # idempotent, as OpenAI's
    assert again.status_code == 200 and again.json()["status"] == "cancelled"


def test_delete_cancels_a_running_background_response(slow):
    r = create(slow, {"input": "hi", "max_output_tokens": 500, "background": True})
    poll(slow, r["id"], lambda x: x["status"] == "in_progress")
    d = httpx.delete(f"{slow.url}/v1/responses/{r['id']}", timeout=30)
    assert d.status_code == 200 and d.json()["deleted"] is True
    assert_error(httpx.get(f"{slow.url}/v1/responses/{r['id']}"), 404, "response_id")
    assert any(rid.startswith(r["id"]) for rid in slow.engine.aborted)


@pytest.mark.parametrize("extra", [{"stream": True}, {"store": False}])
def test_background_needs_the_store_and_no_stream(slow, extra):
    r = httpx.post(f"{slow.url}/v1/responses", json={"input": "hi", "background": True, **extra}, timeout=30)
    assert_error(r, 400, "background")


def test_a_running_id_is_not_reused(slow):
    body = {"input": "hi", "max_output_tokens": 500, "background": True}
    headers = {"X-Request-Id": "mine"}
    r = create(slow, body, headers=headers)
    assert r["id"] == "resp_mine"
    assert_error(httpx.post(f"{slow.url}/v1/responses", json=body, headers=headers, timeout=30), 400, "request_id")
    fg = {"input": "hi", "max_output_tokens": 1}  # a stored foreground response would replace it
    assert_error(httpx.post(f"{slow.url}/v1/responses", json=fg, headers=headers, timeout=30), 400, "request_id")
    httpx.post(f"{slow.url}/v1/responses/resp_mine/cancel", timeout=30)


def test_no_more_running_than_the_store_keeps():
    engine = FakeEngine(transformers.AutoTokenizer.from_pretrained(TINY_MODEL), max_model_len=1024,
                        step_delay=0.02)
    with _server(engine, ["--responses-store-size", "1"]) as s:
        body = {"input": "hi", "max_output_tokens": 500, "background": True}
        first = create(s, body)
        err = assert_error(httpx.post(f"{s.url}/v1/responses", json=body, timeout=30), 429, "background")
        assert "--responses-store-size" in err["message"]
        httpx.post(f"{s.url}/v1/responses/{first['id']}/cancel", timeout=30)
        create(s, {**body, "max_output_tokens": 1})  # room again once it stopped
