"""The fused MoE kernels (small-batch, expert-sorted blocks, their glue) on small CPU shapes
against the torch experts loop: the checks of tests/moe_checks.py."""

from __future__ import annotations

import pytest
import torch
from moe_checks import (SMALL_FP8_MOE, check, check_blocked, check_expert_sort, check_fp8, check_fp8_blocked,
                        check_fp8_blocked_a8, check_fp8_moe, check_glue, check_shared_dense, check_side_norm,
                        expert_sort_ids, fp8_moe_pair, w8a8_reference)


def test_fused_moe_interpreter():
    """Small shapes (I and D not multiples of the tiles) under TRITON_INTERPRET=1."""
    for T in (1, 3):
        check({"hidden_size": 160, "moe_intermediate_size": 48, "n_routed_experts": 8,
               "num_experts_per_tok": 3}, T, torch.float32, "cpu", 1e-5)
        check_fp8(T, torch.float32, "cpu", 1e-5)
    small = {"hidden_size": 160, "moe_intermediate_size": 48, "n_routed_experts": 8, "num_experts_per_tok": 3}
    for T, bm in ((1, 16), (9, 16), (40, 16), (40, 32)):
        check_blocked(small, T, torch.float32, "cpu", 1e-5, bm)
    # E 15: the left-out ids 15 and 16 (check_align_leaves_out) straddle the kernel's 16 histogram bins
    for T, kt, E, bm in ((1, 1, 2, 16), (3, 2, 4, 4), (37, 3, 8, 16), (64, 8, 66, 32), (5, 4, 300, 16), (9, 3, 15, 16)):
        check_glue(T, kt, E, bm, "cpu", seed=T)


@pytest.mark.parametrize("T", [1, 3, 5, 9])
def test_side_norm_with_the_shared_stream(T, monkeypatch):
    """moe_norm_in_router_max_tokens with the shared experts' stream, on the fused path (1, 3) and
    the block path (5, 9): the add + norm in the router's logits kernel and in the side stream's
    own norm kernel give the path's output and residual bit for bit."""
    small = {"hidden_size": 160, "moe_intermediate_size": 48, "n_routed_experts": 8, "num_experts_per_tok": 3}
    check_side_norm(small, T, torch.float32, "cpu", monkeypatch)


@pytest.mark.parametrize("T,kt,E,block", [(37, 3, 8, 16), (300, 8, 257, 16), (50, 6, 66, 32), (7, 2, 3, 16)])
@pytest.mark.parametrize("skewed", [False, True])
def test_expert_sort_over_many_blocks(T, kt, E, block, skewed):
    """The counting sort with small blocks: many blocks, and (257 experts, 150 blocks) more blocks
    than its scan takes in one chunk."""
    check_expert_sort(expert_sort_ids(T, kt, E, skewed, "cpu", seed=T), E, block)


def test_shared_experts_dense_with_the_block_kernels():
    """The block kernels with k pairs per token plus the shared experts' own GEMMs equal the block
    kernels with the shared experts folded in (k + 2 pairs per token)."""
    small = {"hidden_size": 160, "moe_intermediate_size": 48, "n_routed_experts": 8, "num_experts_per_tok": 3}
    check_shared_dense(small, 40, torch.float32, "cpu", 1e-5, moe="triton", moe_blocked_max_tokens=512)


def test_fp8_blocked_kernels():
    """FP8 experts (D = I = 256: two 128-blocks each way) through the block kernels at 16, 32 and
    64-row blocks against the torch loop on the dequantized weights, two of 8 experts unhit."""
    for T, bm in ((1, 16), (9, 16), (40, 32), (40, 64)):
        check_fp8_blocked(T, torch.float32, "cpu", 1e-5, bm)


def test_fp8_moe_triton_plan_equals_torch_plan():
    """MoE.forward with FP8 experts kept, past the fused bound (8) and past moe_blocked_max_tokens
    (16): the Triton plan's block kernels equal the torch plan's loop, with no dequantization."""
    for T in (9, 40):
        check_fp8_moe(T, torch.float32, "cpu", 1e-5, SMALL_FP8_MOE, moe_fused_max_tokens_fp8=8,
                      moe_blocked_max_tokens=16)


def test_fp8_w8a8_blocked_kernels():
    """The W8A8 block kernels (a8=True: x and h quantized by act_quant, FP8 x FP8 products) at 16-
    and 32-row blocks against the torch W8A8 reference: exact to fp32 sums (1e-5), so a dropped or
    misplaced activation scale fails by far; and about the activation rounding (a few %) away from
    the weight-only kernels, not equal to them."""
    for T, bm in ((1, 16), (9, 16), (40, 16), (33, 32), (40, 32)):
        _, dist = check_fp8_blocked_a8(T, torch.float32, "cpu", 1e-5, bm)
        assert 5e-3 < dist < 1e-1, (T, bm, dist)


def test_moe_fp8_w8a8_plan():
    """MoE.forward with the kernel plan's moe_fp8_w8a8 (FP8 experts past the fused bound) is the
    W8A8 block MoE on the layer's own routing; without it, the weight-only kernels (not W8A8)."""
    T = 24
    _, moe, x = fp8_moe_pair(T, torch.float32, "cpu", SMALL_FP8_MOE, moe_fused_max_tokens_fp8=8, moe_fp8_w8a8=True)
    _, w_only, _ = fp8_moe_pair(T, torch.float32, "cpu", SMALL_FP8_MOE, moe_fused_max_tokens_fp8=8)
    w, ids = moe.gate(x)
    ref = w8a8_reference(x, moe.w13, moe.w13_scale, moe.w2, moe.w2_scale, w, ids)
    got, other = moe(x).float(), w_only(x).float()
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5
    assert ((other - ref).norm() / ref.norm()).item() > 5e-3
    # a failure there is charged to moe_fp8_w8a8, whose =0 avoids it
    from common.kernel_plan import charged_key

    def failing(*a, **k):
        raise RuntimeError("out of resources")
    moe.fused_blocked = failing
    with pytest.raises(RuntimeError) as info:
        moe(x)
    assert charged_key(info.value) == "moe_fp8_w8a8"
