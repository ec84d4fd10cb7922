"""W8A8 block-FP8 GEMM (Triton), DeepSeek-V3's inference scheme.

Activations are quantized per token in groups of 128 along K (`x = xq * sx[m, k // 128]`; one
Triton kernel on CUDA, see act_quant), weights
per 128 x 128 block (`W = Wq * sw[n // 128, k // 128]`), so

    y[m, n] = sum_kb  sx[m, kb] * sw[n // 128, kb] * sum_{k in kb} xq[m, k] * Wq[n, k]

with an fp8 tensor-core product per K block and the two scales applied to its fp32 partial sum.
Status: checked against dequantize-then-matmul under TRITON_INTERPRET=1 and on an H200
(tests/test_fp8_gemm.py, 2026-11-30); timed there at 0.55-1.66x of bf16 cuBLAS, 0.8x at M = 4096,
with one fixed 64 x 64 tile and act_quant in torch ops. Since then autotuned tiles per M range with
grouped program order (0.92-1.04x of bf16 at M = 4096) and act_quant as one Triton kernel (3-12x
faster than the torch ops), both timed on the H200 (RESULTS.md). The engine uses it only with
`--fp8-gemm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from models.fp8 import FP8, FP8_MAX
from models.fused import autotuning, interpreting

GROUP = 128


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[M, K]` -> (fp8 `[M, K]`, fp32 scales `[M, ceil(K/128)]`), each group's amax at 448.

    On CUDA one Triton kernel (one read of x, one write of q); elsewhere torch ops. The CPU tests
    cannot check the Triton version: the interpreter rounds fp32 -> e4m3 wrongly at exponent
    boundaries (126.5 -> 64). The GPU test compares it with the torch version bit for bit.
    """
    if x.is_cuda and not interpreting():
        return _act_quant_triton(x)
    return act_quant_torch(x)


def act_quant_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """act_quant in plain torch ops (no host sync); the reference for the Triton kernel."""
    M, K = x.shape
    ng = -(-K // GROUP)
    xp = x.float()
    if ng * GROUP != K:
        xp = torch.nn.functional.pad(xp, (0, ng * GROUP - K))
    g = xp.view(M, ng, GROUP)
    # times the fp32 reciprocal, not divided: torch on CUDA turns `/ scalar` into exactly this, on
    # the CPU it divides; written out, every device and the Triton kernel get the same bits
    s = g.abs().amax(dim=-1).clamp_min(1e-12) * (1.0 / FP8_MAX)  # [M, ng]
    q = (g / s.unsqueeze(-1)).view(M, ng * GROUP)[:, :K].to(FP8)
    return q.contiguous(), s


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, NG, FMAX: tl.constexpr, GROUP_SIZE: tl.constexpr,
                      GROUPS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g0 = tl.program_id(1) * GROUPS
    offs_g = g0 + tl.arange(0, GROUPS)
    offs = offs_g[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]  # [GROUPS, GROUP]
    m = offs < K
    x = tl.load(x_ptr + row * K + offs, mask=m, other=0.0).to(tl.float32)
    # Bit-equal to act_quant_torch: scale = amax times the fp32 reciprocal of FMAX, and an IEEE
    # division for q (Triton's `/` is approximate), so the fp8 rounding sees the same fp32 values.
    s = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) * (1.0 / FMAX)  # [GROUPS]
    q = tl.div_rn(x, s[:, None])
    tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=m)
    tl.store(s_ptr + row * NG + offs_g, s, mask=offs_g < NG)


