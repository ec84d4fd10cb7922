"""The whole engine on the Triton paths, on the CPU under the Triton interpreter (fp32): the MLA
backend's kernels plus the model's (router, fused MoE, absorbed products, cache rows), against the
plain torch engine in this process. Greedy tokens must be equal, with prompts chunked by 16
tokens (prefill with context, mixed steps) and not."""

from __future__ import annotations

import json

import pytest
import torch
from interpreted import run_interpreted
from tiny_models import make_model

from engine import LLM, SamplingParams

KERNELS = ("route", "fused_moe", "kv_finish", "absorb_q", "absorb_o")

RUN = r"""
import os
os.environ["DSV_MOE_BLOCKED"] = {blocked!r}
import json, torch
import attention.mla as mla, models.moe as moe
from engine import LLM, SamplingParams
calls = {{}}
def counting(name, fn, *a):
    calls[name] = calls.get(name, 0) + 1
    return real(name, fn, *a)
real = mla.try_kernel
mla.try_kernel = moe.try_kernel = counting
llm = LLM({path!r}, device="cpu", dtype="float32", attention_backend="triton", num_kv_blocks=64,
          max_num_batched_tokens={budget}, speculative_config={spec!r})
sp = SamplingParams(temperature=0, max_tokens={max_tokens}, ignore_eos=True)
out = [o.outputs[0].token_ids for o in llm.generate({prompts!r}, sp)]
from models.fused import _FAILED
assert not _FAILED, _FAILED  # a kernel that raised was replaced by torch ops: its tokens prove nothing
spec = llm.scheduler.stats.spec
print("RESULT " + json.dumps({{"tokens": out, "calls": calls,
                               "accepted": spec.num_accepted_tokens if spec else None}}))
"""


@pytest.fixture(scope="module", params=["v3", "v2"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"interp_{request.param}")
    make_model(path, request.param, qk_rope_head_dim=16)  # the Triton decode kernel needs rope >= 16
    return str(path)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.mark.parametrize("budget,blocked,spec", [(16, "1", None), (2048, "1", None), (16, "0", None),
                                                 (2048, "1", NGRAM)])
def test_triton_paths_equal_torch_engine(model, budget, blocked, spec):
    """blocked "1" (the default): the expert-sorted MoE kernels take the prefill chunks of 9-512
    tokens; "0" (DSV_MOE_BLOCKED=0) leaves them to the dense path. With ngram speculation the
    decode kernel verifies drafts (q_len 1 + k, masks from positions); the reference engine runs
    without it."""
    g = torch.Generator().manual_seed(budget)
    prompts = [torch.randint(2, 300, (n,), generator=g).tolist() for n in (5, 23, 40)]
    max_tokens = 6
    if spec is not None:  # repetitive prompts and longer outputs: the drafter finds matches
        prompts, max_tokens = [p[:4] * 5 for p in prompts], 16
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ref = LLM(model, device="cpu", dtype="float32", attention_backend="torch", num_kv_blocks=64,
              max_num_batched_tokens=budget)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, sp)]
    out = run_interpreted(RUN.format(path=model, budget=budget, prompts=prompts, blocked=blocked, spec=spec,
                                     max_tokens=max_tokens),
                          timeout=600)
    got = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    assert got["tokens"] == want
    if spec is not None:
        assert got["accepted"] > 0, "no draft accepted: the multi-token decode was not exercised"
    expect = KERNELS + (("fused_moe_blocked",) if blocked == "1" else ())
    assert all(got["calls"].get(k, 0) > 0 for k in expect), got["calls"]
