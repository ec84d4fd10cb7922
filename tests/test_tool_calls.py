"""Tool calls: DeepSeek's markup parsed whole and incrementally; the chat API with tools on a
scripted fake engine (it writes tool-call markup, one byte-level token per stream chunk); and the
tiny model forced into calls by tool_choice "required" or a named function."""

from __future__ import annotations

import json
import os

import httpx
import jsonschema
import pytest
import transformers

from server.api_server import build_app
from server.tool_calls import (CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP, ToolCallParser,
                               assemble, parse_tool_calls)
from tests.server_fixtures import OFFLINE_ENV, TINY_MODEL, InProcessServer, ScriptedEngine, tiny_engine_server

os.environ.update(OFFLINE_ENV)


def v3_call(name: str, args: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{args}\n```{CALL_END}"


def v31_call(name: str, args: str) -> str:
    return f"{CALL_BEGIN}{name}{SEP}{args}{CALL_END}"


WEATHER = '{"city": "Paris", "unit": "celsius"}'
V3_TWO = (f"Let me check.{CALLS_BEGIN}{v3_call('get_weather', WEATHER)}\n"
          f"{v3_call('get_time', '{}')}{CALLS_END}")
V31_TWO = f"{CALLS_BEGIN}{v31_call('get_weather', WEATHER)}{v31_call('get_time', '{}')}{CALLS_END}"


def calls_of(parsed) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls]


def test_v3_and_v31_formats():
    for parser, text in (("deepseek_v3", V3_TWO), ("deepseek_v31", V31_TWO)):
        p = parse_tool_calls(text, parser)
        assert calls_of(p) == [("get_weather", WEATHER), ("get_time", "{}")], parser
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in p.tool_calls)
        assert len({c["id"] for c in p.tool_calls}) == 2
    assert parse_tool_calls(V3_TWO, "deepseek_v3").content == "Let me check."
    assert parse_tool_calls(V31_TWO, "deepseek_v31").content is None
    # vLLM's docstring example, ending in the EOS text when special tokens are kept
    one = f"{CALLS_BEGIN}{v3_call('f', WEATHER)}{CALLS_END}<｜end▁of▁sentence｜>"
    p = parse_tool_calls(one, "deepseek_v3")
    assert calls_of(p) == [("f", WEATHER)] and p.content == "<｜end▁of▁sentence｜>"


MALFORMED = [
    "no calls here, just text with ``` and <｜ in it",
    f"hi{CALLS_BEGIN}junk",
    f"hi{CALLS_BEGIN}",
    f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}f\nno fence{CALL_END}{CALLS_END}",
    f"{CALLS_BEGIN}{CALL_BEGIN}function f\n```json\n{{}}\n```{CALL_END}{CALLS_END}",  # no sep
    f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}\n```json\n{{}}\n```{CALL_END}",  # no name
    f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_",  # cut inside the header
]


@pytest.mark.parametrize("text", MALFORMED, ids=[str(i) for i in range(len(MALFORMED))])
def test_malformed_output_stays_content(text):
    p = parse_tool_calls(text, "deepseek_v3")
    assert p.tool_calls == [] and p.content == text


def test_malformed_after_a_complete_call_keeps_the_call():
    text = f"{CALLS_BEGIN}{v3_call('f', '{}')}\nthen prose{CALLS_END}"
    p = parse_tool_calls(text, "deepseek_v3")
    assert calls_of(p) == [("f", "{}")] and p.content == f"\nthen prose{CALLS_END}"


