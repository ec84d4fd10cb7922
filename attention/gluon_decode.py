"""Paged split-KV MLA decode for many query rows on Hopper's tensor cores, in Gluon.

Same contract as `attention.triton_decode.mla_decode` (notation in its docstring, DESIGN.md §4):
q `[B*q_len, H, 576]` = `[q_lat (512) ‖ q_pe (64)]`, paged cache `[NB, page, 576]` = `[c ‖ k_pe]`,
o = softmax(q·[c ‖ k_pe] * scale) @ c in q's dtype `[T, H, 512]`, lse (natural log) fp32 `[T, H]`;
splits merged by `triton_decode.reduce_splits`. Scope: bf16 q and cache, q_len * H a
multiple of 64, the DeepSeek widths 512 + 64, sm_90 only, written against Triton 3.6's Gluon.
The engine's decodes of 64+ heads per rank run on the Gluon decode by default where all of that
fits (the kernel plan's decode_wgmma_min_heads; attention/gluon_decode_plan.py
`engine_fit_problem`), in the seesaw schedule of attention/gluon_seesaw.py (`SEESAW`, the plan's
decode_wgmma_seesaw, faster at 32+ sequences); this module's lockstep schedule below runs with
decode_wgmma_seesaw=0. `bench_mla_decode.py --impl gluon` times it.

Design. One program = 64 query rows (a wgmma's M) x one split of one sequence, two warpgroups
as two warp-specialised partitions of 4 warps each, both running `_wg_partition` with W = 0 or 1.
Warpgroup W owns a fixed slice of the 576 columns: latent columns [256 W, 256 W + 256) and rope
columns [512 + 32 W, 512 + 32 W + 32). For each tile of BLOCK_N = 32 cache rows it
- loads its own column slice of the tile (cp.async, per-row addresses from the block table),
- computes its partial scores q[:, slice] @ tile[:, slice]^T (wgmma m64n32: K = 256 with q's
  latent slice from shared memory, K = 32 with its rope slice from registers), exchanges the
  64 x 32 fp32 partial with the other warpgroup through shared memory (mbarriers) and adds: both
  then hold the same scores (fp32 addition is commutative, so bit-equal), run the same online
  softmax and hold the same P, m and l;
- accumulates O[:, its 256 latent columns] += P @ tile[:, its latent columns] (wgmma m64n256,
  P from registers).
So each tile is read once per program, by the warpgroup that needs it, no FLOP is done twice,
the only cross-warpgroup traffic is 8 KB of partial scores each way per tile, and no warpgroup
waits for the other's loads (with `producer`, below, both wait for the producer's). Per iteration
j a warpgroup issues QK^T(j+1), rescales O by alpha_j and issues the loads of tile j+STAGES-1
(without the producer) while it runs, queues PV(j) behind it, then exchanges and
softmaxes tile j+1 while PV(j) runs: the tensor cores wait only for the tile's arrival and for
whatever part of the exchange + softmax is longer than PV. alpha_j goes through shared memory
(64 floats) so that ptxas cannot hoist the 128 rescale multiplies above the QK^T issue. With
`lazy_rescale` the running max moves only when a row's tile max passes it by more than 2^8
(p <= 256 meanwhile), and the multiplies are skipped when no row of the warpgroup moved (one
cross-warp max per tile decides); off by default (GluonDecodeConfig.lazy_rescale).

With `GluonDecodeConfig.producer` (opt-in) a third warpgroup of 4 warps (`_producer_partition`, 64
registers a thread) issues every copy, q's latent part and both column halves of every tile, and
publishes each tile on a `full` mbarrier after waiting for and fencing its copies; the compute
warpgroups wait on that barrier instead of on their own copy groups and release each tile's stage
on an `empty` barrier. Their KV-tile loop drops from ~650 to ~455 instructions a warp; the kernel
is bound by those instructions' latencies (docs/kernel_notes.md, "Gluon kernel for many heads").

Why this split and not the alternatives: docs/kernel_notes.md, "Gluon kernel for many heads".
Shared memory, by default: q's latent part 64 KB + 4 stages x 36 KB + one 8 KB
exchange slot each way + alpha = 225 KB, so a tile's loads are issued two tiles before it is used
(`GluonDecodeConfig(num_stages=3, xbuf=2, q_pe_regs=False)`: 212 KB, one tile early).
"""

from __future__ import annotations

import torch

