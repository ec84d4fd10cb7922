"""Prompt-logprob requests on cached blocks (scheduler/logprob_records.py): a cached block filled by
a prompt-logprob request keeps its tokens' logprobs, and a later request with that prefix takes
the KV of all but the last such block and the logprobs from the records; its prompt logprobs
equal those of computing its prompt whole. Scheduler contract with tests/test_scheduler.py's fake
runner (whose prompt logprobs depend on the whole prefix), then the engine on a tiny model."""

from __future__ import annotations

import math
import random

import pytest
import torch

from common.sampling_params import SamplingParams
from engine import LLM
from scheduler.config import SchedulerConfig
from scheduler.scheduler import Scheduler
from test_scheduler import VOCAB, FakeRunner, make_req, run_all, step


def scored(sched, runner, rid, prompt, k=1):
    """Run one prompt-logprob request (one hidden token) to its end; its first output."""
    sched.add_request(make_req(rid, prompt, prompt_logprobs=k, max_tokens=1))
    got, _ = run_all(sched, runner)
    return got[rid][0]


def alone(prompt, k, block_size=4):
    """Prompt logprobs of `prompt` computed whole (prefix caching off)."""
    cfg = SchedulerConfig(max_num_batched_tokens=64, num_blocks=64, block_size=block_size,
                          enable_prefix_caching=False)
    return scored(Scheduler(cfg), FakeRunner(cfg), "x", prompt, k).prompt_logprobs


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_prompt_logprob_request_takes_cached_blocks_with_their_logprobs(async_scheduling):
    cfg = SchedulerConfig(max_num_batched_tokens=16, num_blocks=64, block_size=4, async_scheduling=async_scheduling)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    rng = random.Random(5)
    prompt = [rng.randrange(VOCAB) for _ in range(30)]
    sched.add_request(make_req("first", prompt, prompt_logprobs=2, max_tokens=1))
    first, _ = run_all(sched, runner)
    assert first["first"][0].num_cached_tokens == 0
    assert first["first"][0].prompt_logprobs == alone(prompt, 2)
    # shares tokens 0..24: blocks 0..5 are full and kept their logprobs; the KV of 0..4 is taken
    # (20 tokens) and block 5 is computed again, its first token's logprob from its record. Then
    # all 8 full blocks of `other` keep 2 alternatives: 7 are taken with 1 alternative, none with
    # 3, and a request without prompt logprobs takes all 8 (its last token is in no full block)
    other = prompt[:25] + [rng.randrange(VOCAB) for _ in range(10)]
    for rid, k, hit in (("same k", 2, 20), ("fewer alternatives", 1, 28), ("more alternatives", 3, 0),
                        ("no logprobs", None, 32)):
        sched.add_request(make_req(rid, other, prompt_logprobs=k, max_tokens=1))
        got, _ = run_all(sched, runner)
        out = got[rid][0]
        assert out.num_cached_tokens == hit, rid
        if k is not None:
            assert out.prompt_logprobs == alone(other, k), rid
    # the request that asked for 3 alternatives computed its blocks: their records now hold 3
    sched.add_request(make_req("after", other, prompt_logprobs=3, max_tokens=1))
    got, _ = run_all(sched, runner)
    assert got["after"][0].num_cached_tokens == 28 and got["after"][0].prompt_logprobs == alone(other, 3)


@pytest.mark.parametrize("budget", [7, 8, 11])
def test_a_chunk_ending_a_token_short_of_a_block_keeps_its_record(budget):
    """A chunk's logprobs reach one token past its KV: with a budget of 7 or 11 (4-token blocks)
    a chunk's logprobs complete a block that is not full yet; its record is kept once it is
    cached, so the same prompt again takes all but the last of its 7 full blocks (24 tokens)."""
    cfg = SchedulerConfig(max_num_batched_tokens=budget, num_blocks=64, block_size=4)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    prompt = list(range(200, 230))
    scored(sched, runner, "a", prompt)
    assert len(sched.block_manager.lp_records) == 7
    b = scored(sched, runner, "b", prompt)
    assert b.num_cached_tokens == 24 and b.prompt_logprobs == alone(prompt, 1)


def test_records_go_with_their_blocks():
    """A reset of the prefix cache, or the eviction of the blocks, drops the records too."""
    cfg = SchedulerConfig(max_num_batched_tokens=64, num_blocks=16, block_size=4)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    prompt = list(range(100, 130))
    scored(sched, runner, "a", prompt)
    assert len(sched.block_manager.lp_records) == 7
    sched.block_manager.reset_prefix_cache()
    assert len(sched.block_manager.lp_records) == 0
    b = scored(sched, runner, "b", prompt)
    assert b.num_cached_tokens == 0 and len(sched.block_manager.lp_records) == 7
    sched.add_request(make_req("filler", list(range(500, 563)), max_tokens=1))  # takes all 16 blocks
    run_all(sched, runner)
    assert len(sched.block_manager.lp_records) == 0
    c = scored(sched, runner, "c", prompt)
    assert c.num_cached_tokens == 0 and c.prompt_logprobs == alone(prompt, 1)


