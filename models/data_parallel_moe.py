"""The MoE layers under data parallelism (vLLM's `--data-parallel-size` for DeepSeek: data-parallel
attention, experts over every rank).

Each DP rank (a TP group with its own requests and KV cache) runs attention and the dense layers on
its own tokens. Its MoE layers are split over every rank (common/distributed.py's MoE group: each
rank holds 1 / (dp * tp) of every expert, or with --enable-expert-parallel E / (dp * tp) experts
whole), so a MoE layer's input is the tokens of every DP rank: each rank pads its rows to the
step's `dp_rows` (at least the most tokens any DP rank runs this step, engine/data_parallel.py; set
by the runner from its SchedulerOutput; inside a CUDA graph, the rows it was captured with, which
the runner replays only where they are the step's), the DP group (this TP rank on every DP rank)
all-gathers them, the layer runs on all `dp * dp_rows` rows, and its partial outputs are summed
over every rank into each rank's own rows (`pd.moe_reduce_own_rows`: a reduce-scatter at -tp 1,
where a rank's rows are its chunk; an all-reduce and a slice otherwise). A DP rank with no tokens
in a step still takes part in every MoE layer's collectives, with no rows of its own (`idle_pass`):
every rank runs every step.

The padding rows are zeros: they route like any token, and their outputs are dropped.
"""

from __future__ import annotations

import torch

from common import distributed as pd


def gathered_moe(moe, h: torch.Tensor) -> torch.Tensor:
    """`moe` (a models.moe.MoE built in `pd.moe_scope()`) on this rank's rows `h [n, D]` among
    every DP rank's: its output for `h`, complete (summed over the MoE group)."""
    n, rows = h.shape[0], pd.dp_rows() or h.shape[0]
    if n > rows:
        raise RuntimeError(f"data parallel MoE: {n} rows on this rank, more than the step's {rows} per rank")
    x = h if n == rows else torch.cat([h, h.new_zeros(rows - n, h.shape[1])])
    return pd.moe_reduce_own_rows(moe(pd.dp_all_gather(x)), rows)[:n]


def idle_pass(layers, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
    """This DP rank's part in a step where it has no tokens: every MoE layer of `layers`, in order,
    with no rows of its own, so that the ranks with tokens meet every collective they expect."""
    none = torch.zeros(0, hidden, dtype=dtype, device=device)
    for layer in layers:
        if getattr(layer, "dp_moe", False):
            gathered_moe(layer.mlp, none)
