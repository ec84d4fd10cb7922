"""Structured outputs: grammars (llguidance) force the tiny model's output, whatever it knows.

The tiny model only knows GSM8K-style text, so anything JSON-shaped it writes is the grammar's
doing. Schemas bound every string (maxLength), array (maxItems) and object
(additionalProperties: false) so that the output ends well within max_tokens.
"""

from __future__ import annotations

import json
import sys

import httpx
import jsonschema
import openai
import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import Sampler, SamplingBatch
from common.sampling_params import StructuredOutputs
from tests.server_fixtures import REPO, TINY_MODEL, ServeProcess, tiny_engine_server

PROMPT = "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:"


def S(n: int = 12) -> dict:
    return {"type": "string", "maxLength": n}


def obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props,
            "required": list(props if required is None else required),
            "additionalProperties": False}


def small_int(lo: int = 0, hi: int = 9) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


SCHEMAS = [
    obj({"answer": {"type": "integer"}}),
    obj({"answer": small_int(0, 1000), "unit": S(8)}),
    obj({"name": S(10), "ok": {"type": "boolean"}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"x": {"type": "number", "minimum": -10, "maximum": 10}}),
    obj({"items": {"type": "array", "items": small_int(0, 99), "minItems": 1, "maxItems": 3}}),
    obj({"tags": {"type": "array", "items": S(5), "maxItems": 2}}),
    obj({"person": obj({"name": S(8), "age": small_int(0, 120)})}),
    obj({"a": obj({"b": obj({"c": {"type": "boolean"}})})}),
    obj({"kind": {"const": "apple"}, "count": small_int(1, 9)}),
    obj({"value": {"type": ["integer", "null"], "minimum": 0, "maximum": 50}}),
    obj({"choice": {"anyOf": [{"type": "boolean"}, {"enum": [1, 2, 3]}]}}),
    obj({"points": {"type": "array", "maxItems": 2, "items": obj({"x": small_int(), "y": small_int()})}}),
    obj({"id": {"type": "string", "pattern": "^[a-z]{2,4}-[0-9]{1,3}$"}}),
    obj({"first": S(6), "last": S(6), "middle": S(3)}, required=["first", "last"]),
    {"type": "array", "items": small_int(), "minItems": 2, "maxItems": 4},
    {"enum": ["yes", "no", 42, None]},
    obj({"m": {"type": "object", "additionalProperties": small_int(), "maxProperties": 2}}),
    obj({"steps": {"type": "array", "maxItems": 3, "items": {"enum": ["add", "sub", "mul"]}},
         "result": small_int(-100, 100)}),
    {"$defs": {"pt": obj({"n": small_int(0, 5)})}, **obj({"p": {"$ref": "#/$defs/pt"}, "q": {"$ref": "#/$defs/pt"}})},
    obj({"ratio": {"type": "number", "minimum": 0, "maximum": 1}, "label": S(4), "flag": {"type": "boolean"}}),
]


def constrained(kind: str, spec="", **kw) -> SamplingParams:
    if not isinstance(spec, str):
        spec = json.dumps(spec)
    return SamplingParams(**({"temperature": 0, "max_tokens": 128} | kw),
                          structured_outputs=StructuredOutputs(kind, spec))


@pytest.fixture(scope="module")
def llm():
    return LLM(str(TINY_MODEL), device="cpu", dtype="float32", num_kv_blocks=512)


# ---- sampler ----

