"""The W8A8 block GEMM's cuBLAS backend (models/fp8_gemm.py picks it): cuBLAS's block-scaled FP8
GEMM (cuBLASLt 12.9+, Hopper; through torch._scaled_mm, whose scale shapes select the 1x128 /
128x128 recipe). It takes row counts that are multiples of 4 (probed on
the H200: 4, 8, 12, 16, 24, ..., 100, 1000 taken; 1, 2, 3, 5, 7, 15, 17, 33, 255,
257 refused), so other counts >= 4 are padded with zero rows. A shape cuBLAS refuses anyway
(CUBLAS_STATUS_NOT_SUPPORTED) is remembered and goes to Triton; any other error from this path
(a torch that does not know the block-wise recipe) raises: the warm-up names the kernel plan's
fp8_gemm=triton, which avoids it.
K must be a multiple of 4 x 128: with 1 or 2 K blocks (K 128, 256) the GEMM ran without an error
and returned wrong products on the H200 (relative error 0.7-0.9 against the emulated W8A8 at 4-200
rows, torch 2.11 / CUDA 13; right at 8 blocks and at R1's 12-144; 4 blocks, K 512, is checked by
tests/test_fp8_gemm.py's small-K GPU test). The weight scales' rows are
then 4 or 8 bytes long where the 1x128 activation scales need 16-byte strides (the rows-of-4 rule
above); shapes with a partial 16-byte scale row go to Triton.
"""

from __future__ import annotations

import functools

import torch

from models.fp8 import BLOCK as GROUP


@functools.lru_cache(maxsize=None)
def capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


MIN_ROWS = 4
K_BLOCKS = 4  # K / 128 must be a multiple of this
REFUSED: set[tuple] = set()  # (rows, N, K, out dtype)


def cublas_device_ok(t: torch.Tensor) -> bool:
    return t.is_cuda and hasattr(torch, "_scaled_mm") and capability(t.device.index) == (9, 0)


def cublas_rows(M: int) -> int:
    return -(-M // 4) * 4


def cublas_key(M: int, N: int, K: int, out_dtype: torch.dtype) -> tuple:
    return cublas_rows(M), N, K, out_dtype


def cublas_ok(xq: torch.Tensor, N: int, K: int, out_dtype: torch.dtype) -> bool:
    M = xq.shape[0]
    return (out_dtype in (torch.bfloat16, torch.float16) and N % GROUP == 0
            and K % (GROUP * K_BLOCKS) == 0 and M >= MIN_ROWS
            and cublas_key(M, N, K, out_dtype) not in REFUSED and cublas_device_ok(xq))


def cublas_gemm(xq, sx, wq, sw, out_dtype):
    M, K = xq.shape
    rows = cublas_rows(M)
    sa = sx
    # M-major scales with strides exactly (1, rows), as torch checks for the 1x128 recipe (the
    # Triton act_quant's layout: no copy then)
    if rows != M or (sx.shape[1] > 1 and sx.stride() != (1, M)):
        sa = torch.ones(sx.shape[1], rows, dtype=torch.float32, device=sx.device)
        sa[:, :M] = sx.t()
        sa = sa.t()
    if rows != M:
        xp = torch.empty(rows, K, dtype=xq.dtype, device=xq.device)
        xp[:M] = xq
        xp.view(torch.uint8)[M:] = 0  # fp8 zero is the zero byte
        xq = xp
    y = torch._scaled_mm(xq, wq.t(), sa, sw.t(), out_dtype=out_dtype)
    return y[:M] if rows != M else y
