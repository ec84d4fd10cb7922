"""Sampler tests: greedy, filters, seeded reproducibility, distribution, penalties, logprobs."""

import math

import pytest
import torch

from engine.logprobs import compute_prompt_logprobs
from engine.sampler import Sampler, SamplingBatch, _apply_penalties, make_generator
from common.sampling_params import SamplingParams

V = 32


def batch_of(params, outputs=None, prompts=None, generators=None, eos=(), device="cpu"):
    n = len(params)
    return SamplingBatch.from_params(
        params, prompts or [[] for _ in range(n)], outputs or [[] for _ in range(n)],
        generators or [None] * n, list(eos), device)


def random_logits(n, vocab=V, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * scale


def test_greedy_is_argmax():
    logits = random_logits(6)
    batch = batch_of([SamplingParams(temperature=0.0)] * 6)
    assert batch.all_greedy
    out = Sampler()(logits, batch)
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None


def test_bf16_logits_sample_as_their_fp32_values():
    """The runner hands the LM head's bf16 logits over: a greedy batch that nothing modifies takes
    their argmax as they are (exact: bf16 -> fp32 loses nothing), ties to the first index as in
    fp32; a batch with a modifier or a sampled row converts them first. Each case equals the
    sampler on the same values in fp32."""
    logits = (random_logits(8, seed=3) * 4).round() / 4  # coarse values: ties within rows
    logits[2, 5] = logits[2, 9] = logits[2].max() + 1  # an exact tie for the maximum
    lp16 = logits.to(torch.bfloat16)
    lp32 = lp16.float()
    cases = [[SamplingParams(temperature=0.0)] * 8,
             [SamplingParams(temperature=0.0, logprobs=2)] * 8,
             [SamplingParams(temperature=0.0, logit_bias={3: 2.5})] * 8,
             [SamplingParams(temperature=0.0, presence_penalty=1.5)] * 8,
             [SamplingParams(temperature=0.0, min_tokens=2)] * 8,
             [SamplingParams(temperature=0.0)] * 7 + [SamplingParams(temperature=1.0, seed=1)]]
    for params in cases:
        b = batch_of(params, outputs=[[3]] * 8, eos=[6])
        assert b.unmodified == (params[0].logit_bias is None and params[0].presence_penalty == 0.0
                                and params[0].min_tokens == 0)
        gens = [make_generator(p.seed, "cpu") if p.seed is not None else None for p in params]
        got = Sampler()(lp16, batch_of(params, outputs=[[3]] * 8, eos=[6], generators=gens))
        gens = [make_generator(p.seed, "cpu") if p.seed is not None else None for p in params]
        want = Sampler()(lp32, batch_of(params, outputs=[[3]] * 8, eos=[6], generators=gens))
        assert torch.equal(got.token_ids, want.token_ids), params[0]
        assert (got.logprobs is None) == (want.logprobs is None)
        for a, b_ in zip(got.logprobs or [], want.logprobs or []):
            assert (a.token_id, a.rank, a.top) == (b_.token_id, b_.rank, b_.top)
    assert int(Sampler()(lp16, batch_of([SamplingParams(temperature=0.0)] * 8)).token_ids[2]) == 5


def test_mixed_batch_greedy_rows_take_argmax():
    logits = random_logits(6, scale=0.1)  # flat: sampled rows rarely hit the argmax by chance
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(6)]
    torch.manual_seed(0)
    for _ in range(5):
        ids = Sampler()(logits, batch_of(params)).token_ids
        assert torch.equal(ids[0::2], logits.argmax(-1)[0::2])


def test_top_k_1_equals_greedy():
    logits = random_logits(8, scale=0.5)
    batch = batch_of([SamplingParams(temperature=1.5, top_k=1)] * 8)
    torch.manual_seed(1)
    for _ in range(5):
        assert torch.equal(Sampler()(logits, batch).token_ids, logits.argmax(-1))


