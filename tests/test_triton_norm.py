"""The Triton RMSNorm and residual add + RMSNorm (common/triton_norm.py) against the torch glue."""

from __future__ import annotations

import pytest
import torch

from common import fused
from common.triton_norm import add_rms_norm, rms_norm


def check(device: str, dtype: torch.dtype, T: int, D: int, strided: bool = False) -> None:
    g = torch.Generator().manual_seed(T * 7 + D)
    # rows of magnitude ~3 and a weight near 1, so that mean(x^2) is far from eps
    x = (3 * torch.randn(T, 2 * D if strided else D, generator=g)).to(device, dtype)
    h = torch.randn(T, D, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(device, dtype)
    if strided:  # a row stride past D, as a view of a wider output (q_a_proj's rows of the packed GEMM)
        x = x[:, D // 2: D // 2 + D]
    eps = 1e-6
    # the fp32 sum of squares runs in another order than torch's mean: fp32-close; in bf16 the
    # normalized value's rounding may then land one ulp apart (and the weight's product rounds again)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(rms_norm(x, w, eps), fused.rms_norm(x, w, eps), **tol)
    s, y = add_rms_norm(x, h, w, eps)
    rs, ry = fused.add_rms_norm(x, h, w, eps)
    torch.testing.assert_close(s, rs, rtol=0, atol=0)  # one rounded add, as torch's
    torch.testing.assert_close(y, ry, **tol)
    assert s.dtype == y.dtype == dtype and s.shape == y.shape == (T, D)
    # 3-d input (the q_a norm sees [T, q_lora_rank]; heads are flattened by callers, but any
    # leading shape works)
    x3 = x[: (T // 2) * 2].reshape(-1, 2, D) if T >= 2 else x.reshape(1, T, D)
    torch.testing.assert_close(rms_norm(x3, w, eps), fused.rms_norm(x3, w, eps), **tol)
    # an MoE's unsummed pair rows as h: the same bits as summing them first (PairRows.sum, the
    # pair-sum kernel's order), then the add + norm
    for kt in (1, 8):
        part = torch.randn(T, kt, D, generator=g).to(device)
        pairs = fused.PairRows(part, dtype)
        s2, y2 = add_rms_norm(x, pairs, w, eps)
        s1, y1 = add_rms_norm(x, pairs.sum(), w, eps)
        torch.testing.assert_close(s2, s1, rtol=0, atol=0)
        torch.testing.assert_close(y2, y1, rtol=0, atol=0)


@pytest.mark.parametrize("T,D", [(1, 16), (5, 48), (9, 100)])
def test_triton_norms_check_their_arguments(T, D):
    """Outside the interpreter the kernels need CUDA; what runs here is the argument checking."""
    x = torch.randn(T, D)
    with pytest.raises(ValueError, match="weight must be a contiguous"):
        rms_norm(x, torch.ones(D + 1), 1e-6)
    with pytest.raises(ValueError, match="differ"):
        add_rms_norm(x, torch.randn(T, D + 1), torch.ones(D), 1e-6)
    with pytest.raises(ValueError, match="pair rows"):  # pairs summing to another dtype, or another width
        add_rms_norm(x, fused.PairRows(torch.randn(T, 2, D), torch.float16), torch.ones(D), 1e-6)
    with pytest.raises(ValueError, match="pair rows"):
        add_rms_norm(x, fused.PairRows(torch.randn(T, 2, D + 1), torch.float32), torch.ones(D), 1e-6)


def test_pair_rows_sum_adds_in_order():
    """PairRows.sum: the rows added one after another in fp32, then rounded once."""
    part = torch.tensor([[[1.0, 2.0**24], [2.0**-30, 1.0], [3.0, 1.0]]])  # [1, 3, 2]
    got = fused.PairRows(part, torch.float32).sum()
    # in order (2^24 + 1) + 1 rounds to 2^24 twice; 2^24 + (1 + 1), another order, is 2^24 + 2
    assert got.tolist() == [[4.0, 2.0**24]]
    assert fused.PairRows(part, torch.bfloat16).sum().dtype == torch.bfloat16


def test_glue_for_plan_takes_the_triton_norms_only_where_the_plan_says():
    from common.kernel_plan import KernelPlan
    import common.triton_norm as tn
    assert fused.glue_for(KernelPlan()) is fused.EAGER
    assert fused.glue_for(KernelPlan(compile=True)) is fused.COMPILED
    g = fused.glue_for(KernelPlan(compile=True, norm="triton"))
    assert g.rms_norm is tn.rms_norm and g.add_rms_norm is tn.add_rms_norm
    assert g.rope is fused.COMPILED.rope and g.silu_mul is fused.COMPILED.silu_mul
    assert fused.glue_for(KernelPlan(compile=True, norm="triton")) is g  # made once


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,D", [(1, 2048), (37, 512), (8192, 2048), (3, 7168), (300, 1536)])
def test_triton_norms_gpu(T, D, dtype):
    check("cuda", dtype, T, D)
    if T == 37:
        check("cuda", dtype, T, D, strided=True)
