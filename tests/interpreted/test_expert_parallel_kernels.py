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


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_to_local_kernel_equals_torch(dtype):
    """The one-launch `to_local` against the torch ops, element for element: ids below, at both
    ends of and above this rank's range, 300 pairs (two programs, the last partly masked)."""
    from models.expert_parallel import to_local
    from models.expert_parallel_kernel import to_local_triton
    torch.manual_seed(3)
    ids = torch.randint(0, 64, (100, 3), dtype=dtype)
    ids[0] = torch.tensor([15, 16, 31], dtype=dtype)  # first - 1, first, first + count - 1
    ids[1] = torch.tensor([32, 0, 63], dtype=dtype)
    w = torch.rand(100, 3)
    want_w, want_ids = to_local(w, ids, 16, 16)
    got_w, got_ids = to_local_triton(w, ids, 16, 16)
    assert got_ids.dtype == dtype and torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w)
    assert got_ids[0].tolist() == [16, 0, 15] and got_ids[1].tolist() == [16, 16, 16]
