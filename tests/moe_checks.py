"""The MoE checks shared by tests/test_fused_moe.py (real shapes on the GPU) and
tests/interpreted/test_fused_moe_kernels.py (small shapes under the interpreter): each runs a
Triton MoE path against the torch experts loop (or an fp32 emulation of its FP8 arithmetic)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.config import ModelConfig
from models.fused_moe import fused_moe_small, fused_moe_small_overlapped
from models.moe import MoE


def random_moe(cfg_overrides, T, dtype, device):
    # a V2-Lite-shaped MoE layer (2 shared experts, stacked after the routed), T tokens and their routing
    cfg = ModelConfig.from_pretrained("configs/models/DeepSeek-V2-Lite", cfg_overrides)
    torch.manual_seed(T)
    with torch.device(device):
        moe = MoE(cfg, dtype)
        for p in moe.parameters():
            p.data.normal_(0, 0.05)
        x = torch.randn(T, cfg.hidden_size, dtype=dtype)
        w, ids = moe.gate(x)
    assert moe.n_shared == cfg.n_shared_experts > 0
    return moe, x, w, ids


def check(cfg_overrides, T, dtype, device, tol):
    moe, x, w, ids = random_moe(cfg_overrides, T, dtype, device)
    with torch.device(device):
        ref = moe._routed(x, w, ids).double()
        got = fused_moe_small(x, moe.w13, moe.w2, w, ids).double()
        # with the shared experts: against the plain path taking them as extra weight-1 choices,
        # and against the shared MLP computed on its own
        ref_all = moe._routed(x, *moe._with_shared(w, ids)).double()
        out_all = fused_moe_small(x, moe.w13, moe.w2, w, ids, n_shared=moe.n_shared)
        got_all = out_all.double()
        # defer_sum: the pair rows unsummed, whose in-order sum is the summed output, bit for bit
        pairs = fused_moe_small(x, moe.w13, moe.w2, w, ids, n_shared=moe.n_shared, defer_sum=True)
        assert pairs.part.shape == (T, ids.shape[1] + moe.n_shared, x.shape[1]) and pairs.dtype == x.dtype
        assert torch.equal(pairs.sum(), out_all)
        # the shared and the routed pairs launched apart (moe_shared_stream; the shared ones on a
        # second stream on CUDA): the same pair rows, the same output bits
        k, ns = ids.shape[1], moe.n_shared
        shared = torch.zeros(1, ns, dtype=torch.int32), torch.full((1, ns), float("nan"))  # never read
        stream = torch.cuda.Stream() if device == "cuda" else None
        split = fused_moe_small_overlapped(x, moe.w13, moe.w2, lambda: (w, ids), k, shared, stream)
        assert torch.equal(split, out_all)
        # shared_x: the shared pairs' input from a launch of the side stream while route() writes
        # x (SideNorm): the same rows give the same bits; zero rows zero the shared pairs alone
        x_routed = torch.full_like(x, float("nan"))

        def route_writing_x():
            x_routed.copy_(x)
            return w, ids

        split_pairs = fused_moe_small_overlapped(x, moe.w13, moe.w2, lambda: (w, ids), k, shared, stream,
                                                 defer_sum=True)  # the same launches' tiles as below
        both = fused_moe_small_overlapped(x_routed, moe.w13, moe.w2, route_writing_x, k, shared, stream,
                                          defer_sum=True, shared_x=lambda: x.clone())
        assert torch.equal(both.part, split_pairs.part)
        zero = fused_moe_small_overlapped(x_routed, moe.w13, moe.w2, route_writing_x, k, shared, stream,
                                          defer_sum=True, shared_x=lambda: torch.zeros_like(x))
        assert torch.equal(zero.part[:, :k], split_pairs.part[:, :k]) and not zero.part[:, k:].any()
        sh = moe.w13[-moe.n_shared:], moe.w2[-moe.n_shared:]
        I = moe.w2.shape[-1]
        shared = sum(F.linear(F.silu(x @ a[:I].T) * (x @ a[I:].T), b) for a, b in zip(*sh)).double()
    err = ((got - ref).norm() / ref.norm()).item()
    err_all = ((got_all - ref_all).norm() / ref_all.norm()).item()
    err_sh = ((ref_all - ref - shared).norm() / shared.norm()).item()
    assert err < tol and err_all < tol and err_sh < tol, (cfg_overrides, T, dtype, err, err_all, err_sh)
    return err


def check_blocked(cfg_overrides, T, dtype, device, tol, block_m):
    # medium batches: pairs sorted by expert into blocks; against the plain path with shared experts
    from models.blocked_moe import fused_moe_blocked, fused_moe_blocked_overlapped
    moe, x, w, ids = random_moe(cfg_overrides, T, dtype, device)
    ref = moe._routed(x, *moe._with_shared(w, ids)).double()
    out = fused_moe_blocked(x, moe.w13, moe.w2, *moe._with_shared(w, ids), block_m=block_m)
    got = out.double()
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < tol, (cfg_overrides, T, dtype, block_m, err)
    pairs = fused_moe_blocked(x, moe.w13, moe.w2, *moe._with_shared(w, ids), block_m=block_m, defer_sum=True)
    assert torch.equal(pairs.sum(), out)  # the pair rows unsummed: their in-order sum is the output
    # the programs' order (groups of 3 blocks, the last one short) changes no bit of the output
    grouped = fused_moe_blocked(x, moe.w13, moe.w2, *moe._with_shared(w, ids), block_m=block_m, group_b=3)
    assert torch.equal(grouped, fused_moe_blocked(x, moe.w13, moe.w2, *moe._with_shared(w, ids), block_m=block_m,
                                                  group_b=0))
    # the shared experts' blocks launched apart (moe_shared_stream; on a second stream on CUDA),
    # the routed pairs sorted alone: the same pair rows, the same output bits. The shared columns'
    # weights are NaN: neither launch may read them (the shared blocks carry their own ones)
    k, ns = ids.shape[1], moe.n_shared
    ids_all = moe._with_shared(w, ids)[1]
    w_all = torch.cat([w, torch.full((T, ns), float("nan"), dtype=w.dtype, device=w.device)], dim=1)
    stream = torch.cuda.Stream() if device == "cuda" else None

    def route():
        return w_all, ids_all

    split = fused_moe_blocked_overlapped(x, moe.w13, moe.w2, route, k, ns, stream, block_m, shared_block_m=block_m)
    assert torch.equal(split, out)
    deferred = fused_moe_blocked_overlapped(x, moe.w13, moe.w2, route, k, ns, stream, block_m, defer_sum=True,
                                            shared_block_m=block_m)
    assert torch.equal(deferred.part, pairs.part)
    # shared_x: the shared experts' input from a launch of its own on the side stream, while
    # route() writes the routed pairs' x (SideNorm). The same rows give the same bits; zero rows
    # for the shared launch zero the shared pairs' rows alone
    x_routed = torch.full_like(x, float("nan"))  # written by route(), read only after it

    def route_writing_x():
        x_routed.copy_(x)
        return w_all, ids_all

    both = fused_moe_blocked_overlapped(x_routed, moe.w13, moe.w2, route_writing_x, k, ns, stream, block_m,
                                        defer_sum=True, shared_block_m=block_m, shared_x=lambda: x.clone())
    assert torch.equal(both.part, pairs.part)
    zero = fused_moe_blocked_overlapped(x_routed, moe.w13, moe.w2, route_writing_x, k, ns, stream, block_m,
                                        defer_sum=True, shared_block_m=block_m, shared_x=lambda: torch.zeros_like(x))
    assert torch.equal(zero.part[:, :k], pairs.part[:, :k]) and not zero.part[:, k:].any()
    # the default: the shared experts in deeper blocks (SHARED_BLOCK_M), tiled otherwise; the
    # routed pairs' rows are still the same bits
    deep = fused_moe_blocked_overlapped(x, moe.w13, moe.w2, route, k, ns, stream, block_m, defer_sum=True)
    assert torch.equal(deep.part[:, :k], pairs.part[:, :k])
    err_deep = ((deep.sum().double() - ref).norm() / ref.norm()).item()
    assert err_deep < tol, (cfg_overrides, T, dtype, block_m, err_deep)
    return err


def check_shared_dense(cfg_overrides, T, dtype, device, tol, **plan):
    """MoE.forward with the shared experts as their own GEMMs (moe_shared_dense_min_tokens) equals
    MoE.forward with them folded into the routed path, on the same weights and tokens."""
    from common.kernel_plan import KernelPlan
    moe, x, _, _ = random_moe(cfg_overrides, T, dtype, device)
    dense = MoE(moe.cfg, dtype, KernelPlan(**plan, moe_shared_dense_min_tokens=T)).to(device)
    folded = MoE(moe.cfg, dtype, KernelPlan(**plan)).to(device)
    for m in (dense, folded):
        m.load_state_dict(moe.state_dict())
    with torch.device(device):
        got, ref = dense(x).double(), folded(x).double()
        above = MoE(moe.cfg, dtype, KernelPlan(**plan, moe_shared_dense_min_tokens=T + 1)).to(device)
        above.load_state_dict(moe.state_dict())
        assert torch.equal(above(x), folded(x)), "below moe_shared_dense_min_tokens the shared experts stay folded"
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < tol, (cfg_overrides, T, dtype, plan, err)
    return err


def check_side_norm(cfg_overrides, T, dtype, device, monkeypatch):
    """MoE.forward with a `SideNorm` (moe_norm_in_router_max_tokens on the block path with the
    shared experts' stream: the add + norm in the router's logits kernel for the routed pairs and
    in a norm kernel of the side stream for the shared ones) equals the same path after one add +
    norm kernel, bit for bit, and gives the same residual. On the CPU the side stream is the
    current one (the path itself is CUDA's: `_paths` is made to say it is taken)."""
    from common.kernel_plan import KernelPlan
    from common.triton_norm import add_rms_norm
    from models import moe as moe_module
    from models.moe import SideNorm
    moe, x, _, _ = random_moe(cfg_overrides, T, dtype, device)
    plan = KernelPlan(router="triton", norm="triton", moe="triton", moe_fused_max_tokens=4, moe_blocked_max_tokens=512,
                      moe_shared_stream=True, moe_norm_in_router_max_tokens=T)
    fast = MoE(moe.cfg, dtype, plan).to(device)
    fast.load_state_dict(moe.state_dict())
    fast.gate.weight.data = fast.gate.weight.data.to(dtype).float()  # the router's values exact in bf16
    fast.gate.keep_bf16_weight()
    fast.process_weights_after_loading()
    if device != "cuda":
        paths = MoE._paths
        monkeypatch.setattr(MoE, "_paths", lambda self, T, dev: (*paths(self, T, dev)[:3], True))
        monkeypatch.setattr(moe_module, "side_stream", lambda dev: None)
    torch.manual_seed(T + 1)
    residual, h = (torch.randn(T, moe.cfg.hidden_size, dtype=dtype, device=device) for _ in range(2))
    nw = 1 + 0.1 * torch.randn(moe.cfg.hidden_size, dtype=dtype, device=device)
    assert fast.gate.fuses_norm(h) and fast.takes_side_norm(h)
    with torch.device(device):
        s_ref, y_ref = add_rms_norm(residual, h, nw, 1e-6)
        ref = fast(y_ref)
        side = SideNorm(fast.gate, residual, h, nw, 1e-6)
        got = fast(side.x, logits=side.logits, side_norm=side)
    assert torch.equal(side.s, s_ref) and torch.equal(side.x, y_ref) and torch.equal(got, ref)
    return got


def check_align_leaves_out(ids, E, block_m, n_out=2, kernel=True):
    # the overlapped block path's sort: n_out columns of ids past the experts (its shared experts)
    # appended to ids [T, k]; both sorts leave their pairs out and bound the blocks by the T*k
    # others: the layout of ids alone, each pair t*k+j renumbered t*(k+n_out)+j
    from models.expert_sort import align_pairs, sort_pairs_into_blocks
    T, k = ids.shape
    extra = torch.arange(E, E + n_out, device=ids.device, dtype=ids.dtype).expand(T, -1)
    wide = torch.cat([ids, extra], dim=1)
    rows, bexp = sort_pairs_into_blocks(ids, E, block_m)
    want = torch.where(rows >= 0, rows // k * (k + n_out) + rows % k, -1)
    sorts = [sort_pairs_into_blocks] + ([align_pairs] if kernel else [])  # the kernel: CUDA or the interpreter
    for got in (sort(wide, E, block_m, T * k) for sort in sorts):
        assert torch.equal(got[0], want) and torch.equal(got[1], bexp), (T, k, E, block_m, got, want)


def check_glue(T, kt, E, block_m, device, seed=0):
    # the blocked path's one-kernel alignment equals the torch reference element for element;
    # the grouped path's row gather, SwiGLU and weighted un-permute equal their torch forms
    from models.expert_sort import align_pairs, sort_pairs_into_blocks
    from models.grouped_glue import gather_rows, silu_mul, unpermute_sum
    from common.fused import silu_mul as silu_ref
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:kt] for _ in range(T)]).to(device)
    want = sort_pairs_into_blocks(ids, E, block_m)
    got = align_pairs(ids, E, block_m)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), (T, kt, E, block_m, got, want)
    check_align_leaves_out(ids, E, block_m)
    D = 96
    x = torch.randn(T, 300, generator=g).to(device)  # 300 columns: a partial 256-wide tile
    order = ids.flatten().argsort(stable=True)
    token_of = order // kt
    assert torch.equal(gather_rows(x, token_of), x[token_of])
    assert torch.equal(gather_rows(x[:, 7:107], token_of), x[:, 7:107][token_of])  # a strided x
    assert torch.equal(gather_rows(x.bfloat16(), token_of), x.bfloat16()[token_of])
    assert gather_rows(x, token_of[:0]).shape == (0, 300)
    with pytest.raises(ValueError, match="contiguous"):
        gather_rows(x, torch.zeros(4, dtype=torch.int64, device=device)[::2])
    gu = torch.randn(T * kt, 2 * 40, generator=g).to(device)
    assert torch.allclose(silu_mul(gu), silu_ref(gu), atol=1e-6, rtol=1e-5)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=order.device)
    y, w = torch.randn(T * kt, D, generator=g).to(device), torch.rand(T, kt, generator=g).to(device)
    ref = torch.zeros(T, D, device=device).index_add_(0, order // kt, y * w.flatten()[order].unsqueeze(-1))
    assert torch.allclose(unpermute_sum(y, pos, w), ref, atol=1e-5, rtol=1e-5)
    check_expert_sort(ids, E)


def check_expert_sort(ids, E, block=512):
    """The grouped path's counting sort equals the stable torch sort, element for element."""
    from models.expert_sort import sort_by_expert
    kt = ids.shape[1]
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=order.device)
    ends = torch.arange(1, E + 1, dtype=torch.int32, device=ids.device)
    offs = torch.searchsorted(flat[order].to(torch.int32), ends, out_int32=True)
    got = sort_by_expert(ids, E, block)
    want = (order // kt, pos, offs)
    for a, b, name in zip(got, want, ("token_of", "pos", "offs")):
        assert a.dtype == b.dtype and torch.equal(a, b), (name, ids.shape, E, block, a, b)


def expert_sort_ids(T, kt, E, skewed, device, seed=0):
    """Routing ids `[T, kt]`, distinct per token: random, or every token on experts 0..kt-1 (one
    run per expert spanning every block, the other experts empty)."""
    if skewed:
        return torch.arange(kt).repeat(T, 1).to(device)
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:kt] for _ in range(T)]).to(device)