@pytest.mark.parametrize("top_p", [1e-6, 1e-46])  # 1e-46 > 0, but 0 in fp32
def test_tiny_top_p_is_argmax(top_p):
    logits = random_logits(8, scale=0.5)
    batch = batch_of([SamplingParams(temperature=1.0, top_p=top_p)] * 8)
    torch.manual_seed(2)
    for _ in range(5):
        assert torch.equal(Sampler()(logits, batch).token_ids, logits.argmax(-1))


def _draw_many(row_logits, params, n=3000, seed=0):
    logits = row_logits.unsqueeze(0).expand(n, -1).contiguous()
    torch.manual_seed(seed)
    return Sampler()(logits, batch_of([params] * n)).token_ids


def test_top_k_and_top_p_keep_the_right_sets():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    row = probs.log()
    assert set(_draw_many(row, SamplingParams(top_k=2)).tolist()) == {0, 1}
    # top_p 0.8: 0.4 + 0.3 = 0.7 < 0.8, so token 2 is needed; token 3 is not
    assert set(_draw_many(row, SamplingParams(top_p=0.8)).tolist()) == {0, 1, 2}
    # both: top_k 4 then top_p 0.8 renormalised over the 4 kept tokens (mass 0.95)
    assert set(_draw_many(row, SamplingParams(top_k=4, top_p=0.75)).tolist()) == {0, 1, 2}


def test_min_p_filters_relative_to_the_max():
    probs = torch.tensor([0.4, 0.25, 0.19, 0.1, 0.06])
    ids = _draw_many(probs.log(), SamplingParams(min_p=0.45))  # threshold 0.18
    assert set(ids.tolist()) == {0, 1, 2}
    assert set(_draw_many(probs.log(), SamplingParams(min_p=0.0)).tolist()) == {0, 1, 2, 3, 4}
    # vLLM's order, min_p before top_p: min_p keeps 0-2 (renormalised 0.476 / 0.298 / 0.226),
    # then top_p 0.75 needs only 0 and 1 (0.774); top_p first would keep 0-2 (0.4 + 0.25 < 0.75)
    assert set(_draw_many(probs.log(), SamplingParams(min_p=0.45, top_p=0.75)).tolist()) == {0, 1}


def test_top_k_candidate_path_equals_full_sort():
    logits = random_logits(16, scale=1.0)
    params = [SamplingParams(temperature=0.9, top_k=k, top_p=p)
              for k, p in zip([1, 3, 7, 30] * 4, [1.0, 0.5, 0.9, 0.99] * 4)]
    fast = batch_of(params)
    assert fast.max_top_k == 30
    slow = batch_of(params)
    slow.max_top_k = None
    for seed in range(5):
        torch.manual_seed(seed)
        a = Sampler()(logits, fast).token_ids
        torch.manual_seed(seed)
        b = Sampler()(logits, slow).token_ids
        assert torch.equal(a, b)
    # a row without top_k forces the full sort
    assert batch_of([SamplingParams(top_k=3), SamplingParams(top_p=0.5)]).max_top_k is None


def _chi_square(ids, probs):
    counts = torch.bincount(ids, minlength=probs.numel()).double()
    expected = probs.double() * ids.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_temperature_sampling_matches_softmax():
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    temp = 0.7
    ids = _draw_many(row, SamplingParams(temperature=temp), n=20000, seed=3)
    expected = torch.softmax(row / temp, dim=-1)
    # 5 degrees of freedom: chi2 > 20.5 has probability 0.001
    assert _chi_square(ids, expected) < 20.5
    # the test can fail: the untempered distribution is far off
    assert _chi_square(ids, torch.softmax(row, dim=-1)) > 100


def test_seeded_rows_follow_softmax():
    row = torch.tensor([0.3, -0.2, 1.0, 0.0])
    n = 4000
    logits = row.unsqueeze(0).expand(n, -1).contiguous()
    gens = [make_generator(10_000 + i, "cpu") for i in range(n)]
    ids = Sampler()(logits, batch_of([SamplingParams(seed=1)] * n, generators=gens)).token_ids
    assert _chi_square(ids, torch.softmax(row, dim=-1)) < 16.3  # 3 dof, p = 0.001


