"""Data parallelism (-dp): DP ranks with their own requests and KV caches, the MoE layers split
over every rank and run on every DP rank's tokens (engine/data_parallel.py,
models/data_parallel_moe.py). On the CPU: the layer split over dp x tp ranks in one process, the
DP scheduler and its routing, the runner's CUDA-graph choice, the engine on 2 and 4 gloo processes
and over two "nodes" on loopback against one rank, and dead or failing DP ranks. MTP drafts under
DP: tests/test_mtp.py; under NCCL on 2+ GPUs: tests/test_gpu_parallel.py."""

from __future__ import annotations

import pytest
import torch

from common import distributed as pd
from common.distributed import as_rank
from common.sampling_params import SamplingParams
from engine import LLM
from engine.data_parallel import DataParallelScheduler, DPModelRunnerOutput
from models.config import ModelConfig
from models.moe import MoE
from scheduler.config import SchedulerConfig
from scheduler.outputs import ModelRunnerOutput
from scheduler.request import Request
from tests.ep_checks import checkpoint_tensors, load

V2_LITE = "configs/models/DeepSeek-V2-Lite"
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SMALL = {"hidden_size": 64, "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
         "n_shared_experts": 2, "n_group": 1, "topk_group": 1}


@pytest.mark.parametrize("tp,dp,ep", [(1, 2, False), (2, 2, False), (1, 4, True), (2, 2, True)])
def test_moe_layer_split_over_every_rank(tp, dp, ep, monkeypatch):
    """Built as each of the dp x tp ranks (inside moe_scope), the layer holds 1 / (dp x tp) of every
    expert (or with EP E / (dp x tp) experts whole), loads its slice of the checkpoint tensors, and
    the ranks' partial outputs on the same (gathered) tokens sum to the one-rank layer's."""
    cfg = ModelConfig.from_pretrained(V2_LITE, SMALL)
    full = MoE(cfg, torch.float32)
    tensors = checkpoint_tensors(full, seed=3)
    load(full, tensors)
    x = torch.randn(12, cfg.hidden_size)
    ref = full(x).double()
    monkeypatch.setattr(pd, "moe_all_reduce", lambda t: t)  # the partial sums are added below
    total, n = torch.zeros_like(ref), tp * dp
    for r in range(n):
        with as_rank(tp, r, ep, dp_size=dp):
            assert pd.tp().size == tp and pd.dp().rank == r // tp and pd.moe().size == n
            with pd.moe_scope():
                moe = MoE(cfg, torch.float32)
            assert pd.tp().size == tp  # the scope ends with the layer
            if ep:
                assert moe.w13.shape[0] == cfg.n_routed_experts // n and moe.ep_first == r * cfg.n_routed_experts // n
            else:
                assert moe.w2.shape[-1] == cfg.moe_intermediate_size // n
            load(moe, tensors)
        total += moe(x).double()
    assert ((total - ref).norm() / ref.norm()).item() < 1e-5


def _request(rid: str, n: int) -> Request:
    return Request(rid, list(range(2, 2 + n)), SamplingParams(max_tokens=3), None)


