"""Scheduler contract with a fake runner on CPU: budgets, chunking, preemption, prefix caching, stops.

The fake runner keeps its own per-request state from the diffs only (as the real one must), checks
that they are consistent, and keeps a fake KV pool of token ids per slot: every step it checks that
the context it "attends to" holds exactly the request's earlier tokens (so a prefix hit or a resumed
request reads correct KV) and that it never writes a block another live request holds.
"""

from __future__ import annotations

import random

import pytest

from common.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler
from test_block_manager import check_invariants

VOCAB = 1000


def next_token(tokens: list[int]) -> int:
    """Deterministic 'greedy model': the next token depends on the whole sequence."""
    return (sum(tokens) * 31 + len(tokens) * 7 + tokens[-1]) % VOCAB + 3


def fake_prompt_logprob(prefix: list[int], k: int) -> TokenLogprobs:
    """Deterministic 'logprob' of prefix[-1] given the tokens before it, with k alternatives."""
    h = sum(t * (i + 1) for i, t in enumerate(prefix))
    top = [((next_token(prefix[:-1]) + t) % VOCAB, -0.25 * t - (h % 7) / 8) for t in range(k)]
    return TokenLogprobs(prefix[-1], -(h % 997) / 64, 1 + h % 5, top)


class FakeRunner:
    """Turns a SchedulerOutput into a ModelRunnerOutput using only the diffs it is given."""

    def __init__(self, config: SchedulerConfig, script: dict[str, list[int]] | None = None):
        self.vbs = config.virtual_block_size
        self.kv: dict[int, list[int | None]] = {}  # block id -> token id written in each slot
        self.reqs: dict[str, dict] = {}
        self.script = script or {}  # req_id -> tokens to emit instead of next_token

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        for req_id in so.finished_req_ids:
            self.reqs.pop(req_id, None)
        for nr in so.scheduled_new_reqs:
            assert nr.req_id not in self.reqs
            self.reqs[nr.req_id] = dict(tokens=nr.prompt_token_ids + nr.output_token_ids,
                                        num_prompt=len(nr.prompt_token_ids), blocks=list(nr.block_ids),
                                        computed=nr.num_computed_tokens, sp=nr.sampling_params,
                                        num_out=len(nr.output_token_ids))
        for cr in so.scheduled_cached_reqs:
            st = self.reqs[cr.req_id]
            assert cr.num_computed_tokens == st["computed"], "num_computed_tokens diff out of sync"
            st["blocks"] += cr.new_block_ids
        assert {r.req_id for r in so.scheduled_new_reqs} | {r.req_id for r in so.scheduled_cached_reqs} \
            == set(so.num_scheduled_tokens)
        written = set()
        out = ModelRunnerOutput([], [], [], {})
        for req_id, n in so.num_scheduled_tokens.items():
            st = self.reqs[req_id]
            start, tokens, blocks = st["computed"], st["tokens"], st["blocks"]
            assert n >= 1 and start + n <= len(tokens)
            assert len(blocks) * self.vbs >= start + n, "not enough blocks for the scheduled tokens"
            for p in range(start):  # the context this step attends to
                assert self.kv[blocks[p // self.vbs]][p % self.vbs] == tokens[p], (req_id, p)
            for p in range(start, start + n):
                b = blocks[p // self.vbs]
                others = [r for r, o in self.reqs.items() if r != req_id and b in o["blocks"]]
                assert not others, f"{req_id} writes block {b} shared with {others}"
                self.kv.setdefault(b, [None] * self.vbs)[p % self.vbs] = tokens[p]
                written.add(b)
            st["computed"] = start + n
            sp = st["sp"]
            if sp.prompt_logprobs is not None and start < st["num_prompt"]:
                # as the real runner: positions start .. start + n - 1 predict prompt tokens
                # start + 1 .. (the prompt's last at most), after a None for token 0
                last = min(start + n, st["num_prompt"] - 1)
                out.prompt_logprobs[req_id] = ([None] if start == 0 else []) + [
                    fake_prompt_logprob(tokens[:j + 1], sp.prompt_logprobs) for j in range(start + 1, last + 1)]
            if start + n == len(tokens):
                script = self.script.get(req_id)
                tok = script[st["num_out"]] if script else next_token(tokens)
                st["num_out"] += 1
                tokens.append(tok)
                out.req_ids.append(req_id)
                out.sampled_token_ids.append(tok)
                out.logprobs.append(None if sp.logprobs is None else TokenLogprobs(tok, -0.5, 1, []))
        return out


def make_req(req_id, prompt, eos=None, **sp) -> Request:
    sp.setdefault("max_tokens", 8)
    return Request(req_id, list(prompt), SamplingParams(**sp), eos_token_id=eos)


def step(sched: Scheduler, runner: FakeRunner, results: dict | None = None):
    so = sched.schedule()
    outs = sched.update_from_output(so, runner.execute(so))
    check_invariants(sched.block_manager)
    bm = sched.block_manager
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_total_blocks
    if results is not None:
        for o in outs:
            results.setdefault(o.req_id, []).append(o)
    return so, outs


def run_all(sched, runner, max_steps=10_000):
    results: dict = {}
    steps = 0
    while sched.has_unfinished_requests():
        step(sched, runner, results)
        steps += 1
        assert steps < max_steps, "scheduler hangs"
    return results, steps


def tokens_of(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def reference_tokens(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


def test_long_prompt_chunked_under_budget():
    cfg = SchedulerConfig(max_num_batched_tokens=64, num_blocks=128, block_size=16)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    prompt = [random.Random(0).randrange(VOCAB) for _ in range(1000)]
    sched.add_request(make_req("a", prompt, max_tokens=3))
    chunks = []
    for _ in range(16):
        so, outs = step(sched, runner)
        assert so.total_num_scheduled_tokens <= 64
        chunks.append(so.num_scheduled_tokens["a"])
        assert (outs != []) == (len(chunks) == 16)  # a token only after the last chunk
    assert chunks == [64] * 15 + [40]
    results, _ = run_all(sched, runner)
    assert tokens_of(outs) + tokens_of(results["a"]) == reference_tokens(prompt, 3)


def test_long_prefill_token_threshold_lets_short_prompts_in():
    """long_prefill_token_threshold (vLLM's): a long prompt takes at most that many tokens a step,
    so a short prompt behind it starts in the first step instead of waiting for the whole prefill;
    the outputs are the same as without it."""
    rng = random.Random(1)
    long_p, short_p = [rng.randrange(VOCAB) for _ in range(200)], [rng.randrange(VOCAB) for _ in range(5)]
    outputs = {}
    for threshold in (0, 48):
        cfg = SchedulerConfig(max_num_batched_tokens=64, num_blocks=128, block_size=16,
                              long_prefill_token_threshold=threshold)
        sched, runner = Scheduler(cfg), FakeRunner(cfg)
        sched.add_request(make_req("long", long_p, max_tokens=4))
        sched.add_request(make_req("short", short_p, max_tokens=4))
        results: dict = {}
        so, _ = step(sched, runner, results)
        first = dict(so.num_scheduled_tokens)
        while sched.has_unfinished_requests():
            step(sched, runner, results)
        outputs[threshold] = {r: tokens_of(o) for r, o in results.items()}
        if threshold:
            assert first == {"long": 48, "short": 5}
        else:
            assert first == {"long": 64}
    for threshold in (0, 48):
        assert outputs[threshold] == {"long": reference_tokens(long_p, 4), "short": reference_tokens(short_p, 4)}
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=-1)


def test_running_decode_not_starved_and_budget_kept():
    cfg = SchedulerConfig(max_num_batched_tokens=64, num_blocks=512, block_size=16, max_model_len=4096)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    sched.add_request(make_req("dec", [1, 2, 3], max_tokens=60))
    step(sched, runner)  # prefill
    for i in range(40):
        sched.add_request(make_req(f"p{i}a", range(i, i + 100), max_tokens=2))
        sched.add_request(make_req(f"p{i}b", range(i, i + 50), max_tokens=2))
        so, _ = step(sched, runner)
        assert so.num_scheduled_tokens.get("dec") == 1, f"decode starved at step {i}"
        assert so.total_num_scheduled_tokens <= 64


def test_max_num_seqs_respected():
    cfg = SchedulerConfig(max_num_batched_tokens=1000, max_num_seqs=3, num_blocks=256, block_size=4)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    for i in range(10):
        sched.add_request(make_req(f"r{i}", range(i, i + 7), max_tokens=5))
    seen = 0
    while sched.has_unfinished_requests():
        so, _ = step(sched, runner)
        assert len(so.num_scheduled_tokens) <= 3 and sched.stats.num_running <= 3
        seen = max(seen, len(so.num_scheduled_tokens))
    assert seen == 3


@pytest.mark.parametrize("prefix", [True, False])
def test_preemption_recomputes_and_outputs_unchanged(prefix):
    cfg = SchedulerConfig(max_num_batched_tokens=32, num_blocks=12, block_size=4,
                          enable_prefix_caching=prefix)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    rng = random.Random(1)
    prompts = {f"r{i}": [rng.randrange(VOCAB) for _ in range(rng.randint(5, 15))] for i in range(6)}
    for rid, p in prompts.items():
        sched.add_request(make_req(rid, p, max_tokens=20))
    results, _ = run_all(sched, runner)
    assert sched.stats.num_preemptions > 0
    for rid, p in prompts.items():
        assert tokens_of(results[rid]) == reference_tokens(p, 20), rid
        assert results[rid][-1].finish_reason == "length"
    assert sched.block_manager.num_used_blocks == 0


def test_preempted_request_is_resumed_as_new_with_its_outputs():
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=2, num_blocks=4, block_size=4,
                          enable_prefix_caching=False)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    sched.add_request(make_req("old", [1] * 4, max_tokens=9))
    sched.add_request(make_req("new", [2] * 4, max_tokens=9))
    sched.add_request(make_req("late", [3] * 4, max_tokens=9))  # waits: max_num_seqs
    preempted_at = None
    for i in range(30):
        so, _ = step(sched, runner)
        if "new" in so.finished_req_ids and preempted_at is None:
            preempted_at = i
            assert sched.requests["new"].status == RequestStatus.PREEMPTED
            assert sched.requests["new"].num_computed_tokens == 0
            assert [r.request_id for r in sched.waiting] == ["new", "late"]  # front of the queue
            assert so.num_scheduled_tokens == {"old": 1}
        resumed = [r for r in so.scheduled_new_reqs if r.req_id == "new"]
        if preempted_at is not None and resumed:
            assert resumed[0].output_token_ids and resumed[0].num_computed_tokens == 0
            break
    assert preempted_at is not None and resumed


def test_request_alone_too_long_for_pool_finishes_not_hangs():
    cfg = SchedulerConfig(max_num_batched_tokens=64, num_blocks=2, block_size=4)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    sched.add_request(make_req("a", range(6), max_tokens=100))
    results, steps = run_all(sched, runner, max_steps=50)
    assert results["a"][-1].finish_reason == "length"
    assert len(tokens_of(results["a"])) == 8 - 6 + 1  # the pool holds 8 tokens; the 9th is never computed


def test_randomized_run_keeps_invariants():
    rng = random.Random(1234)
    cfg = SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=8, num_blocks=40, block_size=4,
                          max_model_len=96)
    sched = Scheduler(cfg)
    runner = FakeRunner(cfg)
    prefixes = [[rng.randrange(VOCAB) for _ in range(12)] for _ in range(3)]
    live, expected, results, n_id, aborted = set(), {}, {}, 0, set()
    for _ in range(500):
        for _ in range(rng.choice([0, 0, 1, 2])):
            prompt = rng.choice(prefixes)[:rng.randint(0, 12)] + [rng.randrange(VOCAB)
                                                               for _ in range(rng.randint(1, 30))]
            rid = f"r{n_id}"
            n_id += 1
            mt = rng.randint(1, 30)
            sched.add_request(make_req(rid, prompt, max_tokens=mt))
            expected[rid] = reference_tokens(prompt, min(mt, 96 - len(prompt)))
            live.add(rid)
        if live and rng.random() < 0.05:
            victim = rng.choice(sorted(live))
            outs = sched.abort_requests([victim, "no-such-id"])
            assert [o.finish_reason for o in outs] == ["abort"]
            aborted.add(victim)
        so, outs = step(sched, runner, results)
        assert so.total_num_scheduled_tokens <= 48 and len(so.num_scheduled_tokens) <= 8
        for o in outs:
            if o.finished:
                live.discard(o.req_id)
        live -= aborted
        assert len(sched.requests) == len(live)
    results2, _ = run_all(sched, runner)
    for rid, outs in results2.items():
        results.setdefault(rid, []).extend(outs)
    assert sched.block_manager.num_used_blocks == 0
    assert sched.stats.num_preemptions > 0 and sched.stats.prefix_cache_hits > 0
    for rid, exp in expected.items():
        if rid not in aborted:
            assert tokens_of(results[rid]) == exp, rid


def test_prefix_hit_in_scheduler_and_stats():
    cfg = SchedulerConfig(max_num_batched_tokens=64, num_blocks=64, block_size=4)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    prompt = list(range(50, 70))  # 20 tokens = 5 full blocks
    sched.add_request(make_req("a", prompt, max_tokens=2))
    ra, _ = run_all(sched, runner)
    assert ra["a"][0].num_cached_tokens == 0
    sched.add_request(make_req("b", prompt, max_tokens=2))
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16  # whole prompt cached: one block less
    assert so.num_scheduled_tokens["b"] == 4
    outs = sched.update_from_output(so, runner.execute(so))
    assert outs[0].num_cached_tokens == 16
    assert tokens_of(outs) == reference_tokens(prompt, 1)
    st = sched.stats
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (40, 16)


def test_concurrent_same_prompt_never_shares_block_being_written():
    # Step 1: a computes tokens 0..31. Step 2: a writes 32..39 (blocks 8, 9) while b is admitted
    # with the same prompt: b may reuse blocks 0..7 only, not block 8 that a is writing right now.
    cfg = SchedulerConfig(max_num_batched_tokens=32, num_blocks=64, block_size=4)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    prompt = list(range(200, 240))
    results: dict = {}
    sched.add_request(make_req("a", prompt, max_tokens=3))
    step(sched, runner, results)
    sched.add_request(make_req("b", prompt, max_tokens=3))
    so, _ = step(sched, runner, results)  # the runner asserts no write into a shared block
    assert so.num_scheduled_tokens == {"a": 8, "b": 8}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 32
    assert so.scheduled_new_reqs[0].block_ids[:8] == sched.block_manager.get_block_ids("a")[:8]
    more, _ = run_all(sched, runner)
    for r in "ab":
        assert tokens_of(results[r] + more.get(r, [])) == reference_tokens(prompt, 3)
    assert results["b"][0].num_cached_tokens == 32


def test_dcp_virtual_blocks():
    cfg = SchedulerConfig(max_num_batched_tokens=64, num_blocks=16, block_size=4, dcp_size=2)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    sched.add_request(make_req("a", range(20), max_tokens=10))
    so, _ = step(sched, runner)
    assert len(so.scheduled_new_reqs[0].block_ids) == 3  # ceil(20 / 8)
    for _ in range(4):
        so, _ = step(sched, runner)  # 24 tokens computed after 4 decodes: still 3 blocks
        assert so.scheduled_cached_reqs[0].new_block_ids == []
    assert len(sched.block_manager.get_block_ids("a")) == 3
    so, _ = step(sched, runner)  # the 25th token opens a 4th virtual block
    assert len(so.scheduled_cached_reqs[0].new_block_ids) == 1
    with pytest.raises(ValueError, match="128"):
        sched.add_request(make_req("big", range(129)))  # capacity 16 * 8 tokens
    sched.add_request(make_req("fits", range(128)))


def test_add_request_rejects_prompt_larger_than_pool():
    cfg = SchedulerConfig(num_blocks=4, block_size=16, max_model_len=1000)
    sched = Scheduler(cfg)
    with pytest.raises(ValueError, match=r"65 tokens.*64 tokens"):
        sched.add_request(make_req("a", range(65)))
    with pytest.raises(ValueError, match="max_model_len"):
        Scheduler(SchedulerConfig(max_model_len=10)).add_request(make_req("b", range(11)))
    sched.add_request(make_req("c", range(64)))
    with pytest.raises(ValueError, match="request_id"):
        sched.add_request(make_req("c", range(3)))
    assert len(sched.requests) == 1


def run_one(req: Request, script=None, **cfg_kw):
    cfg = SchedulerConfig(**{"num_blocks": 64, "block_size": 4, **cfg_kw})
    sched = Scheduler(cfg)
    sched.add_request(req)
    results, _ = run_all(sched, FakeRunner(cfg, {req.request_id: script} if script else None))
    outs = results[req.request_id]
    assert all(not o.finished for o in outs[:-1])
    return tokens_of(outs), outs[-1]


def test_stop_conditions():
    script = [5, 9, 2, 7, 2, 9, 4, 4, 4, 4, 4, 4]
    toks, last = run_one(make_req("a", [1, 2], max_tokens=4), script)
    assert toks == script[:4] and last.finish_reason == "length"
    toks, last = run_one(make_req("a", [1, 2], eos=2, max_tokens=10), script)
    assert toks == [5, 9, 2] and (last.finish_reason, last.stop_reason) == ("stop", None)
    toks, last = run_one(make_req("a", [1, 2], eos=2, ignore_eos=True, max_tokens=6), script)
    assert toks == script[:6] and last.finish_reason == "length"
    toks, last = run_one(make_req("a", [1, 2], eos=2, stop_token_ids=[9], max_tokens=10), script)
    assert toks == [5, 9] and (last.finish_reason, last.stop_reason) == ("stop", 9)
    toks, last = run_one(make_req("a", [1, 2], eos=2, min_tokens=4, max_tokens=10), script)
    assert toks == script[:5] and last.finish_reason == "stop"  # the eos at output 3 is ignored
    toks, last = run_one(make_req("a", [1, 2], stop_token_ids=[9], min_tokens=3, max_tokens=10), script)
    assert toks == script[:6] and last.stop_reason == 9
    toks, last = run_one(make_req("a", [1, 2, 3], max_tokens=None), script, max_model_len=8)
    assert toks == script[:5] and last.finish_reason == "length"  # 3 + 5 == max_model_len


def test_prompt_logprobs_accumulated_across_chunks_and_emitted_once():
    prompt = list(range(10, 40))  # 30 tokens, budget 8 -> 4 chunks
    cfg = SchedulerConfig(max_num_batched_tokens=8, num_blocks=64, block_size=4)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    sched.add_request(make_req("warm", prompt, max_tokens=1))
    run_all(sched, runner)  # its blocks are now cached
    sched.add_request(make_req("a", prompt, prompt_logprobs=1, logprobs=0, max_tokens=3))
    results, steps = run_all(sched, runner)
    outs = results["a"]
    assert steps == 4 + 2  # no prefix hit: all 30 prompt tokens computed
    assert outs[0].num_cached_tokens == 0
    plp = outs[0].prompt_logprobs
    assert plp[0] is None and [x.token_id for x in plp[1:]] == prompt[1:]
    assert all(o.prompt_logprobs is None for o in outs[1:])
    assert [lp.token_id for o in outs for lp in o.new_logprobs] == tokens_of(outs)


def test_abort_running_and_waiting():
    cfg = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=1, num_blocks=16, block_size=4)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    sched.add_request(make_req("run", range(5), max_tokens=10))
    sched.add_request(make_req("wait", range(5), max_tokens=10))
    step(sched, runner)
    outs = sched.abort_requests(["wait", "run", "ghost"])
    assert [(o.req_id, o.finish_reason) for o in outs] == [("wait", "abort"), ("run", "abort")]
    assert sched.block_manager.num_used_blocks == 0 and not sched.has_unfinished_requests()
    so = sched.schedule()
    assert so.finished_req_ids == {"run"} and so.is_empty


def test_a_failed_grammar_ends_in_an_error_even_on_eos():
    """A matcher that failed while computing its mask allows only EOS: the request must end in
    an error, not in a stop whose output breaks the constraint."""
    class Failed:
        failed, terminated = True, False

        def error(self) -> str:
            return "structured output: the constraint could not be followed (test)"

    cfg = SchedulerConfig(max_num_batched_tokens=64, num_blocks=64, block_size=4)
    sched = Scheduler(cfg)
    req = make_req("r", [1, 2, 3], eos=9, max_tokens=5)
    req.grammar = Failed()
    assert sched._check_stop(req, 9)
    assert req.finish_reason == "error" and "could not be followed" in req.stop_reason

