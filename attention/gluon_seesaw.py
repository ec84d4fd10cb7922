"""Paged split-KV MLA decode for many query rows, seesaw schedule, in Gluon
(`GluonDecodeConfig(seesaw=True)`, through `gluon_decode.mla_decode_wgmma`).

Contract, scope, per-program work (64 query rows x one split of one sequence), the two
warpgroups' column halves of every cache tile and their halves of O are those of
attention/gluon_decode.py. What differs is who computes the scores. There each warpgroup
computes the partial scores of its column half of every tile and the two swap them (8 KB of fp32
each way per tile) and then both run the same softmax, in lockstep, so both are in their softmax
at the same time and the tensor cores wait. Here tile t belongs to warpgroup t % 2:

- its owner computes the whole of QK^T (all 576 columns: its own half of the tile and the
  other's, both halves of q), runs the online softmax from the running max and sum that the
  other warpgroup handed over with tile t-1, and hands over P (bf16), m, l and alpha through its
  shared-memory slot; it then accumulates its half of O with P from registers;
- the other warpgroup first issues QK^T of its own next tile t+1, then waits for the hand-over,
  rescales its half of O by alpha and accumulates P @ V with P from the slot (shared memory).

So one warpgroup's softmax runs while the other's QK^T does, each warpgroup does half the
softmax work of the lockstep kernel, and no partial scores cross. The chain of running maxima
passes from one warpgroup to the other once per tile.

Cache tiles are shared: each warpgroup loads its column half (cp.async, as the lockstep
kernel), waits for its own copies, fences them for wgmma and arrives on the stage's `full`
barrier (count 2); whoever reads the other half waits on that barrier. Each warpgroup arrives on
the stage's `empty` barrier (count 2) once it is done with a tile, and a stage is refilled only
after both have. Nothing is in flight across the loop's back edge (ptxas serialises every wgmma of
a loop that carries one whose accumulator it reads). The QK^T issued for the tile after the last
reads rows that were zero-filled (masked copies) and is discarded.

Shared memory with 4 stages: q's latent part 64 KB, 4 x 36 KB of tiles, two 4 KB P slots,
m / l / alpha slots: 218 KB. q's rope part is held in registers by both warpgroups.
"""

from __future__ import annotations

from attention.gluon_decode_plan import LKV

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared,
                                                                  mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from attention.gluon_decode import _load_tile, _softmax, _tile_ids
    _ERROR: Exception | None = None
except Exception as exc:  # noqa: BLE001 - gluon_decode.check_gluon_available reports it
    _ERROR = exc

__all__ = ["seesaw_kernel"]


