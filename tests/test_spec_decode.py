"""Speculative decoding (ngram drafts verified as multi-token decodes): outputs equal those
without speculation, token for token, under every schedule; the block pool stays consistent."""

from __future__ import annotations

import pytest
import torch
from test_block_manager import check_invariants

from engine import LLM, SamplingParams
from engine.spec_decode import SpeculativeConfig, accepted_prefix, ngram_propose

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


# ---- config and drafter ----

def test_config_parses_vllm_keys_and_names_bad_ones():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 1, 5)
    assert c.decode_threshold == 5
    assert SpeculativeConfig.parse(None) is None
    for bad, word in [('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
                      ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
                      ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "unknown key"),
                      ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
                       '"prompt_lookup_max": 2}', "prompt_lookup_min 4 exceeds"),
                      ('{"method": "mtp", "num_speculative_tokens": 1, "prompt_lookup_max": 2}', "'ngram' only"),
                      ("[1]", "JSON object"), ("{", "not valid JSON")]:
        with pytest.raises(ValueError, match=word):
            SpeculativeConfig.parse(bad)


def test_async_scheduling_with_speculation_is_refused_by_name(tiny_v3):
    with pytest.raises(ValueError, match="--async-scheduling cannot be combined with --speculative-config"):
        LLM(tiny_v3[0], device="cpu", dtype="float32", async_scheduling=True, speculative_config=NGRAM)


def test_ngram_proposes_what_followed_the_longest_suffix():
    #        0  1  2  3  4  5  6  7  8  9
    toks = [5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]
    # suffix [6, 7] first occurs at 1 (then 8, 9, 1); the 3-gram [2, 6, 7] never occurred before
    assert ngram_propose(toks, 1, 3, 3) == [8, 9, 1]
    assert ngram_propose(toks, 1, 3, 5) == [8, 9, 1, 6, 7]
    assert ngram_propose(toks, 3, 3, 3) == []  # only 3-grams: none matches
    assert ngram_propose([1, 2, 3], 1, 2, 2) == []
    assert ngram_propose([4, 4], 1, 2, 3) == [4]  # the continuation is cut at the end of the tokens
    assert ngram_propose([4], 1, 2, 3) == []


def test_accepted_prefix():
    assert accepted_prefix([1, 2, 3, 4], [1, 2, 9]) == 2
    assert accepted_prefix([1, 2, 3, 4], [1, 2, 3]) == 3
    assert accepted_prefix([5, 2], [1]) == 0
    assert accepted_prefix([5], []) == 0


# ---- the engine ----

@pytest.fixture(scope="module")
def workload():
    """Repetitive prompts (the ngram drafter finds matches) and plain random ones."""
    torch.manual_seed(7)
    motif = torch.randint(2, 320, (6,)).tolist()
    prompts = [motif * 5, torch.randint(2, 320, (19,)).tolist(), motif[:4] * 3 + [11, 12],
               torch.randint(2, 320, (41,)).tolist(), motif * 2 + torch.randint(2, 320, (9,)).tolist()]
    return prompts


def generate(path, prompts, params, waves=1, **kw):
    """Outputs (token ids, logprobs, finish reasons, text) and scheduler stats; the pool's
    invariants are checked after every step."""
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, **({"num_kv_blocks": 256} | kw))
    try:
        update = llm.scheduler.update_from_output

        def checked(so, out):
            res = update(so, out)
            check_invariants(llm.scheduler.block_manager)
            return res

        llm.scheduler.update_from_output = checked
        outs = []
        size = -(-len(prompts) // waves)
        for i in range(0, len(prompts), size):  # later waves hit the prefix cache
            outs += llm.generate(prompts[i:i + size], params)
        s = llm.scheduler.stats
        assert s.num_free_blocks == s.num_total_blocks
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].text,
                 list(o.outputs[0].logprobs or []))
                for o in outs], s
    finally:
        llm.engine.shutdown()


def assert_same(got, ref):
    """Token ids, finish reasons and text exactly; logprobs' ids and ranks exactly, their values
    to fp32 rounding (a position's logits come from a decode of another width)."""
    assert [g[:3] for g in got] == [r[:3] for r in ref]
    for g, r in zip(got, ref):
        assert len(g[3]) == len(r[3])
        for a, b in zip(g[3], r[3]):
            assert (a.token_id, a.rank, [t for t, _ in a.top]) == (b.token_id, b.rank, [t for t, _ in b.top])
            assert abs(a.logprob - b.logprob) < 1e-4
            assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a.top, b.top))