from attention.decode_config import LAZY_TAU
from attention.gluon_decode_plan import (BLOCK_H, LKV, OPTION, SEESAW, SMEM_LIMIT, GluonDecodeConfig,
                                         plan_splits, validate_inputs)

__all__ = ["GluonDecodeConfig", "SEESAW", "SMEM_LIMIT", "check_gluon_available", "mla_decode_wgmma",
           "plan_splits", "validate_inputs"]
from attention.triton_decode import LOG2E, reduce_splits, split_outputs
from common.launch_settings import sm_count

try:  # Gluon is Triton's experimental dialect: present in Triton >= 3.4, its API moves
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from attention.gluon_copies import (_load_tile, _producer_partition, _split_bounds, _store_outputs,
                                       _tile_ids, _visible_keys, _wait_tile)
    from attention.gluon_seesaw import _mla_decode_seesaw_kernel
    _GLUON_ERROR: Exception | None = None
except Exception as exc:  # noqa: BLE001 - reported by check_gluon_available when the path is used
    _GLUON_ERROR = exc

def check_gluon_available(device: torch.device) -> None:
    """Raise naming the option when this path cannot run: no Gluon, no CUDA, not sm_90."""
    if _GLUON_ERROR is not None:
        raise RuntimeError(f"{OPTION} needs Triton's Gluon dialect, whose import failed: "
                           f"{_GLUON_ERROR!r}; use the Triton decode (the default) instead")
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"{OPTION} runs on CUDA sm_90 only (got device {device}); "
                           "use the Triton decode (the default) instead")
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        raise RuntimeError(f"{OPTION} needs an sm_90 GPU (Hopper wgmma), got sm_{cap[0]}{cap[1]}; "
                           "use the Triton decode (the default) instead")