def _seeded_stream(seed, position, batch_size, others, steps=12, device="cpu"):
    """Tokens drawn by one seeded request placed at `position` among `others`."""
    gens = []
    for i in range(batch_size):
        if i == position:
            gens.append(make_generator(seed, device))
        else:
            s = others[i % len(others)]
            gens.append(None if s is None else make_generator(s, device))
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=20, seed=0)] * batch_size
    stream = []
    for step in range(steps):
        logits = random_logits(batch_size, seed=100 + step, scale=0.8)
        logits[position] = random_logits(1, seed=1000 + step, scale=0.8)[0]
        out = Sampler()(logits.to(device), batch_of(params, generators=gens, device=device))
        stream.append(int(out.token_ids[position]))
    return stream


def test_seeded_rows_reproducible_across_batch_compositions():
    torch.manual_seed(5)
    alone = _seeded_stream(1234, 0, 1, [None])
    assert len(set(alone)) > 3  # the stream really is random
    torch.manual_seed(6)
    assert _seeded_stream(1234, 3, 8, [None, 7, None, 99]) == alone
    torch.manual_seed(7)
    assert _seeded_stream(1234, 7, 8, [5, None]) == alone
    torch.manual_seed(8)
    assert _seeded_stream(1234, 0, 8, [None]) == alone
    assert _seeded_stream(4321, 0, 1, [None]) != alone


def test_penalties_against_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    prompt, output = [0, 4], [2, 2, 3]
    batch = SamplingBatch(
        temperature=torch.tensor([1.0]), all_greedy=False,
        repetition_penalty=torch.tensor([2.0]), frequency_penalty=torch.tensor([0.5]),
        presence_penalty=torch.tensor([0.25]),
        prompt_token_ids=[prompt], output_token_ids=[output])
    got = _apply_penalties(logits, batch)[0].tolist()
    want = [2.0 / 2, -1.0, 0.5 / 2 - 0.5 * 2 - 0.25, 3.0 / 2 - 0.5 * 1 - 0.25, -2.0 * 2, 1.0]
    assert got == pytest.approx(want)

    # each penalty alone
    def only(**kw):
        b = SamplingBatch(temperature=torch.tensor([1.0]), all_greedy=False,
                          prompt_token_ids=[prompt], output_token_ids=[output],
                          **{k: torch.tensor([v]) for k, v in kw.items()})
        return _apply_penalties(logits, b)[0].tolist()

    assert only(repetition_penalty=2.0) == pytest.approx([1.0, -1.0, 0.25, 1.5, -4.0, 1.0])
    assert only(frequency_penalty=0.5) == pytest.approx([2.0, -1.0, -0.5, 2.5, -2.0, 1.0])
    assert only(presence_penalty=0.25) == pytest.approx([2.0, -1.0, 0.25, 2.75, -2.0, 1.0])

    # rows are counted separately, empty histories included
    two = SamplingBatch(temperature=torch.tensor([1.0, 1.0]), all_greedy=False,
                        frequency_penalty=torch.tensor([1.0, 1.0]), output_token_ids=[[], [5, 5]])
    got = _apply_penalties(logits.repeat(2, 1), two)
    assert torch.equal(got[0], logits[0])
    assert got[1].tolist() == pytest.approx([2.0, -1.0, 0.5, 3.0, -2.0, -1.0])


