"""Request fields beyond the basics, against the fake engine: fields this server cannot honour
are 400s naming them; reasoning output, chat_template_kwargs, logit_bias, prompt_logprobs and
continuous usage stats work."""

from __future__ import annotations

import os

import httpx
import pytest
import transformers

from server.api_server import build_app
from tests.server_fixtures import OFFLINE_ENV, TINY_MODEL, FakeEngine, InProcessServer, ScriptedEngine

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
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {**CHAT, "function_call": "auto"}, "function_call"),
    # tools with tool_choice "auto" (the default with tools) need --enable-auto-tool-choice
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice"),
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
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "none"}),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "text"}}),
    ("/v1/chat/completions", {**CHAT, "no_such_field": 1, "guided_json": None}),
]


@pytest.mark.parametrize("path,body", ACCEPTED, ids=[str(i) for i in range(len(ACCEPTED))])
def test_values_that_ask_for_nothing_are_accepted(server, path, body):
    r = post(server, path, body)
    assert r.status_code == 200, r.text


# ---- reasoning output (--reasoning-parser) ----

THINK_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<｜User｜>' + m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}"
    "{% if thinking is defined and thinking %}{{ '<think>\\n' }}{% endif %}{% endif %}")
REASONING, CONTENT = "Let me think: 3 + 4.", "The answer is 7."


def reasoning_server(tok, parser: str, **flags):
    t = transformers.AutoTokenizer.from_pretrained(TINY_MODEL)
    t.chat_template = THINK_TEMPLATE
    engine = ScriptedEngine(t, max_model_len=256, cycle=True)
    engine.script = t(REASONING + "</think>" + CONTENT, add_special_tokens=False)["input_ids"]
    args = type("Args", (), {"reasoning_parser": parser, **flags})()
    return engine, InProcessServer(build_app(engine, args))


@pytest.fixture(scope="module")
def r1(tok):
    engine, srv = reasoning_server(tok, "deepseek_r1")
    with srv as s:
        s.engine = engine
        yield s


@pytest.fixture(scope="module")
def v3(tok):
    engine, srv = reasoning_server(tok, "deepseek_v3")
    with srv as s:
        s.engine = engine
        yield s


def stream_chat(server, body: dict) -> list[dict]:
    import json

    chunks = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=30,
                      json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def joined(chunks: list[dict], field: str, index: int = 0) -> str | None:
    parts = [c["choices"][0]["delta"].get(field) for c in chunks
             if c["choices"] and c["choices"][0]["index"] == index]
    parts = [p for p in parts if p]
    return "".join(parts) if parts else None


