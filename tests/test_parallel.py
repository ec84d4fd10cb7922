"""Tensor and decode-context parallelism on CPU (gloo, 2 processes) equal one rank."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from common.args import EngineArgs

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def workload():
    torch.manual_seed(5)
    shared = torch.randint(2, 320, (21,)).tolist()
    prompts = [torch.randint(2, 320, (n,)).tolist() for n in (5, 17, 33, 64)]
    prompts += [shared + torch.randint(2, 320, (n,)).tolist() for n in (2, 9, 14, 30)]
    return prompts


def outputs(path, prompts, tp, dcp, **kw):
    """Greedy outputs for two waves of prompts (the second wave hits the prefix cache)."""
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, tensor_parallel_size=tp,
              decode_context_parallel_size=dcp, **kw)
    try:
        first = llm.generate(prompts[:5], GREEDY)
        second = llm.generate(prompts[5:], GREEDY)
        s = llm.scheduler.stats
        assert s.num_free_blocks == s.num_total_blocks
        return [o.outputs[0].token_ids for o in first + second], s, llm.scheduler.config.capacity_tokens
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("budget", [2048, 16])
def test_tp_and_dcp_equal_one_rank(tiny_v3, workload, budget):
    path = tiny_v3[0]
    # With the small budget, also a pool small enough to preempt, of the same KV capacity in
    # tokens for every layout (DCP multiplies each block's tokens by D); with the large one, the
    # same KV memory on every rank (--cpu-kv-cache-gb), which holds D times the tokens under DCP.
    small_pool = budget == 16

    def pool(dcp):
        return dict(num_kv_blocks=28 // dcp) if small_pool else dict(cpu_kv_cache_gb=0.001)
    ref, s1, cap1 = outputs(path, workload, 1, 1, max_num_batched_tokens=budget, **pool(1))
    for tp, dcp in [(2, 1), (2, 2)]:
        got, s, cap = outputs(path, workload, tp, dcp, max_num_batched_tokens=budget, **pool(dcp))
        assert got == ref, (tp, dcp)
        assert cap == (cap1 if small_pool else dcp * cap1), (tp, dcp, cap, cap1)
        assert s.prefix_cache_hits > 0
        if small_pool:
            assert s.num_preemptions > 0


@pytest.fixture(scope="module")
def tiny_v3_8heads(tmp_path_factory):
    from tiny_models import make_model
    path = tmp_path_factory.mktemp("tiny_v3_8heads")
    make_model(path, "v3", num_attention_heads=8)
    return str(path)


def test_four_ranks_equal_one_rank(tiny_v3_8heads, workload):
    """Four ranks on the CPU (gloo, 4 processes): -tp 4, -tp 4 -dcp 2, -tp 4 -dcp 4 equal one rank
    with every prompt chunked by 16 tokens. Eight ranks: scripts/cpu_parallel_check.py."""
    ref, _, cap1 = outputs(tiny_v3_8heads, workload, 1, 1, max_num_batched_tokens=16, num_kv_blocks=256)
    for tp, dcp in [(4, 1), (4, 2), (4, 4)]:
        got, s, cap = outputs(tiny_v3_8heads, workload, tp, dcp, max_num_batched_tokens=16,
                              num_kv_blocks=256 // dcp)
        assert got == ref, (tp, dcp)
        assert cap == cap1 and s.prefix_cache_hits > 0


def test_impossible_layouts_refused(tiny_v3):
    with pytest.raises(ValueError, match="decode-context-parallel-size 3 must divide"):
        EngineArgs(model=tiny_v3[0], tensor_parallel_size=2, decode_context_parallel_size=3)
    with pytest.raises(ValueError, match="tensor-parallel-size 3 must divide the model's 4 attention heads"):
        LLM(tiny_v3[0], device="cpu", tensor_parallel_size=3)


def test_two_nodes_on_loopback(tiny_v3, workload):
    """tp 2 split over two "nodes" (node 1 runs workers only) equals one rank."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tiny_v3[0]
    node1 = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from common.args import EngineArgs; from models.config import ModelConfig;"
         "from engine.multiproc import run_worker_node;"
         f"a = EngineArgs(model={path!r}, device='cpu', dtype='float32', block_size=4, num_kv_blocks=64,"
         f" tensor_parallel_size=2, nnodes=2, node_rank=1, master_port={port});"
         "run_worker_node(a, ModelConfig.from_pretrained(a.model), [])"])
    try:
        llm = LLM(path, device="cpu", dtype="float32", block_size=4, num_kv_blocks=64,
                  tensor_parallel_size=2, nnodes=2, node_rank=0, master_port=port)
        got = [o.outputs[0].token_ids for o in llm.generate(workload[:4], GREEDY)]
        llm.engine.shutdown()
        ref_llm = LLM(path, device="cpu", dtype="float32", block_size=4, num_kv_blocks=64)
        assert got == [o.outputs[0].token_ids for o in ref_llm.generate(workload[:4], GREEDY)]
        assert node1.wait(timeout=30) == 0  # the stop reached the other node's workers
    finally:
        if node1.poll() is None:
            node1.kill()


