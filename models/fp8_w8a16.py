"""y = x @ dequant(Wq, s)^T for few rows: a block-FP8 weight streamed once, x kept in its dtype.

At decode sizes (up to 16 rows) a kept-FP8 projection is weight-bound, and the W8A8 path spends
three launches on it: act_quant, the split-K W8A8 GEMM and its split reduce (V2-Lite with
`--quantization fp8`, batch 1, one H100: 1.72 + 5.24 + 1.70 µs a projection, 106 projections a
step; `profile_ops.py -q fp8 --decode 1`). Here it is one launch and no activation quantization:
one program owns a BLOCK_N slice of the output columns for all rows (padded to 16, the
tensor-core product's M) and walks K in pipelined BLOCK_K steps; each e4m3 weight tile is scaled
by its 128 x 128 block's scale in fp32 and rounded to x's dtype in registers, which is what
`models.fp8.dequantize(..., x.dtype)` stores, so the result is the dequantized weight's product
up to the order of the fp32 sums (closer to the unquantized product than W8A8, whose activations
are rounded to e4m3 too). BLOCK_N divides 128, so a program's columns share one row of scales.

A narrow output (kv_a's 576 columns: 36 programs of 16) leaves most SMs idle, so the K range is
split as well when the column slices alone do not fill the GPU twice over: program (n, s) walks
split s's contiguous run of BLOCK_K steps and stores its fp32 partial; each column slice's last
program (counted on one atomic counter per slice, acquire-release) sums the partials in split
order, writes y and sets its counter back to 0, as the W8A8 split-K GEMM's serial reduce does
(models/fp8_gemm_splitk.py), so the result is the same bits whichever split finishes last, and
it stays one launch.

The tiles are autotuned per (N, K) on CUDA on first use (outside CUDA-graph capture: the graph
warm-up runs each bucket eagerly first); autotune=0 takes one fixed tile; the interpreter (CPU
tests, fp32) a small one. Used by `models.layers.Linear` for weights kept in FP8 at up to the
plan's `fp8_gemm_w8a16_max_tokens` rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.launch_settings import autotuning, interpreting
from common.pdl import pdl_launch, pdl_prologue
from models.fp8_gemm_splitk import tile_counters

MAX_ROWS = 16  # one row tile: the rows are the product's M, padded to 16
SCALE_BLOCK = 128  # the checkpoints' weight-scale block, rows and columns


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, s_ptr, y_ptr, p_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_sk,
                  stride_ym, IEEE: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (n, s): split s's part of y[:, cols] = x @ (Wq[cols, :] * s[cols // 128, k // 128])^T,
    fp32 sums; with one split (the grid's second size) the whole of it, stored as y. Else p_ptr is
    fp32 [splits, M, N] and cnt_ptr one zeroed int32 a column slice (see the module docstring)."""
    pdl_prologue(PDL)
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    steps = tl.cdiv(K, BLOCK_K)
    k_lo = (split * steps // splits) * BLOCK_K
    k_hi = ((split + 1) * steps // splits) * BLOCK_K
    offs_m = tl.arange(0, 16)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = offs_m < M
    nmask = offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    s_row = s_ptr + ((pid_n * BLOCK_N) // 128) * stride_sn  # BLOCK_N divides 128: one scale row
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        s = tl.load(s_row + (offs_k // 128) * stride_sk, mask=kmask, other=0.0)
        wd = (w.to(tl.float32) * s[None, :]).to(x_ptr.dtype.element_ty)
        if IEEE:
            acc = tl.dot(x, tl.trans(wd), acc=acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(wd), acc=acc)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = mmask[:, None] & nmask[None, :]
    if splits == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tile = offs_m[:, None] * N + offs_n[None, :]
        tl.store(p_ptr + split.to(tl.int64) * M * N + tile, acc, mask=mask)
        # every thread's partial stored before the one atomic (a CTA barrier, then the atomic's
        # release at GPU scope); the last program's acquire makes every split's partial visible
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if done == splits - 1:
            total = tl.zeros([16, BLOCK_N], tl.float32)
            for j in range(0, splits):  # split order: the same bits whichever split ends last; .cg: from L2
                total += tl.load(p_ptr + j * M * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)


# Candidate tiles (BLOCK_N, BLOCK_K, warps, stages): narrow column slices, so that a 2048-wide
# output still gives 64-128 programs, and K steps of 128-1024 one-byte weights, so that each SM
# keeps tens of KB in flight (the splits make up the rest of the grid).
_TILES = [(16, 256, 4, 4), (16, 512, 4, 3), (16, 1024, 4, 3), (32, 256, 4, 4), (32, 512, 4, 3),
          (64, 256, 4, 3), (16, 512, 2, 4), (32, 1024, 8, 3), (16, 128, 4, 4), (32, 128, 4, 4)]
PROGRAMS_PER_SM = 2  # the splits aim the grid at this many programs a SM


def choose_splits(n: int, k: int, block_n: int, block_k: int, num_sms: int | None) -> int:
    """K splits for an N-column output in BLOCK_N slices: enough that slices x splits fills the
    SMs PROGRAMS_PER_SM times, at most one BLOCK_K step each; 1 when the slices alone fill the
    SMs once, or with no SM count (not CUDA)."""
    slices = triton.cdiv(n, block_n)
    if num_sms is None or slices >= num_sms:
        return 1
    return max(1, min(triton.cdiv(PROGRAMS_PER_SM * num_sms, slices), triton.cdiv(k, block_k)))
_CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s) for n, k, w, s in _TILES]
_w8a16_tuned = triton.autotune(configs=_CONFIGS, key=["N", "K", "IEEE"])(_w8a16_kernel)
_FIXED = dict(BLOCK_N=32, BLOCK_K=512, num_warps=4, num_stages=3)  # autotune=0
_INTERPRET = dict(BLOCK_N=16, BLOCK_K=64)


def w8a16_linear(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                 tile: tuple[int, int] | None = None, splits: int | None = None) -> torch.Tensor:
    """x `[M, K]` (M <= 16) @ dequant(wq `[N, K]` e4m3, sw `[ceil(N/128), ceil(K/128)]`)^T ->
    `[M, N]` in x's dtype; fp32 products are IEEE (no TF32). `tile` = (BLOCK_N, BLOCK_K) forces
    one, `splits` the K splits (tests, benchmarks; else choose_splits')."""
    M, K = x.shape
    N = wq.shape[0]
    nb, kb = triton.cdiv(N, SCALE_BLOCK), triton.cdiv(K, SCALE_BLOCK)
    if M > MAX_ROWS:
        raise ValueError(f"w8a16_linear: {M} rows; at most {MAX_ROWS}")
    if wq.shape[1] != K or wq.dtype != torch.float8_e4m3fn or wq.stride(1) != 1 or tuple(sw.shape) != (nb, kb):
        raise ValueError(f"w8a16_linear: weight {tuple(wq.shape)} {wq.dtype} (stride {wq.stride()}) with "
                         f"scales {tuple(sw.shape)} does not fit x {tuple(x.shape)} and 128 x 128 blocks")
    if tile is not None and SCALE_BLOCK % tile[0]:
        raise ValueError(f"w8a16_linear: tile width {tile[0]} must divide the {SCALE_BLOCK}-row scale block")
    if x.stride(1) != 1:
        x = x.contiguous()
    if splits is not None and splits < 1:
        raise ValueError(f"w8a16_linear: {splits} splits")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else None
    fixed = tile is not None or interpreting() or not autotuning()
    if fixed:
        t = (dict(BLOCK_N=tile[0], BLOCK_K=tile[1]) if tile is not None
             else _INTERPRET if interpreting() else _FIXED)
        tiles = [(t["BLOCK_N"], t["BLOCK_K"])]
    else:
        tiles = [(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]) for c in _CONFIGS]

    def split_count(bn: int, bk: int) -> int:
        return min(splits, triton.cdiv(K, bk)) if splits is not None else choose_splits(N, K, bn, bk, sms)

    most = max(split_count(bn, bk) for bn, bk in tiles)
    # the partials and counters only where a tile splits (a 1-element stand-in otherwise)
    partials = torch.empty((most, M, N) if most > 1 else (1,), dtype=torch.float32, device=x.device)
    counters = tile_counters(x.device, triton.cdiv(N, min(bn for bn, _ in tiles))) if most > 1 else partials
    args = (x, wq, sw, y, partials, counters, M, N, K, x.stride(0), wq.stride(0), sw.stride(0), sw.stride(1),
            y.stride(0))
    const = dict(IEEE=x.dtype == torch.float32, **pdl_launch())
    if fixed:
        grid = (triton.cdiv(N, t["BLOCK_N"]), split_count(t["BLOCK_N"], t["BLOCK_K"]))
        _w8a16_kernel[grid](*args, **const, **t)
    else:
        _w8a16_tuned[lambda m: (triton.cdiv(N, m["BLOCK_N"]), split_count(m["BLOCK_N"], m["BLOCK_K"]))](*args, **const)
    return y
