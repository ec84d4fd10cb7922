"""The one-kernel expert choice (models/triton_route.py) against the torch router, every rule."""

from __future__ import annotations

import functools

import pytest
import torch

from models.router import route
from models.triton_route import LOGITS_MAX_TOKENS, route_triton, router_logits


def check(case, device, T=7, D=48, fused=False):
    """The Triton router against the torch one; `fused`: through the one-launch kernel where the
    case has no groups (route_triton's fused_max_tokens = T), its logits on the tensor cores."""
    # T <= LOGITS_MAX_TOKENS: the logits are the Triton kernel's too (unfused)
    scoring, method, E, G, TG, k, norm, scale, has_bias = case
    g = torch.Generator().manual_seed(E + k)
    x = torch.randn(T, D, generator=g).to(device)
    w = torch.randn(E, D, generator=g).to(device)
    bias = (torch.randn(E, generator=g) * 0.1).to(device) if has_bias else None
    args = (x, w, bias, scoring, method, G, TG, k, norm, scale)
    rw, ri = route(*args)
    run = functools.partial(route_triton, fused_max_tokens=T if fused else 0)
    if fused and G > 1 and (scoring != "softmax" or method == "group_limited_greedy"):
        with pytest.raises(ValueError, match="router_fused_max_tokens: .* chosen by groups; leave"):
            run(*args)
        return
    if not fused and T <= LOGITS_MAX_TOKENS:
        for xx in (x, x.to(torch.bfloat16)):  # the kernel reads bf16 rows as the model gives them
            torch.testing.assert_close(router_logits(xx, w), xx.float() @ w.T, rtol=1e-5, atol=1e-4)
    tw, ti = run(*args)
    assert ti.dtype == torch.int64 and tw.dtype == torch.float32
    assert torch.equal(ti, ri), (case, ti, ri)
    # fp32 logits summed in another order (the Triton logits kernel, or cuBLAS on the GPU): a
    # weight moves by about the logit's rounding, |logit| ~ sqrt(D) here
    torch.testing.assert_close(tw, rw, rtol=1e-5 * max(1.0, D / 64), atol=1e-7)
    # the folded shared experts' columns, written by the choice kernel after the k choices
    sw, si = run(*args, n_shared=2)
    assert torch.equal(si[:, :k], ti) and torch.equal(sw[:, :k], tw)
    assert torch.equal(si[:, k:].cpu(), torch.arange(E, E + 2).expand(T, 2))
    assert torch.equal(sw[:, k:].cpu(), torch.ones(T, 2))
    empty = run(x[:0], *args[1:])
    assert empty[0].shape == (0, k) and empty[1].shape == (0, k)
    if T < 3:
        return
    # overflowed rows (NaN, inf) still get k distinct valid ids; the good rows are unchanged
    bad = x.clone()
    bad[1] = float("nan")
    bad[2, 0] = float("inf")
    bw, bi = run(bad, *args[1:])
    assert int(bi.min()) >= 0 and int(bi.max()) < E
    assert all(len(set(r)) == k for r in bi.tolist())
    assert torch.equal(bi[3:], ti[3:]) and torch.equal(bi[0], ti[0])


