"""Expert-sorted block MoE for medium batches (5-512 tokens; FP8 experts at any size past the
small-batch bound): the (token, expert) pairs sorted by expert into blocks, each expert's
weights read once per block. The small-batch kernels and the shared pieces (the product helper,
the pair sum, the FP8 scale checks) are in models/fused_moe.py.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from common.fused import PairRows
from common.launch_settings import autotuning, interpreting
from common.pdl import pdl_launch, pdl_prologue
from common.triton_launch import fast_launch
from models.fp8 import FP8
from models.fp8_gemm import GROUP as ACT_GROUP, act_quant
from models.expert_sort import align_pairs
from models.fused_moe import _expert_scales, _mma, _scaled_mma, sum_pairs

# From ~16 tokens on, pairs share experts and the pair-parallel kernels (models/fused_moe.py) would read an
# expert's weights once per pair. Here the (token, expert) pairs are sorted by expert and padded
# into blocks of BLOCK_M rows of one expert; a program multiplies a block's rows by one tile of
# its expert's weights, so each expert's weights are read once per block (once, at these sizes).
# The sort and padding are one kernel (`_align_kernel`, no host sync: CUDA-graph safe); the
# products and the pair sum are the three kernels below, the same math as the small-batch path.
# At 32-128 tokens on the H200 the two product kernels move the touched experts' bytes at
# 95-97% of the copy bandwidth (RESULTS.md). FP8 experts (DeepSeek-V3/R1 kept in FP8) take these
# kernels at every size past the small-batch bound, prefill included: the weights are read as
# FP8 and scaled per tile product, so no dequantized copy of a layer's experts is ever made.
# By default that is weight-only (each FP8 tile converted to x's dtype in registers); with
# `a8` (the kernel plan's moe_fp8_w8a8) W8A8: the activations are quantized per token per 128
# group, as the dense W8A8 GEMMs do, and the tiles multiply in FP8 on the tensor cores.

@triton.jit
def _block_tile(NB, N, BLOCK_N: tl.constexpr, GROUP_B: tl.constexpr):
    """(block, tile of N) of this program in the 1-D grid of NB * cdiv(N, BLOCK_N) programs.
    GROUP_B 0: the block index runs fastest (programs running together share one tile of N and
    span many experts: each expert's tile is read once, from HBM, which is what decode needs).
    GROUP_B g > 0: groups of g consecutive blocks, every tile of N of a group before the next
    group, the blocks fastest within it; at prefill sizes (several blocks per expert) the
    programs running together then share the group's rows and its experts' weights in L2
    instead of streaming every block's rows once per tile of N."""
    pid = tl.program_id(0)
    if GROUP_B == 0:
        return pid % NB, pid // NB
    per_group = GROUP_B * tl.cdiv(N, BLOCK_N)
    first = (pid // per_group) * GROUP_B
    size = tl.minimum(NB - first, GROUP_B)
    r = pid % per_group
    return first + r % size, r // size


@triton.jit
def _block_pairs(rows_ptr, blk, BLOCK_M: tl.constexpr):
    """A block's pair indices (int64, padding rows as 0) and which rows are real (not -1)."""
    pair = tl.load(rows_ptr + blk * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair >= 0
    return tl.where(valid, pair, 0).to(tl.int64), valid


@triton.jit(do_not_specialize=["NB"])
def _blocked_gate_up_kernel(x_ptr, sx_ptr, rows_ptr, bexp_ptr, w13_ptr, s13_ptr, h_ptr, D, I, E, KT, T_BUCKET,
                            S_ROWS, S_COLS, SX_M, SX_K, NB, QB: tl.constexpr, SCALED: tl.constexpr,
                            A8: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_B: tl.constexpr,
                            PDL: tl.constexpr):
    """h = silu(x W_gate^T) * (x W_up^T) for one block of an expert's pairs and one tile of I.
    SCALED (FP8 weights, QB x QB block scales, BLOCK_K dividing QB): a k tile lies in one scale
    column and each weight row in one scale row, so the tile's product of x with the FP8 tile
    (converted to x's dtype, unscaled) is scaled per output column by a [BLOCK_N] vector.
    A8 (with SCALED; W8A8): x is FP8 too, quantized per token in QB-wide groups with scales
    sx[t, k // QB] (strides SX_M, SX_K); the tile's product is an FP8 tensor-core product,
    scaled per row by its tokens' scales and per column as above. It is computed transposed,
    (W x^T) [BLOCK_N, BLOCK_M], so that the weight tile is the tensor-core operand with many rows:
    on sm_90 Triton gives FP8 operands native wgmma (QGMMA) only with >= 64 rows in the first
    operand, and with 16 or 32 (the blocks the MoE picks) it takes mma.sync, converting both FP8
    tiles to fp16 in registers. The accumulators are transposed back once, after the k loop."""
    pdl_prologue(PDL)
    blk, nb = _block_tile(NB, I, BLOCK_N, GROUP_B)
    e = tl.load(bexp_ptr + blk).to(tl.int64)
    if e < E:
        safe, valid = _block_pairs(rows_ptr, blk, BLOCK_M)
        tok = safe // KT
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < I
        if A8:  # transposed, [BLOCK_N, BLOCK_M] (see the docstring)
            acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        w_base = w13_ptr + e * (2 * I) * D
        s_g = s13_ptr + e * S_ROWS * S_COLS + (offs_n // QB) * S_COLS  # [BLOCK_N] gate rows' scale rows
        s_u = s13_ptr + e * S_ROWS * S_COLS + ((I + offs_n) // QB) * S_COLS
        for k0 in range(0, D, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < D
            xv = tl.load(x_ptr + tok[:, None].to(tl.int64) * D + offs_k[None, :],
                         mask=valid[:, None] & mask_k[None, :], other=0.0)
            m = mask_n[:, None] & mask_k[None, :]
            wg = tl.load(w_base + offs_n[:, None] * D + offs_k[None, :], mask=m, other=0.0)
            wu = tl.load(w_base + (I + offs_n[:, None]) * D + offs_k[None, :], mask=m, other=0.0)
            if A8:
                sxv = tl.load(sx_ptr + tok * SX_M + (k0 // QB) * SX_K, mask=valid, other=0.0)[None, :]
                pg = tl.dot(wg, tl.trans(xv))  # [BLOCK_N, BLOCK_M]
                pu = tl.dot(wu, tl.trans(xv))
                acc_g += pg * sxv * tl.load(s_g + k0 // QB, mask=mask_n, other=0.0)[:, None]
                acc_u += pu * sxv * tl.load(s_u + k0 // QB, mask=mask_n, other=0.0)[:, None]
            elif SCALED:
                acc_g += _scaled_mma(xv, wg, s_g, k0, mask_n, QB, IEEE, BLOCK_M, BLOCK_N)
                acc_u += _scaled_mma(xv, wu, s_u, k0, mask_n, QB, IEEE, BLOCK_M, BLOCK_N)
            else:
                acc_g = _mma(xv, tl.trans(wg), acc_g, IEEE)
                acc_u = _mma(xv, tl.trans(wu), acc_u, IEEE)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        if A8:
            h = tl.trans(h)
        tl.store(h_ptr + safe[:, None] * I + offs_n[None, :],
                 h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["NB"])
def _blocked_down_kernel(h_ptr, sh_ptr, rows_ptr, bexp_ptr, pw_ptr, w2_ptr, s2_ptr, part_ptr, D, I, E, T_BUCKET,
                         S_ROWS, S_COLS, SH_M, SH_K, NB, QB: tl.constexpr, SCALED: tl.constexpr,
                         A8: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_B: tl.constexpr,
                         PDL: tl.constexpr):
    """part = w * (h W2^T) (fp32) for one block of an expert's pairs and one tile of D; SCALED
    and A8 as in the gate/up kernel (A8: h FP8 per pair row, scales sh[pair, k // QB])."""
    pdl_prologue(PDL)
    blk, db = _block_tile(NB, D, BLOCK_N, GROUP_B)
    e = tl.load(bexp_ptr + blk).to(tl.int64)
    if e < E:
        safe, valid = _block_pairs(rows_ptr, blk, BLOCK_M)
        wt = tl.load(pw_ptr + safe, mask=valid, other=0.0).to(tl.float32)
        offs_n = db * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < D
        if A8:  # transposed, as in the gate/up kernel
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        s_n = s2_ptr + e * S_ROWS * S_COLS + (offs_n // QB) * S_COLS  # [BLOCK_N]
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < I
            hv = tl.load(h_ptr + safe[:, None] * I + offs_k[None, :], mask=valid[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w2_ptr + e * D * I + offs_n[:, None] * I + offs_k[None, :],
                        mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            if A8:
                shv = tl.load(sh_ptr + safe * SH_M + (k0 // QB) * SH_K, mask=valid, other=0.0)
                p = tl.dot(w, tl.trans(hv))  # [BLOCK_N, BLOCK_M]
                acc += p * shv[None, :] * tl.load(s_n + k0 // QB, mask=mask_n, other=0.0)[:, None]
            elif SCALED:
                acc += _scaled_mma(hv, w, s_n, k0, mask_n, QB, IEEE, BLOCK_M, BLOCK_N)
            else:
                acc = _mma(hv, tl.trans(w), acc, IEEE)
        if A8:
            acc = tl.trans(acc)
        tl.store(part_ptr + safe[:, None] * D + offs_n[None, :], acc * wt[:, None],
                 mask=valid[:, None] & mask_n[None, :])


_BLOCKED_TILES = [(64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 8, 3), (32, 128, 4, 4), (128, 128, 8, 3)]
_BLOCKED_KEY = ["D", "I", "T_BUCKET", "IEEE", "BLOCK_M"]
# The non-autotuned tiles (autotune=0 on CUDA; the interpreter).
_BLOCKED_FIXED = dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
_BLOCKED_INTERPRET = dict(BLOCK_N=32, BLOCK_K=64)
# FP8 experts (SCALED) need BLOCK_K to divide the 128-wide quantization block (one scale column
# per k tile); _BlockedMoE checks the block it is given against these tiles. Shared memory
# per program on the H200 (227 KB), the gate/up kernel at BLOCK_M 64 (the largest): num_stages x
# (x tile 2*BLOCK_M*BLOCK_K + two FP8 weight tiles 2*BLOCK_N*BLOCK_K bytes) + the two weight tiles
# converted to bf16 for the tensor cores (4*BLOCK_N*BLOCK_K bytes, one buffer): 80, 128, 104, 112
# and 208 KB for the five tiles, 80 KB for the fixed one; the down kernel stages one weight tile,
# less. (bf16 weights at BLOCK_M 64 and (128, 128, 8, 3) would need 240 KB: the autotuner skips a
# tile that does not fit.)
_BLOCKED_TILES_FP8 = [t for t in _BLOCKED_TILES if 128 % t[1] == 0]
_BLOCKED_K_FP8 = sorted({t[1] for t in _BLOCKED_TILES_FP8} | {_BLOCKED_FIXED["BLOCK_K"], _BLOCKED_INTERPRET["BLOCK_K"]})


def _blocked_configs(tiles):
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st) for n, k, w, st in tiles]


_blocked_gate_up_tuned = triton.autotune(configs=_blocked_configs(_BLOCKED_TILES), key=_BLOCKED_KEY)(
    _blocked_gate_up_kernel)
_blocked_down_tuned = triton.autotune(configs=_blocked_configs(_BLOCKED_TILES), key=_BLOCKED_KEY)(
    _blocked_down_kernel)
_blocked_gate_up_fp8_tuned = triton.autotune(configs=_blocked_configs(_BLOCKED_TILES_FP8), key=_BLOCKED_KEY)(
    _blocked_gate_up_kernel)
_blocked_down_fp8_tuned = triton.autotune(configs=_blocked_configs(_BLOCKED_TILES_FP8), key=_BLOCKED_KEY)(
    _blocked_down_kernel)
# W8A8 (A8): their own autotuners, so that the two FP8 modes' tuned tiles never mix. The FP8
# tiles with BLOCK_N >= 64: the transposed product's first operand is the BLOCK_N-row weight
# tile, and with 32 rows Triton 3.6 compiles it for sm_90 to mma.sync, both tiles converted to
# fp16 (ptxas on a CPU machine: every other tile, and the fixed one, at 16/32/64-row blocks gets
# QGMMA (FP8 wgmma) with no conversion, no spills, at most 120 KB of shared memory).
_BLOCKED_TILES_W8A8 = [t for t in _BLOCKED_TILES_FP8 if t[0] >= 64]
_blocked_gate_up_w8a8_tuned = triton.autotune(configs=_blocked_configs(_BLOCKED_TILES_W8A8), key=_BLOCKED_KEY)(
    _blocked_gate_up_kernel)
_blocked_down_w8a8_tuned = triton.autotune(configs=_blocked_configs(_BLOCKED_TILES_W8A8), key=_BLOCKED_KEY)(
    _blocked_down_kernel)


# From this many tokens the block kernels run their programs in groups of BLOCK_GROUP blocks
# (`_block_tile`). On the H200 (bench_fused_moe.py --groups, CUDA graphs, µs per layer): V2-Lite
# bf16 with 128-row blocks 500.9 -> 467.5 at 1024 tokens, 997.0 -> 923.1 at 2048, 3085.8 -> 2761.2
# at 8192 (groups of 1, 4, 16 within 2% of 8); R1's FP8 experts at 1024 tokens 6857 -> 6586
# (weight-only, 64-row blocks) and 3960 -> 3802 (W8A8, 32-row blocks). Below it, untimed: 0.
BLOCK_GROUP_MIN_TOKENS, BLOCK_GROUP = 1024, 8


def block_group(T: int) -> int:
    """`_block_tile`'s GROUP_B for a batch of T tokens: 0 (the blocks fastest: at decode sizes
    each touched expert is one or two blocks, read once either way), or BLOCK_GROUP from
    BLOCK_GROUP_MIN_TOKENS on, where an expert spans several blocks."""
    return BLOCK_GROUP if T >= BLOCK_GROUP_MIN_TOKENS else 0


def fused_moe_blocked(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor, block_m: int = 16, w13_scale: torch.Tensor | None = None,
                      w2_scale: torch.Tensor | None = None, block: int = 128, a8: bool = False,
                      defer_sum: bool = False, group_b: int | None = None,
                      aligned: tuple[torch.Tensor, torch.Tensor] | None = None,
                      left_out: bool = False) -> torch.Tensor | PairRows:
    """Routed-expert output `[T, D]`: pairs sorted by expert into blocks of block_m rows, so each
    expert's weights are read once per block. ids / weights `[T, kt]` are every pair a token
    takes, folded shared experts included (`MoE._with_shared`).
    Experts in x's dtype, or FP8 (float8 e4m3) with `w13_scale` / `w2_scale` as in
    `fused_moe_small`: the kernels scale each tile's product as they go (weight-only: x stays in
    its dtype, no dequantized copy of the weights).
    `a8` (FP8 experts with 128x128 blocks only): W8A8, as the dense W8A8 GEMMs (models/fp8_gemm.py):
    x, and the gate/up output h in a pass of its own, are quantized per token (per pair for h) in
    128-wide groups by `act_quant`, and the kernels multiply FP8 by FP8 on the tensor cores, each
    tile's product scaled per row by the activation scales and per column by the weight scales.
    `defer_sum`: the pair rows unsummed, as `fused_moe_small`'s.
    `group_b`: the programs' order (`_block_tile`'s GROUP_B); None: `block_group(T)`.
    `aligned`: the blocks (rows, bexp) as `align_pairs(ids, E, block_m)` gives them, already made
    with the choice (models/route_align.py).
    `left_out`: ids may be >= E, the experts' count (expert parallelism: pairs another rank
    computes); such pairs are in no block and out of the sum."""
    run = _BlockedMoE(x, w13, w2, ids.shape[1], w13_scale, w2_scale, block, a8, group_b)
    E = w13.shape[0]
    rows, bexp = aligned if aligned is not None else align_pairs(ids, E, block_m)
    run.launch(rows, bexp, weights.contiguous().flatten(), E, block_m)
    return sum_pairs(run.part, run.x.dtype, run.kt, defer_sum, (ids, E) if left_out else None)


# The shared experts' block depth in `fused_moe_blocked_overlapped`: every token takes them, so
# their blocks are full, and deeper blocks read each tile of their weights fewer times. On the H200
# (scripts/bench_moe_stream.py, V2-Lite, CUDA graphs over 6 layers, µs per MoE layer, one stream
# against two with the shared experts in blocks of the routed block_m / 32 / 64 / 128 rows):
# 8 tokens 159.8-161.7 against 159.0 / 160.6 / 158.3 / 160.0; 32: 263.7-263.9 against 259.9 /
# 260.9 / 258.3 / 261.1; 128: 296.0 against 302.5 / 289.4 / 287.7 / 287.4; 256: 312.0 against
# 317.2 / 317.6 (32 = block_m) / 303.4 / 304.8.
SHARED_BLOCK_M = 64


def fused_moe_blocked_overlapped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, route, k: int,
                                 n_shared: int, stream: torch.cuda.Stream | None, block_m: int = 16,
                                 w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                                 block: int = 128, defer_sum: bool = False, group_b: int | None = None,
                                 shared_block_m: int = SHARED_BLOCK_M,
                                 shared_x: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | PairRows:
    """`fused_moe_blocked` with the routing done here and the shared experts' blocks off its path.
    The shared experts are the last n_shared of w13 / w2, and every token takes them, so their
    blocks need no sort: one small kernel writes them (`_shared_blocks_kernel`), and it and the
    shared blocks' two product kernels go to `stream` first. Meanwhile the current stream runs
    `route()` -> (weights, ids) `[T, k + n_shared]` (the shared columns last, as the Triton router
    appends them; their weights are not read), sorts the routed pairs alone into blocks (unless
    route() gave them too: (weights, ids, rows, bexp), as `align_pairs(ids, E - n_shared, block_m,
    max_pairs=T * k)` would) and runs their product kernels; it waits for `stream` before the
    pair sum.

    The shared experts' blocks are `shared_block_m` rows deep (SHARED_BLOCK_M, above). With
    `shared_block_m` = block_m every pair row is computed as `fused_moe_blocked` computes it (the
    shared blocks then hold the same pairs in the same order as its sort gives them, and both
    launches key the autotuner alike) and the rows are summed in the same order: the same output
    bits. With other depths the shared rows' products are tiled otherwise (on the tensor cores,
    possibly another rounding of the same sums).
    Not for W8A8 (`a8`): its activation pass quantizes all pair rows of h at once.
    `shared_x`: called first on `stream`, it launches what computes the shared experts' input
    and returns it (x's shape and dtype, allocated before this call), while x is what `route()`
    writes on the current stream before it returns (moe_norm_in_router_max_tokens: the add +
    norm inside the router's logits kernel for the routed pairs, a norm kernel of its own for the
    shared experts, so that their stream forks before the router's first launch).
    Nothing is allocated on `stream` (the shared blocks, h and the pair rows are the current
    stream's, which waits for `stream` before it uses or frees them, also when the router or a
    launch raises; only the autotuner's first, eager timing runs allocate there), so this is
    CUDA-graph capture safe. `stream` None (CPU tests): everything on the current stream, the
    shared blocks first."""
    E = w13.shape[0]
    if not 1 <= n_shared < E:
        raise ValueError(f"fused_moe_blocked_overlapped needs 1 <= n_shared < {E} experts, got {n_shared}")
    T, kt = x.shape[0], k + n_shared
    run = _BlockedMoE(x, w13, w2, kt, w13_scale, w2_scale, block, False, group_b)
    sbm = shared_block_m
    nbt = triton.cdiv(T, sbm)
    s_rows = torch.empty(n_shared * nbt * sbm, dtype=torch.int64, device=x.device)
    s_bexp = torch.empty(n_shared * nbt, dtype=torch.int64, device=x.device)
    s_pw = torch.empty(T * kt, dtype=torch.float32, device=x.device)  # only the shared slots are written and read

    def shared() -> None:
        xs = None if shared_x is None else shared_x()
        if nbt:
            _shared_blocks_kernel[(n_shared * nbt,)](s_rows, s_bexp, s_pw, T, kt, k, E - n_shared, nbt,
                                                     BLOCK_M=sbm, **pdl_launch())
        run.launch(s_rows, s_bexp, s_pw, E, sbm, x=xs)

    main = None if stream is None else torch.cuda.current_stream(x.device)
    try:
        if main is None:
            shared()
        else:
            stream.wait_stream(main)  # x (and the buffers' memory) ready
            with torch.cuda.stream(stream):
                shared()
        weights, ids, *aligned = route()
        if ids.shape != (T, kt) or weights.shape != (T, kt):
            raise ValueError(f"route() gave weights {tuple(weights.shape)} and ids {tuple(ids.shape)}, "
                             f"expected [{T}, {kt}] (k routed choices, then the {n_shared} shared experts)")
        # the shared ids land past the bins: not sorted, and no blocks are bounded for them
        rows, bexp = aligned or align_pairs(ids, E - n_shared, block_m, max_pairs=T * k)
        run.launch(rows, bexp, weights.contiguous().flatten(), E - n_shared, block_m)
    finally:
        if main is not None:
            main.wait_stream(stream)  # joined on every path: the buffers outlive the side stream's kernels
    return sum_pairs(run.part, run.x.dtype, kt, defer_sum)


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _shared_blocks_kernel(rows_ptr, bexp_ptr, pw_ptr, T, KT, K, E_FIRST, NBT, BLOCK_M: tl.constexpr,
                          PDL: tl.constexpr):
    """Block b of the shared experts' blocks (NBT per shared expert, shared expert s = b // NBT):
    the pairs t * KT + K + s of its BLOCK_M tokens, ascending (-1 past T), as `align_pairs` sorts
    them; its expert E_FIRST + s; weight 1 in those pairs' slots of pw."""
    pdl_prologue(PDL)
    b = tl.program_id(0)
    s = b // NBT
    t = (b % NBT) * BLOCK_M + tl.arange(0, BLOCK_M)
    real = t < T
    pair = t.to(tl.int64) * KT + K + s
    tl.store(rows_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M), tl.where(real, pair, -1))
    tl.store(bexp_ptr + b, (E_FIRST + s).to(tl.int64))
    tl.store(pw_ptr + pair, tl.full([BLOCK_M], 1.0, tl.float32), mask=real)


class _BlockedMoE:
    """The block MoE's checks, scales and buffers for one call: h `[T*kt, I]` and the fp32 pair
    rows `[T*kt, D]`, indexed by pair t*kt + j; `launch` runs the two product kernels over the
    blocks it is given, writing those blocks' pairs' rows."""

    def __init__(self, x, w13, w2, kt: int, w13_scale, w2_scale, block: int, a8: bool, group_b: int | None):
        T, D = x.shape
        I = w2.shape[-1]
        scaled, self.s13, self.s2 = _expert_scales(x, w13, w2, w13_scale, w2_scale, block)
        wdt = FP8 if scaled else x.dtype
        if w13.shape[-2:] != (2 * I, D) or w2.shape[-2:] != (D, I) or w13.dtype != wdt or w2.dtype != wdt:
            raise ValueError(f"expert weights {tuple(w13.shape)} {w13.dtype} / {tuple(w2.shape)} {w2.dtype} do not "
                             f"match x {tuple(x.shape)} {x.dtype} (expected {wdt} weights)")
        if a8 and not scaled:
            raise ValueError("fused_moe_blocked(a8=True) needs FP8 experts (w13_scale / w2_scale); "
                             "experts in x's dtype take a8=False")
        if a8 and block != ACT_GROUP:
            raise ValueError(f"fused_moe_blocked(a8=True): the activations are quantized in {ACT_GROUP}-wide "
                             f"groups, so the weights' blocks must be {ACT_GROUP}x{ACT_GROUP}, not {block}x{block}")
        if scaled and any(block % bk for bk in _BLOCKED_K_FP8):
            raise ValueError(f"FP8 experts with {block}x{block} blocks: the block kernels' k tiles {_BLOCKED_K_FP8} "
                             f"must divide the block")
        self.x, self.w13, self.w2, self.kt, self.scaled, self.a8 = x.contiguous(), w13, w2, kt, scaled, a8
        self.h = torch.empty(T * kt, I, dtype=x.dtype, device=x.device)
        self.part = torch.empty(T * kt, D, dtype=torch.float32, device=x.device)
        self.xq, self.sx = act_quant(self.x) if a8 else (self.x, self.x)  # sx [T, D/128], any strides
        self.const = dict(QB=block, SCALED=scaled, A8=a8, IEEE=x.dtype == torch.float32,
                          GROUP_B=block_group(T) if group_b is None else group_b, **pdl_launch())

    def launch(self, rows: torch.Tensor, bexp: torch.Tensor, pw: torch.Tensor, e_limit: int, block_m: int,
               x: torch.Tensor | None = None) -> None:
        """The product kernels over the blocks of block_m rows `rows` / `bexp` (`align_pairs`'
        layout; blocks of expert >= e_limit are skipped), pair weights `pw` by pair index. `x`:
        these blocks' tokens' rows, instead of the call's (the same shape and dtype, contiguous;
        not with a8, whose quantized rows are the call's)."""
        xq = self.xq
        if x is not None:
            if self.a8 or x.shape != self.x.shape or x.dtype != self.x.dtype or not x.is_contiguous():
                raise ValueError(f"_BlockedMoE.launch: x {tuple(x.shape)} {x.dtype} for a call on "
                                 f"{tuple(self.x.shape)} {self.x.dtype} (contiguous, not W8A8)")
            xq = x
        w13, w2, s13, s2 = self.w13, self.w2, self.s13, self.s2
        T, D = self.x.shape
        I, nb, a8 = w2.shape[-1], bexp.numel(), self.a8
        r13, c13 = (s13.shape[1], s13.shape[2]) if self.scaled else (1, 1)
        r2, c2 = (s2.shape[1], s2.shape[2]) if self.scaled else (1, 1)
        sx_strides = (self.sx.stride(0), self.sx.stride(1)) if a8 else (0, 0)
        bucket = triton.next_power_of_2(T)
        up_args = (xq, self.sx, rows, bexp, w13, s13, self.h, D, I, e_limit, self.kt, bucket, r13, c13,
                   *sx_strides, nb)
        if not autotuning():
            t = _BLOCKED_INTERPRET if interpreting() else _BLOCKED_FIXED
            up = _blocked_gate_up_kernel[(nb * triton.cdiv(I, t["BLOCK_N"]),)]
            down = _blocked_down_kernel[(nb * triton.cdiv(D, t["BLOCK_N"]),)]
        else:
            t = {}
            tuned_up, tuned_down = ((_blocked_gate_up_w8a8_tuned, _blocked_down_w8a8_tuned) if a8 else
                                    (_blocked_gate_up_fp8_tuned, _blocked_down_fp8_tuned) if self.scaled else
                                    (_blocked_gate_up_tuned, _blocked_down_tuned))
            up = tuned_up[lambda m: (nb * triton.cdiv(I, m["BLOCK_N"]),)]
            down = tuned_down[lambda m: (nb * triton.cdiv(D, m["BLOCK_N"]),)]
        const = dict(self.const, BLOCK_M=block_m)
        up(*up_args, **const, **t)
        # per pair row; the rows of pairs in no block (expert parallelism's other ranks') hold no
        # value, and their quantized rows are never read
        hq, sh = act_quant(self.h) if a8 else (self.h, self.h)
        sh_strides = (sh.stride(0), sh.stride(1)) if a8 else (0, 0)
        down_args = (hq, sh, rows, bexp, pw, w2, s2, self.part, D, I, e_limit, bucket, r2, c2, *sh_strides, nb)
        down(*down_args, **const, **t)


# the autotuned kernels, by name, for fused_moe.tuned_configs
TUNED = {"blocked_gate_up": _blocked_gate_up_tuned, "blocked_down": _blocked_down_tuned,
         "blocked_gate_up_fp8": _blocked_gate_up_fp8_tuned, "blocked_down_fp8": _blocked_down_fp8_tuned,
         "blocked_gate_up_w8a8": _blocked_gate_up_w8a8_tuned, "blocked_down_w8a8": _blocked_down_w8a8_tuned}
