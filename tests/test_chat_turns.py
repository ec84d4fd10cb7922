"""Chat messages as the chat template reads them (server/chat_protocol.template_turns, rendered by
server/chat.render_chat_template): an assistant turn of tool calls with `content: null`, an empty
`tool_calls` list, text content part types, and /tokenize rendering exactly what chat renders."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import transformers

from server.api_server import build_app
from server.cli import build_parser
from tests.server_fixtures import TINY_MODEL, FakeEngine

# DeepSeek's shape: an assistant turn with `tool_calls` renders its content only when it is not
# none (a missing key fails: `'<A>' + undefined`), and any `tool_calls` key opens a calls block
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '<U>' + m['content'] }}"
    "{% elif m['role'] == 'tool' %}{{ '<out ' + m['tool_call_id'] + '>' + m['content'] }}"
    "{% elif 'tool_calls' in m %}{{ '<A>' + ('' if m['content'] is none else m['content']) + '<calls>' }}"
    "{% for c in m['tool_calls'] %}{{ c['function']['name'] + c['function']['arguments'] }}{% endfor %}"
    "{{ '</calls>' }}"
    "{% else %}{{ '<A>' + m['content'] + '<end>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<A>' }}{% endif %}")
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
MESSAGES = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
            {"role": "assistant", "content": "Hello!", "tool_calls": []},
            {"role": "user", "content": [{"type": "input_text", "text": "Bye"},
                                         {"type": "refusal", "refusal": "no"}]}]
RENDERED = ('<U>Weather?<A><calls>get_weather{"city": "Paris"}</calls><out call_1>18 C'
            '<A>Hello!<end><U>Bye\nno<A>')


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(TINY_MODEL)


def post_all(tok, *bodies):
    async def go():
        app = build_app(FakeEngine(tok, max_model_len=512),
                        build_parser().parse_args(["--model", str(TINY_MODEL), "--chat-template", TEMPLATE]))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return [await c.post(path, json=body) for path, body in bodies]
    return asyncio.run(go())


def test_tool_call_turns_render_as_the_template_expects(tok):
    want = tok(tok.bos_token + RENDERED, add_special_tokens=False)["input_ids"]
    chat, tokenized, alone = post_all(
        tok, ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "return_token_ids": True}),
        ("/tokenize", {"messages": MESSAGES}),
        # the turn of calls alone, as an agent's second request sends it back
        ("/tokenize", {"messages": MESSAGES[:3], "add_generation_prompt": False}))
    assert chat.status_code == 200, chat.text
    assert chat.json()["prompt_token_ids"] == want
    assert tokenized.status_code == 200 and tokenized.json()["tokens"] == want
    assert tok.decode(alone.json()["tokens"]) == tok.bos_token + RENDERED.split("<A>Hello!")[0]


def test_a_call_without_arguments_renders_as_an_empty_object(tok):
    bare = {"id": "call_2", "type": "function", "function": {"name": "now"}}
    messages = [MESSAGES[0], {"role": "assistant", "content": None, "tool_calls": [bare]}]
    (r,) = post_all(tok, ("/tokenize", {"messages": messages, "add_generation_prompt": False}))
    assert tok.decode(r.json()["tokens"]) == tok.bos_token + "<U>Weather?<A><calls>now{}</calls>"


@pytest.mark.parametrize("part, message", [
    ({"type": "image_url", "image_url": {"url": "x"}}, "only text content parts are supported"),
    ({"type": "text"}, "a 'text' content part needs a string 'text'"),
    ({"type": "refusal", "text": "no"}, "a 'refusal' content part needs a string 'refusal'")])
def test_content_parts_without_text_are_refused(tok, part, message):
    for path, body in (("/v1/chat/completions", {"max_tokens": 1}), ("/tokenize", {})):
        (r,) = post_all(tok, (path, {**body, "messages": [{"role": "user", "content": [part]}]}))
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