def test_scheduler_balances_requests_and_pads_every_rank():
    s = DataParallelScheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64,
                                              block_size=4, num_blocks=32), dp=2)
    for rid, n in (("a", 10), ("b", 3), ("c", 5)):
        s.add_request(_request(rid, n))
    assert [sorted(x.requests) for x in s.schedulers] == [["a", "c"], ["b"]]  # the fewest unfinished first
    waiting, running = s.waiting, s.running  # live views over every rank's queues
    assert len(waiting) == 3 and len(running) == 0
    with pytest.raises(ValueError, match="request_id 'b' is already in use"):
        s.add_request(_request("b", 4))  # held by DP rank 1: refused from any rank
    so = s.schedule()
    assert [p.total_num_scheduled_tokens for p in so.parts] == [15, 3]
    assert len(waiting) == 0 and sorted(r.request_id for r in running) == ["a", "b", "c"]
    assert [p.dp_rows for p in so.parts] == [15, 15] and so.total_num_scheduled_tokens == 18
    assert so.num_scheduled_tokens == {"a": 10, "c": 5, "b": 3}
    st = s.stats
    assert (st.num_running, st.num_waiting, st.num_total_blocks) == (3, 0, 64)
    assert st.num_free_blocks == 64 - 3 - 2 - 1 and st.kv_cache_usage == pytest.approx(6 / 64)
    news = s.update_from_output(so, DPModelRunnerOutput([ModelRunnerOutput(["a", "c"], [7, 8], [None, None]),
                                                         ModelRunnerOutput(["b"], [9], [None])]))
    assert {(o.req_id, tuple(o.new_token_ids), o.engine_index) for o in news} == {
        ("a", (7,), 0), ("c", (8,), 0), ("b", (9,), 1)}  # each output names the DP rank that ran it
    per = s.stats_per_engine  # each rank's own counts (the metrics' `engine` label), summing to the above
    assert [(p.num_running, p.prompt_tokens, p.generation_tokens) for p in per] == [(2, 15, 2), (1, 3, 1)]
    assert (s.stats.prompt_tokens, s.stats.generation_tokens) == (18, 3)
    out = s.abort_requests(["b", "zzz"])
    assert [o.req_id for o in out] == ["b"] and not s.schedulers[1].requests
    so = s.schedule()  # DP rank 1 has nothing: an empty part that still pads to the others' rows
    assert so.parts[0].num_scheduled_tokens == {"a": 1, "c": 1}
    assert so.parts[1].is_empty and so.parts[1].dp_rows == 2 and so.parts[1].finished_req_ids == {"b"}


def test_requests_follow_their_cached_prefix_within_a_slack():
    """A prompt whose prefix one rank has cached goes there while that rank holds at most
    `affinity_slack` (here 1) more unfinished requests than the least loaded, else to the least loaded."""
    s = DataParallelScheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64,
                                              block_size=4, num_blocks=32), dp=2)
    history = list(range(2, 22))  # 5 full blocks
    s.add_request(Request("x", history, SamplingParams(max_tokens=1), None))  # rank 0
    s.add_request(_request("f1", 3))  # rank 1
    s.add_request(_request("f0", 3))  # rank 0 (a tie: the lower index)
    so = s.schedule()
    s.update_from_output(so, DPModelRunnerOutput([ModelRunnerOutput(["x", "f0"], [7, 7], [None, None]),
                                                  ModelRunnerOutput(["f1"], [7], [None])]))
    assert "x" not in s.requests  # finished: its 5 blocks stay in rank 0's prefix cache
    s.add_request(_request("g", 3))  # a tie again: rank 0, now 2 unfinished against 1
    turn = history + [30, 31]
    s.add_request(Request("y", turn, SamplingParams(max_tokens=1), None))
    assert "y" in s.schedulers[0].requests  # 5 blocks cached there, one request over the least loaded
    s.add_request(Request("z", turn + [32], SamplingParams(max_tokens=1), None))
    assert "z" in s.schedulers[1].requests  # rank 0 is now two over: the least loaded takes it
    # /reset_prefix_cache forgets every rank's cached blocks
    from types import SimpleNamespace

    from engine.core import EngineCore
    assert EngineCore.reset_prefix_cache(SimpleNamespace(scheduler=s)) == 5
    assert not s.schedulers[0].block_manager.find_cached_prefix(Request("w", turn, SamplingParams(), None))


def test_prompts_sharing_a_prefix_meet_on_one_rank_before_it_is_cached():
    """Prompts sharing a prefix sent together (the n choices of one request) go where the first
    went, before any of its blocks is computed, while that rank is within the slack (here 2) of
    the least loaded."""
    s = DataParallelScheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16, max_model_len=64,
                                              block_size=4, num_blocks=32), dp=2)
    context = list(range(2, 22))  # 5 full blocks

    def rank_of(rid, prompt):
        s.add_request(Request(rid, prompt, SamplingParams(max_tokens=1), None))
        return next(d for d, x in enumerate(s.schedulers) if rid in x.requests)
    # the 4th choice: rank 0 would be 3 over the least loaded, so rank 1 takes it
    assert [rank_of(f"a{i}", context + [40 + i]) for i in range(4)] == [0, 0, 0, 1]
    assert rank_of("b0", list(range(60, 80))) == 1  # another question: the least loaded
    assert rank_of("b1", list(range(60, 80)) + [5]) == 1  # with the first, rank 0 being no more loaded


