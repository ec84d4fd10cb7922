"""W8A8 block-FP8 GEMM (Triton), DeepSeek-V3's inference scheme.

Activations are quantized per token in groups of 128 along K (`x = xq * sx[m, k // 128]`; one
Triton kernel on CUDA, see act_quant), weights
per 128 x 128 block (`W = Wq * sw[n // 128, k // 128]`), so

    y[m, n] = sum_kb  sx[m, kb] * sw[n // 128, kb] * sum_{k in kb} xq[m, k] * Wq[n, k]

with an fp8 tensor-core product per K block and the two scales applied to its fp32 partial sum.

Two implementations (w8a8_block_gemm picks; the kernel plan's fp8_gemm=triton|cublas forces one):
- cuBLAS's block-scaled FP8 GEMM through torch._scaled_mm (models/fp8_cublas.py; the default
  where this torch and an sm_90 GPU have it, from 4 rows, K a multiple of 512; from 17 rows with
  split_k, the plan's fp8_gemm_splitk, on by default): 1.48-1.60x of bf16 cuBLAS at M = 4096, V3
  shapes (H200).
- Triton, everywhere else (fewer rows, other GPUs, older torch): a persistent TMA kernel above 256
  rows (1.13-1.19x of bf16 at M = 4096), an autotuned pointer kernel below, which at <= 16
  rows with split_k splits K where its tiles alone would leave SMs idle
  (models/fp8_gemm_splitk.py). Its ceiling here: each K block's product must be scaled before
  the next accumulates, so Triton waits for every wgmma (wait 0) instead of keeping one in
  flight; an unscaled Triton fp8 GEMM reaches 1.2-1.7x.
Measurements and the variants tried: RESULTS.md.
The engine uses this where an FP8 checkpoint's weights are kept in FP8 (the default wherever
these kernels run; `--no-fp8-gemm` dequantizes: engine/weight_memory.py).
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from common.triton_launch import fast_launch
from models import fp8_cublas as cb
from models.fp8 import BLOCK, FP8, FP8_MAX
from models.fp8_cublas import capability as _capability
from models.fp8_gemm_splitk import SPLIT_MAX_M, _w8a8_splitk_kernel, choose_k_splits, splitk_reduce, tile_counters
from common.launch_settings import autotuning, interpreting, sm_count

GROUP = BLOCK
log = logging.getLogger(__name__)
try:  # host-side TMA descriptors: Triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None


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


@fast_launch
@triton.jit(do_not_specialize=["M"])
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, NG, FMAX: tl.constexpr, GROUP_SIZE: tl.constexpr,
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
    tl.store(s_ptr + offs_g * M + row, s, mask=offs_g < NG)  # M-major: [K/128, M] in memory


def _act_quant_triton(x: torch.Tensor, groups: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales come back as a `[M, K/128]` view of `[K/128, M]` memory (M-major), the layout
    cuBLAS's block-scaled GEMM takes; the Triton GEMM reads either."""
    M, K = x.shape
    ng = triton.cdiv(K, GROUP)
    x = x.contiguous()
    q = torch.empty(M, K, dtype=FP8, device=x.device)
    s = torch.empty(ng, M, dtype=torch.float32, device=x.device)
    _act_quant_kernel[(M, triton.cdiv(ng, groups))](x, q, s, M, K, ng, FMAX=FP8_MAX, GROUP_SIZE=GROUP,
                                                     GROUPS=groups, num_warps=4)
    return q, s.t()