def fp8_experts(E, D, I):
    """Random experts quantized to FP8 with 128x128 block scales (scales uneven across blocks):
    (q13, s13, q2, s2), on the current device."""
    from models.fp8 import quantize
    w13 = torch.randn(E, 2 * I, D) * 0.05 * torch.rand(E, 2 * I, 1) * 4  # uneven blocks
    w2 = torch.randn(E, D, I) * 0.05 * torch.rand(E, 1, I) * 4
    q13, s13 = zip(*(quantize(w) for w in w13))
    q2, s2 = zip(*(quantize(w) for w in w2))
    return tuple(map(torch.stack, (q13, s13, q2, s2)))


def routed_reference(x, w13, w2, w, ids):
    """Routed output of x `[T, D]` in fp32 with the experts w13 `[E, 2I, D]`, w2 `[E, D, I]`:
    a loop over the experts hit, each pair's rows gathered."""
    x, I = x.float(), w2.shape[-1]
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gu = x[tok] @ w13[e].float().T
        y = (F.silu(gu[:, :I]) * gu[:, I:]) @ w2[e].float().T
        out.index_add_(0, tok, y * w[tok, slot, None].float())
    return out


def check_fp8(T, dtype, device, tol, D=256, I=256, E=8, k=3):
    # FP8 experts with 128x128 block scales: the kernel dequantizing tile by tile equals the
    # same kernel on the dequantized weights.
    from models.fp8 import dequantize
    torch.manual_seed(100 + T)
    with torch.device(device):
        q13, s13, q2, s2 = fp8_experts(E, D, I)
        x = torch.randn(T, D, dtype=dtype)
        ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
        w = torch.rand(T, k)
        d13, d2 = dequantize(q13, s13, (128, 128), dtype), dequantize(q2, s2, (128, 128), dtype)
        ref = fused_moe_small(x, d13, d2, w, ids).double()
        got = fused_moe_small(x, q13, q2, w, ids, s13, s2, 128).double()
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < tol, (T, dtype, err)
    return err