def test_prompt_logprob_requests_go_where_the_prefix_kept_its_logprobs():
    """A prefix cached on two ranks, computed by a plain request on rank 0 and by a prompt-logprob
    request on rank 1: a prompt-logprob request sharing it goes to rank 1, whose blocks kept their
    logprobs (rank 0's would all be computed again), a plain one to rank 0 (a tie: the lower
    index). Prompts routed together meet where one wanting as many alternatives went."""
    from test_prompt_logprob_cache import scored
    from test_scheduler import FakeRunner, make_req, run_all
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16, max_model_len=64, block_size=4, num_blocks=64)
    s = DataParallelScheduler(cfg, dp=2)
    context = list(range(100, 124))  # 6 full blocks
    s.schedulers[0].add_request(make_req("plain", context + [7], max_tokens=1))
    run_all(s.schedulers[0], FakeRunner(cfg))
    scored(s.schedulers[1], FakeRunner(cfg), "scored", context + [7])
    assert [x.block_manager.usable_prefix_blocks(make_req("q", context + [9], prompt_logprobs=1))
            for x in s.schedulers] == [0, 5]  # rank 1: all but the last of its 6 kept blocks

    def rank_of(req):
        s.add_request(req)
        return next(d for d, x in enumerate(s.schedulers) if req.request_id in x.requests)
    assert rank_of(make_req("lp", context + [8, 9], prompt_logprobs=1, max_tokens=1)) == 1
    assert rank_of(make_req("pl", context + [8, 10], max_tokens=1)) == 0
    # nothing cached: a prompt-logprob request follows one routed before it that wanted as many
    # alternatives, not a plain one (whose rank is within the slack: it would have gone there)
    fresh = list(range(200, 224))
    assert rank_of(make_req("p0", fresh + [1], max_tokens=1)) == 0  # loads 1 / 1: the lower index
    assert rank_of(make_req("l0", fresh + [2], prompt_logprobs=2, max_tokens=1)) == 1  # not p0's rank
    assert rank_of(make_req("l1", fresh + [3], prompt_logprobs=1, max_tokens=1)) == 1  # l0's (2 >= 1)
    assert rank_of(make_req("l2", fresh + [4], prompt_logprobs=3, max_tokens=1)) == 0  # none had 3


@pytest.fixture(scope="module")
def workload():
    torch.manual_seed(5)
    shared = torch.randint(2, 320, (21,)).tolist()
    prompts = [torch.randint(2, 320, (n,)).tolist() for n in (5, 17, 33, 64, 3)]
    prompts += [shared + torch.randint(2, 320, (n,)).tolist() for n in (2, 9, 14, 30)]
    return prompts


def _outputs(path, prompts, tp=1, dp=1, **kw):
    """Greedy outputs of two waves (the second hits the prefix cache), the stats and the capacity."""
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, tensor_parallel_size=tp, data_parallel_size=dp,
              max_num_batched_tokens=16, **kw)
    try:
        outs = llm.generate(prompts[:5], GREEDY) + llm.generate(prompts[5:], GREEDY)
        s = llm.scheduler.stats
        assert s.num_free_blocks == s.num_total_blocks and not llm.engine.has_unfinished_requests()
        return [o.outputs[0].token_ids for o in outs], s, llm.scheduler.config.capacity_tokens
    finally:
        llm.engine.shutdown()


