"""The server stays live whatever one request does: tokenizing runs off the event loop (/health
answers meanwhile), a request whose sampling fails in the engine fails alone, /health reports a
stalled engine, overlong text is refused before tokenizing. On a fake engine and on the real
AsyncLLM with the tiny model (one per module), in-process, its HTTP app on a loopback port.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import threading
import time

import httpx
import pytest
import transformers

from common.args import EngineArgs
from common.sampling_params import SamplingParams
from server.api_server import build_app
from tests.server_fixtures import TINY_MODEL, FakeEngine, InProcessServer, assert_error, health_until, post


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(TINY_MODEL)


# ---- tokenizing never blocks the event loop ----

class SlowTokenizer:
    """A tokenizer whose encode holds its thread for `delay` s (as a 10 MB prompt does)."""

    def __init__(self, tok, delay: float) -> None:
        self._tok, self.delay = tok, delay

    def __call__(self, text, **kw):
        if len(text) > 50:
            time.sleep(self.delay)
        return self._tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)


# A tokenize call that holds its thread this long; /health must answer in under half of it.
# The margin is wide because the server shares the test's process: a full garbage collection
# there can take ~0.5 s on a busy 2-core machine, while a blocked event loop would show ~3 s.
TOKENIZE_S = 3.0


def _health_latency_during(url: str, request) -> float:
    """Worst /health latency while `request()` runs in another thread."""
    t = threading.Thread(target=request)
    t.start()
    time.sleep(0.2)
    worst = 0.0
    while t.is_alive():
        t0 = time.perf_counter()
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        worst = max(worst, time.perf_counter() - t0)
        time.sleep(0.05)
    t.join()
    return worst


def test_tokenize_route_does_not_block_health(tok):
    with InProcessServer(build_app(FakeEngine(SlowTokenizer(tok, TOKENIZE_S)))) as s:
        worst = _health_latency_during(s.url, lambda: post(s, "/tokenize", {"prompt": "x " * 40}))
        assert worst < TOKENIZE_S / 2, worst


# ---- the real engine: per-request failures, stall detection, off-loop tokenizing ----

@pytest.fixture(scope="module")
def real():
    from engine.async_llm import AsyncLLM

    # AsyncLLM binds to the loop of its first request: uvicorn's, in the server's thread
    engine = AsyncLLM(EngineArgs(model=str(TINY_MODEL), device="cpu", dtype="float32",
                                 num_kv_blocks=64, max_model_len=256))
    try:
        with InProcessServer(build_app(engine, argparse.Namespace(engine_stall_timeout=2.0))) as s:
            s.engine = engine
            yield s
    finally:
        engine.shutdown()


def _greedy(server, prompt, **kw) -> httpx.Response:
    return post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                            "ignore_eos": True, **kw})


def test_bad_sampling_state_fails_the_request_not_the_engine(real):
    ref = _greedy(real, "Mia has").json()["choices"][0]["text"]
    loop = real.engine._loop  # uvicorn's, bound by the request above

    async def submit(**bad):
        p = SamplingParams(max_tokens=4, temperature=1.0, n=2)
        for k, v in bad.items():
            setattr(p, k, v)  # past validation, as a value only torch refuses would be
        return [o async for o in real.engine.generate([5, 6, 7], p, f"bad-{time.time_ns()}")]

    for bad in ({"seed": 2**64}, {"seed": 2**64 - 1}, {"top_k": 2**63}):
        fut = asyncio.run_coroutine_threadsafe(submit(**bad), loop)
        with pytest.raises(ValueError, match=next(iter(bad))):
            fut.result(timeout=30)
        assert not real.engine.errored
        assert httpx.get(f"{real.url}/health").status_code == 200
        assert _greedy(real, "Mia has").json()["choices"][0]["text"] == ref
    deadline = time.monotonic() + 10  # the engine core reports its last step's counts a moment later
    while time.monotonic() < deadline and real.engine.stats().num_free_blocks != 64:
        time.sleep(0.01)
    assert real.engine.stats().num_free_blocks == 64


def test_near_zero_temperature_equals_greedy_on_the_engine(real):
    ref = _greedy(real, "Emma has").json()["choices"][0]["text"]
    assert _greedy(real, "Emma has", temperature=1e-38, seed=1).json()["choices"][0]["text"] == ref


def test_health_reports_a_stalled_engine(real):
    """The engine-core process stopped (SIGSTOP) while it holds a request: /health turns 503 with
    the reason within the stall timeout, and 200 again once the core runs on."""
    pid = real.engine.core._proc.pid
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("r", _greedy(real, "Hi", max_tokens=40)))
    os.kill(pid, signal.SIGSTOP)
    try:
        t.start()
        err = assert_error(health_until(real.url, 503, within=10), 503)
        assert "no progress" in err["message"] and "--engine-stall-timeout" in err["message"]
    finally:
        os.kill(pid, signal.SIGCONT)
        t.join(30)
    assert done["r"].status_code == 200
    assert httpx.get(f"{real.url}/health").status_code == 200


def test_completion_tokenizing_does_not_block_health(real):
    inputs = real.engine.inputs
    original = inputs.tokenizer
    inputs.tokenizer = SlowTokenizer(original, TOKENIZE_S)
    try:
        worst = _health_latency_during(real.url, lambda: _greedy(real, "Mia has 7 apples. " * 4))
    finally:
        inputs.tokenizer = original
    assert worst < TOKENIZE_S / 2, worst


def test_overlong_text_is_refused_before_tokenizing(real):
    t0 = time.perf_counter()
    err = assert_error(_greedy(real, "ab " * 2_000_000), 400, "prompt")
    assert "before tokenizing" in err["message"] and time.perf_counter() - t0 < 5
    msgs = [{"role": "user", "content": "ab " * 2_000_000}]
    err = assert_error(post(real, "/v1/chat/completions", {"messages": msgs}), 400, "messages")
    assert "before tokenizing" in err["message"]


def test_engine_core_refuses_what_would_fail_a_step():
    from engine.llm import LLM

    llm = LLM(str(TINY_MODEL), device="cpu", dtype="float32", num_kv_blocks=16, max_model_len=64)
    V = llm.engine.cfg.vocab_size
    cases = [([5], {"seed": 2**64}, "seed"), ([5], {"top_k": 2**63}, "top_k"),
             ([V], {}, "prompt"), ([5], {"stop_token_ids": [V], "min_tokens": 2}, "stop_token_ids")]
    for ids, bad, field in cases:
        p = SamplingParams(max_tokens=2, temperature=1.0)
        for k, v in bad.items():
            setattr(p, k, v)  # past SamplingParams' own checks
        with pytest.raises(ValueError, match=field):
            llm.engine.add_request("bad", ids, p)
        assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
