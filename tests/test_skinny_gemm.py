"""The Triton few-row GEMM (models/skinny_gemm.py) against torch's product, and where Linear uses it."""

from __future__ import annotations

import pytest
import torch


def check(device: str, dtype: torch.dtype, M: int, N: int, K: int, x_stride: int | None = None) -> None:
    from models.skinny_gemm import skinny_linear
    g = torch.Generator().manual_seed(M * 131 + N * 7 + K)
    x = torch.randn(M, x_stride or K, generator=g)[:, :K].to(device, dtype)  # a row stride past K when given
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype)
    y = skinny_linear(x, w)
    ref = (x.double() @ w.double().T)
    assert y.shape == (M, N) and y.dtype == dtype
    # fp32: IEEE products, only the summation order differs, whose error grows as sqrt(K) (K 16384:
    # 1.29e-5 seen on an entry of magnitude ~0.1); bf16/fp16: one rounding of an fp32 sum
    fp32_atol = 1e-5 * max(1.0, (K / 2048) ** 0.5)
    tol = dict(rtol=1e-5, atol=fp32_atol) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=2e-3)
    torch.testing.assert_close(y.double(), ref, **tol)


def test_skinny_linear_refuses_a_weight_that_does_not_fit():
    from models.skinny_gemm import skinny_linear
    with pytest.raises(ValueError, match="does not fit"):
        skinny_linear(torch.randn(2, 16), torch.randn(8, 17))
    with pytest.raises(ValueError, match="does not fit"):
        skinny_linear(torch.randn(2, 16), torch.randn(16, 8).T)  # K not contiguous


def test_linear_takes_the_skinny_gemm_up_to_the_plans_bound(monkeypatch):
    """Linear.forward: rows 1..skinny_max on skinny_linear, more (and 0, the default bound) on F.linear."""
    import models.skinny_gemm as sg
    from models.layers import Linear
    calls = []
    monkeypatch.setattr(sg, "skinny_linear", lambda x, w: calls.append(x.shape[0]) or x @ w.T)
    lin = Linear(16, 8, torch.float32)
    torch.nn.init.normal_(lin.weight)
    for m in (1, 4, 5):
        lin(torch.randn(m, 16))
    assert calls == []  # skinny_max 0: never
    lin.skinny_max = 4
    for m in (1, 4, 5):
        lin(torch.randn(m, 16))
    assert calls == [1, 4]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M", [1, 3, 16, 17, 32, 64])
@pytest.mark.parametrize("N,K", [(3648, 2048), (2048, 2048), (2112, 7168), (7168, 16384), (21888, 2048)])
def test_skinny_gemm_gpu(M, N, K, dtype):
    """Real shapes: V2-Lite's q + kv_a and o_proj, V3's q_a + kv_a and o_proj, V2-Lite's dense
    gate/up (layer 0); 17 and 64 rows take more than one row tile's worth of padding."""
    check("cuda", dtype, M, N, K)


def test_fixed_tiles_fit_shared_memory():
    """Without autotuning every row bucket and dtype gets a tile within the shared-memory budget
    (fp32 with 64 rows asked for 294 KB at 4 stages of 256 on the H200)."""
    from models.skinny_gemm import _SMEM_BUDGET, fixed_tile
    for mb in (16, 32, 64):
        for size in (2, 4):
            t = fixed_tile(mb, size)
            assert (mb + t["BLOCK_N"]) * t["BLOCK_K"] * size * t["num_stages"] <= _SMEM_BUDGET
            assert t["num_stages"] >= 2


@pytest.mark.gpu
def test_skinny_gemm_gpu_strided_rows():
    check("cuda", torch.bfloat16, 5, 2048, 2048, x_stride=2560)
