"""Expert parallelism (vLLM's `--enable-expert-parallel`) for the MoE layers (models/moe.py).

Under `-tp N` the attention is split by heads, and a MoE layer's input is the same on every rank.
Without EP every routed expert is split N ways (moe_intermediate_size / N units a rank), and each
rank computes its slice of every chosen expert. With EP (the EP group is the TP group,
common/distributed.py) rank r holds routed experts r*E/N .. (r+1)*E/N - 1 whole and computes only
the (token, expert) pairs that chose them. Either way a rank's MoE output is a partial sum that the
layer's one all-reduce completes, since each pair is computed on exactly one rank. The shared
experts stay split over the TP ranks: an MLP of n_shared * I / N units a rank (`MoE.shared_experts`),
its partial output summed by the same all-reduce.

The router runs on every rank over all E experts, as without EP; `to_local` then turns its global
choices into this rank's: a local expert index, or `count` (one past the last) for a pair another
rank computes, with weight 0. The MoE paths leave such pairs out: the block kernels sort only ids
below the expert count (models/expert_sort.py), the pair-parallel fused MoE of small batches
(models/fused_moe.py `fused_moe_small`) ends such a pair's programs at once, both pair sums skip
their rows (fused_moe.sum_pairs), the torch loop stops at the last local expert, the dense path
drops the extra column.

Its speed across GPUs is not measured here: this project's GPU machines have one GPU
(scripts/bench_expert_parallel.py times one rank's layer on one GPU; RESULTS.md).
"""

from __future__ import annotations

import torch

from common import distributed as pd
from models.layers import Shard


def local_range(num_experts: int) -> tuple[int, int]:
    """(first, count) of the routed experts this rank holds: all of them without EP."""
    ep = pd.ep()
    if ep.size == 1:
        return 0, num_experts
    if num_experts % ep.size:
        raise ValueError(f"--enable-expert-parallel: {pd.moe_size_name()} {ep.size} must divide the model's "
                         f"{num_experts} routed experts")
    count = num_experts // ep.size
    return ep.rank * count, count


def routed_shards(num_experts: int, inter: int, hidden: int) -> tuple[list[Shard], list[Shard], int, list[str]]:
    """The routed experts' checkpoint shards of this rank, stacked as `w13 [n, 2*Il, D]` (gate rows,
    then up rows) and `w2 [n, D, Il]`: (w13 shards, w2 shards, Il, the other ranks' expert
    weight names). Without EP: every expert, each split over the TP ranks (Il = I / tp); with EP:
    this rank's experts whole (Il = I), loaded at their local index."""
    first, count = local_range(num_experts)
    split = count == num_experts  # no EP: every expert's units split over the TP ranks
    il = inter // pd.tp().size if split else inter
    w13 = [Shard(f"experts.{first + e}.{name}.weight", (inter, hidden), 0 if split else None,
                 (e, slice(h * il, (h + 1) * il)))
           for e in range(count) for h, name in enumerate(("gate_proj", "up_proj"))]
    w2 = [Shard(f"experts.{first + e}.down_proj.weight", (hidden, inter), 1 if split else None, (e,))
          for e in range(count)]
    foreign = [f"experts.{e}.{name}.weight" for e in range(num_experts) if not first <= e < first + count
               for name in ("gate_proj", "up_proj", "down_proj")]
    return w13, w2, il, foreign


def to_local(weights: torch.Tensor, ids: torch.Tensor, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's (weights, ids) `[T, k]` over all experts as this rank's: ids of its experts
    made local (id - first), every other id `count` with weight 0."""
    local = ids - first
    mine = (local >= 0) & (local < count)
    return torch.where(mine, weights, 0), torch.where(mine, local, count)
