"""The sampler where vLLM's rules decide more than the math does: logits that tie (top-k keeps
every token tied with the k-th, a rank counts the tokens at least as likely), logprobs under a
grammar's mask (over the tokens it allows), and min_tokens with ignore_eos (the EOS stays masked)."""

import math

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.logprobs import compute_prompt_logprobs
from engine.sampler import Sampler, SamplingBatch


def batch_of(params, outputs=None, eos=()):
    n = len(params)
    return SamplingBatch.from_params(params, [[]] * n, outputs or [[]] * n, [None] * n, list(eos), "cpu")


def drawn(row: list[float], params: SamplingParams, n=4000, narrow=True) -> set[int]:
    """The tokens `n` draws of one row give; narrow=False forces the full sort path."""
    batch = batch_of([params] * n)
    if not narrow:
        batch.max_top_k = None
    torch.manual_seed(0)
    return set(Sampler()(torch.tensor([row]).expand(n, -1).contiguous(), batch).token_ids.tolist())


@pytest.mark.parametrize("narrow", [True, False])
def test_top_k_keeps_every_token_tied_with_the_kth(narrow):
    # the 2nd largest, 2.0, is tied three ways; the last of them lies past the 2 candidates
    assert drawn([3.0, 2.0, 0.0, 2.0, 2.0], SamplingParams(top_k=2), narrow=narrow) == {0, 1, 3, 4}
    # a tied maximum under top_k 1 is sampled among its ties, as vLLM does
    assert drawn([1.0, 5.0, 5.0, 0.0], SamplingParams(top_k=1), narrow=narrow) == {1, 2}
    # top-p past the k-th: its ties go with it; top-p keeping only the first: they do not
    assert drawn([3.0, 2.0, 0.0, 2.0], SamplingParams(top_k=2, top_p=0.99), narrow=narrow) == {0, 1, 3}
    assert drawn([9.0, 2.0, 0.0, 2.0], SamplingParams(top_k=2, top_p=0.5), narrow=narrow) == {0}


def test_tied_candidates_sample_as_the_full_sort():
    """bf16-rounded logits tie often: the topk(max_top_k) path and the full sort agree draw for draw."""
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(16, 64, generator=g) * 2).bfloat16().float().round(decimals=0)
    params = [SamplingParams(temperature=0.9, top_k=k) for k in [1, 3, 7, 12] * 4]
    fast, slow = batch_of(params), batch_of(params)
    slow.max_top_k = None
    assert fast.max_top_k == 12
    for seed in range(5):
        torch.manual_seed(seed)
        a = Sampler()(logits, fast).token_ids
        torch.manual_seed(seed)
        assert torch.equal(a, Sampler()(logits, slow).token_ids)


def test_rank_counts_the_tokens_at_least_as_likely():
    logits = torch.tensor([[2.0, 2.0, 0.0], [0.0, 1.0, 3.0]])
    out = Sampler()(logits, batch_of([SamplingParams(temperature=0.0, logprobs=1)] * 2))
    assert [(lp.token_id, lp.rank) for lp in out.logprobs] == [(0, 2), (2, 1)]
    (tied, last) = compute_prompt_logprobs(logits, torch.tensor([1, 0]), 1)
    assert (tied.rank, last.rank) == (2, 3)


def test_logprobs_under_a_grammar_are_over_the_allowed_tokens():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0], [3.0, 2.0, 1.0, 0.0, -1.0]])
    batch = batch_of([SamplingParams(temperature=0.0, logprobs=2)] * 2)
    batch.token_bitmask = torch.tensor([[0b00110]], dtype=torch.int32)  # row 1: tokens 1 and 2
    batch.bitmask_rows = torch.tensor([1])
    free, constrained = Sampler()(logits, batch).logprobs
    allowed = torch.tensor([2.0, 1.0]).log_softmax(-1).tolist()
    assert constrained.token_id == 1 and constrained.rank == 1
    assert constrained.logprob == pytest.approx(allowed[0], abs=1e-6)
    assert [t for t, _ in constrained.top] == [1, 2]
    assert [v for _, v in constrained.top] == pytest.approx(allowed, abs=1e-6)
    # the row without a grammar keeps the whole distribution
    assert free.token_id == 0 and [t for t, _ in free.top] == [0, 1]
    assert math.isclose(free.logprob, logits[0].log_softmax(-1)[0].item(), abs_tol=1e-6)


def test_min_tokens_masks_eos_under_ignore_eos():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 5.0]])
    p = SamplingParams(temperature=1.0, min_tokens=3, max_tokens=8, ignore_eos=True)
    torch.manual_seed(0)
    for out in ([], [1], [1, 2]):
        ids = Sampler()(logits.expand(200, -1).contiguous(), batch_of([p] * 200, outputs=[out] * 200, eos=[4]))
        assert 4 not in ids.token_ids.tolist()
    # from min_tokens on, the EOS is an ordinary token again (greedy takes it)
    greedy = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert Sampler()(logits, batch_of([greedy], outputs=[[1, 2]], eos=[4])).token_ids.tolist() == [0]
    assert Sampler()(logits, batch_of([greedy], outputs=[[1, 2, 3]], eos=[4])).token_ids.tolist() == [4]
