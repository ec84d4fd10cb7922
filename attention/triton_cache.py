"""Paged latent-cache movement in Triton: write new rows by slot mapping, gather context rows.

Cache `[NB, BS, Lkv+R]`; a flat slot is `block * BS + offset`. Both kernels move BLOCK_T rows per
program in BLOCK_D-wide column chunks (576 = 9 x 64: no masked lanes at the real width).
An FP8 cache (attention/kv_quant.py) is written as e4m3 of `x / kv_scale` and read as
`q * kv_scale` in the compute dtype, with the same arithmetic as the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention.kv_quant import is_fp8
from common.pdl import pdl_launch, pdl_prologue
from common.triton_launch import fast_launch

BLOCK_T = 16
# Sequences one gather program compares its rows against per loop step. Fixed, as are the block
# table's row stride and the counts (do_not_specialize), so that one compiled variant serves every
# step: a variant first met while serving compiles for ~0.25 s with every request waiting.
GATHER_BLOCK_B = 32
SPARE_ROWS = 127  # rows past the end of kv_finish's and gather_context's outputs (see kv_finish)


@triton.jit
def fp8_store_value(x, inv_scale):
    """fp32 `x * inv_scale` saturated to ±448 and rounded to nearest even on e4m3's grid, as fp8.

    The rounding is done here, in fp32 bit arithmetic, so the final cast is exact: the stored byte
    is the one torch's cast gives on every target (the interpreter's own cast rounds values that
    round up to a power of two down to half of it)."""
    x = tl.minimum(tl.maximum(x * inv_scale, -448.0), 448.0)
    bits = x.to(tl.int32, bitcast=True)
    # normal range (|x| >= 2^-6): keep 3 of fp32's 23 mantissa bits, ties to even; a carry moves
    # into the exponent by itself
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    # subnormal range: multiples of 2^-9, rounded by the fp32 add of 1.5 * 2^23 (ties to even),
    # on |x|, with x's sign bit put back by integer or, so that a value rounding to 0 keeps its
    # sign (-0 as in torch; a float negation of +0 was seen to lose it on the GPU)
    a = tl.abs(x)
    sub = ((a * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
    sub = (sub.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return tl.where(a < 0.015625, sub, normal).to(tl.float8e4nv)


@triton.jit
def cache_store_value(x, cache_dtype: tl.constexpr, inv_scale, IS_FP8: tl.constexpr):
    """`x` as the cache stores it (kv_quant.store_as)."""
    if IS_FP8:
        return fp8_store_value(x.to(tl.float32), inv_scale)
    return x.to(cache_dtype)


def _col_block(d: int) -> int:
    """Column chunk: the largest power of two <= 128 that divides d, or 128 with a masked tail."""
    for c in (128, 64, 32, 16):
        if d % c == 0:
            return c
    return min(128, triton.next_power_of_2(d))


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _write_kv_kernel(kv_ptr, cache_ptr, slot_ptr, T, inv_scale,
                     stride_kvt, stride_cb, stride_cs,
                     PAGE: tl.constexpr, D: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, IS_FP8: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + rows, mask=rows < T, other=-1).to(tl.int64)
    keep = slot >= 0  # -1: padding, or a token another DCP rank stores
    safe = tl.where(keep, slot, 0)
    dst = cache_ptr + (safe // PAGE) * stride_cb + (safe % PAGE) * stride_cs  # [BLOCK_T]
    src = kv_ptr + rows.to(tl.int64) * stride_kvt
    for d0 in tl.static_range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        m = keep[:, None] & (cols[None, :] < D)
        x = tl.load(src[:, None] + cols[None, :], mask=m)
        tl.store(dst[:, None] + cols[None, :], cache_store_value(x, cache_ptr.dtype.element_ty, inv_scale, IS_FP8),
                 mask=m)


@fast_launch
@triton.jit(do_not_specialize=["num_tokens", "B", "stride_btb"])
def _gather_kernel(cache_ptr, out_ptr, block_table_ptr, starts_ptr, cu_ptr, num_tokens, B, kv_scale,
                   stride_cb, stride_cs, stride_btb, stride_ot,
                   PAGE: tl.constexpr, D: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr, IS_FP8: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    # Sequence of each output row = number of sequences ending at or before it (cu_lens[b+1] <= row);
    # empty sequences end where they start and are skipped by the count.
    seq = tl.zeros([BLOCK_T], tl.int32)
    for b0 in range(0, B, BLOCK_B):
        offs_b = b0 + tl.arange(0, BLOCK_B)
        ends = tl.load(cu_ptr + 1 + offs_b, mask=offs_b < B, other=2147483647)
        seq += tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), 1)
    valid = (rows < num_tokens) & (seq < B)  # rows past cu_lens[B] are left unwritten
    seq = tl.where(valid, seq, 0)
    pos = tl.load(starts_ptr + seq, mask=valid, other=0) + rows - tl.load(cu_ptr + seq, mask=valid, other=0)
    blk = tl.load(block_table_ptr + seq.to(tl.int64) * stride_btb + pos // PAGE, mask=valid, other=0)
    src = cache_ptr + blk.to(tl.int64) * stride_cb + (pos % PAGE).to(tl.int64) * stride_cs
    dst = out_ptr + rows.to(tl.int64) * stride_ot
    for d0 in tl.static_range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        m = valid[:, None] & (cols[None, :] < D)
        x = tl.load(src[:, None] + cols[None, :], mask=m)
        if IS_FP8:  # dequantised in fp32, as kv_quant.load_as
            x = x.to(tl.float32) * kv_scale
        tl.store(dst[:, None] + cols[None, :], x.to(out_ptr.dtype.element_ty), mask=m)


def write_kv(kv_cache: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scale: float = 1.0) -> None:
    """Store kv [T, D] rows into kv_cache [NB, BS, D] at flat slots; slot -1 is skipped."""
    T, D = kv.shape
    if T == 0:
        return
    _write_kv_kernel[(triton.cdiv(T, BLOCK_T),)](
        kv, kv_cache, slot_mapping, T, 1.0 / kv_scale,
        kv.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        PAGE=kv_cache.shape[1], D=D, BLOCK_T=BLOCK_T, BLOCK_D=_col_block(D), IS_FP8=is_fp8(kv_cache),
        num_warps=4)


def gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor, starts: torch.Tensor,
                   cu_lens: torch.Tensor, num_tokens: int, dtype: torch.dtype | None = None,
                   kv_scale: float = 1.0) -> torch.Tensor:
    """Rows starts[b] .. starts[b]+len_b-1 of sequence b -> out[cu_lens[b]:cu_lens[b+1]]; [num_tokens, D]
    in `dtype` (default the cache's; an FP8 cache is dequantised)."""
    D = kv_cache.shape[-1]
    out = kv_cache.new_empty(num_tokens + SPARE_ROWS, D, dtype=dtype or kv_cache.dtype)[:num_tokens]  # as kv_finish
    B = starts.shape[0]
    if num_tokens == 0 or B == 0:
        return out
    _gather_kernel[(triton.cdiv(num_tokens, BLOCK_T),)](
        kv_cache, out, block_table, starts, cu_lens, num_tokens, B, float(kv_scale),
        kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0), out.stride(0),
        PAGE=kv_cache.shape[1], D=D, BLOCK_T=BLOCK_T, BLOCK_D=_col_block(D),
        BLOCK_B=GATHER_BLOCK_B, IS_FP8=is_fp8(kv_cache), num_warps=4)
    return out


