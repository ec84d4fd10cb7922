"""Paged split-KV MLA decode in Triton: q_len query tokens per sequence, one latent KV head.

Notation (DESIGN.md §4): q `[B*q_len, H, Lkv+R]` = `[q_lat ‖ q_pe]`, cache `[NB, BS, Lkv+R]` =
`[c ‖ k_pe]`. score = q_lat·c + q_pe·k_pe, o = softmax(score) @ c.
The products run in q's dtype: a cache of another dtype (FP8, attention/kv_quant.py, or bf16 under
fp32 compute) is converted on load; an FP8 cache's per-tensor scale folds out of both products,
into the softmax scale and into the output. With `DecodeConfig.qk_fp8` (FP8 cache, opt-in) QK^T
instead runs on e4m3 operands: each query row is rounded to e4m3 with its own scale
(kv_quant.e4m3_rows) and multiplied with the cache's bytes as they are; PV is unchanged.

Stage 1 (`_mla_decode_partial_kernel`): program (row tile, split, b) streams the split's cache rows
once for BLOCK_H query rows, a row being one (query token, head) pair of sequence b (all of them
share the latent head, so a row tile re-reads nothing), and keeps an online softmax. With query
positions (`q_pos`) each row sees only the keys up to its token's position: under DCP the local key
j of rank r is global position j*D + r, so a token at position p sees the first
`local_len(p + 1)` local keys, a per-row prefix of the scan. Stage 2 (`_mla_decode_reduce_kernel`) merges the splits by LSE. With one
split, stage 1 writes the final output directly and stage 2 is skipped.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from attention.decode_config import LAZY_TAU, WIDE_ROWS, DecodeConfig, choose_num_splits, default_decode_config
from attention.kv_quant import is_fp8
from attention.triton_cache import fp8_store_value
from common.launch_settings import interpreting
from common.pdl import pdl_launch, pdl_prologue
from common.triton_launch import fast_launch

__all__ = ["DecodeConfig", "WIDE_ROWS", "choose_num_splits", "default_decode_config", "mla_decode"]

LOG2E = 1.4426950408889634


@functools.lru_cache(maxsize=None)
def _hw_e4m3_convert(device: torch.device) -> bool:
    """Whether kernels on `device` convert e4m3 with the hardware instruction (CUDA sm_89+, not
    under the interpreter)."""
    if device.type != "cuda" or interpreting():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


@triton.jit
def _e4m3_as_f16(raw, HW_CVT: tl.constexpr):
    """e4m3 bytes (uint8) -> fp16, exactly; the load stays a plain byte copy, which Triton
    pipelines (an fp8-typed load converted for two products was left synchronous on sm_90).

    HW_CVT (sm_89+): the hardware's e4m3x2 -> f16x2 convert, 2 values an instruction; the values
    are the true ones. Else (the interpreter): e4m3's sign, 4 exponent and 3 mantissa bits moved
    into fp16's places with integer ops, which gives value * 2^-8 (fp16's exponent bias is 8 more;
    subnormals map to subnormals); `mla_decode` folds the 2^8 into both scales."""
    if HW_CVT:
        return tl.inline_asm_elementwise(
            asm="{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; "
                "cvt.rn.f16x2.e4m3x2 $1, hi; }",
            constraints="=r,=r,r", args=[raw], dtype=tl.float16, is_pure=True, pack=4)
    b = raw.to(tl.int32)
    return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _as_product(x, dtype: tl.constexpr, FP8: tl.constexpr, HW_CVT: tl.constexpr):
    """A loaded cache tile as a product operand: e4m3 bytes via _e4m3_as_f16, else a cast."""
    if FP8:
        x = _e4m3_as_f16(x, HW_CVT)
    return x.to(dtype)


@triton.jit
def _e4m3_rows(x_lat, x_pe):
    """Query rows [BLOCK_H, BLOCK_L] ‖ [BLOCK_H, BLOCK_R] as e4m3 with one scale per row over
    both parts (amax / 448, kv_quant.FP8_MAX; 1 for a zero row), as kv_quant.e4m3_rows: (lat, pe,
    scale [BLOCK_H]). The divisions are IEEE (div_rn; Triton's `/` is approximate on CUDA), so the
    bytes equal the torch reference's."""
    x_lat = x_lat.to(tl.float32)
    x_pe = x_pe.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x_lat), 1), tl.max(tl.abs(x_pe), 1))
    sq = tl.where(amax > 0.0, tl.math.div_rn(amax, 448.0), 1.0)
    inv = tl.math.div_rn(tl.full(sq.shape, 1.0, tl.float32), sq)[:, None]
    return fp8_store_value(x_lat, inv), fp8_store_value(x_pe, inv), sq


