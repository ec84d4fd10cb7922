"""OutputProcessor: per-step outputs carry only the news; the final one carries everything."""

from __future__ import annotations

import pytest
import transformers

from engine.output_processor import OutputProcessor
from common.sampling_params import SamplingParams
from scheduler.outputs import EngineCoreOutput, TokenLogprobs
from tests.server_fixtures import TINY_MODEL


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(TINY_MODEL)


def _lp(t: int) -> TokenLogprobs:
    return TokenLogprobs(t, -0.1 * t, 1, [(t, -0.1 * t)])


@pytest.mark.parametrize("with_tokenizer", [True, False])
def test_outputs_are_deltas_and_the_final_one_is_whole(tokenizer, with_tokenizer):
    tok = tokenizer if with_tokenizer else None
    proc = OutputProcessor(tok)
    params = SamplingParams(max_tokens=8, n=2, logprobs=1, seed=3)
    children = proc.add_request("r", None, [10, 11, 12], params)
    steps = [[20, 21], [22], [], [23, 24, 25]]
    seen = {0: [], 1: []}
    texts = {0: "", 1: ""}
    lps = {0: [], 1: []}
    outs = []
    for k, new in enumerate(steps):
        last = k == len(steps) - 1
        batch = [EngineCoreOutput(cid, list(new) if i == 0 or k % 2 else [],
                                  [_lp(t) for t in new] if i == 0 or k % 2 else [],
                                  finish_reason="length" if last else None)
                 for i, (cid, _) in enumerate(children)]
        results, to_abort = proc.process(batch)
        assert to_abort == [] and len(results) == 1
        out = results[0]
        outs.append(out)
        assert out.finished == last
        for c in out.outputs:
            seen[c.index] += c.delta_token_ids
            texts[c.index] += c.delta_text
            lps[c.index] += c.delta_logprobs
            if not last:  # intermediate outputs carry no cumulative copies
                assert c.token_ids == [] and c.text == "" and c.logprobs is None
    final = outs[-1]
    for c in final.outputs:
        assert c.token_ids == seen[c.index] and c.logprobs == lps[c.index]
        assert [lp.token_id for lp in c.logprobs] == c.token_ids
        assert c.text == texts[c.index]
        if with_tokenizer:
            assert c.text == tokenizer.decode(c.token_ids, clean_up_tokenization_spaces=False)
        else:
            assert c.text == ""
    assert final.outputs[0].token_ids == [20, 21, 22, 23, 24, 25]
    assert final.outputs[1].token_ids == [22, 23, 24, 25]
    assert proc.child_ids("r") == []  # a finished request is forgotten


def test_abort_returns_the_whole_output():
    proc = OutputProcessor(None)
    (cid, _), = proc.add_request("r", None, [1, 2], SamplingParams(max_tokens=8))
    proc.process([EngineCoreOutput(cid, [5])])
    proc.process([EngineCoreOutput(cid, [6])])
    out = proc.abort("r")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert out.outputs[0].token_ids == [5, 6] and out.outputs[0].delta_token_ids == []


def test_several_tokens_in_one_step_end_at_the_stop_string(tokenizer):
    """A step that delivers several tokens (speculative decoding) ends the output at the token
    that completes a stop string, as delivering them one by one would: later ids, their
    logprobs and text are dropped, and the request is aborted in the engine."""
    ids = tokenizer("Answer: 7 + 3 = 10 #### 10", add_special_tokens=False)["input_ids"]
    stop_at = next(j for j in range(len(ids)) if "####" in tokenizer.decode(ids[: j + 1]))
    assert stop_at < len(ids) - 1  # tokens follow the stop string
    results = {}
    for split in ("one_by_one", "one_step"):
        proc = OutputProcessor(tokenizer)
        ((cid, _),) = proc.add_request("r", None, [10, 11], SamplingParams(max_tokens=50, stop=["####"],
                                                                          logprobs=0))
        steps = [[t] for t in ids] if split == "one_by_one" else [ids]
        aborted = []
        for new in steps:
            outs, to_abort = proc.process([EngineCoreOutput(cid, list(new), [_lp(t) for t in new])])
            aborted += to_abort
            if outs and outs[0].finished:
                results[split] = outs[0].outputs[0]
                break
        assert aborted == [cid]
    a, b = results["one_by_one"], results["one_step"]
    assert b.token_ids == a.token_ids == ids[: stop_at + 1]
    assert b.text == a.text and b.logprobs == a.logprobs and b.stop_reason == "####"
