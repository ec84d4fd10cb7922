"""Engine on tiny transformers models: greedy outputs equal `generate()` under every schedule."""

from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, SamplingParams

LENS = (5, 17, 33, 64, 3, 40, 12, 50)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def prompts_and_refs(tiny_v3):
    path, hf = tiny_v3
    torch.manual_seed(3)
    prompts = [torch.randint(2, 320, (n,)).tolist() for n in LENS]
    refs = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    return prompts, refs


def make_llm(path, **kw):
    return LLM(path, device="cpu", dtype="float32", **({"num_kv_blocks": 256} | kw))


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 8}, {"max_num_seqs": 2},
                                {"max_num_batched_tokens": 16, "block_size": 4},
                                {"max_num_batched_tokens": 32, "long_prefill_token_threshold": 5}],
                         ids=["default", "budget8", "seqs2", "budget16-block4", "long-prefill5"])
def test_greedy_equals_transformers(tiny_v3, prompts_and_refs, kw):
    prompts, refs = prompts_and_refs
    llm = make_llm(tiny_v3[0], **kw)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == refs
    s = llm.scheduler.stats
    assert s.num_free_blocks == s.num_total_blocks


def test_greedy_under_preemption(tiny_v3, prompts_and_refs):
    prompts, refs = prompts_and_refs
    llm = make_llm(tiny_v3[0], num_kv_blocks=22, block_size=4)  # 88 tokens for 8 requests
    outs = llm.generate(prompts, GREEDY)
    assert llm.scheduler.stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == refs


def test_prefix_cache_hits_keep_outputs(tiny_v3):
    path, hf = tiny_v3
    torch.manual_seed(4)
    shared = torch.randint(2, 320, (37,)).tolist()
    prompts = [shared + torch.randint(2, 320, (n,)).tolist() for n in (3, 9, 20, 1)]
    refs = [hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    llm = make_llm(path, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = llm.generate(prompts[:1], params)
    rest = llm.generate(prompts[1:], params)
    assert llm.scheduler.stats.prefix_cache_hits >= 3 * 36
    assert all(o.num_cached_tokens >= 36 for o in rest)
    assert [o.outputs[0].token_ids for o in first + rest] == refs


def test_seeded_sampling_independent_of_batch(tiny_v3):
    llm = make_llm(tiny_v3[0])
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(["Hello world"], p)[0].outputs[0]
    others = [SamplingParams(temperature=0.7, max_tokens=n, ignore_eos=True) for n in range(3, 10)]
    batch = llm.generate(["The quick", "Hello", "A", "Question:", "fox", "dog", "Hello world", "x"][:7]
                         + ["Hello world"], others + [p])
    assert batch[-1].outputs[0].token_ids == alone.token_ids
    assert batch[-1].outputs[0].text == alone.text


def test_n_samples_and_logprobs(tiny_v3):
    llm = make_llm(tiny_v3[0])
    out = llm.generate(["Hello"], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6,
                                                 ignore_eos=True, logprobs=2, prompt_logprobs=1))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.logprobs) == 6 and all(len(lp.top) == 2 for lp in c.logprobs)
        assert [lp.token_id for lp in c.logprobs] == c.token_ids
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert [lp.token_id for lp in out.prompt_logprobs[1:]] == out.prompt_token_ids[1:]


