"""A named tool_choice cut short by max_tokens: the same call whether streamed or not, as vLLM
returns it (the partial arguments as the call's arguments, finish_reason "length")."""

from __future__ import annotations

import pytest
from test_tool_calls import REAL, post, stream

from tests.server_fixtures import tiny_engine_server


@pytest.fixture(scope="module")
def real():
    with tiny_engine_server() as s:
        yield s


def test_a_named_call_cut_short_is_the_same_call_streamed_or_not(real):
    body = {**REAL, "max_tokens": 5, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    r = post(real, body)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "length" and c["message"]["content"] is None, c
    [call] = c["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    args = call["function"]["arguments"]
    assert args and not args.endswith("}")  # 5 tokens of JSON: not a complete object
    streamed, names = "", []
    chunks = stream(real, body)
    for ch in chunks:
        for t in (ch["choices"][0]["delta"].get("tool_calls") or []) if ch["choices"] else []:
            names += [t["function"]["name"]] if "id" in t else []
            streamed += t["function"].get("arguments") or ""
        assert not (ch["choices"] and ch["choices"][0]["delta"].get("content"))  # no text outside the call
    assert names == ["get_weather"] and streamed == args
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