def test_extreme_repetition_penalties_keep_the_row_finite():
    """A penalty near 0 or huge (vLLM accepts any > 0) must not turn a logit to inf and the
    row's softmax to NaN (whose sample is garbage, token 0)."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    for rep in (1e-39, 3e38):  # both finite in fp32, as the core's check requires
        p = SamplingParams(temperature=1.0, repetition_penalty=rep, seed=0)
        batch = batch_of([p], outputs=[[2, 3, 4]])
        penalized = _apply_penalties(logits, batch)
        assert torch.isfinite(penalized).all()
        if rep < 1:  # the seen positives 0.5 and 3.0 both saturate, also after a divide by 0.5
            for seed in range(8):
                q = SamplingParams(temperature=0.5, repetition_penalty=rep, seed=seed)
                assert Sampler()(logits, batch_of([q], outputs=[[2, 3, 4]])).token_ids.item() in (2, 3)
        else:  # the seen negative (token 4) goes to the bottom; the best unseen (0) leads
            assert penalized[0].argmax().item() == 0 and penalized[0, 4] < -1e30
    # a banned token (-inf) stays banned whatever the penalty does to it
    banned = logits.clone()
    banned[0, 4] = float("-inf")
    b = batch_of([SamplingParams(temperature=1.0, repetition_penalty=3e38)], outputs=[[4]])
    assert _apply_penalties(banned, b)[0, 4].item() == float("-inf")


def test_penalties_change_greedy_choice_and_min_tokens_masks_eos():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert Sampler()(logits, batch_of([p], outputs=[[1]])).token_ids.tolist() == [2]
    p = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    assert Sampler()(logits, batch_of([p], outputs=[[1, 1]])).token_ids.tolist() == [2]
    # min_tokens: eos (1) and stop id (2) are forbidden until 3 tokens exist
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[2])
    assert Sampler()(logits, batch_of([p], outputs=[[0]], eos=[1])).token_ids.tolist() == [3]
    assert Sampler()(logits, batch_of([p], outputs=[[0, 0, 0]], eos=[1])).token_ids.tolist() == [1]
    # (under ignore_eos too: tests/test_sampler_ties.py)


def test_logprobs_are_raw_with_rank_and_top():
    logits = random_logits(5, seed=9)
    params = [SamplingParams(temperature=0.8, top_k=5, logprobs=3, presence_penalty=1.0)] * 3 \
        + [SamplingParams(temperature=0.0, logprobs=1)] * 2
    torch.manual_seed(10)
    out = Sampler()(logits, batch_of(params, outputs=[[0, 1]] * 5))
    ref = torch.log_softmax(logits, dim=-1)
    assert len(out.logprobs) == 5
    for row, lp in enumerate(out.logprobs):
        tok = int(out.token_ids[row])
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(float(ref[row, tok]), abs=1e-6)
        assert lp.rank == int((ref[row] > ref[row, tok]).sum()) + 1
        vals, ids = ref[row].topk(3)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(vals.tolist(), abs=1e-6)
    # with penalties on, the greedy rows' rank is computed on the raw distribution
    assert out.logprobs[3].rank == int((ref[3] > ref[3, out.token_ids[3]]).sum()) + 1


def test_zero_logprobs_gives_empty_top():
    logits = random_logits(2)
    out = Sampler()(logits, batch_of([SamplingParams(temperature=0.0, logprobs=0)] * 2))
    assert [lp.top for lp in out.logprobs] == [[], []]
    assert [lp.rank for lp in out.logprobs] == [1, 1]


def test_prompt_logprobs():
    logits = random_logits(7, seed=11)
    nxt = torch.tensor([3, 0, 31, 5, 5, 17, 2])
    res = compute_prompt_logprobs(logits, nxt, 2)
    ref = torch.log_softmax(logits, dim=-1)
    for m, lp in enumerate(res):
        t = int(nxt[m])
        assert lp.token_id == t
        assert math.isclose(lp.logprob, float(ref[m, t]), abs_tol=1e-6)
        assert lp.rank == 1 + int((ref[m] > ref[m, t]).sum())
        assert [i for i, _ in lp.top] == ref[m].topk(2).indices.tolist()
    assert compute_prompt_logprobs(logits[:0], nxt[:0], 2) == []
    with pytest.raises(ValueError, match="next_token_ids"):
        compute_prompt_logprobs(logits, nxt[:3], 2)


@pytest.mark.parametrize("num_top", [0, 2])
def test_prompt_logprobs_chunked_equal_whole(monkeypatch, num_top):
    import engine.logprobs as el
    logits, nxt = random_logits(7, seed=11), torch.tensor([3, 0, 31, 5, 5, 17, 2])
    V = logits.shape[1]
    whole = list(el.prompt_logprobs_chunked(lambda h: h, logits, nxt, num_top, V))
    monkeypatch.setattr(el, "PROMPT_LOGPROB_CHUNK_BYTES", 3 * el.PROMPT_LOGPROB_BYTES_PER_ENTRY * V)
    seen = []
    chunked = list(el.prompt_logprobs_chunked(lambda h: seen.append(h.shape[0]) or h, logits, nxt, num_top, V))
    assert seen == [3, 3, 1] and chunked == whole == compute_prompt_logprobs(logits, nxt, num_top)


def test_from_params_leaves_unused_fields_none():
    b = batch_of([SamplingParams(temperature=0.0), SamplingParams()])
    assert not b.all_greedy
    assert b.top_p is None and b.top_k is None and b.min_p is None
    assert b.repetition_penalty is None and b.max_num_logprobs is None
    assert b.min_tokens_masked_ids is None and len(b.generators) == 0
    b = batch_of([SamplingParams(logprobs=2), SamplingParams(logprobs=5, top_k=3)])
    assert b.max_num_logprobs == 5 and b.top_k.tolist() == [0, 3]
    with pytest.raises(ValueError, match="one prompt"):
        SamplingBatch.from_params([SamplingParams()], [], [[]], [None], [], "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_greedy_and_seeded_reproducibility():
    logits = random_logits(4).cuda()
    greedy = Sampler()(logits, batch_of([SamplingParams(temperature=0.0)] * 4, device="cuda"))
    assert torch.equal(greedy.token_ids.cpu(), logits.argmax(-1).cpu())
    alone = _seeded_stream(1234, 0, 1, [None], device="cuda")
    assert len(set(alone)) > 3
    assert _seeded_stream(1234, 5, 8, [None, 7, None, 99], device="cuda") == alone
    assert _seeded_stream(1234, 7, 8, [5, None], device="cuda") == alone


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_temperature_sampling_matches_softmax():
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    n = 20000
    logits = row.unsqueeze(0).expand(n, -1).contiguous().cuda()
    torch.manual_seed(3)
    ids = Sampler()(logits, batch_of([SamplingParams(temperature=0.7)] * n, device="cuda"))
    assert _chi_square(ids.token_ids.cpu(), torch.softmax(row / 0.7, dim=-1)) < 20.5


def test_logit_bias_moves_greedy_and_sampled_rows_and_leaves_logprobs_raw():
    logits = random_logits(4)
    low = logits.argmin(-1)
    params = [SamplingParams(temperature=0.0, logit_bias={int(low[0]): 100.0}, logprobs=1),
              SamplingParams(temperature=0.0),  # no bias: the argmax, in the same batch
              SamplingParams(temperature=1.0, seed=1, logit_bias={int(low[2]): 100.0}),
              SamplingParams(temperature=0.0, logit_bias={int(logits[3].argmax()): -100.0,
                                                          int(low[3]): 1.0})]
    batch = batch_of(params, generators=[None, None, make_generator(1, "cpu"), None])
    assert batch.logit_bias is not None and batch.logit_bias[0].tolist() == [0, 2, 3, 3]
    out = Sampler()(logits.clone(), batch)
    assert out.token_ids[0] == low[0] and out.token_ids[1] == logits[1].argmax()
    assert out.token_ids[2] == low[2]  # +100 outweighs any difference of these logits
    want3 = logits[3].clone()
    want3[logits[3].argmax()] -= 100.0
    want3[low[3]] += 1.0
    assert out.token_ids[3] == want3.argmax()
    # logprobs stay those of the raw logits (vLLM and OpenAI report them so)
    raw = torch.log_softmax(logits[0], -1)
    assert out.logprobs[0].logprob == pytest.approx(raw[low[0]].item(), abs=1e-5)
    assert batch_of([SamplingParams()]).logit_bias is None


@pytest.mark.parametrize("bias", [{3: 100.5}, {3: -101}, {-1: 1.0}, {3: float("nan")}])
def test_logit_bias_out_of_range_is_refused(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_check_sampling_params_matches_what_torch_accepts():
    """The core's per-request check refuses what the sampler's int64 / fp32 columns could not
    hold, and accepts the largest values they can (the same bounds torch.tensor has)."""
    from engine.sampler import check_sampling_params

    for t in (3.4e38, 0.0, 2.0):
        check_sampling_params(SamplingParams(temperature=t))
        torch.tensor(t, dtype=torch.float32).isfinite().item() or pytest.fail(f"{t} overflows fp32")
    with pytest.raises(ValueError, match="temperature .* finite in fp32"):
        SamplingParams(temperature=3.5e38)  # refused where the request is made
    p = SamplingParams()
    p.temperature = 3.5e38  # and by the core, should a value get past that
    with pytest.raises(ValueError, match="temperature .* not a finite fp32"):
        check_sampling_params(p)
    assert not torch.tensor(3.5e38, dtype=torch.float32).isfinite().item()
    p = SamplingParams()
    p.stop_token_ids = [2**63 - 1]
    check_sampling_params(p)
    p.stop_token_ids = [5, 2**63]
    with pytest.raises(ValueError, match="stop_token_ids .* does not fit in int64"):
        check_sampling_params(p)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids_constrain_only_their_rows(temperature):
    logits = random_logits(4, scale=3.0)
    allowed = [int(logits[0].argmin()), int(logits[0].argsort()[1])]  # two unlikely tokens
    params = [SamplingParams(temperature=temperature, allowed_token_ids=allowed),
              SamplingParams(temperature=temperature),
              SamplingParams(temperature=temperature, allowed_token_ids=[3]),
              SamplingParams(temperature=temperature, logprobs=1)]
    batch = batch_of(params)
    assert not batch.unmodified
    torch.manual_seed(0)
    for _ in range(20):
        out = Sampler()(logits, batch)
        ids = out.token_ids.tolist()
        assert ids[0] in allowed and ids[2] == 3
        if temperature == 0:
            assert ids[1] == int(logits[1].argmax()) and ids[3] == int(logits[3].argmax())
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])


def test_check_token_ids_refuses_ids_outside_and_rows_left_nothing():
    from common.sampling_params import check_token_ids
    check_token_ids(SamplingParams(allowed_token_ids=[7, 8], bad_words_token_ids=[[7], [3, 8]]), 10)
    check_token_ids(SamplingParams(allowed_token_ids=[2], min_tokens=3, ignore_eos=True), 10, eos_token_id=2)
    check_token_ids(SamplingParams(allowed_token_ids=[2, 5], min_tokens=3), 10, eos_token_id=2)
    with pytest.raises(ValueError, match="allowed_token_ids: every listed token is also banned"):
        check_token_ids(SamplingParams(allowed_token_ids=[2], min_tokens=3), 10, eos_token_id=2)
    with pytest.raises(ValueError, match="allowed_token_ids: every listed token is also banned"):
        check_token_ids(SamplingParams(allowed_token_ids=[2, 5], min_tokens=1, stop_token_ids=[5],
                                       bad_words_token_ids=[[2]]), 10)
    for field, kw in (("stop_token_ids", {"stop_token_ids": [10]}), ("logit_bias", {"logit_bias": {10: 1.0}}),
                      ("allowed_token_ids", {"allowed_token_ids": [3, 10]}),
                      ("bad_words", {"bad_words_token_ids": [[3, 10]]})):
        with pytest.raises(ValueError, match=f"{field}: token id 10 is outside the vocabulary"):
            check_token_ids(SamplingParams(**kw), 10)


def test_bad_word_bans():
    from engine.sampler import bad_word_bans
    assert bad_word_bans([[5], [7, 8, 9]], []) == [5]
    assert bad_word_bans([[5], [7, 8, 9]], [1, 7, 8]) == [5, 9]
    assert bad_word_bans([[7, 8, 9]], [7, 8, 1]) == []
    batch = batch_of([SamplingParams(bad_words_token_ids=[[3], [1, 2]])], outputs=[[0, 1]])
    assert sorted(batch.min_tokens_masked_ids[0]) == [2, 3]
    assert SamplingParams(bad_words_token_ids=[[1, 2]]).reads_history
    assert not SamplingParams(bad_words_token_ids=[[1]]).reads_history