@fast_launch
@triton.jit(do_not_specialize=["num_splits", "stride_btb"])  # the table width varies by step
def _mla_decode_partial_kernel(
    q_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, q_pos_ptr, o_ptr, lse_ptr,
    qk_scale_log2,  # softmax scale * kv scale * log2(e): scores live in the log2 domain
    o_scale,  # kv scale (FP8 cache), else 1; either scale carries 2^8 where its product reads bit-moved values
    H, num_splits,  # runtime, so a new split count never recompiles
    q_len, dcp_size, dcp_rank,
    stride_qb, stride_qh,
    stride_kvb, stride_kvs,
    stride_btb,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_ls, stride_lh,
    PAGE: tl.constexpr, LKV: tl.constexpr, R: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, QK_T: tl.constexpr, PREFETCH_IDS: tl.constexpr, DIRECT: tl.constexpr,
    HAS_POS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, FP8: tl.constexpr, PRODUCT_DTYPE: tl.constexpr,
    RELOAD_V: tl.constexpr, HW_CVT: tl.constexpr, STAGE_V: tl.constexpr, STAGE_C: tl.constexpr,
    QK_FP8: tl.constexpr, LAZY: tl.constexpr, TAU: tl.constexpr, PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    pid_h = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    # Split boundaries on BLOCK_N multiples, so only a split's last tile is partial.
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    rows = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)  # (query token, head) pairs of sequence b
    hmask = rows < q_len * H
    tok = b.to(tl.int64) * q_len + rows // H  # row of q / o / lse
    heads = rows % H
    if HAS_POS:  # keys visible to each row: local_len(p + 1) of its token's position p
        p1 = tl.load(q_pos_ptr + tok, mask=hmask, other=0).to(tl.int32) + 1
        visible = tl.minimum(p1 // dcp_size + (dcp_rank < p1 % dcp_size).to(tl.int32), seq_len)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    lmask = offs_l < LKV
    rmask = offs_r < R
    # the products' input dtype (PRODUCT_DTYPE): q's, or fp16 over an FP8 cache (kv_ptr is then
    # the cache's bytes, read as fp16 values * 2^-8 without HW_CVT; the host folds the 2^8 into
    # the scales of the products that read them)
    kv_dtype = PRODUCT_DTYPE
    q_row = q_ptr + tok[:, None] * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + offs_l[None, :], mask=hmask[:, None] & lmask[None, :], other=0.0)
    q_pe = tl.load(q_row + LKV + offs_r[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
    if QK_FP8:
        # q as e4m3 with a scale per row, sq: QK^T = sq * (q8 · ĉ) over the cache's own e4m3 values
        # (true values: a bitcast, no 2^-8; the host leaves 2^8 out of qk_scale_log2), in fp32.
        # The interpreter's fp8 x fp8 dot widens both operands exactly (fp16, then an fp32
        # matmul), so it needs no fp32 fallback. Triton 3.6 emits e4m3 MMAs on sm_89 (mma.sync
        # m16n8k32) and on sm_90 only as wgmma (QK_T over BLOCK_N = 64 rows); a 16-row sm_90 dot
        # gets its fp8 operands converted to fp16 (docs/kernel_notes.md).
        q_lat, q_pe, sq = _e4m3_rows(q_lat, q_pe)  # [BLOCK_H, BLOCK_L], [BLOCK_H, BLOCK_R], [BLOCK_H]
        qk_scale = (sq * qk_scale_log2)[:, None]  # [BLOCK_H, 1]
    else:
        q_lat = q_lat.to(kv_dtype)  # [BLOCK_H, BLOCK_L]
        q_pe = q_pe.to(kv_dtype)    # [BLOCK_H, BLOCK_R]
        qk_scale = qk_scale_log2

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    bt_row = block_table_ptr + b.to(tl.int64) * stride_btb
    # Block ids. Tiles start on BLOCK_N multiples (the splits too), so a tile holds NP whole pages
    # (NP = 1 when a page holds whole tiles) when one divides the other: then NP ids per tile, each
    # page's rows consecutive, loaded a tile ahead (a row address that waits on a load of the same
    # iteration is not pipelined); the compiled loop is ~40% shorter than with an id per row
    # (scripts/decode_sass.py). Otherwise an id per row, a tile ahead with PREFETCH_IDS.
    PAGED_TILES: tl.constexpr = (PAGE % BLOCK_N == 0) or (BLOCK_N % PAGE == 0 and BLOCK_N // PAGE <= 4)
    NP: tl.constexpr = BLOCK_N // PAGE if BLOCK_N > PAGE else 1
    if PAGED_TILES:
        ids_next = tl.load(bt_row + start // PAGE + tl.arange(0, NP), mask=start + tl.arange(0, NP) * PAGE < end,
                           other=0)
    elif PREFETCH_IDS:
        offs_first = start + tl.arange(0, BLOCK_N)
        blk_next = tl.load(bt_row + offs_first // PAGE, mask=offs_first < end, other=0)
    for n0 in tl.range(start, end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        if PAGED_TILES:
            ids = ids_next
            ids_next = tl.load(bt_row + (n0 + BLOCK_N) // PAGE + tl.arange(0, NP),
                               mask=n0 + BLOCK_N + tl.arange(0, NP) * PAGE < end, other=0)
            if NP == 1:
                blk = tl.sum(ids, 0).to(tl.int64)  # the one id, as a scalar
                base = blk * stride_kvb + (n0 % PAGE) * stride_kvs  # the tile's first row (the offset in a page fits i32)
                row = base + tl.arange(0, BLOCK_N).to(tl.int64) * stride_kvs
            else:
                in_tile = tl.arange(0, BLOCK_N)
                pick = (in_tile // PAGE)[:, None] == tl.arange(0, NP)[None, :]
                blk = tl.sum(tl.where(pick, ids[None, :], 0), 1).to(tl.int64)
                row = blk * stride_kvb + (in_tile % PAGE).to(tl.int64) * stride_kvs
        else:
            if PREFETCH_IDS:
                blk = blk_next.to(tl.int64)
                offs_after = offs_n + BLOCK_N
                blk_next = tl.load(bt_row + offs_after // PAGE, mask=offs_after < end, other=0)
            else:
                blk = tl.load(bt_row + offs_n // PAGE, mask=nmask, other=0).to(tl.int64)
            row = blk * stride_kvb + (offs_n % PAGE).to(tl.int64) * stride_kvs  # [BLOCK_N]
        c_ptrs = kv_ptr + row[:, None] + offs_l[None, :]
        cmask = nmask[:, None] & lmask[None, :]
        c = tl.load(c_ptrs, mask=cmask, other=0)  # [BLOCK_N, BLOCK_L]
        k_pe = tl.load(kv_ptr + row[:, None] + LKV + offs_r[None, :],
                       mask=nmask[:, None] & rmask[None, :], other=0)  # [BLOCK_N, BLOCK_R]
        if RELOAD_V:
            # An FP8 tile converted in registers for both products is loaded synchronously by
            # Triton's pipeliner (sm_90, 16-row tiles); a second load of the same rows for PV
            # (from L1/L2) keeps both loads pipelined.
            v = tl.load(c_ptrs, mask=cmask, other=0, cache_modifier=".ca")  # a distinct op: not CSEd with c
        else:
            v = c
        if QK_FP8:  # the bytes as e4m3 operands; v (the reload, or these bytes) is converted below
            c = c.to(tl.float8e4nv, bitcast=True)
            k_pe = k_pe.to(tl.float8e4nv, bitcast=True)
        else:
            k_pe = _as_product(k_pe, kv_dtype, FP8, HW_CVT)
            c = _as_product(c, kv_dtype, FP8, HW_CVT)
            if STAGE_C and HW_CVT:
                # The same opaque identity as STAGE_V, on the only copy: the tile is converted once,
                # in the load's layout, and both products read the fp16 tile (ldmatrix, .trans for PV)
                # from shared memory instead of converting 8-bit operands in their own layouts.
                c = tl.inline_asm_elementwise(asm="mov.b32 $0, $1;", constraints="=r,r", args=[c],
                                              dtype=tl.float16, is_pure=False, pack=2)
        if QK_T:  # scores as [BLOCK_N, BLOCK_H]: rows (tokens) fill the MMA's M, for wide head tiles
            s_t = tl.dot(c, tl.trans(q_lat), input_precision=PRECISION)
            s_t = tl.dot(k_pe, tl.trans(q_pe), acc=s_t, input_precision=PRECISION)
            s = tl.trans(s_t)
        else:
            s = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)
            s = tl.dot(q_pe, tl.trans(k_pe), acc=s, input_precision=PRECISION)
        if RELOAD_V or QK_FP8:
            v = _as_product(v, kv_dtype, FP8, HW_CVT)
            if STAGE_V and HW_CVT:
                # An opaque identity (not pure: Triton can neither move nor drop it) keeps the
                # conversion in the load's layout: the fp16 tile then goes through shared memory
                # and PV reads it with ldmatrix.trans, instead of Triton converting in PV's operand
                # layout, where 8-bit data has no ldmatrix.trans (single-byte shared loads).
                v = tl.inline_asm_elementwise(asm="mov.b32 $0, $1;", constraints="=r,r", args=[v],
                                              dtype=tl.float16, is_pure=False, pack=2)
        else:
            v = c
        if HAS_POS:
            s = tl.where(offs_n[None, :] < visible[:, None], s * qk_scale, float("-inf"))
        else:
            s = tl.where(nmask[None, :], s * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if LAZY:
            # Rescale only when some row's max outgrew the one in use by more than 2^TAU (the
            # first tile always: m_i = -inf). Rows that saw no key have m_new - m_i = nan: no vote.
            if tl.max(tl.where(m_new - m_i > TAU, 1, 0), 0) > 0:
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_use)
                l_i = l_i * alpha
                acc = acc * alpha[:, None]
                m_i = m_new
            m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i + tl.sum(p, 1)
            acc = tl.dot(p.to(kv_dtype), v, acc=acc, input_precision=PRECISION)
        else:
            # A row that has seen no visible key yet keeps m = -inf: shift by 0 instead (p = 0).
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(kv_dtype), v, acc=acc * alpha[:, None], input_precision=PRECISION)
            m_i = m_new

    empty = l_i == 0.0  # split (or whole sequence) without rows: lse -inf, output 0
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    o = acc * (o_scale / tl.where(empty, 1.0, l_i))[:, None]
    o_ptrs = (o_ptr + tok[:, None] * stride_ob + split * stride_os
              + heads[:, None] * stride_oh + offs_l[None, :])
    lse_ptrs = lse_ptr + tok * stride_lb + split * stride_ls + heads * stride_lh
    # A split past the sequence's end (the engine's block tables are max_model_len wide, so at
    # batch 1 most of ~100 splits are) stores only its lse of -inf: the reduce never reads the
    # rows of such a split, and they would be 32 KB each per (sequence, head tile). The direct
    # path (DIRECT: one split) writes the final output, zeros included.
    omask = hmask[:, None] & lmask[None, :]
    if not DIRECT:
        # as a [BLOCK_H] vector: the interpreter rejects a scalar condition broadcast into a mask
        omask = omask & ((tl.zeros([BLOCK_H], tl.int32) + start) < seq_len)[:, None]
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=omask)
    tl.store(lse_ptrs, lse, mask=hmask)


@fast_launch
@triton.jit(do_not_specialize=["num_splits"])
def _mla_decode_reduce_kernel(
    po_ptr, plse_ptr, o_ptr, lse_ptr,
    H, num_splits,
    stride_pob, stride_pos, stride_poh,
    stride_plb, stride_pls, stride_plh,
    stride_ob, stride_oh, stride_lb, stride_lh,
    LKV: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    """Program (head, row, column block): o[row, head, cols] = sum_s w_s * po[row, s, head, cols]
    with w_s = exp(lse_s - lse) over the splits. Every split's lse is read in one load and its
    rows as one [BLOCK_S, BLOCK_L] tile, so the program waits on two loads, not two per split
    (at batch 1 there are ~55 splits); the columns are spread over programs to keep the tile
    small and the grid wide."""
    pdl_prologue(PDL)
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    pid_l = tl.program_id(2)
    offs_s = tl.arange(0, BLOCK_S)
    offs_l = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
    lmask = offs_l < LKV
    lse_s = tl.load(plse_ptr + b * stride_plb + h * stride_plh + offs_s * stride_pls,
                    mask=offs_s < num_splits, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe)  # 0 for empty splits (lse -inf) and past num_splits
    total = tl.sum(w, 0)  # 0 when every split is empty
    # Empty splits' rows were never written: masked, so their contents cannot reach the sum.
    read = (lse_s > float("-inf"))[:, None] & lmask[None, :]
    o_s = tl.load(po_ptr + b * stride_pob + offs_s[:, None] * stride_pos + h * stride_poh + offs_l[None, :],
                  mask=read, other=0.0)
    acc = tl.sum(w[:, None] * o_s, 0)
    nonempty = total > 0.0
    o = acc / tl.where(nonempty, total, 1.0)
    lse = tl.where(nonempty, m_safe + tl.log(tl.where(nonempty, total, 1.0)), float("-inf"))
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_l, o.to(o_ptr.dtype.element_ty), mask=lmask)
    tl.store(lse_ptr + b * stride_lb + h * stride_lh, lse, mask=pid_l == 0)


def reduce_splits(po: torch.Tensor, plse: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                  num_splits: int, po_strides: tuple, plse_strides: tuple) -> None:
    """Stage 2: merge the splits' partials (`split_outputs`) into o `[T, H, L]` and lse `[T, H]`.
    Columns per program: the [splits, columns] fp32 tile at most 4096 values (32 per thread of
    4 warps), at least 32 columns."""
    T, H, lkv = o.shape
    block_l = max(32, min(triton.next_power_of_2(lkv), 4096 // triton.next_power_of_2(num_splits)))
    _mla_decode_reduce_kernel[(H, T, triton.cdiv(lkv, block_l))](
        po, plse, o, lse, H, num_splits,
        *po_strides, *plse_strides,
        o.stride(0), o.stride(1), lse.stride(0), lse.stride(1),
        LKV=lkv, BLOCK_L=block_l, BLOCK_S=triton.next_power_of_2(num_splits),
        num_warps=4, **pdl_launch(),
    )


def split_outputs(o: torch.Tensor, lse: torch.Tensor, num_splits: int) -> tuple:
    """(po, plse, po strides, plse strides) for stage 1: with one split the final o `[T, H, L]` and
    lse `[T, H]` themselves (split stride 0), else fp32 partials `[T, splits, H, L]` and
    `[T, splits, H]` for the merge."""
    if num_splits == 1:
        return o, lse, (o.stride(0), 0, o.stride(1)), (lse.stride(0), 0, lse.stride(1))
    T, H, L = o.shape
    po = torch.empty(T, num_splits, H, L, dtype=torch.float32, device=o.device)
    plse = torch.empty(T, num_splits, H, dtype=torch.float32, device=o.device)
    return po, plse, (po.stride(0), po.stride(1), po.stride(2)), (plse.stride(0), plse.stride(1), plse.stride(2))


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, kv_lora_rank: int, q_len: int = 1,
               q_pos: torch.Tensor | None = None, dcp_size: int = 1, dcp_rank: int = 0,
               num_splits: int | None = None, num_sms: int | None = None,
               cfg: DecodeConfig | None = None, kv_scale: float = 1.0,
               qk_fp8: bool = False, unmerged_max_splits: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode: q [B*q_len, H, Lkv+R] -> (o [B*q_len, H, Lkv] in q.dtype, lse
    [B*q_len, H] fp32); `q_pos` and the DCP layout as in attention/backend.py `decode`.

    Inputs are assumed validated (TritonAttentionOps does it); the last dims must be contiguous.
    `kv_scale` is an FP8 cache's per-tensor scale (ignored for other caches); `qk_fp8` sets
    DecodeConfig.qk_fp8 on the tiles chosen (or given). With 2 to `unmerged_max_splits` splits
    the splits' partials are returned unmerged: (po `[B*q_len, splits, H, Lkv]` fp32, plse
    `[B*q_len, splits, H]`), for triton_absorb.absorb_o_merge.
    """
    T, H, D = q.shape
    B = T // q_len
    page = kv_cache.shape[1]
    lkv, r = kv_lora_rank, D - kv_lora_rank
    fp8 = is_fp8(kv_cache)
    # the products' inputs: q's dtype; over an FP8 cache fp16 (e4m3 -> fp16 is exact), or fp32
    compute_dtype = torch.float16 if fp8 and q.dtype != torch.float32 else q.dtype
    rows = q_len * H  # query rows per sequence
    cfg = cfg or default_decode_config(rows, compute_dtype, cache_dtype=kv_cache.dtype)
    if qk_fp8 and not cfg.qk_fp8:
        cfg = dataclasses.replace(cfg, qk_fp8=True)
    qk_fp8 = fp8 and cfg.qk_fp8
    # e4m3 -> fp16 by the hardware's convert on CUDA (sm_89+), else by moving bits, which reads
    # values * 2^-8 (_e4m3_as_f16): then 2^8 goes into the scale of each product whose operand
    # was converted: PV always, QK^T unless it runs on the bytes as e4m3 (qk_fp8: true values)
    hw_cvt = fp8 and _hw_e4m3_convert(q.device)
    o_scale = (kv_scale * (1.0 if hw_cvt else 256.0)) if fp8 else 1.0
    qk_kv_scale = (kv_scale * (1.0 if hw_cvt or qk_fp8 else 256.0)) if fp8 else 1.0
    block_h = max(16, min(cfg.block_h, triton.next_power_of_2(rows)))
    head_tiles = triton.cdiv(rows, block_h)
    if num_splits is None:
        max_len = block_table.shape[1] * page
        num_splits = choose_num_splits(B, head_tiles, max_len, num_sms or 1, cfg)
    o = torch.empty(T, H, lkv, dtype=q.dtype, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if B == 0 or H == 0:
        return o, lse
    precision = "ieee" if compute_dtype == torch.float32 else "tf32"
    direct = num_splits == 1
    po, plse, po_strides, plse_strides = split_outputs(o, lse, num_splits)
    block_l = triton.next_power_of_2(lkv)
    _mla_decode_partial_kernel[(head_tiles, num_splits, B)](
        q, kv_cache.view(torch.uint8) if fp8 else kv_cache, block_table, seq_lens,
        seq_lens if q_pos is None else q_pos, po, plse,
        scale * qk_kv_scale * LOG2E, o_scale, H, num_splits, q_len, dcp_size, dcp_rank,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0),
        *po_strides, *plse_strides,
        PAGE=page, LKV=lkv, R=r,
        BLOCK_L=block_l, BLOCK_R=triton.next_power_of_2(r),
        BLOCK_H=block_h, BLOCK_N=cfg.block_n,
        PRECISION=precision, QK_T=cfg.qk_t, PREFETCH_IDS=cfg.prefetch_ids, DIRECT=direct,
        HAS_POS=q_pos is not None, WARP_SPECIALIZE=cfg.warp_specialize, FP8=fp8,
        RELOAD_V=fp8 and cfg.reload_v and not cfg.stage_c, HW_CVT=hw_cvt,
        STAGE_V=fp8 and cfg.reload_v and cfg.stage_v and not cfg.stage_c, STAGE_C=fp8 and cfg.stage_c,
        QK_FP8=qk_fp8, LAZY=cfg.lazy_rescale, TAU=LAZY_TAU,
        PRODUCT_DTYPE={torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[compute_dtype],
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(),
        **({} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}),
    )
    if direct:
        return o, lse
    if num_splits <= unmerged_max_splits:
        return po, plse
    reduce_splits(po, plse, o, lse, num_splits, po_strides, plse_strides)
    return o, lse
