"""y = x W^T for few rows (decode): one Triton kernel that streams the weight once.

At batch 1-16 a projection is a weight-streaming product: its time is W's bytes over the memory
bandwidth when enough bytes are in flight. cuBLAS picks 64-column tiles for these shapes and
leaves the H200 at a third to a half of its bandwidth on V2-Lite's projections (q + kv_a
3648 x 2048: 6.2-6.5 µs against a 3.5 µs floor; o_proj 2048 x 2048: 5.7 against 2.0;
`scripts/profile_graphs.py`). Here one program owns a BLOCK_N slice of the output columns and
walks K in deep-pipelined BLOCK_K steps; the rows (padded to 16, 32 or 64) are the tensor-core
product's M, so the padding costs arithmetic nobody waits for. The tiles are autotuned per
(N, K, row bucket) on CUDA on first use (outside CUDA-graph capture: the graph warm-up runs each
bucket eagerly first); the interpreter (CPU tests) uses one fixed tile.

Used by `models.layers.Linear` for bf16 / fp16 / fp32 weights up to the plan's
`gemm_skinny_max_tokens` rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.launch_settings import autotuning, interpreting
from common.pdl import pdl_launch, pdl_prologue


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                        M_BUCKET: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (column tile, row tile): y[rows, cols] = x[rows, :] @ W[cols, :]^T, fp32 sums."""
    pdl_prologue(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * M_BUCKET + tl.arange(0, M_BUCKET)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = offs_m < M
    nmask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([M_BUCKET, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc=acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc=acc)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


# Candidate tiles (BLOCK_N, BLOCK_K, warps, stages): narrow column slices so that a 2048-wide
# output still gives 64-128 programs, with K steps deep enough to keep ~64 KB per SM in flight.
_TILES = [(16, 256, 4, 4), (16, 512, 4, 3), (16, 128, 4, 6), (32, 256, 4, 4), (32, 128, 4, 6),
          (32, 512, 4, 3), (64, 128, 4, 4), (64, 256, 4, 3), (16, 256, 2, 4), (32, 256, 8, 4)]
_CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s) for n, k, w, s in _TILES]
_skinny_gemm_tuned = triton.autotune(configs=_CONFIGS, key=["N", "K", "M_BUCKET", "IEEE"])(_skinny_gemm_kernel)
_SMEM_BUDGET = 200 * 1024  # bytes of pipelined tiles the fixed tile may take (the H200 has 227 KB)
_INTERPRET = dict(BLOCK_N=16, BLOCK_K=32)


def row_bucket(m: int) -> int:
    """The rows of one program's tile: m padded to 16, 32 or 64 (more rows take several tiles)."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def fixed_tile(m_bucket: int, elem_bytes: int) -> dict:
    """The tile without autotuning (autotune=0): 32 columns, K steps of 256 (128 for fp32), and
    as many stages (2-4) as fit _SMEM_BUDGET (fp32 with 64 rows: 294 KB at 4 stages of 256)."""
    bn, bk = 32, 256 if elem_bytes <= 2 else 128
    stages = max(2, min(4, _SMEM_BUDGET // ((m_bucket + bn) * bk * elem_bytes)))
    return dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=stages)


def skinny_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x `[M, K]` @ w `[N, K]`^T -> `[M, N]` in x's dtype; fp32 products are IEEE (no TF32)."""
    M, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K or w.dtype != x.dtype or w.stride(1) != 1:
        raise ValueError(f"skinny_linear: weight {tuple(w.shape)} {w.dtype} (stride {w.stride()}) "
                         f"does not fit x {tuple(x.shape)} {x.dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    mb = row_bucket(M)
    args = (x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0))
    const = dict(M_BUCKET=mb, IEEE=x.dtype == torch.float32, **pdl_launch())
    if interpreting():
        _skinny_gemm_kernel[(triton.cdiv(N, _INTERPRET["BLOCK_N"]), triton.cdiv(M, mb))](*args, **const, **_INTERPRET)
    elif not autotuning():
        t = fixed_tile(mb, x.element_size())
        _skinny_gemm_kernel[(triton.cdiv(N, t["BLOCK_N"]), triton.cdiv(M, mb))](*args, **const, **t)
    else:
        _skinny_gemm_tuned[lambda m: (triton.cdiv(N, m["BLOCK_N"]), triton.cdiv(M, mb))](*args, **const)
    return y

