"""The MTP drafter (`{"method": "mtp"}`) on a tiny random V3 with one MTP layer: it loads, runs,
and greedy outputs with its drafts equal those without speculation."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module", params=[True, False], ids=["copies", "shared"])
def tiny_mtp(request, tmp_path_factory):
    from tiny_models import add_mtp_layer, make_model
    path = tmp_path_factory.mktemp("tiny_mtp")
    make_model(path, "v3")
    add_mtp_layer(path, copies=request.param)
    return str(path), request.param


def prompts():
    torch.manual_seed(9)
    return [torch.randint(2, 320, (n,)).tolist() for n in (5, 23, 40, 11)]


def generate(path, params=GREEDY, **kw):
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, **({"num_kv_blocks": 256} | kw))
    try:
        outs = llm.generate(prompts(), params)
        s = llm.scheduler.stats
        assert s.num_free_blocks == s.num_total_blocks
        return [o.outputs[0].token_ids for o in outs], s, llm
    finally:
        llm.engine.shutdown()


_PLAIN: dict[str, list] = {}


def plain(path):
    """Greedy outputs without speculation, every test's reference: generated once per model."""
    if path not in _PLAIN:
        _PLAIN[path] = generate(path)[0]
    return _PLAIN[path]


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_greedy_equals_no_speculation(tiny_mtp, k):
    path, copies = tiny_mtp
    ref = plain(path)
    got, s, llm = generate(path, speculative_config={"method": "mtp", "num_speculative_tokens": k})
    assert got == ref
    sp = s.spec
    assert sp.num_drafts > 0 and sp.num_draft_tokens > 0
    assert 0 < sp.num_accepted_tokens < sp.num_draft_tokens  # drafts accepted and rejected
    m = llm.engine.executor.worker.model
    shared = m.mtp[0].embed_tokens is m.model.embed_tokens and m.mtp[0].shared_head.head is m.lm_head
    assert shared != copies  # loaded where the checkpoint has copies, shared where not


def test_mtp_under_chunking_preemption_dcp_and_ep(tiny_mtp):
    """Chunked by 16 tokens in a pool small enough to preempt, and -tp 2 -dcp 2 (each rank loading
    its part of the MTP layer's own or the shared embedding and head); with the checkpoint of
    copies also -tp 2 EP and -dp 2 EP, whose MTP layer's experts are alike in both checkpoints."""
    path, copies = tiny_mtp
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    ref = plain(path)
    got, s, _ = generate(path, speculative_config=spec, max_num_batched_tokens=16, num_kv_blocks=20)
    assert got == ref and s.num_preemptions > 0 and s.spec.num_accepted_tokens > 0
    got, s, _ = generate(path, speculative_config=spec, max_num_batched_tokens=16,
                         tensor_parallel_size=2, decode_context_parallel_size=2, num_kv_blocks=128)
    assert got == ref and s.spec.num_accepted_tokens > 0
    if copies:
        # expert parallel: the MTP layer's MoE split by expert too (its other rank's experts skipped at load)
        got, s, _ = generate(path, speculative_config=spec, tensor_parallel_size=2, enable_expert_parallel=True)
        assert got == ref and s.spec.num_accepted_tokens > 0
        # -dp 2 with EP: every DP rank runs the MTP layer k times a step, one with nothing to draft
        # with no rows of its own, prompts chunked by 16 tokens
        got, s, _ = generate(path, speculative_config=spec, max_num_batched_tokens=16, data_parallel_size=2,
                             enable_expert_parallel=True)
        assert got == ref and s.spec.num_accepted_tokens > 0, s.spec


class EagerDrafterGraphs:
    """Stands in for the drafter's CUDA graphs on the CPU: `DecodeGraphs`' interface, the padded
    inputs run eagerly through the same step (engine/mtp_drafter.py `MTPStep`)."""

    def __init__(self, step, cache, q_lens):
        self.step, self.cache, self.q_lens = step, cache, q_lens
        self.padded_rows = 0  # rows run that are padding (no cache slot)

    def bucket_for(self, batch, q_len=1):
        return batch if q_len in self.q_lens else None

    def run(self, input_ids, positions, meta, hidden=None):
        assert meta.prefill is None and meta.decode.row_index is None
        assert input_ids.shape[0] == meta.num_decodes * meta.decode.q_len == hidden.shape[0]
        self.padded_rows += int((meta.slot_mapping < 0).sum())
        return self.step(input_ids, positions, self.cache, meta, hidden)


def test_mtp_drafts_through_padded_graph_inputs_equal_eager(tiny_mtp):
    """The drafter's graph path (requests padded to the step's most rows, padding writing no slot
    and seeing no key) drafts exactly what the eager path drafts: the same outputs and the same
    accepted count, with padding rows run."""
    from engine.mtp_drafter import MTPStep
    path, _ = tiny_mtp
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    ref, s_eager, _ = generate(path, speculative_config=spec)
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, num_kv_blocks=256, speculative_config=spec)
    try:
        runner = llm.engine.executor.worker.runner
        graphs = EagerDrafterGraphs(MTPStep(runner.model.mtp[0], runner.model.model.rotary_emb),
                                    runner.mtp_kv_caches[0], (1, 2, 3, 4))
        runner.mtp_graphs = graphs
        got = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY)]
        s = llm.scheduler.stats
    finally:
        llm.engine.shutdown()
    assert got == ref
    assert s.spec.num_accepted_tokens == s_eager.spec.num_accepted_tokens > 0
    assert graphs.padded_rows > 0


