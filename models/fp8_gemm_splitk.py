"""Split-K form of the small-M W8A8 block-FP8 GEMM (models/fp8_gemm.py dispatches to it).

At decode sizes (M <= 16 rows) the GEMM is a weight-bound GEMV: one program per 16 x 64 output
tile, each walking every K block in turn, gives R1's narrow projections (o_proj and the dense
down_proj: N 7168, K 16384-18432; q_a + kv_a: N 2112, K 7168) 33-112 programs on a 132-SM H200,
too few to keep the weight read at the copy bandwidth. Here program (tile, s) takes split s's
contiguous range of K blocks,

    kb in [s * NKB // S, (s + 1) * NKB // S)        (S ranges, together every block exactly once)

and stores its fp32 partial tile in `[S, M, N]`; one reduce kernel sums the S partials in split
order and casts to the output dtype: the result is the same bits on every run, so CUDA graphs
equal eager. With SERIAL (the plan's fp8_gemm_splitk_serial) there is no reduce launch: each
program counts itself done on its tile's counter (one atomic, acquire-release), and the tile's
last program sums the S partials in split order, as the reduce kernel does (the same bits, in
whichever order the splits finish), writes the output and sets the counter back to 0, so the
counters are zero between launches (`tile_counters`: one zeroed buffer per device and stream,
so that concurrent streams never share a counter). The splits cut on K-block boundaries: each
128-wide K block has one weight scale per 128 rows, so a program's scaling is what the unsplit
kernel does on its blocks.

`choose_k_splits` is the host-side rule for S (pure, from the shape and the SM count).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from common.triton_launch import fast_launch

SPLIT_MAX_M = 16  # split only in the "small" range: from 17 rows the grid has more row tiles
PROGRAMS_PER_SM = 2  # target grid: this many programs per SM
MIN_SPLIT_BLOCKS = 2  # K blocks per split at least: fewer and the partials cost more than they add
SPLIT_TILE_N = 64  # tile width the split count is computed for (the small range's first candidate)


@functools.lru_cache(maxsize=4096)  # pure; called once per GEMM launch
def choose_k_splits(m: int, n: int, nkb: int, num_sms: int | None) -> int:
    """Splits of the `nkb` K blocks for an `m x n` output so that tiles x splits fills the GPU
    about PROGRAMS_PER_SM times; 1 (no split) when the tiles alone fill the SMs, above
    SPLIT_MAX_M rows, or with no SM count (not CUDA)."""
    if num_sms is None or m > SPLIT_MAX_M:
        return 1
    tiles = triton.cdiv(m, 16) * triton.cdiv(n, SPLIT_TILE_N)
    if tiles >= num_sms:
        return 1
    want = triton.cdiv(PROGRAMS_PER_SM * num_sms, tiles)
    return max(1, min(want, nkb // MIN_SPLIT_BLOCKS))


@triton.jit(do_not_specialize=["M"])
def _w8a8_splitk_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, p_ptr, M, N, K, NKB, SPLITS, M_BUCKET,
                        stride_sam, stride_sak, y_ptr, cnt_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        EVEN_K: tl.constexpr, QUANT_A: tl.constexpr = False, FMAX: tl.constexpr = 448.0,
                        SERIAL: tl.constexpr = False):
    # program (t, s): output tile t (N tiles fastest), split s; p_ptr is fp32 [SPLITS, M, N].
    # SERIAL: y_ptr [M, N] and cnt_ptr (int32, one zero per tile) are used (see the docstring).
    # QUANT_A: a_ptr is the activations in their own dtype, quantized here per row and K block
    # (BK = 128, the group) with act_quant's arithmetic, bit for bit (sa_ptr unread): no
    # act_quant launch and no FP8 copy of x. Each N tile's programs quantize their K blocks again.
    num_n = tl.cdiv(N, BN)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    split = tl.program_id(1)
    kb0 = split * NKB // SPLITS
    kb1 = (split + 1) * NKB // SPLITS
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mm, mn = offs_m < M, offs_n < N
    # one weight scale per tile and K block (BN divides the 128-row scale block)
    sb_row = sb_ptr + ((pid_n * BN) // BK) * NKB
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kb in range(kb0, kb1):
        offs_k = kb * BK + tl.arange(0, BK)
        a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
        b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mm[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=mn[None, :], other=0.0)
        else:  # the last K block is partial
            mk = offs_k < K
            a = tl.load(a_ptrs, mask=mm[:, None] & mk[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=mn[None, :] & mk[:, None], other=0.0)
        if QUANT_A:  # models/fp8_gemm.py _act_quant_kernel: amax times 1/FMAX, an IEEE division
            xf = a.to(tl.float32)
            sa = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-12) * (1.0 / FMAX)
            a = tl.div_rn(xf, sa[:, None]).to(b.dtype)
        else:
            sa = tl.load(sa_ptr + offs_m * stride_sam + kb * stride_sak, mask=mm, other=0.0)
        acc += tl.dot(a, b) * (sa * tl.load(sb_row + kb))[:, None]
    p_ptrs = p_ptr + split.to(tl.int64) * M * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(p_ptrs, acc, mask=mm[:, None] & mn[None, :])
    if SERIAL:
        tile = offs_m[:, None] * N + offs_n[None, :]
        mask = mm[:, None] & mn[None, :]
        # every thread's partial stored before the one atomic (a CTA barrier, then the atomic's
        # release at GPU scope); the last program's acquire makes every split's partial visible.
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + tl.program_id(0), 1, sem="acq_rel")
        if done == SPLITS - 1:
            total = tl.zeros([BM, BN], dtype=tl.float32)
            for s in range(0, SPLITS):  # split order, as _splitk_reduce_kernel; .cg: from L2, not L1
                total += tl.load(p_ptr + s * M * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + tile, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + tl.program_id(0), 0)


@fast_launch
@triton.jit
def _splitk_reduce_kernel(p_ptr, y_ptr, MN, SPLITS, BLOCK: tl.constexpr):
    # y[i] = sum over s = 0, 1, ..., SPLITS - 1 of p[s, i], in that order, cast to y's dtype
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(p_ptr + s * MN + offs, mask=m, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=m)


REDUCE_BLOCK = 512
# SERIAL's counters a device and stream: one per output tile of a launch. R1's widest small-M
# projection (the dense gate_up, N 36864 at -tp 1) has 576 tiles of the narrowest (16 x 64)
SERIAL_TILES = 8192
_COUNTERS: dict = {}


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The zeroed int32 counters SERIAL launches on the current stream of `device` use. Made on
    first use (an eager warm-up precedes every CUDA-graph capture; made inside one, the buffer
    comes from the graph's pool and is kept alive here, and its zeroing replays harmlessly)."""
    if tiles > SERIAL_TILES:
        raise ValueError(f"W8A8 split-K serial reduce: {tiles} output tiles, at most {SERIAL_TILES}")
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    c = _COUNTERS.get(key)
    if c is None:
        c = _COUNTERS[key] = torch.zeros(SERIAL_TILES, dtype=torch.int32, device=device)
    return c


def splitk_reduce(partials, y) -> None:
    """y `[M, N]` (contiguous) <- partials `[S, M, N]` fp32 summed over S in split order."""
    mn = y.numel()
    _splitk_reduce_kernel[(triton.cdiv(mn, REDUCE_BLOCK),)](partials, y, mn, partials.shape[0],
                                                             BLOCK=REDUCE_BLOCK)