def check_ties(device):
    """Exact ties (experts 9 and 12 with the router rows of 2 and 4): both Triton routers take the
    lower id first, so the one launch and the two choose alike, order included."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 64, generator=g).to(device)
    w = torch.randn(16, 64, generator=g)
    w[9], w[12] = w[2], w[4]
    args = (x, w.to(device), None, "softmax", "greedy", 1, 1, 4, False, 1.0)
    fw, fi = route_triton(*args, fused_max_tokens=40)
    tw, ti = route_triton(*args)
    assert torch.equal(fi, ti)
    rows = fi.tolist()
    both = [r for r in rows if (2 in r and 9 in r) or (4 in r and 12 in r)]
    assert both, "no row chose both experts of a tie: pick another seed"
    assert all(r.index(lo) < r.index(hi) for r in both for lo, hi in ((2, 9), (4, 12)) if lo in r and hi in r)


# (scoring, topk_method, E, n_group, topk_group, top_k, norm, scale, bias)
CASES = [
    ("softmax", "greedy", 64, 1, 1, 6, False, 1.0, False),  # V2-Lite
    ("softmax", "group_limited_greedy", 160, 8, 3, 6, False, 16.0, False),  # V2: 20 per group
    ("sigmoid", "noaux_tc", 256, 8, 4, 8, True, 2.5, True),  # V3 / R1
    ("sigmoid", "noaux_tc", 16, 4, 2, 4, True, 1.0, True),  # the tiny V3
    ("softmax", "greedy", 20, 1, 1, 1, True, 1.0, False),  # k = 1: no normalisation
    ("sigmoid", "noaux_tc", 24, 1, 1, 3, False, 1.0, True),  # sigmoid without groups
    ("softmax", "greedy", 64, 1, 1, 6, True, 1.5, False),  # no groups, normalised and scaled
]


def test_route_rejects_a_layout_that_cannot_fill_k():
    from models.triton_route import route_triton
    x, w = torch.randn(2, 8), torch.randn(12, 8)
    with pytest.raises(ValueError, match="top-8"):
        route_triton(x, w, None, "softmax", "group_limited_greedy", 4, 2, 8, False, 1.0)


def test_router_fused_refuses_what_it_cannot_serve():
    """The one-launch router names its setting where it cannot serve the router (asked for, it
    never quietly takes the two launches)."""
    x, w = torch.randn(3, 32), torch.randn(80, 32)
    with pytest.raises(ValueError, match=r"router_fused_max_tokens: .* 80 experts, more than 64; leave"):
        route_triton(x, w, None, "softmax", "greedy", 1, 1, 6, False, 1.0, fused_max_tokens=8)
    with pytest.raises(ValueError, match=r"router_fused_max_tokens: .* not exactly bf16"):
        route_triton(x.bfloat16(), w[:64], None, "softmax", "greedy", 1, 1, 6, False, 1.0, None, fused_max_tokens=8)
    with pytest.raises(ValueError, match=r"router_fused_max_tokens: .* torch.float16 \(bf16 or fp32 only\)"):
        route_triton(x.half(), w[:64], None, "softmax", "greedy", 1, 1, 6, False, 1.0, fused_max_tokens=8)


def test_router_logits_rejects_mismatched_widths():
    from models.triton_route import router_logits
    with pytest.raises(ValueError, match="router_logits"):
        router_logits(torch.randn(2, 8), torch.randn(12, 9))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_route_kernel_gpu(case):
    check(case, "cuda", T=300)  # cuBLAS logits
    check(case, "cuda", T=8, D=2048)  # the Triton logits kernel where 8 * E * 2048 is in its envelope
    check(case, "cuda", T=32, D=2048)  # at its bound for V2-Lite's 64 experts
    check(case, "cuda", T=1, D=7168)  # the Triton logits kernel, four passes over V3's width
    check(case, "cuda", T=3, D=7168)  # and with the overflowed rows
    check(case, "cuda", T=40, D=2048, fused=True)  # the one-launch router where the case has no groups
    check_ties("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 17, 64, 128, 512])
def test_router_fused_bf16_gpu(T):
    """V2-Lite's router in one launch, as the engine runs it (bf16 activations, the exact bf16
    copy of the weight, two folded shared experts): the two-launch path's expert ids, and its
    weights within the logits' rounding (the same exact products, summed in another order)."""
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, 2048, generator=g).to("cuda", torch.bfloat16)
    w = torch.randn(64, 2048, generator=g).to(torch.bfloat16).float().to("cuda")
    args = (x, w, None, "softmax", "greedy", 1, 1, 6, False, 1.0, w.to(torch.bfloat16), 2)
    fw, fi = route_triton(*args, fused_max_tokens=T)
    tw, ti = route_triton(*args)
    assert torch.equal(fi, ti)
    # the same exact products summed in other orders (the tensor cores' against the logits kernel's
    # or cuBLAS's): logits ~45 apart by up to ~1e-4, as check()'s bound at this width
    torch.testing.assert_close(fw, tw, rtol=1e-5 * 2048 / 64, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [33, 512, 8192])