if _ERROR is None:
    @gluon.jit
    def _signal_tile(full, t, STAGES: gl.constexpr, OUTSTANDING: gl.constexpr):
        """This warpgroup's copies of tile t have landed and are fenced for wgmma: arrive on the
        stage's `full` barrier (OUTSTANDING: the copy groups committed after tile t's)."""
        async_copy.wait_group(OUTSTANDING)
        fence_async_shared()  # cp.async writes (generic proxy) before wgmma reads (async proxy)
        gl.thread_barrier()  # every thread's copies before the one arrive
        mbarrier.arrive(full.index(t % STAGES), count=1)

    @gluon.jit
    def _wait_full(full, t, STAGES: gl.constexpr):
        """Both halves of tile t are in shared memory."""
        mbarrier.wait(full.index(t % STAGES), (t // STAGES) & 1)
        fence_async_shared()

    @gluon.jit
    def _qk_whole(q_lat0, q_lat1, q_pe0, q_pe1, c0, c1, r0, r1, k, s0):
        """Issue the whole QK^T of the tile in stage k (both column halves), asynchronously."""
        s = warpgroup_mma(q_lat0, c0.index(k).permute((1, 0)), s0, use_acc=False, is_async=True)
        s = warpgroup_mma(q_lat1, c1.index(k).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(q_pe0, r0.index(k).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(q_pe1, r1.index(k).permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _seesaw_partition(q_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, q_pos_ptr, o_ptr, lse_ptr,
                          qk_scale_log2, H, num_splits, q_len, dcp_size, dcp_rank,
                          stride_qb, stride_qh, stride_kvb, stride_kvs, stride_btb,
                          stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh,
                          q_lat0, q_lat1, c0, c1, r0, r1, q_own, c_own, r_own, p_s, ml_s,
                          full, empty, hf_full, hf_empty,
                          W: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                          STAGES: gl.constexpr, DIRECT: gl.constexpr, HAS_POS: gl.constexpr):
        HALF: gl.constexpr = 256
        RH: gl.constexpr = 32
        LKV_: gl.constexpr = 512
        BH: gl.constexpr = 64
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HALF, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        qpe_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        ld_c: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        alpha_l: gl.constexpr = gl.SliceLayout(1, o_layout)

        pid_h = gl.program_id(0)
        split = gl.program_id(1)
        b = gl.program_id(2)
        seq_len = gl.load(seq_lens_ptr + b).to(gl.int32)
        # split boundaries on BLOCK_N multiples: only a sequence's last tile is partial
        per_split = gl.cdiv(gl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = gl.minimum(start + per_split, seq_len)
        # an empty split still runs one all-masked tile (no memory read): lse -inf, o 0
        n_tiles = gl.maximum(gl.cdiv(gl.maximum(end - start, 0), BLOCK_N), 1)
        bt_row = block_table_ptr + b.to(gl.int64) * stride_btb

        # this warpgroup's latent half of q into shared memory (both read both halves); both
        # rope halves of q into registers, QK^T's A operand
        rq_c = pid_h * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, ld_c))
        q_row_c = (b.to(gl.int64) * q_len + rq_c // H) * stride_qb + (rq_c % H) * stride_qh
        cq_c = W * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, ld_c))
        async_copy.async_copy_global_to_shared(q_own, q_ptr + q_row_c[:, None] + cq_c[None, :])
        rq_r = pid_h * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, qpe_l))
        q_row_r = (b.to(gl.int64) * q_len + rq_r // H) * stride_qb + (rq_r % H) * stride_qh
        cq_r = LKV_ + gl.arange(0, RH, layout=gl.SliceLayout(0, qpe_l))
        q_pe0 = gl.load(q_ptr + q_row_r[:, None] + cq_r[None, :])
        q_pe1 = gl.load(q_ptr + q_row_r[:, None] + (cq_r + RH)[None, :])
        # tiles 0 .. STAGES-2; one commit group per tile (q joins tile 0's)
        for t in gl.static_range(STAGES - 1):
            ids_a, ids_b = _tile_ids(bt_row, start + t * BLOCK_N, end, PAGE, BLOCK_N)
            _load_tile(kv_ptr, ids_a, ids_b, c_own.index(t), r_own.index(t), start + t * BLOCK_N, end,
                       stride_kvb, stride_kvs, W, PAGE, HALF, RH, LKV_, BLOCK_N)
            async_copy.commit_group()
        ids_a, ids_b = _tile_ids(bt_row, start + (STAGES - 1) * BLOCK_N, end, PAGE, BLOCK_N)
        _signal_tile(full, 0, STAGES, STAGES - 2)

        rows = pid_h * BH + gl.arange(0, BH, layout=row_l)  # (query token, head) pairs of b
        tok = b.to(gl.int64) * q_len + rows // H
        heads = rows % H
        if HAS_POS:  # keys visible to each row: local_len(p + 1) of its token's position p
            p1 = gl.load(q_pos_ptr + tok).to(gl.int32) + 1
            visible = gl.minimum(p1 // dcp_size + (dcp_rank < p1 % dcp_size).to(gl.int32), seq_len)
        else:
            visible = rows  # unused

        s0 = gl.zeros([BH, BLOCK_N], gl.float32, layout=s_layout)
        acc = gl.zeros([BH, HALF], gl.float32, layout=o_layout)
        m_i = gl.full([BH], float("-inf"), gl.float32, layout=row_l)
        l_i = gl.zeros([BH], gl.float32, layout=row_l)
        s_cur = s0  # the scores of this warpgroup's next own tile
        if W == 0:  # tile 0 is warpgroup 0's
            _wait_full(full, 0, STAGES)
            s_tok = _qk_whole(q_lat0, q_lat1, q_pe0, q_pe1, c0, c1, r0, r1, 0, s0)
            s_cur = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok])

        for t in range(0, n_tiles):
            k = t % STAGES
            # this warpgroup's half of tile t+1 (committed STAGES-3 groups before the latest)
            _signal_tile(full, t + 1, STAGES, STAGES - 3)
            if t % 2 == W:  # own tile: softmax, hand-over, PV with P from registers
                m_i, l_i, p, alpha, moved = _softmax(s_cur, m_i, l_i, start + t * BLOCK_N, end, visible,
                                                     qk_scale_log2, HAS_POS, BLOCK_N, s_layout, False)
                mbarrier.wait(hf_empty.index(W), ((t // 2) & 1) ^ 1)  # the other read this slot's last use
                p_s.index(W).store(p.to(gl.bfloat16))
                ml_s.slice((3 * W) * 64, 64).store(m_i)
                ml_s.slice((3 * W + 1) * 64, 64).store(l_i)
                ml_s.slice((3 * W + 2) * 64, 64).store(alpha)
                fence_async_shared()  # P's stores before the other's wgmma reads them
                gl.thread_barrier()
                mbarrier.arrive(hf_full.index(W), count=1)
                acc = acc * gl.convert_layout(alpha, alpha_l)[:, None]
                p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
                o_tok = warpgroup_mma(p_op, c_own.index(k), acc, is_async=True)
                acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=[o_tok, p_op])
            else:  # the other's tile: QK^T of own tile t+1 first, then PV with the other's P
                _wait_full(full, t + 1, STAGES)
                s_tok = _qk_whole(q_lat0, q_lat1, q_pe0, q_pe1, c0, c1, r0, r1, (t + 1) % STAGES, s0)
                mbarrier.wait(hf_full.index(1 - W), (t // 2) & 1)
                m_i = ml_s.slice((3 * (1 - W)) * 64, 64).load(row_l)
                l_i = ml_s.slice((3 * (1 - W) + 1) * 64, 64).load(row_l)
                acc = acc * ml_s.slice((3 * (1 - W) + 2) * 64, 64).load(alpha_l)[:, None]
                o_tok = warpgroup_mma(p_s.index(1 - W), c_own.index(k), acc, is_async=True)
                s_cur, acc = warpgroup_mma_wait(num_outstanding=0, deps=[s_tok, o_tok])
                gl.thread_barrier()  # every warp's reads of the slot before it is handed back
                mbarrier.arrive(hf_empty.index(1 - W), count=1)
            gl.thread_barrier()  # every warp of this warpgroup is done with tile t
            mbarrier.arrive(empty.index(k), count=1)
            # refill: tile x = t + STAGES - 1 into the stage of tile t - 1, once both warpgroups
            # are done with that (the first STAGES-1... fills find a fresh barrier and pass)
            x = t + STAGES - 1
            mbarrier.wait(empty.index(x % STAGES), ((x // STAGES) & 1) ^ 1)
            _load_tile(kv_ptr, ids_a, ids_b, c_own.index(x % STAGES), r_own.index(x % STAGES),
                       start + x * BLOCK_N, end, stride_kvb, stride_kvs, W, PAGE, HALF, RH, LKV_, BLOCK_N)
            async_copy.commit_group()
            ids_a, ids_b = _tile_ids(bt_row, start + (x + 1) * BLOCK_N, end, PAGE, BLOCK_N)
        async_copy.wait_group(0)  # no copy may land after the program ends

        empty_row = l_i == 0.0  # a split (or sequence) without visible keys: lse -inf, o 0
        lse = gl.where(empty_row, float("-inf"),
                       (m_i + gl.log2(gl.where(empty_row, 1.0, l_i))) * 0.6931471805599453)
        inv_l = gl.convert_layout(1.0 / gl.where(empty_row, 1.0, l_i), alpha_l)
        o = acc * inv_l[:, None]
        rows_o = pid_h * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, o_layout))
        tok_o = b.to(gl.int64) * q_len + rows_o // H
        cols_o = W * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
        o_ptrs = (o_ptr + tok_o[:, None] * stride_ob + split * stride_os
                  + (rows_o % H)[:, None] * stride_oh + cols_o[None, :])
        # a split past the sequence's end stores only its lse (-inf): the reduce skips its rows
        if DIRECT:
            gl.store(o_ptrs, o.to(o_ptr.dtype.element_ty))
        else:
            if start < seq_len:
                gl.store(o_ptrs, o.to(o_ptr.dtype.element_ty))
        if W == 0:
            gl.store(lse_ptr + tok * stride_lb + split * stride_ls + heads * stride_lh, lse)

    @gluon.jit(do_not_specialize=["num_splits", "stride_btb"])
    def seesaw_kernel(q_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, q_pos_ptr, o_ptr,
                      lse_ptr, qk_scale_log2, H, num_splits, q_len, dcp_size, dcp_rank,
                      stride_qb, stride_qh, stride_kvb, stride_kvs, stride_btb,
                      stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh,
                      PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                      DIRECT: gl.constexpr, HAS_POS: gl.constexpr, WORKER_REGS: gl.constexpr):
        BH: gl.constexpr = 64
        HALF: gl.constexpr = 256
        RH: gl.constexpr = 32
        q_lat_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, HALF], gl.bfloat16)
        c_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF], gl.bfloat16)
        r_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, RH], gl.bfloat16)
        p_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BH, BLOCK_N], gl.bfloat16)
        ml_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        q_lat0 = gl.allocate_shared_memory(gl.bfloat16, [BH, HALF], q_lat_l)
        q_lat1 = gl.allocate_shared_memory(gl.bfloat16, [BH, HALF], q_lat_l)
        c0 = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HALF], c_l)
        c1 = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HALF], c_l)
        r0 = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, RH], r_l)
        r1 = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, RH], r_l)
        p_s = gl.allocate_shared_memory(gl.bfloat16, [2, BH, BLOCK_N], p_l)  # P of each owner's last tile
        ml_s = gl.allocate_shared_memory(gl.float32, [8 * BH], ml_l)  # m, l, alpha of each owner (6 of 8 used)
        full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        hf_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        hf_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(full.index(i), count=2)
            mbarrier.init(empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(hf_full.index(i), count=1)
            mbarrier.init(hf_empty.index(i), count=1)

        gl.warp_specialize([
            (_seesaw_partition, (q_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, q_pos_ptr, o_ptr, lse_ptr,
                                 qk_scale_log2, H, num_splits, q_len, dcp_size, dcp_rank,
                                 stride_qb, stride_qh, stride_kvb, stride_kvs, stride_btb,
                                 stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh,
                                 q_lat0, q_lat1, c0, c1, r0, r1, q_lat0, c0, r0, p_s, ml_s,
                                 full, empty, hf_full, hf_empty,
                                 0, PAGE, BLOCK_N, STAGES, DIRECT, HAS_POS)),
            (_seesaw_partition, (q_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, q_pos_ptr, o_ptr, lse_ptr,
                                 qk_scale_log2, H, num_splits, q_len, dcp_size, dcp_rank,
                                 stride_qb, stride_qh, stride_kvb, stride_kvs, stride_btb,
                                 stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh,
                                 q_lat0, q_lat1, c0, c1, r0, r1, q_lat1, c1, r1, p_s, ml_s,
                                 full, empty, hf_full, hf_empty,
                                 1, PAGE, BLOCK_N, STAGES, DIRECT, HAS_POS)),
        ], [4], [WORKER_REGS])

    assert LKV == 512  # the widths the kernel is written for
