"""Beam search (vLLM's use_beam_search, server/beam_search.py): the beams equal a reference search
over transformers' log-probabilities, width 1 is greedy decoding, and what beam search cannot
honour is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.server_fixtures import assert_error, tiny_engine_server


@torch.no_grad()
def reference_beams(hf, prompt: list[int], width: int, steps: int, penalty: float, eos: int) -> list[list[int]]:
    """The same search over transformers' fp32 log-probabilities, in float64."""
    def score(tokens, logprob, ended):
        return logprob / (len(prompt) + len(tokens) - ended) ** penalty
    live, done = [([], 0.0)], []
    for _ in range(steps):
        candidates = []
        for tokens, logprob in live:
            logits = hf(torch.tensor([prompt + tokens])).logits[0, -1].double()
            top = torch.log_softmax(logits, -1).topk(2 * width)
            for lp, tid in zip(top.values.tolist(), top.indices.tolist()):
                (done if tid == eos else candidates).append((tokens + [tid], logprob + lp))
        candidates.sort(key=lambda b: score(b[0], b[1], 0), reverse=True)
        live = candidates[:width]
    ranked = sorted([(t, lp, 1) for t, lp in done] + [(t, lp, 0) for t, lp in live],
                    key=lambda b: score(*b), reverse=True)
    return [t for t, _, _ in ranked[:width]]


@pytest.fixture(scope="module")
def v3_server(tiny_v3):
    with tiny_engine_server(max_model_len=128, model=tiny_v3[0]) as s:
        yield s, tiny_v3[1]


def _beams(server, prompt, **kw) -> list[dict]:
    body = {"model": server.model, "prompt": prompt, "use_beam_search": True, "return_token_ids": True, **kw}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"]


@pytest.mark.parametrize("width,penalty", [(3, 1.0), (2, 0.5), (4, 2.0)])
def test_beams_equal_a_reference_search(v3_server, width, penalty):
    server, hf = v3_server
    prompts = [[5, 17, 42, 8], [100, 3, 250]]
    choices = _beams(server, prompts, n=width, max_tokens=5, length_penalty=penalty)
    assert [c["index"] for c in choices] == list(range(2 * width))
    for i, prompt in enumerate(prompts):
        got = [c["token_ids"] for c in choices[i * width:(i + 1) * width]]
        assert got == reference_beams(hf, prompt, width, 5, penalty, eos=1), (i, width, penalty)
        for c in choices[i * width:(i + 1) * width]:
            assert c["finish_reason"] == ("stop" if c["token_ids"][-1] == 1 else "length")


