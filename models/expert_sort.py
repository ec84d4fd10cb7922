"""(token, expert) pairs sorted by expert for the grouped GEMM: a counting sort in three launches.

The grouped MoE path (`MoE._routed_grouped`) needs, for the P = T * k pairs of a batch:
- `token_of [P]`: the token of each pair, in expert order (the rows the GEMMs gather);
- `pos [P]`: where each pair landed in that order (the un-permute reads its k rows back);
- `offs [E]` int32: each expert's end offset in that order (torch._grouped_mm's `offs`).
The order is stable (ascending pair index within an expert), the same as `argsort(stable=True)`.

Done in torch that is an int32 copy, a radix sort (a histogram, four passes and their memsets),
an index, a binary search, a division and an inverse permutation: ~16 launches per layer, each
paid by the host in an eager prefill step, where the host paces the step (scripts/profile_host.py).
Here it is three: per block of pairs a histogram (`_count_kernel`); one program that turns the
counts into each block's destination per expert and the experts' end offsets (`_scan_kernel`);
per block, its pairs sorted in registers by (expert, index) and stored (`_scatter_kernel`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.triton_launch import fast_launch


@fast_launch
@triton.jit
def _count_kernel(ids_ptr, counts_ptr, P, PAD_ID, BINS: tl.constexpr, BLOCK: tl.constexpr):
    """counts[b, e]: pairs of block b choosing expert e (padding lanes land in bin PAD_ID)."""
    b = tl.program_id(0)
    offs = b * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < P, other=PAD_ID).to(tl.int32)
    tl.store(counts_ptr + b * BINS + tl.arange(0, BINS), tl.histogram(ids, BINS))


@fast_launch
@triton.jit
def _scan_kernel(counts_ptr, dest_ptr, offs_ptr, NB, E, BINS: tl.constexpr, CH: tl.constexpr):
    """One program. With total[e] the pairs of expert e and start[e] their first sorted position
    (the exclusive cumsum of total over experts): dest[b, e] = start[e] + (expert e's pairs in
    blocks before b) - (block b's pairs of experts before e), so that block b's pair sorted to
    position s within the block goes to dest[b, its expert] + s. offs[e] = start[e] + total[e]."""
    bins = tl.arange(0, BINS)
    rows = tl.arange(0, CH)
    real = bins < E
    total = tl.zeros([BINS], tl.int32)
    for b0 in range(0, NB, CH):
        m = (b0 + rows)[:, None] < NB
        c = tl.load(counts_ptr + (b0 + rows)[:, None] * BINS + bins[None, :], mask=m, other=0)
        total += tl.sum(c, 0)
    total = tl.where(real, total, 0)
    ends = tl.cumsum(total, 0)
    tl.store(offs_ptr + bins, ends, mask=real)
    start = ends - total
    before = tl.zeros([BINS], tl.int32)  # expert e's pairs in the blocks already passed
    for b0 in range(0, NB, CH):
        m = (b0 + rows)[:, None] < NB
        c = tl.where(real[None, :], tl.load(counts_ptr + (b0 + rows)[:, None] * BINS + bins[None, :],
                                            mask=m, other=0), 0)
        above = tl.cumsum(c, 0) - c  # [CH, BINS]: expert e's pairs in this chunk's earlier blocks
        left = tl.cumsum(c, 1) - c  # block b's pairs of experts before e
        dest = start[None, :] + before[None, :] + above - left
        tl.store(dest_ptr + (b0 + rows)[:, None] * BINS + bins[None, :], dest, mask=m)
        before += tl.sum(c, 0)


@fast_launch
@triton.jit
def _scatter_kernel(ids_ptr, dest_ptr, token_ptr, pos_ptr, P, KT, PAD_ID,
                    BINS: tl.constexpr, BLOCK: tl.constexpr):
    """Block b's pairs sorted by (expert, pair index) in registers; the one at sorted position s
    goes to dest[b, its expert] + s: token_of there, and that position as its pos."""
    b = tl.program_id(0)
    local = tl.arange(0, BLOCK)
    offs = b * BLOCK + local
    ids = tl.load(ids_ptr + offs, mask=offs < P, other=PAD_ID).to(tl.int32)  # padding sorts last
    key = tl.sort(ids * BLOCK + local)  # unique keys
    sid = key // BLOCK
    pair = b * BLOCK + key % BLOCK
    ok = pair < P
    dst = tl.load(dest_ptr + b * BINS + sid, mask=ok, other=0) + local
    tl.store(token_ptr + dst, (pair // KT).to(tl.int64), mask=ok)
    tl.store(pos_ptr + pair, dst.to(tl.int64), mask=ok)


def sort_by_expert(ids: torch.Tensor, num_experts: int,
                   block: int = 512) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids `[T, k]` (expert ids in [0, num_experts)) -> (token_of `[T*k]` int64, pos `[T*k]`
    int64, offs `[num_experts]` int32) as in the module docstring; no host sync."""
    T, k = ids.shape
    flat = ids.contiguous().view(-1)
    P = flat.numel()
    dev = ids.device
    token_of = torch.empty(P, dtype=torch.int64, device=dev)
    pos = torch.empty(P, dtype=torch.int64, device=dev)
    offs = torch.empty(num_experts, dtype=torch.int32, device=dev)
    if P == 0:
        return token_of, pos, offs.zero_()
    bins = max(16, triton.next_power_of_2(num_experts + 1))  # bin num_experts.. takes the padding
    nb = triton.cdiv(P, block)
    counts = torch.empty(nb, bins, dtype=torch.int32, device=dev)
    dest = torch.empty(nb, bins, dtype=torch.int32, device=dev)
    pad = bins - 1
    _count_kernel[(nb,)](flat, counts, P, pad, BINS=bins, BLOCK=block, num_warps=4)
    _scan_kernel[(1,)](counts, dest, offs, nb, num_experts, BINS=bins, CH=max(1, 8192 // bins), num_warps=8)
    _scatter_kernel[(nb,)](flat, dest, token_of, pos, P, k, pad, BINS=bins, BLOCK=block, num_warps=4)
    return token_of, pos, offs
