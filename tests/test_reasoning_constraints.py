"""An output constraint with reasoning (--reasoning-parser): as vLLM, the model reasons freely and
the constraint holds from the token after `</think>` (StructuredOutputs.start_after), so the
constrained text is the message's content; where `</think>` is not one token the constraint holds
from the first token and the whole output is content."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import transformers

from common.sampling_params import SamplingParams, StructuredOutputs
from engine import LLM
from server.api_server import build_app
from server.cli import build_parser
from tests.server_fixtures import TINY_MODEL, ScriptedEngine

PROMPT = "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:"
JSON = '{"answer": 8}'
FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
    "type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}}}


def chat(engine, body: dict, *flags: str) -> dict:
    async def go():
        app = build_app(engine, build_parser().parse_args(["--model", str(TINY_MODEL), *flags]))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/v1/chat/completions", json=body)
    r = asyncio.run(go())
    assert r.status_code == 200, r.text
    return r.json()


def tokenizer(with_end: bool):
    tok = transformers.AutoTokenizer.from_pretrained(TINY_MODEL)
    if with_end:  # `</think>` as one token, as DeepSeek's R1 and V3.1 tokenizers have it
        tok.add_tokens(["</think>"])  # not special: its text stays in the output, as there
    return tok


@pytest.mark.parametrize("field", [{"response_format": FORMAT}, {"response_format": {"type": "json_object"}},
                                   {"structured_outputs": {"json": FORMAT["json_schema"]["schema"]}},
                                   {"guided_choice": [JSON]}])
def test_the_constraint_starts_after_the_reasoning(field):
    tok = tokenizer(with_end=True)
    end = tok.convert_tokens_to_ids("</think>")
    script = tok.encode("Tom had 3, then 5 more.", add_special_tokens=False) + [end] + \
        tok.encode(JSON, add_special_tokens=False)
    engine = ScriptedEngine(tok, script)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": len(script), "temperature": 0, **field}
    msg = chat(engine, body, "--reasoning-parser", "deepseek_r1")["choices"][0]["message"]
    assert engine.last_params.structured_outputs.start_after == end
    assert msg["content"] == JSON and msg["reasoning_content"] == "Tom had 3, then 5 more."
    # without the parser, or with a forced tool choice, the constraint holds from the first token
    chat(engine, body)
    assert engine.last_params.structured_outputs.start_after is None
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    forced = {k: v for k, v in body.items() if k not in field}
    chat(engine, {**forced, "tools": [tool], "tool_choice": "required"}, "--reasoning-parser", "deepseek_r1")
    assert engine.last_params.structured_outputs.start_after is None


def test_without_one_end_token_the_constrained_output_is_content():
    tok = tokenizer(with_end=False)
    script = tok.encode(JSON, add_special_tokens=False)
    engine = ScriptedEngine(tok, script)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": len(script), "temperature": 0,
            "response_format": FORMAT}
    msg = chat(engine, body, "--reasoning-parser", "deepseek_r1")["choices"][0]["message"]
    assert engine.last_params.structured_outputs.start_after is None
    assert msg["content"] == JSON and msg["reasoning_content"] is None
    # unconstrained, the same output is reasoning (deepseek_r1: all text before `</think>`)
    del body["response_format"]
    msg = chat(engine, body, "--reasoning-parser", "deepseek_r1")["choices"][0]["message"]
    assert msg["content"] is None and msg["reasoning_content"] == JSON


@pytest.fixture(scope="module")
def llm():
    return LLM(str(TINY_MODEL), device="cpu", dtype="float32", num_kv_blocks=256)


def test_the_engine_constrains_only_after_its_start_token(llm):
    """The tiny model's greedy output, then the same prompt with a choice constraint starting after
    that output's third token: the first three tokens are the free output's, the rest a choice;
    with a start token the output never samples, the output is the free one."""
    free = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    ids = list(free.token_ids)
    start = ids[2]
    k = ids.index(start) + 1  # the gate opens at the first sampling of `start`
    choices = ["yes", "no", "eight apples"]

    def gated(start_after: int, max_tokens: int = 40):
        so = StructuredOutputs("choice", json.dumps(choices), start_after=start_after)
        return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                     structured_outputs=so))[0].outputs[0]
    out = gated(start)
    assert list(out.token_ids[:k]) == ids[:k]
    assert llm.tokenizer.decode(out.token_ids[k:]) in choices and out.finish_reason == "stop"
    never = next(t for t in range(llm.tokenizer.vocab_size) if t not in ids)
    out = gated(never, max_tokens=12)
    assert list(out.token_ids) == ids and out.finish_reason == "length"
    with pytest.raises(ValueError, match="start_after"):
        StructuredOutputs("choice", "[]", start_after=-1)
