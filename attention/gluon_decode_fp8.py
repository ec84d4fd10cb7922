"""Paged split-KV MLA decode over an FP8 latent cache on Hopper's e4m3 tensor cores, in Gluon.

Same contract as `attention.triton_decode.mla_decode` (notation in its docstring, DESIGN.md §4)
for a cache of e4m3 bytes with one per-tensor scale (attention/kv_quant.py): q `[B*q_len, H, 576]`
bf16, o `[T, H, 512]` bf16, lse `[T, H]` fp32; splits merged by `triton_decode.reduce_splits`.
Scope (attention/gluon_decode_fp8_plan.py): q_len * H a multiple of 16, the DeepSeek widths
512 + 64, sm_90 only, written against Triton 3.6's Gluon. The engine's decodes over an FP8 cache
run here by default where that fits (the kernel plan's decode_fp8_wgmma);
`scripts/bench_fp8_decode.py` times it against the bf16 cache and the Triton FP8 kernel.

Why Gluon and this shape: Hopper's only e4m3 MMA is wgmma (its mma.sync on e4m3 is emulated by
ptxas: both operands converted to fp16, two HMMAs), and wgmma wants both e4m3 operands K-major.
The Triton kernels convert the cache's bytes to fp16 for every product and lose to the bf16
cache (docs/kernel_notes.md). Here no cache value is ever converted:

- One program = 16 query rows ((token, head) pairs of one sequence) x one split, one warpgroup,
  two programs per SM. Tiles of BLOCK_N = 64 cache rows are copied as bytes (cp.async, a page's
  base address per thread and page, `_copy_tile`) into `num_stages` shared buffers.
- QK^T runs transposed, tokens as wgmma's M: S^T [64 x 32] = tile [64 x 576] . [q_hi ; q_lo]^T.
  Each query row is scaled to e4m3's range (sq = amax / 448) and written as two e4m3 terms,
  q ~ sq (hi + lo) with lo = e4m3(q / sq - hi): a relative error near bf16's instead of e4m3's
  2^-4. Both terms share one wgmma (N = 2 x 16) and the two halves of its accumulator are added
  in registers. The wgmma's own e4m3 sums are of reduced precision: with `qk_promote` (256) they
  are added in fp32 every 256 of K (the GPU tests' lse bound failed without it, 0.027-0.031).
- The online softmax runs over the tile's tokens (axis 0 of S^T): the column max by shuffles
  within each warp and one barrier across the 4 warps (`_column_max`); the row sums l are kept
  per element and summed once at the end.
- PV runs transposed too: O^T [512 x 16] += V^T [512 x 64] . P'^T with P' = 256 P (p <= 1) written
  as e4m3 hi + residual (the same two-term form, P' <= 256 < 448) into shared memory as the
  K-major B operand, two wgmmas into one accumulator. V^T is the A operand from registers
  (`_vt_fragment`): wgmma wants 4 consecutive tokens of one latent column in each register, the
  tile holds 4 consecutive latent columns of one token. So each thread loads 16 consecutive
  latent bytes of each of its 16 tokens (16-byte shared loads) and Triton transposes them in
  registers (byte permutes). For that the 512 rows of O^T are in a permuted order (`perm_rows`:
  each thread's 16 rows are 16 consecutive latent columns), undone when O is stored.
- The two-term split rounds in fp32 arithmetic (`_e4m3_round`), not by converting to e4m3 and
  back: Triton 3.6's e4m3 -> fp32 conversion gave wrong values in this kernel on the H200.

The scales fold out: scores = (sq . qk_scale) * S^T per head column (qk_scale = softmax scale x
kv scale x log2 e), o = O^T * kv_scale / 256 / l. The copies, V^T's fragment and the e4m3 helpers
are in attention/gluon_fp8_tiles.py; the config, checks and row order in gluon_decode_fp8_plan.py.
"""
from __future__ import annotations


import torch