def test_router_logits_bf16_gemm_equals_fp32_gemm(T):
    """Beyond the Triton kernel's envelope, bf16 activations against a bf16 copy of a
    bf16-representable fp32 weight: the cuBLAS bf16 GEMM with fp32 output gives fp32-class logits
    (the products are exact) and the float64 expert choice."""
    from models.router import Router
    from models.triton_route import router_logits
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, 2048, generator=g).to("cuda", torch.bfloat16)
    w = torch.randn(64, 2048, generator=g).to(torch.bfloat16).float().to("cuda")
    r = Router.__new__(Router)
    torch.nn.Module.__init__(r)
    r.weight = torch.nn.Parameter(w, requires_grad=False)
    r.keep_bf16_weight()
    assert r.weight_bf16 is not None and r.weight_bf16.dtype == torch.bfloat16
    ref = torch.nn.functional.linear(x.double(), w.double())
    got = router_logits(x, w, r.weight_bf16)
    assert got.dtype == torch.float32 and got.shape == (T, 64)
    # fp32-class sums: tensor cores add the exact products in fp32 in their own order and rounding,
    # so the error is not the fp32 GEMM's, but it stays far below a bf16 output's rounding (2^-9 of
    # the largest logit) or bf16 partial sums; and the top-6 choice is the float64 one wherever
    # the 6th and 7th logits are not a near-tie
    err = (got.double() - ref).abs().max().item()
    err_fp32 = (torch.nn.functional.linear(x.float(), w).double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= scale * 2 ** -14, (err, err_fp32, scale)
    top = ref.topk(7, dim=-1).values
    clear = (top[:, 5] - top[:, 6]) > 1e-2
    assert torch.equal(got.topk(6, dim=-1).indices.sort(-1).values[clear],
                       ref.topk(6, dim=-1).indices.sort(-1).values[clear])
    # a weight bf16 cannot hold keeps the fp32 path
    r.weight = torch.nn.Parameter(w + 1e-4, requires_grad=False)
    r.keep_bf16_weight()
    assert r.weight_bf16 is None


def check_norm_logits(device, dtype, T, E, D, exact_logits=True, strided=False):
    """`add_norm_router_logits` (moe_norm_in_router_max_tokens) against its two launches: the add + RMSNorm
    kernel's s and y bit for bit, the logits kernel's logits from that y (bit for bit where both
    sum one block of the same width; wider rows: within fp32 rounding), and the torch reference;
    the choice from them is route_triton's."""
    from common.fused import add_rms_norm as torch_add_rms_norm
    from common.triton_norm import add_rms_norm
    from models.triton_route import add_norm_router_logits, route_choice
    g = torch.Generator().manual_seed(T * 1000 + D)
    x = torch.randn(T, D + 8 if strided else D, generator=g).to(device, dtype)[:, :D]
    h = (torch.randn(T, D, generator=g) * 0.5).to(device, dtype)
    nw = (1 + 0.1 * torch.randn(D, generator=g)).to(device, dtype)
    w = (torch.randn(E, D, generator=g) / D ** 0.5).to(device)
    s, y, logits = add_norm_router_logits(x, h, nw, 1e-6, w)
    rs, ry = add_rms_norm(x, h, nw, 1e-6)
    if device == "cuda":  # a bf16-exact weight read as its bf16 copy: the same logits
        wb = w.to(torch.bfloat16)
        assert torch.equal(add_norm_router_logits(x, h, nw, 1e-6, wb.float(), wb)[2],
                           add_norm_router_logits(x, h, nw, 1e-6, wb.float())[2])
    assert s.is_contiguous() and y.dtype == ry.dtype and logits.shape == (T, E)
    assert torch.equal(s, rs) and torch.equal(y, ry)
    want = router_logits(ry, w)
    if exact_logits:
        assert torch.equal(logits, want)
    else:
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    ts, ty = torch_add_rms_norm(x.float(), h.float(), nw.float(), 1e-6)
    torch.testing.assert_close(y.float(), ty, rtol=2e-2 if dtype != torch.float32 else 1e-5, atol=1e-2)
    args = (None, "softmax", "greedy", 1, 1, min(6, E), False, 1.0)
    cw, ci = route_choice(logits, *args, n_shared=2)
    tw, ti = route_triton(y, w, *args, n_shared=2)
    assert torch.equal(ci, ti)  # from the same logits (exact_logits) or ones a rounding apart
    assert torch.equal(cw, tw) if exact_logits else torch.allclose(cw, tw, rtol=1e-5, atol=1e-7)


def test_norm_logits_refuses_what_its_kernel_cannot_take():
    from models.triton_route import LOGITS_MAX_TOKENS, add_norm_router_logits
    x, w, nw = torch.randn(LOGITS_MAX_TOKENS + 1, 16), torch.randn(8, 16), torch.ones(16)
    with pytest.raises(ValueError, match=r"add_norm_router_logits: x \(33, 16\) .* the logits kernel's envelope"):
        add_norm_router_logits(x, x, nw, 1e-6, w)
    with pytest.raises(ValueError, match="add_norm_router_logits"):
        add_norm_router_logits(x[:4], x[:4].half(), nw, 1e-6, w)
    with pytest.raises(ValueError, match="add_norm_router_logits"):
        add_norm_router_logits(x[:4], x[:4], nw, 1e-6, w.double())


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 8, 16, 32])
def test_norm_logits_gpu(T):
    """V2-Lite's shapes in bf16 as the engine runs them: bit for bit the two launches'."""
    check_norm_logits("cuda", torch.bfloat16, T, 64, 2048)
    check_norm_logits("cuda", torch.bfloat16, T, 64, 2048, strided=True)


@pytest.mark.gpu
def test_norm_logits_wide_rows_gpu():
    """V3's router at one token (7168 columns, 256 experts; V2's 5120 x 160): one 8192-wide block
    with the norm kernel's 8 warps, so s and y are its bits; the logits sum in another order than
    the logits kernel's 2048-column passes."""
    check_norm_logits("cuda", torch.bfloat16, 1, 256, 7168, exact_logits=False)
    check_norm_logits("cuda", torch.bfloat16, 1, 160, 5120, exact_logits=False)
