"""The absorbed decode's per-head products, written where the next step reads them.

MLA's decode multiplies each head's query by W_UK before attention and each head's latent output
by W_UV after it (DESIGN.md §4). As `torch.einsum` these are batched GEMMs whose outputs are
head-major views, so the step also pays a cat (latent query ‖ rope query) and a copy (to flatten
the heads for o_proj): four launches per layer at decode, each a few µs on small batches.
Here:
  absorb_q: q [T, H, L+R] = [q_nope[t, h] @ W_UK[h] ‖ rope(q_pe[t, h])]   (one kernel, no cat,
            and the query's RoPE on the way)
  absorb_o: o [T, H, V]   = o_lat[t, h] @ W_UV[h]^T, contiguous      (one kernel, no copy)
Products accumulate in fp32 (tensor cores; IEEE for fp32 models) and round once to the dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.kv_quant import is_fp8
from attention.triton_cache import check_kv_finish, kv_finish_row
from common.pdl import pdl_launch, pdl_prologue
from common.triton_launch import fast_launch


@triton.jit
def absorb_q_tile(h, lb, t0, qn_ptr, qp_ptr, w_ptr, q_ptr, cs_ptr, T, s_qn_t, s_qn_h, s_qp_t, s_qp_h, s_w_h,
                  s_w_p, s_cs_t, H: tl.constexpr, P: tl.constexpr, L: tl.constexpr, R: tl.constexpr,
                  BP: tl.constexpr, BL: tl.constexpr, BR: tl.constexpr, BT: tl.constexpr,
                  IEEE: tl.constexpr, ROPE: tl.constexpr):
    """Head h, latent columns lb*BL.., rows t0..t0+BT-1 of q = [q_nope @ W_UK ‖ rope(q_pe)] (the
    rope part by the lb == 0 tile)."""
    offs_t = t0 + tl.arange(0, BT)
    offs_p = tl.arange(0, BP)
    offs_l = lb * BL + tl.arange(0, BL)
    mt = offs_t < T
    x = tl.load(qn_ptr + offs_t[:, None] * s_qn_t + h * s_qn_h + offs_p[None, :],
                mask=mt[:, None] & (offs_p[None, :] < P), other=0.0)  # [BT, BP]
    w = tl.load(w_ptr + h * s_w_h + offs_p[:, None] * s_w_p + offs_l[None, :],
                mask=(offs_p[:, None] < P) & (offs_l[None, :] < L), other=0.0)  # [BP, BL]
    if IEEE:
        acc = tl.dot(x, w, input_precision="ieee")
    else:
        acc = tl.dot(x, w)
    row = offs_t[:, None] * (H * (L + R)) + h * (L + R)
    tl.store(q_ptr + row + offs_l[None, :], acc.to(q_ptr.dtype.element_ty), mask=mt[:, None] & (offs_l[None, :] < L))
    if lb == 0:  # the rope part goes behind the latent part
        if ROPE:  # rotated on interleaved pairs as common.fused.rope (cos | sin rows, fp32)
            offs_i = tl.arange(0, BR // 2)
            mr = mt[:, None] & (offs_i[None, :] < R // 2)
            src = qp_ptr + offs_t[:, None] * s_qp_t + h * s_qp_h + 2 * offs_i[None, :]
            x1 = tl.load(src, mask=mr, other=0.0).to(tl.float32)
            x2 = tl.load(src + 1, mask=mr, other=0.0).to(tl.float32)
            cs = cs_ptr + offs_t[:, None] * s_cs_t + offs_i[None, :]
            cos = tl.load(cs, mask=mr, other=0.0)
            sin = tl.load(cs + R // 2, mask=mr, other=0.0)
            dt = q_ptr.dtype.element_ty
            dst = q_ptr + row + L + 2 * offs_i[None, :]
            tl.store(dst, (x1 * cos - x2 * sin).to(dt), mask=mr)
            tl.store(dst + 1, (x2 * cos + x1 * sin).to(dt), mask=mr)
        else:
            offs_r = tl.arange(0, BR)
            mr = mt[:, None] & (offs_r[None, :] < R)
            pe = tl.load(qp_ptr + offs_t[:, None] * s_qp_t + h * s_qp_h + offs_r[None, :], mask=mr, other=0.0)
            tl.store(q_ptr + row + L + offs_r[None, :], pe.to(q_ptr.dtype.element_ty), mask=mr)


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _absorb_q_kernel(qn_ptr, qp_ptr, w_ptr, q_ptr, cs_ptr, T, s_qn_t, s_qn_h, s_qp_t, s_qp_h, s_w_h, s_w_p, s_cs_t,
                     H: tl.constexpr, P: tl.constexpr, L: tl.constexpr, R: tl.constexpr,
                     BP: tl.constexpr, BL: tl.constexpr, BR: tl.constexpr, BT: tl.constexpr,
                     IEEE: tl.constexpr, ROPE: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    absorb_q_tile(tl.program_id(0), tl.program_id(1), tl.program_id(2) * BT, qn_ptr, qp_ptr, w_ptr, q_ptr, cs_ptr,
                  T, s_qn_t, s_qn_h, s_qp_t, s_qp_h, s_w_h, s_w_p, s_cs_t, H, P, L, R, BP, BL, BR, BT, IEEE, ROPE)


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _absorb_q_kv_finish_kernel(qn_ptr, qp_ptr, w_ptr, q_ptr, cs_ptr, T, s_qn_t, s_qn_h, s_qp_t, s_qp_h, s_w_h,
                               s_w_p, s_cs_t, kv_ptr, nw_ptr, cache_ptr, slot_ptr, eps, inv_scale, s_kv_t,
                               s_cb, s_cs, N_ABS, NL,
                               H: tl.constexpr, P: tl.constexpr, L: tl.constexpr, R: tl.constexpr,
                               BP: tl.constexpr, BL: tl.constexpr, BR: tl.constexpr, BT: tl.constexpr,
                               IEEE: tl.constexpr, PAGE: tl.constexpr, LKV: tl.constexpr, RK: tl.constexpr,
                               BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr, IS_FP8: tl.constexpr,
                               PDL: tl.constexpr):
    """absorb_q (q_pe rotated) and kv_finish's cache rows as one launch: programs 0..N_ABS-1 are
    absorb_q's (head, latent tile, row tile) programs, the T after them kv_finish's token rows.
    The two halves read and write disjoint memory."""
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    if pid < N_ABS:
        h = pid % H
        rest = pid // H
        absorb_q_tile(h, rest % NL, (rest // NL) * BT, qn_ptr, qp_ptr, w_ptr, q_ptr, cs_ptr, T, s_qn_t, s_qn_h,
                      s_qp_t, s_qp_h, s_w_h, s_w_p, s_cs_t, H, P, L, R, BP, BL, BR, BT, IEEE, True)
    else:
        kv_finish_row((pid - N_ABS).to(tl.int64), kv_ptr, nw_ptr, cs_ptr, kv_ptr, cache_ptr, slot_ptr, eps,
                      inv_scale, s_kv_t, s_cs_t, s_cb, s_cs, PAGE, LKV, RK, BLOCK_L, BLOCK_H, IS_FP8, False)


@triton.jit
def _o_tile(BT: tl.constexpr, BV: tl.constexpr, T, V):
    """absorb_o's program (head, value-column tile, row tile): h, the rows and columns, their masks."""
    h = tl.program_id(0)
    offs_t = tl.program_id(2) * BT + tl.arange(0, BT)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    return h, offs_t, offs_v, offs_t < T, offs_v < V