@triton.jit
def _tile_scales(sa_ptr, sb_ptr, kb, offs_m, mm, pid_n, stride_sam, stride_sak, NKB,
                 BN: tl.constexpr, BK: tl.constexpr):
    # sx[m, kb] * sw[n // 128, kb] for the tile's rows: BN divides 128, so one weight scale per
    # tile and K block, and the scaling is one FMA per accumulator element
    sa = tl.load(sa_ptr + offs_m * stride_sam + kb * stride_sak, mask=mm, other=0.0)
    return (sa * tl.load(sb_ptr + ((pid_n * BN) // BK) * NKB + kb))[:, None]


@triton.jit
def _grouped_tile(t, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped program order: GROUP_M row tiles share each column tile's weights while in L2.
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    first_m = (t // per_group) * GROUP_M
    group_m = min(num_m - first_m, GROUP_M)
    return first_m + (t % per_group) % group_m, (t % per_group) // group_m


@triton.jit(do_not_specialize=["M"])
def _w8a8_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, M, N, K, NKB, M_BUCKET, stride_sam, stride_sak,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                 EVEN_K: tl.constexpr):
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mm, mn = offs_m < M, offs_n < N
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
        s = _tile_scales(sa_ptr, sb_ptr, kb, offs_m, mm, pid_n, stride_sam, stride_sak, NKB, BN, BK)
        acc += tl.dot(a, b) * s
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=mm[:, None] & mn[None, :])


@triton.jit(do_not_specialize=["M"])
def _w8a8_tma_kernel(a_desc, sa_ptr, b_desc, sb_ptr, c_desc, M, N, NKB, M_BUCKET, stride_sam, stride_sak,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                     PROGS: tl.constexpr, FLAT: tl.constexpr):
    # Persistent: PROGS programs walk the tiles; A, B and C move by TMA (edges zero-filled on
    # load, clipped on store), so no masks or address arithmetic per tile.
    for t in tl.range(tl.program_id(0), tl.cdiv(M, BM) * tl.cdiv(N, BN), PROGS, flatten=FLAT):
        pid_m, pid_n = _grouped_tile(t, M, N, BM, BN, GROUP_M)
        offs_m = pid_m * BM + tl.arange(0, BM)
        mm = offs_m < M
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for kb in range(0, NKB):
            a = a_desc.load([pid_m * BM, kb * BK])
            b = b_desc.load([pid_n * BN, kb * BK])
            s = _tile_scales(sa_ptr, sb_ptr, kb, offs_m, mm, pid_n, stride_sam, stride_sak, NKB, BN, BK)
            acc += tl.dot(a, b.T) * s
        c_desc.store([pid_m * BM, pid_n * BN], acc.to(c_desc.dtype))


def _cfgs(tiles):
    return [triton.Config({"BM": bm, "BN": bn, "GROUP_M": 8}, num_warps=w, num_stages=st)
            for bm, bn, w, st in tiles]


# Candidate tiles per M range (BN divides 128: one weight scale per tile). The first of each list
# is the untuned tile. 256-wide tiles, timed on the H200, ran at
# 200-300 TFLOP/s against 580-700 for 128 x 128: per-column scales and their registers spill.
_TILES = {
    "small": [(16, 64, 4, 3), (16, 128, 4, 4), (16, 64, 4, 5), (32, 128, 4, 4)],
    "medium": [(64, 64, 4, 3), (64, 128, 4, 4), (32, 128, 4, 4), (64, 128, 8, 3), (128, 128, 8, 3)],
    "large": [(128, 128, 8, 3), (128, 128, 8, 4), (64, 128, 4, 4), (128, 64, 4, 4)],
}
_TUNED = {name: triton.autotune(configs=_cfgs(tiles), key=["M_BUCKET", "N", "K"])(_w8a8_kernel)
          for name, tiles in _TILES.items()}
# The split-K kernel (models/fp8_gemm_splitk.py) takes the small range's tiles, tuned per split count
_SPLITK_TUNED = triton.autotune(
    configs=[triton.Config({"BM": bm, "BN": bn}, num_warps=w, num_stages=st) for bm, bn, w, st in _TILES["small"]],
    key=["M_BUCKET", "N", "K", "SPLITS", "QUANT_A"])(_w8a8_splitk_kernel)
# The persistent TMA kernel at M > 256 (H200: 761-860 TFLOP/s at M 4096 against
# 560-710 for the pointer kernel); FLAT merges the tile and K loops into one software pipeline
# (faster at K <= 2048, slower at K >= 7168)
_TMA_TUNED = triton.autotune(
    configs=[triton.Config({"BM": 128, "BN": 128, "GROUP_M": 8, "FLAT": f}, num_warps=8, num_stages=st)
             for f, st in ((False, 4), (True, 4), (False, 3))],
    key=["M_BUCKET", "N", "NKB"])(_w8a8_tma_kernel)


def _num_sms(t: torch.Tensor) -> int | None:
    """SMs of t's GPU, for the split-K choice; None off CUDA and under the interpreter (no split
    unless asked for)."""
    return sm_count(t.device) if t.is_cuda and not interpreting() else None


def _tma_ok(xq: torch.Tensor, N: int, K: int, out_dtype: torch.dtype) -> bool:
    """TMA descriptors: Triton >= 3.4 (host TensorDescriptor), Hopper or newer, 16-byte strides."""
    return (TensorDescriptor is not None and xq.is_cuda and not interpreting()
            and _capability(xq.device.index)[0] >= 9 and K % 16 == 0 and xq.is_contiguous()
            and (N * out_dtype.itemsize) % 16 == 0)


def _m_bucket(M: int) -> int:
    """The row count the Triton kernels' autotuners key on: M rounded up to a power of 2, at most 8192."""
    return min(triton.next_power_of_2(M), 8192)


def _triton_gemm(xq, sx, wq, sw, y, tile=None, tma=None, splits=None, split_k=False, serial=False):
    """y <- the Triton GEMM: the persistent TMA kernel at M > 256 where TMA works (tma=True
    forces it, at K % 128 == 0), else the pointer kernel (autotuned, or `tile`); at M <= 16 on
    CUDA, with `split_k`, its split-K form where choose_k_splits splits K (`splits` forces a
    count, 1 the unsplit kernel), its partials summed by a reduce launch or, with `serial`, by
    each tile's last program."""
    M, K = xq.shape
    N = wq.shape[0]
    nkb = triton.cdiv(K, GROUP)
    m_bucket = _m_bucket(M)
    scale_strides = (sx.stride(0), sx.stride(1))
    if splits is None:
        splits = 1 if tile is not None or tma or not split_k else choose_k_splits(M, N, nkb, _num_sms(xq))
    if not 1 <= splits <= nkb or (splits > 1 and tma):
        raise ValueError(f"W8A8 split-K: {splits} splits of {nkb} K blocks (K {K}), tma {tma}; expected "
                         f"1 to {nkb} splits, and no TMA kernel with more than one")
    if splits > 1:
        try:
            _splitk_gemm(xq, sx, wq, sw, y, splits, tile, nkb, m_bucket, scale_strides, serial=serial)
        except Exception as e:
            # the kernel plan names the key's =0 as the way out
            e.plan_key = "fp8_gemm_splitk_serial" if serial else "fp8_gemm_splitk"
            raise
        return
    if tma is None:
        tma = tile is None and M > 256 and K % GROUP == 0 and _tma_ok(xq, N, K, y.dtype)
    if tma:
        # one program per SM whatever M is (programs without a tile exit): PROGS is a constant,
        # so the kernel compiles once, not once per tile count below the SM count
        progs = sm_count(xq.device) if xq.is_cuda else 4
        args = (TensorDescriptor.from_tensor(xq, [128, GROUP]), sx, TensorDescriptor.from_tensor(wq, [128, GROUP]),
                sw, TensorDescriptor.from_tensor(y, [128, 128]), M, N, nkb, m_bucket, *scale_strides)
        if autotuning():
            _TMA_TUNED[(progs,)](*args, BK=GROUP, PROGS=progs)
        else:  # the first candidate
            _w8a8_tma_kernel[(progs,)](*args, BM=128, BN=128, BK=GROUP, GROUP_M=8, PROGS=progs, FLAT=False,
                                       **({} if interpreting() else {"num_warps": 8, "num_stages": 4}))
        return
    args = (xq, sx, wq, sw, y, M, N, K, nkb, m_bucket, *scale_strides)
    even_k = K % GROUP == 0
    if tile is not None or not autotuning():  # else the first candidate of the M range
        bm, bn = tile or ((16 if M <= 16 else 64), 64)
        if GROUP % bn:
            raise ValueError(f"W8A8 tile width {bn} must divide the {GROUP}-wide weight-scale block")
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
        _w8a8_kernel[grid](*args, BM=bm, BN=bn, BK=GROUP, GROUP_M=2, EVEN_K=even_k)
        return
    kern = _TUNED["small" if M <= 16 else "medium" if M <= 256 else "large"]
    kern[lambda c: (triton.cdiv(M, c["BM"]) * triton.cdiv(N, c["BN"]),)](*args, BK=GROUP, EVEN_K=even_k)


def _splitk_gemm(xq, sx, wq, sw, y, splits, tile, nkb, m_bucket, scale_strides, quant_a: bool = False,
                 serial: bool = False):
    """y <- the split-K kernel's fp32 partials [splits, M, N], summed in split order by one reduce
    or, with `serial` (y contiguous), by each output tile's last program (no reduce launch).
    `quant_a`: xq is the activations in their own dtype (contiguous), quantized in the kernel."""
    M, K = xq.shape
    N = wq.shape[0]
    partials = torch.empty(splits, M, N, dtype=torch.float32, device=xq.device)
    # the counters cover the most tiles any candidate tile makes (the narrowest, 16 x 64)
    counters = tile_counters(xq.device, triton.cdiv(M, 16) * triton.cdiv(N, 64)) if serial else partials
    args = (xq, sx, wq, sw, partials, M, N, K, nkb, splits, m_bucket, *scale_strides, y, counters)
    const = dict(BK=GROUP, EVEN_K=K % GROUP == 0, QUANT_A=quant_a, FMAX=FP8_MAX, SERIAL=serial)
    if tile is not None or not autotuning():  # else the small range's candidates
        bm, bn = tile or (16, 64)
        if GROUP % bn:
            raise ValueError(f"W8A8 tile width {bn} must divide the {GROUP}-wide weight-scale block")
        if serial and triton.cdiv(M, bm) * triton.cdiv(N, bn) > counters.numel():
            raise ValueError(f"W8A8 split-K serial reduce: tile {bm} x {bn} makes more tiles than its counters")
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), splits)
        _w8a8_splitk_kernel[grid](*args, BM=bm, BN=bn, **const)
    else:
        _SPLITK_TUNED[lambda c: (triton.cdiv(M, c["BM"]) * triton.cdiv(N, c["BN"]), splits)](*args, **const)
    if not serial:
        splitk_reduce(partials, y)


def fused_act_splitk(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, splits: int | None = None,
                     tile: tuple[int, int] | None = None, serial: bool = False) -> torch.Tensor | None:
    """x `[M, K]` @ dequant(wq, sw)^T through the split-K kernel quantizing x itself (the plan's
    fp8_gemm_fuse_act), the same bits as act_quant + w8a8_block_gemm's split path; None where
    that path would not split (more than SPLIT_MAX_M rows, or choose_k_splits gives 1; `splits`
    forces a count). `serial`: the partials summed by each tile's last program (no reduce launch)."""
    M, K = x.shape
    N = wq.shape[0]
    nkb = triton.cdiv(K, GROUP)
    if splits is None:
        if M > SPLIT_MAX_M:
            return None
        splits = choose_k_splits(M, N, nkb, _num_sms(x))
        if splits <= 1:
            return None
    if not 1 <= splits <= nkb:
        raise ValueError(f"W8A8 split-K: {splits} splits of {nkb} K blocks (K {K}); expected 1 to {nkb}")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    try:
        _splitk_gemm(x.contiguous(), x, wq.contiguous(), sw.contiguous(), y, splits, tile, nkb,
                     _m_bucket(M), (0, 0), quant_a=True, serial=serial)
    except Exception as e:
        # the kernel plan names fp8_gemm_fuse_act=0 as the way out (without it, the call goes to
        # the split path, which charges a failure of its own serial reduce to that key)
        e.plan_key = "fp8_gemm_fuse_act"
        raise
    return y


def w8a8_block_gemm(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                    out_dtype: torch.dtype = torch.bfloat16, tile: tuple[int, int] | None = None,
                    backend: str = "auto", splits: int | None = None, split_k: bool = False,
                    serial: bool = False) -> torch.Tensor:
    """y `[M, N]` from fp8 xq `[M, K]` + sx `[M, K/128]` (any strides) and fp8 wq `[N, K]` +
    sw `[N/128, K/128]`.

    backend: "auto" (cuBLAS's block-scaled GEMM where this torch, GPU and shape have it, else
    Triton; with `split_k`, Triton up to SPLIT_MAX_M rows), "triton" or "cublas" (the plan's fp8_gemm). Triton tiles are autotuned on CUDA per
    (M bucket, N, K) on first use; fixed under the interpreter and with autotune=0. `tile`
    = (BM, BN) forces one (tests, benchmarks; BN must divide 128), and `splits` the Triton
    kernel's K split count (1: unsplit; default: choose_k_splits on CUDA with `split_k`, the
    plan's fp8_gemm_splitk in the engine, else 1). `splits` forces the Triton kernel. `serial`
    (the plan's fp8_gemm_splitk_serial): a split product is summed by each tile's last program
    instead of a reduce launch (the same bits).
    """
    M, K = xq.shape
    N = wq.shape[0]
    if backend not in ("auto", "triton", "cublas"):
        raise ValueError(f"W8A8 GEMM backend {backend!r}: expected auto, triton or cublas")
    if splits is not None and backend == "cublas":
        raise ValueError("W8A8 GEMM: splits forces the Triton kernel, not with backend='cublas'")
    # auto with split_k: the Triton kernel through SPLIT_MAX_M rows, split or not (bench_fp8_gemm.py
    # --decode at R1's decode shapes, M 4-16, CUDA graphs on the H200: 1.15-1.31x faster than cuBLAS
    # on q_b and the gate/up projections, 1.03-1.08x on o_proj, level on the down projections)
    small = split_k and backend == "auto" and M <= SPLIT_MAX_M
    use_cublas = tile is None and splits is None and backend != "triton" and not small
    if use_cublas and cb.cublas_ok(xq, N, K, out_dtype):
        try:
            return cb.cublas_gemm(xq, sx, wq, sw, out_dtype)
        except torch.cuda.OutOfMemoryError:
            raise
        except RuntimeError as e:  # raised before the GEMM launches (the padding copies may have run)
            # never switch paths inside a CUDA-graph capture (graph capture runs every bucket
            # eagerly first, so a refusal shows there, not here)
            msg = str(e).splitlines()[0][:160]
            if (backend == "cublas" or "NOT_SUPPORTED" not in msg
                    or (xq.is_cuda and torch.cuda.is_current_stream_capturing())):
                raise
            cb.REFUSED.add(cb.cublas_key(M, N, K, out_dtype))
            log.info("cuBLAS block-scaled FP8 GEMM refused M %d, N %d, K %d (%s): Triton for that shape",
                     M, N, K, msg)
    elif backend == "cublas":
        raise ValueError(f"cuBLAS block-scaled FP8 GEMM unavailable for M {M}, N {N}, K {K}, {out_dtype} "
                         f"on this torch / device (it takes M >= {cb.MIN_ROWS}, N a multiple of {GROUP}, "
                         f"K a multiple of {GROUP * cb.K_BLOCKS}, bf16 or fp16 out, sm_90; or it refused "
                         f"this shape before)")
    y = torch.empty(M, N, dtype=out_dtype, device=xq.device)
    _triton_gemm(xq, sx, wq.contiguous(), sw.contiguous(), y, tile, splits=splits, split_k=split_k, serial=serial)
    return y


def fp8_linear(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, backend: str = "auto",
               split_k: bool = False, fuse_act: bool = False, serial: bool = False) -> torch.Tensor:
    """x `[..., K]` @ dequant(wq, sw)ᵀ with activations quantized on the fly. `fuse_act` (the
    plan's fp8_gemm_fuse_act, with split_k): where the Triton split-K kernel serves the shape, it
    quantizes x itself (one launch fewer, the same bits). `serial` (fp8_gemm_splitk_serial, with
    split_k): a split product's partials summed by its tiles' last programs (one launch fewer)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if fuse_act and split_k and backend != "cublas" and (x.is_cuda or interpreting()):
        y = fused_act_splitk(x2, wq, sw, serial=serial)
        if y is not None:
            return y.view(*shape[:-1], wq.shape[0])
    xq, sx = act_quant(x2)
    y = w8a8_block_gemm(xq, sx, wq, sw, x.dtype, backend=backend, split_k=split_k, serial=serial)
    return y.view(*shape[:-1], wq.shape[0])


def tuned_configs() -> dict[str, dict[str, str]]:
    """What autotuning picked so far, per M range and key (for benchmark logs)."""
    kerns = dict(_TUNED, tma=_TMA_TUNED, splitk=_SPLITK_TUNED)
    return {name: {str(key): str(cfg) for key, cfg in kern.cache.items()} for name, kern in kerns.items()}
