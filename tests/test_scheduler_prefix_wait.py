"""The scheduler's wait for prompt blocks another request is computing (`PrefixReuse.waits`):
a prompt whose next 64+ tokens are blocks computed in this step or the one in flight waits for
them to be cached; the fake runner of tests/test_scheduler.py checks every step's KV."""

from __future__ import annotations

import random

import pytest

from common.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from test_scheduler import VOCAB, FakeRunner, make_req, reference_tokens, run_all, step, tokens_of


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompts_sharing_blocks_computed_this_step_wait_for_them(async_scheduling):
    """A prompt whose next 64+ tokens past its cache hit are blocks another request computes this
    step (or in the step in flight) waits until they are cached instead of computing them too;
    one sharing fewer, or wanting prompt logprobs (no cache), is admitted at once; the outputs
    are those of a model run alone."""
    cfg = SchedulerConfig(max_num_batched_tokens=512, num_blocks=128, block_size=16, async_scheduling=async_scheduling)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    rng = random.Random(1)
    prompt = [rng.randrange(VOCAB) for _ in range(100)]  # 6 full blocks
    reqs = {"a": prompt, "b": prompt[:99] + [7], "short": prompt[:40] + [8] * 30,
            "scored": prompt[:99] + [9]}
    sched.add_request(make_req("a", reqs["a"], max_tokens=3))
    sched.add_request(make_req("b", reqs["b"], max_tokens=3))
    sched.add_request(make_req("short", reqs["short"], max_tokens=3))  # shares 2 blocks: 32 tokens
    sched.add_request(Request("scored", reqs["scored"], SamplingParams(max_tokens=3, prompt_logprobs=0), None))
    results: dict = {}

    def finish(so, out):
        for o in sched.update_from_output(so, out):
            results.setdefault(o.req_id, []).append(o)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 100, "short": 70, "scored": 100}
    assert [r.request_id for r in sched.waiting] == ["b"]
    out = runner.execute(so)
    if async_scheduling:  # the next step is scheduled with this one in flight: a's blocks not cached yet
        so2 = sched.schedule()
        assert "b" not in so2.num_scheduled_tokens
        finish(so, out)
        so, out = so2, runner.execute(so2)
    finish(so, out)
    so, _ = step(sched, runner, results)
    assert so.num_scheduled_tokens["b"] == 4  # its 6 blocks found cached
    rest, _ = run_all(sched, runner)
    for rid, prompt in reqs.items():
        assert tokens_of(results.get(rid, []) + rest.get(rid, [])) == reference_tokens(prompt, 3), rid


def test_the_wait_scan_stops_after_max_num_seqs_deferrals():
    """Behind a crowd waiting for one prefix the scan of the queue stops after max_num_seqs of
    them (its host time bounded); the request after them is admitted a step later."""
    cfg = SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=3, num_blocks=128, block_size=16)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    prompt = [random.Random(2).randrange(VOCAB) for _ in range(100)]
    for i in range(4):
        sched.add_request(make_req(f"s{i}", prompt[:99] + [i], max_tokens=2))
    sched.add_request(make_req("other", list(range(5, 30)), max_tokens=2))
    so, _ = step(sched, runner)
    assert list(so.num_scheduled_tokens) == ["s0"]  # s1..s3 wait for its blocks; the scan stops there
    so, _ = step(sched, runner)
    assert set(so.num_scheduled_tokens) == {"s0", "s1", "s2"}  # s1, s2 hit; max_num_seqs 3 reached
    results, _ = run_all(sched, runner)
    assert tokens_of(results["other"])
