"""(token, expert) pairs sorted by expert: for the grouped GEMM, a counting sort in three launches;
for the block kernels (models/blocked_moe.py), each expert's run padded to whole blocks, in one
launch (`align_pairs`, at the end of this file).

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

from common.pdl import pdl_launch, pdl_prologue
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


# --- The block kernels' alignment (models/blocked_moe.py): pairs by expert, runs padded to blocks ---


def sort_pairs_into_blocks(ids: torch.Tensor, num_experts: int, block_m: int,
                           max_pairs: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, block_expert) for ids `[T, kt]`: `rows [NB * block_m]` holds pair indices t*kt+j
    grouped by expert (ascending within an expert), each expert's run padded to a multiple of
    block_m with -1; `block_expert [NB]` the expert of each block, `num_experts` for unused
    blocks. Pairs of ids >= num_experts are left out (`fused_moe_blocked_overlapped` passes its
    shared experts' ids so and runs them apart). NB is a bound known without a host sync:
    ceil(max_pairs / block_m) + num_experts, max_pairs (default T*kt) bounding the pairs of ids
    below num_experts. Torch ops; `align_pairs` is the one-kernel version the blocked MoE runs."""
    flat = ids.flatten()
    P = flat.numel()
    dev = ids.device
    # No boolean-mask indexing or other host sync: prefill steps run this inside piecewise CUDA
    # graphs. The pairs left out sort into bin num_experts and are scattered to a trash slot.
    key = torch.where(flat < num_experts, flat, num_experts)
    order = key.argsort(stable=True)
    sorted_e = key[order]
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts.index_add_(0, key, torch.ones_like(key))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts:].zero_()  # the left-out bin has no run (a kernel: `padded[i] = 0` copies
    # a CPU scalar, which CUDA-graph capture refuses)
    pad_end = padded.cumsum(0)
    first = counts.cumsum(0) - counts  # each bin's first place in sorted order
    rank = torch.arange(P, device=dev) - first[sorted_e]  # ascending pair index within the expert
    nb = -(-(P if max_pairs is None else max_pairs) // block_m) + num_experts
    trash = nb * block_m
    dest = torch.where(sorted_e < num_experts, (pad_end - padded)[sorted_e] + rank, trash)
    rows = torch.full((trash + 1,), -1, dtype=torch.int64, device=dev)
    rows[dest] = order
    rows = rows[:trash]
    starts = torch.arange(nb, device=dev) * block_m
    block_expert = torch.searchsorted(pad_end[:num_experts], starts, right=True)  # num_experts past the last run
    return rows, block_expert


@triton.jit
def write_runs(flat, pair, e, E, NB, rows_ptr, bexp_ptr, BLOCK_M: tl.constexpr, BINS: tl.constexpr):
    """Program e < E of an alignment: expert e's run of `rows` (the `pair` indices whose id in
    `flat` is e, ascending as they come, padded with -1 to whole blocks of BLOCK_M) and its
    blocks' `bexp`; program E the unused tail. `flat` holds every pair's id (1-D, in ascending
    pair order; padding lanes carry E); each program histograms them all to find where its run
    starts: the padded counts of the experts before it. Ids >= E land in no run: their bins are
    masked (BINS > E), and past BINS the histogram drops them."""
    bins = tl.arange(0, BINS)
    counts = tl.where(bins < E, tl.histogram(flat, BINS), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_start = tl.cumsum(padded, 0) - padded
    if e < E:
        start = tl.sum(tl.where(bins == e, pad_start, 0))
        count = tl.sum(tl.where(bins == e, counts, 0))
        mine = flat == e
        rank = tl.cumsum(mine.to(tl.int32), 0) - 1  # ascending pair index within the expert
        tl.store(rows_ptr + start + rank, pair.to(tl.int64), mask=mine)
        n_pad = tl.sum(tl.where(bins == e, padded, 0))
        tail = tl.arange(0, BLOCK_M)
        tl.store(rows_ptr + start + count + tail, tl.full([BLOCK_M], -1, tl.int64), mask=count + tail < n_pad)
        for b in range(start // BLOCK_M, (start + n_pad) // BLOCK_M):
            tl.store(bexp_ptr + b, e.to(tl.int64))
    else:
        used = tl.sum(padded) // BLOCK_M
        lane = tl.arange(0, BLOCK_M)
        for b in range(used, NB):
            tl.store(bexp_ptr + b, tl.cast(E, tl.int64))  # E: an int argument or a constexpr
            tl.store(rows_ptr + b * BLOCK_M + lane, tl.full([BLOCK_M], -1, tl.int64))


@fast_launch
@triton.jit(do_not_specialize=["P", "NB"])
def _align_kernel(ids_ptr, rows_ptr, bexp_ptr, P, E, NB, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                  BINS: tl.constexpr, PDL: tl.constexpr):
    """Program e of `write_runs` over the P pair ids of ids_ptr (pair index = position)."""
    pdl_prologue(PDL)
    offs = tl.arange(0, BLOCK_P)
    flat = tl.load(ids_ptr + offs, mask=offs < P, other=E).to(tl.int32)  # padding lands in bin E
    write_runs(flat, offs, tl.program_id(0), E, NB, rows_ptr, bexp_ptr, BLOCK_M, BINS)


# Up to this many pairs align_pairs is one kernel, each of whose E + 1 programs holds all pair ids
# in registers (tests/test_fused_moe.py checks it on CUDA up to 4608 pairs); past it (prefill with
# FP8 experts) the torch sort: a few launches, against expert GEMMs of milliseconds at such sizes.
ALIGN_KERNEL_MAX_PAIRS = 8192


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int,
                max_pairs: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`sort_pairs_into_blocks` in one Triton launch (the same outputs, element for element, ids
    >= num_experts left out alike), up to ALIGN_KERNEL_MAX_PAIRS pairs; `sort_pairs_into_blocks`
    itself beyond."""
    flat = ids.contiguous().flatten()
    P = flat.numel()
    if P > ALIGN_KERNEL_MAX_PAIRS:
        return sort_pairs_into_blocks(ids, num_experts, block_m, max_pairs)
    nb = -(-(P if max_pairs is None else max_pairs) // block_m) + num_experts
    rows = torch.empty(nb * block_m, dtype=torch.int64, device=ids.device)
    bexp = torch.empty(nb, dtype=torch.int64, device=ids.device)
    _align_kernel[(num_experts + 1,)](flat, rows, bexp, P, num_experts, nb, BLOCK_M=block_m,
                                      BLOCK_P=max(16, triton.next_power_of_2(P)),
                                      BINS=max(16, triton.next_power_of_2(num_experts + 1)), num_warps=4,
                                      **pdl_launch())
    return rows, bexp