from attention.decode_config import choose_num_splits
from attention.gluon_decode_fp8_plan import (BLOCK_H, BLOCK_N, LAZY_TAU, LKV, OPTION, R, SMEM_LIMIT, Fp8DecodeConfig,
                                             engine_fit_problem, perm_rows, validate_inputs)

from attention.triton_decode import LOG2E, reduce_splits, split_outputs
from common.launch_settings import sm_count

__all__ = ["BLOCK_H", "BLOCK_N", "LAZY_TAU", "LKV", "OPTION", "R", "SMEM_LIMIT", "Fp8DecodeConfig", "check_available",
           "engine_fit_problem", "mla_decode_fp8_wgmma", "perm_rows", "validate_inputs"]

try:  # Gluon is Triton's experimental dialect: present in Triton >= 3.4, its API moves
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from attention.gluon_copies import _split_bounds
    from attention.gluon_fp8_tiles import _copy_tile, _page_ids, _two_terms, _vt_fragment
    _GLUON_ERROR: Exception | None = None
except Exception as exc:  # noqa: BLE001 - reported by check_available when the path is used
    _GLUON_ERROR = exc


def check_available(device: torch.device) -> None:
    """Raise naming the option when this path cannot run: no Gluon, no CUDA, not sm_90."""
    if _GLUON_ERROR is not None:
        raise RuntimeError(f"{OPTION} needs Triton's Gluon dialect, whose import failed: {_GLUON_ERROR!r}")
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"{OPTION} runs on CUDA sm_90 only (got device {device})")
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        raise RuntimeError(f"{OPTION} needs an sm_90 GPU (e4m3 wgmma), got sm_{cap[0]}{cap[1]}")