def test_r1_reasoning_split_whole_and_streamed(r1):
    n_script = len(r1.engine.script)
    assert r1.engine.script.count(r1.engine.tokenizer.convert_tokens_to_ids("<")) >= 1
    body = {**CHAT, "max_tokens": n_script, "n": 2, "temperature": 0}
    r = post(r1, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        m = c["message"]
        assert (m["reasoning_content"], m["reasoning"], m["content"]) == (REASONING, REASONING, CONTENT)
    chunks = stream_chat(r1, body)
    for i in range(2):  # per-choice parser state: the choices' chunks interleave
        assert joined(chunks, "reasoning_content", i) == REASONING
        assert joined(chunks, "reasoning", i) == REASONING
        assert joined(chunks, "content", i) == CONTENT
    # no chunk leaks part of the tag, although "</think>" arrives as 6 tokens in 6 chunks
    assert not any("<" in (c["choices"][0]["delta"].get("reasoning_content") or "")
                   + (c["choices"][0]["delta"].get("content") or "") for c in chunks if c["choices"])
    # reasoning comes before content in the stream
    kinds = [k for c in chunks if c["choices"] and c["choices"][0]["index"] == 0
             for k in ("reasoning", "content") if c["choices"][0]["delta"].get(k)]
    assert kinds == sorted(kinds, key=("reasoning", "content").index)


@pytest.mark.parametrize("stream", [False, True])
def test_r1_output_without_closing_tag_is_all_reasoning(r1, stream):
    # stops inside "</think>": the held-back "</th" is flushed as reasoning at the end
    tok = r1.engine.tokenizer
    upto = len(tok(REASONING + "</th", add_special_tokens=False)["input_ids"])
    body = {**CHAT, "max_tokens": upto}
    if stream:
        chunks = stream_chat(r1, body)
        got = (joined(chunks, "reasoning_content"), joined(chunks, "content"))
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    else:
        m = post(r1, "/v1/chat/completions", body).json()["choices"][0]["message"]
        got = (m["reasoning_content"], m["content"])
    assert got == (REASONING + "</th", None)


def test_v3_thinks_only_with_chat_template_kwargs(v3):
    tok = v3.engine.tokenizer
    n_script = len(v3.engine.script)
    r = post(v3, "/v1/chat/completions", {**CHAT, "max_tokens": n_script})
    m = r.json()["choices"][0]["message"]
    assert (m["reasoning_content"], m["content"]) == (None, REASONING + "</think>" + CONTENT)
    assert not tok.decode(v3.engine.last_prompt).endswith("<think>\n")
    body = {**CHAT, "max_tokens": n_script, "chat_template_kwargs": {"thinking": True},
            "reasoning_effort": "high"}
    m = post(v3, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert (m["reasoning_content"], m["content"]) == (REASONING, CONTENT)
    assert tok.decode(v3.engine.last_prompt).endswith("<think>\n")  # the kwargs reached the template
    chunks = stream_chat(v3, body)
    assert (joined(chunks, "reasoning"), joined(chunks, "content")) == (REASONING, CONTENT)


def test_tokenize_messages_with_chat_template_kwargs(v3):
    body = {"messages": CHAT["messages"]}
    plain = post(v3, "/tokenize", body).json()["tokens"]
    thinking = post(v3, "/tokenize", {**body, "chat_template_kwargs": {"thinking": True}}).json()
    assert v3.engine.tokenizer.decode(thinking["tokens"][len(plain):]) == "<think>\n"


def test_default_chat_template_kwargs_and_response_role(tok):
    """--default-chat-template-kwargs: V3.1 thinks unless a request says otherwise (its keys win);
    --response-role names the role after a generation prompt, else the last message's role is
    given (vLLM's choice)."""
    engine, srv = reasoning_server(tok, "deepseek_v3", default_chat_template_kwargs={"thinking": True},
                                   response_role="bot")
    with srv as v31:
        body = {**CHAT, "max_tokens": len(engine.script)}
        m = post(v31, "/v1/chat/completions", body).json()["choices"][0]["message"]
        assert (m["role"], m["reasoning"], m["content"]) == ("bot", REASONING, CONTENT)
        assert tok.decode(engine.last_prompt).endswith("<think>\n")
        chunks = stream_chat(v31, body)
        assert chunks[0]["choices"][0]["delta"]["role"] == "bot"
        off = {**body, "chat_template_kwargs": {"thinking": False}}
        m = post(v31, "/v1/chat/completions", off).json()["choices"][0]["message"]
        assert (m["reasoning"], m["content"]) == (None, REASONING + "</think>" + CONTENT)
        plain = post(v31, "/tokenize", {"messages": CHAT["messages"],
                                        "chat_template_kwargs": {"thinking": False}}).json()["tokens"]
        thinking = post(v31, "/tokenize", {"messages": CHAT["messages"]}).json()["tokens"]
        assert tok.decode(thinking[len(plain):]) == "<think>\n"
        cont = {**body, "add_generation_prompt": False, "continue_final_message": True}
        assert post(v31, "/v1/chat/completions", cont).json()["choices"][0]["message"]["role"] == "user"


def test_no_reasoning_parser_keeps_the_text_as_content(server):
    m = post(server, "/v1/chat/completions", CHAT).json()["choices"][0]["message"]
    assert set(m) == {"role", "content"}


@pytest.mark.parametrize("body,field", [
    ({**CHAT, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({**CHAT, "chat_template_kwargs": ["thinking"]}, "chat_template_kwargs"),
    ({**CHAT, "reasoning_effort": "extreme"}, "reasoning_effort"),
])
def test_bad_chat_template_kwargs_and_reasoning_effort(server, body, field):
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_unknown_reasoning_parser_is_a_startup_error(capsys):
    from server.cli import main

    assert main(["--reasoning-parser", "qwen3", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("serve: error: --reasoning-parser") and "deepseek_r1, deepseek_v3" in err


@pytest.mark.parametrize("text", [
    "a</think>b", "<think>\nr</think>c", "  <think>r", "<thi", "r</thi", "</think>", "",
    "r</think>c</think>d", "x<think>y</think>z", "<<//think>>", "r<</think>c<"])
def test_incremental_split_equals_whole_for_every_chunking(text):
    from server.reasoning import ThinkParser, split_reasoning

    whole = split_reasoning(text)
    for size in range(1, len(text) + 1):
        p, r, c = ThinkParser(), "", ""
        for i in range(0, len(text), size):
            dr, dc = p.feed(text[i:i + size])
            r, c = r + dr, c + dc
        dr, dc = p.finish()
        assert ((r + dr) or None, (c + dc) or None) == whole, (text, size)
    if "</think>" not in text:  # never closed: all reasoning (a leading <think> dropped)
        assert whole[1] is None


def test_split_reasoning_follows_vllm_deepseek_r1():
    from server.reasoning import split_reasoning

    assert split_reasoning("<think>\nr</think>c") == ("\nr", "c")
    assert split_reasoning("r</think>") == ("r", None)
    assert split_reasoning("r") == ("r", None)
    assert split_reasoning("r</think>c</think>d") == ("r", "c</think>d")


# ---- logit_bias ----

@pytest.mark.parametrize("bias,needle", [
    ({"abc": 1}, "token ids"), ({"5": 100.5}, "[-100, 100]"), ({"5": -101}, "[-100, 100]"),
    ({"100000": 1}, "outside"), ({"-3": 1}, "token ids"), ({str(i): 1 for i in range(1025)}, "1024"),
    ({"1" * 5000: 1}, "outside the vocabulary")])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_logit_bias_is_a_400_naming_it(server, path, bias, needle):
    body = {**(CMPL if "chat" not in path else CHAT), "logit_bias": bias}
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logit_bias" and needle in err["message"], err


def test_logit_bias_steers_the_real_engine():
    """The tiny model on the CPU: +100 forces a token, -100 bans the greedy one, greedy or sampled."""
    from engine import LLM, SamplingParams

    llm = LLM(str(TINY_MODEL), device="cpu", dtype="float32", num_kv_blocks=64)
    prompt = "Question: Mia has 7 apples."
    base = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    greedy = llm.generate(prompt, base)[0].outputs[0].token_ids
    forced = next(t for t in range(10, 400) if t not in greedy)
    for temperature in (0.0, 1.0):
        p = SamplingParams(temperature=temperature, seed=3, max_tokens=6, ignore_eos=True,
                           logit_bias={forced: 100.0})
        assert llm.generate(prompt, p)[0].outputs[0].token_ids == [forced] * 6
    banned = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                            logit_bias={greedy[0]: -100.0})
    assert llm.generate(prompt, banned)[0].outputs[0].token_ids[0] != greedy[0]
    with pytest.raises(ValueError, match="logit_bias: token id"):
        llm.generate(prompt, SamplingParams(logit_bias={10 ** 6: 1.0}))


def test_prompt_logprobs_range_and_chat_stream_refusal(server):
    for path, body in (("/v1/completions", CMPL), ("/v1/chat/completions", CHAT)):
        r = post(server, path, {**body, "prompt_logprobs": 21})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
    # chat returns them in whole responses only, as vLLM does
    r = post(server, "/v1/chat/completions", {**CHAT, "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
    assert "stream" in r.json()["error"]["message"]
    # 0 asks for nothing to stream: accepted, as vLLM accepts it
    assert post(server, "/v1/chat/completions", {**CHAT, "prompt_logprobs": 0, "stream": True}).status_code == 200


@pytest.mark.slow
def test_serve_with_reasoning_parser_on_the_tiny_model(tmp_path_factory):
    """`serve --reasoning-parser deepseek_r1` end to end: the tiny model never writes </think>, so
    its whole output is reasoning, whole and streamed alike."""
    from tests.server_fixtures import ServeProcess, tiny_model_dir

    with ServeProcess("--model", tiny_model_dir(tmp_path_factory), "--device", "cpu",
                      "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "256",
                      "--reasoning-parser", "deepseek_r1") as s:
        body = {**CHAT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = post(s, "/v1/chat/completions", body).json()
        m = r["choices"][0]["message"]
        assert "</think>" not in (m["reasoning_content"] or "")
        assert m["content"] is None and m["reasoning"] == m["reasoning_content"]
        assert m["reasoning_content"] and r["usage"]["completion_tokens"] == 8
        chunks = stream_chat(s, body)
        assert joined(chunks, "reasoning_content") == m["reasoning_content"]
        assert joined(chunks, "content") is None



def test_earlier_tool_calls_reach_the_template_shaped():
    """An earlier call's arguments object is written as the JSON string templates concatenate;
    a call without "type" is a function call."""
    from server.chat_protocol import ChatMessage
    m = ChatMessage(role="assistant", tool_calls=[
        {"id": "c1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}])
    assert m.tool_calls == [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
