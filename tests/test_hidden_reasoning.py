"""include_reasoning false (vLLM's field) with --reasoning-parser, against the fake engine: the
reasoning is left out of the answer, and so are its tokens' logprobs and ids and the stream's
chunks for it, whole and streamed alike (server/reasoning.py TokenMask)."""

from __future__ import annotations

import pytest

from tests.test_server_request_fields import CHAT, CONTENT, REASONING, joined, post, reasoning_server, stream_chat


@pytest.fixture(scope="module")
def r1():
    engine, srv = reasoning_server(None, "deepseek_r1")  # its own tokenizer, with a thinking template
    with srv as s:
        s.engine = engine
        yield s

def test_include_reasoning_false_leaves_only_the_content(r1):
    body = {**CHAT, "max_tokens": len(r1.engine.script), "include_reasoning": False}
    m = post(r1, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert (m["reasoning_content"], m["reasoning"], m["content"]) == (None, None, CONTENT)
    chunks = stream_chat(r1, body)
    assert (joined(chunks, "reasoning"), joined(chunks, "reasoning_content")) == (None, None)
    assert joined(chunks, "content") == CONTENT

    # the left-out reasoning sends no chunks, nor does text held back inside it (a possible tag's
    # start): reasoning with more "<" in it sends as many chunks, with logprobs or without; the
    # one empty delta is the closing tag's
    def empty(cs):
        return sum(1 for c in cs if c["choices"] and c["choices"][0]["delta"] == {}
                   and c["choices"][0]["finish_reason"] is None)
    assert empty(chunks) == 1 < empty(stream_chat(r1, {**body, "include_reasoning": True}))
    tok, script = r1.engine.tokenizer, r1.engine.script
    counts = []
    for reasoning in ("Let me see: a b c d.", "Let me see: a<b</c<d."):
        r1.engine.script = tok(reasoning + "</think>" + CONTENT, add_special_tokens=False)["input_ids"]
        try:
            counts.append([len(stream_chat(r1, {**body, "max_tokens": len(r1.engine.script), "logprobs": lps}))
                           for lps in (False, True)])
        finally:
            r1.engine.script = script
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("upto", [None, "inside"])
def test_left_out_reasoning_has_no_logprobs_streamed_or_whole(r1, upto):
    """With include_reasoning false the reasoning tokens' logprobs are left out of the whole
    answer too (they would spell out the hidden reasoning), and the whole answer's logprobs are
    the streamed ones; an output that stops inside the reasoning has none either way."""
    n = len(r1.engine.script)
    if upto == "inside":
        n = len(r1.engine.tokenizer(REASONING[:10], add_special_tokens=False)["input_ids"])
    body = {**CHAT, "max_tokens": n, "include_reasoning": False, "logprobs": True}
    whole = post(r1, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    streamed = [e for c in stream_chat(r1, body) if c["choices"] and c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]]
    assert [e["token"] for e in whole] == [e["token"] for e in streamed]
    text = "".join(e["token"] for e in whole)
    if upto == "inside":
        assert whole == []
    else:
        # the closing tag's tokens stay (a stream sends their empty deltas), the reasoning's go
        assert "Let me" not in text and "3 + 4" not in text and text.endswith("</think>" + CONTENT)
    shown = post(r1, "/v1/chat/completions", {**body, "include_reasoning": True}).json()
    assert len(shown["choices"][0]["logprobs"]["content"]) == n  # with the reasoning: every token's


@pytest.mark.parametrize("logprobs", [False, True])
def test_left_out_reasoning_has_no_token_ids_streamed_or_whole(r1, logprobs):
    """return_token_ids with include_reasoning false: the reasoning tokens' ids are left out as
    their logprobs are (the ids would spell the hidden reasoning out), the same tokens whole and
    streamed, with or without logprobs beside them; with the reasoning shown, every id is sent."""
    tok, n = r1.engine.tokenizer, len(r1.engine.script)
    body = {**CHAT, "max_tokens": n, "include_reasoning": False, "return_token_ids": True, "logprobs": logprobs}
    whole = post(r1, "/v1/chat/completions", body).json()["choices"][0]
    streamed = [t for c in stream_chat(r1, body) if c["choices"] for t in c["choices"][0].get("token_ids") or []]
    assert whole["token_ids"] == streamed
    text = tok.decode(whole["token_ids"])
    assert "Let me" not in text and "3 + 4" not in text and text.endswith("</think>" + CONTENT)
    if logprobs:
        assert [e["token"] for e in whole["logprobs"]["content"]] == [tok.decode([t]) for t in whole["token_ids"]]
    shown = post(r1, "/v1/chat/completions", {**body, "include_reasoning": True}).json()["choices"][0]
    assert shown["token_ids"] == r1.engine.script[:n]


def test_left_out_reasoning_that_looks_like_a_tag_start_stays_out(r1):
    """Reasoning holding "</p>" and "<": the parser holds those tokens back as a possible
    "</think>", then decides them as reasoning; their logprobs and ids stay out, whole and
    streamed (they were shown before they were decided); the real tag's tokens are shown."""
    tok, script = r1.engine.tokenizer, r1.engine.script
    r1.engine.script = tok("Close it with </p> and a < b.</think>" + CONTENT, add_special_tokens=False)["input_ids"]
    try:
        body = {**CHAT, "max_tokens": len(r1.engine.script), "include_reasoning": False, "logprobs": True,
                "return_token_ids": True}
        whole = post(r1, "/v1/chat/completions", body).json()["choices"][0]
        chunks = [c["choices"][0] for c in stream_chat(r1, body) if c["choices"]]
    finally:
        r1.engine.script = script
    assert whole["token_ids"] == [t for c in chunks for t in c.get("token_ids") or []]
    assert whole["logprobs"]["content"] == [e for c in chunks if c["logprobs"] for e in c["logprobs"]["content"]]
    assert tok.decode(whole["token_ids"]) == "</think>" + CONTENT
    assert "".join(e["token"] for e in whole["logprobs"]["content"]) == "</think>" + CONTENT


def test_left_out_reasoning_held_back_by_the_detokenizer_has_no_logprobs(r1):
    """Reasoning with multi-byte characters: the stream's detokenizer holds back their partial
    bytes (chunks with no text), yet those tokens' logprobs stay out as in the whole answer."""
    tok, script = r1.engine.tokenizer, r1.engine.script
    r1.engine.script = tok("Let me think: 3 + 4 \U0001F600 \u7b49\u4e8e\u4e03.</think>" + CONTENT,
                           add_special_tokens=False)["input_ids"]
    try:
        body = {**CHAT, "max_tokens": len(r1.engine.script), "include_reasoning": False, "logprobs": True,
                "top_logprobs": 2}
        whole = post(r1, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
        streamed = [e for c in stream_chat(r1, body) if c["choices"] and c["choices"][0]["logprobs"]
                    for e in c["choices"][0]["logprobs"]["content"]]
    finally:
        r1.engine.script = script
    assert whole == streamed
    assert "".join(e["token"] for e in whole).endswith("</think>" + CONTENT)
    assert not any("\u7b49" in e["token"] or "\ufffd" in e["token"] for e in whole)