def _bitmask(vocab: int, allowed: list[set[int]]) -> torch.Tensor:
    words = torch.zeros(len(allowed), (vocab + 31) // 32, dtype=torch.int64)
    for r, toks in enumerate(allowed):
        for t in toks:
            words[r, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # as int32 bits


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_bitmask_constrains_only_its_rows(temperature):
    torch.manual_seed(0)
    logits = torch.randn(3, 70) * 5
    allowed = {5, 31, 63, 69}  # bit 31 of a word is its sign bit
    batch = SamplingBatch.from_params([SamplingParams(temperature=temperature)] * 3,
                                      [[]] * 3, [[]] * 3, [None] * 3, [], "cpu")
    batch.token_bitmask, batch.bitmask_rows = _bitmask(70, [allowed]), torch.tensor([1])
    for _ in range(20):
        ids = Sampler()(logits, batch).token_ids.tolist()
        assert ids[1] in allowed
    if temperature == 0:
        free = logits.argmax(-1).tolist()
        assert (ids[0], ids[2]) == (free[0], free[2])
        assert ids[1] == max(allowed, key=lambda t: logits[1, t])


def test_plain_requests_do_no_grammar_work(llm):
    """Without a constrained request the scheduler finds no rows and the runner gets no bitmask."""
    sched = llm.engine.scheduler
    seen = []
    schedule = llm.engine._schedule
    llm.engine._schedule = lambda: seen.append(schedule()) or seen[-1]
    try:
        llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4))
    finally:
        llm.engine._schedule = schedule
    assert seen and all(so.grammar_bitmask is None and not so.grammar_req_ids for so in seen)
    assert not sched._structured and not sched.needs_sync()


def test_server_imports_and_serves_plain_requests_without_llguidance():
    """llguidance is imported only by a request that asks for structure: with it missing, the
    server's modules import and plain requests pass, a structured one is a clear error."""
    code = """
import sys
sys.modules["llguidance"] = None  # as if not installed
import engine.core, engine.async_llm, server.api_server
from server.chat_protocol import ChatCompletionRequest
msgs = [{"role": "user", "content": "hi"}]
ChatCompletionRequest(messages=msgs).to_sampling_params()
try:
    ChatCompletionRequest(messages=msgs, guided_choice=["a"]).to_sampling_params()
except ValueError as e:
    print(e)
"""
    import subprocess
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("guided_choice: structured outputs need the 'llguidance' package")


def test_missing_package_is_a_clear_error(monkeypatch):
    from engine.structured_outputs import validate
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import fails as if not installed
    with pytest.raises(ValueError, match=r"guided_regex: .*'llguidance' package"):
        validate(StructuredOutputs("regex", "a+"), "guided_regex")


# ---- engine ----

def test_choice_greedy_and_sampled(llm):
    choices = ["yes", "no", "maybe", "eight apples"]
    params = [constrained("choice", choices),
              constrained("choice", choices, temperature=1.0, seed=3, n=6)]
    outs = llm.generate([PROMPT, PROMPT], params)
    texts = [o.text for r in outs for o in r.outputs]
    assert len(texts) == 7 and set(texts) <= set(choices), texts
    assert len(set(texts)) > 1  # the six samples are drawn, one matcher each
    assert all(o.finish_reason == "stop" for r in outs for o in r.outputs)


def test_json_schemas_validate(llm):
    outs = llm.generate([PROMPT] * len(SCHEMAS), [constrained("json", s) for s in SCHEMAS])
    for schema, r in zip(SCHEMAS, outs):
        o = r.outputs[0]
        assert o.finish_reason == "stop", (schema, o.text)
        jsonschema.validate(json.loads(o.text), schema)
        assert o.text == json.dumps(json.loads(o.text), ensure_ascii=False)  # compact by default


def test_json_whitespace_options(llm):
    schema = SCHEMAS[7]
    tight, free = llm.generate([PROMPT] * 2, [
        SamplingParams(temperature=0, max_tokens=96, structured_outputs=StructuredOutputs(
            "json", json.dumps(schema), disable_any_whitespace=True)),
        SamplingParams(temperature=0, max_tokens=96, structured_outputs=StructuredOutputs(
            "json", json.dumps(schema), whitespace_pattern=r"[ ]{0,2}"))])
    value = json.loads(tight.outputs[0].text)
    assert tight.outputs[0].text == json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    jsonschema.validate(json.loads(free.outputs[0].text), schema)


