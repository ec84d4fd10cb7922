"""Variable-length flash attention with LSE in Triton, QK width != V width (MLA prefill).

q `[Tq, H, P+R]`, k `[Tk, H, P+R]`, v `[Tk, H, V]`, sequences delimited by cu_seqlens_q/k.
The QK width is handled as two power-of-two parts (192 = 128 + 64), so nothing is padded to 256;
V is read at its own width (not padded in memory). Causal masks are bottom-right aligned: query i
of a sequence with Lq queries and Lk keys sees keys j <= i + Lk - Lq.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from attention.backend import check_prefill_out
from common.triton_launch import fast_launch

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3  # measured best on H200 (docs/kernel_notes.md)
    # causal: launch the query tiles with the most keys first (the last tiles of a sequence), so
    # that the short ones fill the tail of the grid instead of the long ones running alone
    # (H200, bench_mla_decode.py --sweep: 1-3% faster on 4 of 5 causal shapes, 1.5% slower at 1 x 8192)
    reverse_m: bool = True


def default_prefill_config(dtype: torch.dtype) -> PrefillConfig:
    """Tile shape per dtype: fp32 tiles are twice the bytes, so halve them."""
    if dtype == torch.float32:
        return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    return PrefillConfig()


def split_width(d: int) -> tuple[int, int]:
    """Width d as (largest power of two <= d, next power of two >= the rest, or 0): 192 -> (128, 64)."""
    da = 1 << (d.bit_length() - 1)
    rest = d - da
    return da, (triton.next_power_of_2(rest) if rest else 0)


@triton.jit
def _attend_range(acc, l_i, m_i, qa, qb, k_base, kb_base, v_base, stride_kt, stride_kbt, stride_vt,
                  lo, hi, offs_m, shift, lk, qk_scale_log2,
                  D_QK: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
                  DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """Online-softmax over key rows [lo, hi); MASKED applies the length and causal masks."""
    offs_da = tl.arange(0, DA)
    offs_dv = tl.arange(0, BLOCK_DV)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < lk
        k_cols = k_base + offs_n[None, :] * stride_kt
        ka = tl.load(k_cols + offs_da[:, None], mask=nmask[None, :], other=0.0)  # [DA, BLOCK_N]
        s = tl.dot(qa, ka, input_precision=PRECISION)                            # [BLOCK_M, BLOCK_N]
        if DB > 0:
            offs_db = tl.arange(0, DB)
            kb = tl.load(kb_base + offs_n[None, :] * stride_kbt + offs_db[:, None],
                         mask=nmask[None, :] & (offs_db[:, None] < D_QK - DA), other=0.0)  # [DB, BLOCK_N]
            s = tl.dot(qb, kb, acc=s, input_precision=PRECISION)
        s = s * qk_scale_log2
        if MASKED:
            keep = nmask[None, :]
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= offs_m[:, None] + shift)
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; subtract 0 instead to avoid inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_dv[None, :],
                    mask=nmask[:, None] & (offs_dv[None, :] < DV), other=0.0)   # [BLOCK_N, BLOCK_DV]
        acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@fast_launch
@triton.jit
def _prefill_kernel(
    q_ptr, qb_ptr, k_ptr, kb_ptr, v_ptr, o_ptr, lse_ptr, cu_q_ptr, cu_k_ptr,
    qk_scale_log2,
    stride_qt, stride_qh, stride_qbt, stride_qbh, stride_kt, stride_kh, stride_kbt, stride_kbh,
    stride_vt, stride_vh,
    stride_ot, stride_oh, stride_lt, stride_lh,
    D_QK: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr, REVERSE_M: tl.constexpr,
):
    mblk = tl.program_id(0)
    if REVERSE_M:
        mblk = tl.num_programs(0) - 1 - mblk
    b = tl.program_id(1)
    h = tl.program_id(2)
    q0 = tl.load(cu_q_ptr + b).to(tl.int32)
    lq = tl.load(cu_q_ptr + b + 1).to(tl.int32) - q0
    k0 = tl.load(cu_k_ptr + b).to(tl.int32)
    lk = tl.load(cu_k_ptr + b + 1).to(tl.int32) - k0
    if mblk * BLOCK_M < lq:
        offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = offs_m < lq
        rows = (q0 + offs_m).to(tl.int64)
        q_base = q_ptr + rows[:, None] * stride_qt + h * stride_qh
        qa = tl.load(q_base + tl.arange(0, DA)[None, :], mask=mmask[:, None], other=0.0)
        if DB > 0:
            offs_db = tl.arange(0, DB)
            qb = tl.load(qb_ptr + rows[:, None] * stride_qbt + h * stride_qbh + offs_db[None, :],
                         mask=mmask[:, None] & (offs_db[None, :] < D_QK - DA), other=0.0)
        else:
            qb = qa
        k_base = k_ptr + k0.to(tl.int64) * stride_kt + h * stride_kh
        kb_base = kb_ptr + k0.to(tl.int64) * stride_kbt + h * stride_kbh
        v_base = v_ptr + k0.to(tl.int64) * stride_vt + h * stride_vh
        shift = lk - lq
        if CAUSAL:
            # Keys below `full` are visible to every row of the tile; none at or past `hi` is.
            hi = tl.minimum(tl.maximum((mblk + 1) * BLOCK_M + shift, 0), lk)
            full = tl.minimum(tl.maximum(mblk * BLOCK_M + shift + 1, 0), lk) // BLOCK_N * BLOCK_N
        else:
            hi = lk
            full = lk // BLOCK_N * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        acc, l_i, m_i = _attend_range(acc, l_i, m_i, qa, qb, k_base, kb_base, v_base, stride_kt,
                                      stride_kbt, stride_vt, 0, full, offs_m, shift, lk, qk_scale_log2,
                                      D_QK, DA, DB, DV, BLOCK_DV, BLOCK_N, False, CAUSAL, PRECISION)
        acc, l_i, m_i = _attend_range(acc, l_i, m_i, qa, qb, k_base, kb_base, v_base, stride_kt,
                                      stride_kbt, stride_vt, full, hi, offs_m, shift, lk, qk_scale_log2,
                                      D_QK, DA, DB, DV, BLOCK_DV, BLOCK_N, True, CAUSAL, PRECISION)
        empty = l_i == 0.0  # no visible key: lse -inf, output 0
        lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        o = acc / tl.where(empty, 1.0, l_i)[:, None]
        offs_dv = tl.arange(0, BLOCK_DV)
        tl.store(o_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_dv[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=mmask[:, None] & (offs_dv[None, :] < DV))
        tl.store(lse_ptr + rows * stride_lt + h * stride_lh, lse, mask=mmask)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                      max_seqlen_q: int, scale: float, causal: bool,
                      cfg: PrefillConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen attention: (o [Tq, H, V] in q.dtype, lse [Tq, H] fp32); last dims must be contiguous."""
    da, _ = split_width(q.shape[-1])
    return prefill_attention_parts(q[..., :da], q[..., da:], k[..., :da], k[..., da:], v, cu_seqlens_q,
                                   cu_seqlens_k, max_seqlen_q, scale, causal, cfg)