def test_engine_with_data_parallel_equals_one_rank(tiny_v3, workload):
    """-dp 2 (2 processes), with expert parallelism and async scheduling, and -tp 2 -dcp 2 -dp 2 with
    EP (4 processes): every prompt chunked by 16 tokens on each DP rank, KV pools small enough to
    preempt, DP ranks whose requests end at different steps (the idle one joins the MoE layers
    alone): the one-rank greedy tokens, each DP rank with the one-rank capacity."""
    ref, _, cap1 = _outputs(tiny_v3[0], workload, num_kv_blocks=24)
    for tp, dp, kw in [(1, 2, {}), (1, 2, dict(enable_expert_parallel=True, async_scheduling=True)),
                       (2, 2, dict(enable_expert_parallel=True, decode_context_parallel_size=2))]:
        got, s, cap = _outputs(tiny_v3[0], workload, tp, dp,
                               num_kv_blocks=24 // kw.get("decode_context_parallel_size", 1), **kw)
        assert got == ref, (tp, dp, kw)
        assert cap == cap1 and s.num_total_blocks == dp * 24 // kw.get("decode_context_parallel_size", 1)
        assert s.prefix_cache_hits > 0 and s.num_preemptions > 0, s


def test_data_parallel_v2_dense_first_layer_and_ngram_drafts(tiny_v2, workload):
    """V2's layout (a dense first layer, softmax routing): -dp 2 with prompt-lookup drafts verified
    as multi-token decodes equals one rank, the drafts' counters summed over the ranks. (-dp 2
    without drafts: the V3 test above.)"""
    ref, _, _ = _outputs(tiny_v2[0], workload, num_kv_blocks=256)
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    got, s, _ = _outputs(tiny_v2[0], workload, dp=2, num_kv_blocks=256, speculative_config=ngram)
    assert got == ref and s.spec.num_drafts > 0 and sum(s.spec.accepted_per_pos) == s.spec.num_accepted_tokens


def test_padded_rows_rounds_each_rank_to_its_graph_size():
    from engine.data_parallel import padded_rows
    from scheduler.outputs import SchedulerOutput

    def step(lens):
        return SchedulerOutput([], [], {str(i): n for i, n in enumerate(lens)}, sum(lens))
    decode, piecewise = [1, 2, 4, 8, 16, 32], [16, 64]
    assert padded_rows(step([]), decode, piecewise) == 0
    assert padded_rows(step([1] * 5), decode, piecewise) == 8  # decodes: the decode graphs' bucket
    assert padded_rows(step([1] * 40), decode, piecewise) == 64  # past them: the piecewise size
    assert padded_rows(step([1, 1, 3]), decode, piecewise) == 16  # a chunk: piecewise only
    assert padded_rows(step([70]), decode, piecewise) == 70  # past every graph: eager, its own count
    assert padded_rows(step([1] * 5), [], []) == 5


class _Graphs:
    buckets, q_lens = [1, 2, 4, 8, 16], (1,)

    def bucket_for(self, n, q=1):
        return next((b for b in self.buckets if b >= n), None)

    def run(self, ids, pos, meta, bucket=None):
        return ("decode graph", bucket)


class _Pieces:
    sizes = [8, 16]

    def size_for(self, n):
        return next((s for s in self.sizes if s >= n), None)

    def run(self, ids, pos, meta, size=None):
        return ("piecewise", size)


@pytest.mark.parametrize("decodes,rows,want", [
    (3, 0, ("decode graph", 4)), (3, 8, ("decode graph", 8)), (3, 16, ("decode graph", 16)),
    (3, 5, "eager"),  # no decode graph of 5 rows and no piece of 5: eager, gathering 5 rows
    (0, 16, ("piecewise", 16)), (0, 12, "eager"), (0, 0, ("piecewise", 8))])
def test_runner_replays_only_graphs_of_the_steps_rows(decodes, rows, want):
    """Under DP the runner replays a CUDA graph only where its captured rows are the step's dp_rows
    (each MoE gather must take the same rows on every DP rank); else it runs eagerly."""
    from types import SimpleNamespace
    from engine.model_runner import ModelRunner, StepBatch
    runner = ModelRunner.__new__(ModelRunner)
    runner.graphs, runner.piecewise, runner.kv_caches = _Graphs(), _Pieces(), []
    runner.model = lambda *a: "eager"
    T = decodes or 5
    meta = SimpleNamespace(prefill=None if decodes else object(), num_decodes=decodes,
                           decode=SimpleNamespace(row_index=None, q_len=1) if decodes else None)
    batch = StepBatch(torch.zeros(T, dtype=torch.int64), torch.zeros(T, dtype=torch.int64), meta, [], [], [])
    pd.set_dp_rows(rows)
    try:
        assert runner.forward(batch) == want
    finally:
        pd.set_dp_rows(0)


def test_served_engine_reports_every_dp_rank(tmp_path_factory):
    """The HTTP side's engine (its core in a process of its own): the KV block counts it reports
    are every DP rank's from the start, not one rank's until the first step; /metrics has vLLM's
    series once per DP rank (label `engine`), a request's under the rank that ran it."""
    import asyncio
    import re

    from common.args import EngineArgs
    from engine.async_llm import AsyncLLM
    from server.metrics import ServerMetrics
    from tests.server_fixtures import tiny_model_dir
    args = EngineArgs(model=tiny_model_dir(tmp_path_factory), device="cpu", dtype="float32",
                      max_model_len=512, num_kv_blocks=64, data_parallel_size=2)

    async def run():
        e = AsyncLLM(args, core_in_thread=False)
        metrics = ServerMetrics(e, "m")

        async def one(prompt, max_tokens, rid, n=1):
            tracker = metrics.tracker(n=n, max_tokens=max_tokens)
            async for out in e.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n,
                                                               seed=1), rid):
                tracker.observe(0, out)
            tracker.close(n)
            return out.engine_index if n == 1 else [o.engine_index for o in out.outputs]
        try:
            before = e.stats()
            # two requests at once: the least loaded rank takes each, so one on each rank
            engines = await asyncio.gather(one([5, 6, 7], 2, "x"), one([5, 6, 7, 8], 5, "y"))
            await asyncio.sleep(0.5)
            stats, text = e.stats(), metrics.render().decode()
            # then the two choices of an n = 2 request, each an engine request: one on each rank
            choices = await one([9, 10, 11, 12, 13], 3, "z", n=2)
            await asyncio.sleep(0.5)
            return before, stats, engines, text, choices, metrics.render().decode()
        finally:
            e.shutdown()
    before, after, engines, text, choices, text_n = asyncio.run(run())
    assert before.num_total_blocks == after.num_total_blocks == before.num_free_blocks == 128
    assert [p.num_total_blocks for p in before.per_engine] == [64, 64]
    assert sorted(engines) == [0, 1]
    x, y = after.per_engine[engines[0]], after.per_engine[engines[1]]
    assert (x.prompt_tokens_total, x.generation_tokens_total) == (3, 2)
    assert (y.prompt_tokens_total, y.generation_tokens_total) == (4, 5)
    assert (after.prompt_tokens_total, after.generation_tokens_total) == (7, 7)
    hists = [p.iteration_tokens for p in after.per_engine]
    assert sum(h[2] for h in hists) == after.iteration_tokens[2] >= 7 + 5  # each rank's step tokens

    def sample(name, engine, text=text, finished_reason=None):
        reason = "" if finished_reason is None else f'finished_reason="{finished_reason}",'
        m = re.search(rf'^{re.escape(name)}{{engine="{engine}",{reason}(.*)}} (\S+)$', text, re.M)
        assert m, (name, engine)
        return float(m.group(2))
    for d, (prompt, generated) in ((engines[0], (3, 2)), (engines[1], (4, 5))):
        assert sample("vllm:prompt_tokens_total", d) == prompt
        assert sample("vllm:generation_tokens_total", d) == generated
        assert sample("vllm:num_requests_running", d) == 0
        assert sample("vllm:time_to_first_token_seconds_count", d) == 1
        assert sample("vllm:request_generation_tokens_sum", d) == generated
        assert sample("vllm:request_success_total", d, finished_reason="length") == 1
    assert text.count('vllm:cache_config_info{') == 2 and 'num_gpu_blocks="64"' in text
    assert "mla_serve_generation_tokens_total 7.0" in text  # ours: the whole engine's, unlabelled
    assert sorted(choices) == [0, 1]
    for d in (0, 1):  # each choice's series under its own rank: they add up to the rank's counters
        assert sample("vllm:request_success_total", d, text_n, finished_reason="length") == 2
        assert sample("vllm:request_generation_tokens_sum", d, text_n) == sample("vllm:generation_tokens_total", d,
                                                                                   text_n)
        assert sample("vllm:request_prompt_tokens_sum", d, text_n) == sample("vllm:prompt_tokens_total", d, text_n)


