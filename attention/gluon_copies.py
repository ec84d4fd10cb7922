"""The copy side of the Gluon many-heads MLA decode (attention/gluon_decode.py): which cache rows
a tile reads, the cp.async copies of a tile's column half into shared memory, the wait that makes
them visible to wgmma, and the producer warpgroup of `GluonDecodeConfig.producer`, which issues
every copy so that the compute warpgroups issue none; also the pieces both many-heads kernels
(gluon_decode.py, gluon_seesaw.py) share: the split bounds, the keys visible to a row under DCP
and the output stores. Layouts and the cache format are
gluon_decode's (DESIGN.md §4)."""

from __future__ import annotations

try:  # Gluon is Triton's experimental dialect; gluon_decode.check_gluon_available reports a failure
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, mbarrier
    _ERROR: Exception | None = None
except Exception as exc:  # noqa: BLE001
    _ERROR = exc

if _ERROR is None:
    @gluon.jit
    def _split_bounds(seq_lens_ptr, block_table_ptr, stride_btb, b, split, num_splits, BLOCK_N: gl.constexpr):
        """(seq_len, start, end, n_tiles, block-table row) of sequence b's split: boundaries on
        BLOCK_N multiples, so only a sequence's last tile is partial; an empty split still runs
        one all-masked tile (no memory read: lse -inf, o 0). Shared by every partition, which must
        agree on the tiles."""
        seq_len = gl.load(seq_lens_ptr + b).to(gl.int32)
        per_split = gl.cdiv(gl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = gl.minimum(start + per_split, seq_len)
        n_tiles = gl.maximum(gl.cdiv(gl.maximum(end - start, 0), BLOCK_N), 1)
        return seq_len, start, end, n_tiles, block_table_ptr + b.to(gl.int64) * stride_btb

    @gluon.jit
    def _visible_keys(q_pos_ptr, tok, seq_len, dcp_size, dcp_rank):
        """Keys of this rank's cache visible to each query row: local_len(p + 1) of its token's
        position p under DCP (DESIGN.md), at most the sequence's local length."""
        p1 = gl.load(q_pos_ptr + tok).to(gl.int32) + 1
        return gl.minimum(p1 // dcp_size + (dcp_rank < p1 % dcp_size).to(gl.int32), seq_len)

    @gluon.jit
    def _store_outputs(acc, m_i, l_i, o_ptr, lse_ptr, pid_h, b, split, start, seq_len, H, q_len, tok, heads,
                       stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh,
                       W: gl.constexpr, DIRECT: gl.constexpr, o_layout: gl.constexpr):
        """A program's outputs, as both many-heads kernels write them: warpgroup W's 256 columns of o
        (acc / l; the split's partial, or o itself with DIRECT) and, from warpgroup 0, the lse
        (natural log; -inf with o 0 for rows without a visible key). A split past the sequence's
        end stores only its lse, and the reduce skips its rows."""
        BH: gl.constexpr = 64
        HALF: gl.constexpr = 256
        empty = l_i == 0.0
        lse = gl.where(empty, float("-inf"),
                       (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        inv_l = gl.convert_layout(1.0 / gl.where(empty, 1.0, l_i), gl.SliceLayout(1, o_layout))
        o = acc * inv_l[:, None]
        rows_o = pid_h * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, o_layout))
        tok_o = b.to(gl.int64) * q_len + rows_o // H
        cols_o = W * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_layout))
        o_ptrs = (o_ptr + tok_o[:, None] * stride_ob + split * stride_os
                  + (rows_o % H)[:, None] * stride_oh + cols_o[None, :])
        if DIRECT:
            gl.store(o_ptrs, o.to(o_ptr.dtype.element_ty))
        else:
            if start < seq_len:
                gl.store(o_ptrs, o.to(o_ptr.dtype.element_ty))
        if W == 0:
            gl.store(lse_ptr + tok * stride_lb + split * stride_ls + heads * stride_lh, lse)

    @gluon.jit
    def _tile_ids(bt_row, t0, end, PAGE: gl.constexpr, BLOCK_N: gl.constexpr):
        """Block ids of cache rows [t0, t0 + BLOCK_N) for `_load_tile` (t0 is a BLOCK_N multiple);
        no table entry past the sequence is read (0 instead). A tile within one page: its id, as
        a scalar, twice; a tile over two pages: both ids, as scalars; else one id per row, in the
        two layouts `_load_tile` copies with."""
        if PAGE >= BLOCK_N:
            blk = gl.load(bt_row + t0 // PAGE, mask=t0 < end, other=0)
            return blk, blk
        elif 2 * PAGE == BLOCK_N:
            id0 = gl.load(bt_row + t0 // PAGE, mask=t0 < end, other=0)
            id1 = gl.load(bt_row + t0 // PAGE + 1, mask=t0 + PAGE < end, other=0)
            return id0, id1
        else:
            ld_c: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
            ld_r: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
            n_c = t0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_c))
            blk_c = gl.load(bt_row + n_c // PAGE, mask=n_c < end, other=0)
            n_r = t0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_r))
            blk_r = gl.load(bt_row + n_r // PAGE, mask=n_r < end, other=0)
            return blk_c, blk_r

    @gluon.jit
    def _row_ids(ids_a, ids_b, r, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, LAYOUT_B: gl.constexpr):
        """Block id of each tile row r (0 .. BLOCK_N-1) from `_tile_ids`' pair; LAYOUT_B: the
        per-row case's second layout (rope) instead of the first."""
        if PAGE >= BLOCK_N:
            return ids_a
        elif 2 * PAGE == BLOCK_N:
            return gl.where(r < PAGE, ids_a, ids_b)
        elif LAYOUT_B:
            return ids_b
        else:
            return ids_a

    @gluon.jit
    def _load_tile(kv_ptr, ids_a, ids_b, c_buf, r_buf, t0, end, stride_kvb, stride_kvs,
                   W: gl.constexpr, PAGE: gl.constexpr, HALF: gl.constexpr, RH: gl.constexpr,
                   LKV_: gl.constexpr, BLOCK_N: gl.constexpr):
        """Issue cp.async for cache rows [t0, t0 + BLOCK_N) of the blocks `_tile_ids` gave (rows
        >= end zero-filled, nothing read for them): latent columns [W*HALF, +HALF) into c_buf,
        rope [LKV_ + W*RH, +RH) into r_buf."""
        ld_c: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        ld_r: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        r_c = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_c))
        n_c = t0 + r_c
        blk_c = _row_ids(ids_a, ids_b, r_c, PAGE, BLOCK_N, False)
        row_c = blk_c.to(gl.int64) * stride_kvb + (n_c % PAGE).to(gl.int64) * stride_kvs
        cols_c = W * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, ld_c))
        async_copy.async_copy_global_to_shared(
            c_buf, kv_ptr + row_c[:, None] + cols_c[None, :], mask=(n_c < end)[:, None])
        r_r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_r))
        n_r = t0 + r_r
        blk_r = _row_ids(ids_a, ids_b, r_r, PAGE, BLOCK_N, True)
        row_r = blk_r.to(gl.int64) * stride_kvb + (n_r % PAGE).to(gl.int64) * stride_kvs
        cols_r = LKV_ + W * RH + gl.arange(0, RH, layout=gl.SliceLayout(0, ld_r))
        async_copy.async_copy_global_to_shared(
            r_buf, kv_ptr + row_r[:, None] + cols_r[None, :], mask=(n_r < end)[:, None])

    @gluon.jit
    def _wait_tile(OUTSTANDING: gl.constexpr):
        """This warpgroup's copies up to the given group are in shared memory and visible to wgmma."""
        async_copy.wait_group(OUTSTANDING)
        fence_async_shared()  # cp.async writes (generic proxy) before wgmma reads (async proxy)
        gl.thread_barrier()  # every thread's copies, before any warp's wgmma

    @gluon.jit
    def _producer_partition(q_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, H, num_splits, q_len,
                            stride_qb, stride_qh, stride_kvb, stride_kvs, stride_btb,
                            q_lat0, q_lat1, c0, c1, r0, r1, full, empty,
                            PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """GluonDecodeConfig.producer: one warpgroup issues every copy (q's latent part, both
        column halves of every tile) so that the two compute warpgroups issue none. Tile t goes
        into stage t % STAGES once both compute warpgroups have released the tile before it there
        (`empty`); its copies are waited for, fenced for wgmma and published on `full` one tile
        later, so two tiles' copies are in flight."""
        HALF: gl.constexpr = 256
        RH: gl.constexpr = 32
        LKV_: gl.constexpr = 512
        BH: gl.constexpr = 64
        ld_c: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
        pid_h = gl.program_id(0)
        split = gl.program_id(1)
        b = gl.program_id(2)
        seq_len, start, end, n_tiles, bt_row = _split_bounds(seq_lens_ptr, block_table_ptr, stride_btb, b,
                                                             split, num_splits, BLOCK_N)
        rq_c = pid_h * BH + gl.arange(0, BH, layout=gl.SliceLayout(1, ld_c))
        q_row_c = (b.to(gl.int64) * q_len + rq_c // H) * stride_qb + (rq_c % H) * stride_qh
        cq_c = gl.arange(0, HALF, layout=gl.SliceLayout(0, ld_c))
        async_copy.async_copy_global_to_shared(q_lat0, q_ptr + q_row_c[:, None] + cq_c[None, :])
        async_copy.async_copy_global_to_shared(q_lat1, q_ptr + q_row_c[:, None] + (HALF + cq_c)[None, :])
        ids_a, ids_b = _tile_ids(bt_row, start, end, PAGE, BLOCK_N)
        for t in range(0, n_tiles):
            k = t % STAGES
            mbarrier.wait(empty.index(k), ((t // STAGES) & 1) ^ 1)  # a fresh barrier passes
            _load_tile(kv_ptr, ids_a, ids_b, c0.index(k), r0.index(k), start + t * BLOCK_N, end,
                       stride_kvb, stride_kvs, 0, PAGE, HALF, RH, LKV_, BLOCK_N)
            _load_tile(kv_ptr, ids_a, ids_b, c1.index(k), r1.index(k), start + t * BLOCK_N, end,
                       stride_kvb, stride_kvs, 1, PAGE, HALF, RH, LKV_, BLOCK_N)
            async_copy.commit_group()
            ids_a, ids_b = _tile_ids(bt_row, start + (t + 1) * BLOCK_N, end, PAGE, BLOCK_N)
            if t >= 1:  # tile t-1 has landed: publish it
                async_copy.wait_group(1)
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(full.index((t - 1) % STAGES), count=1)
        async_copy.wait_group(0)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(full.index((n_tiles - 1) % STAGES), count=1)
