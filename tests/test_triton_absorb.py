"""The absorbed decode's per-head product kernels (attention/triton_absorb.py) against einsum."""

from __future__ import annotations

import pytest
import torch
from interpreted import run_interpreted


CHECK = r"""
import torch
from attention.triton_absorb import absorb_o, absorb_q
from models.fused import rope

def check(T, H, P, R, L, V, dtype, device, tol):
    g = torch.Generator().manual_seed(T * 7 + H)
    # q as the model makes it: a view into a wider projection output (row stride > H*(P+R))
    proj = torch.randn(T, H * (P + R) + 40, generator=g).to(device, dtype)
    q = proj[:, : H * (P + R)].view(T, H, P + R)
    q_nope, q_pe = q.split([P, R], dim=-1)
    kv_b = torch.randn(H, P + V, L, generator=g).to(device, dtype) / L ** 0.5
    w_uk, w_uv = kv_b[:, :P], kv_b[:, P:]  # views, as MLAAttention keeps them
    ref_q = torch.cat([torch.einsum("thp,hpl->thl", q_nope.double(), w_uk.double()), q_pe.double()], dim=-1)
    got_q = absorb_q(q_nope, q_pe, w_uk)
    assert got_q.shape == (T, H, L + R) and got_q.is_contiguous()
    assert torch.equal(got_q[..., L:], q_pe)  # the rope part is copied, not computed
    # with the RoPE rows: the same latent part, the rope part rotated as models.fused.rope does
    cos_sin = torch.randn(T, R, generator=g).to(device)
    got_qr = absorb_q(q_nope, q_pe, w_uk, cos_sin)
    assert torch.equal(got_qr[..., :L], got_q[..., :L])
    cos, sin = (c.view(T, 1, R // 2) for c in cos_sin.chunk(2, dim=-1))
    want_pe = rope(q_pe, cos, sin)
    torch.testing.assert_close(got_qr[..., L:], want_pe, rtol=tol, atol=tol if dtype == torch.float32 else 2e-2)
    assert not torch.equal(got_qr[..., L:], q_pe)
    # the prefill's standalone query RoPE: the same rotation, from the strided view
    from attention.triton_absorb import rope as rope_kernel
    got_pe = rope_kernel(q_pe, cos_sin)
    assert got_pe.is_contiguous()
    torch.testing.assert_close(got_pe, want_pe, rtol=tol, atol=tol if dtype == torch.float32 else 2e-2)
    o_lat = torch.randn(T, H, L, generator=g).to(device, dtype)
    ref_o = torch.einsum("thl,hvl->thv", o_lat.double(), w_uv.double())
    got_o = absorb_o(o_lat, w_uv)
    assert got_o.shape == (T, H, V) and got_o.is_contiguous()
    for got, ref in ((got_q, ref_q), (got_o, ref_o)):
        err = ((got.double() - ref).norm() / ref.norm()).item()
        assert err < tol, (T, H, P, R, L, V, dtype, err)
"""


def test_absorb_kernels_interpreter():
    """Small shapes (P and R not powers of two, V below one tile), and the real widths at T 80
    (several L, V and T tiles: the loops and the rope copy's one-tile condition)."""
    code = CHECK + r"""
for T in (1, 5, 17):
    check(T, 4, 16, 8, 32, 16, torch.float32, "cpu", 1e-6)
check(3, 2, 24, 12, 48, 20, torch.float32, "cpu", 1e-6)
check(19, 20, 16, 8, 32, 16, torch.float32, "cpu", 1e-6)  # heads over two partial tiles
check(80, 2, 128, 64, 512, 128, torch.float32, "cpu", 1e-6)
"""
    run_interpreted(code)


def test_absorb_rejects_non_contiguous_rows():
    from attention.triton_absorb import absorb_o
    with pytest.raises(ValueError, match="absorb_o"):
        absorb_o(torch.randn(2, 4, 32)[..., ::2], torch.randn(4, 16, 16))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64, 256])
@pytest.mark.parametrize("H", [16, 128])
def test_absorb_kernels_real_shapes(T, H):
    """DeepSeek shapes: P 128, R 64, Lkv 512, V 128; bf16 against a float64 reference."""
    ns = {}
    exec(CHECK, ns)
    ns["check"](T, H, 128, 64, 512, 128, torch.bfloat16, "cuda", 1e-2)
    ns["check"](T, H, 128, 64, 512, 128, torch.float32, "cuda", 1e-5)
