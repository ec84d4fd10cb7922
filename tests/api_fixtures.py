"""The `server` and `client` fixtures of the HTTP contract tests (test_server_api.py,
test_server_load.py): each test runs against a fake engine in-process (`fake`, milliseconds) and
against the real `serve` subprocess on the tiny model (`real`, marked slow).

A module imports the fixtures by name and lists them in `FIXTURES`, which keeps the import used."""

from __future__ import annotations

import openai
import pytest
import transformers

from server.api_server import build_app
from tests.server_fixtures import TINY_MODEL, FakeEngine, InProcessServer, ServeProcess, tiny_model_dir

MAX_MODEL_LEN = 512
PROMPTS = ["Question: Mia has 7 apples. Leo has 3 pens.", "Answer: 7 + 3 =", "Emma has", "Hi"]


@pytest.fixture(scope="module", params=["fake", pytest.param("real", marks=pytest.mark.slow)])
def server(request, tmp_path_factory):
    if request.param == "fake":
        tok = transformers.AutoTokenizer.from_pretrained(TINY_MODEL)
        engine = FakeEngine(tok, max_model_len=MAX_MODEL_LEN, step_delay=0.005)
        with InProcessServer(build_app(engine)) as s:
            s.model = engine.model_name
            yield s
    else:
        with ServeProcess("--model", tiny_model_dir(tmp_path_factory), "--served-model-name",
                          "tiny", "--device", "cpu", "--dtype", "float32",
                          "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "512",
                          "--block-size", "16") as s:
            s.model = "tiny"
            yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def greedy(client, server, prompt, **kw):
    """A greedy completion (8 tokens unless `max_tokens` says otherwise)."""
    kw = {"max_tokens": 8, "temperature": 0.0, **kw}
    return client.completions.create(model=server.model, prompt=prompt, **kw)