def assert_spec_exercised(stats):
    sp = stats.spec
    assert sp.num_accepted_tokens > 0, "no draft was accepted: the test checks nothing"
    assert sp.num_accepted_tokens < sp.num_draft_tokens, "no draft was rejected"


@pytest.mark.parametrize("model", ["tiny_v2", "tiny_v3"])
@pytest.mark.parametrize("budget", [16, 2048])
def test_greedy_with_speculation_equals_without(model, budget, request, workload):
    path = request.getfixturevalue(model)[0]
    ref, _ = generate(path, workload, GREEDY, max_num_batched_tokens=budget)
    got, s = generate(path, workload, GREEDY, max_num_batched_tokens=budget, speculative_config=NGRAM)
    assert got == ref
    assert_spec_exercised(s)


def test_greedy_with_speculation_under_preemption_and_prefix_hits(tiny_v3, workload):
    path = tiny_v3[0]
    prompts = workload + [p + [3, 4] for p in workload]  # the second wave shares the first's prefixes
    ref, _ = generate(path, prompts, GREEDY, waves=2)
    got, s = generate(path, prompts, GREEDY, waves=2, num_kv_blocks=24, speculative_config=NGRAM)
    assert got == ref
    assert s.num_preemptions > 0 and s.prefix_cache_hits > 0
    assert_spec_exercised(s)


def test_penalties_logprobs_min_tokens_and_stops_see_accepted_tokens(tiny_v2, workload):
    """Each request's sampling state (penalties over its outputs, min_tokens, logprobs, stop
    ids and strings, max_tokens) is the one a plain decode would have at that position."""
    path = tiny_v2[0]
    base, _ = generate(path, workload[:1], GREEDY)
    stop_text = base[0][2][6:9]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.4, presence_penalty=0.2),
              SamplingParams(temperature=0, max_tokens=20, min_tokens=6, stop_token_ids=[base[0][0][2]]),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop_text])]
    prompts = [workload[0], workload[0], workload[0], workload[2], workload[0]]
    ref, _ = generate(path, prompts, params)
    got, s = generate(path, prompts, params, speculative_config=NGRAM)
    assert_same(got, ref)
    assert ref[0][3] and ref[4][1] == "stop" and ref[3][1] == "length" and len(ref[3][0]) == 7
    assert s.spec.num_accepted_tokens > 0


def test_seeded_sampling_with_speculation_equals_without(tiny_v3, workload):
    """A seeded request draws one noise vector per output token, as without speculation, so
    its stream is the same token for token (and reproducible)."""
    params = [SamplingParams(temperature=1.0, seed=40 + i, max_tokens=16, ignore_eos=True, top_k=4)
              for i in range(len(workload))]
    ref, _ = generate(tiny_v3[0], workload, params)
    got, s = generate(tiny_v3[0], workload, params, speculative_config=NGRAM)
    again, _ = generate(tiny_v3[0], workload, params, speculative_config=NGRAM, num_kv_blocks=24)
    assert got == ref == again
    assert_spec_exercised(s)


