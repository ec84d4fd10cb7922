"""--enable-expert-parallel through the Triton MoE paths under the interpreter: one MoE layer as
each of N EP ranks builds it, summed over the ranks, against the one-rank layer
(tests/ep_checks.py). Under EP the fused MoE (small batches) skips the other ranks' pairs in its
programs, and the block kernels leave them out of their sort; both leave them out of the pair
sum (models/expert_parallel.py)."""

from __future__ import annotations

import pytest
import torch
from ep_checks import check_expert_parallel

from common.kernel_plan import KernelPlan

SMALL = {"hidden_size": 160, "moe_intermediate_size": 48, "n_routed_experts": 8, "num_experts_per_tok": 3}
R1_SMALL = {"hidden_size": 256, "moe_intermediate_size": 256, "n_routed_experts": 8, "num_experts_per_tok": 3,
            "n_group": 1, "topk_group": 1, "n_shared_experts": 2}
TRITON_MOE = dict(router="triton", moe="triton", moe_fused_max_tokens=4, moe_blocked_max_tokens=16)


def _count_calls(monkeypatch, module, name: str) -> list:
    """Record each call of `module.name` (before the layers are built: they keep the function)."""
    calls, f = [], getattr(module, name)

    def spy(*a, **kw):
        calls.append(kw.get("left_out", False))
        return f(*a, **kw)
    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("T,n", [(1, 2), (4, 4), (9, 2), (40, 4)])
def test_moe_kernels_split_by_expert(T, n, monkeypatch):
    """V2-Lite's MoE narrowed (2 shared experts): at 1 and 4 tokens the fused MoE (other ranks'
    pairs skipped by its programs and left out of the pair sum), at 9 the block kernels, and at 40
    (past moe_blocked_max_tokens, the grouped GEMM's size without EP) the block kernels too."""
    from models import blocked_moe, fused_moe
    small = _count_calls(monkeypatch, fused_moe, "fused_moe_small")
    blocked = _count_calls(monkeypatch, blocked_moe, "fused_moe_blocked")
    check_expert_parallel("configs/models/DeepSeek-V2-Lite", SMALL, T, torch.float32, "cpu", 1e-5,
                          KernelPlan(**TRITON_MOE), n, monkeypatch)
    # the one-rank layer (at 40 tokens the grouped GEMM's), then the n EP ranks', each leaving pairs out
    assert (small if T <= 4 else blocked) == [False] * (T <= 16) + [True] * n
    assert not (blocked if T <= 4 else small)


@pytest.mark.parametrize("w8a8,T", [(False, 9), (True, 9), (False, 2)])
def test_fp8_experts_kept_split_by_expert(w8a8, T, monkeypatch):
    """R1's FP8 MoE narrowed, kept in FP8: the FP8 block kernels (weight-only, and W8A8) at 9
    tokens, the fused MoE's FP8 programs at 2, the shared experts a W8A8 MLP split over the 2
    ranks."""
    check_expert_parallel("configs/models/DeepSeek-R1", R1_SMALL, T, torch.float32, "cpu", 1e-5,
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