@triton.jit
def kv_finish_row(t, kv_ptr, w_ptr, cs_ptr, out_ptr, cache_ptr, slot_ptr, eps, inv_scale,
                  stride_kvt, stride_cst, stride_cb, stride_cs,
                  PAGE: tl.constexpr, L: tl.constexpr, R: tl.constexpr,
                  BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr, IS_FP8: tl.constexpr, HAS_OUT: tl.constexpr):
    """Token t's cache row: [rms_norm(c) ‖ rope(k_pe)] stored at its slot (-1: none) and, with
    HAS_OUT, to row t of out_ptr `[T, L+R]` (in kv's dtype)."""
    src = kv_ptr + t * stride_kvt
    dt = kv_ptr.dtype.element_ty
    # RMSNorm of the latent part, as common.fused.rms_norm: w * (x * rsqrt(mean(x^2) + eps)) in x's dtype
    offs_l = tl.arange(0, BLOCK_L)
    ml = offs_l < L
    c = tl.load(src + offs_l, mask=ml, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(c * c, axis=0) / L + eps)
    cn = (c * r).to(dt) * tl.load(w_ptr + offs_l, mask=ml, other=0.0).to(dt)
    # RoPE of the rope part on interleaved pairs, as common.fused.rope (cos | sin rows, fp32)
    offs_h = tl.arange(0, BLOCK_H)
    mh = offs_h < R // 2
    x1 = tl.load(src + L + 2 * offs_h, mask=mh, other=0.0).to(tl.float32)
    x2 = tl.load(src + L + 2 * offs_h + 1, mask=mh, other=0.0).to(tl.float32)
    cos = tl.load(cs_ptr + t * stride_cst + offs_h, mask=mh, other=0.0)
    sin = tl.load(cs_ptr + t * stride_cst + R // 2 + offs_h, mask=mh, other=0.0)
    o1 = (x1 * cos - x2 * sin).to(dt)
    o2 = (x2 * cos + x1 * sin).to(dt)
    if HAS_OUT:
        dst = out_ptr + t * (L + R)
        tl.store(dst + offs_l, cn, mask=ml)
        tl.store(dst + L + 2 * offs_h, o1, mask=mh)
        tl.store(dst + L + 2 * offs_h + 1, o2, mask=mh)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # -1: padding, or a token another DCP rank stores
        row = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs
        ct = cache_ptr.dtype.element_ty
        tl.store(row + offs_l, cache_store_value(cn, ct, inv_scale, IS_FP8), mask=ml)
        tl.store(row + L + 2 * offs_h, cache_store_value(o1, ct, inv_scale, IS_FP8), mask=mh)
        tl.store(row + L + 2 * offs_h + 1, cache_store_value(o2, ct, inv_scale, IS_FP8), mask=mh)


@fast_launch
@triton.jit
def _kv_finish_kernel(kv_ptr, w_ptr, cs_ptr, out_ptr, cache_ptr, slot_ptr, eps, inv_scale,
                      stride_kvt, stride_cst, stride_cb, stride_cs,
                      PAGE: tl.constexpr, L: tl.constexpr, R: tl.constexpr,
                      BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr, IS_FP8: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    kv_finish_row(tl.program_id(0).to(tl.int64), kv_ptr, w_ptr, cs_ptr, out_ptr, cache_ptr, slot_ptr, eps,
                  inv_scale, stride_kvt, stride_cst, stride_cb, stride_cs, PAGE, L, R, BLOCK_L, BLOCK_H, IS_FP8,
                  True)


def check_kv_finish(kv: torch.Tensor, norm_weight: torch.Tensor, cos_sin: torch.Tensor,
                    kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """ValueError unless kv_finish's arguments fit each other (see kv_finish)."""
    T = kv.shape[0]
    L = norm_weight.shape[0]
    R = kv.shape[1] - L
    if (kv.stride(-1) != 1 or cos_sin.shape != (T, R) or cos_sin.stride(-1) != 1 or R % 2
            or kv_cache.dim() != 3 or kv_cache.shape[-1] != L + R or kv_cache.stride(-1) != 1
            or norm_weight.dim() != 1 or norm_weight.stride(0) != 1 or slot_mapping.shape != (T,)):
        raise ValueError(f"kv_finish: kv {tuple(kv.shape)}, norm weight {tuple(norm_weight.shape)}, "
                         f"cos_sin {tuple(cos_sin.shape)}, cache {tuple(kv_cache.shape)}, "
                         f"slots {tuple(slot_mapping.shape)}")


def kv_finish(kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos_sin: torch.Tensor,
              kv_cache: torch.Tensor, slot_mapping: torch.Tensor, kv_scale: float = 1.0) -> torch.Tensor:
    """The new tokens' cache rows in one kernel: kv `[T, L+R]` (kv_a_proj output, rows may be
    strided) -> `[rms_norm(c) ‖ rope(k_pe)]` `[T, L+R]`, returned in kv's dtype and stored at
    `slot_mapping` (-1 skipped; quantised with `kv_scale` into an FP8 cache). Replaces the norm,
    the rope, the cat and write_kv of the unfused path."""
    check_kv_finish(kv, norm_weight, cos_sin, kv_cache, slot_mapping)
    T = kv.shape[0]
    L = norm_weight.shape[0]
    R = kv.shape[1] - L
    # rows to spare after T: any run of rows in it can be read as a whole multiple of 128
    # (attention/mla.py `padded_rows`, the prefill's up-projection)
    out = torch.empty(T + SPARE_ROWS, L + R, dtype=kv.dtype, device=kv.device)[:T]
    if T:
        _kv_finish_kernel[(T,)](kv, norm_weight, cos_sin, out, kv_cache, slot_mapping.contiguous(), float(eps),
                                1.0 / kv_scale,
                                kv.stride(0), cos_sin.stride(0), kv_cache.stride(0), kv_cache.stride(1),
                                PAGE=kv_cache.shape[1], L=L, R=R, BLOCK_L=triton.next_power_of_2(L),
                                BLOCK_H=triton.next_power_of_2(R // 2), IS_FP8=is_fp8(kv_cache), num_warps=4,
                                **pdl_launch())
    return out
