"""Chat logprobs' `bytes`: each token's raw bytes (server/token_bytes.py), so the bytes of the
tokens that split one character join into it, as OpenAI's field promises."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import transformers

from server.api_server import build_app
from server.cli import build_parser
from server.token_bytes import _BYTE_OF, piece_bytes, token_bytes
from tests.server_fixtures import TINY_MODEL, ScriptedEngine

TEXT = "é😀 ü €ñ 漢字"


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(TINY_MODEL)


def test_every_piece_spells_its_decoded_text(tok):
    assert sorted(_BYTE_OF.values()) == list(range(256))  # one character for each byte
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)  # spelt as themselves
    for tid in range(len(tok)):
        if tid in special:
            continue
        raw = piece_bytes(tok.convert_ids_to_tokens(tid))
        assert raw is not None and raw.decode("utf-8", errors="replace") == tok.decode([tid]), tid
    assert piece_bytes("<0xE9>") == b"\xe9"  # SentencePiece byte fallback
    assert piece_bytes("<｜begin▁of▁sentence｜>") is None


def test_token_bytes_join_into_the_text(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    names = [tok.decode([t]) for t in ids]
    assert "\ufffd" in names  # the text splits characters between tokens
    raw = [token_bytes(tok, t, n) for t, n in zip(ids, names)]
    assert b"".join(raw).decode() == tok.decode(ids)
    assert all(r != "\ufffd".encode() for r in raw)
    # a whole token's bytes are its text's
    assert token_bytes(tok, ids[-1], "plain") == b"plain"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprob_bytes_join_into_the_content(tok, stream):
    script = tok.encode(TEXT, add_special_tokens=False)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": len(script),
            "logprobs": True, "top_logprobs": 2, "temperature": 0, "stream": stream}

    async def go():
        app = build_app(ScriptedEngine(tok, script), build_parser().parse_args(["--model", str(TINY_MODEL)]))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/v1/chat/completions", json=body)

    r = asyncio.run(go())
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        choices = [c["choices"][0] for c in chunks if c["choices"]]
        content = "".join(c["delta"].get("content") or "" for c in choices)
        entries = [e for c in choices if c.get("logprobs") for e in c["logprobs"]["content"]]
    else:
        choice = r.json()["choices"][0]
        content, entries = choice["message"]["content"], choice["logprobs"]["content"]
    assert content == TEXT.lstrip() or content == tok.decode(script)
    assert [e["token"] for e in entries] == [tok.decode([t]) for t in script]
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == content
    for e in entries:  # the alternatives' bytes are their own too
        for alt in e["top_logprobs"]:
            assert bytes(alt["bytes"]).decode("utf-8", errors="replace") == alt["token"]