def test_output_cut_inside_the_arguments_is_a_call_with_what_came():
    cut = f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}f\n```json\n{{\"a\": 1"
    p = parse_tool_calls(cut, "deepseek_v3")
    assert calls_of(p) == [("f", '{"a": 1')] and p.content is None


def _streamed(text: str, parser: str, cuts: list[int]):
    """(content, [(name, args)]) of `text` fed in pieces cut at `cuts`."""
    p, content, names, args = ToolCallParser(parser), "", {}, {}
    bounds = [0, *cuts, len(text)]
    for lo, hi in zip(bounds, bounds[1:]):
        for d in (p.feed(text[lo:hi]),):
            content += d.content
            for i, _, name in d.calls:
                assert i not in names  # a call is announced once
                names[i] = name
            for i, frag in d.args:
                assert i in names  # arguments only after the name
                args[i] = args.get(i, "") + frag
    d = p.finish()
    content += d.content
    for i, frag in d.args:
        args[i] = args.get(i, "") + frag
    return content or None, [(names[i], args.get(i, "")) for i in sorted(names)]


CASES = [("deepseek_v3", V3_TWO), ("deepseek_v31", V31_TWO),
         *(("deepseek_v3", m) for m in MALFORMED),
         ("deepseek_v3", f"{CALLS_BEGIN}{v3_call('f', '{}')}\nthen prose{CALLS_END}"),
         ("deepseek_v3", f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}f\n```json\n{{\"a\": \"\\n``\"")]


@pytest.mark.parametrize("parser,text", CASES, ids=[str(i) for i in range(len(CASES))])
def test_incremental_equals_whole_split_anywhere(parser, text):
    whole = parse_tool_calls(text, parser)
    want = (whole.content, calls_of(whole))
    for cut in range(1, len(text)):  # one split at every position
        assert _streamed(text, parser, [cut]) == want, cut
    for size in (1, 2, 3, 7):  # and every chunking of a few sizes
        assert _streamed(text, parser, list(range(size, len(text), size))) == want, size


def test_arguments_stream_before_the_call_ends():
    p = ToolCallParser("deepseek_v3")
    head = f"ok{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n"
    d = p.feed(head + '{"city": "Pa')
    assert d.content == "ok" and [n for _, _, n in d.calls] == ["get_weather"]
    assert assemble(d)[0]["function"]["arguments"] == '{"city": "Pa'
    d = p.feed('ris"}\n``')  # the start of the closing fence is held back
    assert [f for _, f in d.args] == ['ris"}']
    d = p.feed(f"`{CALL_END}{CALLS_END}")
    assert not d and not p.finish()


# ---- HTTP, on a fake engine that writes tool-call markup ----

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}]
TOOL_TEMPLATE = ("{{ bos_token }}{% if tools %}{{ 'TOOLS:' + (tools | map(attribute='function') "
                 "| map(attribute='name') | join(',')) }}{% endif %}{% for m in messages %}"
                 "{{ '<｜User｜>' + (m['content'] or '') }}{% endfor %}{{ '<｜Assistant｜>' }}")
# the fake engine writes the script, then EOS (id 1), which stops it only as a stop token id
CHAT = {"messages": [{"role": "user", "content": "weather in Paris?"}], "tools": TOOLS,
        "stop_token_ids": [1]}


def _server(argv: list[str], script: str = V3_TWO):
    from server.cli import build_parser

    tok = transformers.AutoTokenizer.from_pretrained(TINY_MODEL)
    tok.chat_template = TOOL_TEMPLATE
    engine = ScriptedEngine(tok, max_model_len=1024)
    engine.script = tok(script, add_special_tokens=False)["input_ids"]
    args = build_parser().parse_args(["--model", str(TINY_MODEL), *argv])
    return engine, InProcessServer(build_app(engine, args))


@pytest.fixture(scope="module")
def auto():
    engine, srv = _server(["--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v3"])
    with srv as s:
        s.engine = engine
        yield s


@pytest.fixture(scope="module")
def plain():
    engine, srv = _server([])
    with srv as s:
        s.engine = engine
        yield s


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)