def test_json_object_regex_and_grammars(llm):
    params = [constrained("json_object", temperature=1.0, seed=0, n=8, max_tokens=48),
              constrained("regex", r"[0-9]{1,3} (apples|pears)"),
              constrained("grammar", 'start: "Answer " NUM\nNUM: /[1-9][0-9]?/'),  # Lark
              constrained("grammar", 'root ::= "x=" [0-9] [0-9]?')]  # GBNF
    objs, regex, lark, gbnf = llm.generate([PROMPT] * 4, params)
    stopped = [o for o in objs.outputs if o.finish_reason == "stop"]
    assert stopped  # (the others run to max_tokens inside one long key string)
    assert all(isinstance(json.loads(o.text), dict) for o in stopped)
    import re
    assert re.fullmatch(r"[0-9]{1,3} (apples|pears)", regex.outputs[0].text)
    assert re.fullmatch(r"Answer [1-9][0-9]?", lark.outputs[0].text)
    assert re.fullmatch(r"x=[0-9][0-9]?", gbnf.outputs[0].text)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemption_and_async_keep_matchers_in_step(llm, async_scheduling):
    """A KV pool too small for the batch preempts requests (they recompute prompt and outputs)
    and prompts come in chunks that sample nothing; the matcher advanced once per sampled token,
    so outputs equal the roomy run's."""
    schemas = SCHEMAS[:8]
    params = [constrained("json", s, max_tokens=64) for s in schemas]
    params += [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]  # unconstrained
    prompts = [PROMPT] * len(params)
    ref = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    small = LLM(str(TINY_MODEL), device="cpu", dtype="float32", num_kv_blocks=40, block_size=4,
                max_num_batched_tokens=16, async_scheduling=async_scheduling)  # chunked prompts
    outs = small.generate(prompts, params)
    assert small.scheduler.stats.num_preemptions > 0
    assert [r.outputs[0].token_ids for r in outs] == ref
    for schema, r in zip(schemas, outs):
        jsonschema.validate(json.loads(r.outputs[0].text), schema)


# a Lark alternation of 3000 strings compiles, then fails in the matcher while generating (the
# parser's rows hold at most 2000 items)
TOO_WIDE_GRAMMAR = "start: " + " | ".join(f'"choice{i}"' for i in range(3000))


def test_a_matcher_that_fails_while_generating_is_an_error(llm):
    """Not a "stop" whose text breaks the constraint: finish_reason "error", and why."""
    out = llm.generate(["Question: a"], constrained("grammar", TOO_WIDE_GRAMMAR, max_tokens=8))[0].outputs[0]
    assert out.finish_reason == "error", (out.text, out.finish_reason)
    assert out.stop_reason.startswith("Structured output: the constraint could not be followed")
    assert len(out.stop_reason) < 500
    ok = llm.generate(["Question: a"], constrained("choice", ["yes", "no"]))[0].outputs[0]
    assert ok.finish_reason == "stop" and ok.text in ("yes", "no")  # the engine goes on


def test_choices_past_the_grammar_parsers_row_limit(llm):
    """A choice list is one regex alternation of the exact strings: 3000 choices (past the 2000
    items an Earley row may hold) are followed, each choice exactly, quoting and all."""
    many = [f"choice{i}" for i in range(2997)] + ["a (b|c)*", 'quo"te\\n', "émoji 😀"]
    outs = llm.generate(["Question: a"] * 4, [constrained("choice", many, max_tokens=16)] + [
        constrained("choice", many, temperature=1.0, seed=s, max_tokens=16) for s in range(3)])
    for r in outs:
        assert r.outputs[0].finish_reason == "stop" and r.outputs[0].text in many, r.outputs[0]
    for special in many[-3:]:  # the escaped characters: allowed exactly, nothing else after them
        only = llm.generate(["Question: a"], constrained("choice", [special], max_tokens=16))[0].outputs[0]
        assert only.text == special and only.finish_reason == "stop"


def test_offline_generate_checks_every_constraint_before_submitting(llm):
    bad = [constrained("choice", ["a"]), constrained("regex", "a(b")]
    with pytest.raises(ValueError, match=r"structured_outputs: .*unclosed group"):
        llm.generate([PROMPT, PROMPT], bad)
    assert not llm.engine.has_unfinished_requests()


