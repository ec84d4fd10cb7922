"""The launch removals of the decode step on the GPU, in the engine (the opt-ins, the norm inside the
router at batch 1 alone among them): the same greedy tokens as the default plan, in CUDA graphs and
eagerly (skipped without CUDA)."""

from __future__ import annotations

import pytest
from test_gpu_engine import _prompts64, _run

pytestmark = pytest.mark.gpu

OPT_INS = ("decode_merge_in_absorb=1", "moe_norm_in_router_max_tokens=64", "moe_route_align_max_tokens=64",
           "decode_merge_in_absorb=1,moe_norm_in_router_max_tokens=64,moe_route_align_max_tokens=64",
           "moe_norm_in_router_max_tokens=1")  # the norm in the router at batch 1 alone


@pytest.fixture(scope="module")
def gpu_v2(tmp_path_factory):
    from tiny_models import make_model
    path = tmp_path_factory.mktemp("gpu_v2_opt_ins")
    make_model(path, "v2", qk_rope_head_dim=16)
    return str(path)


@pytest.mark.parametrize("opt_in", OPT_INS)
def test_launch_opt_ins_equal_the_default_plan(gpu_v2, opt_in):
    """Tiny V2 (no expert groups) in fp32 over 64 prompts: decode steps of 1-64 sequences (the
    fused MoE up to 4, the block kernels with the shared experts on their own stream beyond, the
    norm in the router's logits kernel and the one-launch choice and alignment up to their
    bounds), mixed steps, decode splits merged in absorb_o. The norm's bits are the norm kernel's;
    the one-launch choice's weights may differ from the two launches' in the last bit (fp32)."""
    prompts = _prompts64()
    ref = _run(gpu_v2, prompts)
    assert _run(gpu_v2, prompts, kernels="auto,warmup=0," + opt_in) == ref
    assert _run(gpu_v2, prompts, kernels="auto,warmup=0," + opt_in, enforce_eager=True) == ref
