"""The routes read and validate their JSON bodies themselves (server/request_body.py): a large body
on the lane's worker thread instead of the event loop, the text check decided from the raw bytes,
and the models' schemas still in /openapi.json."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import transformers

import server.request_body as request_body
from server.api_server import build_app
from tests.server_fixtures import TINY_MODEL, FakeEngine, InProcessServer, assert_error, post

JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def fake():
    engine = FakeEngine(transformers.AutoTokenizer.from_pretrained(TINY_MODEL), max_model_len=128)
    with InProcessServer(build_app(engine)) as s:
        yield s


@pytest.fixture
def parsed_on(monkeypatch):
    """The names of the threads that parsed each body, in order."""
    names, parse = [], request_body._parse

    def recording(body, model):
        names.append(threading.current_thread().name)
        return parse(body, model)
    monkeypatch.setattr(request_body, "_parse", recording)
    return names


def test_a_large_body_is_parsed_off_the_event_loop(fake, parsed_on):
    small = {"prompt": "hi", "max_tokens": 2}
    assert post(fake, "/v1/completions", small).status_code == 200
    messages = [{"role": "user", "content": "hi"}] * 40_000  # ~1.4 MB
    assert len(json.dumps(messages)) > request_body.INLINE_BODY_BYTES
    r = post(fake, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert_error(r, 400)  # longer than the context: refused, after validation
    big_ids = {"prompt": [[5, 6]] * 300, "max_tokens": 1, "logit_bias": {str(i): 1 for i in range(30_000)}}
    assert_error(post(fake, "/v1/completions", big_ids), 400, "logit_bias")
    assert not parsed_on[0].startswith("body-large") and parsed_on[1:] == ["body-large_0"] * 2, parsed_on


@pytest.mark.parametrize("route", ["/v1/completions", "/tokenize", "/invocations"])
@pytest.mark.parametrize("pad", [0, 300_000])  # inline and on the lane
def test_unpaired_surrogates_are_refused_from_the_raw_bytes_too(fake, route, pad):
    """A lone surrogate reaches the parsed body through an escape or through the (invalid) UTF-8
    bytes ED A0-BF, which the JSON parser decodes leniently; either is a 400 naming the field.
    A valid escaped pair and plain non-ASCII text pass."""
    filler = ' "x": "' + "a" * pad + '",'
    for text, ok in ((b"\\ud800", False), (b"\\uDFFF", False), (b"\xed\xa0\x80", False),
                     (b"\\ud83d\\ude00", True), ("é日".encode(), True)):
        body = b"{" + filler.encode() + b' "max_tokens": 1, "prompt": "a' + text + b'"}'
        r = httpx.post(f"{fake.url}{route}", content=body, headers=JSON, timeout=60)
        if ok:
            assert r.status_code == 200, (route, text, r.text)
        else:
            err = assert_error(r, 400, "prompt")
            assert "not valid Unicode text" in err["message"], err


def test_a_clean_body_skips_the_text_walk(fake, monkeypatch):
    """Without a surrogate escape or surrogate bytes in the raw body, validation does not look at
    the text again; with one it does (and a valid pair then passes)."""
    import server.request_fields as fields
    calls, valid = [], fields._text_is_valid

    def counting(data):
        calls.append(1)
        return valid(data)
    monkeypatch.setattr(fields, "_text_is_valid", counting)
    assert post(fake, "/v1/completions", {"prompt": "héllo", "max_tokens": 1}).status_code == 200
    assert calls == []
    r = httpx.post(f"{fake.url}/v1/completions", content=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}',
                   headers=JSON, timeout=30)
    assert r.status_code == 200 and calls == [1], r.text


def test_errors_as_fastapi_gave_them(fake):
    assert_error(post(fake, "/v1/completions", {"prompt": "hi", "max_tokens": "many"}), 400, "max_tokens")
    assert_error(post(fake, "/v1/chat/completions", {"messages": []}), 400, "messages")
    assert_error(post(fake, "/detokenize", {"tokens": "abc"}), 400, "tokens")
    for body in (b"[1, 2]", b'"text"'):  # JSON, but not an object
        r = httpx.post(f"{fake.url}/v1/completions", content=body, headers=JSON, timeout=30)
        assert_error(r, 400)
    r = httpx.post(f"{fake.url}/tokenize", content=b'{"prompt": "hi"}',
                   headers={"content-type": "application/vnd.api+json"}, timeout=30)
    assert r.status_code == 200 and r.json()["count"] > 0, r.text
    r = httpx.post(f"{fake.url}/v1/chat/completions", content=b"{}", headers={"content-type": "text/plain"})
    assert "got Content-Type: text/plain" in assert_error(r, 400)["message"]


def test_the_body_models_are_in_openapi(fake):
    doc = httpx.get(f"{fake.url}/openapi.json", timeout=30).json()
    schemas = doc["components"]["schemas"]
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest"),
                        ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"} and "properties" in schemas[model]
    assert "messages" in schemas["ChatCompletionRequest"]["properties"] and "ChatMessage" in schemas

    def refs(node):
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                yield node["$ref"]
            for v in node.values():
                yield from refs(v)
        elif isinstance(node, list):
            for v in node:
                yield from refs(v)
    found = set(refs(doc))
    assert found and all(r.removeprefix("#/components/schemas/") in schemas for r in found), found


def test_a_long_chat_builds_its_turns_on_the_large_lane(fake, monkeypatch):
    """Past MANY_MESSAGES the conversation is built on a worker thread: the same prompt, and a
    content part it cannot take is still a 400 naming messages."""
    import server.chat as chat
    body = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 3, "temperature": 0}
    inline = post(fake, "/v1/chat/completions", body).json()
    monkeypatch.setattr(chat, "MANY_MESSAGES", 1)
    lane, calls = chat.large_lane, []

    async def recording(fn, *args):
        calls.append(fn.__name__)
        return await lane(fn, *args)
    monkeypatch.setattr(chat, "large_lane", recording)
    off = post(fake, "/v1/chat/completions", body).json()
    assert calls == ["conversation"]
    assert off["usage"] == inline["usage"] and off["choices"] == inline["choices"]
    bad = {**body, "messages": [*body["messages"], {"role": "user", "content": [{"type": "image_url"}]}]}
    assert "text content parts" in assert_error(post(fake, "/v1/chat/completions", bad), 400, "messages")["message"]