# ---- HTTP ----

@pytest.fixture(scope="module")
def server():
    with tiny_engine_server(num_kv_blocks=512) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _chat(client, server, **kw):
    return client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": PROMPT}],
        **({"temperature": 0, "max_tokens": 128} | kw))


def _chat_stream_text(client, server, **kw) -> tuple[str, str]:
    text, finish = "", None
    for chunk in _chat(client, server, stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_response_format_json_schema(client, server, stream):
    """Every schema, sent at once (they share steps), each output valid under its schema."""
    from concurrent.futures import ThreadPoolExecutor

    def one(schema):
        fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}
        if stream:
            return _chat_stream_text(client, server, response_format=fmt)
        c = _chat(client, server, response_format=fmt).choices[0]
        return c.message.content, c.finish_reason

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, SCHEMAS))
    for schema, (text, finish) in zip(SCHEMAS, results):
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_chat_json_object_and_n(client, server):
    r = _chat(client, server, response_format={"type": "json_object"}, temperature=1.0, seed=0,
              n=4, max_tokens=48)
    stopped = [c.message.content for c in r.choices if c.finish_reason == "stop"]
    assert stopped and all(isinstance(json.loads(t), dict) for t in stopped)


def test_completions_guided_fields(client, server):
    schema = SCHEMAS[7]
    kw = {"model": server.model, "prompt": PROMPT, "max_tokens": 96, "temperature": 0}
    r = client.completions.create(**kw, extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    r = client.completions.create(**kw, extra_body={"guided_json": json.dumps(schema)}, stream=True)
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in r)), schema)
    r = client.completions.create(**kw, n=3, extra_body={"guided_choice": ["red", "blue"]})
    assert {c.text for c in r.choices} <= {"red", "blue"}
    r = client.completions.create(**kw, extra_body={"guided_regex": r"[a-c]{2}-[0-9]"})
    assert len(r.choices[0].text) == 4 and r.choices[0].finish_reason == "stop"
    r = client.completions.create(**kw, extra_body={"guided_grammar": 'root ::= "A" | "B"'})
    assert r.choices[0].text in ("A", "B")
    for so, check in [({"json": schema}, lambda t: jsonschema.validate(json.loads(t), schema)),
                      ({"regex": "[0-9]+ apples"}, lambda t: t.endswith(" apples")),
                      ({"choice": ["a b", "c"]}, lambda t: t in ("a b", "c")),
                      ({"grammar": 'start: "ok"'}, lambda t: t == "ok"),
                      ({"json_object": True, "disable_any_whitespace": True}, None)]:
        r = client.completions.create(**kw, extra_body={"structured_outputs": so})
        if check is not None:
            check(r.choices[0].text)


