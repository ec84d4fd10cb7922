"""`POST /v1/responses` at its edges (server/responses.py), on fake engines: input items of the
wrong type, fields of the chat route that this route would drop, a response too large for the
store, the store's byte count, and text written after tool calls (whole and streamed alike)."""

from __future__ import annotations

import json
import os

import httpx
import pytest
import transformers

from server.responses_stream import ResponseEvents
from tests.server_fixtures import OFFLINE_ENV, TINY_MODEL, FakeEngine, ScriptedEngine, assert_error
from tests.test_responses_api import (CALLS_BEGIN, CALLS_END, SCRIPTED, WEATHER, _server,
                                      create, events_of, streamed_items, v3_call)

os.environ.update(OFFLINE_ENV)


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(TINY_MODEL)


@pytest.fixture(scope="module")
def small_store(tok):
    """A fake engine; the store keeps 3 responses within 6,000 bytes."""
    with _server(FakeEngine(tok, max_model_len=512), ["--responses-store-size", "3",
                                                      "--responses-store-max-bytes", "6000"]) as s:
        yield s


REFUSED = [
    ({"input": [{"role": ["user"], "content": "x"}]}, "input.0.role"),  # unhashable: a 400, not a 500
    ({"input": [{"role": {"a": 1}, "content": "x"}]}, "input.0.role"),
    # the chat route's fields, which this route does not take: refused, not dropped
    ({"guided_choice": ["yes", "no"]}, "guided_choice"),
    ({"structured_outputs": {"choice": ["yes"]}}, "structured_outputs"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"prompt_logprobs": 2}, "prompt_logprobs"),
    ({"echo": True}, "echo"),
    ({"include_reasoning": False}, "include_reasoning"),
    ({"truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    ({"add_generation_prompt": False}, "add_generation_prompt"),
    ({"previous_input_messages": [{"role": "user", "content": "x"}]}, "previous_input_messages"),
    ({"text": {"format": {"type": "json_object", "schema": {"type": "object"}}}}, "text.format"),
]


@pytest.mark.parametrize("body,param", REFUSED, ids=[p for _, p in REFUSED])
def test_fields_it_would_drop_or_choke_on_are_400s(small_store, body, param):
    r = httpx.post(f"{small_store.url}/v1/responses", json={"input": "hi", **body}, timeout=30)
    assert_error(r, 400, param)


def test_a_call_output_answers_an_earlier_call(small_store):
    """function_call_output needs a function_call of its call_id before it (OpenAI's rule)."""
    out = {"type": "function_call_output", "call_id": "call_9", "output": "ok"}
    r = httpx.post(f"{small_store.url}/v1/responses", json={"input": [out]}, timeout=30)
    assert "call_9" in assert_error(r, 400, "input.0.call_id")["message"]
    call = {"type": "function_call", "call_id": "call_9", "name": "f", "arguments": "{}"}
    r = httpx.post(f"{small_store.url}/v1/responses", json={"input": [out, call]}, timeout=30)
    assert_error(r, 400, "input.0.call_id")  # the output before its call
    many = [{"role": "user", "content": "x"}] * 5000 + [out]  # scanned on the large lane
    r = httpx.post(f"{small_store.url}/v1/responses", json={"input": many}, timeout=30)
    assert_error(r, 400, "input.5000.call_id")
    # (a call and then its output, in one input or across previous_response_id, run:
    # tests/test_responses_api.py, on the tiny model's tool template)


def test_chat_fields_at_their_defaults_pass(small_store):
    create(small_store, {"input": "hi", "max_output_tokens": 2, "use_beam_search": False,
                         "echo": False, "include_reasoning": True, "guided_json": None})


def test_errors_quote_a_long_value_cut_short(small_store):
    err = assert_error(httpx.get(f"{small_store.url}/v1/responses/{'x' * 5000}"), 404, "response_id")
    assert len(err["message"]) < 300
    err = assert_error(httpx.post(f"{small_store.url}/v1/responses", json={
        "input": [{"role": "r" * 100_000, "content": "x"}]}), 400, "input.0.role")
    assert len(err["message"]) < 300


TOOLS = [{"type": "function", "name": f"f{i}", "description": "d" * 500} for i in range(20)]


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_over_the_stores_bytes_says_it_was_not_stored(small_store, stream):
    body = {"input": "hi", "max_output_tokens": 2, "tools": TOOLS, "tool_choice": "none"}
    r = events_of(small_store, body)[-1]["response"] if stream else create(small_store, body)
    assert r["store"] is False  # it said true, and a GET then found nothing
    assert_error(httpx.get(f"{small_store.url}/v1/responses/{r['id']}"), 404, "response_id")
    small = create(small_store, {"input": "hi", "max_output_tokens": 2})
    assert small["store"] is True
    assert httpx.get(f"{small_store.url}/v1/responses/{small['id']}").json() == small


def test_store_evicts_the_oldest_by_count_and_bytes():
    from server.responses_store import ResponseStore

    store = ResponseStore(max_entries=2, max_bytes=100)
    for rid in ("a", "b", "c"):
        assert store.put(rid, {"id": rid}, [], 0, 10)
    assert [store.get(r) is not None for r in "abc"] == [False, True, True] and store.nbytes == 20
    assert store.put("d", {"id": "d"}, [], 0, 95)  # over the bytes with either: both older go
    assert len(store) == 1 and store.nbytes == 95
    assert not store.put("e", {"id": "e"}, [], 0, 101) and store.get("e") is None  # alone too big
    assert store.put("d", {"id": "d2"}, [], 0, 5) and store.get("d").response == {"id": "d2"}
    assert store.nbytes == 5 and store.delete("d") and store.nbytes == 0 and not store.delete("d")
    with pytest.raises(ValueError, match="--responses-store-size"):
        ResponseStore(max_entries=-1)
    # running background responses' entries are never evicted, nor is the one just kept
    store = ResponseStore(max_entries=2, max_bytes=100)
    store.put("a", b"a", [], 0, 1), store.put("b", b"b", [], 0, 1)
    store.running.update(a=None, b=None)
    assert store.put("c", b"c", [], 0, 1) and len(store) == 3 and store.get("c") is not None
    store.running.clear()
    assert store.put("d", b"d", [], 0, 1) and [r for r in "abcd" if store.get(r)] == ["c", "d"]


def test_the_store_counts_the_turns_objects(tok):
    """Forty one-character turns are ~20 KB of Python objects, not the ~3 KB of their text and
    keys that were counted: a response made of them does not fit 16,000 bytes."""
    with _server(FakeEngine(tok, max_model_len=512), ["--responses-store-max-bytes", "16000"]) as s:
        items = [{"role": "user", "content": "a"}] * 40
        assert create(s, {"input": items, "max_output_tokens": 2})["store"] is False
        assert create(s, {"input": items[:4], "max_output_tokens": 2})["store"] is True


def test_arguments_and_text_after_a_call_in_one_delta():
    """A delta that ends a call's arguments and brings text written after the call (several
    tokens in one step): the arguments go to the call, the text to a message after it."""
    events = ResponseEvents({"id": "resp_x"})
    events.start()
    events.feed({"delta": {"content": "Before."}})
    events.feed({"delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                           "function": {"name": "f", "arguments": '{"a": '}}]}})
    events.feed({"delta": {"content": "After.", "tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]},
                 "finish_reason": "stop"})
    got = [(it["type"], it.get("arguments") or it["content"][0]["text"]) for it in events.items]
    assert got == [("message", "Before."), ("function_call", '{"a": 1}'), ("message", "After.")]
    assert [it["status"] for it in events.items] == ["completed"] * 3


@pytest.fixture(scope="module")
def after_calls(tok):
    engine = ScriptedEngine(tok, max_model_len=1024)
    script = f"Think.</think>Before.{CALLS_BEGIN}{v3_call('get_weather', WEATHER)}{CALLS_END}After."
    engine.script = tok(script, add_special_tokens=False)["input_ids"]
    with _server(engine, ["--reasoning-parser", "deepseek_r1", "--enable-auto-tool-choice",
                          "--tool-call-parser", "deepseek_v3"]) as s:
        yield s


def test_text_after_the_calls_is_a_message_after_them_whole_and_streamed(after_calls):
    whole = create(after_calls, SCRIPTED)
    got = [(it["type"], it["arguments"] if it["type"] == "function_call" else it["content"][0]["text"])
           for it in whole["output"]]
    assert got == [("reasoning", "Think."), ("message", "Before."), ("function_call", WEATHER),
                   ("message", "After.")]
    events = events_of(after_calls, SCRIPTED)
    streamed = [(i["done"]["type"], i["deltas"]) for i in streamed_items(events)]
    assert streamed == got
    assert [json.loads(it["arguments"]) for it in events[-1]["response"]["output"]
            if it["type"] == "function_call"] == [json.loads(WEATHER)]


@pytest.fixture(scope="module")
def roomy(tok):
    """A fake engine, the store at its defaults."""
    with _server(FakeEngine(tok, max_model_len=512), []) as s:
        yield s


def test_input_items_lists_the_requests_input_by_page(roomy):
    """GET /v1/responses/{id}/input_items: the request's own input as OpenAI lists it (a string is
    one user message; content as parts; ids kept or made stable), newest first by default,
    paged by limit / after / before, order asc; bad parameters are 400s naming them."""
    url = f"{roomy.url}/v1/responses"
    r = create(roomy, {"input": "hi", "max_output_tokens": 1})
    got = httpx.get(f"{url}/{r['id']}/input_items").json()
    (item,) = got["data"]
    assert item == {"id": item["id"], "type": "message", "role": "user", "status": "completed",
                    "content": [{"type": "input_text", "text": "hi"}]}
    assert got["object"] == "list" and got["first_id"] == got["last_id"] == item["id"] and not got["has_more"]
    items = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a", "id": "msg_mine"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "c"}]}]
    r = create(roomy, {"input": items, "max_output_tokens": 1})
    desc = httpx.get(f"{url}/{r['id']}/input_items").json()["data"]
    assert [it["id"] for it in desc][2] == "msg_mine" and desc[0]["content"][0]["text"] == "c"
    assert desc[3]["content"] == [{"type": "input_text", "text": "be brief"}] and desc[3]["role"] == "system"
    assert httpx.get(f"{url}/{r['id']}/input_items").json()["data"] == desc  # the same ids each time
    asc = httpx.get(f"{url}/{r['id']}/input_items", params={"order": "asc"}).json()["data"]
    assert asc == desc[::-1]
    page = httpx.get(f"{url}/{r['id']}/input_items", params={"limit": 2}).json()
    assert page["data"] == desc[:2] and page["has_more"] and page["last_id"] == desc[1]["id"]
    rest = httpx.get(f"{url}/{r['id']}/input_items", params={"limit": 2, "after": page["last_id"]}).json()
    assert rest["data"] == desc[2:] and not rest["has_more"]
    assert httpx.get(f"{url}/{r['id']}/input_items", params={"before": "msg_mine"}).json()["data"] == desc[:2]
    for params, field in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"order": "up"}, "order"),
                          ({"after": "msg_none"}, "after"), ({"include": "file.bytes"}, "include")):
        assert_error(httpx.get(f"{url}/{r['id']}/input_items", params=params), 400, field)
    assert httpx.get(f"{url}/{r['id']}/input_items", params={"include": "reasoning.encrypted_content"}).status_code == 200
    assert_error(httpx.get(f"{url}/resp_none/input_items"), 404, "response_id")


@pytest.mark.parametrize("client_id", ["a/b", "a?b", "x y", "50%", "a\tb"])
def test_a_response_id_must_fit_a_url_path(roomy, client_id):
    """A response is fetched, cancelled and deleted by its id in the URL path: a client id that
    could not be (a '/', '?', space, ...) is a 400 naming request_id, by header or field; before,
    a background response under such an id ran to its end and could never be fetched."""
    url = f"{roomy.url}/v1/responses"
    body = {"input": "hi", "max_output_tokens": 1}
    assert_error(httpx.post(url, json={**body, "request_id": client_id}), 400, "request_id")
    if client_id.isprintable():  # a header cannot carry a tab
        assert_error(httpx.post(url, json=body, headers={"X-Request-Id": client_id}), 400, "request_id")
    r = httpx.post(url, json={**body, "request_id": "mine-1.ok:2"})
    assert r.status_code == 200 and httpx.get(f"{url}/{r.json()['id']}").status_code == 200
