"""y = x @ W^T for a few rows of x (decode), as one Triton kernel that streams W at bandwidth.

At batch 1 a decode step's attention projections are GEMVs: on the H200 cuBLAS ran the fused
q/kv_a projection (V2-Lite: 3648 x 2048 bf16, 15 MB) and o_proj (2048 x 2048, 8 MB) at 5.9 µs
each, ~1.9 TB/s together, where the copy bandwidth is ~4.3 TB/s. Here each program owns BLOCK_N
output columns and reads their weight rows over the whole K once, BLOCK_K at a time; x's rows
(up to 16) are padded to 16 so that the product is a tensor-core dot, which is what makes the
compiler pipeline the weight loads (num_stages tiles in flight), as in models/fused_moe.py.
Accumulation in fp32 (IEEE for fp32 models), one rounding to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from models.fused import autotuning, interpreting

MAX_ROWS = 16


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   IEEE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.arange(0, 16)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mm = offs_m < M
    mn = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_rows + offs_k[None, :], mask=mm[:, None], other=0.0)
            w = tl.load(w_rows + offs_k[None, :], mask=mn[:, None], other=0.0)
        else:
            mk = offs_k < K
            x = tl.load(x_rows + offs_k[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
            w = tl.load(w_rows + offs_k[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    y = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & mn[None, :])


# (BLOCK_N, BLOCK_K, warps, stages), tuned per (N, K, dtype): narrow column tiles so that even
# N = 2048 fills the GPU (2048 / 16 = 128 programs on 132 SMs), deep pipelines of K tiles.
_TILES = [(16, 128, 4, 6), (16, 256, 4, 4), (16, 512, 4, 3), (32, 128, 4, 5), (32, 256, 4, 4),
          (32, 256, 8, 3), (64, 128, 4, 4), (64, 256, 8, 3)]
_CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s) for n, k, w, s in _TILES]
_tuned = triton.autotune(configs=_CONFIGS, key=["N", "K", "IEEE", "EVEN_K"])(_skinny_kernel)
_FIXED = dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4)  # DSV_AUTOTUNE=0
_INTERPRET = dict(BLOCK_N=16, BLOCK_K=32)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` for x `[M, K]` with M <= MAX_ROWS (rows may be strided, the last dim
    contiguous), weight `[N, K]` contiguous of x's dtype -> `[M, N]`."""
    M, K = x.shape
    N = weight.shape[0]
    if (M > MAX_ROWS or weight.shape[1] != K or weight.dtype != x.dtype or x.stride(-1) != 1
            or not weight.is_contiguous() or x.dtype not in (torch.bfloat16, torch.float16, torch.float32)):
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype} "
                         f"(at most {MAX_ROWS} rows, one dtype, contiguous weight)")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    const = dict(IEEE=x.dtype == torch.float32)
    if autotuning():
        const["EVEN_K"] = all(K % k == 0 for _, k, _, _ in _TILES)
        _tuned[lambda m: (triton.cdiv(N, m["BLOCK_N"]),)](x, weight, y, M, N, K, x.stride(0), weight.stride(0),
                                                         y.stride(0), **const)
    else:
        t = _INTERPRET if interpreting() else _FIXED
        _skinny_kernel[(triton.cdiv(N, t["BLOCK_N"]),)](x, weight, y, M, N, K, x.stride(0), weight.stride(0),
                                                       y.stride(0), EVEN_K=K % t["BLOCK_K"] == 0, **const, **t)
    return y
