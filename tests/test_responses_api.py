"""`POST /v1/responses` (OpenAI's Responses API, server/responses.py): on the tiny model, its
output equals the chat route's for the same conversation (instructions, input items, function
calls and their outputs, a previous response), streamed and whole; forced tool calls and
text.format; on a scripted fake engine, reasoning and parsed tool calls as output items and
events, and a failure mid-stream; every refused field a 400 naming it; the API key; metrics."""

from __future__ import annotations

import json
import os
import time

import httpx
import jsonschema
import pytest
import transformers

from server.api_server import build_app
from server.cli import build_parser
from server.tool_calls import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP
from tests.server_fixtures import OFFLINE_ENV, TINY_MODEL, FakeEngine, InProcessServer, ScriptedEngine, assert_error

os.environ.update(OFFLINE_ENV)

# renders system, user, assistant turns with tool calls, tool turns and the tools' names
TEMPLATE = (
    "{{ bos_token }}{% if tools %}{{ 'TOOLS:' + (tools | map(attribute='function') "
    "| map(attribute='name') | join(',')) }}{% endif %}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '<｜Assistant｜>' + (m['content'] or '') }}"
    "{% for c in (m.tool_calls or []) %}{{ '[call ' + c['id'] + ' ' + c['function']['name'] + ' '"
    " + c['function']['arguments'] + ']' }}{% endfor %}{{ eos_token }}"
    "{% elif m['role'] == 'tool' %}{{ '[output ' + m['tool_call_id'] + ' ' + m['content'] + ']' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}")
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather in a city",
          "parameters": WEATHER_PARAMS}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
WEATHER = '{"city": "Paris", "unit": "celsius"}'
GREEDY = {"temperature": 0}


def _server(engine, argv: list[str]):
    args = build_parser().parse_args(["--model", str(TINY_MODEL), *argv])
    return InProcessServer(build_app(engine, args))


@pytest.fixture(scope="module")
def real():
    """The tiny model on the CPU, with a chat template that renders tool turns."""
    from common.args import EngineArgs
    from engine.async_llm import AsyncLLM
    engine = AsyncLLM(EngineArgs(str(TINY_MODEL), device="cpu", dtype="float32", num_kv_blocks=256,
                                 max_model_len=512), core_in_thread=True)
    try:
        with _server(engine, ["--chat-template", TEMPLATE]) as s:
            yield s
    finally:
        engine.shutdown()


def create(server, body: dict, status: int = 200, **kw) -> dict:
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60, **kw)
    assert r.status_code == status, r.text
    return r.json()


def chat(server, body: dict) -> dict:
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def events_of(server, body: dict, headers: dict | None = None) -> list[dict]:
    """A stream's events, each checked: an `event:` line naming its data's type, numbered in
    order from 0, no [DONE]."""
    with httpx.stream("POST", f"{server.url}/v1/responses", json={**body, "stream": True},
                      headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = sse_events(text)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def sse_events(text: str) -> list[dict]:
    """The events of an SSE body, each `event:` line naming its data's type."""
    events = []
    for block in filter(None, text.split("\n\n")):
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}", block
        events.append(event)
    return events


def text_of(response: dict) -> str:
    return "".join(p["text"] for it in response["output"] if it["type"] == "message" for p in it["content"])


def streamed_items(events: list[dict]) -> list[dict]:
    """Per output item, from the events: its added/done items and the text its deltas make."""
    items: dict[int, dict] = {}
    for e in events:
        if e["type"] == "response.output_item.added":
            assert e["output_index"] == len(items)  # items open in order
            items[e["output_index"]] = {"added": e["item"], "deltas": "", "done": None}
        elif e["type"].endswith(".delta"):
            item = items[e["output_index"]]
            assert e["item_id"] == item["added"]["id"] and item["done"] is None
            item["deltas"] += e["delta"]
        elif e["type"] == "response.output_item.done":
            items[e["output_index"]]["done"] = e["item"]
    return [items[i] for i in sorted(items)]


# ---- the tiny model: the chat route's output for the same conversation ----

