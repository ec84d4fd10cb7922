"""cache_salt (vLLM's field): prefix-cache hits only between requests with the same salt, through
the offline engine and the HTTP routes; the outputs are those of an unsalted request."""

from __future__ import annotations

import httpx

from engine import LLM, SamplingParams
from tests.server_fixtures import TINY_MODEL, assert_error, tiny_engine_server

PROMPT = list(range(2, 42))  # 40 tokens: 9 full blocks of 4 cacheable (the last token never is)


def test_offline_requests_hit_only_their_own_salt():
    llm = LLM(model=str(TINY_MODEL), device="cpu", dtype="float32", block_size=4, num_kv_blocks=128)

    def run(salt: str | None):
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, cache_salt=salt)
        return llm.generate([PROMPT], params)[0]
    outs = [run(salt) for salt in ("tenant-1", "tenant-2", "tenant-1", None, None, "tenant-2")]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 36, 0, 36, 36]
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1


def _hits(s) -> float:
    text = httpx.get(f"{s.url}/metrics", timeout=30).text
    lines = [ln for ln in text.splitlines() if ln.startswith("mla_serve_prefix_cache_hits_total")]
    assert len(lines) == 1, lines
    return float(lines[0].split()[-1])


def test_http_requests_hit_only_their_own_salt():
    with tiny_engine_server() as s:
        def post(route: str, salt: str | None) -> dict:
            body = {"model": s.model, "max_tokens": 2, "temperature": 0,
                    **({"cache_salt": salt} if salt is not None else {})}
            body.update({"prompt": PROMPT} if route == "/v1/completions"
                        else {"messages": [{"role": "user", "content": "word " * 60}]})
            r = httpx.post(f"{s.url}{route}", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()
        for route in ("/v1/completions", "/v1/chat/completions"):
            before = _hits(s)
            first = post(route, "a" * 43)
            assert _hits(s) == before
            post(route, "b" * 43)  # another tenant: no hit
            assert _hits(s) == before
            again = post(route, "a" * 43)  # the same tenant: hits
            assert _hits(s) > before and again["choices"][0] == first["choices"][0]
        for bad in ("", "x" * 1025, 5):
            body = {"model": s.model, "prompt": "hi", "max_tokens": 1, "cache_salt": bad}
            assert_error(httpx.post(f"{s.url}/v1/completions", json=body, timeout=30), 400, "cache_salt")
