"""HTTP contract of the server with the `openai` client and raw HTTP.

Every test runs twice: against a fake engine in-process (fast, `fake`) and against the real
`serve` subprocess on the tiny model (`real`, marked slow). Expected values come from the server
itself (a greedy run, a non-streamed run), never from constants. Disconnects, load and metrics:
test_server_load.py.
"""

from __future__ import annotations

import os

import httpx
import pytest
import transformers

from tests.api_fixtures import MAX_MODEL_LEN, PROMPTS, client, greedy, server
from tests.server_fixtures import OFFLINE_ENV, TINY_MODEL

os.environ.update(OFFLINE_ENV)
FIXTURES = (server, client)  # pytest finds them here (tests/api_fixtures.py)


def test_models_health_tokenizer_routes(server):
    models = httpx.get(f"{server.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [server.model]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert models["data"][0]["parent"] is None and models["data"][0]["permission"][0]["allow_sampling"]
    # OpenAI's retrieve: the served name's card; another name is a 404 naming `model`
    assert httpx.get(f"{server.url}/v1/models/{server.model}").json() == models["data"][0]
    r = httpx.get(f"{server.url}/v1/models/no/such-model")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    vocab = models["data"][0].get("vocab_size")
    if vocab is not None:  # the ids a prompt may hold: the first one past them is refused
        body = {"model": server.model, "max_tokens": 1}
        assert httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": [vocab - 1]}).status_code == 200
        r = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": [vocab]})
        assert r.status_code == 400 and f"{vocab} is outside" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    tok = transformers.AutoTokenizer.from_pretrained(TINY_MODEL)
    assert info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert ids["tokens"] == tok(PROMPTS[0])["input_ids"] and ids["count"] == len(ids["tokens"])
    no_bos = httpx.post(f"{server.url}/tokenize",
                        json={"prompt": PROMPTS[0], "add_special_tokens": False}).json()
    assert no_bos["tokens"] == ids["tokens"][1:]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": no_bos["tokens"]}).json()
    assert text["prompt"] == PROMPTS[0]


def test_lm_eval_detects_remote_tokenizer(server):
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    base = f"{server.url}/v1/completions"
    assert check_remote_tokenizer_support(base)
    rt = RemoteTokenizer(base)
    tok = transformers.AutoTokenizer.from_pretrained(TINY_MODEL)
    assert rt.encode(PROMPTS[1]) == tok(PROMPTS[1], add_special_tokens=False)["input_ids"]
    assert rt.eos_token_id == tok.eos_token_id and rt.bos_token_id == tok.bos_token_id
    assert rt.decode(rt.encode(PROMPTS[0])) == PROMPTS[0]


def test_completion_shape_and_usage(client, server):
    r = greedy(client, server, PROMPTS[0], max_tokens=5, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == server.model and r.id.startswith("cmpl-")
    (c,) = r.choices
    assert c.index == 0 and c.finish_reason == "length" and c.logprobs is None
    n_prompt = len(httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPTS[0]}).json()["tokens"])
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 5)
    assert r.usage.total_tokens == n_prompt + 5


def test_batch_index_order_matches_single_requests(client, server):
    singles = [greedy(client, server, p).choices[0].text for p in PROMPTS]
    batch = greedy(client, server, PROMPTS)
    assert [c.index for c in batch.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in batch.choices] == singles
    tok = transformers.AutoTokenizer.from_pretrained(TINY_MODEL)
    ids = [tok(p)["input_ids"] for p in PROMPTS[:2]]
    by_ids = greedy(client, server, ids, n=2)  # token-id prompts; n choices per prompt
    assert [c.index for c in by_ids.choices] == [0, 1, 2, 3]
    assert [c.text for c in by_ids.choices] == [singles[0]] * 2 + [singles[1]] * 2
    one_id_prompt = greedy(client, server, ids[1])
    assert one_id_prompt.choices[0].text == singles[1]


@pytest.mark.parametrize("echo", [False, True])
def test_stream_equals_non_stream(client, server, echo):
    kw = dict(max_tokens=12, logprobs=1, echo=echo, n=2, temperature=0.8, seed=5)
    full = greedy(client, server, PROMPTS[:3], **kw)
    texts, finish, tokens, offsets, values = {}, {}, {}, {}, {}
    chunks = list(greedy(client, server, PROMPTS[:3], stream=True,
                         stream_options={"include_usage": True}, **kw))
    for ch in chunks[:-1]:
        (c,) = ch.choices
        texts[c.index] = texts.get(c.index, "") + c.text
        tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
        offsets.setdefault(c.index, []).extend(c.logprobs.text_offset)
        values.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
        if c.finish_reason:
            finish[c.index] = c.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert len(full.choices) == 6
    for c in full.choices:
        assert texts[c.index] == c.text and finish[c.index] == c.finish_reason
        assert tokens[c.index] == c.logprobs.tokens
        assert offsets[c.index] == c.logprobs.text_offset
        # the streamed request meets the first one's prompts in the prefix cache (context attention
        # instead of a whole prefill) and other batch neighbours: fp32 sums in another order, which
        # moved a log-probability by 1.08e-5 in one run (tokens and text above are exact)
        assert values[c.index] == pytest.approx(c.logprobs.token_logprobs, abs=1e-4)