@pytest.mark.parametrize("when", ["between-steps", "mid-step"])
def test_a_dead_dp_rank_fails_the_engine_fast(tiny_v3, when):
    """DP rank 1's process dies between steps (the next step's send finds it) or after its step
    was sent (DP rank 0 then waits in the MoE gather for it, and the engine, waiting on rank 0's
    output, finds it dead, or rank 0's gather fails first): WorkerDiedError, within seconds, not a
    hang."""
    import time

    from engine.multiproc import WorkerDiedError
    llm = LLM(tiny_v3[0], device="cpu", dtype="float32", num_kv_blocks=64, data_parallel_size=2)
    ranks = llm.engine.executor.ranks
    victim = ranks.procs[1]

    def kill():
        victim.kill()
        victim.join()
    if when == "mid-step":
        send = ranks.send_group

        def send_then_kill(first, count, msg):
            send(first, count, msg)
            if first == 1 and victim.is_alive():
                kill()
        ranks.send_group = send_then_kill
    else:
        kill()
    t0 = time.monotonic()
    # (mid-step, gloo's gather on DP rank 0 fails once its peer is gone, and rank 0 reports that:
    # "Connection reset by peer" or "Connection closed by peer", as the dead process's socket ended)
    with pytest.raises(WorkerDiedError,
                       match="worker process died: worker-1|worker failed: rank 0: .*(reset|closed) by peer"):
        llm.generate([[5, 6, 7], [8, 9, 10]], GREEDY)
    assert time.monotonic() - t0 < 60
    llm.engine.shutdown()


