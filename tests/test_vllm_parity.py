"""What a client or launch line written for vLLM gets here, beyond the basics (against the fake
engine and the real InputProcessor): explicit nulls, stream_options' default, vLLM's fields this
server refuses rather than drop, the client's request id, stop_reason, return_token_ids,
add_special_tokens, truncate_prompt_tokens, continue_final_message, OpenAI's context-length
error, and the flags vLLM launch lines pass."""

from __future__ import annotations

import asyncio
import logging
import os

import httpx
import pytest
import transformers

from common.sampling_params import SamplingParams
from engine.input_processor import ContextLengthError, InputProcessor
from engine.spec_decode import SpeculativeConfig
from models.config import ModelConfig
from server.api_server import build_app
from server.flags import api_key_from, build_parser, engine_args_from
from server.overrides import load_generation_defaults
from server.protocol import CompletionRequest
from server.request_fields import _non_nullable
from tests.server_fixtures import OFFLINE_ENV, TINY_MODEL, FakeEngine, InProcessServer, assert_error

os.environ.update(OFFLINE_ENV)
MAX_LEN = 256


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(TINY_MODEL)


class ContextEngine(FakeEngine):
    """The fake engine, but a prompt over the context fails as InputProcessor fails it."""

    async def generate(self, prompt, params, request_id):
        if params.max_tokens and params.max_tokens > 10_000:
            raise ContextLengthError(MAX_LEN, 5, params.max_tokens)
        async for out in super().generate(prompt, params, request_id):
            yield out


@pytest.fixture(scope="module")
def server(tok):
    with InProcessServer(build_app(ContextEngine(tok, max_model_len=MAX_LEN))) as s:
        yield s


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
CMPL = {"prompt": "hi", "max_tokens": 4}
CHAT_PATH = "/v1/chat/completions"


# --- explicit nulls -------------------------------------------------------------------------

