"""The Gluon FP8-cache decode's data movement and e4m3 arithmetic (attention/gluon_decode_fp8.py):
the paged cp.async copies of a tile, V^T's register fragment for PV (16-byte shared loads, byte
transposes within the thread, O^T's row relabelling), and the two-term e4m3 split of q and P.
Layouts and formats are the kernel's (its module docstring)."""

from __future__ import annotations

try:  # Gluon is Triton's experimental dialect; gluon_decode_fp8.check_available reports a failure
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import async_copy
    _ERROR: Exception | None = None
except Exception as exc:  # noqa: BLE001
    _ERROR = exc

from attention.gluon_decode_fp8_plan import BLOCK_N, LKV

if _ERROR is None:
    # the tile transposed, [512 latent columns, 64 tokens], as each thread loads it: 16 consecutive
    # columns (16 bytes) of each of 16 tokens; lanes: tokens 4t (t = lane % 4) and column blocks
    # 16 g (g = lane // 4); warps: 128-column quarters
    _VT_LOAD = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [2, 0], [4, 0], [8, 0], [0, 1], [0, 2], [0, 16], [0, 32]],
        lane_bases=[[0, 4], [0, 8], [16, 0], [32, 0], [64, 0]],
        warp_bases=[[128, 0], [256, 0]], block_bases=[], shape=[LKV, BLOCK_N]))
    # the same elements in the registers' order of wgmma's A fragment (4 consecutive tokens per
    # 32-bit register): converting _VT_LOAD to it moves bytes within each thread only
    _VT_REGS = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [1, 0], [0, 16], [0, 32], [2, 0], [4, 0], [8, 0]],
        lane_bases=[[0, 4], [0, 8], [16, 0], [32, 0], [64, 0]],
        warp_bases=[[128, 0], [256, 0]], block_bases=[], shape=[LKV, BLOCK_N]))

    @gluon.constexpr_function
    def _copy_layout(NP, RP, W):
        """cp.async layout of a tile's [NP pages, RP rows, W bytes] view: 16 bytes a thread, lanes
        along the row first, then rows, then pages; warps along rows, then pages."""
        NP, RP, W = (gl._unwrap_if_constexpr(x) for x in (NP, RP, W))
        lanes_c = min(32, W // 16)
        lanes_r = min(32 // lanes_c, RP)
        warps_r = min(4, max(1, RP // lanes_r))
        return gl.BlockedLayout([1, 1, 16], [32 // lanes_c // lanes_r, lanes_r, lanes_c], [4 // warps_r, warps_r, 1],
                                [2, 1, 0])

    @gluon.jit
    def _page_ids_for(bt_row, t0, end, PAGE: gl.constexpr, BN: gl.constexpr, W: gl.constexpr):
        """Block ids of the pages of cache rows [t0, t0 + BN) (t0 a BN multiple) in the layout of
        the copy of W-byte rows (`_copy_part`): [NP] (NP = BN // PAGE, or 1 when a page holds the
        tile), 0 for pages past `end` (not read)."""
        NP: gl.constexpr = BN // PAGE if PAGE < BN else 1
        RP: gl.constexpr = PAGE if PAGE < BN else BN
        id_l: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, _copy_layout(NP, RP, W)))
        pg = gl.arange(0, NP, layout=id_l)
        return gl.load(bt_row + t0 // PAGE + pg, mask=t0 + pg * RP < end, other=0)

    @gluon.jit
    def _page_ids(bt_row, t0, end, PAGE: gl.constexpr, BN: gl.constexpr):
        """The tile's page ids twice, in the layouts of its latent (512-byte) and rope (64-byte)
        copies: two loads of a few ids (cached) instead of a layout conversion, which went
        through shared memory and cost a barrier a tile."""
        return (_page_ids_for(bt_row, t0, end, PAGE, BN, 512),
                _page_ids_for(bt_row, t0, end, PAGE, BN, 64))

    @gluon.jit
    def _copy_part(kv_ptr, ids, dst, t0, end, stride_kvb, stride_kvs, PAGE: gl.constexpr,
                   NP: gl.constexpr, RP: gl.constexpr, COL0: gl.constexpr, W: gl.constexpr):
        """cp.async of columns [COL0, COL0 + W) of the tile's rows into dst, viewed as [NP, RP, W];
        ids in this copy's layout (`_page_ids_for`)."""
        ld: gl.constexpr = _copy_layout(NP, RP, W)
        pg = gl.arange(0, NP, layout=gl.SliceLayout(1, gl.SliceLayout(2, ld)))
        rr = gl.arange(0, RP, layout=gl.SliceLayout(0, gl.SliceLayout(2, ld)))
        cc = COL0 + gl.arange(0, W, layout=gl.SliceLayout(0, gl.SliceLayout(1, ld)))
        base = gl.convert_layout(ids, gl.SliceLayout(1, gl.SliceLayout(2, ld)), assert_trivial=True)
        base = base.to(gl.int64) * stride_kvb
        rows = (t0 % PAGE + rr) * stride_kvs  # t0 % PAGE: 0 unless a page holds several tiles
        ptrs = kv_ptr + base[:, None, None] + rows[None, :, None] + cc[None, None, :]
        valid = (t0 + pg[:, None] * RP + rr[None, :] < end)[:, :, None]
        async_copy.async_copy_global_to_shared(dst.reshape([NP, RP, W]), ptrs, mask=valid)

    @gluon.jit
    def _copy_tile(kv_ptr, ids, c_buf, r_buf, t0, end, stride_kvb, stride_kvs,
                   PAGE: gl.constexpr, BN: gl.constexpr):
        """cp.async of cache rows [t0, t0 + BN) into c_buf [BN, 512] and r_buf [BN, 64] (rows >= end
        zero-filled, not read), 16 bytes a thread. The tile is viewed as [NP pages, RP rows]: each
        thread's page bases come from `ids` (`_page_ids`: latent and rope layouts); its rows'
        offsets within a page are the same every tile where a tile holds whole pages (pages of up
        to 64 rows), and move by t0 % PAGE within a larger page."""
        NP: gl.constexpr = BN // PAGE if PAGE < BN else 1
        RP: gl.constexpr = PAGE if PAGE < BN else BN
        _copy_part(kv_ptr, ids[0], c_buf, t0, end, stride_kvb, stride_kvs, PAGE, NP, RP, 0, 512)
        _copy_part(kv_ptr, ids[1], r_buf, t0, end, stride_kvb, stride_kvs, PAGE, NP, RP, 512, 64)

    @gluon.jit
    def _e4m3_round(x):
        """x (fp32, |x| <= 448) rounded to the nearest e4m3 value, ties to even, as fp32. In fp32
        arithmetic, not by converting to e4m3 and back: Triton 3.6's e4m3 -> fp32 conversion gave
        wrong values here on the H200 (some elements read another's value)."""
        ax = gl.abs(x)
        bits = ax.to(gl.int32, bitcast=True)
        # normal e4m3 (>= 2^-6): 3 of fp32's 23 mantissa bits kept, ties to even
        norm = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(gl.float32, bitcast=True)
        # subnormal (< 2^-6): multiples of 2^-9, by the round-to-integer of adding 1.5 * 2^23
        sub = ((ax * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
        r = gl.where(ax < 0.015625, sub, norm)
        return gl.where(x < 0, -r, r)

    @gluon.jit
    def _transpose4(t0, t1, t2, t3):
        """Byte transposes of 4 x 4 blocks: t_d [128, 4, 16] holds latent columns 4a + b of token
        4c + d, 4 consecutive b in one 32-bit register; returns u_e [128, 4, 16] whose element
        (a, b, c) is latent 4a + e of token 4c + b: each register 4 consecutive tokens of one
        latent column. 8 byte permutes a block."""
        return gl.inline_asm_elementwise(
            asm="{ .reg .b32 x0, x1, x2, x3; prmt.b32 x0, $4, $5, 0x5140; prmt.b32 x1, $4, $5, 0x7362; "
                "prmt.b32 x2, $6, $7, 0x5140; prmt.b32 x3, $6, $7, 0x7362; prmt.b32 $0, x0, x2, 0x5410; "
                "prmt.b32 $1, x0, x2, 0x7632; prmt.b32 $2, x1, x3, 0x5410; prmt.b32 $3, x1, x3, 0x7632; }",
            constraints="=r,=r,=r,=r,r,r,r,r", args=[t0, t1, t2, t3],
            dtype=(gl.uint8, gl.uint8, gl.uint8, gl.uint8), is_pure=True, pack=4)

    @gluon.jit
    def _vt_fragment(tile, vt_l: gl.constexpr, VT_PRMT: gl.constexpr):
        """V^T [512, 64] of a tile [64, 512] as wgmma's A fragment in registers, rows in O^T's order
        (PERM): 16-byte loads, the bytes transposed within each thread (Triton's layout conversion,
        or with VT_PRMT `_transpose4`), then the rows relabelled (no data moves)."""
        vt = tile.permute((1, 0)).load(_VT_LOAD)
        if VT_PRMT:
            # [512, 64] as (a, b, c, d1, d0): latent 4a + b, token 4c + 2 d1 + d0; b is the first
            # two register bits of _VT_LOAD, so each 32-bit register is one (a, c, d)'s 4 b
            x = gl.reshape(vt.to(gl.uint8, bitcast=True), [128, 4, 16, 2, 2])
            x_0, x_1 = gl.split(x)  # d0 = 0, 1
            t0, t2 = gl.split(x_0)  # d1 = 0, 1
            t1, t3 = gl.split(x_1)
            u0, u1, u2, u3 = _transpose4(t0, t1, t2, t3)
            # (a, b, c, e0, e1) -> (a, e1, e0, c, b): latent 4a + 2 e1 + e0, token 4c + b
            w = gl.join(gl.join(u0, u1), gl.join(u2, u3))
            w = gl.reshape(gl.permute(w, [0, 4, 3, 2, 1]), [512, 64])
            vt = gl.convert_layout(w.to(gl.float8e4nv, bitcast=True), _VT_REGS)
        else:
            vt = gl.convert_layout(vt, _VT_REGS)
        # latent bits (MSB first) w1 w0 g2 g1 g0 i2 i1 i0 h -> O^T's row bits i2 i1 i0 w1 w0 h g2 g1 g0
        vt = gl.reshape(vt, [2, 2, 2, 2, 2, 2, 2, 2, 2, 64])
        vt = gl.reshape(gl.permute(vt, [5, 6, 7, 0, 1, 8, 2, 3, 4, 9]), [512, 64])
        return gl.convert_layout(vt, vt_l, assert_trivial=True)

    @gluon.jit
    def _e4m3_to_f32(x8):
        """e4m3 values as fp32 by the hardware's e4m3x2 -> f16x2 convert, in inline asm so that the
        element order is this code's (Triton 3.6's own conversion misplaced elements, `_e4m3_round`)."""
        return gl.inline_asm_elementwise(
            asm="{ .reg .b32 h2; .reg .b16 lo, hi; cvt.rn.f16x2.e4m3x2 h2, $2; mov.b32 {lo, hi}, h2; "
                "cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }",
            constraints="=r,=r,h", args=[x8.to(gl.uint8, bitcast=True)], dtype=gl.float32, is_pure=True, pack=2)

    @gluon.jit
    def _two_terms(x, HW_DECODE: gl.constexpr = False):
        """x (|x| <= 448) as e4m3 hi + lo, lo = e4m3(x - hi): x to ~2^-8 relative. hi's value in
        fp32 by rounding arithmetic (`_e4m3_round`), or with HW_DECODE by converting hi back in
        hardware (`_e4m3_to_f32`: 1.5 instructions a value instead of ~9)."""
        if HW_DECODE:
            hi8 = x.to(gl.float8e4nv)
            return hi8, (x - _e4m3_to_f32(hi8)).to(gl.float8e4nv)
        else:
            hi = _e4m3_round(x)
            return hi.to(gl.float8e4nv), (x - hi).to(gl.float8e4nv)