def check_fp8_blocked(T, dtype, device, tol, block_m, D=256, I=256, E=8, k=3, unhit=2):
    """FP8 experts through the expert-sorted block kernels (each tile's product scaled per output
    column) against the torch loop on the dequantized weights; the last `unhit` experts are
    chosen by no token."""
    from models.fp8 import dequantize
    from models.blocked_moe import fused_moe_blocked
    torch.manual_seed(200 + T + block_m)
    with torch.device(device):
        q13, s13, q2, s2 = fp8_experts(E, D, I)
        x = torch.randn(T, D, dtype=dtype)
        ids = torch.stack([torch.randperm(E - unhit)[:k] for _ in range(T)])
        w = torch.rand(T, k)
        ref = routed_reference(x, dequantize(q13, s13, (128, 128)), dequantize(q2, s2, (128, 128)), w, ids)
        got = fused_moe_blocked(x, q13, q2, w, ids, block_m, w13_scale=s13, w2_scale=s2, block=128)
    assert got.dtype == dtype and got.shape == (T, D)
    err = ((got.float() - ref).norm() / ref.norm()).item()
    assert err < tol, (T, dtype, block_m, D, I, err)
    return err


def w8a8_reference(x, q13, s13, q2, s2, w, ids):
    """Routed output (fp32) of the W8A8 block MoE: x quantized per token by act_quant, each pair's
    h = silu(x W_gate^T) * (x W_up^T) on the dequantized operands rounded to x's dtype (as the
    kernel stores it) and quantized per pair by act_quant, times the dequantized W2."""
    from models.fp8 import dequantize
    from models.fp8_gemm import act_quant
    T, kt, I = ids.shape[0], ids.shape[1], q2.shape[-1]
    xd = dequantize(*act_quant(x), (1, 128))
    d13, d2 = dequantize(q13, s13, (128, 128)), dequantize(q2, s2, (128, 128))
    pair_e, pair_t = ids.flatten(), torch.arange(T * kt, device=x.device) // kt
    h = torch.empty(T * kt, I, device=x.device)
    for e in pair_e.unique().tolist():
        p = (pair_e == e).nonzero(as_tuple=True)[0]
        gu = xd[pair_t[p]] @ d13[e].T
        h[p] = (F.silu(gu[:, :I]) * gu[:, I:]).to(x.dtype).float()
    hd = dequantize(*act_quant(h.to(x.dtype)), (1, 128))
    out = torch.zeros(T, x.shape[1], device=x.device)
    for e in pair_e.unique().tolist():
        p = (pair_e == e).nonzero(as_tuple=True)[0]
        out.index_add_(0, pair_t[p], (hd[p] @ d2[e].T) * w.flatten()[p, None].float())
    return out


