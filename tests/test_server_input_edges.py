"""Inputs at the edges, found by attacking the server (against the fake engine): each is a 400
naming what is wrong, or is bounded, rather than read loosely or left unbounded."""

from __future__ import annotations

import os

import httpx
import pytest
import transformers

from server.api_server import build_app
from tests.server_fixtures import OFFLINE_ENV, TINY_MODEL, FakeEngine, InProcessServer, assert_error, post

os.environ.update(OFFLINE_ENV)


class BoundedEngine(FakeEngine):
    """The fake engine with the real engine's text bound (InputProcessor.check_text_length)."""

    class inputs:  # noqa: N801 - stands in for the engine's InputProcessor
        @staticmethod
        def check_text_length(text: str, field: str) -> None:
            if len(text) > 10_000:
                raise ValueError(f"{field} has {len(text)} characters: more than the context ...")


@pytest.fixture(scope="module")
def server():
    tok = transformers.AutoTokenizer.from_pretrained(TINY_MODEL)
    with InProcessServer(build_app(BoundedEngine(tok, max_model_len=256))) as s:
        yield s


def test_tokenize_is_bounded_as_completions_are(server):
    assert post(server, "/tokenize", {"prompt": "x" * 9_000}).status_code == 200
    assert_error(post(server, "/tokenize", {"prompt": "x" * 20_000}), 400, "prompt")
    msgs = [{"role": "user", "content": "x" * 20_000}]
    assert_error(post(server, "/tokenize", {"messages": msgs}), 400, "messages")
    assert_error(post(server, "/tokenize", {}), 400, "prompt")  # named, not "give"


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_says_so(server, ctype):
    headers = {} if ctype is None else {"content-type": ctype}
    r = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": "hi"}', headers=headers, timeout=30)
    err = assert_error(r, 400)
    assert "Content-Type: application/json" in err["message"], err


@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": True}, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": False}, "logprobs"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"\u0663": 5}}, "logit_bias"),  # Arabic-Indic 3
])
def test_booleans_and_non_ascii_digits_are_not_integers(server, path, body, field):
    assert_error(post(server, path, body), 400, field)


@pytest.mark.parametrize("value", [1e20, -1e300, 2 ** 70])
def test_an_int64_field_out_of_range_names_the_range(server, value):
    """A whole number past int64, as an int or a float, gets the range (not pydantic's message
    about parsing a string)."""
    err = assert_error(post(server, "/v1/completions", {"prompt": "hi", "min_tokens": value}), 400, "min_tokens")
    assert "must be an integer in [0, 9223372036854775807]" in err["message"], err


@pytest.mark.parametrize("key", ["messages", "tools", "documents", "bos_token", "add_generation_prompt"])
def test_template_variables_cannot_be_set_by_chat_template_kwargs(server, key):
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {key: []}}
    err = assert_error(post(server, "/v1/chat/completions", body), 400, "chat_template_kwargs")
    assert key in err["message"]