@pytest.mark.parametrize("tp,dcp", [(2, 2), (4, 4)])
def test_greedy_with_speculation_under_dcp_equals_one_rank(tiny_v3, workload, tp, dcp):
    """-tp N -dcp N on the CPU (gloo): every rank holds 1/N of each sequence's keys, so a draft
    row's keys differ per rank (the per-token mask over interleaved shards)."""
    path = tiny_v3[0]
    ref, _ = generate(path, workload, GREEDY, max_num_batched_tokens=16)
    got, s = generate(path, workload, GREEDY, max_num_batched_tokens=16, speculative_config=NGRAM,
                      tensor_parallel_size=tp, decode_context_parallel_size=dcp, num_kv_blocks=256 // dcp)
    assert got == ref
    assert s.spec.num_accepted_tokens > 0


def two_sample_chi2_pvalue(a: list, b: list) -> float:
    """p-value of Pearson's chi-square test that samples a and b come from one distribution
    (categories with fewer than 10 draws in all pooled into one)."""
    from collections import Counter
    ca, cb = Counter(a), Counter(b)
    cats = sorted(set(ca) | set(cb), key=lambda c: -(ca[c] + cb[c]))
    rows, rare = [], [0, 0]
    for c in cats:
        if ca[c] + cb[c] >= 10:
            rows.append([ca[c], cb[c]])
        else:
            rare[0] += ca[c]
            rare[1] += cb[c]
    if sum(rare):
        rows.append(rare)
    t = torch.tensor(rows, dtype=torch.float64)  # [m, 2]
    expected = t.sum(1, keepdim=True) * t.sum(0, keepdim=True) / t.sum()
    stat = ((t - expected) ** 2 / expected).sum()
    df = t.shape[0] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_sampled_tokens_keep_the_target_distribution(tiny_v3):
    """Temperature 1, many seeds: output tokens at positions 1..4 (sampled, with speculation, by
    steps that verify drafts for most requests) are distributed as without speculation."""
    path = tiny_v3[0]
    torch.manual_seed(11)
    seed_prompt = torch.randint(2, 320, (8,)).tolist()
    # the model's own greedy continuation: its likely tokens recur in it, so drafts are found
    prompt = seed_prompt + generate(path, [seed_prompt], SamplingParams(temperature=0, max_tokens=24,
                                                                        ignore_eos=True))[0][0][0]
    N = 400

    def tokens(seeds, **kw):
        params = [SamplingParams(temperature=1.0, top_k=3, seed=s, max_tokens=5, ignore_eos=True) for s in seeds]
        outs, stats = generate(path, [prompt] * N, params, **kw)
        return [o[0] for o in outs], stats

    plain, _ = tokens(range(N))
    spec, s = tokens(range(N, 2 * N), speculative_config=NGRAM)
    assert_spec_exercised(s)
    assert s.spec.num_drafts >= N  # on average a request verified drafts at least once
    for pos in (1, 2, 3, 4):
        a, b = [t[pos] for t in plain], [t[pos] for t in spec]
        assert len(set(a)) > 2  # a distribution, not a constant
        p = two_sample_chi2_pvalue(a, b)
        assert p > 1e-3, f"output position {pos}: distributions differ (chi-square p = {p:.2e})"
    # the test can tell distributions apart: position 1 against position 2 differ
    assert two_sample_chi2_pvalue([t[1] for t in plain], [t[2] for t in plain]) < 1e-3


def test_spec_decode_metrics_use_vllm_names(tiny_v3, workload):
    """The engine's counters reach /metrics under vLLM's spec_decode names (and ours)."""
    from types import SimpleNamespace

    from engine.async_llm import EngineStats
    from server.metrics import ServerMetrics
    _, s = generate(tiny_v3[0], workload, GREEDY, speculative_config=NGRAM)
    sp = s.spec
    assert sp.num_drafts > 0 and sum(sp.accepted_per_pos) == sp.num_accepted_tokens
    assert sp.accepted_per_pos == sorted(sp.accepted_per_pos, reverse=True)  # position i needs i-1
    stats = EngineStats(0, 0, 10, 10, 0.0, 0, 0, 0, 0, 0, 0, None, sp)
    engine = SimpleNamespace(stats=lambda: stats, model_name="m", max_model_len=256)
    text = ServerMetrics(engine).render().decode()
    for name, value in (("num_drafts", sp.num_drafts), ("num_draft_tokens", sp.num_draft_tokens),
                        ("num_accepted_tokens", sp.num_accepted_tokens)):
        assert f'vllm:spec_decode_{name}_total{{engine="0",model_name="m"}} {float(value)}' in text
        assert f"mla_serve_spec_decode_{name}_total {float(value)}" in text
    for pos, value in enumerate(sp.accepted_per_pos):
        assert (f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="{pos}"}} '
                f'{float(value)}') in text


def test_mean_acceptance_length_is_logged(tiny_v3, workload, caplog):
    llm = LLM(tiny_v3[0], device="cpu", dtype="float32", block_size=4, num_kv_blocks=256,
              speculative_config=NGRAM)
    try:
        llm.generate(workload, GREEDY)
        sp = llm.scheduler.stats.spec
        core = llm.engine
        core._spec_logged = (core._spec_logged[0] - 11, 0, 0, 0)  # the interval has passed
        with caplog.at_level("INFO", logger="engine.core"):
            core._log_spec_decode()
        want = f"mean acceptance length {1 + sp.num_accepted_tokens / sp.num_drafts:.2f}"
        assert any(want in r.getMessage() for r in caplog.records), caplog.text
        caplog.clear()
        with caplog.at_level("INFO", logger="engine.core"):
            core._log_spec_decode()  # nothing new, and the interval has not passed
        assert not caplog.records
        # a server's core leaves the line to the front end's stats line (--disable-log-stats)
        core.serving = True
        core._spec_logged = (core._spec_logged[0] - 11, 0, 0, 0)
        with caplog.at_level("INFO", logger="engine.core"):
            llm.generate(workload[:1], GREEDY)
        assert not any("speculative decoding" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        llm.engine.shutdown()
