"""RMSNorm and the residual add + RMSNorm as one Triton kernel each (the plan's `norm=triton`).

A step with prefill runs eagerly, and there the host, not the GPU, sets its pace: on the H200 a
V2-Lite step of 211 decodes and 8 new 1000-token prompts took 2.5-4.0 ms of host time per layer
to launch (`scripts/profile_host.py`, median per rep) against ~2.85 ms of GPU time. The
torch.compile'd glue costs its guards and wrappers on every call (under cProfile its 56 calls of
that step took 19 ms of the forward's 112); one Triton launch costs the host less. The same
kernels run inside the decode CUDA graphs, where the host cost is paid once at capture: one path.

Arithmetic as `common.fused.rms_norm` / `add_rms_norm`: s = x + h rounded to x's dtype, then in
fp32 s * rsqrt(mean(s^2) + eps), rounded to x's dtype, times the weight (fp32 product of the two
rounded values, rounded to the promoted dtype of x and the weight, as torch's product is).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.fused import PairRows
from common.pdl import pdl_launch, pdl_prologue
from common.triton_launch import fast_launch


@triton.jit
def add_rms_norm_row(x_ptr, h_ptr, w_ptr, t, D, eps, stride_x, stride_h, Y_DTYPE: tl.constexpr,
                     ADD: tl.constexpr, KT: tl.constexpr, BLOCK_D: tl.constexpr):
    """Row t's (s, y) in registers, `[BLOCK_D]` (lanes past D zero): s = x + h rounded to x's
    dtype (ADD; else x itself), y = rms_norm(s) * w rounded to Y_DTYPE. With KT > 0, h is the sum
    of KT fp32 rows (h_ptr + (t*KT + j) * stride_h), rounded to x's dtype: an MoE's pair rows
    (common.fused.PairRows), summed as its pair-sum kernel sums them. Shared by the norm kernel
    and the router's norm + logits kernel (models/triton_route.py), so both give the same bits
    when they run with the same BLOCK_D and warps (`norm_warps`)."""
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    x = tl.load(x_ptr + t * stride_x + offs, mask=m, other=0.0)
    if ADD:
        if KT > 0:
            acc = tl.zeros([BLOCK_D], dtype=tl.float32)
            for j in tl.static_range(KT):
                acc += tl.load(h_ptr + (t * KT + j) * stride_h + offs, mask=m, other=0.0)
            h = acc.to(x_ptr.dtype.element_ty)
        else:
            h = tl.load(h_ptr + t * stride_h + offs, mask=m, other=0.0)
        x = (x.to(tl.float32) + h.to(tl.float32)).to(x_ptr.dtype.element_ty)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / D + eps)
    n = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    return x, (n * w).to(Y_DTYPE)


@fast_launch
@triton.jit
def _rms_norm_kernel(x_ptr, h_ptr, w_ptr, s_ptr, y_ptr, D, eps,
                     stride_x, stride_h, stride_s, stride_y,
                     ADD: tl.constexpr, KT: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Row t: (ADD) s = x + h stored to s_ptr; y = rms_norm(s or x) * w (`add_rms_norm_row`)."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    s, y = add_rms_norm_row(x_ptr, h_ptr, w_ptr, t, D, eps, stride_x, stride_h, y_ptr.dtype.element_ty,
                            ADD, KT, BLOCK_D)
    if ADD:
        tl.store(s_ptr + t * stride_s + offs, s, mask=m)
    tl.store(y_ptr + t * stride_y + offs, y, mask=m)


def norm_warps(block_d: int) -> int:
    """The norm kernel's warps for a row block (its reduction's layout, and so its bits)."""
    return 4 if block_d <= 2048 else 8


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as `[rows, D]` with a unit last stride (a view where it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(x2, h2, w, s2, y2, eps: float, add: bool, kt: int = 0) -> None:
    T, D = x2.shape
    if T == 0:
        return
    block = triton.next_power_of_2(D)
    _rms_norm_kernel[(T,)](x2, h2, w, s2, y2, D, eps, x2.stride(0), h2.stride(0), s2.stride(0), y2.stride(0),
                           ADD=add, KT=kt, BLOCK_D=block, num_warps=norm_warps(block), **pdl_launch())


def _check_weight(x: torch.Tensor, w: torch.Tensor) -> None:
    if w.dim() != 1 or w.shape[0] != x.shape[-1] or w.stride(0) != 1:
        raise ValueError(f"RMSNorm weight must be a contiguous [{x.shape[-1]}], got {tuple(w.shape)} "
                         f"with strides {w.stride()}")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x `[.., D]` with weight w `[D]`: one kernel, x's shape and dtype."""
    _check_weight(x, w)
    x2 = _rows(x)
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, w.dtype), device=x.device)
    y2 = y.view(-1, x.shape[-1])
    _launch(x2, x2, w, y2, y2, eps, False)
    return y


def add_rms_norm(x: torch.Tensor, h: torch.Tensor | PairRows, w: torch.Tensor, eps: float,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + h, rms_norm(x + h)) in one kernel; x, h `[.., D]` of one shape and dtype. h may be an
    MoE output left unsummed (`PairRows`, x `[T, D]`): its sum is taken in the same kernel, with
    the pair-sum kernel's arithmetic, so the result is the one of summing first. `out` (plain h
    only): the (s, y) tensors to write, contiguous, of x's shape, x's dtype and the promoted one
    (allocated by a caller that launches this on another stream)."""
    if isinstance(h, PairRows):
        if out is not None:
            raise ValueError("add_rms_norm: out is for a plain h, not pair rows")
        return _add_pairs_rms_norm(x, h, w, eps)
    if h.shape != x.shape or h.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype} and h {tuple(h.shape)} {h.dtype} differ")
    _check_weight(x, w)
    x2, h2 = _rows(x), _rows(h)
    ydt = torch.promote_types(x.dtype, w.dtype)
    if out is None:
        s, y = torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(x.shape, dtype=ydt, device=x.device)
    else:
        s, y = out
        if (s.shape != x.shape or y.shape != x.shape or s.dtype != x.dtype or y.dtype != ydt
                or not s.is_contiguous() or not y.is_contiguous()):
            raise ValueError(f"add_rms_norm: out {tuple(s.shape)} {s.dtype} / {tuple(y.shape)} {y.dtype}, expected "
                             f"contiguous {tuple(x.shape)} {x.dtype} / {ydt}")
    _launch(x2, h2, w, s.view(-1, x.shape[-1]), y.view(-1, x.shape[-1]), eps, True)
    return s, y


def _add_pairs_rms_norm(x: torch.Tensor, h: PairRows, w: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    part = h.part
    T, D = x.shape if x.dim() == 2 else (-1, -1)
    if (x.dim() != 2 or part.dim() != 3 or part.shape[0] != T or part.shape[2] != D or h.dtype != x.dtype
            or part.dtype != torch.float32 or not part.is_contiguous()):
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype} and pair rows {tuple(part.shape)} "
                         f"{part.dtype} (summing to {h.dtype}) differ (expected x [T, D], contiguous fp32 "
                         f"pair rows [T, KT, D] summing to x's dtype)")
    _check_weight(x, w)
    x2 = _rows(x)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, w.dtype), device=x.device)
    _launch(x2, part.view(-1, D), w, s, y, eps, True, kt=part.shape[1])
    return s, y