def test_echo_logprobs_as_lm_eval_sends_them(client, server):
    tok = transformers.AutoTokenizer.from_pretrained(TINY_MODEL)
    # several KV blocks long: the second request takes its first blocks' KV and prompt logprobs
    # from the cache (scheduler/logprob_records.py)
    ctx = tok(" ".join(PROMPTS) * 2 + " Question: Mia has", add_special_tokens=False)["input_ids"]
    cont = tok(" 7 apples", add_special_tokens=False)["input_ids"]
    assert len(ctx) > 3 * 16
    # lm_eval's loglikelihood payload: token prompt, echo, logprobs=1, max_tokens=1, greedy
    r = client.completions.create(model=server.model, prompt=[ctx + cont], echo=True, logprobs=1,
                                  max_tokens=1, temperature=0, seed=1234)
    lp = r.choices[0].logprobs
    n = len(ctx) + len(cont) + 1  # every prompt token, then the sampled one
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.tokens[:-1] == [tok.decode([t]) for t in ctx + cont]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for v, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert 1 <= len(top) <= 2 and max(top.values()) >= v
    # the sampled (greedy) token is the argmax: lm_eval's is_greedy test on the last position
    assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())
    assert r.choices[0].text.startswith(tok.decode(ctx + cont))
    # Same prompt logprobs without the sampled token when max_tokens=0 (up to the rounding of a
    # prefill split at the cache hit: its tail attends to the cached blocks)
    r0 = client.completions.create(model=server.model, prompt=[ctx + cont], echo=True,
                                   logprobs=1, max_tokens=0, temperature=0)
    lp0 = r0.choices[0].logprobs
    assert lp0.tokens == lp.tokens[:-1] and lp0.token_logprobs[0] is None
    assert lp0.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:-1], abs=1e-4)
    assert r0.usage.completion_tokens == 0 and r0.choices[0].text == tok.decode(ctx + cont)


