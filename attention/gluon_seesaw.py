"""The many-heads MLA decode on 64-row cache tiles in a seesaw schedule, in Gluon (sm_90).

Same contract and launch arguments as `attention.gluon_decode`'s kernel (q `[B*q_len, H, 576]`,
paged cache `[NB, page, 576]` = `[c ‖ k_pe]`, split partials merged by
`triton_decode.reduce_splits`); `gluon_decode.mla_decode_wgmma` runs it for
`GluonDecodeConfig(seesaw=True)`.

Why a second schedule: the lockstep kernel (gluon_decode.py) is bound by the instructions each
warp issues per 32-row tile (docs/kernel_notes.md, "The Gluon many-heads decode: what bounds it"):
both warpgroups run the softmax of every tile, swap 64 x 32 partial scores, and rescale their half
of O on every tile. Here a program takes the cache in pairs of 64-row tiles (K0, K1) and each
warpgroup computes the whole QK^T and softmax of one tile of the pair, so per cache row a
warpgroup issues half the QK^T instructions (m64n64 instead of m64n32 steps), runs the softmax
on half the rows, exchanges no partial scores and rescales O at most twice per 128 rows. O's 512
columns stay split: warpgroup W holds O[:, 256 W : 256 W + 256] and multiplies both tiles' P into
it. With m the running row max before the pair (held by both warpgroups), per pair:

  WG0: S0 = q K0^T; m0 = max(m, rowmax S0); P0 = exp2(S0 - m0); a0 = exp2(m - m0)
       O_L = a0 O_L + P0 V0_L                       (P0 from registers)
  WG1: S1 = q K1^T; m1 = max(m0, rowmax S1); P1 = exp2(S1 - m1); a1 = exp2(m0 - m1)
       O_R = a0 a1 O_R + P1 V1_R                    (P1 from registers; P1 also to shared memory)
  WG0: O_L = a1 O_L + P1 V1_L                       (P1 from shared memory; P0 a1 to shared memory)
  WG1: O_R = O_R + (P0 a1) V0_R
  m = m1; l_W tracks the row sums of what warpgroup W's P contributed, at the same scale.

(This is the schedule of FlashMLA's published design notes; the code is written for this cache
layout and these loads.) While WG0 runs its softmax, WG1's QK^T runs, and the other way round,
so the tensor cores stay fed from two warpgroups that each wait only for the other's row max.

Shared memory (218 KiB of the 227): q whole (the latent part as two [64, 256] halves, the rope
part [64, 64]: 72 KB) and two tile stages of 72 KB, stage s holding tile 2i + s as halves h0
(columns 0-255), h1 (256-511) and rope (512-575). P_s travels through stage s's rope slot: the
rope is read only by tile s's own QK^T, which has finished when P_s is written, and no third
8 KB buffer fits. A third warpgroup (4 warps) issues every copy (cp.async, rows past the sequence
zero-filled: a NaN in an unused cache slot never reaches a product) and publishes each part on an
mbarrier through cp.async's own arrive (`async_copy.mbarrier_arrive`), so it never waits for its
copies. A stage is refilled in two parts: its own half (h_s, read only by warpgroup s) is released
as soon as warpgroup s's PV on it is done, so the next tile's first QK^T k-steps can start on it
while the rest (the other half and the rope slot, whose last reader is the other warpgroup) is
still in flight.

Ordering between the warpgroups (m, a, P, l through shared memory): the writer stores, fences
(for P, which wgmma reads through the async proxy), syncs its warps and arrives on an mbarrier;
the reader waits on it. Every slot is rewritten only after its reader has provably read it: the
rewrite of pair i+1's value depends, through the barriers above, on a step the reader takes after
its read of pair i's.

Rows of the last pair past the split's end are masked to -inf before the softmax (P = 0 exactly),
so an odd tile count costs one masked QK^T and no special case. With `lazy_rescale` the max moves
only by more than 2^LAZY_TAU and a warpgroup skips each rescale of O whose factors are all 1.
"""

