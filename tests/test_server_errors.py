"""HTTP-layer faults with a fake engine: API key, engine faults (500, in-band stream errors), 503."""

from __future__ import annotations

import argparse
import json
import time

import httpx
import openai
import pytest
import transformers

from server.api_server import build_app
from tests.server_fixtures import TINY_MODEL, FakeEngine, InProcessServer

BOOM = "please crash"
BAD = "bad value"


class FaultyEngine(FakeEngine):
    """Fails with a non-ValueError for prompts containing BOOM, before or after its first output
    ("later"), and with a ValueError after its first output for prompts containing BAD."""

    async def generate(self, prompt, params, request_id):
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
        if BOOM in text and "later" not in text:
            raise RuntimeError("simulated fault: /secret/path")
        async for out in super().generate(prompt, params, request_id):
            yield out
            if BOOM in text:
                raise RuntimeError("simulated fault mid-stream: /secret/path")
            if BAD in text:
                raise ValueError("max_tokens: simulated bad value")


def eventually(cond, timeout: float = 5.0) -> bool:
    """Aborts finish on the server's loop just after the response went out: poll briefly."""
    deadline = time.time() + timeout
    while not cond() and time.time() < deadline:
        time.sleep(0.01)
    return cond()


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(TINY_MODEL)


@pytest.fixture(scope="module")
def faulty(tok):
    engine = FaultyEngine(tok, max_model_len=64)
    with InProcessServer(build_app(engine)) as s:
        s.engine = engine
        yield s


def test_api_key_required_on_v1_routes(tok):
    args = argparse.Namespace(api_key="sekret")
    with InProcessServer(build_app(FakeEngine(tok), args)) as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "hi"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.get(f"{s.url}/v1/models")
        assert r.status_code == 401
        ok = openai.OpenAI(base_url=f"{s.url}/v1", api_key="sekret", max_retries=0)
        assert ok.completions.create(model="fake-model", prompt="hi", max_tokens=2).choices
        bad = openai.OpenAI(base_url=f"{s.url}/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="fake-model", prompt="hi", max_tokens=2)
        # health, metrics and the tokenizer routes stay open (lm_eval probes them without a key)
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert httpx.get(f"{s.url}/tokenizer_info").status_code == 200
        assert httpx.post(f"{s.url}/tokenize", json={"prompt": "a"}).status_code == 200


def test_engine_fault_is_a_500_without_internals(faulty):
    r = httpx.post(f"{faulty.url}/v1/completions", json={"prompt": BOOM, "max_tokens": 2})
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "internal_server_error" and "/secret/path" not in r.text
    assert "Traceback" not in r.text
    ok = httpx.post(f"{faulty.url}/v1/completions", json={"prompt": "fine", "max_tokens": 2})
    assert ok.status_code == 200
    assert eventually(lambda: faulty.engine.blocks == {})


def test_fault_in_one_prompt_of_a_batch_aborts_the_others(faulty):
    faulty.engine.step_delay = 0.01
    body = {"prompt": ["a long one", f"{BOOM} later"], "max_tokens": 40, "ignore_eos": True}
    r = httpx.post(f"{faulty.url}/v1/completions", json=body)
    faulty.engine.step_delay = 0.0
    assert r.status_code == 500
    assert eventually(lambda: faulty.engine.blocks == {})


def test_fault_mid_stream_is_reported_in_band(faulty):
    body = {"prompt": f"{BOOM} later", "max_tokens": 8, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{faulty.url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "internal_server_error" and "/secret/path" not in err["message"]
    assert httpx.get(f"{faulty.url}/health").status_code == 200


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
@pytest.mark.parametrize("words,status", [(f"{BOOM} later", 500), (BAD, 400)])
def test_mid_stream_errors_map_the_same_for_completions_and_chat(faulty, endpoint, words, status):
    """Once a stream's headers are out, a ValueError is an in-band 400 carrying its message and
    anything else an in-band 500 without internals, then [DONE], on both endpoints."""
    body = {"max_tokens": 8, "stream": True, "ignore_eos": True}
    if endpoint == "completions":
        body["prompt"] = words
    else:
        body["messages"] = [{"role": "user", "content": words}]
    with httpx.stream("POST", f"{faulty.url}/v1/{endpoint}", json=body) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == ("invalid_request_error" if status == 400 else "internal_server_error"), err
    if status == 400:
        assert err["message"] == "max_tokens: simulated bad value"
    else:
        assert "/secret/path" not in err["message"]
    assert eventually(lambda: faulty.engine.blocks == {})


def test_health_is_503_when_the_engine_died(faulty):
    faulty.engine.errored = True
    try:
        r = httpx.get(f"{faulty.url}/health")
        assert r.status_code == 503 and r.json()["error"]["message"]
        r = httpx.post(f"{faulty.url}/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    finally:
        faulty.engine.errored = False