def test_prompt_logprobs_in_row_chunks(tiny_v3, monkeypatch):
    """The runner computes a prompt's logprobs a few rows at a time (engine.logprobs bounds the
    logits held at once), equal to those of one chunk."""
    import engine.logprobs as el
    llm = make_llm(tiny_v3[0], enable_prefix_caching=False)  # the second run computes the whole prompt again
    V = llm.engine.cfg.vocab_size
    prompt = torch.randint(2, 320, (41,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    whole = llm.generate([prompt], params)[0].prompt_logprobs
    monkeypatch.setattr(el, "PROMPT_LOGPROB_CHUNK_BYTES", 3 * el.PROMPT_LOGPROB_BYTES_PER_ENTRY * V)
    assert el.prompt_logprob_rows(V) == 3 and el.prompt_logprob_rows(10 * V) == 1
    rows, real = [], el.prompt_logprobs_on_device
    monkeypatch.setattr(el, "prompt_logprobs_on_device", lambda lg, *a: rows.append(lg.shape[0]) or real(lg, *a))
    chunked = llm.generate([prompt], params)[0].prompt_logprobs
    assert rows and max(rows) == 3 and sum(rows) == 40, rows  # the runner's logits came in chunks
    assert whole[0] is None is chunked[0] and len(whole) == len(chunked) == 41
    for a, b in zip(whole[1:], chunked[1:]):
        assert (a.token_id, a.rank, [t for t, _ in a.top]) == (b.token_id, b.rank, [t for t, _ in b.top])
        assert math.isclose(a.logprob, b.logprob, abs_tol=1e-5)


@pytest.mark.parametrize("prompt,params,field", [
    ("", SamplingParams(), "prompt"),
    ([5, 320], SamplingParams(), "token id 320"),
    ([5] * 250, SamplingParams(max_tokens=10), "10 in the completion: max_tokens"),
    ([5, 6], SamplingParams(allowed_token_ids=[7, 10**6]), "allowed_token_ids"),
    ([5, 6], SamplingParams(bad_words_token_ids=[[7, 10**6]]), "bad_words: token id 1000000"),
    ([5, 6], SamplingParams(allowed_token_ids=[7], bad_words_token_ids=[[7]]), "nothing could be sampled"),
    ([5, 6], SamplingParams(allowed_token_ids=[7, 8], stop_token_ids=[7, 8], min_tokens=1),
     "nothing could be sampled"),
])
def test_bad_input_named_and_engine_keeps_serving(tiny_v3, prompt, params, field):
    llm = make_llm(tiny_v3[0])
    with pytest.raises(ValueError, match=field):
        llm.generate([prompt], params)
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_max_tokens_past_a_small_kv_cache_is_refused(tiny_v3):
    """A KV cache smaller than the context (16 blocks of 4: 64 tokens) bounds a request too: it
    can grow to 65 tokens (the last one is never cached), so a max_tokens past that is a
    ValueError naming it, and without max_tokens the request stops there, as with max_tokens 15."""
    llm = make_llm(tiny_v3[0], num_kv_blocks=16, block_size=4)
    with pytest.raises(ValueError, match=r"max_tokens: 16 after a prompt of 50 tokens .* at most 15"):
        llm.generate([[5] * 50], SamplingParams(max_tokens=16))
    for max_tokens in (15, None):
        out = llm.generate([[5] * 50], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].outputs[0]
        assert len(out.token_ids) == 15 and out.finish_reason == "length"


def test_engine_core_checks_token_ids_itself(tiny_v3):
    """The core refuses ids outside the vocabulary on its own, for callers that skip the
    InputProcessor (the engine process's socket, tests), and queues nothing."""
    llm = make_llm(tiny_v3[0])
    core = llm.engine
    for params, field in ((SamplingParams(stop_token_ids=[10**6]), "stop_token_ids: token id 1000000"),
                          (SamplingParams(logit_bias={10**6: 1.0}), "logit_bias: token id 1000000"),
                          (SamplingParams(allowed_token_ids=[7], bad_words_token_ids=[[7]]),
                           "nothing could be sampled")):
        with pytest.raises(ValueError, match=field):
            core.add_request("direct", [5, 6], params)
        assert not core.has_unfinished_requests()


@pytest.mark.parametrize("kw,field", [({"top_p": 0.0}, "top_p"), ({"temperature": -1.0}, "temperature"),
                                      ({"max_tokens": 0}, "max_tokens"), ({"n": 0}, "n "),
                                      ({"logprobs": 99}, "logprobs")])
def test_bad_sampling_params_named(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_stop_strings_and_stop_tokens(tiny_v3):
    llm = make_llm(tiny_v3[0])
    base = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    stop = base.text[3:6]
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                 stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.index(stop)]
    tok = base.token_ids[4]
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                 stop_token_ids=[tok]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == tok
    assert out.token_ids == base.token_ids[: base.token_ids.index(tok) + 1]
    s = llm.scheduler.stats
    assert s.num_free_blocks == s.num_total_blocks


def test_seeded_sampling_survives_preemption(tiny_v3, prompts_and_refs):
    prompts, _ = prompts_and_refs
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
              for i in range(len(prompts))]
    roomy = make_llm(tiny_v3[0], block_size=4)
    tight = make_llm(tiny_v3[0], num_kv_blocks=22, block_size=4)
    a = roomy.generate(prompts, params)
    b = tight.generate(prompts, params)
    assert tight.scheduler.stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_warm_up_meets_every_token_bucket_and_leaves_serving_unchanged(tiny_v3, prompts_and_refs):
    """Worker.warm_up (run before graph capture, so that autotuned kernels never tune while
    serving): one prefill step per power of two up to the budget and the budget itself, on a cache
    smaller than its largest step (block ids wrap, never out of range), with steps past the
    model's context (256 positions) split into several prompts, then 64 prompts of 2 tokens, their
    decode step, mixed steps of 8 and 64 sequences (half decodes, half chunks after cached tokens:
    the context attention runs), one of 63 decodes beside a chunk, and 2 decodes over wide block tables; greedy outputs after it still equal
    transformers'."""
    prompts, refs = prompts_and_refs
    llm = make_llm(tiny_v3[0], num_kv_blocks=40, block_size=4, max_num_batched_tokens=600)
    worker = llm.engine.executor.worker
    seen = []
    model_forward = worker.model.forward
    worker.model.forward = lambda ids, pos, caches, meta: (
        seen.append((ids.shape[0], int(pos.max()), meta)) or model_forward(ids, pos, caches, meta))
    try:
        assert worker.warm_up(600, 256, 256) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 600]  # 600 tokens: 150 blocks > 40
    finally:
        del worker.model.forward
    assert [n for n, _, _ in seen] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 600, 128, 64, 12, 96, 65, 2]
    assert max(p for _, p, _ in seen) == 255  # no position past the model's 256
    mixed, most, wide = seen[-3][2], seen[-2][2], seen[-1][2]
    assert (mixed.num_decodes, mixed.num_prefills, mixed.prefill.num_context_prefills) == (32, 32, 32)
    assert (most.num_decodes, most.num_prefills) == (63, 1)  # absorb_q's tiles past 32 decode rows
    assert (wide.num_decodes, wide.prefill) == (2, None)
    assert wide.decode.block_table.shape == (2, 256 // 4)  # the longest sequence, in 4-token blocks
    worker._profile_run(600)  # the CUDA start-up's memory probe: the same split (no IndexError)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == refs


def test_warm_up_with_speculation_runs_a_multi_token_decode(tiny_v3):
    """With k = 2 draft tokens a decode carries 3 query tokens: the warm-up's mixed step uses
    chunks of 4 (the shortest prefill), and a step decodes 3 tokens for each of its 16 sequences
    (a budget of 64 tokens: 16 chunks of 4), after mixed steps of 8 and 16 sequences (and 15 decodes
    beside one chunk)."""
    llm = make_llm(tiny_v3[0], num_kv_blocks=40, block_size=4, max_num_batched_tokens=64,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    worker = llm.engine.executor.worker
    seen = []
    model_forward = worker.model.forward
    worker.model.forward = lambda ids, pos, caches, meta: seen.append(meta) or model_forward(ids, pos, caches, meta)
    try:
        worker.warm_up(64, 256, 256)
    finally:
        del worker.model.forward
    small, mixed, most, multi = seen[-5:-1]
    assert (most.num_decodes, most.num_prefills) == (15, 1)
    assert (small.num_decodes, small.num_prefills, small.num_prefill_tokens) == (4, 4, 16)
    assert (mixed.num_decodes, mixed.num_prefills, mixed.prefill.num_context_prefills) == (8, 8, 8)
    assert mixed.num_decode_tokens == 8 and mixed.num_prefill_tokens == 32
    assert (multi.num_decodes, multi.num_decode_tokens, multi.prefill) == (16, 48, None)


def test_allowed_token_ids(tiny_v3):
    llm = make_llm(tiny_v3[0])
    allowed = [11, 12, 13]
    outs = llm.generate(["Hello", "Question"], [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed),
        SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed)])
    for out in outs:
        assert set(out.outputs[0].token_ids) <= set(allowed), out.outputs[0].token_ids