def check_fp8_blocked_a8(T, dtype, device, tol, block_m, D=256, I=256, E=8, k=3, unhit=2):
    """The W8A8 block kernels (fused_moe_blocked(a8=True)) against w8a8_reference. Tokens of
    very different magnitudes, so a kernel that took another token's (or pair's) activation scale,
    or none, is off by far more than tol; the last `unhit` experts are chosen by no token.
    Returns (error vs the W8A8 reference, distance from the weight-only kernels' output)."""
    from models.blocked_moe import fused_moe_blocked
    torch.manual_seed(400 + T + block_m)
    with torch.device(device):
        q13, s13, q2, s2 = fp8_experts(E, D, I)
        x = (torch.randn(T, D) * (0.1 + 4 * torch.rand(T, 1))).to(dtype)
        ids = torch.stack([torch.randperm(E - unhit)[:k] for _ in range(T)])
        w = torch.rand(T, k)
        ref = w8a8_reference(x, q13, s13, q2, s2, w, ids)
        got = fused_moe_blocked(x, q13, q2, w, ids, block_m, w13_scale=s13, w2_scale=s2, block=128, a8=True)
        w_only = fused_moe_blocked(x, q13, q2, w, ids, block_m, w13_scale=s13, w2_scale=s2, block=128)
    assert got.dtype == dtype and got.shape == (T, D)
    err = ((got.float() - ref).norm() / ref.norm()).item()
    assert err < tol, (T, dtype, block_m, D, I, err)
    return err, ((got.float() - w_only.float()).norm() / w_only.float().norm()).item()


