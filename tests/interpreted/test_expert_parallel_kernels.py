"""--enable-expert-parallel through the Triton MoE paths under the interpreter: one MoE layer as
each of N EP ranks builds it, summed over the ranks, against the one-rank layer
(tests/ep_checks.py). Under EP the block kernels take every batch size, the other ranks' pairs
left out of their sort and of the pair sum (models/expert_parallel.py)."""

from __future__ import annotations

import pytest
import torch
from ep_checks import check_expert_parallel

from common.kernel_plan import KernelPlan

SMALL = {"hidden_size": 160, "moe_intermediate_size": 48, "n_routed_experts": 8, "num_experts_per_tok": 3}
R1_SMALL = {"hidden_size": 256, "moe_intermediate_size": 256, "n_routed_experts": 8, "num_experts_per_tok": 3,
            "n_group": 1, "topk_group": 1, "n_shared_experts": 2}
TRITON_MOE = dict(router="triton", moe="triton", moe_fused_max_tokens=4, moe_blocked_max_tokens=16)


@pytest.mark.parametrize("T,n", [(1, 2), (9, 2), (40, 4)])
def test_block_kernels_split_by_expert(T, n, monkeypatch):
    """V2-Lite's MoE narrowed (2 shared experts): at 1 token (the fused MoE's size without EP), 9,
    and 40 (past moe_blocked_max_tokens, the grouped GEMM's size without EP)."""
    check_expert_parallel("configs/models/DeepSeek-V2-Lite", SMALL, T, torch.float32, "cpu", 1e-5,
                          KernelPlan(**TRITON_MOE), n, monkeypatch)


@pytest.mark.parametrize("w8a8", [False, True])
def test_fp8_experts_kept_split_by_expert(w8a8, monkeypatch):
    """R1's FP8 MoE narrowed, kept in FP8: the FP8 block kernels (weight-only, and W8A8), the
    shared experts a W8A8 MLP split over the 2 ranks."""
    check_expert_parallel("configs/models/DeepSeek-R1", R1_SMALL, 9, torch.float32, "cpu", 1e-5,
                          KernelPlan(**TRITON_MOE, moe_fp8_w8a8=w8a8), 2, monkeypatch, keep_fp8=True)
