"""TokenMask (server/reasoning.py): which tokens a chat answer that leaves its reasoning out
(include_reasoning false) shows with their logprobs and ids. A token is left out when any of its
characters is reasoning and none is content; a tag's own tokens are shown; a token the parser
holds back (a possible "</think>") is decided once the parser decides its characters, so the
hidden reasoning cannot be read from the tokens that looked like the start of a tag."""

from __future__ import annotations

import random

import pytest

from server.reasoning import TokenMask


def decide(pieces: list[str], chunks: list[int] | None = None) -> list[bool]:
    """Decisions for tokens with these texts, fed in chunks of the given sizes (one chunk: all)."""
    mask = TokenMask(lambda i: pieces[i])
    ids, out, at = list(range(len(pieces))), [], 0
    for n in chunks or [len(pieces)]:
        out += mask.feed(ids[at:at + n], final=at + n >= len(pieces))
        at += n
    assert len(out) == len(pieces)
    return out


CASES = [
    # reasoning holding a tag-like "</p>": its tokens are reasoning, left out with the rest
    (["I close ", "</", "p", "> here", "</", "think", ">", "Done", "."],
     [False, False, False, False, True, True, True, True, True]),
    # the held "<" turns out to be reasoning; the tag's tokens and the content are shown
    (["a", "<", "b", "</think>", "ok"], [False, False, False, True, True]),
    # an output ending inside a would-be tag: all reasoning, the held tail too
    (["a", "</", "thi"], [False, False, False]),
    # a token with reasoning and the tag is left out; one with the tag and content is shown
    (["x</", "think>y"], [False, True]),
    (["x</think", ">y"], [False, True]),
    # a leading <think> (and whitespace) is a tag: shown; reasoning after it is not
    (["\n", "<think>", "r", "</think>", "c"], [True, True, False, True, True]),
    # an output that never closes the tag is reasoning only; a token without text (an id past
    # the tokenizer's vocabulary) is reasoning inside it, content after it
    (["r", "", "s"], [False, False, False]),
    (["r", "", "</think>", "", "c"], [False, False, True, True, True]),
]


@pytest.mark.parametrize("pieces,shown", CASES)
def test_tokens_are_shown_as_their_characters_are_decided(pieces, shown):
    assert decide(pieces) == shown


@pytest.mark.parametrize("pieces,shown", CASES)
def test_any_chunking_decides_the_same(pieces, shown):
    rng = random.Random(len(pieces))
    for _ in range(30):
        chunks, left = [], len(pieces)
        while left:
            chunks.append(rng.randint(0, min(3, left)) or 1)
            left -= chunks[-1]
        assert decide(pieces, chunks) == shown


def test_a_held_token_waits_for_the_parser():
    pieces = ["r", "</", "think", ">", "c"]
    mask = TokenMask(lambda i: pieces[i])
    assert mask.feed([0]) == [False]
    assert mask.feed([1]) == []  # "</" may start the end tag: undecided
    assert mask.feed([2]) == []  # "</think" still may
    assert mask.feed([3]) == [True, True, True]  # the tag: the three held tokens, shown
    assert mask.feed([4], final=True) == [True]