def test_output_equals_chat_with_instructions_as_system(real):
    system, user = "You count apples.", "Mia has 7 apples. Leo has 3 pens."
    r = create(real, {"instructions": system, "input": user, "max_output_tokens": 24, **GREEDY,
                      "metadata": {"run": "1"}, "user": "u1"})
    c = chat(real, {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
                    "max_tokens": 24, **GREEDY})
    choice = c["choices"][0]
    assert r["id"].startswith("resp_") and r["object"] == "response" and r["model"] == c["model"]
    assert text_of(r) == choice["message"]["content"] and text_of(r)
    u = r["usage"]
    assert (u["input_tokens"], u["output_tokens"]) == (c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"])
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    assert u["output_tokens_details"] == {"reasoning_tokens": 0} and "cached_tokens" in u["input_tokens_details"]
    (item,) = r["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["id"].startswith("msg_")
    assert item["content"][0]["type"] == "output_text" and item["content"][0]["annotations"] == []
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    assert r["status"] == item["status"] == status
    assert (r["instructions"], r["max_output_tokens"], r["temperature"], r["metadata"], r["user"]) == (
        system, 24, 0.0, {"run": "1"}, "u1")
    assert r["error"] is None and r["previous_response_id"] is None and "output_text" not in r
    bare = create(real, {"input": user, "max_output_tokens": 4, **GREEDY})  # the user message alone
    assert bare["usage"]["input_tokens"] == chat(real, {"messages": [{"role": "user", "content": user}],
                                                        "max_tokens": 4})["usage"]["prompt_tokens"]


def test_max_output_tokens_makes_it_incomplete(real):
    r = create(real, {"input": "Emma has", "max_output_tokens": 3, **GREEDY, "ignore_eos": True})
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["usage"]["output_tokens"] == 3 and r["output"][-1]["status"] == "incomplete"
    events = events_of(real, {"input": "Emma has", "max_output_tokens": 3, **GREEDY, "ignore_eos": True})
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert text_of(events[-1]["response"]) == text_of(r)


def test_stream_equals_whole_with_logprobs(real):
    body = {"instructions": "Answer.", "input": "Question: Mia has 7 apples. How many?",
            "max_output_tokens": 16, **GREEDY, "include": ["message.output_text.logprobs"],
            "top_logprobs": 2}
    whole = create(real, body)
    events = events_of(real, body)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole['status']}"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    (item,) = streamed_items(events)
    final = events[-1]["response"]
    assert item["deltas"] == text_of(whole) == text_of(final) == events[-4]["text"]
    assert item["done"] == final["output"][0] and final["usage"] == whole["usage"]
    # logprobs: every generated token once, as in the whole response; deltas carry no bytes
    lps = whole["output"][0]["content"][0]["logprobs"]
    assert len(lps) == whole["usage"]["output_tokens"] and all(len(e["top_logprobs"]) == 2 for e in lps)
    streamed = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    assert [(e["token"], e["logprob"]) for e in streamed] == [(e["token"], e["logprob"]) for e in lps]
    assert all("bytes" not in e for e in streamed) and events[-4]["logprobs"] == lps


def test_function_call_items_render_as_the_chat_tool_turns(real):
    user_parts = [{"type": "input_text", "text": "Weather in Paris?"},
                  {"type": "input_text", "text": "Be brief."}]
    items = [{"role": "developer", "content": "You have tools."},
             {"type": "message", "role": "user", "content": user_parts},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "dropped"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": WEATHER},
             {"type": "function_call_output", "call_id": "call_1", "output": "18 C and sunny"}]
    messages = [{"role": "system", "content": "You have tools."},
                {"role": "user", "content": "Weather in Paris?\nBe brief."},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": WEATHER}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    r = create(real, {"input": items, "tools": TOOLS, "tool_choice": "none", "max_output_tokens": 12, **GREEDY})
    c = chat(real, {"messages": messages, "tools": CHAT_TOOLS, "tool_choice": "none", "max_tokens": 12, **GREEDY})
    assert r["usage"]["input_tokens"] == c["usage"]["prompt_tokens"]
    assert text_of(r) == c["choices"][0]["message"]["content"]
    assert r["tools"][0]["name"] == "get_weather" and r["tool_choice"] == "none"
    # the call and its output are in the prompt: without them it is shorter
    bare = create(real, {"input": items[:2], "tools": TOOLS, "tool_choice": "none", "max_output_tokens": 1})
    assert bare["usage"]["input_tokens"] < r["usage"]["input_tokens"] - 10


def test_forced_tool_choice_is_a_function_call_item(real):
    body = {"input": "Weather in Paris?", "tools": TOOLS, "max_output_tokens": 96, **GREEDY,
            "tool_choice": {"type": "function", "name": "get_weather"}}
    r = create(real, body)
    (call,) = r["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["status"] == "completed"
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    jsonschema.validate(json.loads(call["arguments"]), WEATHER_PARAMS)
    assert r["tool_choice"] == {"type": "function", "name": "get_weather"}
    # the call's output continues the conversation; an output of a call never made is a 400
    out = {"type": "function_call_output", "call_id": call["call_id"], "output": "18 C"}
    nxt = create(real, {"input": [out], "previous_response_id": r["id"], "tools": TOOLS,
                        "tool_choice": "none", "max_output_tokens": 2})
    assert nxt["status"] in ("completed", "incomplete") and nxt["previous_response_id"] == r["id"]
    bad = create(real, {"input": [{**out, "call_id": "call_none"}], "previous_response_id": r["id"],
                        "max_output_tokens": 2}, status=400)["error"]
    assert bad["param"] == "input.0.call_id" and "call_none" in bad["message"], bad
    # "required", streamed: the call's arguments arrive as deltas and add up to the final item
    events = events_of(real, {**body, "tool_choice": "required"})
    (item,) = streamed_items(events)
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert item["added"]["type"] == "function_call" and item["added"]["status"] == "in_progress"
    assert item["deltas"] == done["arguments"] == item["done"]["arguments"] and done["name"] == "get_weather"
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["output"] == [item["done"]]
    jsonschema.validate(json.loads(done["arguments"]), WEATHER_PARAMS)


def test_text_format_json_schema(real):
    fmt = {"type": "json_schema", "name": "weather", "schema": WEATHER_PARAMS, "strict": True}
    r = create(real, {"input": "Weather in Paris as JSON", "text": {"format": fmt},
                      "max_output_tokens": 96, **GREEDY})
    assert r["status"] == "completed", r
    jsonschema.validate(json.loads(text_of(r)), WEATHER_PARAMS)
    assert r["text"] == {"format": fmt}
    obj = create(real, {"input": "Any JSON", "text": {"format": {"type": "json_object"}},
                        "max_output_tokens": 96, **GREEDY})
    assert obj["status"] == "completed" and isinstance(json.loads(text_of(obj)), dict)


def test_previous_response_id_continues_the_conversation(real):
    first = create(real, {"instructions": "Old rules.", "input": "Mia has 7 apples.",
                          "max_output_tokens": 8, **GREEDY})
    assert first["store"] is True
    second = create(real, {"instructions": "New rules.", "input": "How many apples?",
                           "previous_response_id": first["id"], "max_output_tokens": 8, **GREEDY})
    # the earlier input and output come back, the earlier instructions do not (OpenAI's rule)
    c = chat(real, {"messages": [{"role": "system", "content": "New rules."},
                                 {"role": "user", "content": "Mia has 7 apples."},
                                 {"role": "assistant", "content": text_of(first)},
                                 {"role": "user", "content": "How many apples?"}], "max_tokens": 8, **GREEDY})
    assert second["usage"]["input_tokens"] == c["usage"]["prompt_tokens"]
    assert text_of(second) == c["choices"][0]["message"]["content"]
    assert second["previous_response_id"] == first["id"]
    # a chain: the third turn sees both earlier turns
    third = create(real, {"input": "And pens?", "previous_response_id": second["id"], "max_output_tokens": 2})
    assert third["usage"]["input_tokens"] > second["usage"]["input_tokens"]
    # stored responses: retrieved as sent, deleted, then gone
    got = httpx.get(f"{real.url}/v1/responses/{first['id']}")
    assert got.status_code == 200 and got.json() == first
    gone = httpx.delete(f"{real.url}/v1/responses/{first['id']}").json()
    assert gone == {"id": first["id"], "object": "response", "deleted": True}
    assert_error(httpx.get(f"{real.url}/v1/responses/{first['id']}"), 404, "response_id")
    err = assert_error(httpx.post(f"{real.url}/v1/responses", json={
        "input": "x", "previous_response_id": first["id"]}), 404, "previous_response_id")
    assert err["code"] == "previous_response_not_found"
    unstored = create(real, {"input": "hi", "store": False, "max_output_tokens": 1})
    assert unstored["store"] is False
    assert_error(httpx.get(f"{real.url}/v1/responses/{unstored['id']}"), 404, "response_id")
    assert_error(httpx.post(f"{real.url}/v1/responses/{second['id']}/cancel"), 400, "response_id")


def test_context_overflow_names_the_responses_fields(real):
    err = assert_error(httpx.post(f"{real.url}/v1/responses", json={
        "input": "apples " * 20, "max_output_tokens": 10_000}), 400, "max_output_tokens")
    assert err["code"] == "context_length_exceeded" and "input" in err["message"]


# ---- a scripted fake engine: reasoning, parsed tool calls, failures ----

def v3_call(name: str, args: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{args}\n```{CALL_END}"


SCRIPT = f"Weather first.</think>Let me check.{CALLS_BEGIN}{v3_call('get_weather', WEATHER)}\n" \
         f"{v3_call('get_time', '{}')}{CALLS_END}"


class FailingEngine(ScriptedEngine):
    """The scripted engine; a prompt holding FAIL fails after its first output (BADFIELD: naming a field)."""

    async def generate(self, prompt, params, request_id):
        text = self.tokenizer.decode(prompt if not isinstance(prompt, str) else [])
        async for out in super().generate(prompt, params, request_id):
            yield out
            if "BADFIELD" in text:
                raise ValueError("allowed_token_ids: none of them may come next")
            if "FAIL" in text:
                raise RuntimeError("the engine broke")


@pytest.fixture(scope="module")
def scripted():
    tok = transformers.AutoTokenizer.from_pretrained(TINY_MODEL)
    engine = FailingEngine(tok, max_model_len=1024)
    engine.script = tok(SCRIPT, add_special_tokens=False)["input_ids"]
    with _server(engine, ["--reasoning-parser", "deepseek_r1", "--enable-auto-tool-choice",
                          "--tool-call-parser", "deepseek_v3", "--api-key", "sk-test",
                          "--responses-store-size", "1"]) as s:
        s.tok = tok
        yield s


KEY = {"Authorization": "Bearer sk-test"}
SCRIPTED = {"input": "weather?", "tools": TOOLS + [{"type": "function", "name": "get_time"}],
            "stop_token_ids": [1]}


def test_reasoning_and_tool_calls_as_items_whole_and_streamed(scripted):
    r = create(scripted, SCRIPTED, headers=KEY)
    got = [(it["type"], it.get("content", [{}])[0].get("text") if it["type"] != "function_call"
            else (it["name"], it["arguments"])) for it in r["output"]]
    assert got == [("reasoning", "Weather first."), ("message", "Let me check."),
                   ("function_call", ("get_weather", WEATHER)), ("function_call", ("get_time", "{}"))]
    assert r["output"][0]["id"].startswith("rs_") and r["output"][0]["summary"] == [] and r["status"] == "completed"
    n_reasoning = len(scripted.tok("Weather first.", add_special_tokens=False)["input_ids"])
    assert r["usage"]["output_tokens_details"]["reasoning_tokens"] == n_reasoning > 0
    events = events_of(scripted, SCRIPTED, headers=KEY)
    items = streamed_items(events)
    assert [(i["done"]["type"], i["deltas"]) for i in items] == [
        ("reasoning", "Weather first."), ("message", "Let me check."),
        ("function_call", WEATHER), ("function_call", "{}")]
    assert [i["added"]["status"] for i in items] == ["in_progress"] * 4
    kinds = [e["type"] for e in events]
    assert "response.reasoning_text.delta" in kinds and kinds.count("response.reasoning_text.done") == 1
    parts = [e["part"]["type"] for e in events if e["type"] == "response.content_part.added"]
    assert parts == ["reasoning_text", "output_text"]
    assert kinds.count("response.function_call_arguments.delta") > 5  # token by token
    final = events[-1]["response"]
    assert final["output"] == [i["done"] for i in items] and final["usage"] == r["usage"]
    # the store holds one response (--responses-store-size 1): the older one is evicted
    assert httpx.get(f"{scripted.url}/v1/responses/{r['id']}", headers=KEY).status_code == 404
    assert httpx.get(f"{scripted.url}/v1/responses/{final['id']}", headers=KEY).json() == final


def test_a_failure_mid_stream_ends_with_error_and_failed(scripted):
    events = events_of(scripted, {"input": "FAIL now", "stop_token_ids": [1]}, headers=KEY)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["message"] == "internal server error (RuntimeError)"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error" and events[-2]["param"] is None
    # kept as failed, as a background response is: GET answers what the last event said
    got = httpx.get(f"{scripted.url}/v1/responses/{failed['id']}", headers=KEY).json()
    assert failed["store"] is True and got == failed
    events = events_of(scripted, {"input": "BADFIELD now", "stop_token_ids": [1]}, headers=KEY)  # names a field
    assert events[-2]["param"] == "allowed_token_ids" and events[-1]["response"]["error"]["code"] == "invalid_prompt"


def test_the_routes_need_the_api_key_and_are_counted(scripted):
    assert_error(httpx.post(f"{scripted.url}/v1/responses", json={"input": "hi"}), 401)
    assert_error(httpx.get(f"{scripted.url}/v1/responses/resp_x"), 401)
    assert_error(httpx.get(f"{scripted.url}/v1/responses/resp_x", headers=KEY), 404, "response_id")
    metrics = httpx.get(f"{scripted.url}/metrics").text
    assert 'handler="/v1/responses",method="POST",status="4xx"' in metrics
    assert 'handler="/v1/responses/{response_id}",method="GET",status="4xx"' in metrics


# ---- refusals ----

@pytest.fixture(scope="module")
def plain():
    tok = transformers.AutoTokenizer.from_pretrained(TINY_MODEL)
    engine = FakeEngine(tok, max_model_len=512)
    with _server(engine, ["--responses-store-size", "0"]) as s:
        s.engine = engine
        yield s


REFUSED = [
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"tools": [{"type": "web_search"}]}, "tools.0"),
    ({"tools": TOOLS, "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS}, "tool_choice"),  # "auto" needs --enable-auto-tool-choice
    ({"include": ["file_search_call.results"]}, "include"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format"),  # no name
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format.schema"),
    ({"reasoning": {"summary": "detailed"}}, "reasoning.summary"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": []}, "input"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.0.type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input.0.output"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"temperature": -1}, "temperature"),
    ({"top_k": True}, "top_k"),  # a vLLM extra: the chat request's check names it
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"max_tokens": 5}, "max_tokens"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"logprobs": True}, "logprobs"),
    ({"n": 2}, "n"),
    ({"logits_processors": ["x"]}, "logits_processors"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),  # this server stores none
]


@pytest.mark.parametrize("body,param", REFUSED, ids=[p for _, p in REFUSED])
def test_refused_fields_are_400s_naming_them(plain, body, param):
    r = httpx.post(f"{plain.url}/v1/responses", json={"input": "hi", **body}, timeout=30)
    assert_error(r, 400, param)


def test_a_client_that_leaves_aborts_its_stream(plain, monkeypatch):
    monkeypatch.setattr(plain.engine, "step_delay", 0.02)  # 400 tokens: 8 s unless aborted
    with httpx.stream("POST", f"{plain.url}/v1/responses", timeout=30,
                      json={"input": "hi", "stream": True, "max_output_tokens": 400}) as r:
        assert next(r.iter_lines()) == "event: response.created"
    deadline = time.time() + 5
    while not plain.engine.aborted and time.time() < deadline:
        time.sleep(0.02)
    assert plain.engine.aborted


def test_vllm_extras_reach_the_sampler(plain):
    """vLLM's seed goes to the chat request: the same seed samples the same text."""
    body = {"input": "hi", "temperature": 1.0, "seed": 7, "max_output_tokens": 12}
    a, b = create(plain, body), create(plain, body)
    assert text_of(a) == text_of(b) and a["store"] is False
    assert text_of(create(plain, {**body, "seed": 8})) != text_of(a)

