"""Request fields beyond the basics, against the fake engine: fields this server cannot honour
are 400s naming them; reasoning output, chat_template_kwargs, logit_bias, prompt_logprobs and
continuous usage stats work."""

from __future__ import annotations

import os

import httpx
import pytest
import transformers

from server.api_server import build_app
from tests.server_fixtures import OFFLINE_ENV, TINY_MODEL, FakeEngine, InProcessServer

os.environ.update(OFFLINE_ENV)


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(TINY_MODEL)


@pytest.fixture(scope="module")
def server(tok):
    engine = FakeEngine(tok, max_model_len=256)
    with InProcessServer(build_app(engine)) as s:
        yield s


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
CMPL = {"prompt": "hi", "max_tokens": 4}
REFUSED = [
    ("/v1/completions", {**CMPL, "suffix": " end"}, "suffix"),
    ("/v1/completions", {**CMPL, "best_of": 3}, "best_of"),
    ("/v1/completions", {**CMPL, "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/completions", {**CMPL, "guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/completions", {**CMPL, "guided_regex": "a+"}, "guided_regex"),
    ("/v1/completions", {**CMPL, "guided_choice": ["a", "b"]}, "guided_choice"),
    ("/v1/completions", {**CMPL, "guided_grammar": "root ::= \"a\""}, "guided_grammar"),
    ("/v1/completions", {**CMPL, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "x"}}},
     "response_format"),
    ("/v1/chat/completions", {**CHAT, "guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"choice": ["a"]}}, "structured_outputs"),
]


@pytest.mark.parametrize("path,body,field", REFUSED, ids=[f[2] + f[0][3:7] for f in REFUSED])
def test_unsupported_fields_are_400s_naming_them(server, path, body, field):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["message"].startswith(field), err


ACCEPTED = [
    ("/v1/completions", {**CMPL, "suffix": ""}),
    ("/v1/completions", {**CMPL, "best_of": 1}),
    ("/v1/completions", {**CMPL, "n": 2, "best_of": 2}),
    ("/v1/completions", {**CMPL, "response_format": {"type": "text"}}),
    ("/v1/chat/completions", {**CHAT, "tools": [], "tool_choice": "none"}),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "text"}}),
    ("/v1/chat/completions", {**CHAT, "no_such_field": 1, "guided_json": None}),
]


@pytest.mark.parametrize("path,body", ACCEPTED, ids=[str(i) for i in range(len(ACCEPTED))])
def test_values_that_ask_for_nothing_are_accepted(server, path, body):
    r = post(server, path, body)
    assert r.status_code == 200, r.text
