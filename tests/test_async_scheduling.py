"""Async scheduling (step N+1 scheduled and launched before step N's tokens are back): the same
outputs as the synchronous loop under every schedule, and real pipelining."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from common.sampling_params import SamplingParams as SP
from scheduler.config import SchedulerConfig
from scheduler.outputs import ModelRunnerOutput
from scheduler.request import Request
from scheduler.scheduler import Scheduler

LENS = (5, 17, 33, 64, 3, 40, 12, 50)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 320, (n,), generator=g).tolist() for n in LENS]


def _llm(path, async_scheduling, **kw):
    return LLM(path, device="cpu", dtype="float32", async_scheduling=async_scheduling,
               **({"num_kv_blocks": 256} | kw))


def _outs(llm, prompts, params):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
            for o in llm.generate(prompts, params)]


SCHEDULES = [{}, {"max_num_batched_tokens": 8}, {"max_num_seqs": 2},
             {"num_kv_blocks": 22, "block_size": 4}]  # the last one preempts


def test_async_scheduling_auto_is_off_on_cpu(tiny_v3):
    """The default (None) turns overlap on only where the model runs on a GPU: on the CPU the
    host computes the model itself, so there is nothing to overlap with."""
    assert not LLM(tiny_v3[0], device="cpu", dtype="float32", num_kv_blocks=64).engine.async_scheduling


@pytest.mark.parametrize("kw", SCHEDULES, ids=["default", "budget8", "seqs2", "preempting"])
def test_async_greedy_equals_sync(tiny_v3, prompts, kw):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = _outs(_llm(tiny_v3[0], False, **kw), prompts, params)
    llm = _llm(tiny_v3[0], True, **kw)
    assert llm.engine.async_scheduling
    assert _outs(llm, prompts, params) == ref
    s = llm.scheduler.stats
    assert s.num_free_blocks == s.num_total_blocks
    if "num_kv_blocks" in kw:
        assert s.num_preemptions > 0


def test_async_seeded_sampling_equals_sync_under_preemption(tiny_v3, prompts):
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=12, ignore_eos=True)
              for i in range(len(prompts))]
    kw = {"num_kv_blocks": 22, "block_size": 4}
    ref = _outs(_llm(tiny_v3[0], False, **kw), prompts, params)
    llm = _llm(tiny_v3[0], True, **kw)
    assert _outs(llm, prompts, params) == ref
    assert llm.scheduler.stats.num_preemptions > 0


def test_async_stops_exactly_where_sync_does(tiny_v3, prompts):
    """max_tokens of 1 and 2 (the token in flight ends it), stop tokens met mid-stream, and
    max_model_len: the extra step already launched must add nothing."""
    base = _outs(_llm(tiny_v3[0], False), prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    params = []
    for i, (toks, _, _) in enumerate(base):
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=1 + i % 2, ignore_eos=True))
        else:  # stop on the token sampled at step 3 + i % 4
            params.append(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                         stop_token_ids=[toks[3 + i % 4]]))
    for kw in ({}, {"max_model_len": 70}):
        ref = _outs(_llm(tiny_v3[0], False, **kw), prompts, params)
        got = _outs(_llm(tiny_v3[0], True, **kw), prompts, params)
        assert got == ref
        assert {r[1] for r in ref} == {"length", "stop"}


def test_async_penalties_min_tokens_and_logprobs_equal_sync(tiny_v3, prompts):
    """Penalties and min_tokens read the output history: the engine waits for the step in flight
    first. Logprobs come back with their step."""
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, presence_penalty=1.5,
                             frequency_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=10, min_tokens=6, stop_token_ids=[7, 9, 11]),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3)] * 2

    def run(flag):
        outs = _llm(tiny_v3[0], flag).generate(prompts, params)
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason,
                 [(lp.token_id, round(lp.logprob, 5), lp.rank, [t for t, _ in lp.top])
                  for lp in (o.outputs[0].logprobs or [])]) for o in outs]

    assert run(True) == run(False)


def test_async_step_keeps_one_step_in_flight(tiny_v3, prompts):
    """The first step launches and reports nothing; later steps report the step before."""
    llm = _llm(tiny_v3[0], True)
    core = llm.engine
    for i, p in enumerate(prompts[:3]):
        core.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert core.step() == [] and core._in_flight is not None
    seen = {}
    while core.has_unfinished_requests():
        for o in core.step():
            seen.setdefault(o.req_id, []).extend(o.new_token_ids)
    assert core._in_flight is None  # drained once every request had ended
    assert sorted(len(v) for v in seen.values()) == [4, 4, 4]


def test_scheduler_output_placeholders():
    """A request that samples holds a placeholder until its token arrives; a token in flight that
    must end the request (max_tokens) stops further scheduling; preemption drops placeholders."""
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, num_blocks=16, block_size=4,
                                  async_scheduling=True))
    s.add_request(Request("a", [1, 2, 3, 4, 5], SP(temperature=0, max_tokens=2, ignore_eos=True), None))
    so1 = s.schedule()
    a = s.requests["a"]
    assert so1.num_scheduled_tokens == {"a": 5} and a.num_output_placeholders == 1
    so2 = s.schedule()  # before step 1's token is back: decode the placeholder
    assert so2.num_scheduled_tokens == {"a": 1} and a.num_output_placeholders == 2
    assert s.schedule().is_empty  # max_tokens 2 is reached by the two tokens in flight
    s.update_from_output(so1, ModelRunnerOutput(["a"], [42], [None]))
    assert a.output_token_ids == [42] and a.num_output_placeholders == 1
    out = s.update_from_output(so2, ModelRunnerOutput(["a"], [43], [None]))
    assert out[0].finish_reason == "length" and "a" not in s.requests
    assert s.block_manager.num_free_blocks == 16

    s.add_request(Request("b", [1, 2, 3], SP(temperature=0, max_tokens=9, ignore_eos=True), None))
    s.schedule()
    b = s.requests["b"]
    s._preempt(b)
    assert b.num_output_placeholders == 0 and b.num_computed_tokens == 0


def test_async_prompt_logprobs_survive_preemption(tiny_v3, prompts):
    """A request preempted while its prefill chunk is in flight reports its prompt logprobs once,
    from the start (the chunk in flight must not be kept)."""
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                             prompt_logprobs=1 if i % 2 else None) for i in range(len(prompts))]
    kw = dict(num_kv_blocks=22, block_size=4, max_num_batched_tokens=8)

    def run(flag):
        llm = _llm(tiny_v3[0], flag, **kw)
        outs = llm.generate(prompts, params)
        assert llm.scheduler.stats.num_preemptions > 0
        return [None if o.prompt_logprobs is None else
                [None if lp is None else (lp.token_id, round(lp.logprob, 3)) for lp in o.prompt_logprobs]
                for o in outs]

    got, ref = run(True), run(False)
    assert [None if g is None else len(g) for g in got] == [None if i % 2 == 0 else n for i, n in enumerate(LENS)]
    assert got == ref


def test_async_request_id_reused_while_its_last_step_is_in_flight(tiny_v3):
    """A request ends (stop token) with one more step already launched; a new request under the
    same id must not receive that step's token."""
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = _llm(tiny_v3[0], False).generate([[100, 101, 102]], greedy)[0].outputs[0].token_ids
    probe = _llm(tiny_v3[0], False).generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=4,
                                                                          ignore_eos=True))
    stop_tok = probe[0].outputs[0].token_ids[1]
    core = _llm(tiny_v3[0], True).engine
    core.add_request("y", list(range(20, 40)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    core.add_request("x", [7, 8, 9], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                    stop_token_ids=[stop_tok]))
    got, reused = {}, False
    while core.has_unfinished_requests():
        for o in core.step():
            got.setdefault(o.req_id, []).extend(o.new_token_ids)
            if o.req_id == "x" and o.finished and not reused:
                assert o.finish_reason == "stop"
                core.add_request("x", [100, 101, 102], greedy)
                reused, got["x"] = True, []
    assert reused and got["x"] == alone


@pytest.mark.parametrize("tp,dcp", [(2, 1), (2, 2)])
def test_async_tp_and_dcp_equal_sync(tiny_v3, prompts, tp, dcp):
    """Worker processes (gloo) launch step N+1 before they are asked to finish step N; chunked
    prefills, a pool small enough to preempt, stop tokens and logprobs."""
    base = _outs(_llm(tiny_v3[0], False), prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2 if i % 2 else None,
                             stop_token_ids=[base[i][0][4]] if i % 3 == 0 else None)
              for i in range(len(prompts))]
    kw = dict(tensor_parallel_size=tp, decode_context_parallel_size=dcp, max_num_batched_tokens=16,
              block_size=4, num_kv_blocks=28 // dcp)

    def run(flag):
        llm = _llm(tiny_v3[0], flag, **kw)
        try:
            outs = llm.generate(prompts, params)
            assert llm.scheduler.stats.num_preemptions > 0
            return [(o.outputs[0].token_ids, o.outputs[0].finish_reason,
                     [(lp.token_id, lp.logprob) for lp in (o.outputs[0].logprobs or [])]) for o in outs]
        finally:
            llm.engine.shutdown()

    # Tokens and finish reasons exactly; logprobs to fp32 summation order (the two runs batch
    # rows differently, and rounding both to 4 decimals fails whenever a value straddles a digit).
    got, want = run(True), run(False)
    assert [(ids, fr, [t for t, _ in lps]) for ids, fr, lps in got] == \
        [(ids, fr, [t for t, _ in lps]) for ids, fr, lps in want]
    for (_, _, a), (_, _, b) in zip(got, want):
        assert all(abs(x - y) <= 1e-4 for (_, x), (_, y) in zip(a, b)), (a, b)


def test_priority_preempts_a_request_whose_last_token_is_in_flight(tiny_v3):
    """Priority scheduling under async scheduling: the victim may be a running request skipped this
    step because its in-flight token ends it (nothing of it scheduled yet). Preempting it (the
    token dropped and recomputed) must not fail, and both requests end as they do alone."""
    kw = dict(device="cpu", dtype="float32", block_size=1, num_kv_blocks=12, max_num_batched_tokens=4,
              scheduling_policy="priority", enable_prefix_caching=False)
    a = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, priority=5)
    b = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, priority=0)
    alone = LLM(tiny_v3[0], **kw, async_scheduling=False)
    want = [alone.generate([[5, 6, 7]], a)[0].outputs[0].token_ids,
            alone.generate([list(range(10, 20))], b)[0].outputs[0].token_ids]
    core = LLM(tiny_v3[0], **kw, async_scheduling=True).engine
    core.add_request("A", [5, 6, 7], a)
    got, preempted = {}, 0
    for step in range(40):
        if step == 1:  # A's first token is in flight; B needs blocks A holds
            core.add_request("B", list(range(10, 20)), b)
        for out in core.step():
            got.setdefault(out.req_id, []).extend(out.new_token_ids)
        preempted = max(preempted, core.scheduler.stats.num_preemptions)
        if step > 1 and not core.has_unfinished_requests():
            break
    assert preempted >= 1 and not core.has_unfinished_requests()
    assert [got["A"], got["B"]] == want
