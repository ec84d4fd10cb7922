"""W8A8 block-FP8 GEMM (Triton), DeepSeek-V3's inference scheme.

Activations are quantized per token in groups of 128 along K (in torch, see act_quant) (`x = xq * sx[m, k // 128]`), weights
per 128 x 128 block (`W = Wq * sw[n // 128, k // 128]`), so

    y[m, n] = sum_kb  sx[m, kb] * sw[n // 128, kb] * sum_{k in kb} xq[m, k] * Wq[n, k]

with an fp8 tensor-core product per K block and the two scales applied to its fp32 partial sum.
Status: checked against dequantize-then-matmul under TRITON_INTERPRET=1 and on an H200
(tests/test_fp8_gemm.py, 2026-11-30); timed there at 0.55-1.66x of bf16 cuBLAS, 0.8x at M = 4096,
and slower end to end because act_quant runs as torch ops (RESULTS.md), so the engine uses it
only with `--fp8-gemm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from models.fp8 import FP8, FP8_MAX

GROUP = 128


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[M, K]` -> (fp8 `[M, K]`, fp32 scales `[M, ceil(K/128)]`), each group's amax at 448.

    Plain torch (three fused-able elementwise kernels, no host sync): Triton's interpreter
    rounds fp32 -> e4m3 wrongly at exponent boundaries (126.5 -> 64), which would make the CPU
    tests check the wrong thing.
    """
    M, K = x.shape
    ng = -(-K // GROUP)
    xp = x.float()
    if ng * GROUP != K:
        xp = torch.nn.functional.pad(xp, (0, ng * GROUP - K))
    g = xp.view(M, ng, GROUP)
    s = g.abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX  # [M, ng]
    q = (g / s.unsqueeze(-1)).view(M, ng * GROUP)[:, :K].to(FP8)
    return q.contiguous(), s


@triton.jit
def _w8a8_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, M, N, K, NKB,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mm, mn = offs_m < M, offs_n < N
    nblk = (pid_n * BN) // BK  # BN divides BK, so the tile sits inside one weight-scale row
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kb in range(0, NKB):
        offs_k = kb * BK + tl.arange(0, BK)
        mk = offs_k < K
        a = tl.load(a_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
        b = tl.load(b_ptr + offs_n[None, :] * K + offs_k[:, None], mask=mn[None, :] & mk[:, None], other=0.0)
        sa = tl.load(sa_ptr + offs_m * NKB + kb, mask=mm, other=0.0)  # [BM]
        sb = tl.load(sb_ptr + nblk * NKB + kb)  # scalar
        acc += tl.dot(a, b) * (sa[:, None] * sb)
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=mm[:, None] & mn[None, :])


def w8a8_block_gemm(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                    out_dtype: torch.dtype = torch.bfloat16, block_n: int = 64) -> torch.Tensor:
    """y `[M, N]` from fp8 xq `[M, K]` + sx `[M, K/128]` and fp8 wq `[N, K]` + sw `[N/128, K/128]`."""
    M, K = xq.shape
    N = wq.shape[0]
    if GROUP % block_n:
        raise ValueError(f"block_n {block_n} must divide the 128-wide weight-scale block")
    y = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    bm = 16 if M <= 16 else 64
    grid = (triton.cdiv(M, bm), triton.cdiv(N, block_n))
    _w8a8_kernel[grid](xq, sx, wq.contiguous(), sw.contiguous(), y, M, N, K, triton.cdiv(K, GROUP),
                       BM=bm, BN=block_n, BK=GROUP)
    return y


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """x `[..., K]` @ dequant(wq, sw)ᵀ with activations quantized on the fly."""
    shape = x.shape
    xq, sx = act_quant(x.reshape(-1, shape[-1]))
    return w8a8_block_gemm(xq, sx, wq, sw, x.dtype).view(*shape[:-1], wq.shape[0])
