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
from tests.test_responses_api import GREEDY, _server, create, events_of, sse_events as sse, text_of

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


def test_background_needs_the_store(slow):
    r = httpx.post(f"{slow.url}/v1/responses", json={"input": "hi", "background": True, "store": False}, timeout=30)
    assert_error(r, 400, "background")


def replay(server, rid: str, starting_after: int | None = None, status: int = 200) -> list[dict]:
    params = {"stream": "true"} if starting_after is None else {"stream": "true", "starting_after": starting_after}
    r = httpx.get(f"{server.url}/v1/responses/{rid}", params=params, timeout=60)
    assert r.status_code == status, r.text
    return sse(r.text)


def test_a_background_stream_goes_on_without_its_client_and_is_streamed_again(slow):
    """background + stream: the POST streams the events; a client that leaves after the first
    deltas stops only its own stream; GET ?stream=true replays every event (the same ones a
    foreground stream sends) and, with starting_after, those after a sequence number; the
    stored response is the stream's final one."""
    body = {"input": "hi", "max_output_tokens": 40, **GREEDY}
    with httpx.stream("POST", f"{slow.url}/v1/responses", json={**body, "background": True, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        seen = ""
        for chunk in r.iter_text():
            seen += chunk
            if "response.output_text.delta" in seen:
                break  # the client leaves mid-response
    first = sse(seen[:seen.rindex("\n\n") + 2])
    rid = first[0]["response"]["id"]
    assert first[0]["type"] == "response.created" and first[0]["response"]["background"] is True
    done = poll(slow, rid, lambda x: x["status"] not in ("queued", "in_progress"))
    assert done["status"] == "incomplete" and done["usage"]["output_tokens"] == 40  # it went on
    events = replay(slow, rid)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[:len(first)] == first
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"] == done
    fg = events_of(slow, body)  # the same request streamed in the foreground: the same events
    assert [e["type"] for e in fg] == [e["type"] for e in events]
    assert text_of(fg[-1]["response"]) == text_of(done)
    tail = replay(slow, rid, starting_after=5)
    assert tail == events[6:]
    assert replay(slow, rid, starting_after=len(events) + 10) == []
    assert_error(httpx.get(f"{slow.url}/v1/responses/{rid}", params={"stream": "true", "starting_after": -2},
                           timeout=30), 400, "starting_after")


def test_a_running_background_stream_is_followed_and_cancelled(slow):
    """GET ?stream=true on a running background stream follows it as it is written, from the
    sequence number asked; a cancel ends the followers' streams and stores it cancelled."""
    body = {"input": "hi", "max_output_tokens": 500, "background": True, "stream": True}
    with httpx.stream("POST", f"{slow.url}/v1/responses", json=body, timeout=60) as r:
        head = ""
        for chunk in r.iter_text():
            head += chunk
            if "\n\n" in head:
                break
    rid = sse(head[:head.index("\n\n") + 2])[0]["response"]["id"]
    poll(slow, rid, lambda x: x["status"] == "in_progress")
    with httpx.stream("GET", f"{slow.url}/v1/responses/{rid}", params={"stream": "true", "starting_after": 1},
                      timeout=60) as follower:
        got = ""
        it = follower.iter_text()
        while got.count("response.output_text.delta") < 3:
            got += next(it)
        c = httpx.post(f"{slow.url}/v1/responses/{rid}/cancel", timeout=30)
        assert c.status_code == 200 and c.json()["status"] == "cancelled"
        got += "".join(it)  # the follower's stream ends with the response
    events = sse(got)
    assert events[0]["sequence_number"] == 2
    assert [e["sequence_number"] for e in events] == list(range(2, 2 + len(events)))
    assert get(slow, rid)["status"] == "cancelled"
    assert any(x.startswith(rid) for x in slow.engine.aborted)


def test_only_a_background_stream_is_streamed_again(slow):
    fg = create(slow, {"input": "hi", "max_output_tokens": 2})
    assert_error(httpx.get(f"{slow.url}/v1/responses/{fg['id']}", params={"stream": "true"}, timeout=30),
                 400, "stream")
    bg = create(slow, {"input": "hi", "max_output_tokens": 2, "background": True})
    assert_error(httpx.get(f"{slow.url}/v1/responses/{bg['id']}", params={"stream": "true"}, timeout=30),
                 400, "stream")
    assert_error(httpx.get(f"{slow.url}/v1/responses/resp_none", params={"stream": "true"}, timeout=30),
                 404, "response_id")


def test_a_running_id_is_not_reused(slow):
    body = {"input": "hi", "max_output_tokens": 500, "background": True}
    headers = {"X-Request-Id": "mine"}
    r = create(slow, body, headers=headers)
    assert r["id"] == "resp_mine"
    assert_error(httpx.post(f"{slow.url}/v1/responses", json=body, headers=headers, timeout=30), 400, "request_id")
    fg = {"input": "hi", "max_output_tokens": 1}  # a stored foreground response would replace it
    assert_error(httpx.post(f"{slow.url}/v1/responses", json=fg, headers=headers, timeout=30), 400, "request_id")
    httpx.post(f"{slow.url}/v1/responses/resp_mine/cancel", timeout=30)


def test_a_foreground_response_does_not_replace_a_background_one_of_its_id(slow):
    """A stored foreground response running when a background one of the same id starts (which
    check_running cannot see: only background responses are marked running) leaves the background
    one's entry alone when it finishes, and says so (store false); GET keeps polling the
    background one."""
    import threading
    headers = {"X-Request-Id": "twice"}
    fg = {}
    t = threading.Thread(target=lambda: fg.update(create(slow, {"input": "hi", "max_output_tokens": 15},
                                                         headers=headers)))
    t.start()
    time.sleep(0.1)  # the foreground one is running (20 ms a token)
    bg = create(slow, {"input": "hi", "max_output_tokens": 500, "background": True}, headers=headers)
    assert bg["id"] == "resp_twice"
    t.join(30)
    assert fg["id"] == "resp_twice" and fg["store"] is False and fg["usage"]["output_tokens"] == 15
    assert get(slow, "resp_twice")["status"] in ("queued", "in_progress")  # still the background one
    httpx.post(f"{slow.url}/v1/responses/resp_twice/cancel", timeout=30)
    assert poll(slow, "resp_twice", lambda x: x["status"] == "cancelled")["status"] == "cancelled"


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


def test_event_logs_live_and_go_with_their_entries():
    """An event log is kept only with its entry: put with `events` (or attach_events) keeps it,
    any other put or a delete of the id drops it, and so does a put too large to keep; its bytes
    count against the byte bound (evicting older entries for it), and a log that would not fit
    with its entry is not kept."""
    from server.responses_background import EventLog
    from server.responses_store import ResponseStore

    def ev(n: int) -> str:
        return f'event: x\ndata: {{"type": "x", "sequence_number": {n}}}\n\n'
    store = ResponseStore(max_entries=10, max_bytes=1000)
    log = EventLog()
    store.put("a", b"{}", [], 0, 100, events=log)
    store.put("a", b"{}", [], 0, 100, events=log)  # queued, then in_progress: kept
    assert store.event_logs["a"] is log and store.held_bytes() == 100
    log.extend(ev(0) + ev(1))
    assert len(log.events) == 2 and store.held_bytes() == 100 + log.nbytes
    store.put("b", b"{}", [], 0, 850)  # a's entry and log go: 100 + log + 850 > 1000 (950 without it)
    assert store.get("a") is None and "a" not in store.event_logs and store.get("b") is not None
    store.put("c", b"{}", [], 0, 10, events=EventLog())
    store.put("c", b"{}", [], 0, 10)  # the id reused by a response without events: dropped
    assert "c" not in store.event_logs and store.get("c") is not None
    assert store.attach_events("c", EventLog()) and store.delete("c") and "c" not in store.event_logs
    store.put("d", b"{}", [], 0, 10, events=EventLog())
    assert not store.put("d", b"{}", [], 0, 5000, events=log)  # too large: neither entry nor log stays
    assert store.get("d") is None and "d" not in store.event_logs
    big = EventLog()
    big.extend(ev(0) * 30)  # ~1.6 KB of events: with its entry over the bound
    assert store.put("e", b"{}", [], 0, 10, events=big) and "e" not in store.event_logs
    assert not store.attach_events("nobody", EventLog()) and "nobody" not in store.event_logs


def test_a_final_response_too_large_to_store_fails_alike_in_the_stream_and_the_store():
    """A background stream whose final response is over --responses-store-max-bytes: the stored
    response is `failed` saying why, and the stream's last event (live and replayed) is the same
    `response.failed`; the log, too large to keep with it, is not kept."""
    engine = FakeEngine(transformers.AutoTokenizer.from_pretrained(TINY_MODEL), max_model_len=1024)
    with _server(engine, ["--responses-store-max-bytes", "6000"]) as s:
        body = {"input": "hi", "max_output_tokens": 300, "background": True, "stream": True,
                "top_logprobs": 5, "include": ["message.output_text.logprobs"], **GREEDY}
        with httpx.stream("POST", f"{s.url}/v1/responses", json=body, timeout=60) as r:
            live = sse(r.read().decode())
        rid = live[0]["response"]["id"]
        stored = get(s, rid)
        assert stored["status"] == "failed" and "--responses-store-max-bytes" in stored["error"]["message"]
        assert live[-1]["type"] == "response.failed" and live[-1]["response"] == stored
        # its events (with logprobs, far over 6,000 bytes) are not kept with it
        assert_error(httpx.get(f"{s.url}/v1/responses/{rid}", params={"stream": "true"}, timeout=30), 400, "stream")


def test_starting_after_must_be_a_sequence_number(slow):
    body = {"input": "hi", "max_output_tokens": 2, "background": True, "stream": True}
    with httpx.stream("POST", f"{slow.url}/v1/responses", json=body, timeout=60) as r:
        rid = sse(r.read().decode())[0]["response"]["id"]
    for bad in ("abc", "1.5", "-1"):
        assert_error(httpx.get(f"{slow.url}/v1/responses/{rid}", params={"stream": "true", "starting_after": bad},
                               timeout=30), 400, "starting_after")


def test_an_event_log_is_followed_from_a_sequence_number():
    """EventLog.follow: what is there after `after`, then each new write, until the log closes."""
    import asyncio

    from server.responses_background import EventLog

    def ev(n: int) -> str:
        return f'event: e\ndata: {{"type": "e", "sequence_number": {n}}}\n\n'

    async def main():
        log = EventLog()
        log.extend(ev(0) + ev(1))
        got = []

        async def reader():
            async for chunk in log.follow(0):
                got.append(chunk)
        task = asyncio.ensure_future(reader())
        await asyncio.sleep(0.01)
        log.extend(ev(2))
        await asyncio.sleep(0.01)
        log.close()
        await asyncio.wait_for(task, 5)
        assert got == [ev(1), ev(2)]
        assert [c async for c in log.follow(-1)] == [ev(0) + ev(1) + ev(2)]
        assert [c async for c in log.follow(7)] == []
    asyncio.run(main())
