"""Greedy sampling's argmax over the vocabulary in two Triton launches (the plan's `argmax=triton`).

On the H200 torch's `argmax(dim=-1)` over V2-Lite's 102,400 fp32 logits took 23 µs at batch 1
and 36 µs at batch 128 (`scripts/profile_graphs.py`): a reduction laid out for long rows by few
blocks, bound by latency, not by the 0.4 MB it reads. Here stage 1 gives each (row, BLOCK
columns) one program that finds its block's best value and index, and stage 2 merges a row's
blocks. Same answer as torch: the first index of the maximum, and a NaN counts as larger than
every number (the first NaN's index wins), as torch's argmax propagates NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.triton_launch import fast_launch

BLOCK = 2048  # columns per stage-1 program: V2/V3's 102,400 / 129,280 logits give 50 / 64 blocks


@triton.jit
def _best(vals, idxs, n):
    """(value, index) of the best entry: a NaN first (the smallest index among NaNs), else the
    largest value (the smallest index among ties); entries with index >= n are padding."""
    valid = idxs < n
    nan = (vals != vals) & valid
    first_nan = tl.min(tl.where(nan, idxs, n), 0)
    m = tl.max(tl.where(valid & ~nan, vals, float("-inf")), 0)
    first_max = tl.min(tl.where(valid & (vals == m), idxs, n), 0)  # all -inf: every entry ties, the first wins
    has_nan = first_nan < n
    return tl.where(has_nan, float("nan"), m), tl.where(has_nan, first_nan, first_max)


@fast_launch
@triton.jit
def _argmax_blocks_kernel(x_ptr, val_ptr, idx_ptr, N, NB, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < N, other=float("-inf")).to(tl.float32)
    v, i = _best(x, offs, N)
    tl.store(val_ptr + row * NB + b, v)
    tl.store(idx_ptr + row * NB + b, i)


@fast_launch
@triton.jit
def _argmax_merge_kernel(val_ptr, idx_ptr, out_ptr, N, NB, NBP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, NBP)
    m = j < NB
    vals = tl.load(val_ptr + row * NB + j, mask=m, other=float("-inf"))
    idxs = tl.load(idx_ptr + row * NB + j, mask=m, other=N)  # padding: index N, never chosen
    _, i = _best(vals, idxs, N)
    tl.store(out_ptr + row, i.to(tl.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` for a 2-d float tensor (last dim contiguous), int64 `[rows]`."""
    if x.dim() != 2 or x.stride(-1) != 1 or not x.is_floating_point():
        raise ValueError(f"argmax_rows: x must be a 2-d float tensor with contiguous rows, got "
                         f"{tuple(x.shape)} {x.dtype} strides {x.stride()}")
    rows, n = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    if n == 0:
        raise ValueError("argmax_rows: rows of 0 values have no argmax")
    nb = triton.cdiv(n, BLOCK)
    vals = torch.empty(rows, nb, dtype=torch.float32, device=x.device)
    idxs = torch.empty(rows, nb, dtype=torch.int32, device=x.device)
    _argmax_blocks_kernel[(rows, nb)](x, vals, idxs, n, nb, x.stride(0), BLOCK=BLOCK, num_warps=4)
    _argmax_merge_kernel[(rows,)](vals, idxs, out, n, nb, NBP=max(2, triton.next_power_of_2(nb)), num_warps=1)
    return out