@triton.jit
def _wuv_product(acc, x, w_ptr, h, offs_v, mv, offs_l, ml, s_w_h, s_w_v, IEEE: tl.constexpr):
    """acc + x [BT, BL] @ W_UV[h]^T's [BL, BV] tile at latent columns offs_l, value columns offs_v."""
    w = tl.load(w_ptr + h * s_w_h + offs_v[None, :] * s_w_v + offs_l[:, None],
                mask=mv[None, :] & ml[:, None], other=0.0)
    if IEEE:
        return tl.dot(x, w, acc, input_precision="ieee")
    return tl.dot(x, w, acc)


@triton.jit
def _store_o(out_ptr, acc, h, offs_t, offs_v, mt, mv, H: tl.constexpr, V: tl.constexpr):
    """acc [BT, BV] into the contiguous o [T, H, V]."""
    tl.store(out_ptr + offs_t[:, None] * (H * V) + h * V + offs_v[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mt[:, None] & mv[None, :])


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _absorb_o_kernel(o_ptr, w_ptr, out_ptr, T, s_o_t, s_o_h, s_w_h, s_w_v,
                     H: tl.constexpr, L: tl.constexpr, V: tl.constexpr,
                     BL: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, IEEE: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_prologue(PDL)
    h, offs_t, offs_v, mt, mv = _o_tile(BT, BV, T, V)
    acc = tl.zeros([BT, BV], dtype=tl.float32)
    for l0 in range(0, L, BL):
        offs_l = l0 + tl.arange(0, BL)
        ml = offs_l < L
        x = tl.load(o_ptr + offs_t[:, None] * s_o_t + h * s_o_h + offs_l[None, :],
                    mask=mt[:, None] & ml[None, :], other=0.0)  # [BT, BL]
        acc = _wuv_product(acc, x, w_ptr, h, offs_v, mv, offs_l, ml, s_w_h, s_w_v, IEEE)
    _store_o(out_ptr, acc, h, offs_t, offs_v, mt, mv, H, V)


@triton.jit
def _split_lse(plse_ptr, rows, mt, s0, S, h, s_lt, s_ls, s_lh, BS: tl.constexpr):
    """lse of splits s0..s0+BS-1 for `rows` [BT]: [BT, BS], -inf past S and past T."""
    offs_s = s0 + tl.arange(0, BS)
    return tl.load(plse_ptr + rows[:, None] * s_lt + offs_s[None, :] * s_ls + h * s_lh,
                   mask=mt[:, None] & (offs_s[None, :] < S), other=float("-inf"))


@fast_launch
@triton.jit(do_not_specialize=["T", "S"])
def _absorb_o_merge_kernel(po_ptr, plse_ptr, w_ptr, out_ptr, T, S, s_pt, s_ps, s_ph, s_lt, s_ls, s_lh, s_w_h, s_w_v,
                           H: tl.constexpr, L: tl.constexpr, V: tl.constexpr, BS: tl.constexpr,
                           CHUNKS: tl.constexpr, BL: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                           IEEE: tl.constexpr, PDL: tl.constexpr):
    """Program (head h, value columns vb, rows t0..): the split merge of triton_decode's
    `_mla_decode_reduce_kernel` for rows [BT] of head h, then their product with W_UV[h]^T as
    `_absorb_o_kernel`. The splits' lse give each row's max and weight sum (with CHUNKS, passes
    over them BS at a time; else one [BT, BS] load); each [BT, BL] chunk of the merged latent
    output is then summed from [BT, BS, BL] partials, divided by the row's weight sum, rounded to
    the weights' dtype (as the merge stores it) and multiplied into the accumulator."""
    pdl_prologue(PDL)
    h, offs_t, offs_v, mt, mv = _o_tile(BT, BV, T, V)
    rows = offs_t.to(tl.int64)
    # With CHUNKS (more splits than one [BT, BS] chunk) the loops over the chunks carry [BT, BS]
    # (max, weight sum) and [BT, BS, BL] (partials) accumulators and reduce over BS after the
    # loop: Triton 3.6 cannot compile a reduction carried by an inner loop (its thread-locality
    # pass asserts).
    if CHUNKS:
        m2 = tl.full([BT, BS], float("-inf"), tl.float32)
        for s0 in range(0, S, BS):
            m2 = tl.maximum(m2, _split_lse(plse_ptr, rows, mt, s0, S, h, s_lt, s_ls, s_lh, BS))
        m = tl.max(m2, 1)
    else:
        lse = _split_lse(plse_ptr, rows, mt, 0, S, h, s_lt, s_ls, s_lh, BS)
        m = tl.max(lse, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    if CHUNKS:
        total2 = tl.zeros([BT, BS], tl.float32)
        for s0 in range(0, S, BS):
            lse = _split_lse(plse_ptr, rows, mt, s0, S, h, s_lt, s_ls, s_lh, BS)
            total2 += tl.exp(lse - m_safe[:, None])
        total = tl.sum(total2, 1)
    else:
        wgt = tl.exp(lse - m_safe[:, None])  # 0 for empty splits (lse -inf), past S and past T
        total = tl.sum(wgt, 1)
    total = tl.where(total > 0.0, total, 1.0)  # every split empty: the row's output is 0
    acc = tl.zeros([BT, BV], dtype=tl.float32)
    offs_s = tl.arange(0, BS)
    for l0 in range(0, L, BL):
        offs_l = l0 + tl.arange(0, BL)
        ml = offs_l < L
        # empty splits' rows were never written: masked, so they cannot reach the sum
        if CHUNKS:
            xs3 = tl.zeros([BT, BS, BL], dtype=tl.float32)
            for s0 in range(0, S, BS):
                lse = _split_lse(plse_ptr, rows, mt, s0, S, h, s_lt, s_ls, s_lh, BS)
                p = tl.load(po_ptr + rows[:, None, None] * s_pt + (s0 + offs_s)[None, :, None] * s_ps
                            + h * s_ph + offs_l[None, None, :],
                            mask=(lse > float("-inf"))[:, :, None] & ml[None, None, :], other=0.0)
                xs3 += tl.exp(lse - m_safe[:, None])[:, :, None] * p
            xs = tl.sum(xs3, 1)
        else:
            p = tl.load(po_ptr + rows[:, None, None] * s_pt + offs_s[None, :, None] * s_ps + h * s_ph
                        + offs_l[None, None, :], mask=(lse > float("-inf"))[:, :, None] & ml[None, None, :],
                        other=0.0)
            xs = tl.sum(wgt[:, :, None] * p, 1)
        x = (xs / total[:, None]).to(w_ptr.dtype.element_ty)  # [BT, BL] of the merged o_lat rows
        acc = _wuv_product(acc, x, w_ptr, h, offs_v, mv, offs_l, ml, s_w_h, s_w_v, IEEE)
    _store_o(out_ptr, acc, h, offs_t, offs_v, mt, mv, H, V)


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _rope_kernel(x_ptr, cs_ptr, out_ptr, T, H, s_x_t, s_x_h, s_cs_t,
                 R: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, BR: tl.constexpr):
    """out[t, h] = x[t, h] rotated on interleaved pairs by token t's [cos | sin] row (fp32), for a
    tile of BT tokens x BH heads: whole rows are loaded and stored (the pairs are split in
    registers), so the accesses are contiguous."""
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    offs_h = tl.program_id(1) * BH + tl.arange(0, BH)
    offs_r = tl.arange(0, BR)
    offs_i = tl.arange(0, BR // 2)
    t3, h3, r3 = offs_t[:, None, None].to(tl.int64), offs_h[None, :, None], offs_r[None, None, :]
    m = (t3 < T) & (h3 < H) & (r3 < R)
    x = tl.load(x_ptr + t3 * s_x_t + h3 * s_x_h + r3, mask=m, other=0.0).to(tl.float32)
    x1, x2 = tl.split(tl.reshape(x, [BT, BH, BR // 2, 2]))  # even and odd elements of each pair
    mc = (offs_t[:, None] < T) & (offs_i[None, :] < R // 2)
    cs = cs_ptr + offs_t[:, None].to(tl.int64) * s_cs_t + offs_i[None, :]
    cos = tl.load(cs, mask=mc, other=0.0)[:, None, :]
    sin = tl.load(cs + R // 2, mask=mc, other=0.0)[:, None, :]
    y = tl.reshape(tl.join(x1 * cos - x2 * sin, x2 * cos + x1 * sin), [BT, BH, BR])
    tl.store(out_ptr + t3 * (H * R) + h3 * R + r3, y.to(out_ptr.dtype.element_ty), mask=m)


def rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """`common.fused.apply_rope(cos_sin, x)` for x `[T, H, R]` (last dim contiguous), contiguous out:
    the prefill's query RoPE in one pass."""
    T, H, R = x.shape
    if cos_sin.shape != (T, R) or cos_sin.stride(-1) != 1 or x.stride(-1) != 1 or R % 2:
        raise ValueError(f"rope: x {tuple(x.shape)}, cos_sin {tuple(cos_sin.shape)} (cos_sin [T, R], R even, "
                         "last dims contiguous)")
    out = torch.empty(T, H, R, dtype=x.dtype, device=x.device)
    if T and H:
        BH = min(16, triton.next_power_of_2(H))
        BR = max(2, triton.next_power_of_2(R))
        BT = max(1, min(16, 4096 // (BH * BR)))
        _rope_kernel[(triton.cdiv(T, BT), triton.cdiv(H, BH))](
            x, cos_sin, out, T, H, x.stride(0), x.stride(1), cos_sin.stride(0), R=R, BT=BT, BH=BH, BR=BR,
            num_warps=4)
    return out


def _bt(T: int) -> int:
    return 16 if T <= 16 else 64


def _absorb_q_tiles(T: int) -> dict:
    """absorb_q's tiles for T rows. Each program does one [BT, P] x [P, BL] product, so the
    program count, not the bytes, sets its time: 16-row tiles at every T, and narrow latent tiles
    while T is small. H200, 16 heads, P 128, L 512, µs in a CUDA graph (`scripts/bench_absorb.py`;
    against the former BL 128, BT 16 / 64, 4 warps): T 1 3.50 -> 3.24, T 8 4.29 -> 3.83, T 32
    8.36 -> 5.00 (BL 32, 2 warps), T 128 12.68 -> 9.05, T 256 21.19 -> 13.73 (BL 128, 4 warps)."""
    return dict(BL=32, BT=16, num_warps=2) if T <= 32 else dict(BL=128, BT=16, num_warps=4)


def absorb_q(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor,
             cos_sin: torch.Tensor | None = None, tiles: dict | None = None) -> torch.Tensor:
    """q_nope [T, H, P], q_pe [T, H, R], w_uk [H, P, L] (last dims contiguous) -> q [T, H, L+R].
    With `cos_sin` (`[T, R]` [cos | sin] rows, `YarnRotaryEmbedding.at`; the math in fp32) q_pe
    is rotated on the way (one launch fewer than a separate RoPE); without, it is copied as is."""
    T, H, P = q_nope.shape
    R, L = q_pe.shape[-1], w_uk.shape[-1]
    if (q_pe.shape[:2] != (T, H) or w_uk.shape[:2] != (H, P) or not q_nope.dtype == q_pe.dtype == w_uk.dtype
            or q_nope.stride(-1) != 1 or q_pe.stride(-1) != 1 or w_uk.stride(-1) != 1
            or (cos_sin is not None and (cos_sin.shape != (T, R) or cos_sin.stride(-1) != 1 or R % 2))):
        raise ValueError(f"absorb_q: q_nope {tuple(q_nope.shape)}, q_pe {tuple(q_pe.shape)}, w_uk {tuple(w_uk.shape)}, "
                         f"cos_sin {None if cos_sin is None else (tuple(cos_sin.shape), cos_sin.dtype)} "
                         "(one dtype, last dims contiguous, cos_sin [T, R] with R even)")
    q = torch.empty(T, H, L + R, dtype=q_nope.dtype, device=q_nope.device)
    if T == 0:
        return q
    t = _absorb_q_tiles(T) | (tiles or {})
    t["BL"] = max(16, min(t["BL"], triton.next_power_of_2(L)))  # a latent narrower than the tile (tiny models)
    _absorb_q_kernel[(H, triton.cdiv(L, t["BL"]), triton.cdiv(T, t["BT"]))](
        q_nope, q_pe, w_uk, q, q if cos_sin is None else cos_sin, T, q_nope.stride(0), q_nope.stride(1),
        q_pe.stride(0), q_pe.stride(1), w_uk.stride(0), w_uk.stride(1), 0 if cos_sin is None else cos_sin.stride(0),
        H=H, P=P, L=L, R=R, BP=max(16, triton.next_power_of_2(P)), BR=max(2, triton.next_power_of_2(R)),
        IEEE=q_nope.dtype == torch.float32, ROPE=cos_sin is not None, **t, **pdl_launch())
    return q


def absorb_q_kv_finish(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor, cos_sin: torch.Tensor,
                       kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, kv_scale: float = 1.0, tiles: dict | None = None) -> torch.Tensor:
    """`absorb_q(q_nope, q_pe, w_uk, cos_sin)` and `triton_cache.kv_finish(kv, norm_weight, eps,
    cos_sin, kv_cache, slot_mapping, kv_scale)`'s cache writes as one launch, for a pure decode
    step (whose attention reads the new rows from the cache, not from kv_finish's returned rows):
    returns q `[T, H, L+R]`; the cache rows are written as kv_finish writes them."""
    T, H, P = q_nope.shape
    R, L = q_pe.shape[-1], w_uk.shape[-1]
    if (q_pe.shape[:2] != (T, H) or w_uk.shape[:2] != (H, P) or not q_nope.dtype == q_pe.dtype == w_uk.dtype
            or q_nope.stride(-1) != 1 or q_pe.stride(-1) != 1 or w_uk.stride(-1) != 1
            or cos_sin.shape != (T, R) or cos_sin.stride(-1) != 1 or R % 2 or kv.shape[0] != T):
        raise ValueError(f"absorb_q_kv_finish: q_nope {tuple(q_nope.shape)}, q_pe {tuple(q_pe.shape)}, "
                         f"w_uk {tuple(w_uk.shape)}, cos_sin {tuple(cos_sin.shape)}, kv {tuple(kv.shape)} "
                         "(one dtype, last dims contiguous, cos_sin [T, R] with R even, kv [T, ...])")
    check_kv_finish(kv, norm_weight, cos_sin, kv_cache, slot_mapping)  # k_pe as wide as q_pe: one cos_sin
    q = torch.empty(T, H, L + R, dtype=q_nope.dtype, device=q_nope.device)
    if T == 0:
        return q
    t = _absorb_q_tiles(T) | (tiles or {})
    t["BL"] = max(16, min(t["BL"], triton.next_power_of_2(L)))
    nl = triton.cdiv(L, t["BL"])
    n_abs = H * nl * triton.cdiv(T, t["BT"])
    lkv = norm_weight.shape[0]
    rk = kv.shape[1] - lkv
    _absorb_q_kv_finish_kernel[(n_abs + T,)](
        q_nope, q_pe, w_uk, q, cos_sin, T, q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        w_uk.stride(0), w_uk.stride(1), cos_sin.stride(0), kv, norm_weight, kv_cache, slot_mapping.contiguous(),
        float(eps), 1.0 / kv_scale, kv.stride(0), kv_cache.stride(0), kv_cache.stride(1), n_abs, nl,
        H=H, P=P, L=L, R=R, BP=max(16, triton.next_power_of_2(P)), BR=max(2, triton.next_power_of_2(R)),
        IEEE=q_nope.dtype == torch.float32, PAGE=kv_cache.shape[1], LKV=lkv, RK=rk,
        BLOCK_L=triton.next_power_of_2(lkv), BLOCK_H=triton.next_power_of_2(rk // 2), IS_FP8=is_fp8(kv_cache),
        **t, **pdl_launch())
    return q


def _o_out(name: str, out: torch.Tensor | None, shape: tuple, dtype: torch.dtype,
           device: torch.device) -> torch.Tensor:
    """absorb_o's output: `out` checked (a contiguous `shape` of `dtype`), or a new tensor."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if out.shape != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"{name}: out must be a contiguous {shape} {dtype}, got "
                         f"{tuple(out.shape)} {out.dtype} with strides {out.stride()}")
    return out


def absorb_o(o_lat: torch.Tensor, w_uv: torch.Tensor, out: torch.Tensor | None = None,
             tiles: dict | None = None) -> torch.Tensor:
    """o_lat [T, H, L], w_uv [H, V, L] (last dims contiguous) -> o [T, H, V], contiguous: `out`
    when given (a contiguous [T, H, V] of o_lat's dtype, e.g. the decode rows of a mixed step's
    joint output), else a new tensor."""
    T, H, L = o_lat.shape
    V = w_uv.shape[1]
    if (w_uv.shape[0] != H or w_uv.shape[2] != L or o_lat.dtype != w_uv.dtype
            or o_lat.stride(-1) != 1 or w_uv.stride(-1) != 1):
        raise ValueError(f"absorb_o: o_lat {tuple(o_lat.shape)} {o_lat.dtype}, w_uv {tuple(w_uv.shape)} {w_uv.dtype} "
                         "(one dtype, last dims contiguous)")
    out = _o_out("absorb_o", out, (T, H, V), o_lat.dtype, o_lat.device)
    if T == 0:
        return out
    t = dict(BL=max(16, min(128, triton.next_power_of_2(L))), BV=max(16, min(32, triton.next_power_of_2(V))),
             BT=_bt(T), num_warps=4, num_stages=3) | (tiles or {})
    _absorb_o_kernel[(H, triton.cdiv(V, t["BV"]), triton.cdiv(T, t["BT"]))](
        o_lat, w_uv, out, T, o_lat.stride(0), o_lat.stride(1), w_uv.stride(0), w_uv.stride(1), H=H, L=L, V=V,
        IEEE=o_lat.dtype == torch.float32, **t, **pdl_launch())
    return out


def absorb_o_merge(po: torch.Tensor, plse: torch.Tensor, w_uv: torch.Tensor, out: torch.Tensor | None = None,
                   tiles: dict | None = None) -> torch.Tensor:
    """The split-KV decode's merge and absorb_o in one launch (the plan's decode_merge_in_absorb):
    po [T, S, H, L] fp32 partial outputs and plse [T, S, H] their lse (triton_decode
    `split_outputs`, last dims contiguous), w_uv [H, V, L] -> o [T, H, V] in w_uv's dtype, as
    `absorb_o(reduce_splits(...))` computes it: each row's merged latent output is rounded to that
    dtype before its product. The merged lse is not formed: callers without DCP drop it.
    `out` as absorb_o's."""
    T, S, H, L = po.shape
    V = w_uv.shape[1]
    if (po.dtype != torch.float32 or plse.shape != (T, S, H) or plse.dtype != torch.float32
            or w_uv.shape[0] != H or w_uv.shape[2] != L or po.stride(-1) != 1 or w_uv.stride(-1) != 1):
        raise ValueError(f"absorb_o_merge: po {tuple(po.shape)} {po.dtype}, plse {tuple(plse.shape)} {plse.dtype}, "
                         f"w_uv {tuple(w_uv.shape)} {w_uv.dtype} (fp32 partials [T, S, H, L] and lse [T, S, H], "
                         "w_uv [H, V, L], last dims contiguous)")
    out = _o_out("absorb_o_merge", out, (T, H, V), w_uv.dtype, po.device)
    if T == 0:
        return out
    BT = _bt(T)
    BS = min(triton.next_power_of_2(S), 16 if BT == 16 else 8)  # splits a chunk
    # the [BT, BS, BL] partials chunk: 8192 values (64 a thread of 4 warps), 4096 where several
    # chunks of splits are summed in a second tile of that shape; BL at least 16
    t = dict(BL=max(16, min(128, triton.next_power_of_2(L), (4096 if S > BS else 8192) // (BT * BS))),
             BV=max(16, min(32, triton.next_power_of_2(V))), BT=BT, num_warps=4, num_stages=2) | (tiles or {})
    _absorb_o_merge_kernel[(H, triton.cdiv(V, t["BV"]), triton.cdiv(T, t["BT"]))](
        po, plse, w_uv, out, T, S, po.stride(0), po.stride(1), po.stride(2), plse.stride(0), plse.stride(1),
        plse.stride(2), w_uv.stride(0), w_uv.stride(1), H=H, L=L, V=V, BS=BS, CHUNKS=S > BS,
        IEEE=w_uv.dtype == torch.float32, **t, **pdl_launch())
    return out