@pytest.mark.parametrize("path,base", [("/v1/completions", CMPL), ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("field", ["temperature", "top_p", "top_k", "min_p", "n", "stream",
                                   "presence_penalty", "frequency_penalty", "repetition_penalty",
                                   "stop_token_ids", "ignore_eos", "skip_special_tokens", "seed"])
def test_null_means_not_set(server, path, base, field):
    r = post(server, path, {**base, field: None})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_null_where_it_means_something_keeps_its_meaning(server):
    r = post(server, "/v1/completions", {**CMPL, "max_tokens": None, "echo": None, "logprobs": None})
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert u["completion_tokens"] == MAX_LEN - u["prompt_tokens"]  # null max_tokens: up to the context
    assert "max_tokens" not in _non_nullable(CompletionRequest)
    assert {"temperature", "n", "echo"} <= _non_nullable(CompletionRequest)
    r = post(server, "/v1/chat/completions", {"messages": None})
    assert_error(r, 400, "messages")


def test_null_takes_the_generation_config_default(tok):
    class Args:
        override_generation_config = '{"max_new_tokens": 3}'
        generation_config = "vllm"
    with InProcessServer(build_app(FakeEngine(tok, max_model_len=MAX_LEN), Args())) as s:
        r = post(s, "/v1/completions", {"prompt": "hi", "max_tokens": None})
        assert r.json()["usage"]["completion_tokens"] == 3  # the config's, as in vLLM
        r = post(s, "/v1/chat/completions", {**CHAT, "max_tokens": None, "temperature": None})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


# --- stream_options ---------------------------------------------------------------------------

def _events(server, body, path: str = "/v1/completions"):
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=30) as r:
        assert r.status_code == 200
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("opts,usage", [({}, True), ({"continuous_usage_stats": True}, True),
                                        ({"include_usage": None}, False), ({"include_usage": False}, False),
                                        (None, False)])
def test_stream_options_include_usage_defaults_to_true(server, opts, usage):
    body = {**CMPL, "stream": True, **({} if opts is None else {"stream_options": opts})}
    events = _events(server, body)
    assert events[-1] == "[DONE]"
    last = httpx.Response(200, content=events[-2]).json()
    assert (last["choices"] == [] and last["usage"]["completion_tokens"] == 4) == usage


# --- vLLM's fields that are refused, not dropped ----------------------------------------------

REFUSED = [("length_penalty", 0.5),
           ("spaces_between_special_tokens", False),
           ("logits_processors", ["p"]), ("prompt_embeds", "AAAA"),
           ("kv_transfer_params", {}), ("vllm_xargs", {"a": 1})]
CHAT_REFUSED = [("documents", [{"text": "d"}]), ("chat_template", "{{ x }}")]


@pytest.mark.parametrize("path,base,field,value",
                         [("/v1/completions", CMPL, f, v) for f, v in REFUSED]
                         + [("/v1/chat/completions", CHAT, f, v) for f, v in REFUSED + CHAT_REFUSED])
def test_vllm_fields_not_honoured_are_400s(server, path, base, field, value):
    assert_error(post(server, path, {**base, field: value}), 400, field)


@pytest.mark.parametrize("field,value", [("use_beam_search", False), ("length_penalty", 1.0),
                                         ("bad_words", []), ("priority", 0), ("cache_salt", None),
                                         ("spaces_between_special_tokens", True), ("echo", False)])
def test_their_no_op_values_are_accepted(server, field, value):
    assert post(server, "/v1/chat/completions", {**CHAT, field: value}).status_code == 200


# --- ids, stop_reason, token ids ---------------------------------------------------------------

def post(server, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=30)


def test_client_request_id(server):
    r = post(server, "/v1/completions", CMPL, headers={"X-Request-Id": "trace-7"})
    assert r.json()["id"] == "cmpl-trace-7"
    r = post(server, "/v1/chat/completions", {**CHAT, "request_id": "abc"})
    assert r.json()["id"] == "chatcmpl-abc"
    r = post(server, "/v1/chat/completions", {**CHAT, "request_id": "abc"}, headers={"X-Request-Id": "hdr"})
    assert r.json()["id"] == "chatcmpl-hdr"  # the header wins, as in vLLM

    async def same_id_at_once():  # a client's id need not be unique
        async with httpx.AsyncClient(timeout=30) as c:
            return await asyncio.gather(*[c.post(f"{server.url}/v1/completions", json=CMPL,
                                                 headers={"X-Request-Id": "dup"}) for _ in range(4)])
    assert [r.status_code for r in asyncio.run(same_id_at_once())] == [200] * 4
    assert_error(post(server, "/v1/completions", CMPL, headers={"X-Request-Id": "x" * 257}), 400,
                 "request_id")


def test_stop_reason_and_return_token_ids(server):
    r = post(server, "/v1/completions", {**CMPL, "return_token_ids": True, "temperature": 0})
    first = c = r.json()["choices"][0]
    assert c["finish_reason"] == "length" and c["stop_reason"] is None
    assert len(c["token_ids"]) == 4 and len(c["prompt_token_ids"]) == r.json()["usage"]["prompt_tokens"]
    stop_id = c["token_ids"][2]
    r = post(server, "/v1/completions", {**CMPL, "temperature": 0, "stop_token_ids": [stop_id]})
    c = r.json()["choices"][0]
    assert (c["finish_reason"], c["stop_reason"]) == ("stop", stop_id)
    whole = post(server, "/v1/completions", {**CMPL, "temperature": 0, "stop_token_ids": [stop_id],
                                             "return_token_ids": True}).json()["choices"][0]
    events = _events(server, {**CMPL, "stream": True, "return_token_ids": True, "temperature": 0,
                              "stop_token_ids": [stop_id]})
    chunks = [httpx.Response(200, content=e).json()["choices"][0] for e in events[:-1]]
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in ch for ch in chunks[1:])
    assert [t for ch in chunks for t in ch["token_ids"]] == whole["token_ids"] == first["token_ids"][:3]
    assert (chunks[-1]["finish_reason"], chunks[-1]["stop_reason"]) == ("stop", stop_id)
    assert all(ch["stop_reason"] is None for ch in chunks[:-1])

    text = post(server, "/v1/chat/completions", {**CHAT, "temperature": 0, "max_tokens": 8}
                ).json()["choices"][0]["message"]["content"]
    stop = text[len(text) // 2]
    r = post(server, "/v1/chat/completions", {**CHAT, "temperature": 0, "max_tokens": 8, "stop": [stop]})
    c = r.json()["choices"][0]
    assert (c["finish_reason"], c["stop_reason"]) == ("stop", stop), c


def test_chat_return_token_ids_whole_and_streamed(server, tok):
    body = {**CHAT, "temperature": 0, "n": 2, "return_token_ids": True}
    r = post(server, "/v1/chat/completions", body).json()
    prompt_ids = post(server, "/tokenize", {"messages": CHAT["messages"]}).json()["tokens"]
    assert r["prompt_token_ids"] == prompt_ids and r["usage"]["prompt_tokens"] == len(prompt_ids)
    for c in r["choices"]:
        assert len(c["token_ids"]) == 4 and tok.decode(c["token_ids"]) == c["message"]["content"]
    chunks = [httpx.Response(200, content=e).json() for e in _events(server, {**body, "stream": True}, CHAT_PATH)[:-1]]
    for i in range(2):
        mine = [ch for ch in chunks if ch["choices"][0]["index"] == i]
        assert mine[0]["prompt_token_ids"] == prompt_ids and mine[0]["choices"][0]["delta"]["role"]
        assert all("prompt_token_ids" not in ch for ch in mine[1:])
        assert [t for ch in mine[1:] for t in ch["choices"][0]["token_ids"]] == r["choices"][i]["token_ids"]
    plain = post(server, "/v1/chat/completions", {**CHAT, "temperature": 0}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_chat_echo_puts_the_continued_message_first(server):
    msgs = [{"role": "user", "content": "Question: x?"}, {"role": "assistant", "content": "The answer is"}]
    cont = {**CHAT, "messages": msgs, "add_generation_prompt": False, "continue_final_message": True,
            "temperature": 0}
    plain = post(server, "/v1/chat/completions", cont).json()["choices"][0]["message"]
    echoed = post(server, "/v1/chat/completions", {**cont, "echo": True}).json()["choices"][0]["message"]
    assert echoed == {**plain, "content": "The answer is" + plain["content"]}
    events = _events(server, {**cont, "echo": True, "stream": True}, CHAT_PATH)
    deltas = [httpx.Response(200, content=e).json()["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[1] == {"content": "The answer is"}
    assert "".join(d.get("content") or "" for d in deltas) == echoed["content"]
    # after a generation prompt the response's role (assistant) is not the last message's: no echo
    after_prompt = post(server, "/v1/chat/completions", {**CHAT, "temperature": 0, "echo": True}).json()
    assert after_prompt["choices"][0]["message"] == post(
        server, "/v1/chat/completions", {**CHAT, "temperature": 0}).json()["choices"][0]["message"]


def test_context_length_error_is_openais(server):
    err = assert_error(post(server, "/v1/completions", {**CMPL, "max_tokens": 20_000}), 400, None)
    assert err["message"].startswith("This model's maximum context length is")
    assert (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded")
    assert "(5 in the prompt, 20000 in the completion: max_tokens)" in err["message"]
    for field in ("max_tokens", "max_completion_tokens"):  # chat names its own fields
        err = assert_error(post(server, "/v1/chat/completions", {**CHAT, field: 20_000}), 400, None)
        assert (err["param"], err["code"]) == (field, "context_length_exceeded")
        assert f"in the messages, 20000 in the completion: {field}). Please reduce the length of the " \
               f"messages or {field}." in err["message"]


def test_echo_without_logprobs_logs_no_warning(server, caplog):
    with caplog.at_level(logging.WARNING, logger="server.completions"):
        r = post(server, "/v1/completions", {**CMPL, "echo": True})
    assert r.json()["choices"][0]["text"].startswith("hi")
    assert not [m for m in caplog.messages if "prompt logprobs" in m]


# --- the prompt: add_special_tokens, truncate_prompt_tokens, the context -----------------------

@pytest.fixture(scope="module")
def inputs(tok):
    return InputProcessor(tok, ModelConfig.from_pretrained(str(TINY_MODEL)), max_model_len=MAX_LEN)


def test_add_special_tokens_and_truncation(inputs, tok):
    with_bos = inputs.process("Question: a", SamplingParams(max_tokens=4))[1]
    without = inputs.process("Question: a", SamplingParams(max_tokens=4, add_special_tokens=False))[1]
    assert with_bos == [tok.bos_token_id] + without
    text, ids, _ = inputs.process("Question: a", SamplingParams(max_tokens=4, truncate_prompt_tokens=3))
    assert ids == with_bos[-3:] and text is None  # the text no longer matches the ids
    ids = list(range(5, 5 + MAX_LEN + 10))
    _, kept, p = inputs.process(ids, SamplingParams(max_tokens=None, truncate_prompt_tokens=MAX_LEN - 6))
    assert kept == ids[-(MAX_LEN - 6):] and p.max_tokens == 6
    with pytest.raises(ValueError, match="truncate_prompt_tokens 300 is more than the context length"):
        inputs.process(ids, SamplingParams(truncate_prompt_tokens=300))
    with pytest.raises(ContextLengthError, match="your prompt has 256 tokens"):  # -1: max_model_len
        inputs.process(ids, SamplingParams(truncate_prompt_tokens=-1))
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)
    assert CompletionRequest(prompt="x", truncate_prompt_tokens=-1).to_sampling_params().truncate_prompt_tokens == -1
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        CompletionRequest(prompt="x", truncate_prompt_tokens=0)
    assert CompletionRequest(prompt="x", add_special_tokens=False).to_sampling_params().add_special_tokens is False


def test_context_length_message(inputs):
    with pytest.raises(ContextLengthError) as e:
        inputs.process([5] * 250, SamplingParams(max_tokens=10))
    assert str(e.value).startswith("This model's maximum context length is 256 tokens")
    assert "you requested 260 tokens (250 in the prompt, 10 in the completion" in str(e.value)
    assert (e.value.param, e.value.code) == ("max_tokens", "context_length_exceeded")
    chat = e.value.renamed("messages", "max_completion_tokens")  # as the chat handler names them
    assert chat.param == "max_completion_tokens" and "in the messages, 10 in the completion" in str(chat)
    with pytest.raises(ContextLengthError) as e:
        inputs.process([5] * 256, SamplingParams(max_tokens=None))
    assert e.value.param == "prompt" and "your prompt has 256 tokens" in str(e.value)
    assert "your messages have 256 tokens" in str(e.value.renamed("messages", "max_tokens"))


def test_continue_final_message_and_chat_special_tokens(server, tok):
    msgs = [{"role": "user", "content": "Question: x?"}, {"role": "assistant", "content": "The answer is"}]
    ids = post(server, "/tokenize", {"messages": msgs, "add_generation_prompt": False,
                                     "continue_final_message": True}).json()["tokens"]
    assert tok.decode(ids).endswith("The answer is") and ids[-1] != tok.eos_token_id
    closed = post(server, "/tokenize", {"messages": msgs, "add_generation_prompt": False}).json()["tokens"]
    assert closed[-1] == tok.eos_token_id and closed[:len(ids)] == ids
    for path, body in (("/tokenize", {"messages": msgs}), ("/v1/chat/completions", {**CHAT, "messages": msgs})):
        assert_error(post(server, path, {**body, "continue_final_message": True}), 400, "continue_final_message")
    r = post(server, "/v1/chat/completions", {**CHAT, "messages": msgs, "add_generation_prompt": False,
                                              "continue_final_message": True})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)
    plain = post(server, "/tokenize", {"messages": msgs[:1]}).json()["tokens"]
    doubled = post(server, "/tokenize", {"messages": msgs[:1], "add_special_tokens": True}).json()["tokens"]
    assert doubled == [tok.bos_token_id] + plain  # the template's BOS, then the tokenizer's
    r = post(server, "/v1/chat/completions", {**CHAT, "messages": msgs[:1], "add_special_tokens": True})
    assert r.json()["usage"]["prompt_tokens"] == len(doubled)


def test_text_parts_join_with_newlines(server, tok):
    """vLLM joins a message's text parts with "\\n" (chat templates that take string content)."""
    parts = [{"type": "text", "text": "first part"}, {"type": "text", "text": "second part"}]
    as_parts = post(server, "/tokenize", {"messages": [{"role": "user", "content": parts}]}).json()["tokens"]
    joined = post(server, "/tokenize", {"messages": [
        {"role": "user", "content": "first part\nsecond part"}]}).json()["tokens"]
    assert as_parts == joined and "first part\nsecond part" in tok.decode(as_parts)
    r = post(server, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(joined)


# --- launch lines -------------------------------------------------------------------------------

def _engine_args(line: str):
    return engine_args_from(build_parser().parse_args(["--model", str(TINY_MODEL), *line.split()]))


def test_vllm_no_op_flags(monkeypatch):
    _engine_args("--enable-chunked-prefill -pp 1 --distributed-executor-backend mp "
                 "--tokenizer-mode auto --scheduling-policy fcfs --disable-log-stats --disable-fastapi-docs "
                 "--max-logprobs 5")
    for line, msg in (("--no-enable-chunked-prefill", "chunked prefill cannot be turned off"),
                      ("-pp 2", "--pipeline-parallel-size 2: only 1"),
                      ("-dp 0", "--data-parallel-size must be >= 1, got 0"),
                      ("--distributed-executor-backend ray", "only mp"),
                      ("--tokenizer-mode slow", "only auto"),
                      ("--max-logprobs 21", "--max-logprobs must be in \\[0, 20\\]")):
        with pytest.raises(ValueError, match=msg):
            _engine_args(line)
    assert _engine_args("--scheduling-policy priority").scheduling_policy == "priority"
    monkeypatch.setenv("VLLM_API_KEY", "k1")
    assert api_key_from(None) == "k1" and api_key_from("k2") == "k2"
    monkeypatch.delenv("VLLM_API_KEY")
    assert api_key_from(None) is None


def test_vllm_aliases_and_generation_overrides(tmp_path):
    assert SpeculativeConfig.parse('{"method": "deepseek_mtp", "num_speculative_tokens": 1}').method == "mtp"
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.3, "top_k": 5}')
    assert load_generation_defaults("auto", str(tmp_path), '{"temperature": 0.6, "max_new_tokens": 9}') == \
        {"temperature": 0.6, "top_k": 5, "max_tokens": 9}
    assert load_generation_defaults("vllm", str(tmp_path), '{"top_p": 0.5}') == {"top_p": 0.5}
    for bad, msg in (('{"nope": 1}', "unknown key"), ("[1]", "JSON object"), ("{", "not valid JSON"),
                     ('{"temperature": -1}', "temperature"),
                     ('{"max_new_tokens": 0}', r"max_new_tokens must be >= 1, got 0$"),
                     ('{"top_p": 2}', r"^--override-generation-config: top_p: .*\(got 2.0\)$")):
        with pytest.raises(ValueError, match=msg):
            load_generation_defaults("vllm", None, bad)
    assert _engine_args('--override-generation-config {"temperature":0.5}').model == str(TINY_MODEL)


def _hub_cache(root, repo: str, files_from) -> str:
    """A Hugging Face cache holding `repo` at main: files_from's files in snapshots/<commit>."""
    import shutil
    commit = "0123456789abcdef0123456789abcdef01234567"
    base = root / f"models--{repo.replace('/', '--')}"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    shutil.copytree(files_from, base / "snapshots" / commit)
    return str(base / "snapshots" / commit)


def test_a_hub_repository_id_is_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the cache only: no network here
    snapshot = _hub_cache(tmp_path, "org/tiny-v3", TINY_MODEL)
    ns = build_parser().parse_args(["org/tiny-v3", "--download-dir", str(tmp_path)])
    a = engine_args_from(ns)
    assert a.model == snapshot and a.model_name == "org/tiny-v3"  # vLLM's default name
    a = engine_args_from(build_parser().parse_args([
        "--model", str(TINY_MODEL), "--tokenizer", "org/tiny-v3", "--download-dir", str(tmp_path)]))
    assert a.tokenizer == snapshot
    with pytest.raises(ValueError, match="--model org/missing: not a local directory, and fetching it "
                                         "from the Hugging Face Hub failed \\(HF_HUB_OFFLINE is set"):
        engine_args_from(build_parser().parse_args(["org/missing", "--download-dir", str(tmp_path)]))
    fetched = []
    monkeypatch.setattr("server.flags.resolve_model_dir", lambda *a, **k: fetched.append(a) or snapshot)
    with pytest.raises(ValueError, match="--pipeline-parallel-size 2"):  # named before any fetch
        engine_args_from(build_parser().parse_args(["org/big", "-pp", "2"]))
    assert fetched == []


def test_max_logprobs_and_fastapi_docs(tok):
    class Args:
        max_logprobs = 2
        disable_fastapi_docs = False
    with InProcessServer(build_app(FakeEngine(tok, max_model_len=MAX_LEN), Args())) as s:
        assert post(s, "/v1/completions", {**CMPL, "logprobs": 2}).status_code == 200
        for path, body, field in (("/v1/completions", {**CMPL, "logprobs": 3}, "logprobs"),
                                  ("/v1/completions", {**CMPL, "prompt_logprobs": 3}, "prompt_logprobs"),
                                  ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 3},
                                   "top_logprobs"),
                                  ("/v1/chat/completions", {**CHAT, "prompt_logprobs": 3}, "prompt_logprobs")):
            err = assert_error(post(s, path, body), 400, field)
            assert "--max-logprobs" in err["message"]
            # past the engine's cap of 20 too, where the field's range refuses it
            err = assert_error(post(s, path, {**body, field: 21}), 400, field)
            assert "[0, 20] (the most --max-logprobs allows)" in err["message"]
        assert httpx.get(f"{s.url}/openapi.json").json()["paths"]["/v1/completions"]
        assert httpx.get(f"{s.url}/docs").status_code == 200
    Args.disable_fastapi_docs = True
    with InProcessServer(build_app(FakeEngine(tok, max_model_len=MAX_LEN), Args())) as s:
        assert httpx.get(f"{s.url}/openapi.json").status_code == 404


def test_bad_words_are_read_as_token_sequences(tok):
    from server.handler import bad_words_token_ids
    seqs = bad_words_token_ids(tok, ["apples", " 7"])
    plain = tok("apples", add_special_tokens=False)["input_ids"]
    spaced = tok(" apples", add_special_tokens=False)["input_ids"]
    assert plain in seqs and spaced in seqs  # at the start and after a space
    assert tok("7", add_special_tokens=False)["input_ids"] in seqs  # the word's leading space stripped


def test_bad_words_are_validated(server):
    r = post(server, "/v1/completions", {**CMPL, "bad_words": ["apples"]})
    assert r.status_code == 200, r.text
    assert_error(post(server, "/v1/completions", {**CMPL, "bad_words": [""]}), 400, "bad_words")
    assert_error(post(server, "/v1/completions", {**CMPL, "bad_words": ["x"] * 129}), 400, "bad_words")


def test_vllm_request_params_and_cache_config_metrics(tok):
    from common.args import EngineArgs
    engine = FakeEngine(tok, max_model_len=MAX_LEN)
    engine.args = EngineArgs(model=str(TINY_MODEL), block_size=16)
    with InProcessServer(build_app(engine)) as s:
        post(s, "/v1/completions", {"prompt": ["hi", "yo"], "max_tokens": 4, "n": 2})
        chat_prompt = post(s, "/v1/chat/completions", {**CHAT, "max_tokens": None}).json()["usage"]["prompt_tokens"]
        text = httpx.get(f"{s.url}/metrics").text

    def series(name: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(name + "{"))
        return float(line.rsplit(" ", 1)[1])
    assert series("vllm:request_params_n_count") == 3  # per prompt: two of n 2, one of n 1
    assert series("vllm:request_params_n_sum") == 5
    # the chat request's unset max_tokens counts as what its context left
    assert series("vllm:request_params_max_tokens_sum") == 2 * 4 + MAX_LEN - chat_prompt
    info = next(ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{"))
    assert 'block_size="16"' in info and 'num_gpu_blocks="1024"' in info and info.endswith(" 1.0")