@pytest.mark.parametrize("when", ["between-steps", "step-unread", "awaiting-output"])
@pytest.mark.parametrize("rank", [0, 1])
def test_dead_worker_fails_fast(tiny_v3, rank, when):
    """A worker process that dies raises WorkerDiedError, neither hanging nor another error.

    between-steps: the next step's send finds it dead. step-unread: killed right after a step
    was sent, before reading it (its socket resets). awaiting-output: the engine waits on a pipe
    whose process died with nothing unread (its socket reads EOF)."""
    import time

    from engine.multiproc import WorkerDiedError

    llm = LLM(tiny_v3[0], device="cpu", dtype="float32", num_kv_blocks=64, tensor_parallel_size=2)
    ranks = llm.engine.executor.ranks
    procs = list(ranks.procs)

    def kill():
        procs[rank].kill()
        procs[rank].join()

    if when == "step-unread":
        send = ranks.send_step

        def send_then_kill(msg, multi_node):
            send(msg, multi_node)
            if msg is not None and procs[rank].is_alive():
                kill()
        ranks.send_step = send_then_kill
    else:
        kill()
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match=f"worker process died: worker-{rank}|worker failed"):
        if when == "awaiting-output":
            ranks.recv(rank, "out")
        else:
            llm.generate([[5, 6, 7]], GREEDY)
    assert time.monotonic() - t0 < 60
    if when == "between-steps":
        # the surviving rank heard the stop (a broken pipe to rank 0 must not keep it from rank 1)
        # and left by itself rather than being killed after shutdown's join wait
        assert [p.exitcode for i, p in enumerate(procs) if i != rank] == [0]
    llm.engine.shutdown()


def _agreement_rank(rank: int, init: str, q) -> None:
    """One of two gloo ranks recording 6 sampling steps for each `diverge_at` of None and 3 (a
    RankAgreement each); rank 1 samples differently from step `diverge_at` on. Puts (diverge_at,
    rank, error message or None, steps agreed) on `q`."""
    import numpy as np

    from common import distributed as pd
    from engine.rank_agreement import RankAgreement, RankDivergenceError

    pd.init_parallel(2, 1, rank, init, "gloo", timeout_s=60)
    try:
        for diverge_at in (None, 3):
            a = RankAgreement(interval=2)
            err = None
            try:
                for step in range(1, 7):
                    ids = np.array([step, 7, 11])
                    if rank == 1 and diverge_at is not None and step >= diverge_at:
                        ids[1] = 8
                    a.record(ids)
            except RankDivergenceError as e:
                err = str(e)
            q.put((diverge_at, rank, err, a.checked))
    finally:
        pd.destroy_parallel()


@pytest.fixture(scope="module")
def agreement(tmp_path_factory):
    """{diverge_at: {rank: (error message or None, steps agreed)}} from one pair of spawned gloo
    ranks (starting them takes seconds, both checks milliseconds)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"file://{tmp_path_factory.mktemp('agreement')}/rendezvous"
    procs = [ctx.Process(target=_agreement_rank, args=(r, init, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = {None: {}, 3: {}}
    for _ in range(2 * len(procs)):
        diverge_at, r, err, checked = q.get(timeout=120)
        results[diverge_at][r] = (err, checked)
    for p in procs:
        p.join(timeout=30)
    return results


@pytest.mark.parametrize("diverge_at", [None, 3])
def test_rank_agreement_check(diverge_at, agreement):
    """Ranks that sample alike pass every check; a difference fails the first check after it on
    every rank, naming the steps since the last agreement."""
    results = agreement[diverge_at]
    if diverge_at is None:
        assert results == {0: (None, 6), 1: (None, 6)}
    else:
        assert len(results) == 2
        for err, checked in results.values():
            assert checked == 2
            assert "sampled different tokens in sampling steps 3..4" in err


def test_per_rank_sampling_stays_in_step(tiny_v3, workload):
    """-tp 2 with random sampling (engine RNG and per-request seeds) and the ranks comparing their
    samples every step: no divergence (the check stops the engine if there is one)."""
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=20, seed=5, max_tokens=12, ignore_eos=True)]
    llm = LLM(tiny_v3[0], device="cpu", dtype="float32", block_size=4, num_kv_blocks=64,
              tensor_parallel_size=2, rank_check_interval=1)
    try:
        for p in params:
            outs = llm.generate(workload[:4], p)
            assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    finally:
        llm.engine.shutdown()
    one = LLM(tiny_v3[0], device="cpu", dtype="float32", block_size=4, num_kv_blocks=64)
    one.generate(workload[:2], params[0])
    assert one.engine.executor.worker.runner.agreement.steps == 12  # every sampling step recorded