def test_bad_words(tiny_v3):
    """Greedy output, then the same with one of its two-token pairs banned: the pair's second
    token no longer follows its first, and the output up to there is unchanged."""
    llm = make_llm(tiny_v3[0])
    base = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    free = llm.generate(["Hello"], base)[0].outputs[0].token_ids
    pair = free[3:5]
    banned = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                    bad_words_token_ids=[pair]))[0].outputs[0].token_ids
    assert banned[:4] == free[:4] and banned[4] != pair[1]
    assert all(banned[i:i + 2] != pair for i in range(len(banned) - 1))
    one = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                 bad_words_token_ids=[[free[0]]]))[0].outputs[0].token_ids
    assert free[0] not in one


def test_allowed_tokens_banned_by_a_bad_word_end_in_an_error(tiny_v3):
    """allowed_token_ids [11] with the bad word [11, 11]: after one 11 the only allowed token is
    banned. The request ends in an error after that token, naming allowed_token_ids, where the
    sampler would have taken a token off the list from a row of -inf (an adversarial pass found
    token 0 there); likewise [11, 12] below min_tokens 3 with 12 a stop token and [11, 11] banned."""
    from common.sampling_params import nothing_to_sample
    llm = make_llm(tiny_v3[0])
    dead = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, allowed_token_ids=[11],
                          bad_words_token_ids=[[11, 11]])
    stops = SamplingParams(temperature=1.0, seed=1, max_tokens=5, ignore_eos=True, allowed_token_ids=[11, 12],
                           bad_words_token_ids=[[11, 11]], stop_token_ids=[12], min_tokens=3)
    for params in (dead, stops):
        o = llm.generate(["Hello"], params)[0].outputs[0]
        assert o.token_ids == [11] and o.finish_reason == "error", (o.token_ids, o.finish_reason)
        assert str(o.stop_reason).startswith("allowed_token_ids: after 1 output tokens every listed token")
    # the check itself: only where the output ends with the bad word's first token, below min_tokens
    assert nothing_to_sample(stops, [11], None) and not nothing_to_sample(stops, [12], None)
    assert not nothing_to_sample(SamplingParams(allowed_token_ids=[11, 12], bad_words_token_ids=[[11, 11]]),
                                 [11], None)