def test_width_one_is_greedy(v3_server):
    server, _ = v3_server
    prompt = [9, 8, 7, 6]
    beam = _beams(server, prompt, n=1, max_tokens=6, ignore_eos=True)
    body = {"model": server.model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    greedy = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()["choices"]
    assert [c["token_ids"] for c in beam] == [greedy[0]["token_ids"]]


def test_chat_and_refusals():
    with tiny_engine_server() as s:
        chat = {"model": s.model, "messages": [{"role": "user", "content": "Mia has 3 cats."}],
                "use_beam_search": True, "n": 2, "max_tokens": 4, "return_token_ids": True}
        r = httpx.post(f"{s.url}/v1/chat/completions", json=chat, timeout=120)
        choices = r.json()["choices"]
        assert r.status_code == 200 and len(choices) == 2 and choices[0]["token_ids"] != choices[1]["token_ids"]
        assert r.json()["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
        cmpl = {"model": s.model, "prompt": "Mia", "use_beam_search": True, "max_tokens": 3}
        for extra, field in (({"stream": True}, "stream"), ({"stop": ["x"]}, "stop"), ({"logprobs": 0}, "logprobs"),
                             ({"n": 11}, "n"), ({"echo": True}, "echo"), ({"top_p": 0.5}, "top_p"),
                             ({"guided_choice": ["a", "b"]}, "guided_choice")):
            r = httpx.post(f"{s.url}/v1/completions", json={**cmpl, **extra}, timeout=60)
            assert_error(r, 400, field)
        r = httpx.post(f"{s.url}/v1/completions", json={**cmpl, "use_beam_search": False, "length_penalty": 0.5})
        assert "use_beam_search" in assert_error(r, 400, "length_penalty")["message"]


@pytest.mark.parametrize("penalty,best", [(0.0, [1]), (1.0, [2, 2, 2]), (2.0, [2, 2, 2])])
def test_length_penalty_ranks_finished_against_live_beams(monkeypatch, penalty, best):
    """A scripted model where EOS comes first at once: a finished one-token beam (logprob -0.5,
    length 2 with the ending EOS not counted) against a live three-token one (-1.2, length 5).
    Without the penalty the short one wins; with it the long one."""
    import asyncio
    from types import SimpleNamespace

    import server.beam_search as bs
    from common.sampling_params import SamplingParams
    from engine.outputs import CompletionOutput, RequestOutput
    from scheduler.outputs import TokenLogprobs

    def top(generated: list[int]) -> list[tuple[int, float]]:
        return [(1, -0.5), (2, -1.0)] if not generated else [(2, -0.1), (1, -3.0)]

    async def one_token(state, prompts, params, request_id):
        assert params.max_tokens == 1 and params.logprobs == 2
        return [RequestOutput(request_id, None, p, [CompletionOutput(
            0, logprobs=[TokenLogprobs(top(p[2:])[0][0], top(p[2:])[0][1], 1, top(p[2:]))])], finished=True)
            for p in prompts]
    monkeypatch.setattr(bs, "_one_token", one_token)
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: f"{ids} skip={skip_special_tokens}")
    state = SimpleNamespace(max_model_len=64, tokenizer=tokenizer,
                            engine=SimpleNamespace(inputs=SimpleNamespace(eos_token_id=1)))
    out = asyncio.run(bs.beam_search(state, [7, 7], SamplingParams(max_tokens=3), 1, penalty, "r"))
    assert [o.token_ids for o in out.outputs] == [best]
    assert out.outputs[0].finish_reason == ("stop" if best == [1] else "length")
    # the text leaves out an ending EOS unless include_stop_str_in_output, as the route's options say
    shown = "[] skip=True" if best == [1] else f"{best} skip=True"
    assert out.outputs[0].text == shown
    if best == [1]:
        params = SamplingParams(max_tokens=3, include_stop_str_in_output=True, skip_special_tokens=False)
        out = asyncio.run(bs.beam_search(state, [7, 7], params, 1, penalty, "r"))
        assert out.outputs[0].text == "[1] skip=False"


def test_a_prompt_too_long_for_its_beams_is_a_400():
    with tiny_engine_server(max_model_len=64) as s:
        body = {"model": s.model, "prompt": list(range(5, 65)), "use_beam_search": True, "n": 2, "max_tokens": 8}
        assert_error(httpx.post(f"{s.url}/v1/completions", json=body, timeout=60), 400)
        body["max_tokens"] = 3  # 60 + 3 fits 64: the search stops at the context's end at most
        r = httpx.post(f"{s.url}/v1/completions", json={**body, "return_token_ids": True}, timeout=60)
        assert r.status_code == 200 and all(len(c["token_ids"]) <= 3 for c in r.json()["choices"]), r.text


def test_beams_stop_where_the_kv_cache_ends_and_any_penalty_scores():
    """A search and an ordinary request are bounded alike by the KV cache (here 128 tokens, before
    the context's 512): a max_tokens past it is a 400 for both, and up to it both run as far;
    extreme penalties rank without overflowing; fields that ask for nothing (a text
    response_format, parallel_tool_calls without tools) pass."""
    with tiny_engine_server(num_kv_blocks=8) as s:
        prompt = list(range(5, 125))  # 120 tokens: 9 more fit 128 + 1
        greedy = {"model": s.model, "prompt": prompt, "temperature": 0, "ignore_eos": True,
                  "return_token_ids": True}
        for body in (greedy, {**greedy, "use_beam_search": True, "n": 1}):
            r = httpx.post(f"{s.url}/v1/completions", json={**body, "max_tokens": 10}, timeout=120)
            assert r.status_code == 400 and "KV cache" in r.json()["error"]["message"], r.text
        plain = httpx.post(f"{s.url}/v1/completions", json={**greedy, "max_tokens": 9},
                           timeout=120).json()["choices"][0]
        assert len(plain["token_ids"]) == 9 and plain["finish_reason"] == "length"
        beams = _beams(s, prompt, n=1, max_tokens=9, ignore_eos=True)
        assert [c["token_ids"] for c in beams] == [plain["token_ids"]]
        for penalty in (300.0, -400.0, 1e300):
            assert len(_beams(s, prompt[:20], n=3, max_tokens=3, length_penalty=penalty)) == 3
        chat = {"model": s.model, "messages": [{"role": "user", "content": "hi"}], "use_beam_search": True,
                "n": 2, "max_tokens": 2, "response_format": {"type": "text"}, "parallel_tool_calls": False}
        r = httpx.post(f"{s.url}/v1/chat/completions", json=chat, timeout=120)
        assert r.status_code == 200, r.text
