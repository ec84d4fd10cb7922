"""The decode-sized GEMM (models/skinny_gemm.py) against a float64 matmul, and its use by Linear."""

from __future__ import annotations

import pytest
import torch
from interpreted import run_interpreted


CHECK = r"""
import torch
from models.skinny_gemm import skinny_linear

def check(M, N, K, dtype, device, tol):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    # x as the model can hand it: rows of a wider buffer (row stride > K)
    buf = torch.randn(M, K + 24, generator=g).to(device, dtype)
    x = buf[:, :K]
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(device, dtype)
    y = skinny_linear(x, w)
    assert y.shape == (M, N) and y.dtype == dtype and y.is_contiguous()
    ref = x.double() @ w.double().T
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < tol, (M, N, K, dtype, err)
"""


def test_skinny_linear_interpreter():
    """Rows 1..16, N and K not multiples of the tiles (masked column and K tails)."""
    code = CHECK + r"""
for M in (1, 5, 16):
    check(M, 40, 72, torch.float32, "cpu", 1e-6)
check(3, 16, 64, torch.float32, "cpu", 1e-6)
assert skinny_linear(torch.randn(0, 8), torch.randn(4, 8)).shape == (0, 4)
"""
    run_interpreted(code)


def test_skinny_linear_rejects_what_it_cannot_serve():
    from models.skinny_gemm import skinny_linear
    with pytest.raises(ValueError, match="at most 16 rows"):
        skinny_linear(torch.randn(17, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="skinny_linear"):
        skinny_linear(torch.randn(2, 8), torch.randn(4, 8, dtype=torch.float64))


def test_linear_takes_it_only_for_decode_sized_inputs(monkeypatch):
    """models.layers.linear: the kernel for <= 16 rows on the fast path, F.linear otherwise (and
    for a weight it cannot read); both give x @ W^T."""
    import models.layers as layers
    import models.skinny_gemm as sg
    calls = []
    monkeypatch.setattr(layers, "triton_fast_path", lambda t: True)
    monkeypatch.setattr(sg, "skinny_linear", lambda x, w: calls.append(x.shape[0]) or x @ w.T)
    w = torch.randn(6, 8)
    for M in (1, 16, 17):
        x = torch.randn(M, 8)
        torch.testing.assert_close(layers.linear(x, w), x @ w.T)
    layers.linear(torch.randn(2, 8), torch.randn(8, 6).T)  # non-contiguous weight: F.linear
    assert calls == [1, 16]


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8, 16])
@pytest.mark.parametrize("N,K", [(3648, 2048), (2048, 2048), (2048, 10944), (2112, 7168), (7168, 16384)])
def test_skinny_linear_real_shapes(M, N, K):
    """V2-Lite q/kv_a fused, o_proj, dense down_proj; V3 q_a + kv_a, o_proj (tp 1)."""
    ns = {}
    exec(CHECK, ns)
    ns["check"](M, N, K, torch.bfloat16, "cuda", 1e-2)
    ns["check"](M, N, K, torch.float32, "cuda", 1e-5)