if _GLUON_ERROR is None:
    # the per-column maxima of the 4 warps, [warp, column], as each thread reads them back: the 4
    # warps in registers, the columns as in a column vector of S^T (SliceLayout(0, s_l))
    _WMAX = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 8], [1, 0], [2, 0]], lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
        warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[4, BLOCK_H]))

    @gluon.jit
    def _column_max(s, red_s, col_l: gl.constexpr):
        """max over the 64 rows of S^T [64, 16] (one warp a 16-row band): within each warp by
        shuffles, then the 4 warps' maxima through shared memory with one barrier (Triton's own
        cross-warp reduction takes three)."""
        w_max = gl.max(gl.reshape(s, [4, 16, 16]), axis=1)  # [warp, column]: no cross-warp step
        red_s.store(w_max)
        gl.thread_barrier()
        return gl.convert_layout(gl.max(red_s.load(_WMAX), axis=0), col_l, assert_trivial=True)

    @gluon.jit
    def _issue_qk(c_tile, r_tile, q_s, qr_s, s_zero, QK_PROMOTE: gl.constexpr):
        """Issue S^T [64, 32] = tile . [q_hi ; q_lo]^T (async); with QK_PROMOTE the e4m3 sums are
        promoted to fp32 every QK_PROMOTE of K (the rope part is one promotion)."""
        if QK_PROMOTE > 0:
            s_tok = warpgroup_mma(c_tile, q_s.permute((1, 0)), s_zero, use_acc=False, is_async=True,
                                  max_num_imprecise_acc=QK_PROMOTE)
            s_tok = warpgroup_mma(r_tile, qr_s.permute((1, 0)), s_tok, is_async=True, max_num_imprecise_acc=64)
        else:
            s_tok = warpgroup_mma(c_tile, q_s.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s_tok = warpgroup_mma(r_tile, qr_s.permute((1, 0)), s_tok, is_async=True)
        return s_tok

    @gluon.jit
    def _softmax_step(s2, m_i, l_part, col_scale, t0, end, visible, red_s, s_l: gl.constexpr,
                      HAS_POS: gl.constexpr, LAZY: gl.constexpr, TAU: gl.constexpr):
        """One tile's online-softmax step on QK^T's accumulator s2 [64, 32] (the q_hi and q_lo
        halves added): (m, l_part with this tile's p added, p, alpha, whether any column's m moved).
        The caller rescales O by alpha where m moved; l_part is rescaled here."""
        BH: gl.constexpr = 16
        BN: gl.constexpr = 64
        col_l: gl.constexpr = gl.SliceLayout(0, s_l)
        s_hi, s_lo = gl.split(gl.permute(gl.reshape(s2, [BN, 2, BH]), [0, 2, 1]))
        s = gl.convert_layout(s_hi, s_l, assert_trivial=True) + gl.convert_layout(s_lo, s_l, assert_trivial=True)
        offs_n = t0 + gl.arange(0, BN, layout=gl.SliceLayout(1, s_l))
        valid = offs_n[:, None] < end
        if HAS_POS:
            valid = valid & (offs_n[:, None] < visible[None, :])
        s = gl.where(valid, s * col_scale[None, :], float("-inf"))
        m_cand = gl.maximum(m_i, _column_max(s, red_s, col_l))
        if LAZY:  # m moves only when a column's tile max passes it by more than TAU
            moved = m_cand > m_i + TAU
            m_new = gl.where(moved, m_cand, m_i)
            any_moved = gl.max(moved.to(gl.int32), axis=0)  # one decision for the warpgroup
        else:
            m_new = m_cand
            any_moved = 1
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: p = 0
        p = gl.exp2(s - m_use[None, :])
        alpha = gl.exp2(m_i - m_use)  # 1 where m stayed (0 where no key yet: l and O are 0)
        if any_moved > 0:
            l_part = l_part * alpha[None, :]
        return m_new, l_part + p, p, alpha, any_moved

    @gluon.jit
    def _store_p(p, ph_s, pl_s, P_SCALE: gl.constexpr, HW_DECODE: gl.constexpr):
        """P' = P_SCALE * p (<= 256: p <= 2^TAU, 1 without LAZY) as e4m3 hi and lo into ph_s and
        pl_s [16, 64], transposed: the K-major B operand of PV. Two allocations, not one [2, 16, 64]:
        Triton orders stores to one allocation with a barrier between them."""
        p_hi, p_lo = _two_terms(p * P_SCALE, HW_DECODE)
        ph_s.store(gl.permute(p_hi, [1, 0]))
        pl_s.store(gl.permute(p_lo, [1, 0]))

    @gluon.jit
    def _kv_step(j, kv_ptr, ids, bt_row, start, end, stride_kvb, stride_kvs, c_cur, r_cur, c_nxt, r_nxt,
                 q_s, qr_s, ph_s, pl_s, red_s, s_zero, m_i, l_part, acc, col_scale, visible,
                 PAGE: gl.constexpr, STAGES: gl.constexpr, HAS_POS: gl.constexpr, LAZY: gl.constexpr,
                 TAU: gl.constexpr, P_SCALE: gl.constexpr, QK_PROMOTE: gl.constexpr, VT_EARLY: gl.constexpr,
                 VT_PRMT: gl.constexpr, P_HW_DECODE: gl.constexpr, FENCE_FIRST: gl.constexpr):
        """KV tile j (in c_cur / r_cur) into the softmax state and O^T, with the refill of tile
        j + STAGES - 1 into c_nxt / r_nxt issued at its start: (m_i, l_part, acc, the page ids of
        the refill after). With FENCE_FIRST the proxy fence comes before the refill's issue, and
        Triton adds a barrier of its own between the refill and QK^T (it cannot tell the stages
        apart): 5 barriers a tile instead of 4."""
        BN: gl.constexpr = 64
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, 16, 32])
        vt_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_l, k_width=4)
        async_copy.wait_group(STAGES - 2)  # this thread's copies of tile j are in
        if FENCE_FIRST:
            fence_async_shared()
        gl.thread_barrier()  # every warp is past tile j-1: its stage is free for the refill
        nxt = j + STAGES - 1
        _copy_tile(kv_ptr, ids, c_nxt, r_nxt, start + nxt * BN, end, stride_kvb, stride_kvs, PAGE, BN)
        async_copy.commit_group()
        if not FENCE_FIRST:
            # tile j's cp.async writes and q's stores (generic proxy) before wgmma reads them
            # (async proxy), in every thread; the barrier also orders the refill's issue before
            # the reads, as Triton's shared-memory analysis wants
            fence_async_shared()
            gl.thread_barrier()
        ids = _page_ids(bt_row, start + (nxt + 1) * BN, end, PAGE, BN)
        s_tok = _issue_qk(c_cur, r_cur, q_s, qr_s, s_zero, QK_PROMOTE)
        if VT_EARLY:  # V^T's fragment (below) while QK^T runs
            vt = _vt_fragment(c_cur, vt_l, VT_PRMT)
        s2 = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
        m_i, l_part, p, alpha, moved = _softmax_step(s2, m_i, l_part, col_scale, start + j * BN, end,
                                                    visible, red_s, s_l, HAS_POS, LAZY, TAU)
        if moved > 0:
            acc = acc * alpha[None, :]
        _store_p(p, ph_s, pl_s, P_SCALE, P_HW_DECODE)
        if not VT_EARLY:  # here its 64 registers are not live across the softmax
            vt = _vt_fragment(c_cur, vt_l, VT_PRMT)
        fence_async_shared()
        gl.thread_barrier()
        o_tok = warpgroup_mma(vt, ph_s.permute((1, 0)), acc, is_async=True)
        o_tok = warpgroup_mma(vt, pl_s.permute((1, 0)), o_tok, is_async=True)
        # (the wait cannot list vt, 8-bit, among its deps: nothing touches vt before it)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[o_tok])
        return m_i, l_part, acc, ids

    @gluon.jit(do_not_specialize=["num_splits", "stride_btb"])
    def _mla_decode_fp8_kernel(q_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, q_pos_ptr, o_ptr, lse_ptr,
                               qk_scale_log2, o_scale, H, num_splits, q_len, dcp_size, dcp_rank,
                               stride_qb, stride_qh, stride_kvb, stride_kvs, stride_btb,
                               stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh,
                               PAGE: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr,
                               HAS_POS: gl.constexpr, LAZY: gl.constexpr, TAU: gl.constexpr,
                               P_SCALE: gl.constexpr, QK_PROMOTE: gl.constexpr, VT_EARLY: gl.constexpr,
                               VT_PRMT: gl.constexpr, P_HW_DECODE: gl.constexpr, FENCE_FIRST: gl.constexpr):
        BH: gl.constexpr = 16
        BN: gl.constexpr = 64
        s2_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 2 * BH, 32])
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BH, 32])
        ld_q: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        col_l: gl.constexpr = gl.SliceLayout(0, s_l)  # per head column of S^T and O^T
        c_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, 512], gl.float8e4nv)
        r_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, 64], gl.float8e4nv)
        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BH, 512], gl.float8e4nv)
        qr_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BH, 64], gl.float8e4nv)
        p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, BN], gl.float8e4nv)
        c_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, 512], c_sl)
        r_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, 64], r_sl)
        q_s = gl.allocate_shared_memory(gl.float8e4nv, [2 * BH, 512], q_sl)
        qr_s = gl.allocate_shared_memory(gl.float8e4nv, [2 * BH, 64], qr_sl)
        ph_s = gl.allocate_shared_memory(gl.float8e4nv, [BH, BN], p_sl)  # P's two terms: hi
        pl_s = gl.allocate_shared_memory(gl.float8e4nv, [BH, BN], p_sl)  # and lo
        red_s = gl.allocate_shared_memory(gl.float32, [4, BH],
                                          gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))

        pid_h = gl.program_id(0)
        split = gl.program_id(1)
        b = gl.program_id(2)
        seq_len, start, end, n_tiles, bt_row = _split_bounds(seq_lens_ptr, block_table_ptr, stride_btb, b,
                                                             split, num_splits, BN)
        for t in gl.static_range(STAGES - 1):
            ids = _page_ids(bt_row, start + t * BN, end, PAGE, BN)
            _copy_tile(kv_ptr, ids, c_s.index(t), r_s.index(t), start + t * BN, end,
                       stride_kvb, stride_kvs, PAGE, BN)
            async_copy.commit_group()
        # the next refill's page ids, a tile ahead: their load's latency passes under a tile's work
        ids = _page_ids(bt_row, start + (STAGES - 1) * BN, end, PAGE, BN)

        # q's rows as two e4m3 terms with a scale per row (under the first tiles' copies)
        rq = pid_h * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, ld_q))
        q_row = (b.to(gl.int64) * q_len + rq // H) * stride_qb + (rq % H) * stride_qh
        q_lat = gl.load(q_ptr + q_row[:, None] + gl.arange(0, 512, layout=gl.SliceLayout(0, ld_q))[None, :])
        q_pe = gl.load(q_ptr + q_row[:, None] + 512 + gl.arange(0, 64, layout=gl.SliceLayout(0, ld_q))[None, :])
        q_lat = q_lat.to(gl.float32)
        q_pe = q_pe.to(gl.float32)
        amax = gl.maximum(gl.max(gl.abs(q_lat), axis=1), gl.max(gl.abs(q_pe), axis=1))
        sq = gl.where(amax > 0, amax / 448.0, 1.0)
        inv = 1.0 / sq
        # [hi ; lo] as one [32, width] tile (rows 0-15 hi, 16-31 lo), stored whole
        hi, lo = _two_terms(q_lat * inv[:, None])
        q_s.store(gl.reshape(gl.permute(gl.join(hi, lo), [2, 0, 1]), [2 * BH, 512]))
        hi, lo = _two_terms(q_pe * inv[:, None])
        qr_s.store(gl.reshape(gl.permute(gl.join(hi, lo), [2, 0, 1]), [2 * BH, 64]))
        col_scale = gl.convert_layout(sq, col_l) * qk_scale_log2

        rows = pid_h * BH + gl.arange(0, BH, layout=col_l)  # (query token, head) pairs of b
        tok = b.to(gl.int64) * q_len + rows // H
        heads = rows % H
        if HAS_POS:  # keys visible to each row: local_len(p + 1) of its token's position p
            p1 = gl.load(q_pos_ptr + tok).to(gl.int32) + 1
            visible = gl.minimum(p1 // dcp_size + (dcp_rank < p1 % dcp_size).to(gl.int32), seq_len)
        else:
            visible = rows  # unused

        m_i = gl.full([BH], float("-inf"), gl.float32, layout=col_l)
        l_part = gl.zeros([BN, BH], gl.float32, layout=s_l)  # row sums, reduced over rows once at the end
        acc = gl.zeros([512, BH], gl.float32, layout=s_l)
        s_zero = gl.zeros([BN, 2 * BH], gl.float32, layout=s2_l)
        for j in range(0, n_tiles):
            k = j % STAGES
            m_i, l_part, acc, ids = _kv_step(
                j, kv_ptr, ids, bt_row, start, end, stride_kvb, stride_kvs, c_s.index(k), r_s.index(k),
                c_s.index((j + STAGES - 1) % STAGES), r_s.index((j + STAGES - 1) % STAGES),
                q_s, qr_s, ph_s, pl_s, red_s, s_zero, m_i, l_part, acc, col_scale, visible,
                PAGE, STAGES, HAS_POS, LAZY, TAU, P_SCALE, QK_PROMOTE, VT_EARLY, VT_PRMT, P_HW_DECODE,
                FENCE_FIRST)
        async_copy.wait_group(0)  # no copy may land after the program ends

        l_i = gl.sum(l_part, axis=0)
        empty = l_i == 0.0  # a split (or sequence) without visible keys: lse -inf, o 0
        lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        o = acc * (o_scale / gl.where(empty, 1.0, l_i))[None, :]
        r = gl.arange(0, 512, layout=gl.SliceLayout(1, s_l))
        lat = ((r >> 3) & 1) | (((r >> 6) & 7) << 1) | ((r & 7) << 4) | (((r >> 4) & 3) << 7)  # perm_rows
        o_ptrs = o_ptr + (tok * stride_ob + split * stride_os + heads * stride_oh)[None, :] + lat[:, None]
        # a split past the sequence's end stores only its lse (-inf): the reduce skips its rows
        if DIRECT:
            gl.store(o_ptrs, o.to(o_ptr.dtype.element_ty))
        else:
            if start < seq_len:
                gl.store(o_ptrs, o.to(o_ptr.dtype.element_ty))
        gl.store(lse_ptr + tok * stride_lb + split * stride_ls + heads * stride_lh, lse)


def launch_args(q, kv_cache, block_table, seq_lens, q_pos, o, lse, po_strides, plse_strides,
                scale, kv_scale, p_scale, H, num_splits, q_len, dcp_size, dcp_rank):
    """The kernel's runtime arguments, in order (scripts/compile_fp8_decode.py's SIGNATURE names
    and types them for a compile without a GPU; the two lists must agree)."""
    return (q, kv_cache, block_table, seq_lens, seq_lens if q_pos is None else q_pos, o, lse,
            scale * kv_scale * LOG2E, kv_scale / p_scale, H, num_splits, q_len, dcp_size, dcp_rank,
            q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
            *po_strides, *plse_strides)


def mla_decode_fp8_wgmma(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                         seq_lens: torch.Tensor, scale: float, kv_lora_rank: int, q_len: int = 1,
                         q_pos: torch.Tensor | None = None, dcp_size: int = 1, dcp_rank: int = 0,
                         num_splits: int | None = None, num_sms: int | None = None, kv_scale: float = 1.0,
                         cfg: Fp8DecodeConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`triton_decode.mla_decode`'s contract over an e4m3 cache with per-tensor scale `kv_scale`:
    q [B*q_len, H, 576] bf16 -> (o [B*q_len, H, 512] bf16, lse [B*q_len, H] fp32). Raises (never
    falls back) where the kernel cannot run; the scope is in the module docstring."""
    cfg = cfg or Fp8DecodeConfig()
    validate_inputs(q, kv_cache, block_table, seq_lens, kv_lora_rank, q_len, q_pos, cfg)
    check_available(q.device)
    T, H, _ = q.shape
    B = T // q_len
    page = kv_cache.shape[1]
    if num_splits is None:
        if num_sms is None:
            num_sms = sm_count(q.device)
        num_splits = choose_num_splits(B, (q_len * H) // BLOCK_H, block_table.shape[1] * page, num_sms,
                                       cfg.split_config())
    o = torch.empty(T, H, LKV, dtype=q.dtype, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if B == 0 or H == 0:
        return o, lse
    direct = num_splits == 1
    po, plse, po_strides, plse_strides = split_outputs(o, lse, num_splits)
    grid = ((q_len * H) // BLOCK_H, num_splits, B)
    _mla_decode_fp8_kernel[grid](
        *launch_args(q, kv_cache, block_table, seq_lens, q_pos, po, plse, po_strides,
                     plse_strides, scale, kv_scale, cfg.p_scale(), H, num_splits, q_len, dcp_size, dcp_rank),
        PAGE=page, STAGES=cfg.num_stages, DIRECT=direct, HAS_POS=q_pos is not None, LAZY=cfg.lazy_rescale,
        TAU=LAZY_TAU, P_SCALE=cfg.p_scale(), QK_PROMOTE=cfg.qk_promote, VT_EARLY=cfg.vt_early,
        VT_PRMT=cfg.vt_prmt, P_HW_DECODE=cfg.p_hw_decode,
        FENCE_FIRST=cfg.fence_first, num_warps=4)
    if not direct:
        reduce_splits(po, plse, o, lse, num_splits, po_strides, plse_strides)
    return o, lse