if _GLUON_ERROR is None:
    _TAU = gl.constexpr(LAZY_TAU)

    @gluon.jit
    def _exchange(s_own, x_own, x_other, full_own, empty_own, full_other, empty_other, j,
                  XBUF: gl.constexpr, s_layout: gl.constexpr):
        """Publish this warpgroup's partial scores of tile j and add the other's."""
        slot = j % XBUF
        phase = (j // XBUF) & 1
        mbarrier.wait(empty_own.index(slot), phase ^ 1)  # the other has read this slot's last use
        gl.static_assert(gl.bank_conflicts(s_own.type, x_own.index(slot).type) == 0,
                         "the exchange slots' layout must store the accumulator without conflicts")
        x_own.index(slot).store(s_own)
        gl.thread_barrier()  # all of this warpgroup's stores before the one arrive
        mbarrier.arrive(full_own.index(slot), count=1)
        mbarrier.wait(full_other.index(slot), phase)
        s_other = x_other.index(slot).load(s_layout)
        gl.thread_barrier()  # all of this warpgroup's loads before the slot is handed back
        mbarrier.arrive(empty_other.index(slot), count=1)
        return s_own + s_other

    @gluon.jit
    def _softmax(s, m_i, l_i, t0, end, visible, qk_scale_log2,
                 HAS_POS: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr,
                 LAZY: gl.constexpr):
        """Online softmax step over one tile's summed scores (log2 domain): new m, l, p, alpha,
        and whether any row's m moved (LAZY: m moves only when the tile's max passes it by more
        than LAZY_TAU, so p <= 2^LAZY_TAU; else whenever it grows)."""
        offs_n = t0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        valid = offs_n[None, :] < end
        if HAS_POS:
            valid = valid & (offs_n[None, :] < visible[:, None])
        s = gl.where(valid, s * qk_scale_log2, float("-inf"))
        m_cand = gl.maximum(m_i, gl.max(s, axis=1))
        if LAZY:  # m_i = -inf: any finite max moves it
            moved = m_cand > m_i + _TAU
            m_new = gl.where(moved, m_cand, m_i)
            any_moved = gl.max(moved.to(gl.int32), axis=0)  # one decision for the warpgroup
        else:
            m_new = m_cand
            any_moved = 1
        # a row that has seen no visible key keeps m = -inf: shift by 0 instead (p = 0)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)  # 1 exactly where m did not move (0 where no key yet)
        p = gl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return m_new, l_i, p, alpha, any_moved

    @gluon.jit
    def _wg_partition(q_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, q_pos_ptr, o_ptr, lse_ptr,
                      qk_scale_log2, H, num_splits, q_len, dcp_size, dcp_rank,
                      stride_qb, stride_qh, stride_kvb, stride_kvs, stride_btb,
                      stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh,
                      q_lat_s, q_pe_s, c_s, r_s, x_own, x_other, a_s,
                      full_own, empty_own, full_other, empty_other, kv_full, kv_empty,
                      W: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                      STAGES: gl.constexpr, XBUF: gl.constexpr, DIRECT: gl.constexpr,
                      HAS_POS: gl.constexpr, QPE_REGS: gl.constexpr, LAZY: gl.constexpr,
                      PROD: gl.constexpr):
        HALF: gl.constexpr = 256
        RH: gl.constexpr = 32
        LKV_: gl.constexpr = 512
        BH: gl.constexpr = 64
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HALF, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        ld_c: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        ld_r: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)

        pid_h = gl.program_id(0)
        split = gl.program_id(1)
        b = gl.program_id(2)
        seq_len, start, end, n_tiles, bt_row = _split_bounds(seq_lens_ptr, block_table_ptr, stride_btb, b,
                                                             split, num_splits, BLOCK_N)

        # this warpgroup's slice of q: latent [W*HALF, +HALF), rope [LKV + W*RH, +RH)
        rq_c = pid_h * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, ld_c))
        q_row_c = (b.to(gl.int64) * q_len + rq_c // H) * stride_qb + (rq_c % H) * stride_qh
        cq_c = W * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, ld_c))
        if not PROD:
            async_copy.async_copy_global_to_shared(q_lat_s, q_ptr + q_row_c[:, None] + cq_c[None, :])
        if QPE_REGS:  # rope slice of q held in registers as QK^T's A operand (frees 8 KB)
            qpe_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
            rq_r = pid_h * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, qpe_l))
            q_row_r = (b.to(gl.int64) * q_len + rq_r // H) * stride_qb + (rq_r % H) * stride_qh
            cq_r = LKV_ + W * RH + gl.arange(0, RH, layout=gl.SliceLayout(0, qpe_l))
            q_pe_a = gl.load(q_ptr + q_row_r[:, None] + cq_r[None, :])
        else:
            rq_r = pid_h * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, ld_r))
            q_row_r = (b.to(gl.int64) * q_len + rq_r // H) * stride_qb + (rq_r % H) * stride_qh
            cq_r = LKV_ + W * RH + gl.arange(0, RH, layout=gl.SliceLayout(0, ld_r))
            async_copy.async_copy_global_to_shared(q_pe_s, q_ptr + q_row_r[:, None] + cq_r[None, :])
            q_pe_a = q_pe_s
        if not PROD:
            # tiles 0 .. STAGES-2 ahead; one commit group per tile (q joins tile 0's)
            for t in gl.static_range(STAGES - 1):
                ids_a, ids_b = _tile_ids(bt_row, start + t * BLOCK_N, end, PAGE, BLOCK_N)
                _load_tile(kv_ptr, ids_a, ids_b, c_s.index(t), r_s.index(t), start + t * BLOCK_N, end,
                           stride_kvb, stride_kvs, W, PAGE, HALF, RH, LKV_, BLOCK_N)
                async_copy.commit_group()
            # block ids one refill ahead: their load's latency passes under an iteration's work
            ids_a, ids_b = _tile_ids(bt_row, start + (STAGES - 1) * BLOCK_N, end, PAGE, BLOCK_N)

        rows = pid_h * BH + gl.arange(0, BH, layout=row_l)  # (query token, head) pairs of b
        tok = b.to(gl.int64) * q_len + rows // H
        heads = rows % H
        if HAS_POS:
            visible = _visible_keys(q_pos_ptr, tok, seq_len, dcp_size, dcp_rank)
        else:
            visible = rows  # unused

        # tile 0: scores, exchange, softmax (alpha_0 = 0 scales the empty acc)
        if PROD:
            mbarrier.wait(kv_full.index(0), 0)
        else:
            _wait_tile(STAGES - 2)
        s0 = gl.zeros([BH, BLOCK_N], gl.float32, layout=s_layout)
        s_tok = warpgroup_mma(q_lat_s, c_s.index(0).permute((1, 0)), s0, use_acc=False, is_async=True)
        s_tok = warpgroup_mma(q_pe_a, r_s.index(0).permute((1, 0)), s_tok, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])
        s = _exchange(s, x_own, x_other, full_own, empty_own, full_other, empty_other, 0,
                      XBUF, s_layout)
        m_i = gl.full([BH], float("-inf"), gl.float32, layout=row_l)
        l_i = gl.zeros([BH], gl.float32, layout=row_l)
        m_i, l_i, p, alpha, moved = _softmax(s, m_i, l_i, start, end, visible, qk_scale_log2,
                                             HAS_POS, BLOCK_N, s_layout, LAZY)
        p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        a_s.store(alpha)
        acc = gl.zeros([BH, HALF], gl.float32, layout=o_layout)

        # At iteration j: P_j and alpha_j (tile j's softmax) are ready, acc holds tiles < j at
        # tile j-1's max. QK^T(j+1) is issued first; the rescale by alpha_j and the loads of tile
        # j+STAGES-1 run under it; PV(j) queues behind it; the exchange and softmax of tile j+1
        # run under PV(j).
        for j in range(0, n_tiles - 1):
            if PROD:
                mbarrier.wait(kv_full.index((j + 1) % STAGES), ((j + 1) // STAGES) & 1)
            else:
                _wait_tile(STAGES - 3)  # tile j + 1 is in
            k1 = (j + 1) % STAGES
            s_tok = warpgroup_mma(q_lat_s, c_s.index(k1).permute((1, 0)), s0, use_acc=False,
                                  is_async=True)
            s_tok = warpgroup_mma(q_pe_a, r_s.index(k1).permute((1, 0)), s_tok, is_async=True)
            # alpha_j read back from shared memory after a barrier: ptxas cannot hoist the 128
            # multiplies of the rescale above the barrier, so they run while QK^T(j+1) does
            # (from registers it schedules them before the wgmma issue, tensor cores idle).
            # The barrier also orders the refill below after every warp's wait for PV(j-1).
            gl.thread_barrier()
            if LAZY:
                if moved > 0:  # rows whose m stayed keep alpha = 1 (or 0 with acc 0): skip
                    acc = acc * a_s.load(gl.SliceLayout(1, o_layout))[:, None]
            else:
                acc = acc * a_s.load(gl.SliceLayout(1, o_layout))[:, None]
            if PROD:  # release tile j-1's stage to the producer
                mbarrier.arrive(kv_empty.index((j + STAGES - 1) % STAGES), count=1, pred=j >= 1)
            else:  # refill the stage of tile j-1
                nxt = j + STAGES - 1
                _load_tile(kv_ptr, ids_a, ids_b, c_s.index(nxt % STAGES), r_s.index(nxt % STAGES),
                           start + nxt * BLOCK_N, end, stride_kvb, stride_kvs,
                           W, PAGE, HALF, RH, LKV_, BLOCK_N)
                async_copy.commit_group()
                ids_a, ids_b = _tile_ids(bt_row, start + (nxt + 1) * BLOCK_N, end, PAGE, BLOCK_N)
            o_tok = warpgroup_mma(p_op, c_s.index(j % STAGES), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok])  # QK^T(j+1) done, PV(j) runs
            s = _exchange(s, x_own, x_other, full_own, empty_own, full_other, empty_other, j + 1,
                          XBUF, s_layout)
            m_i, l_i, p, alpha, moved = _softmax(s, m_i, l_i, start + (j + 1) * BLOCK_N, end,
                                                 visible, qk_scale_log2, HAS_POS, BLOCK_N,
                                                 s_layout, LAZY)
            a_s.store(alpha)
            acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=[o_tok, p_op])
            p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)

        if moved > 0:
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        last = (n_tiles - 1) % STAGES
        o_tok = warpgroup_mma(p_op, c_s.index(last), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=[o_tok, p_op])
        async_copy.wait_group(0)  # no copy may land after the program ends

        _store_outputs(acc, m_i, l_i, o_ptr, lse_ptr, pid_h, b, split, start, seq_len, H, q_len, tok, heads,
                       stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh, W, DIRECT, o_layout)

    @gluon.jit(do_not_specialize=["num_splits", "stride_btb"])
    def _mla_decode_wgmma_kernel(q_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, q_pos_ptr, o_ptr,
                                 lse_ptr, qk_scale_log2, H, num_splits, q_len, dcp_size, dcp_rank,
                                 stride_qb, stride_qh, stride_kvb, stride_kvs, stride_btb,
                                 stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh,
                                 PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                                 XBUF: gl.constexpr, DIRECT: gl.constexpr, HAS_POS: gl.constexpr,
                                 QPE_REGS: gl.constexpr, LAZY: gl.constexpr, PROD: gl.constexpr,
                                 WORKER_REGS: gl.constexpr, PROD_REGS: gl.constexpr):
        BH: gl.constexpr = 64
        HALF: gl.constexpr = 256
        RH: gl.constexpr = 32
        q_lat_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, HALF], gl.bfloat16)
        QPE_ROWS: gl.constexpr = 8 if QPE_REGS else BH  # a token buffer when q_pe is in registers
        q_pe_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([QPE_ROWS, RH], gl.bfloat16)
        c_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF], gl.bfloat16)
        r_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, RH], gl.bfloat16)
        # exchange slots: 8-column groups of a row permuted by the row (32-column rows: by row % 4;
        # 16-column rows: by row // 2 % 2), so the wgmma accumulator layout stores and loads
        # without bank conflicts (checked in _exchange)
        XPP: gl.constexpr = 1 if BLOCK_N == 32 else 2
        XMP: gl.constexpr = 4 if BLOCK_N == 32 else 2
        x_l: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=XPP, max_phase=XMP, order=[1, 0])
        q_lat0 = gl.allocate_shared_memory(gl.bfloat16, [BH, HALF], q_lat_l)
        q_lat1 = gl.allocate_shared_memory(gl.bfloat16, [BH, HALF], q_lat_l)
        q_pe0 = gl.allocate_shared_memory(gl.bfloat16, [QPE_ROWS, RH], q_pe_l)
        q_pe1 = gl.allocate_shared_memory(gl.bfloat16, [QPE_ROWS, RH], q_pe_l)
        c0 = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HALF], c_l)
        c1 = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HALF], c_l)
        r0 = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, RH], r_l)
        r1 = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, RH], r_l)
        x0 = gl.allocate_shared_memory(gl.float32, [XBUF, BH, BLOCK_N], x_l)
        x1 = gl.allocate_shared_memory(gl.float32, [XBUF, BH, BLOCK_N], x_l)
        a_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        a0 = gl.allocate_shared_memory(gl.float32, [BH], a_l)  # each warpgroup's alpha, see the loop
        a1 = gl.allocate_shared_memory(gl.float32, [BH], a_l)
        full0 = gl.allocate_shared_memory(gl.int64, [XBUF, 1], mbarrier.MBarrierLayout())
        empty0 = gl.allocate_shared_memory(gl.int64, [XBUF, 1], mbarrier.MBarrierLayout())
        full1 = gl.allocate_shared_memory(gl.int64, [XBUF, 1], mbarrier.MBarrierLayout())
        empty1 = gl.allocate_shared_memory(gl.int64, [XBUF, 1], mbarrier.MBarrierLayout())
        kv_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(kv_full.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)
        for i in gl.static_range(XBUF):
            mbarrier.init(full0.index(i), count=1)
            mbarrier.init(empty0.index(i), count=1)
            mbarrier.init(full1.index(i), count=1)
            mbarrier.init(empty1.index(i), count=1)

        # the frontend takes the partitions only as literal lists: the two compute ones are spelled twice
        if PROD:
            gl.warp_specialize([
                (_wg_partition, (q_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, q_pos_ptr, o_ptr, lse_ptr,
                                 qk_scale_log2, H, num_splits, q_len, dcp_size, dcp_rank,
                                 stride_qb, stride_qh, stride_kvb, stride_kvs, stride_btb,
                                 stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh,
                                 q_lat0, q_pe0, c0, r0, x0, x1, a0, full0, empty0, full1, empty1, kv_full, kv_empty,
                                 0, PAGE, BLOCK_N, STAGES, XBUF, DIRECT, HAS_POS, QPE_REGS, LAZY, PROD)),
                (_wg_partition, (q_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, q_pos_ptr, o_ptr, lse_ptr,
                                 qk_scale_log2, H, num_splits, q_len, dcp_size, dcp_rank,
                                 stride_qb, stride_qh, stride_kvb, stride_kvs, stride_btb,
                                 stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh,
                                 q_lat1, q_pe1, c1, r1, x1, x0, a1, full1, empty1, full0, empty0, kv_full, kv_empty,
                                 1, PAGE, BLOCK_N, STAGES, XBUF, DIRECT, HAS_POS, QPE_REGS, LAZY, PROD)),
                (_producer_partition, (q_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, H, num_splits, q_len,
                                       stride_qb, stride_qh, stride_kvb, stride_kvs, stride_btb,
                                       q_lat0, q_lat1, c0, c1, r0, r1, kv_full, kv_empty, PAGE, BLOCK_N, STAGES)),
            ], [4, 4], [WORKER_REGS, PROD_REGS])
        else:
            gl.warp_specialize([
                (_wg_partition, (q_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, q_pos_ptr, o_ptr, lse_ptr,
                                 qk_scale_log2, H, num_splits, q_len, dcp_size, dcp_rank,
                                 stride_qb, stride_qh, stride_kvb, stride_kvs, stride_btb,
                                 stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh,
                                 q_lat0, q_pe0, c0, r0, x0, x1, a0, full0, empty0, full1, empty1, kv_full, kv_empty,
                                 0, PAGE, BLOCK_N, STAGES, XBUF, DIRECT, HAS_POS, QPE_REGS, LAZY, PROD)),
                (_wg_partition, (q_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, q_pos_ptr, o_ptr, lse_ptr,
                                 qk_scale_log2, H, num_splits, q_len, dcp_size, dcp_rank,
                                 stride_qb, stride_qh, stride_kvb, stride_kvs, stride_btb,
                                 stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh,
                                 q_lat1, q_pe1, c1, r1, x1, x0, a1, full1, empty1, full0, empty0, kv_full, kv_empty,
                                 1, PAGE, BLOCK_N, STAGES, XBUF, DIRECT, HAS_POS, QPE_REGS, LAZY, PROD)),
            ], [4], [WORKER_REGS])