def test_a_failed_constraint_is_a_400_or_an_in_band_error(client, server):
    kw = {"model": server.model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
          "extra_body": {"guided_grammar": TOO_WIDE_GRAMMAR}}
    with pytest.raises(openai.BadRequestError, match="constraint could not be followed"):
        client.completions.create(**kw)
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={**{k: v for k, v in kw.items() if k != "extra_body"}, **kw["extra_body"],
                            "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "constraint could not be followed" in json.loads(events[-2])["error"]["message"]
    assert _chat(client, server, max_tokens=4).choices[0].finish_reason == "length"


@pytest.mark.parametrize("body, field", [
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_json": {"type": "nope"}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
])
def test_bad_constraint_is_a_400_naming_the_field(server, body, field):
    for path, base in (("completions", {"prompt": PROMPT}),
                       ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(f"{server.url}/v1/{path}", json={**base, **body, "max_tokens": 8}, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and field in err["message"], err


def test_openai_parse_with_pydantic(client, server):
    from typing import Literal

    from pydantic import BaseModel, Field

    class Step(BaseModel):
        op: Literal["add", "sub"]
        n: int = Field(ge=0, le=99)

    class Solution(BaseModel):
        steps: list[Step] = Field(max_length=2)
        answer: int = Field(ge=0, le=999)
        unit: str = Field(max_length=8)

    r = client.beta.chat.completions.parse(
        model=server.model, messages=[{"role": "user", "content": PROMPT}],
        response_format=Solution, temperature=0, max_tokens=128)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Solution) and r.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_tensor_parallel_ranks_apply_the_same_mask():
    """-tp 2 on the CPU: the core's bitmask reaches both ranks; their samples agree (the rank
    digest check runs every step) and the output follows the schema."""
    schema = SCHEMAS[7]
    with ServeProcess("--model", str(TINY_MODEL), "--device", "cpu", "--dtype", "float32",
                      "-tp", "2", "--num-kv-blocks", "128", "--max-model-len", "256",
                      "--rank-check-interval", "1") as s:
        body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 96,
                "temperature": 1.0, "seed": 1, "n": 2,
                "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}
        r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            jsonschema.validate(json.loads(c["message"]["content"]), schema)
        assert httpx.get(f"{s.url}/health").status_code == 200


def test_forced_required_choice_keeps_the_tools_definitions():
    """tool_choice "required" nests each tool's parameters in one array schema: their $defs (as
    Pydantic writes them) move to its root, so that "#/$defs/..." still resolves."""
    from engine.structured_outputs import validate
    from server.tool_calls import forced_schema
    unit = {"type": "string", "enum": ["c", "f"]}

    def tool(name, defs):
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "$defs": defs, "properties": {"unit": {"$ref": "#/$defs/Unit"}},
            "required": ["unit"]}}}
    schema = forced_schema([tool("a", {"Unit": unit}), tool("b", {"Unit": unit})], "required")
    assert schema["$defs"] == {"Unit": unit}
    validate(StructuredOutputs("json", json.dumps(schema)), "tools")  # compiles
    with pytest.raises(ValueError, match=r"^tools: two tools define \$defs 'Unit' differently"):
        forced_schema([tool("a", {"Unit": unit}), tool("b", {"Unit": {"type": "integer"}})], "required")


def test_a_constraint_that_allows_none_of_allowed_token_ids_is_an_error(llm):
    """guided regex "b+" with allowed_token_ids holding only "a": the step's grammar mask leaves
    none of the listed tokens, so the request ends in an error naming allowed_token_ids (the
    sampler's row is all -inf; an adversarial pass saw token 0 taken and then the constraint's
    own, fieldless error)."""
    import transformers
    a = transformers.AutoTokenizer.from_pretrained(str(TINY_MODEL)).encode("a", add_special_tokens=False)
    out = llm.generate(["Hello"], constrained("regex", "b+", allowed_token_ids=a[:1]))[0].outputs[0]
    assert out.finish_reason == "error" and out.token_ids == []  # the dead row's sample is not output
    assert str(out.stop_reason).startswith("allowed_token_ids: the structured-output constraint allows none")


def test_a_constraint_and_bad_words_that_together_allow_none_is_an_error(llm):
    """guided regex "a+" with allowed_token_ids ["a", "b"] and the bad word ["a", "a"]: after one
    "a" the constraint allows only "a" of the list, which the bad word bans, and neither mask alone
    empties the row. The request ends in an error naming allowed_token_ids after that token (the
    token sampled from the dead row, off the list, is not output)."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(str(TINY_MODEL))
    a, b = (tok.encode(c, add_special_tokens=False)[0] for c in "ab")
    out = llm.generate(["Hello"], constrained("regex", "a+", allowed_token_ids=[a, b],
                                              bad_words_token_ids=[[a, a]]))[0].outputs[0]
    assert out.token_ids == [a] and out.finish_reason == "error", (out.token_ids, out.finish_reason)
    assert str(out.stop_reason).startswith("allowed_token_ids: the structured-output constraint allows none of "
                                           "the listed tokens not banned (bad_words, min_tokens) after 1")