def fp8_moe_pair(T, dtype, device, overrides=None, **plan):
    """Two MoE layers of the R1 config narrowed by `overrides`, with the same FP8 experts kept in
    FP8 (keep_fp8): one on the torch plan, one on the Triton plan `plan`; and T tokens."""
    from common.kernel_plan import KernelPlan
    cfg = ModelConfig.from_pretrained("configs/models/DeepSeek-R1", overrides)
    torch.manual_seed(300 + T)
    with torch.device(device):
        torch_moe = MoE(cfg, dtype, keep_fp8=True)
        triton_moe = MoE(cfg, dtype, KernelPlan(moe="triton", **plan), keep_fp8=True)
        q13, s13, q2, s2 = fp8_experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        gate_w, bias = torch.randn(cfg.n_routed_experts, cfg.hidden_size), torch.randn(cfg.n_routed_experts) * 0.1
        for m in (torch_moe, triton_moe):
            assert m.w13.dtype == torch.float8_e4m3fn and m.shared_experts is None
            for prm, v in ((m.w13, q13), (m.w13_scale, s13), (m.w2, q2), (m.w2_scale, s2),
                           (m.gate.weight, gate_w), (m.gate.e_score_correction_bias, bias)):
                prm.data.copy_(v)
            m.process_weights_after_loading()
            assert m.fp8_block == (128, 128)
        x = torch.randn(T, cfg.hidden_size, dtype=dtype)
    return torch_moe, triton_moe, x


def check_fp8_moe(T, dtype, device, tol, overrides=None, **plan):
    """MoE.forward with FP8 experts past the fused bound: the Triton plan (the block kernels,
    whatever moe_blocked_max_tokens says) equals the torch plan (the loop, dequantizing the experts
    hit), and dequantizes nothing."""
    import models.moe as moe_mod
    torch_moe, triton_moe, x = fp8_moe_pair(T, dtype, device, overrides, **plan)

    def refuse(*a, **kw):
        raise AssertionError("the Triton plan dequantized FP8 experts")

    with torch.device(device):
        ref = torch_moe(x).float()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(moe_mod, "dequantize", refuse)
            got = triton_moe(x).float()
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < tol, (T, dtype, plan, err)
    return err


SMALL_FP8_MOE = {"hidden_size": 256, "moe_intermediate_size": 256, "n_routed_experts": 8,
                 "num_experts_per_tok": 3, "n_group": 1, "topk_group": 1, "n_shared_experts": 0}
