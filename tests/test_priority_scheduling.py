"""--scheduling-policy priority (vLLM's): waiting requests start in (priority, arrival) order, the
running request last in that order is preempted first (its tokens taken back if it was already
scheduled in the step), and the outputs are those of fcfs; fcfs refuses a non-zero priority."""

from __future__ import annotations

import random

import pytest

from scheduler.config import SchedulerConfig
from scheduler.scheduler import Scheduler
from test_scheduler import VOCAB, FakeRunner, make_req, reference_tokens, run_all, step, tokens_of


def test_waiting_requests_start_in_priority_order():
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=1, num_blocks=64, block_size=4,
                          scheduling_policy="priority")
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    for rid, priority in (("a", 5), ("b", 0), ("c", 3), ("d", 0), ("e", -2)):
        sched.add_request(make_req(rid, [len(rid), 7, 9], max_tokens=2, priority=priority))
    started = []
    while sched.has_unfinished_requests():
        so, _ = step(sched, runner)
        started += [r.req_id for r in so.scheduled_new_reqs]
    assert started == ["e", "b", "d", "c", "a"]


def test_the_lowest_priority_is_preempted_and_its_scheduled_tokens_taken_back():
    """`low` was admitted first and is scheduled first in the step; `high` then needs a block the
    pool does not have: under priority `low` is the victim (fcfs would take `high`, the newest),
    its token in this step is taken back, and `high` runs."""
    cfg = SchedulerConfig(max_num_batched_tokens=64, num_blocks=3, block_size=4,
                          enable_prefix_caching=False, scheduling_policy="priority")
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    low_p, high_p = [11, 12, 13, 14, 15, 16], [21, 22, 23, 24]
    results: dict = {}
    sched.add_request(make_req("low", low_p, max_tokens=6, priority=10))
    step(sched, runner, results)  # low's prefill: 2 of the 3 blocks
    sched.add_request(make_req("high", high_p, max_tokens=6, priority=0))
    so, _ = step(sched, runner, results)  # low decodes in its own block; high's prefill takes the third
    assert so.num_scheduled_tokens == {"low": 1, "high": 4}
    so, _ = step(sched, runner, results)  # high needs a fourth block
    assert so.num_scheduled_tokens == {"high": 1} and "low" in so.finished_req_ids
    assert [r.request_id for r in sched.waiting] == ["low"] and sched.stats.num_preemptions == 1
    while sched.has_unfinished_requests():
        step(sched, runner, results)
    assert tokens_of(results["low"]) == reference_tokens(low_p, 6)
    assert tokens_of(results["high"]) == reference_tokens(high_p, 6)
    assert sched.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_outputs_are_unchanged_under_preemption(policy):
    cfg = SchedulerConfig(max_num_batched_tokens=32, num_blocks=12, block_size=4, scheduling_policy=policy)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    rng = random.Random(3)
    prompts = {f"r{i}": [rng.randrange(VOCAB) for _ in range(rng.randint(5, 15))] for i in range(8)}
    for rid, p in prompts.items():
        priority = rng.randint(-3, 3) if policy == "priority" else 0
        sched.add_request(make_req(rid, p, max_tokens=20, priority=priority))
    results, _ = run_all(sched, runner)
    assert sched.stats.num_preemptions > 0
    for rid, p in prompts.items():
        assert tokens_of(results[rid]) == reference_tokens(p, 20), rid
    assert sched.block_manager.num_used_blocks == 0


def test_fcfs_refuses_a_priority():
    sched = Scheduler(SchedulerConfig(num_blocks=16, block_size=4))
    with pytest.raises(ValueError, match="priority: 1 needs --scheduling-policy priority"):
        sched.add_request(make_req("a", [1, 2, 3], priority=1))
    sched.add_request(make_req("b", [1, 2, 3], priority=0))
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(scheduling_policy="lifo")


def test_the_server_names_the_flag_a_priority_needs():
    import httpx

    from tests.server_fixtures import assert_error, tiny_engine_server
    with tiny_engine_server() as s:
        for route, body in (("/v1/completions", {"prompt": "hi"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            r = httpx.post(f"{s.url}{route}", json={**body, "model": s.model, "max_tokens": 2, "priority": 2},
                           timeout=60)
            assert "--scheduling-policy priority" in assert_error(r, 400, "priority")["message"]
            r = httpx.post(f"{s.url}{route}", json={**body, "model": s.model, "max_tokens": 2, "priority": 0},
                           timeout=60)
            assert r.status_code == 200, r.text


def test_offline_priorities_keep_outputs():
    from engine import LLM, SamplingParams
    from tests.server_fixtures import TINY_MODEL
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    outs = {}
    for policy in ("fcfs", "priority"):
        llm = LLM(model=str(TINY_MODEL), device="cpu", dtype="float32", num_kv_blocks=64, max_num_seqs=1,
                  scheduling_policy=policy)
        params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                 priority=p if policy == "priority" else 0) for p in (3, -1, 0)]
        outs[policy] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if policy == "fcfs":
            with pytest.raises(ValueError, match="--scheduling-policy priority"):
                llm.generate(prompts[:1], SamplingParams(max_tokens=2, priority=1))
            assert not llm.engine.scheduler.has_unfinished_requests()
    assert outs["fcfs"] == outs["priority"]
