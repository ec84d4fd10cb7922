"""`to_local` (models/expert_parallel.py) as one Triton launch, for the Triton MoE plan: the
router's (weights, ids) over all experts made this rank's in a single elementwise kernel instead
of torch's six (subtract, two compares, and, two selects), per MoE layer and step."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.pdl import pdl_launch, pdl_prologue
from common.triton_launch import fast_launch

_BLOCK = 256


@fast_launch
@triton.jit
def _to_local_kernel(w_ptr, ids_ptr, w_out_ptr, ids_out_ptr, N, first, count, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    """ids_out = ids - first where that is in [0, count), else count (weight 0 there)."""
    pdl_prologue(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    e = tl.load(ids_ptr + offs, mask=m, other=0) - first
    mine = (e >= 0) & (e < count)
    tl.store(ids_out_ptr + offs, tl.where(mine, e, count).to(ids_out_ptr.dtype.element_ty), mask=m)
    w = tl.load(w_ptr + offs, mask=m, other=0.0)
    tl.store(w_out_ptr + offs, tl.where(mine, w, 0.0).to(w_out_ptr.dtype.element_ty), mask=m)


def to_local_triton(weights: torch.Tensor, ids: torch.Tensor, first: int,
                    count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`expert_parallel.to_local`'s result, element for element, in one launch."""
    weights, ids = weights.contiguous(), ids.contiguous()
    w_out, ids_out = torch.empty_like(weights), torch.empty_like(ids)
    n = ids.numel()
    if n:
        _to_local_kernel[(triton.cdiv(n, _BLOCK),)](weights, ids, w_out, ids_out, n, first, count, BLOCK=_BLOCK,
                                                   **pdl_launch())
    return w_out, ids_out
