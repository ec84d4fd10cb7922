"""Prefill over an FP8 latent cache reads its own keys as the cache holds them (attention/mla.py,
kv_quant.as_cached): a prompt's logprobs are the same whether its prefix was computed in the same
pass, in an earlier chunk, or taken from the prefix cache, so an lm_eval score does not depend on
what was sent before it."""

from __future__ import annotations

import torch

from attention.kv_quant import FP8_DTYPE, as_cached, load_as, store_as
from common.sampling_params import SamplingParams
from engine import LLM

SHOTS = ("Question: Mia has 7 apples. Leo has 3 pens. How many apples does Mia have?\nAnswer: 7\n"
         "Question: Emma has 4 cups. Leo has 9 pens. How many pens does Leo have?\nAnswer: 9\n")


def test_as_cached_is_a_write_then_a_read():
    x = torch.randn(5, 40) * 3
    cached = as_cached(x, FP8_DTYPE, 0.5)
    assert torch.equal(cached, load_as(store_as(x, FP8_DTYPE, 0.5), x.dtype, 0.5))
    assert not torch.equal(cached, x)  # e4m3 rounds
    assert torch.equal(as_cached(x, torch.bfloat16, 1.0), x.bfloat16().float())  # bf16 under fp32
    assert as_cached(x, x.dtype, 1.0) is x  # a cache of x's own dtype holds x


def prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> list[list[float]]:
    """Each prompt's logprobs of its own tokens (the first has none), in order."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    return [[lp.logprob for lp in out.prompt_logprobs[1:]] for out in llm.generate(prompts, params)]


def test_prompt_logprobs_do_not_depend_on_the_cache():
    fresh = LLM(device="cpu", dtype="float32", kv_cache_dtype="fp8", block_size=4, num_kv_blocks=256)
    tok = fresh.tokenizer
    context = tok(SHOTS)["input_ids"]
    scored = context + tok("Question: Leo has 5 pens.\nAnswer: 5", add_special_tokens=False)["input_ids"]
    want = prompt_logprobs(fresh, [scored])[0]  # computed whole, in one pass
    # the context cached first (no logprobs asked): the scored prompt's tokens past it attend over
    # cached keys, as every later block did above over keys of the same pass
    cached = LLM(device="cpu", dtype="float32", kv_cache_dtype="fp8", block_size=4, num_kv_blocks=256)
    cached.generate([context + tok(" 3", add_special_tokens=False)["input_ids"]], SamplingParams(max_tokens=1))
    (hit,) = prompt_logprobs(cached, [scored])
    # chunks of 8 tokens: each chunk reads the earlier ones from the cache
    chunked = prompt_logprobs(LLM(device="cpu", dtype="float32", kv_cache_dtype="fp8", block_size=4,
                                  num_kv_blocks=256, max_num_batched_tokens=8), [scored])[0]
    for got in (hit, chunked):
        assert len(got) == len(want)
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
