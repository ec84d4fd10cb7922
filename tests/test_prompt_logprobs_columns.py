"""PromptLogprobs (scheduler/prompt_logprobs.py): prompt logprobs as columns behave as the list of
TokenLogprobs they stand for, and the completions response read from the columns equals the one
built entry by entry."""

from __future__ import annotations

import math
import pickle
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.logprobs import gather_logprobs
from engine.outputs import CompletionOutput, RequestOutput
from scheduler.outputs import TokenLogprobs
from scheduler.prompt_logprobs import PromptLogprobs
from server.completions import CompletionBuilder


def entries(n: int, width: int, first: bool = True, seed: int = 0) -> list[TokenLogprobs | None]:
    r = random.Random(seed)
    real = [TokenLogprobs(r.randrange(50), -r.random() * 5, r.randrange(1, 9),
                          [(r.randrange(50), -r.random() * 3) for _ in range(width)]) for _ in range(n)]
    real = [TokenLogprobs(e.token_id, float(np.float32(e.logprob)), e.rank,
                          [(t, float(np.float32(v))) for t, v in e.top]) for e in real]  # float32 values
    return ([None] if first else []) + real


@pytest.mark.parametrize("width", [0, 1, 3])
def test_columns_stand_for_their_entries(width):
    ents = entries(20, width)
    p = PromptLogprobs.from_entries(ents)
    assert len(p) == 21 and list(p) == ents and p == ents and p[0] is None and p[-1] == ents[-1]
    assert p[1:] == ents[1:] and not p[1:].first and p[:4] == ents[:4] and p[5:9] == ents[5:9]
    assert pickle.loads(pickle.dumps(p)) == ents
    assert PromptLogprobs.concat([p[:7], p[7:12], p[12:]]) == ents
    assert p[:3] + ents[3:] == ents  # a list extends the columns
    if width:
        cut = p.slice(0, 21, width=1)
        assert [e.top for e in cut[1:]] == [e.top[:1] for e in ents[1:]]
    assert p.compact() == ents and p.compact().token_ids.dtype == np.int32
    assert len(p[:0]) == 0 and p[:0] == [] and p[3:3] == [] and p[:1] == [None]
    assert p.num_alternatives() == sum(len(e.top) for e in ents[1:])
    with pytest.raises(ValueError, match="only the first run"):
        PromptLogprobs.concat([p[2:], p])


def test_a_responses_size_counts_the_columns_alternatives():
    """The server's size estimate (which builds big answers off the event loop) reads a
    PromptLogprobs's alternatives without walking its entries, and equals the count over them."""
    from server.handler import _entries
    ents = entries(40, 2)
    gen = CompletionOutput(0, "x", [7], [TokenLogprobs(7, -0.5, 1, [(7, -0.5), (8, -1.5)])], "length")
    as_columns, as_list = (RequestOutput("r", None, [1] * 41, [gen], plps, finished=True)
                           for plps in (PromptLogprobs.from_entries(ents), ents))
    assert _entries([as_columns]) == _entries([as_list]) == 41 + 80 + 1 + 2


def test_device_rows_become_columns_without_objects():
    """The runner's rows (gather_logprobs over log_softmax) as a run: equal to their entries."""
    torch.manual_seed(0)
    lps = torch.log_softmax(torch.randn(9, 40), dim=-1)
    rows = gather_logprobs(lps, torch.randint(0, 40, (9,)), 2)
    run = rows.prompt_run(first=True)
    assert run == [None] + list(rows)
    assert gather_logprobs(lps, torch.randint(0, 40, (9,)), 0).prompt_run(first=False).width == 0


def _builder(k: int, echo: bool = True) -> CompletionBuilder:
    words = {i: f"w{i % 7}" for i in range(60)}  # repeated strings: the first of equal strings wins
    state = SimpleNamespace(token_str=lambda t: words[t], tokenizer=None,
                            frontend=SimpleNamespace(as_token_ids=lambda req: False))
    req = SimpleNamespace(logprobs=k, echo=echo, prompt_logprobs=None, max_tokens=1, return_token_ids=False, n=1)
    return CompletionBuilder(state, req)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_completion_logprobs_from_columns_equal_entry_by_entry(k):
    ents = entries(30, 3, seed=k)
    ents[5] = TokenLogprobs(ents[5].token_id, -math.inf, 9, [(1, math.nan), (2, -math.inf), (3, -1.0)])
    ids = [ents[1].token_id] + [e.token_id for e in ents[1:]]
    gen = CompletionOutput(0, "x", [7], [TokenLogprobs(7, -0.5, 1, [(7, -0.5), (8, -1.5), (9, -2.0)])], "length")

    def out(plps):
        return RequestOutput("r", None, ids, [gen], plps, finished=True)
    b = _builder(k)
    fast = b.logprobs([(7, gen.logprobs[0])], 3, out(PromptLogprobs.from_entries(ents)))
    slow = b.logprobs(list(zip(ids, ents)) + [(7, gen.logprobs[0])], 3)
    assert fast == slow
    assert fast["token_logprobs"][5] == -9999.0 and len(fast["tokens"]) == 32
    assert list(fast["top_logprobs"][5]) == list(slow["top_logprobs"][5])  # the same key order