def prefill_attention_parts(qa: torch.Tensor, qb: torch.Tensor, ka: torch.Tensor, kb: torch.Tensor,
                            v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                            max_seqlen_q: int, scale: float, causal: bool,
                            cfg: PrefillConfig | None = None,
                            out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same attention with q = [qa ‖ qb] and k = [ka ‖ kb] given as parts, each read through
    its own strides: qa, ka `[T, H, DA]` with DA a power of two, qb, kb `[T, H, <= DA]`. MLA
    passes q_nope / q_pe, and k_nope (a view of kv_b_proj's output) / k_pe expanded over the
    heads (head stride 0), so nothing is concatenated. With `out` (`[Tq, H, V]`, q's dtype, last dim
    contiguous, any row and head strides) o is written there."""
    Tq, H, da = qa.shape
    d_qk = da + qb.shape[-1]
    dv = v.shape[-1]
    B = cu_seqlens_q.shape[0] - 1
    cfg = cfg or default_prefill_config(qa.dtype)
    if out is None:
        o = torch.empty(Tq, H, dv, dtype=qa.dtype, device=qa.device)
    else:
        check_prefill_out(out, (Tq, H, dv), qa.dtype)
        o = out
    lse = torch.empty(Tq, H, dtype=torch.float32, device=qa.device)
    if Tq == 0 or B == 0 or H == 0 or max_seqlen_q == 0:
        return o, lse
    if split_width(d_qk) != (da, triton.next_power_of_2(qb.shape[-1]) if qb.shape[-1] else 0):
        raise ValueError(f"q/k parts of widths {da} + {qb.shape[-1]} are not split_width({d_qk})")
    _, db = split_width(d_qk)
    grid = (triton.cdiv(max_seqlen_q, cfg.block_m), B, H)
    _prefill_kernel[grid](
        qa, qb, ka, kb, v, o, lse, cu_seqlens_q, cu_seqlens_k,
        scale * LOG2E,
        qa.stride(0), qa.stride(1), qb.stride(0), qb.stride(1), ka.stride(0), ka.stride(1),
        kb.stride(0), kb.stride(1), v.stride(0), v.stride(1),
        o.stride(0), o.stride(1), lse.stride(0), lse.stride(1),
        D_QK=d_qk, DA=da, DB=db, DV=dv, BLOCK_DV=triton.next_power_of_2(dv),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        CAUSAL=causal, PRECISION="ieee" if qa.dtype == torch.float32 else "tf32",
        REVERSE_M=cfg.reverse_m and causal, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return o, lse


@fast_launch
@triton.jit
def _merge_kernel(o_ptr, lse_ptr, ob_ptr, lseb_ptr, H, s_o_t, s_o_h, s_ob_t, s_ob_h, s_l_t, s_lb_t,
                  DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Row t, heads h0..h0+BLOCK_H: (o, lse) <- the merge of (o, lse) and (ob, lseb)."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_DV)
    mh = offs_h < H
    la = tl.load(lse_ptr + t * s_l_t + offs_h, mask=mh, other=float("-inf"))
    lb = tl.load(lseb_ptr + t * s_lb_t + offs_h, mask=mh, other=float("-inf"))
    mx = tl.maximum(la, lb)
    empty = mx == float("-inf")  # no key on either side: weights 0, lse stays -inf
    mx = tl.where(empty, 0.0, mx)
    ea, eb = tl.exp(la - mx), tl.exp(lb - mx)
    tot = tl.where(empty, 1.0, ea + eb)
    wa = tl.where(empty, 0.0, ea / tot)
    wb = tl.where(empty, 0.0, eb / tot)
    m2 = mh[:, None] & (offs_d[None, :] < DV)
    pa = o_ptr + t * s_o_t + offs_h[:, None] * s_o_h + offs_d[None, :]
    pb = ob_ptr + t * s_ob_t + offs_h[:, None] * s_ob_h + offs_d[None, :]
    oa = tl.load(pa, mask=m2, other=0.0).to(tl.float32)
    ob = tl.load(pb, mask=m2, other=0.0).to(tl.float32)
    tl.store(pa, (oa * wa[:, None] + ob * wb[:, None]).to(o_ptr.dtype.element_ty), mask=m2)
    tl.store(lse_ptr + t * s_l_t + offs_h, tl.where(empty, float("-inf"), mx + tl.log(tot)), mask=mh)


def merge_attn_states_(o: torch.Tensor, lse: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """In place: (o, lse) becomes the merge of two partial attentions over disjoint key sets,
    o `[T, H, V]` (any float dtype, math in fp32), lse `[T, H]` fp32; rows where neither side saw
    a key keep lse -inf and get o = 0. One pass over both outputs (the torch version is ~10)."""
    T, H, V = o.shape
    if (o_b.shape != o.shape or lse.shape != (T, H) or lse_b.shape != (T, H) or o.stride(-1) != 1
            or o_b.stride(-1) != 1 or lse.stride(-1) != 1 or lse_b.stride(-1) != 1
            or lse.dtype != torch.float32 or lse_b.dtype != torch.float32):
        raise ValueError(f"merge_attn_states_: o {tuple(o.shape)}, lse {tuple(lse.shape)} {lse.dtype}, o_b "
                         f"{tuple(o_b.shape)}, lse_b {tuple(lse_b.shape)} {lse_b.dtype} (shapes must match, "
                         "lse fp32, last dims contiguous)")
    if T == 0 or H == 0:
        return
    bh = min(16, triton.next_power_of_2(H))
    _merge_kernel[(T, triton.cdiv(H, bh))](o, lse, o_b, lse_b, H, o.stride(0), o.stride(1), o_b.stride(0),
                                           o_b.stride(1), lse.stride(0), lse_b.stride(0), DV=V, BLOCK_H=bh,
                                           BLOCK_DV=triton.next_power_of_2(V), num_warps=4)