def test_prompt_logprob_volume_is_bounded(server):
    """One cheap prefill must not buy an answer so large that building it holds the event loop."""
    body = {"prompt": [[7] * 100] * 4, "max_tokens": 1, "echo": True, "logprobs": 1}
    assert post(server, "/v1/completions", body).status_code == 200
    from server.limits import ServerLimits
    limit = ServerLimits().max_prompt_logprob_entries
    tokens = limit // 21 + 1  # x 21 entries each: one over
    err = assert_error(post(server, "/v1/completions", {
        "prompt": [[7] * (tokens // 2 + 1)] * 2, "max_tokens": 1, "prompt_logprobs": 20}), 400, "prompt_logprobs")
    assert "--max-prompt-logprob-entries" in err["message"]
    assert_error(post(server, "/v1/completions", {"prompt": ["x" * 8000] * 64, "max_tokens": 1, "echo": True,
                                                 "logprobs": 1}), 400, "echo")
    # without prompt logprobs the same prompts are only bounded by the other limits
    assert post(server, "/v1/completions", {"prompt": ["x" * 100] * 4, "max_tokens": 1, "echo": True}
                ).status_code == 200
    # every choice carries its prompt's logprobs: n multiplies the entries (4 prompts of 120
    # tokens, 10k entries, in bounds alone; with n = 128 over them)
    four = [[7] * 120] * 4
    assert limit < 4 * 120 * 21 * 128
    assert post(server, "/v1/completions", {"prompt": four, "max_tokens": 1, "prompt_logprobs": 20}).status_code == 200
    err = assert_error(post(server, "/v1/completions", {"prompt": four, "n": 128, "max_tokens": 1, "echo": True,
                                                       "logprobs": 20}), 400, "echo")
    assert "n = 128 choices" in err["message"]
    # echo's logprobs and prompt_logprobs each spell the prompt's out: both count (2 x 21 entries
    # a token here: within the bound alone, over it together)
    prompts = [[7] * 200] * (limit // (200 * 40))
    ServerLimits().check_prompt_logprobs(prompts, [20], "prompt_logprobs")  # alone: within
    both = {"prompt": prompts, "max_tokens": 1, "echo": True, "logprobs": 20, "prompt_logprobs": 20}
    err = assert_error(post(server, "/v1/completions", both), 400, "prompt_logprobs")
    assert "x 42 logprob entries" in err["message"]


def test_stop_token_ids_are_bounded(server):
    """Each sampled token is looked up in stop_token_ids (and they are masked out while
    min_tokens holds): a request may send at most 1024, as for logit_bias and allowed_token_ids;
    repeated ids count once in the engine."""
    err = assert_error(post(server, "/v1/completions", {"prompt": "hi", "stop_token_ids": [5] * 1025}),
                       400, "stop_token_ids")
    assert "1024" in err["message"]
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop_token_ids": [5] * 1024}
                ).status_code == 200
    from common.sampling_params import SamplingParams
    assert SamplingParams(stop_token_ids=[5, 3, 5, 9, 3]).stop_token_ids == [5, 3, 9]
    with pytest.raises(ValueError, match="stop_token_ids"):  # not a TypeError from the de-duplication
        SamplingParams(stop_token_ids=[[1]])


def test_the_kv_cache_bound_names_the_endpoints_field():
    """The engine's refusal of a max_tokens past a small KV cache names the field the request
    used: chat's max_completion_tokens, the Responses API's max_output_tokens."""
    from engine.input_processor import CacheCapacityError
    from server.handler import refusal_error
    e = CacheCapacityError(64, 50, 16)
    for fields in (("prompt", "max_tokens"), ("messages", "max_completion_tokens"), ("input", "max_output_tokens")):
        err = refusal_error(e, fields)
        assert err.param == fields[1] and err.message.startswith(fields[1] + ": 16 after"), (fields, err.message)


def test_emoji_prompts_count_by_bytes_and_blank_bad_words_are_refused(server):
    from server.limits import ServerLimits
    limit = ServerLimits().max_prompt_logprob_entries
    n = limit // (21 * 4 * 8) + 1  # 8 prompts of n four-byte emoji x 21 entries: over the bound
    assert_error(post(server, "/v1/completions", {"prompt": ["\U0001F600" * n] * 8, "max_tokens": 1,
                                                 "echo": True, "logprobs": 20}), 400, "echo")
    assert_error(post(server, "/v1/completions", {"prompt": "hi", "bad_words": ["   "]}), 400, "bad_words")
    assert_error(post(server, "/v1/completions", {"prompt": "hi", "allowed_token_ids": list(range(1025))}),
                 400, "allowed_token_ids")


def test_generated_logprob_volume_of_a_whole_answer_is_bounded():
    """A whole (not streamed) answer's logprobs are held until its last token: past
    --max-response-logprob-entries the request stops with a 400 naming the field and the flag
    (counted as the tokens come, so a request that ends early is never refused); a stream of the
    same request is not limited."""
    from server.cli import build_parser

    tok = transformers.AutoTokenizer.from_pretrained(TINY_MODEL)
    engine = FakeEngine(tok, max_model_len=256)
    args = build_parser().parse_args(["--model", str(TINY_MODEL), "--max-response-logprob-entries", "100"])
    with InProcessServer(build_app(engine, args)) as s:
        body = {"prompt": "hi", "max_tokens": 30, "logprobs": 3, "ignore_eos": True}  # 30 x 4 = 120
        err = assert_error(post(s, "/v1/completions", body), 400, "logprobs")
        assert "--max-response-logprob-entries" in err["message"] and "more than 100" in err["message"]
        assert post(s, "/v1/completions", {**body, "max_tokens": 25}).status_code == 200  # 100: at the bound
        streamed = post(s, "/v1/completions", {**body, "stream": True})
        assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "logprobs": True,
                "top_logprobs": 3, "ignore_eos": True}
        assert_error(post(s, "/v1/chat/completions", chat), 400, "top_logprobs")
        assert post(s, "/v1/chat/completions", {**chat, "n": 1, "max_tokens": 20}).status_code == 200
        assert post(s, "/v1/completions", {**body, "logprobs": None}).status_code == 200  # no logprobs asked