from __future__ import annotations

try:  # Gluon is Triton's experimental dialect; gluon_decode.check_gluon_available reports a failure
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from attention.decode_config import LAZY_TAU
    from attention.gluon_copies import _split_bounds, _store_outputs, _visible_keys
    _ERROR: Exception | None = None
except Exception as exc:  # noqa: BLE001
    _ERROR = exc

if _ERROR is None:
    _TAU = gl.constexpr(LAZY_TAU)

    @gluon.jit
    def _new_max(m_prev, s, LAZY: gl.constexpr):
        """The running row max after a tile's (masked, log2-domain) scores; with LAZY it moves only
        where the tile's max passes it by more than LAZY_TAU (so p <= 2^LAZY_TAU), which leaves the
        rescale factor exactly 1 on most tiles."""
        m_new = gl.maximum(m_prev, gl.max(s, axis=1))
        if LAZY:  # from m_prev = -inf any finite max moves it
            m_new = gl.where(m_new > m_prev + _TAU, m_new, m_prev)
        return m_new

    @gluon.jit
    def _rescale(acc, a, orow_l: gl.constexpr, LAZY: gl.constexpr):
        """acc scaled per row by a; with LAZY skipped (128 multiplies a thread) when every row's
        factor is exactly 1."""
        if LAZY:
            if gl.max((a != 1.0).to(gl.int32), axis=0) > 0:
                acc = acc * gl.convert_layout(a, orow_l)[:, None]
        else:
            acc = acc * gl.convert_layout(a, orow_l)[:, None]
        return acc

    @gluon.jit
    def _load_rows(kv_ptr, bt_row, buf, t0, end, col0, stride_kvb, stride_kvs,
                   PAGE: gl.constexpr, BLOCK_N: gl.constexpr, NCOLS: gl.constexpr, layout: gl.constexpr):
        """cp.async of columns [col0, col0 + NCOLS) of cache rows [t0, t0 + BLOCK_N) into buf; rows
        >= end are zero-filled and read nothing (no table entry past the sequence is read)."""
        n = t0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        if PAGE >= BLOCK_N:  # t0 is a BLOCK_N multiple: the tile lies in one block
            blk = gl.load(bt_row + t0 // PAGE, mask=t0 < end, other=0)
        else:
            blk = gl.load(bt_row + n // PAGE, mask=n < end, other=0)
        row = blk.to(gl.int64) * stride_kvb + (n % PAGE).to(gl.int64) * stride_kvs
        cols = col0 + gl.arange(0, NCOLS, layout=gl.SliceLayout(0, layout))
        async_copy.async_copy_global_to_shared(buf, kv_ptr + row[:, None] + cols[None, :],
                                               mask=(n < end)[:, None])

    @gluon.jit
    def _seesaw_producer(q_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, H, num_splits, q_len,
                         stride_qb, stride_qh, stride_kvb, stride_kvs, stride_btb,
                         q_lat0, q_lat1, q_pe, h0, h1, rp, q_full, full_e, full_l, empty_e, empty_l,
                         PAGE: gl.constexpr, BLOCK_N: gl.constexpr):
        """Every copy: q, then per pair i the early parts (stage s's own half h_s) and the late
        parts (the other half and the rope slot) of tiles 2i and 2i+1, each once its last reader
        has released it; each published on its `full` barrier (128 arrivals: one per thread, when
        that thread's copies have landed)."""
        HALF: gl.constexpr = 256
        LKV_: gl.constexpr = 512
        BH: gl.constexpr = 64
        # [16, 64] per pass: a thread copies 4 distinct rows of a 64-row tile (4 row addresses and
        # block ids live, not the 16 of a [4, 256] pass, which spilled at 40-80 registers)
        ld_c: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        ld_r: gl.constexpr = ld_c
        pid_h = gl.program_id(0)
        split = gl.program_id(1)
        b = gl.program_id(2)
        seq_len, start, end, n_pairs, bt_row = _split_bounds(seq_lens_ptr, block_table_ptr, stride_btb, b,
                                                             split, num_splits, 2 * BLOCK_N)
        rq_c = pid_h * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, ld_c))
        q_row_c = (b.to(gl.int64) * q_len + rq_c // H) * stride_qb + (rq_c % H) * stride_qh
        cq_c = gl.arange(0, HALF, layout=gl.SliceLayout(0, ld_c))
        async_copy.async_copy_global_to_shared(q_lat0.index(0), q_ptr + q_row_c[:, None] + cq_c[None, :])
        async_copy.async_copy_global_to_shared(q_lat1.index(0), q_ptr + q_row_c[:, None] + (HALF + cq_c)[None, :])
        rq_r = pid_h * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, ld_r))
        q_row_r = (b.to(gl.int64) * q_len + rq_r // H) * stride_qb + (rq_r % H) * stride_qh
        cq_r = LKV_ + gl.arange(0, BH, layout=gl.SliceLayout(0, ld_r))
        async_copy.async_copy_global_to_shared(q_pe.index(0), q_ptr + q_row_r[:, None] + cq_r[None, :])
        async_copy.mbarrier_arrive(q_full.index(0), increment_count=False)
        for i in range(n_pairs):
            phase = (i & 1) ^ 1  # a fresh barrier passes
            ta = start + 2 * i * BLOCK_N
            tb = ta + BLOCK_N
            mbarrier.wait(empty_e.index(0), phase)
            _load_rows(kv_ptr, bt_row, h0.index(0), ta, end, 0, stride_kvb, stride_kvs, PAGE, BLOCK_N, HALF, ld_c)
            async_copy.mbarrier_arrive(full_e.index(0), increment_count=False)
            mbarrier.wait(empty_e.index(1), phase)
            _load_rows(kv_ptr, bt_row, h1.index(1), tb, end, HALF, stride_kvb, stride_kvs, PAGE, BLOCK_N, HALF,
                       ld_c)
            async_copy.mbarrier_arrive(full_e.index(1), increment_count=False)
            mbarrier.wait(empty_l.index(0), phase)
            _load_rows(kv_ptr, bt_row, h1.index(0), ta, end, HALF, stride_kvb, stride_kvs, PAGE, BLOCK_N, HALF,
                       ld_c)
            _load_rows(kv_ptr, bt_row, rp.index(0), ta, end, LKV_, stride_kvb, stride_kvs, PAGE, BLOCK_N, BH, ld_r)
            async_copy.mbarrier_arrive(full_l.index(0), increment_count=False)
            mbarrier.wait(empty_l.index(1), phase)
            _load_rows(kv_ptr, bt_row, h0.index(1), tb, end, 0, stride_kvb, stride_kvs, PAGE, BLOCK_N, HALF, ld_c)
            _load_rows(kv_ptr, bt_row, rp.index(1), tb, end, LKV_, stride_kvb, stride_kvs, PAGE, BLOCK_N, BH, ld_r)
            async_copy.mbarrier_arrive(full_l.index(1), increment_count=False)
        async_copy.commit_group()
        async_copy.wait_group(0)  # no copy may land after the program ends

    @gluon.jit
    def _wait_full(bar, phase):
        """A part published by the producer: its cp.async writes (generic proxy) ordered before
        this warpgroup's wgmma reads (async proxy)."""
        mbarrier.wait(bar, phase)
        fence_async_shared()

    @gluon.jit
    def _release(bar):
        """Every warp of this warpgroup is past its wait for the wgmma that read the part."""
        gl.thread_barrier()
        mbarrier.arrive(bar, count=1)

    @gluon.jit
    def _seesaw_wg(q_pos_ptr, seq_lens_ptr, block_table_ptr, o_ptr, lse_ptr, qk_scale_log2, H, num_splits,
                   q_len, dcp_size, dcp_rank, stride_btb, stride_ob, stride_os, stride_oh,
                   stride_lb, stride_ls, stride_lh,
                   q_own, q_oth, q_pe, h_own, h_oth, rp, q_full, full_e, full_l, empty_e, empty_l,
                   m_x0, m_x1, a_x0, a_x1, l_own, l_oth, bar_m, bar_p, bar_l,
                   W: gl.constexpr, BLOCK_N: gl.constexpr, DIRECT: gl.constexpr, HAS_POS: gl.constexpr,
                   LAZY: gl.constexpr):
        """Warpgroup W: the QK^T and softmax of tile 2i + W of each pair, O[:, 256 W : 256 W + 256]
        over both tiles (module docstring). q_own / h_own: the latent half W of q and of the
        stages; q_oth / h_oth: the other half."""
        HALF: gl.constexpr = 256
        BH: gl.constexpr = 64
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HALF, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        orow_l: gl.constexpr = gl.SliceLayout(1, o_layout)

        pid_h = gl.program_id(0)
        split = gl.program_id(1)
        b = gl.program_id(2)
        seq_len, start, end, n_pairs, bt_row = _split_bounds(seq_lens_ptr, block_table_ptr, stride_btb, b,
                                                             split, num_splits, 2 * BLOCK_N)
        rows = pid_h * BH + gl.arange(0, BH, layout=row_l)  # (query token, head) pairs of b
        tok = b.to(gl.int64) * q_len + rows // H
        heads = rows % H
        if HAS_POS:
            visible = _visible_keys(q_pos_ptr, tok, seq_len, dcp_size, dcp_rank)
        else:
            visible = rows  # unused

        m_i = gl.full([BH], float("-inf"), gl.float32, layout=row_l)
        l_i = gl.zeros([BH], gl.float32, layout=row_l)
        acc = gl.zeros([BH, HALF], gl.float32, layout=o_layout)
        s0 = gl.zeros([BH, BLOCK_N], gl.float32, layout=s_layout)
        _wait_full(q_full.index(0), 0)
        # 0 at run time, unknown to the compiler: indexing q and this warpgroup's stage with it
        # keeps QK^T's 72 operand descriptors (loop-invariant otherwise) from being hoisted out
        # of the loop and held in 144 registers, which spilled
        opaque0 = (seq_len < 0).to(gl.int32)
        for i in range(n_pairs):
            phase = i & 1
            z = i & opaque0
            # QK^T of this warpgroup's tile: its own half first (released and refilled earliest)
            _wait_full(full_e.index(W), phase)
            s_tok = warpgroup_mma(q_own.index(z), h_own.index(W + z).permute((1, 0)), s0, use_acc=False,
                                  is_async=True)
            _wait_full(full_l.index(W), phase)
            s_tok = warpgroup_mma(q_oth.index(z), h_oth.index(W + z).permute((1, 0)), s_tok, is_async=True)
            s_tok = warpgroup_mma(q_pe.index(z), rp.index(W + z).permute((1, 0)), s_tok, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
            offs_n = start + (2 * i + W) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            valid = offs_n[None, :] < end
            if HAS_POS:
                valid = valid & (offs_n[None, :] < visible[:, None])
            s = gl.where(valid, s * qk_scale_log2, float("-inf"))
            if W == 0:
                m_new = _new_max(m_i, s, LAZY)
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: p = 0
                a0 = gl.exp2(m_i - m_use)
                p = gl.exp2(s - m_use[:, None])
                m_x0.store(m_new)
                a_x0.store(a0)
                gl.thread_barrier()
                mbarrier.arrive(bar_m.index(0), count=1)
                l_i = l_i * a0 + gl.sum(p, axis=1)
                acc = _rescale(acc, a0, orow_l, LAZY)
                p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
                o_tok = warpgroup_mma(p_op, h_own.index(0), acc, is_async=True)  # P0 V0_L
                mbarrier.wait(bar_m.index(1), phase)  # WG1's m1, a1, and P1 in rp[1]
                m_i = m_x1.load(row_l)
                a1 = a_x1.load(row_l)
                rp.index(0).store((p * a1[:, None]).to(gl.bfloat16))  # P0 at m1, for WG1's V0_R
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(bar_p.index(0), count=1)
                acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=[o_tok, p_op])
                _release(empty_e.index(0))  # h0 of stage 0
                l_i = l_i * a1
                acc = _rescale(acc, a1, orow_l, LAZY)
                fence_async_shared()
                o_tok = warpgroup_mma(rp.index(1), h_own.index(1), acc, is_async=True)  # P1 V1_L
                acc = warpgroup_mma_wait(num_outstanding=0, deps=[o_tok])
                _release(empty_l.index(1))  # h0 and the rope / P slot of stage 1
            else:
                mbarrier.wait(bar_m.index(0), phase)  # WG0's m0 and a0
                m0 = m_x0.load(row_l)
                a0 = a_x0.load(row_l)
                m_new = _new_max(m0, s, LAZY)
                m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
                a1 = gl.exp2(m0 - m_use)
                p = gl.exp2(s - m_use[:, None])
                gl.thread_barrier()  # every warp's QK^T has read the rope rows that P1 overwrites
                rp.index(1).store(p.to(gl.bfloat16))  # P1 for WG0's V1_L
                fence_async_shared()
                m_x1.store(m_new)
                a_x1.store(a1)
                gl.thread_barrier()
                mbarrier.arrive(bar_m.index(1), count=1)
                f = a0 * a1
                l_i = l_i * f + gl.sum(p, axis=1)
                acc = _rescale(acc, f, orow_l, LAZY)
                p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
                # tile 2i's product first: its release lets the producer refill the part of stage 0
                # that WG0's next QK^T waits for, the one copy on the pair-to-pair critical path
                mbarrier.wait(bar_p.index(0), phase)  # P0 a1 in rp[0]
                fence_async_shared()
                o_tok = warpgroup_mma(rp.index(0), h_own.index(0), acc, is_async=True)  # (P0 a1) V0_R
                acc = warpgroup_mma_wait(num_outstanding=0, deps=[o_tok])
                _release(empty_l.index(0))  # h1 and the rope / P slot of stage 0
                o_tok = warpgroup_mma(p_op, h_own.index(1), acc, is_async=True)  # P1 V1_R
                acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=[o_tok, p_op])
                _release(empty_e.index(1))  # h1 of stage 1
                m_i = m_new

        # l = l_0 + l_1 (the same sum in both warpgroups: fp32 addition commutes)
        l_own.store(l_i)
        gl.thread_barrier()
        mbarrier.arrive(bar_l.index(W), count=1)
        mbarrier.wait(bar_l.index(1 - W), 0)
        l_i = l_i + l_oth.load(row_l)
        _store_outputs(acc, m_i, l_i, o_ptr, lse_ptr, pid_h, b, split, start, seq_len, H, q_len, tok, heads,
                       stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh, W, DIRECT, o_layout)

    @gluon.jit(do_not_specialize=["num_splits", "stride_btb"])
    def _mla_decode_seesaw_kernel(q_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, q_pos_ptr, o_ptr,
                                  lse_ptr, qk_scale_log2, H, num_splits, q_len, dcp_size, dcp_rank,
                                  stride_qb, stride_qh, stride_kvb, stride_kvs, stride_btb,
                                  stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh,
                                  PAGE: gl.constexpr, BLOCK_N: gl.constexpr, DIRECT: gl.constexpr,
                                  HAS_POS: gl.constexpr, LAZY: gl.constexpr, WORKER_REGS: gl.constexpr,
                                  PROD_REGS: gl.constexpr):
        BH: gl.constexpr = 64
        HALF: gl.constexpr = 256
        half_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, HALF], gl.bfloat16)
        rope_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, BH], gl.bfloat16)
        q_lat0 = gl.allocate_shared_memory(gl.bfloat16, [1, BH, HALF], half_l)  # [1, ...]: see opaque0
        q_lat1 = gl.allocate_shared_memory(gl.bfloat16, [1, BH, HALF], half_l)
        q_pe = gl.allocate_shared_memory(gl.bfloat16, [1, BH, BH], rope_l)
        h0 = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, HALF], half_l)
        h1 = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, HALF], half_l)
        rp = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, BH], rope_l)  # rope, then P
        # per warpgroup W: the row max after its tile of the pair (m_xW), its rescale factor (a_xW)
        # and, at the end, its row sums (l_xW)
        x_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        m_x0 = gl.allocate_shared_memory(gl.float32, [BH], x_l)
        m_x1 = gl.allocate_shared_memory(gl.float32, [BH], x_l)
        a_x0 = gl.allocate_shared_memory(gl.float32, [BH], x_l)
        a_x1 = gl.allocate_shared_memory(gl.float32, [BH], x_l)
        l_x0 = gl.allocate_shared_memory(gl.float32, [BH], x_l)
        l_x1 = gl.allocate_shared_memory(gl.float32, [BH], x_l)
        bar_l_: gl.constexpr = mbarrier.MBarrierLayout()
        q_full = gl.allocate_shared_memory(gl.int64, [1, 1], bar_l_)
        full_e = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l_)
        full_l = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l_)
        empty_e = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l_)
        empty_l = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l_)
        bar_m = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l_)
        bar_p = gl.allocate_shared_memory(gl.int64, [1, 1], bar_l_)
        bar_l = gl.allocate_shared_memory(gl.int64, [2, 1], bar_l_)
        mbarrier.init(q_full.index(0), count=128)  # the producer's threads, one cp.async arrive each
        mbarrier.init(bar_p.index(0), count=1)
        for s in gl.static_range(2):
            mbarrier.init(full_e.index(s), count=128)
            mbarrier.init(full_l.index(s), count=128)
            mbarrier.init(empty_e.index(s), count=1)
            mbarrier.init(empty_l.index(s), count=1)
            mbarrier.init(bar_m.index(s), count=1)
            mbarrier.init(bar_l.index(s), count=1)

        # the frontend takes the partitions only as literal lists: the two compute ones are spelled twice
        gl.warp_specialize([
            (_seesaw_wg, (q_pos_ptr, seq_lens_ptr, block_table_ptr, o_ptr, lse_ptr, qk_scale_log2, H, num_splits,
                          q_len, dcp_size, dcp_rank, stride_btb, stride_ob, stride_os, stride_oh,
                          stride_lb, stride_ls, stride_lh,
                          q_lat0, q_lat1, q_pe, h0, h1, rp, q_full, full_e, full_l, empty_e, empty_l,
                          m_x0, m_x1, a_x0, a_x1, l_x0, l_x1, bar_m, bar_p, bar_l, 0, BLOCK_N, DIRECT,
                          HAS_POS, LAZY)),
            (_seesaw_wg, (q_pos_ptr, seq_lens_ptr, block_table_ptr, o_ptr, lse_ptr, qk_scale_log2, H, num_splits,
                          q_len, dcp_size, dcp_rank, stride_btb, stride_ob, stride_os, stride_oh,
                          stride_lb, stride_ls, stride_lh,
                          q_lat1, q_lat0, q_pe, h1, h0, rp, q_full, full_e, full_l, empty_e, empty_l,
                          m_x0, m_x1, a_x0, a_x1, l_x1, l_x0, bar_m, bar_p, bar_l, 1, BLOCK_N, DIRECT,
                          HAS_POS, LAZY)),
            (_seesaw_producer, (q_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, H, num_splits, q_len,
                                stride_qb, stride_qh, stride_kvb, stride_kvs, stride_btb,
                                q_lat0, q_lat1, q_pe, h0, h1, rp, q_full, full_e, full_l, empty_e, empty_l,
                                PAGE, BLOCK_N)),
        ], [4, 4], [WORKER_REGS, PROD_REGS])
