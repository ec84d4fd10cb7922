"""Paged latent-cache movement in Triton: write new rows by slot mapping, gather context rows.

Cache `[NB, BS, Lkv+R]`; a flat slot is `block * BS + offset`. Both kernels move BLOCK_T rows per
program in BLOCK_D-wide column chunks (576 = 9 x 64: no masked lanes at the real width).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16


def _col_block(d: int) -> int:
    """Column chunk: the largest power of two <= 128 that divides d, or 128 with a masked tail."""
    for c in (128, 64, 32, 16):
        if d % c == 0:
            return c
    return min(128, triton.next_power_of_2(d))


@triton.jit
def _write_kv_kernel(kv_ptr, cache_ptr, slot_ptr, T,
                     stride_kvt, stride_cb, stride_cs,
                     PAGE: tl.constexpr, D: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
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
        tl.store(dst[:, None] + cols[None, :], x.to(cache_ptr.dtype.element_ty), mask=m)


@triton.jit
def _gather_kernel(cache_ptr, out_ptr, block_table_ptr, starts_ptr, cu_ptr, num_tokens, B,
                   stride_cb, stride_cs, stride_btb, stride_ot,
                   PAGE: tl.constexpr, D: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr):
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
        tl.store(dst[:, None] + cols[None, :], x, mask=m)


def write_kv(kv_cache: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store kv [T, D] rows into kv_cache [NB, BS, D] at flat slots; slot -1 is skipped."""
    T, D = kv.shape
    if T == 0:
        return
    _write_kv_kernel[(triton.cdiv(T, BLOCK_T),)](
        kv, kv_cache, slot_mapping, T,
        kv.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        PAGE=kv_cache.shape[1], D=D, BLOCK_T=BLOCK_T, BLOCK_D=_col_block(D), num_warps=4)


def gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor, starts: torch.Tensor,
                   cu_lens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Rows starts[b] .. starts[b]+len_b-1 of sequence b -> out[cu_lens[b]:cu_lens[b+1]]; [num_tokens, D]."""
    D = kv_cache.shape[-1]
    out = kv_cache.new_empty(num_tokens, D)
    B = starts.shape[0]
    if num_tokens == 0 or B == 0:
        return out
    _gather_kernel[(triton.cdiv(num_tokens, BLOCK_T),)](
        kv_cache, out, block_table, starts, cu_lens, num_tokens, B,
        kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0), out.stride(0),
        PAGE=kv_cache.shape[1], D=D, BLOCK_T=BLOCK_T, BLOCK_D=_col_block(D),
        BLOCK_B=min(128, triton.next_power_of_2(B)), num_warps=4)
    return out