def test_prompt_logprobs_as_vllm_returns_them(client, server):
    tok = transformers.AutoTokenizer.from_pretrained(TINY_MODEL)
    ids = tok(PROMPTS[0])["input_ids"]
    kw = dict(max_tokens=3, n=2, temperature=0, echo=True, logprobs=1,
              extra_body={"prompt_logprobs": 3})
    r = greedy(client, server, PROMPTS[0], **kw).model_dump()
    for c in r["choices"]:
        plp = c["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        for t, row in zip(ids[1:], plp[1:]):
            assert str(t) in row and row[str(t)]["decoded_token"] == tok.decode([t])
            assert 3 <= len(row) <= 4 and all(v["logprob"] <= 0 for v in row.values())
            assert sorted(v["rank"] for v in row.values())[:3] == [1, 2, 3]
        # echo's logprobs keep their own k (1): the engine computed 3, the response trims
        assert all(len(top) <= 2 for top in c["logprobs"]["top_logprobs"][1:])
        assert c["logprobs"]["token_logprobs"][1:len(ids)] == pytest.approx(
            [row[str(t)]["logprob"] for t, row in zip(ids[1:], plp[1:])], abs=1e-5)
    chunks = list(greedy(client, server, PROMPTS[0], stream=True, **kw))
    first = {}
    for ch in chunks:
        d = ch.model_dump()["choices"][0]
        if d.get("prompt_logprobs") is not None:
            assert d["index"] not in first, "prompt_logprobs sent twice"
            first[d["index"]] = d["prompt_logprobs"]
    assert first == {c["index"]: c["prompt_logprobs"] for c in r["choices"]}
    plain = greedy(client, server, PROMPTS[0], max_tokens=2).model_dump()["choices"][0]
    assert plain.get("prompt_logprobs") is None


def test_chat_prompt_logprobs_are_those_of_the_rendered_prompt(client, server):
    """Chat's prompt_logprobs (vLLM's, on the response) cover the rendered conversation's tokens
    and equal what completions returns for the same token ids."""
    r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi there"}],
                                       max_tokens=2, temperature=0,
                                       extra_body={"prompt_logprobs": 2, "return_token_ids": True}).model_dump()
    ids, plp = r["prompt_token_ids"], r["prompt_logprobs"]
    assert len(plp) == len(ids) > 2 and plp[0] is None
    assert all(str(t) in row and 2 <= len(row) <= 3 for t, row in zip(ids[1:], plp[1:]))
    ref = greedy(client, server, ids, max_tokens=1, extra_body={"prompt_logprobs": 2}).model_dump()
    want = ref["choices"][0]["prompt_logprobs"]
    assert [sorted(row) if row else row for row in plp] == [sorted(row) if row else row for row in want]
    for got, exp in zip(plp[1:], want[1:]):
        for t in exp:
            assert got[t]["logprob"] == pytest.approx(exp[t]["logprob"], abs=1e-4)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_continuous_usage_stats_in_every_chunk(client, server, route):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    if route == "chat":
        chunks = list(client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
            temperature=0, n=2, stream=True, stream_options=opts,
            extra_body={"ignore_eos": True}))
    else:
        chunks = list(greedy(client, server, PROMPTS[:2], max_tokens=5, stream=True,
                             stream_options=opts, extra_body={"ignore_eos": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 10
    seen: dict[int, int] = {}
    for ch in body:
        u = ch.usage
        assert u is not None and u.total_tokens == u.prompt_tokens + u.completion_tokens
        (c,) = ch.choices
        assert u.completion_tokens >= seen.get(c.index, 0)  # the choice's own count, growing
        # chat's role chunk goes before the choice's first token (vLLM's 0); the rest carry tokens
        role = route == "chat" and c.delta.role is not None
        assert (u.completion_tokens == 0) if role else (u.completion_tokens > seen.get(c.index, 0))
        seen[c.index] = u.completion_tokens
    assert seen == {0: 5, 1: 5}
    # without continuous_usage_stats only the last chunk has usage
    plain = list(greedy(client, server, PROMPTS[0], max_tokens=3, stream=True,
                        stream_options={"include_usage": True}))
    assert all(ch.usage is None for ch in plain[:-1]) and plain[-1].usage is not None


def test_logit_bias_reaches_the_engine(client, server):
    if server.model != "tiny":
        pytest.skip("the fake engine does not sample from logits")
    base = greedy(client, server, PROMPTS[0], max_tokens=4, logprobs=0,
                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    ids = [int(t.removeprefix("token_id:")) for t in base.choices[0].logprobs.tokens]
    forced = next(t for t in range(10, 400) if t not in ids)
    for temperature in (0.0, 1.0):  # greedy and sampled rows, completions and chat
        r = greedy(client, server, PROMPTS[0], max_tokens=4, logprobs=0, temperature=temperature,
                   logit_bias={str(forced): 100},
                   extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        assert r.choices[0].logprobs.tokens == [f"token_id:{forced}"] * 4
    c = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=3, temperature=0, logit_bias={str(forced): 100},
                                       logprobs=True, extra_body={"ignore_eos": True,
                                                                  "return_tokens_as_token_ids": True})
    assert [e.token for e in c.choices[0].logprobs.content] == [f"token_id:{forced}"] * 3
    banned = greedy(client, server, PROMPTS[0], max_tokens=4, logprobs=0,
                    logit_bias={str(ids[0]): -100},
                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert banned.choices[0].logprobs.tokens[0] != f"token_id:{ids[0]}"


def test_sampling_fields(client, server):
    base = greedy(client, server, PROMPTS[0], max_tokens=10).choices[0].text
    # top_k=1, tiny top_p and min_p=1 all reduce sampling to greedy, whatever the temperature
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        r = greedy(client, server, PROMPTS[0], max_tokens=10, temperature=1.0, extra_body=extra)
        assert r.choices[0].text == base, extra
    r = greedy(client, server, PROMPTS[0], max_tokens=10, temperature=1.0, top_p=1e-6)
    assert r.choices[0].text == base
    # seeded sampling is reproducible across requests, and the seed matters
    kw = dict(max_tokens=16, temperature=1.0, n=2, extra_body={"ignore_eos": True})
    a = greedy(client, server, PROMPTS[0], seed=123, **kw)
    b = greedy(client, server, PROMPTS[0], seed=123, **kw)
    c = greedy(client, server, PROMPTS[0], seed=124, **kw)
    assert [x.text for x in a.choices] == [x.text for x in b.choices]
    assert [x.text for x in a.choices] != [x.text for x in c.choices]
    # penalties, user, repetition_penalty: accepted and well-formed
    r = greedy(client, server, PROMPTS[0], presence_penalty=1.5, frequency_penalty=-0.5,
               user="tester", extra_body={"repetition_penalty": 1.3, "min_tokens": 2})
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 2
    # logprobs=k lists k alternatives + the chosen token (fewer when two decode to one string,
    # e.g. partial UTF-8 bytes: the format is keyed by text)
    r = greedy(client, server, PROMPTS[0], max_tokens=4, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and all(1 <= len(t) <= 4 for t in lp.top_logprobs)
    assert all(t in top for t, top in zip(lp.tokens, lp.top_logprobs))
    assert max(len(top) for top in lp.top_logprobs) >= 3


def test_stop_strings_and_stop_token_ids(client, server):
    kw = dict(max_tokens=24, extra_body={"ignore_eos": True})
    text = greedy(client, server, PROMPTS[2], **kw).choices[0].text
    assert len(text) >= 6, "need some text to cut"
    stop = text[3:6]
    cut = text[: text.index(stop)]
    for stream in (False, True):
        r = greedy(client, server, PROMPTS[2], stop=[stop, "\x00never"], stream=stream, **kw)
        if stream:
            parts = list(r)
            got = "".join(p.choices[0].text for p in parts)
            reason = parts[-1].choices[0].finish_reason
        else:
            got, reason = r.choices[0].text, r.choices[0].finish_reason
        assert (got, reason) == (cut, "stop")
    lp = greedy(client, server, PROMPTS[2], max_tokens=3, logprobs=0,
                extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    ids = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    r = greedy(client, server, PROMPTS[2], logprobs=0, extra_body={"stop_token_ids": ids[1:2]})
    # generation ends at the first occurrence of the stop token; its text is left out
    end = ids.index(ids[1]) + 1
    assert r.choices[0].finish_reason == "stop" and len(r.choices[0].logprobs.tokens) == end


def test_chat_stream_and_non_stream(client, server):
    msgs = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Mia has 7 apples. How many apples has Mia?"}]
    r = client.chat.completions.create(model=server.model, messages=msgs, max_tokens=10,
                                       temperature=0, logprobs=True, top_logprobs=2)
    (c,) = r.choices
    assert r.object == "chat.completion" and c.message.role == "assistant"
    assert c.finish_reason in ("stop", "length") and len(c.logprobs.content) == r.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 for e in c.logprobs.content)
    tok = transformers.AutoTokenizer.from_pretrained(TINY_MODEL)
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(tok(prompt, add_special_tokens=False)["input_ids"])
    chunks = list(client.chat.completions.create(
        model=server.model, messages=msgs, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks[:-1]) == c.message.content
    assert chunks[-2].choices[0].finish_reason == c.finish_reason
    assert chunks[-1].usage == r.usage


MALFORMED = [
    ("post", "/v1/completions", b"{not json", 400, None),
    ("post", "/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("post", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("post", "/v1/completions", {"prompt": {"a": 1}}, 400, "prompt"),
    ("post", "/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("post", "/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("post", "/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("post", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("post", "/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("post", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("post", "/v1/completions", {"prompt": "x", "temperature": True}, 400, "temperature"),
    ("post", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": False},
     400, "top_p"),
    ("post", "/v1/completions", {"prompt": "x", "top_k": -5}, 400, "top_k"),
    ("post", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("post", "/v1/completions", {"prompt": "x", "logprobs": 99}, 400, "logprobs"),
    ("post", "/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("post", "/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("post", "/v1/completions", {"prompt": "x", "seed": "abc"}, 400, "seed"),
    ("post", "/v1/completions", {"prompt": "x", "stream": "maybe"}, 400, "stream"),
    ("post", "/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop"),
    ("post", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, None),
    ("post", "/v1/completions", {"prompt": [[10 ** 9]]}, 400, None),
    ("post", "/v1/completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, None),
    ("post", "/v1/completions", {"prompt": "x", "model": "no-such-model"}, 404, "model"),
    ("post", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("post", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages"),
    ("post", "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages"),
    ("post", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                      "top_logprobs": 2}, 400, None),
    ("post", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("post", "/tokenize", {}, 400, None),
    ("get", "/v1/no-such-route", None, 404, None),
    ("get", "/v1/completions", None, 405, None),
]


@pytest.mark.parametrize("method,path,body,status,param", MALFORMED,
                         ids=[f"{i}-{m[1]}" for i, m in enumerate(MALFORMED)])
def test_malformed_requests_get_4xx_and_server_keeps_serving(server, client, method, path, body,
                                                             status, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
    r = httpx.request(method.upper(), f"{server.url}{path}", timeout=30,
                      headers={"content-type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text
    if param is not None:
        assert err["param"].startswith(param) and param in err["message"], err
    assert greedy(client, server, "ok", max_tokens=2).choices[0].finish_reason
