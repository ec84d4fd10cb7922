"""Fused MoE for few tokens (decode): three Triton kernels instead of ~18 torch ops per layer.

At batch 1-8 the routed experts are T*k matrix-vector products that read each chosen expert's
weights once; the grouped-GEMM path spends more time in its glue (sort, gather, scatter) than in
the products. Each token has k routed pairs plus n_shared pairs for the shared experts folded
into the weights (`MoE`, stacked at load, weight 1). Here:
  kernel 1, one program per (token-expert pair, tile of I): h = silu(x W_gate^T) * (x W_up^T)
  kernel 2, one program per (token-expert pair, tile of D): p = w * (h W2^T), fp32
  kernel 3, one program per (token, tile of D): out = sum of the token's pair partials, in the
  output dtype (no atomics, so deterministic; no zero-fill); or none, the partials left to the
  next residual add + RMSNorm, which sums them the same way (`defer_sum`, common.fused.PairRows).
Kernels 1 and 2 use tensor-core products on the token's row padded to 16: the padding costs
compute nobody waits for and lets the compiler pipeline the weight loads (7-10% faster at 1-8
tokens on the H200 than the CUDA-core GEMV version they replaced, RESULTS.md).
Weights: w13 `[E, 2I, D]` (gate rows then up rows), w2 `[E, D, I]`; accumulation in fp32. FP8
expert weights with 128 x 128 block scales are dequantized tile by tile inside the kernels.

Both kernels are weight-streaming GEMVs: the time is the chosen experts' bytes over the memory
bandwidth if enough bytes are in flight. At batch 1 there are only k pairs, so the tile shapes
decide how many programs cover the SMs; on CUDA they are autotuned per (D, I, k, batch bucket,
pair slots a launch) on first use (outside CUDA-graph capture: the graph warm-up runs each bucket eagerly first). The
interpreter (CPU tests) uses one fixed tile set.

Medium batches take the expert-sorted block kernels of models/blocked_moe.py; the grouped-GEMM
path's elementwise glue for large batches is in models/grouped_glue.py.
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


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b on tensor cores; IEEE fp32 products for fp32 models (no TF32)."""
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _scaled_mma(a, w, s_rows, k0, mask_n, QB: tl.constexpr, IEEE: tl.constexpr, ROWS: tl.constexpr,
                COLS: tl.constexpr):
    """a `[ROWS, K]` @ w `[COLS, K]`^T for an FP8 weight tile w (converted to a's dtype for the
    tensor cores), times each weight row's block scale at k tile k0: `s_rows` `[COLS]` points at
    the rows' scale rows, and the tile lies in one scale column (its width divides QB)."""
    p = _mma(a, tl.trans(w.to(a.dtype)), tl.zeros([ROWS, COLS], dtype=tl.float32), IEEE)
    return p * tl.load(s_rows + k0 // QB, mask=mask_n, other=0.0)[None, :]


@triton.jit
def _pair(pid, ids_ptr, E_R, K_TOP: tl.constexpr, NS: tl.constexpr, J0: tl.constexpr, JN: tl.constexpr):
    """(token, pair slot, expert, row) of program `pid`: each token has K_TOP routed pairs, then
    NS shared-expert pairs (experts E_R.. E_R+NS-1, weight 1) when shared experts are folded into
    the weights. A launch covers slots J0.. J0+JN-1 of every token (all K_TOP + NS of them, or the
    routed and the shared ones apart); `row` (token * (K_TOP + NS) + slot) indexes h and the pair
    rows whichever launch writes them."""
    tok = pid // JN
    j = J0 + pid % JN
    row = tok * (K_TOP + NS) + j
    if NS > 0:
        e = tl.where(j < K_TOP, tl.load(ids_ptr + tok * K_TOP + j, mask=j < K_TOP, other=0), E_R + j - K_TOP)
    else:
        e = tl.load(ids_ptr + row)
    return tok, j, e.to(tl.int64), row


@triton.jit
def _gate_up_dot_kernel(x_ptr, ids_ptr, w13_ptr, s13_ptr, h_ptr, D, I, E_R, T_BUCKET, S_ROWS, S_COLS,
                        K_TOP: tl.constexpr, NS: tl.constexpr, J0: tl.constexpr, JN: tl.constexpr,
                        QB: tl.constexpr, SCALED: tl.constexpr, IEEE: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PDL: tl.constexpr, LEFT_OUT: tl.constexpr = False):
    """The gate/up GEMV as tensor-core products: the token's row padded to 16 (rows 1-15 zero).
    The padding costs compute nobody waits for; what it buys is the compiler's software
    pipeline for loads that feed a dot (num_stages tiles in flight per program). LEFT_OUT: a pair
    whose expert id is >= E_R (expert parallelism: another rank's) is skipped."""
    pdl_prologue(PDL)
    nb = tl.program_id(1)
    tok, _, e, row = _pair(tl.program_id(0), ids_ptr, E_R, K_TOP, NS, J0, JN)
    if LEFT_OUT:
        if e >= E_R:
            return
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    row0 = (tl.arange(0, 16) == 0)[:, None]
    acc_g = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    w_base = w13_ptr + e * (2 * I) * D
    s_g = s13_ptr + e * S_ROWS * S_COLS + (offs_n // QB) * S_COLS  # SCALED: [BLOCK_N] gate rows' scale rows
    s_u = s13_ptr + e * S_ROWS * S_COLS + ((I + offs_n) // QB) * S_COLS
    for k0 in range(0, D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < D
        xv = tl.load(x_ptr + tok * D + offs_k[None, :] + 0 * row0, mask=row0 & mask_k[None, :], other=0.0)
        m = mask_n[:, None] & mask_k[None, :]
        wg = tl.load(w_base + offs_n[:, None] * D + offs_k[None, :], mask=m, other=0.0)
        wu = tl.load(w_base + (I + offs_n[:, None]) * D + offs_k[None, :], mask=m, other=0.0)
        if SCALED:  # BLOCK_K divides QB: one scale a weight row in this k tile, on the tile's product
            acc_g += _scaled_mma(xv, wg, s_g, k0, mask_n, QB, IEEE, 16, BLOCK_N)
            acc_u += _scaled_mma(xv, wu, s_u, k0, mask_n, QB, IEEE, 16, BLOCK_N)
        else:
            acc_g = _mma(xv, tl.trans(wg), acc_g, IEEE)
            acc_u = _mma(xv, tl.trans(wu), acc_u, IEEE)
    g = tl.sum(acc_g, axis=0)
    h = g / (1.0 + tl.exp(-g)) * tl.sum(acc_u, axis=0)
    tl.store(h_ptr + row * I + offs_n, h.to(h_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _down_dot_kernel(h_ptr, ids_ptr, wts_ptr, w2_ptr, s2_ptr, part_ptr, D, I, E_R, T_BUCKET, S_ROWS, S_COLS,
                     K_TOP: tl.constexpr, NS: tl.constexpr, J0: tl.constexpr, JN: tl.constexpr,
                     QB: tl.constexpr, SCALED: tl.constexpr, IEEE: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PDL: tl.constexpr, LEFT_OUT: tl.constexpr = False):
    """A pair's down GEMV times its weight, into its fp32 pair row (LEFT_OUT: as gate/up's)."""
    pdl_prologue(PDL)
    db = tl.program_id(1)
    offs_n = db * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < D
    tok, j, e, row = _pair(tl.program_id(0), ids_ptr, E_R, K_TOP, NS, J0, JN)
    if LEFT_OUT:
        if e >= E_R:
            return
    wt = tl.load(wts_ptr + tok * K_TOP + j, mask=j < K_TOP, other=1.0).to(tl.float32)
    row0 = (tl.arange(0, 16) == 0)[:, None]
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    s_n = s2_ptr + e * S_ROWS * S_COLS + (offs_n // QB) * S_COLS  # SCALED: [BLOCK_N]
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < I
        hv = tl.load(h_ptr + row * I + offs_k[None, :] + 0 * row0, mask=row0 & mask_k[None, :], other=0.0)
        m = mask_n[:, None] & mask_k[None, :]
        w = tl.load(w2_ptr + e * D * I + offs_n[:, None] * I + offs_k[None, :], mask=m, other=0.0)
        if SCALED:  # as in the gate/up kernel: the k tile's product scaled per weight row
            acc += _scaled_mma(hv, w, s_n, k0, mask_n, QB, IEEE, 16, BLOCK_N)
        else:
            acc = _mma(hv, tl.trans(w), acc, IEEE)
    tl.store(part_ptr + row * D + offs_n, wt * tl.sum(acc, axis=0), mask=mask_n)


@fast_launch
@triton.jit
def _sum_pairs_kernel(part_ptr, ids_ptr, out_ptr, D, E, KT: tl.constexpr, BLOCK: tl.constexpr,
                      LEFT_OUT: tl.constexpr, PDL: tl.constexpr):
    """out[t] = sum of token t's KT partial rows (fp32), in the output dtype: one launch where
    torch took a strided reduction and a cast (~5 µs at batch 1 on the H200). LEFT_OUT: rows of
    pairs whose id (ids [T*KT]) is >= E were not computed (expert parallelism: another rank's) and
    are not read."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < D
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(KT):
        mj = m
        if LEFT_OUT:  # the pair's id, broadcast over the row
            mj = m & (offs * 0 + tl.load(ids_ptr + t * KT + j) < E)
        acc += tl.load(part_ptr + (t * KT + j) * D + offs, mask=mj, other=0.0)
    tl.store(out_ptr + t * D + offs, acc.to(out_ptr.dtype.element_ty), mask=m)


_INTERPRET_TILES = {"BLOCK_N": 32, "BLOCK_K": 128}
_FIXED_TILES = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)  # autotune=0: among the H200's picks


# Candidate tiles (BLOCK_N, BLOCK_K, warps, stages), autotuned per (D, I, k, batch bucket, pair
# slots a launch); bench_fused_moe.py prints the choice. Deep pipelines of moderate tiles: at T = 1 the
# gate/up grid is k * I / BLOCK_N programs (6 * 22 = 132 at BLOCK_N 64 on V2-Lite).
_DOT_TILES = [(16, 128, 4, 4), (16, 256, 4, 4), (32, 128, 4, 4), (32, 128, 4, 6), (32, 256, 4, 3),
              (64, 64, 4, 6), (64, 128, 4, 4), (64, 128, 8, 5), (128, 64, 4, 5), (128, 128, 8, 3)]
_DOT_CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st) for n, k, w, st in _DOT_TILES]
_DOT_KEY = ["D", "I", "T_BUCKET", "K_TOP", "NS", "JN", "SCALED", "IEEE"]
_gate_up_dot_tuned = triton.autotune(configs=_DOT_CONFIGS, key=_DOT_KEY)(_gate_up_dot_kernel)
_down_dot_tuned = triton.autotune(configs=_DOT_CONFIGS, key=_DOT_KEY)(_down_dot_kernel)
# FP8 experts scale each k tile's product by its weight rows' block scales, so BLOCK_K must divide
# the quantization block (128 in every DeepSeek FP8 checkpoint): their own autotuners, without the
# 256-wide k tiles. (Dequantizing each weight element with a gathered scale instead ran at ~0.2
# TB/s on an H100: 1,350 µs a V2-Lite layer's gate/up at batch 8.)
_DOT_TILES_FP8 = [t for t in _DOT_TILES if 128 % t[1] == 0]
_DOT_K_FP8 = sorted({t[1] for t in _DOT_TILES_FP8} | {_FIXED_TILES["BLOCK_K"], _INTERPRET_TILES["BLOCK_K"]})
_DOT_CONFIGS_FP8 = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st)
                    for n, k, w, st in _DOT_TILES_FP8]
_gate_up_dot_fp8_tuned = triton.autotune(configs=_DOT_CONFIGS_FP8, key=_DOT_KEY)(_gate_up_dot_kernel)
_down_dot_fp8_tuned = triton.autotune(configs=_DOT_CONFIGS_FP8, key=_DOT_KEY)(_down_dot_kernel)


def _expert_scales(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
                   w2_scale: torch.Tensor | None, block: int) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """(FP8?, w13 scales, w2 scales) as the kernels read them (fp32, contiguous; x where unread),
    after checking that the scales fit the weights' block grid."""
    scaled = w13_scale is not None
    if scaled != (w2_scale is not None):
        raise ValueError("FP8 experts need both w13_scale and w2_scale")
    if not scaled:
        return False, x, x
    E, D, I = w13.shape[0], w2.shape[-2], w2.shape[-1]
    want13 = (E, triton.cdiv(2 * I, block), triton.cdiv(D, block))
    want2 = (E, triton.cdiv(D, block), triton.cdiv(I, block))
    if I % block or tuple(w13_scale.shape) != want13 or tuple(w2_scale.shape) != want2:
        raise ValueError(f"FP8 expert scales {tuple(w13_scale.shape)} / {tuple(w2_scale.shape)} do not fit "
                         f"weights {tuple(w13.shape)} / {tuple(w2.shape)} with {block}x{block} blocks "
                         f"(expected {want13} / {want2}, and I % {block} == 0)")
    return True, w13_scale.float().contiguous(), w2_scale.float().contiguous()


def fused_moe_small(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                    w2_scale: torch.Tensor | None = None, block: int = 128,
                    n_shared: int = 0, defer_sum: bool = False, left_out: bool = False) -> torch.Tensor | PairRows:
    """Routed-expert output `[T, D]` for x `[T, D]`, ids / weights `[T, k]` (no host sync).

    `n_shared`: the last n_shared experts of w13 / w2 are shared experts folded in
    (`MoE`, stacked at load); every token also takes each of them with weight 1, so the output is
    routed + shared.
    FP8 experts (DeepSeek-V3/R1 checkpoints kept in FP8): w13 / w2 in float8 e4m3 with
    `w13_scale [E, ceil(2I/block), ceil(D/block)]` and `w2_scale [E, ceil(D/block), ceil(I/block)]`;
    the kernels dequantize each tile as they read it (weight-only: x stays in its dtype). I must
    be a multiple of `block` so that the up rows start on a block boundary.
    `defer_sum`: the pair rows unsummed (`PairRows`, for the next add + RMSNorm to sum), no
    pair-sum launch. `left_out`: ids may be >= E (expert parallelism: another rank's pairs, no
    shared experts folded in); those pairs are skipped and left out of the sum.
    """
    k = ids.shape[1]
    if left_out and n_shared:
        raise ValueError("fused_moe_small: left_out pairs with shared experts folded in")
    run = _SmallMoE(x, w13, w2, w13_scale, w2_scale, block, k, n_shared)
    run.launch(weights, ids, 0, k + n_shared, left_out=left_out)
    return sum_pairs(run.part, run.x.dtype, k + n_shared, defer_sum, (ids, w13.shape[0]) if left_out else None)


def fused_moe_small_overlapped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, route, k: int,
                               shared: tuple[torch.Tensor, torch.Tensor], stream: torch.cuda.Stream | None,
                               w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                               block: int = 128, defer_sum: bool = False,
                               shared_x: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | PairRows:
    """`fused_moe_small` with the routing done here and the shared experts' pairs off its path:
    their two kernels go to `stream` first, then `route()` -> (weights, ids) `[T, k]` and the
    routed pairs' kernels run on the current stream meanwhile, which waits for `stream` before the
    sum. `shared` is (ids, weights) `[1, n_shared]` of the shared experts, the last n_shared of
    w13 / w2 (the kernels read neither tensor for a shared pair: any int ids and float weights).
    Every pair row is computed as fused_moe_small computes it and summed in the same order: the
    output is the same bits where both launches take the same tiles (the fixed tiles always; the
    autotuner keys on the slots a launch covers, and its tiles differ only in how K is split
    into steps, which the tests' bit equality covers on the GPU). `shared_x`: called first on
    `stream`, it launches what computes the shared pairs' input and returns it, while x is what
    `route()` writes (as in `blocked_moe.fused_moe_blocked_overlapped`; `models.moe.SideNorm`).

    Nothing is allocated on `stream` (h and the pair rows are the current stream's, which waits
    for `stream` before it uses or frees them, also when the router or a launch raises), so this
    is CUDA-graph capture safe. `stream` None (CPU tests): everything on the current stream, the
    shared pairs first."""
    n_shared = shared[0].shape[1]
    if n_shared < 1 or shared[1].shape != shared[0].shape:
        raise ValueError(f"fused_moe_small_overlapped needs the shared experts' ids and weights [1, n_shared >= 1], "
                         f"got {tuple(shared[0].shape)} and {tuple(shared[1].shape)}")
    run = _SmallMoE(x, w13, w2, w13_scale, w2_scale, block, k, n_shared)

    def shared_pairs() -> None:
        run.launch(shared[1], shared[0], k, n_shared, x=None if shared_x is None else shared_x())

    main = None if stream is None else torch.cuda.current_stream(x.device)
    try:
        if main is None:
            shared_pairs()
        else:
            stream.wait_stream(main)  # x (and h / part's memory) ready
            with torch.cuda.stream(stream):
                shared_pairs()
        weights, ids = route()
        if ids.shape != (x.shape[0], k):
            raise ValueError(f"route() gave ids {tuple(ids.shape)}, expected [{x.shape[0]}, {k}]")
        run.launch(weights, ids, 0, k)
    finally:
        if main is not None:
            main.wait_stream(stream)  # joined on every path: h / part outlive the side stream's kernels
    return sum_pairs(run.part, run.x.dtype, k + n_shared, defer_sum)


class _SmallMoE:
    """The pair-parallel fused MoE's checks, scales and buffers for one call: h `[T*kt, I]` and
    the fp32 pair rows `[T*kt, D]` (kt = k + n_shared pairs a token); `launch` runs its two
    kernels over pair slots j0.. j0+jn-1 of every token."""

    def __init__(self, x, w13, w2, w13_scale, w2_scale, block: int, k: int, n_shared: int):
        T, D = x.shape
        I = w2.shape[-1]
        E = w13.shape[0]
        if w13.shape[-2:] != (2 * I, D) or w2.shape[-2:] != (D, I) or not 0 <= n_shared < E:
            raise ValueError(f"expert weights {tuple(w13.shape)} / {tuple(w2.shape)} do not match x "
                             f"{tuple(x.shape)} with {n_shared} shared experts")
        self.scaled, self.s13, self.s2 = _expert_scales(x, w13, w2, w13_scale, w2_scale, block)
        if self.scaled and any(block % bk for bk in _DOT_K_FP8):
            raise ValueError(f"FP8 experts with {block}x{block} blocks: the fused MoE's k tiles {_DOT_K_FP8} "
                             f"must divide the block")
        self.x, self.w13, self.w2 = x.contiguous(), w13, w2
        self.k, self.n_shared, self.block = k, n_shared, block
        kt = k + n_shared  # pairs per token
        self.h = torch.empty(T * kt, I, dtype=x.dtype, device=x.device)
        self.part = torch.empty(T * kt, D, dtype=torch.float32, device=x.device)

    def launch(self, weights: torch.Tensor, ids: torch.Tensor, j0: int, jn: int, x: torch.Tensor | None = None,
               left_out: bool = False) -> None:
        """The two kernels over pair slots j0.. j0+jn-1; `x`: these pairs' tokens' rows instead
        of the call's (the same shape and dtype, contiguous); `left_out`: pairs of ids >= the
        routed experts' count are skipped (their pair rows are not written)."""
        if x is None:
            x = self.x
        elif x.shape != self.x.shape or x.dtype != self.x.dtype or not x.is_contiguous():
            raise ValueError(f"_SmallMoE.launch: x {tuple(x.shape)} {x.dtype} for a call on {tuple(self.x.shape)} "
                             f"{self.x.dtype} (contiguous)")
        w13, w2, s13, s2 = self.w13, self.w2, self.s13, self.s2
        T, D = x.shape
        I, E = w2.shape[-1], w13.shape[0]
        ids, weights = ids.contiguous(), weights.contiguous()
        bucket = triton.next_power_of_2(T)
        r13, c13 = (s13.shape[1], s13.shape[2]) if self.scaled else (1, 1)
        r2, c2 = (s2.shape[1], s2.shape[2]) if self.scaled else (1, 1)
        e_r = E - self.n_shared
        up_args = (x, ids, w13, s13, self.h, D, I, e_r, bucket, r13, c13)
        down_args = (self.h, ids, weights, w2, s2, self.part, D, I, e_r, bucket, r2, c2)
        # fp32 models (the tiny test models on CUDA): exact products, not TF32
        const = dict(K_TOP=self.k, NS=self.n_shared, J0=j0, JN=jn, QB=self.block, SCALED=self.scaled,
                     IEEE=x.dtype == torch.float32, LEFT_OUT=left_out, **pdl_launch())
        if not autotuning():
            t = _INTERPRET_TILES if interpreting() else _FIXED_TILES
            _gate_up_dot_kernel[(T * jn, triton.cdiv(I, t["BLOCK_N"]))](*up_args, **const, **t)
            _down_dot_kernel[(T * jn, triton.cdiv(D, t["BLOCK_N"]))](*down_args, **const, **t)
        else:
            up, down = ((_gate_up_dot_fp8_tuned, _down_dot_fp8_tuned) if self.scaled
                        else (_gate_up_dot_tuned, _down_dot_tuned))
            up[lambda m: (T * jn, triton.cdiv(I, m["BLOCK_N"]))](*up_args, **const)
            down[lambda m: (T * jn, triton.cdiv(D, m["BLOCK_N"]))](*down_args, **const)


def sum_pairs(part: torch.Tensor, dtype: torch.dtype, kt: int, defer: bool,
              left_out: tuple[torch.Tensor, int] | None = None) -> torch.Tensor | PairRows:
    """The MoE output from its pair rows `part [T*kt, D]` (fp32): summed per token in `dtype`
    (one launch), or with `defer` left to the next add + RMSNorm (`PairRows`). `left_out` (ids
    `[T, kt]`, E): the rows of pairs with ids >= E were not computed and are skipped (not with
    `defer`)."""
    D = part.shape[-1]
    T = part.shape[0] // kt
    if defer:
        if left_out is not None:
            raise ValueError("sum_pairs: pairs left out cannot be summed by the next add + RMSNorm (defer)")
        return PairRows(part.view(T, kt, D), dtype)
    out = torch.empty(T, D, dtype=dtype, device=part.device)
    ids, E = (left_out[0].contiguous(), left_out[1]) if left_out is not None else (part, 0)
    _sum_pairs_kernel[(T, triton.cdiv(D, 1024))](part, ids, out, D, E, KT=kt, BLOCK=1024,
                                                 LEFT_OUT=left_out is not None, num_warps=4, **pdl_launch())
    return out


def tuned_configs() -> dict[str, str]:
    """What autotuning picked so far, per kernel and key (for benchmark logs), the block kernels'
    (models/blocked_moe.py) included."""
    from models import blocked_moe
    return {name: {str(key): str(cfg) for key, cfg in kern.cache.items()}
            for name, kern in (("gate_up", _gate_up_dot_tuned), ("down", _down_dot_tuned),
                               ("gate_up_fp8", _gate_up_dot_fp8_tuned), ("down_fp8", _down_dot_fp8_tuned),
                               *blocked_moe.TUNED.items())}