def test_a_failing_dp_rank_reports_its_own_error(tiny_v3):
    """DP rank 1 fails on its step while the engine waits on DP rank 0's output: the engine raises
    rank 1's own error (left in its pipe), not only that its process died."""
    from engine.multiproc import WorkerDiedError
    llm = LLM(tiny_v3[0], device="cpu", dtype="float32", num_kv_blocks=64, data_parallel_size=2)
    ranks = llm.engine.executor.ranks
    try:
        ranks.send_group(1, 1, ("run", "not a step"))  # rank 1 fails on it; rank 0 is sent nothing
        with pytest.raises(WorkerDiedError, match="worker failed: rank 1: AttributeError"):
            ranks.recv(0, "out")
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("kw", [{}, {"enable_expert_parallel": True, "async_scheduling": True}])
def test_data_parallel_over_two_nodes_on_loopback(tiny_v3, workload, kw):
    """-dp 2 split over two "nodes" (node 1 runs DP rank 1's worker only): rank 0 relays each
    step's parts and gathers the outputs back; the one-rank greedy tokens, with EP and async
    scheduling too, and node 1's worker stops with the engine."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tiny_v3[0]
    common = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=16)
    node1 = subprocess.Popen(
        [sys.executable, "-c",
         "from common.args import EngineArgs; from models.config import ModelConfig;"
         "from engine.multiproc import run_worker_node;"
         f"a = EngineArgs(model={path!r}, data_parallel_size=2, nnodes=2, node_rank=1, master_port={port},"
         f" **{ {**common, **kw}!r});"
         "run_worker_node(a, ModelConfig.from_pretrained(a.model), [])"])
    try:
        llm = LLM(path, data_parallel_size=2, nnodes=2, node_rank=0, master_port=port, **common, **kw)
        try:
            got = [o.outputs[0].token_ids for o in llm.generate(workload[:5], GREEDY)]
            s = llm.scheduler.stats
            assert s.num_free_blocks == s.num_total_blocks == 128
        finally:
            llm.engine.shutdown()
        one = LLM(path, **common)
        try:
            assert got == [o.outputs[0].token_ids for o in one.generate(workload[:5], GREEDY)]
        finally:
            one.engine.shutdown()
        assert node1.wait(timeout=30) == 0  # the stop reached the other node's worker
    finally:
        if node1.poll() is None:
            node1.kill()
