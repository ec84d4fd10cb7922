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

The tiles are autotuned per (N, K) on CUDA on first use (outside CUDA-graph capture: the graph
warm-up runs each bucket eagerly first); autotune=0 takes one fixed tile; the interpreter (CPU
tests, fp32) a small one. Used by `models.layers.Linear` for weights kept in FP8 at up to the
plan's `fp8_gemm_w8a16_max_tokens` rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from common.launch_settings import autotuning, interpreting
from common.pdl import pdl_launch

MAX_ROWS = 16  # one row tile: the rows are the product's M, padded to 16
SCALE_BLOCK = 128  # the checkpoints' weight-scale block, rows and columns


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_sk, stride_ym,
                  IEEE: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  LATE: tl.constexpr = False):
    """Program n: y[:, cols] = x @ (Wq[cols, :] * s[cols // 128, k // 128])^T, fp32 sums. PDL: the
    successor may launch from the first statement on, or with LATE once the K loop is done."""
    if PDL:
        if not LATE:
            gdc_launch_dependents()
        gdc_wait()
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, 16)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = offs_m < M
    nmask = offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    s_row = s_ptr + ((pid_n * BLOCK_N) // 128) * stride_sn  # BLOCK_N divides 128: one scale row
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
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
    if PDL and LATE:
        gdc_launch_dependents()
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


# Candidate tiles (BLOCK_N, BLOCK_K, warps, stages): narrow column slices, so that a 2048-wide
# output still gives 64-128 programs, and K steps of 256-1024 one-byte weights, so that each SM
# keeps tens of KB in flight.
_TILES = [(16, 256, 4, 4), (16, 512, 4, 3), (16, 1024, 4, 3), (32, 256, 4, 4), (32, 512, 4, 3),
          (64, 256, 4, 3), (16, 512, 2, 4), (32, 1024, 8, 3)]
_CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s) for n, k, w, s in _TILES]
_w8a16_tuned = triton.autotune(configs=_CONFIGS, key=["N", "K", "IEEE"])(_w8a16_kernel)
_FIXED = dict(BLOCK_N=32, BLOCK_K=512, num_warps=4, num_stages=3)  # autotune=0
_INTERPRET = dict(BLOCK_N=16, BLOCK_K=64)
# When, under PDL, the kernel lets its successor launch: "late" (after its K loop, the
# default), "start" (its first statement, as the other PDL-aware kernels here) or "none"
# (launched without PDL: its successor launches at its end). Its grid is more programs than fit
# one wave, so an early successor's waiting programs hold SM slots its later programs need: on an
# H100 (V2-Lite, --quantization fp8) "start" lost to "late" at every batch from 1 to 16 (TPOT
# 3.211 against 2.838 ms at batch 1; docs/kernel_notes.md). Read at each launch, so
# scripts/bench_pdl_variants.py can set it per variant.
PDL_SIGNAL = "late"


def w8a16_linear(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                 tile: tuple[int, int] | None = None) -> torch.Tensor:
    """x `[M, K]` (M <= 16) @ dequant(wq `[N, K]` e4m3, sw `[ceil(N/128), ceil(K/128)]`)^T ->
    `[M, N]` in x's dtype; fp32 products are IEEE (no TF32). `tile` = (BLOCK_N, BLOCK_K) forces
    one (tests, benchmarks)."""
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
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    args = (x, wq, sw, y, M, N, K, x.stride(0), wq.stride(0), sw.stride(0), sw.stride(1), y.stride(0))
    const = dict(IEEE=x.dtype == torch.float32, **(pdl_launch() if PDL_SIGNAL != "none" else {"PDL": False}))
    if const["PDL"] and PDL_SIGNAL == "late":
        const["LATE"] = True
    if tile is not None or interpreting() or not autotuning():
        t = (dict(BLOCK_N=tile[0], BLOCK_K=tile[1]) if tile is not None
             else _INTERPRET if interpreting() else _FIXED)
        _w8a16_kernel[(triton.cdiv(N, t["BLOCK_N"]),)](*args, **const, **t)
    else:
        _w8a16_tuned[lambda m: (triton.cdiv(N, m["BLOCK_N"]),)](*args, **const)
    return y