def _act_quant_triton(x: torch.Tensor, groups: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x.shape
    ng = triton.cdiv(K, GROUP)
    x = x.contiguous()
    q = torch.empty(M, K, dtype=FP8, device=x.device)
    s = torch.empty(M, ng, dtype=torch.float32, device=x.device)
    _act_quant_kernel[(M, triton.cdiv(ng, groups))](x, q, s, K, ng, FMAX=FP8_MAX, GROUP_SIZE=GROUP,
                                                     GROUPS=groups, num_warps=4)
    return q, s


@triton.jit
def _w8a8_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, M, N, K, NKB, M_BUCKET,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                 EVEN_K: tl.constexpr):
    # Grouped program order: GROUP_M row tiles share each column tile's weights while in L2.
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mm, mn = offs_m < M, offs_n < N
    # each column's weight-scale row (BK = the 128-wide scale block): a tile may span several
    sb_rows = sb_ptr + (offs_n // BK) * NKB
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kb in range(0, NKB):
        offs_k = kb * BK + tl.arange(0, BK)
        a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
        b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]
        if EVEN_K:  # no K tail: only the M / N edges are masked
            a = tl.load(a_ptrs, mask=mm[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=mn[None, :], other=0.0)
        else:
            mk = offs_k < K
            a = tl.load(a_ptrs, mask=mm[:, None] & mk[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=mn[None, :] & mk[:, None], other=0.0)
        sa = tl.load(sa_ptr + offs_m * NKB + kb, mask=mm, other=0.0)  # [BM]
        sb = tl.load(sb_rows + kb, mask=mn, other=0.0)  # [BN]
        acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=mm[:, None] & mn[None, :])


def _cfgs(tiles):
    return [triton.Config({"BM": bm, "BN": bn, "GROUP_M": 8}, num_warps=w, num_stages=st)
            for bm, bn, w, st in tiles]


# Candidate tiles per M range. The first of each list is the untuned tile of the 2026-11-30 GPU
# measurement; bench_fp8_gemm.py prints the choice. The 256-wide ones (weight scales per column,
# since 2026-11-30, fourth session) are the shape Hopper's wgmma runs best; not yet timed.
_TILES = {
    "small": [(16, 64, 4, 3), (16, 128, 4, 4), (16, 64, 4, 5), (32, 128, 4, 4)],
    "medium": [(64, 64, 4, 3), (64, 128, 4, 4), (32, 128, 4, 4), (64, 128, 8, 3), (64, 256, 8, 3)],
    "large": [(64, 64, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 4, 4), (64, 128, 4, 4),
              (128, 128, 4, 3), (128, 256, 8, 3), (128, 256, 8, 4), (256, 128, 8, 3)],
}
_TUNED = {name: triton.autotune(configs=_cfgs(tiles), key=["M_BUCKET", "N", "K"])(_w8a8_kernel)
          for name, tiles in _TILES.items()}


def w8a8_block_gemm(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                    out_dtype: torch.dtype = torch.bfloat16, tile: tuple[int, int] | None = None) -> torch.Tensor:
    """y `[M, N]` from fp8 xq `[M, K]` + sx `[M, K/128]` and fp8 wq `[N, K]` + sw `[N/128, K/128]`.

    Tiles autotuned on CUDA per (M bucket, N, K) on first use; fixed under the interpreter and
    with DSV_AUTOTUNE=0. `tile` = (BM, BN) forces one (tests, benchmarks).
    """
    M, K = xq.shape
    N = wq.shape[0]
    y = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    args = (xq, sx, wq.contiguous(), sw.contiguous(), y, M, N, K, triton.cdiv(K, GROUP),
            min(triton.next_power_of_2(M), 8192))
    even_k = K % GROUP == 0
    if tile is not None or not autotuning():  # else the first candidate of the M range
        bm, bn = tile or ((16 if M <= 16 else 64), 64)
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
        _w8a8_kernel[grid](*args, BM=bm, BN=bn, BK=GROUP, GROUP_M=2, EVEN_K=even_k)
        return y
    kern = _TUNED["small" if M <= 16 else "medium" if M <= 256 else "large"]
    kern[lambda c: (triton.cdiv(M, c["BM"]) * triton.cdiv(N, c["BN"]),)](*args, BK=GROUP, EVEN_K=even_k)
    return y


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """x `[..., K]` @ dequant(wq, sw)ᵀ with activations quantized on the fly."""
    shape = x.shape
    xq, sx = act_quant(x.reshape(-1, shape[-1]))
    return w8a8_block_gemm(xq, sx, wq, sw, x.dtype).view(*shape[:-1], wq.shape[0])


def tuned_configs() -> dict[str, dict[str, str]]:
    """What autotuning picked so far, per M range and key (for benchmark logs)."""
    return {name: {str(key): str(cfg) for key, cfg in kern.cache.items()} for name, kern in _TUNED.items()}