def test_mtp_needs_an_mtp_layer(tiny_v3):
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    # transformers' config says 1 MTP layer, but its checkpoint stores none
    with pytest.raises(ValueError, match="no tensors of MTP layer model.layers.3.*use method ngram"):
        LLM(tiny_v3[0], device="cpu", dtype="float32", speculative_config=spec)
    with pytest.raises(ValueError, match="num_nextn_predict_layers = 0.*use method ngram"):
        LLM(tiny_v3[0], device="cpu", dtype="float32", speculative_config=spec,
            hf_overrides={"num_nextn_predict_layers": 0})


def test_bundled_model_mtp_drafts_are_mostly_accepted():
    """The bundled tiny V3's trained MTP layer (docs/tiny_model.md: 83.9% on the 200 test items
    at k = 1): on 10 test prompts its drafts are accepted most of the time, and greedy outputs
    equal those without speculation. A wiring error (input order, hidden state, positions) drops
    the acceptance to about chance. (Chunked, preempted, -tp 2 -dcp 2 and EP:
    test_mtp_under_chunking_preemption_dcp_and_ep.)"""
    from scripts.eval_tiny_model_hf import DEFAULT_DATA, build_prompts
    from scripts.make_task_data import read_jsonl
    from tests.server_fixtures import TINY_MODEL
    prompts = build_prompts(read_jsonl(DEFAULT_DATA / "train.jsonl"), read_jsonl(DEFAULT_DATA / "test.jsonl"))[:10]
    params = SamplingParams(temperature=0, max_tokens=48, stop=["Question:"])
    outs = {}
    for name, spec in (("plain", None), ("mtp", {"method": "mtp", "num_speculative_tokens": 1})):
        llm = LLM(str(TINY_MODEL), device="cpu", dtype="float32", speculative_config=spec)
        try:
            outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            s = llm.scheduler.stats.spec
        finally:
            llm.engine.shutdown()
    assert outs["mtp"] == outs["plain"]
    assert s.num_accepted_tokens / s.num_draft_tokens > 0.7, s


def test_mtp_cache_holds_every_prompt_row_under_chunking(tiny_mtp):
    """A prompt prefilled in chunks by steps that sample nothing (one request, a 16-token budget):
    the MTP layer still writes its cache at every prompt row, as one unchunked prefill does (a
    drafter run only in steps that sample would leave the earlier chunks' rows unwritten)."""
    path, _ = tiny_mtp
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    prompt = prompts()[2]  # 40 tokens: two chunks of 16 that sample nothing, then the last 8
    caches = []
    for budget in (2048, 16):
        llm = LLM(path, device="cpu", dtype="float32", block_size=4, num_kv_blocks=64,
                  speculative_config=spec, max_num_batched_tokens=budget)
        try:
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            caches.append(llm.engine.executor.worker.runner.mtp_kv_caches[0].clone())
        finally:
            llm.engine.shutdown()
    rows = caches[0].flatten(0, 1)[:39]  # positions 0..38 (block ids from 0): each row's next token is known
    assert rows.abs().sum(-1).gt(0).all()
    torch.testing.assert_close(caches[1].flatten(0, 1)[:39], rows, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("spec", [{"method": "mtp", "num_speculative_tokens": 2},
                                  {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}],
                         ids=["mtp", "ngram"])
def test_constrained_requests_draft_nothing_beside_ones_that_do(spec):
    """Structured outputs under speculation: a constrained request gets no drafts (its grammar
    must see each token before the next is allowed), so its output is the one without
    speculation; the unconstrained request beside it still drafts. MTP drafted for every request
    and constrained ones failed ("the constraint could not be followed")."""
    from common.sampling_params import StructuredOutputs
    from tests.server_fixtures import TINY_MODEL
    prompt = "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:"
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputs(kind, arg))
              for kind, arg in (("regex", "[0-9]{1,3} (apples|pears)"), ("choice", '["yes", "eight apples"]'),
                                ("json_object", ""))]
    params.append(SamplingParams(temperature=0, max_tokens=40))
    outs = {"plain": _PLAIN.get("constrained")}  # the run without speculation: once for both specs
    for name, sc in (("plain", None), ("spec", spec)):
        if outs.get(name) is not None:
            continue
        llm = LLM(str(TINY_MODEL), device="cpu", dtype="float32", speculative_config=sc)
        try:
            outs[name] = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in llm.generate([prompt] * 4, params)]
            drafted = llm.scheduler.stats.spec
        finally:
            llm.engine.shutdown()
    _PLAIN["constrained"] = outs["plain"]
    assert outs["spec"] == outs["plain"]
    assert [f for _, f in outs["spec"][:2]] == ["stop"] * 2  # the regex and the choice completed
    assert drafted.num_draft_tokens > 0  # the unconstrained request drafted