def test_a_prompt_logprob_request_waits_only_for_blocks_that_keep_logprobs():
    """Sent together, a prompt-logprob request sharing 64+ tokens that another prompt-logprob
    request computes this step waits a step and takes them from the cache; behind a request
    without prompt logprobs (whose blocks keep none) it does not wait."""
    cfg = SchedulerConfig(max_num_batched_tokens=512, num_blocks=128, block_size=16)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    rng = random.Random(2)
    shared = [rng.randrange(VOCAB) for _ in range(96)]
    reqs = {"a": shared + [1] * 4, "b": shared + [2] * 4, "plain": [7] + shared[1:] + [3] * 4,
            "c": [7] + shared[1:] + [4] * 4}
    sched.add_request(make_req("a", reqs["a"], prompt_logprobs=1, max_tokens=1))
    sched.add_request(make_req("b", reqs["b"], prompt_logprobs=1, max_tokens=1))
    sched.add_request(make_req("plain", reqs["plain"], max_tokens=1))
    sched.add_request(make_req("c", reqs["c"], prompt_logprobs=1, max_tokens=1))
    results: dict = {}
    so, _ = step(sched, runner, results)
    assert so.num_scheduled_tokens == {"a": 100, "plain": 100, "c": 100}  # b waits for a's blocks
    so, _ = step(sched, runner, results)
    assert so.num_scheduled_tokens == {"b": 100 - 80}  # 6 blocks kept logprobs: 5 taken, 1 computed again
    for rid in ("a", "b", "c"):
        assert results[rid][0].prompt_logprobs == alone(reqs[rid], 1, block_size=16), rid


def test_a_prompt_logprob_request_waits_only_for_records_of_enough_alternatives():
    """Behind a prompt-logprob request with 1 alternative, one that wants 2 does not wait (the
    records will not cover it: it would compute the blocks anyway, a step later); one that wants
    1 behind one with 2 does."""
    cfg = SchedulerConfig(max_num_batched_tokens=512, num_blocks=128, block_size=16)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    rng = random.Random(3)
    shared, other = [rng.randrange(VOCAB) for _ in range(96)], [rng.randrange(VOCAB) for _ in range(96)]
    for rid, prompt, k in (("one", shared + [1], 1), ("two", shared + [2], 2),
                           ("two'", other + [1], 2), ("one'", other + [2], 1)):
        sched.add_request(make_req(rid, prompt, prompt_logprobs=k, max_tokens=1))
    results: dict = {}
    so, _ = step(sched, runner, results)
    assert set(so.num_scheduled_tokens) == {"one", "two", "two'"}  # one' waits for two''s blocks
    so, _ = step(sched, runner, results)
    assert so.num_scheduled_tokens == {"one'": 97 - 80}  # 6 kept blocks: 5 taken, 1 computed again


def make_llm(path, **kw):
    return LLM(path, device="cpu", dtype="float32", **({"num_kv_blocks": 256, "block_size": 4} | kw))


def lm_eval_like(seed: int) -> list[list[int]]:
    """lm_eval loglikelihood requests, MMLU-like: per subject a few-shot preamble, per question its
    text, per choice the context and a short continuation."""
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(2, 320, (n,), generator=g).tolist()
    prompts = []
    for _ in range(2):  # subjects
        preamble = rand(80)
        for _ in range(3):  # questions
            question = rand(int(torch.randint(5, 14, (1,), generator=g)))
            prompts += [preamble + question + rand(int(torch.randint(1, 4, (1,), generator=g))) for _ in range(4)]
    return prompts


@pytest.mark.parametrize("kw,max_tokens", [({}, 1), ({"num_kv_blocks": 28, "max_num_batched_tokens": 32}, 12)],
                         ids=["roomy", "preempting"])
def test_engine_prompt_logprobs_with_the_cache_equal_computed_whole(tiny_v3, kw, max_tokens):
    """lm_eval's loglikelihood requests (prompt logprobs with 1 alternative, one hidden token)
    through the engine with prefix caching: the same prompt logprobs as with it off (each prompt
    computed whole), with most of the prompt tokens taken from the cache; in a pool too small for
    them all (decoding 12 tokens each), requests are preempted and take their hits again."""
    prompts = lm_eval_like(11)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=1, ignore_eos=True)
    cached_llm = make_llm(tiny_v3[0], **kw)
    got = cached_llm.generate(prompts, params)
    want = make_llm(tiny_v3[0], enable_prefix_caching=False).generate(prompts, params)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.prompt_logprobs[0] is None is w.prompt_logprobs[0]
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs) == len(g.prompt_token_ids)
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert (a.token_id, a.rank, [t for t, _ in a.top]) == (b.token_id, b.rank, [t for t, _ in b.top])
            assert math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
    hits = sum(o.num_cached_tokens for o in got)
    assert hits >= 0.7 * sum(len(p) for p in prompts), hits  # the preambles, and each question's context
    if max_tokens > 1:
        assert cached_llm.scheduler.stats.num_preemptions > 0
