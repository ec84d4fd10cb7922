"""The two-launch argmax on small CPU shapes: the checks of tests/test_triton_argmax.py, and the
sampler taking it for its greedy rows."""

from __future__ import annotations

import torch
from test_triton_argmax import check


def test_argmax_kernel_interpreter():
    from common.triton_argmax import BLOCK
    check("cpu", 1, 37)
    check("cpu", 6, 2 * BLOCK + 300)  # three blocks, the last partial: ties, inf, NaN, -inf rows
    check("cpu", 3, BLOCK, torch.float16)
    check("cpu", 3, BLOCK + 9, torch.bfloat16)  # the LM head's logits as the sampler now gets them


def test_sampler_with_the_triton_argmax_equals_torch_argmax():
    from common.sampling_params import SamplingParams
    from common.triton_argmax import argmax_rows
    from engine.sampler import Sampler, SamplingBatch
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=g) * 3
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=1.0, seed=2)]

    def sample(sampler):
        batch = SamplingBatch.from_params(params, [[] for _ in params], [[] for _ in params],
                                          [torch.Generator().manual_seed(7) for _ in params], [], "cpu")
        return sampler(logits, batch).token_ids
    assert torch.equal(sample(Sampler(argmax_rows)), sample(Sampler()))