def stream(server, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=30,
                      json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_auto_tool_calls_whole(auto):
    r = post(auto, {**CHAT, "n": 2})
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        m = c["message"]
        assert c["finish_reason"] == "tool_calls" and m["content"] == "Let me check."
        got = [(t["function"]["name"], t["function"]["arguments"]) for t in m["tool_calls"]]
        assert got == [("get_weather", WEATHER), ("get_time", "{}")]
        assert all(t["id"].startswith("call_") and t["type"] == "function" for t in m["tool_calls"])
    # the tools reached the chat template
    assert "TOOLS:get_weather,get_time" in auto.engine.tokenizer.decode(auto.engine.last_prompt)
    # the markers are decoded even where the tokenizer marks them special
    assert auto.engine.last_params.skip_special_tokens is False


def test_auto_tool_calls_streamed(auto):
    chunks = stream(auto, CHAT)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    calls: dict[int, dict] = {}
    arg_chunks = 0
    for d in deltas:
        for t in d.get("tool_calls") or []:
            if "id" in t:  # the first entry of a call: id, type, name
                assert t["index"] not in calls and t["type"] == "function"
                calls[t["index"]] = {"id": t["id"], "name": t["function"]["name"], "args": ""}
            calls[t["index"]]["args"] += t["function"].get("arguments") or ""
            arg_chunks += bool(t["function"].get("arguments"))
    assert content == "Let me check."
    assert [(c["name"], c["args"]) for _, c in sorted(calls.items())] == [
        ("get_weather", WEATHER), ("get_time", "{}")]
    assert arg_chunks > 5  # the arguments came in fragments, token by token
    assert not any("｜" in (d.get("content") or "") for d in deltas)  # no markup leaked
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_parallel_tool_calls_false_keeps_the_first_call(auto):
    """As vLLM: the auto parser's first call alone, whole and streamed (the script makes two)."""
    body = {**CHAT, "parallel_tool_calls": False}
    m = post(auto, body).json()["choices"][0]["message"]
    assert [(t["function"]["name"], t["function"]["arguments"]) for t in m["tool_calls"]] == [
        ("get_weather", WEATHER)] and m["content"] == "Let me check."
    calls = _streamed_choices(stream(auto, body))[0]["calls"]
    assert calls == {0: ["get_weather", WEATHER]}


def _streamed_choices(chunks: list[dict]) -> dict[int, dict]:
    """Per choice index: reasoning, content and calls [(name, arguments)] put together."""
    out: dict[int, dict] = {}
    for ch in chunks:
        for c in ch["choices"]:
            o = out.setdefault(c["index"], {"reasoning": "", "content": "", "calls": {}})
            d = c["delta"]
            o["reasoning"] += d.get("reasoning_content") or ""
            o["content"] += d.get("content") or ""
            for t in d.get("tool_calls") or []:
                if "id" in t:
                    o["calls"][t["index"]] = [t["function"]["name"], ""]
                o["calls"][t["index"]][1] += t["function"].get("arguments") or ""
            if c["finish_reason"]:
                o["finish"] = c["finish_reason"]
    return out


def test_v31_calls_after_reasoning_whole_and_streamed_with_n():
    """--reasoning-parser deepseek_r1 with deepseek_v31: the calls are parsed out of the content
    after </think>, per choice (the n choices' chunks interleave)."""
    engine, srv = _server(["--reasoning-parser", "deepseek_r1", "--enable-auto-tool-choice",
                           "--tool-call-parser", "deepseek_v31"],
                          "Weather first.</think>" + V31_TWO)
    want = [("get_weather", WEATHER), ("get_time", "{}")]
    with srv as s:
        for c in post(s, {**CHAT, "n": 2}).json()["choices"]:
            m = c["message"]
            assert (m["reasoning_content"], m["content"]) == ("Weather first.", None)
            got = [(t["function"]["name"], t["function"]["arguments"]) for t in m["tool_calls"]]
            assert got == want
            assert c["finish_reason"] == "tool_calls"
        got = _streamed_choices(stream(s, {**CHAT, "n": 2}))
    assert set(got) == {0, 1}
    for o in got.values():
        assert (o["reasoning"], o["content"], o["finish"]) == ("Weather first.", "", "tool_calls")
        assert [tuple(o["calls"][i]) for i in sorted(o["calls"])] == want


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_choice_with_a_reasoning_parser_is_all_call(choice):
    """The constrained JSON is the call from its first token: nothing of it is reasoning."""
    tool_choice = ({"type": "function", "function": {"name": "get_weather"}} if choice == "named"
                   else "required")
    script = WEATHER if choice == "named" else json.dumps(
        [{"name": "get_weather", "parameters": json.loads(WEATHER)}])
    engine, srv = _server(["--reasoning-parser", "deepseek_r1"], script)
    body = {**CHAT, "tool_choice": tool_choice}
    with srv as s:
        c = post(s, body).json()["choices"][0]
        m = c["message"]
        want = [("get_weather", json.loads(WEATHER))]
        assert (m["reasoning_content"], m["content"]) == (None, None)
        # vLLM's: "tool_calls" for "required"'s calls, "stop" for a named choice's
        finish = "stop" if choice == "named" else "tool_calls"
        assert c["finish_reason"] == finish
        assert [(t["function"]["name"], json.loads(t["function"]["arguments"]))
                for t in m["tool_calls"]] == want
        o = _streamed_choices(stream(s, body))[0]
    assert (o["reasoning"], o["content"], o["finish"]) == ("", "", finish)
    assert [(n, json.loads(a)) for n, a in o["calls"].values()] == want


def test_openai_client_reads_the_calls(auto):
    import openai

    client = openai.OpenAI(base_url=f"{auto.url}/v1", api_key="x", max_retries=0)
    body = {k: v for k, v in CHAT.items() if k != "stop_token_ids"}
    m = client.chat.completions.create(model="fake-model", **body,
                                       extra_body={"stop_token_ids": [1]}).choices[0].message
    assert [json.loads(t.function.arguments) for t in m.tool_calls] == [json.loads(WEATHER), {}]


def test_tool_choice_none_leaves_the_text(auto):
    m = post(auto, {**CHAT, "tool_choice": "none"}).json()["choices"][0]
    assert m["message"]["content"] == V3_TWO and m["finish_reason"] == "stop"


@pytest.mark.parametrize("body,param,needle", [
    (CHAT, "tool_choice", "--enable-auto-tool-choice and --tool-call-parser"),
    ({**CHAT, "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
    ({**CHAT, "tools": None, "tool_choice": "required"}, "tool_choice", "needs a non-empty tools"),
    ({**CHAT, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
    ({**CHAT, "tool_choice": "required", "guided_regex": "a"}, "tool_choice", "no other output"),
    ({**CHAT, "tool_choice": "sometimes"}, "tool_choice", ""),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name",
     "at least 1"),
    ({**CHAT, "functions": [{"name": "f"}]}, "functions", "not supported"),
    *[({**CHAT, "tool_choice": "none", "messages": [{"role": "user", "content": "hi"}, {
        "role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", **call}]}]},
       "messages.1.tool_calls", needle) for call, needle in (({}, "tool_calls[0].function must be an object"),
                                                ({"function": None}, "tool_calls[0].function must be"),
                                                ({"function": {"arguments": "{}"}}, "non-empty name"),
                                                ({"function": {"name": "f", "arguments": 3}}, "a JSON string"),
                                                ({"function": {"name": "f", "arguments": [1]}}, "a JSON string"),
                                                ({"type": "code", "function": {"name": "f", "arguments": "{}"}},
                                                 "type must be"))],
])
def test_bad_tool_requests_are_400s(plain, body, param, needle):
    r = post(plain, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err


def test_tokenize_renders_the_tools(plain):
    body = {"messages": CHAT["messages"]}
    for tools, shown in ((None, False), (TOOLS, True)):
        r = httpx.post(f"{plain.url}/tokenize", json={**body, "tools": tools})
        text = plain.engine.tokenizer.decode(r.json()["tokens"])
        assert ("TOOLS:get_weather,get_time" in text) == shown, text


def test_tool_choice_none_needs_no_flag(plain):
    r = post(plain, {**CHAT, "tool_choice": "none"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == V3_TWO


@pytest.mark.parametrize("argv,needle", [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--tool-call-parser", "pythonic"], "--tool-call-parser: unknown parser 'pythonic'"),
])
def test_tool_flag_errors_name_the_flag(argv, needle, capsys):
    from server.cli import main

    assert main([*argv, "--device", "cpu"]) == 2
    assert needle in capsys.readouterr().err


# ---- the tiny model, forced into calls ----

@pytest.fixture(scope="module")
def real():
    with tiny_engine_server() as s:
        yield s


PROMPT = "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:"
REAL = {"messages": [{"role": "user", "content": PROMPT}], "tools": TOOLS, "temperature": 0,
        "max_tokens": 96}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _check_calls(calls: list[dict], names: set[str]) -> None:
    assert calls
    for c in calls:
        assert c["id"].startswith("call_") and c["type"] == "function"
        assert c["function"]["name"] in names
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_choice_on_the_tiny_model(real, choice, streamed):
    tool_choice = ("required" if choice == "required" else
                   {"type": "function", "function": {"name": "get_weather"}})
    body = {**REAL, "tool_choice": tool_choice, "parallel_tool_calls": choice != "required"}
    names = {"get_weather"} if choice == "named" else set(SCHEMAS)
    finish = "stop" if choice == "named" else "tool_calls"  # vLLM's
    if not streamed:
        r = post(real, body)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["finish_reason"] == finish and c["message"]["content"] is None, c
        _check_calls(c["message"]["tool_calls"], names)
        if choice == "required":
            assert len(c["message"]["tool_calls"]) == 1  # parallel_tool_calls: false
        return
    chunks = stream(real, body)
    calls: dict[int, dict] = {}
    for ch in chunks:
        for t in (ch["choices"][0]["delta"].get("tool_calls") or []) if ch["choices"] else []:
            if "id" in t:
                calls[t["index"]] = {"id": t["id"], "type": t["type"],
                                     "function": {"name": t["function"]["name"], "arguments": ""}}
            calls[t["index"]]["function"]["arguments"] += t["function"].get("arguments") or ""
    assert chunks[-1]["choices"][0]["finish_reason"] == finish
    _check_calls([calls[i] for i in sorted(calls)], names)


@pytest.mark.slow
def test_serve_with_tool_flags_and_a_chat_template(tmp_path_factory, tmp_path):
    """`serve` end to end: the flags reach the app; the --chat-template file renders the tools;
    tool_choice "auto" is accepted, a named function forces a valid call."""
    from tests.server_fixtures import ServeProcess, tiny_model_dir

    template = tmp_path / "tools.jinja"
    template.write_text("CUSTOM:" + TOOL_TEMPLATE)
    with ServeProcess("--model", tiny_model_dir(tmp_path_factory), "--device", "cpu",
                      "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "512",
                      "--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v3",
                      "--chat-template", str(template), "--generation-config", "vllm") as s:
        ids = httpx.post(f"{s.url}/tokenize", json={"messages": REAL["messages"]}).json()["tokens"]
        text = httpx.post(f"{s.url}/detokenize", json={"tokens": ids}).json()["prompt"]
        assert text.startswith("CUSTOM:") and "TOOLS:" not in text  # no tools: none rendered
        assert httpx.get(f"{s.url}/tokenizer_info").json()["chat_template"] == template.read_text()
        r = post(s, {**REAL, "max_tokens": 8})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"] == []
        named = {"type": "function", "function": {"name": "get_weather"}}
        c = post(s, {**REAL, "tool_choice": named}).json()["choices"][0]
        assert c["finish_reason"] == "stop"
        _check_calls(c["message"]["tool_calls"], {"get_weather"})