def launch_args(q, kv_cache, block_table, seq_lens, q_pos, o, lse, po_strides, plse_strides,
                scale, H, num_splits, q_len, dcp_size, dcp_rank):
    """The kernel's runtime arguments, in order."""
    return (q, kv_cache, block_table, seq_lens, seq_lens if q_pos is None else q_pos, o, lse,
            scale * LOG2E, H, num_splits, q_len, dcp_size, dcp_rank,
            q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
            *po_strides, *plse_strides)


def mla_decode_wgmma(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, kv_lora_rank: int, q_len: int = 1,
                     q_pos: torch.Tensor | None = None, dcp_size: int = 1, dcp_rank: int = 0,
                     num_splits: int | None = None, num_sms: int | None = None,
                     cfg: GluonDecodeConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`triton_decode.mla_decode`'s contract on the Gluon kernel: q [B*q_len, H, 576] ->
    (o [B*q_len, H, 512] in q.dtype, lse [B*q_len, H] fp32). Raises (never falls back) where the
    kernel cannot run; see the module docstring for the scope."""
    cfg = cfg or GluonDecodeConfig()
    validate_inputs(q, kv_cache, block_table, seq_lens, kv_lora_rank, q_len, q_pos, cfg)
    check_gluon_available(q.device)
    T, H, _ = q.shape
    B = T // q_len
    page = kv_cache.shape[1]
    if num_splits is None:
        if num_sms is None:
            num_sms = sm_count(q.device)
        num_splits = plan_splits(B, q_len * H, block_table.shape[1] * page, num_sms, cfg)
    o = torch.empty(T, H, LKV, dtype=q.dtype, device=q.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if B == 0 or H == 0:
        return o, lse
    direct = num_splits == 1
    po, plse, po_strides, plse_strides = split_outputs(o, lse, num_splits)
    grid = ((q_len * H) // BLOCK_H, num_splits, B)
    args = launch_args(q, kv_cache, block_table, seq_lens, q_pos, po, plse, po_strides, plse_strides,
                       scale, H, num_splits, q_len, dcp_size, dcp_rank)
    if cfg.seesaw:  # attention/gluon_seesaw.py
        _mla_decode_seesaw_kernel[grid](*args, PAGE=page, BLOCK_N=cfg.block_n, DIRECT=direct,
                                        HAS_POS=q_pos is not None, LAZY=cfg.lazy_rescale, WORKER_REGS=cfg.worker_regs,
                                        PROD_REGS=cfg.producer_regs, num_warps=4)
    else:
        _mla_decode_wgmma_kernel[grid](
            *args, PAGE=page, BLOCK_N=cfg.block_n, STAGES=cfg.num_stages, XBUF=cfg.xbuf, DIRECT=direct,
            HAS_POS=q_pos is not None, QPE_REGS=cfg.q_pe_regs, LAZY=cfg.lazy_rescale, PROD=cfg.producer,
            WORKER_REGS=cfg.worker_regs, PROD_REGS=cfg.producer_regs, num_warps=4)
    if not direct:
        reduce_splits(po, plse, o, lse, num_splits, po_strides, plse_strides)
    return o, lse
