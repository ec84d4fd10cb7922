"""The absorbed decode's per-head product kernels (attention/triton_absorb.py) against einsum."""

from __future__ import annotations

import pytest
import torch

from attention.triton_absorb import absorb_o, absorb_q
from common.fused import rope


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
    # with the RoPE rows: the same latent part, the rope part rotated as common.fused.rope does
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
    # into the first T rows of a larger joint output (a mixed step's decode rows), the rest untouched
    joint = torch.full((T + 3, H, V), float("nan"), device=device, dtype=dtype)
    assert absorb_o(o_lat, w_uv, out=joint[:T]).data_ptr() == joint.data_ptr()
    assert torch.equal(joint[:T], got_o) and joint[T:].isnan().all()
    for got, ref in ((got_q, ref_q), (got_o, ref_o)):
        err = ((got.double() - ref).norm() / ref.norm()).item()
        assert err < tol, (T, H, P, R, L, V, dtype, err)


def check_fused(T, H, P, R, L, page, dtype, device, fp8=False):
    """absorb_q_kv_finish against absorb_q (q_pe rotated) and kv_finish: the same q and the same
    cache bytes, bit for bit (the same arithmetic, in one launch); padding slots (-1) unwritten."""
    from attention.kv_quant import FP8_DTYPE as FP8
    from attention.triton_absorb import absorb_q_kv_finish
    from attention.triton_cache import kv_finish
    g = torch.Generator().manual_seed(T * 11 + H)
    proj = torch.randn(T, H * (P + R) + 40, generator=g).to(device, dtype)
    q_nope, q_pe = proj[:, : H * (P + R)].view(T, H, P + R).split([P, R], dim=-1)
    w_uk = (torch.randn(H, P, L, generator=g) / L ** 0.5).to(device, dtype)
    kv = torch.randn(T, L + R + 8, generator=g).to(device, dtype)[:, 8:]  # a view of a wider output
    norm_w = (1 + 0.1 * torch.randn(L, generator=g)).to(device, dtype)
    cos_sin = torch.randn(T, R, generator=g).to(device)
    nb = max(4, -(-T // page) + 1)
    slots = torch.randperm(nb * page, generator=g)[:T].to(device)
    slots[1::3] = -1
    cache_dtype = FP8 if fp8 else dtype
    ref_cache = torch.zeros(nb, page, L + R, dtype=cache_dtype, device=device)
    got_cache = ref_cache.clone()
    ref_q = absorb_q(q_nope, q_pe, w_uk, cos_sin)
    kv_finish(kv, norm_w, 1e-6, cos_sin, ref_cache, slots, kv_scale=0.5)
    got_q = absorb_q_kv_finish(q_nope, q_pe, w_uk, cos_sin, kv, norm_w, 1e-6, got_cache, slots, kv_scale=0.5)
    assert got_q.shape == (T, H, L + R) and torch.equal(got_q, ref_q)
    assert torch.equal(got_cache.view(torch.uint8), ref_cache.view(torch.uint8))


def check_merged(T, S, H, L, V, dtype, device, tol, po_pad=0):
    """absorb_o_merge against reduce_splits + absorb_o, and against a float64 merge and product.
    Some splits are empty (lse -inf) and their rows hold NaN, as rows the decode never wrote
    would: none may reach the result; a row whose every split is empty gives 0. `po_pad` widens
    the partials' rows (a strided view)."""
    from attention.triton_absorb import absorb_o_merge
    from attention.triton_decode import reduce_splits
    g = torch.Generator().manual_seed(T * 13 + S)
    po = torch.randn(T, S, H, L + po_pad, generator=g)[..., :L]
    plse = 3 * torch.randn(T, S, H, generator=g)
    plse[torch.rand(T, S, H, generator=g) < 0.3] = float("-inf")
    plse[0, :, 0] = float("-inf")  # every split of (row 0, head 0) empty
    po[plse == float("-inf")] = float("nan")
    po, plse = po.to(device), plse.to(device)
    w_uv = (torch.randn(H, V, L, generator=g) / L ** 0.5).to(device, dtype)
    o = torch.empty(T, H, L, dtype=dtype, device=device)
    lse = torch.empty(T, H, dtype=torch.float32, device=device)
    reduce_splits(po, plse, o, lse, S, (po.stride(0), po.stride(1), po.stride(2)),
                  (plse.stride(0), plse.stride(1), plse.stride(2)))
    want = absorb_o(o, w_uv)
    got = absorb_o_merge(po, plse, w_uv)
    assert got.shape == (T, H, V) and got.dtype == dtype and got.is_contiguous()
    assert not got.isnan().any() and torch.equal(got[0, 0], torch.zeros_like(got[0, 0]))
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # float64: the merge by lse, then the product
    w = torch.exp(plse.double() - plse.double().amax(1, keepdim=True).nan_to_num(neginf=0.0)).nan_to_num(0.0)
    merged = (w.unsqueeze(-1) * po.double().nan_to_num(0.0)).sum(1) / w.sum(1).clamp_min(1e-300).unsqueeze(-1)
    ref = torch.einsum("thl,hvl->thv", merged, w_uv.double())
    err = ((got.double() - ref).norm() / ref.norm()).item()
    assert err < tol, (T, S, H, L, V, dtype, err)
    # into the first T rows of a larger joint output, the rest untouched
    joint = torch.full((T + 2, H, V), float("nan"), device=device, dtype=dtype)
    assert absorb_o_merge(po, plse, w_uv, out=joint[:T]).data_ptr() == joint.data_ptr()
    assert torch.equal(joint[:T], got) and joint[T:].isnan().all()


def test_absorb_o_merge_rejects_bad_partials():
    from attention.triton_absorb import absorb_o_merge
    po, plse, w_uv = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 4), torch.randn(4, 8, 16)
    with pytest.raises(ValueError, match="absorb_o_merge"):
        absorb_o_merge(po.half(), plse, w_uv)
    with pytest.raises(ValueError, match="absorb_o_merge"):
        absorb_o_merge(po, plse[:, :2], w_uv)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        absorb_o_merge(po, plse, w_uv, out=torch.empty(2, 8, 4).transpose(1, 2))


def test_absorb_q_kv_finish_rejects_mismatched_rope_widths():
    from attention.triton_absorb import absorb_q_kv_finish
    q_nope, q_pe, w_uk = torch.randn(2, 4, 16), torch.randn(2, 4, 8), torch.randn(4, 16, 32)
    with pytest.raises(ValueError, match="kv_finish"):  # k_pe 4 wide, q_pe 8: one cos_sin cannot serve both
        absorb_q_kv_finish(q_nope, q_pe, w_uk, torch.randn(2, 8), torch.randn(2, 36), torch.ones(32), 1e-6,
                           torch.zeros(4, 4, 36), torch.zeros(2, dtype=torch.int64))


def test_absorb_rejects_non_contiguous_rows():
    from attention.triton_absorb import absorb_o
    with pytest.raises(ValueError, match="absorb_o"):
        absorb_o(torch.randn(2, 4, 32)[..., ::2], torch.randn(4, 16, 16))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        absorb_o(torch.randn(2, 4, 16), torch.randn(4, 8, 16), out=torch.empty(2, 8, 4).transpose(1, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 64, 256])
@pytest.mark.parametrize("H", [16, 128])
def test_absorb_kernels_real_shapes(T, H):
    """DeepSeek shapes: P 128, R 64, Lkv 512, V 128; bf16 against a float64 reference."""
    check(T, H, 128, 64, 512, 128, torch.bfloat16, "cuda", 1e-2)
    check(T, H, 128, 64, 512, 128, torch.float32, "cuda", 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 33, 128])
@pytest.mark.parametrize("fp8", [False, True])
def test_absorb_q_kv_finish_real_shapes(T, fp8):
    check_fused(T, 16, 128, 64, 512, 64, torch.bfloat16, "cuda", fp8=fp8)


@pytest.mark.gpu
@pytest.mark.parametrize("T,S", [(1, 132), (8, 16), (32, 4), (40, 3), (8, 1), (20, 12)])
def test_absorb_o_merge_real_shapes(T, S):
    """The decode's split merge folded into absorb_o at DeepSeek's widths (16 heads, Lkv 512, V
    128) and the split counts the decode picks on an H100 / H200 (batch 1: ~132; 8: 16; 32: 4)."""
    check_merged(T, S, 16, 512, 128, torch.bfloat16, "cuda", 1e-2)
    check_merged(T, S, 16, 512, 128, torch.float32, "cuda", 1e-5)
