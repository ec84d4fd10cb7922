"""Process groups and collectives, in one module with accessor functions (STYLE.md rule 6).

Ranks: `world = dp * tp`, rank `d * tp + t` the TP rank t of data-parallel rank d (pipeline
parallelism is not supported). Each DP rank is a TP group of `tp` consecutive ranks with its own
requests and KV cache (engine/data_parallel.py); DCP groups are `tp / dcp` groups of `dcp`
consecutive ranks inside a TP group (DESIGN.md §7). The MoE group is every rank: the MoE layers
split their experts over all `dp * tp` ranks and run on the tokens of every DP rank, gathered over
the DP group (the ranks of one TP rank across the DP ranks; models/data_parallel_moe.py). Without
DP the MoE group is the TP group. With expert parallelism (--enable-expert-parallel) the EP group
is the MoE group: the MoE layers split their routed experts by expert over it instead of
splitting every expert (models/expert_parallel.py). With a single rank nothing is initialised and
every collective is the identity, so the model code never branches on "distributed or not".
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# torch 2.13 renames the *_tensor collectives; the older torch on our GPU machines lacks the new
# names, so keep the old ones and silence the rename notice.
warnings.filterwarnings("ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor).*deprecated")


@dataclass
class GroupInfo:
    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None


@dataclass
class _State:
    tp: GroupInfo
    dcp: GroupInfo
    cpu: dist.ProcessGroup | None  # gloo group over all ranks, for control messages
    ep: GroupInfo = field(default_factory=GroupInfo)  # the MoE group with expert parallelism, else size 1
    dp: GroupInfo = field(default_factory=GroupInfo)  # this TP rank across the DP ranks
    moe: GroupInfo | None = None  # every rank under DP; None: the TP group
    world_cpu: dist.ProcessGroup | None = None  # gloo over every rank (cpu is one TP group's)
    dp_rows: int = 0  # the step's rows per DP rank in the MoE gather (0: this rank's token count)


_state = _State(GroupInfo(), GroupInfo(), None)  # set once by init_parallel, read by accessors


def init_parallel(tp_size: int, dcp_size: int, rank: int, init_method: str, backend: str,
                  timeout_s: float = 600.0, expert_parallel: bool = False, dp_size: int = 1) -> None:
    """Join the process group of `dp_size * tp_size` ranks and build the TP, DCP, DP and MoE
    groups (and with `expert_parallel` the EP group, the MoE group itself); every rank calls this
    once, with its global rank."""
    global _state
    if tp_size % dcp_size:
        raise ValueError(f"decode context parallel size {dcp_size} must divide tensor parallel size {tp_size}")
    world = tp_size * dp_size
    if world == 1:
        _state = _State(GroupInfo(), GroupInfo(), None)
        return
    dist.init_process_group(backend, init_method=init_method, world_size=world, rank=rank,
                            timeout=datetime.timedelta(seconds=timeout_s))
    d, t = divmod(rank, tp_size)

    def mine(groups: list[list[int]], cpu: bool = False) -> tuple[GroupInfo, dist.ProcessGroup | None]:
        """Every rank creates every group, in one order; (this rank's GroupInfo, its gloo twin)."""
        info, twin = GroupInfo(), None
        for ranks in groups:
            g = dist.new_group(ranks)
            c = (dist.new_group(ranks, backend="gloo") if backend != "gloo" else g) if cpu else None
            if rank in ranks:
                info, twin = GroupInfo(len(ranks), ranks.index(rank), g), c
        return info, twin

    tp_info, cpu_group = mine([list(range(s, s + tp_size)) for s in range(0, world, tp_size)], cpu=True)
    dcp = GroupInfo()
    if dcp_size > 1:
        dcp, _ = mine([list(range(s, s + dcp_size)) for s in range(0, world, dcp_size)])
    dp_info, moe, world_cpu = GroupInfo(), None, cpu_group
    if dp_size > 1:
        dp_info, _ = mine([list(range(j, world, tp_size)) for j in range(tp_size)])
        world_group = dist.new_group(list(range(world)))
        moe = GroupInfo(world, rank, world_group)
        world_cpu = dist.new_group(list(range(world)), backend="gloo") if backend != "gloo" else world_group
    ep = (moe or tp_info) if expert_parallel else GroupInfo()
    _state = _State(tp_info, dcp, cpu_group, ep, dp_info, moe, world_cpu)
    log.info("rank %d: dp %d/%d, tp %d/%d, dcp %d/%d%s", rank, d, dp_size, t, tp_size, dcp.rank, dcp.size,
             f", ep {ep.rank}/{ep.size}" if expert_parallel else "")


def destroy_parallel() -> None:
    global _state
    if dist.is_initialized():
        dist.destroy_process_group()
    _state = _State(GroupInfo(), GroupInfo(), None)


def tp() -> GroupInfo:
    return _state.tp


def dcp() -> GroupInfo:
    return _state.dcp


def ep() -> GroupInfo:
    """The expert-parallel group: the MoE group under --enable-expert-parallel, else one rank."""
    return _state.ep


def dp() -> GroupInfo:
    """This TP rank across the data-parallel ranks (size 1 without DP); its rank is the DP rank."""
    return _state.dp


def moe() -> GroupInfo:
    """The group the MoE layers split their experts over: every rank under DP, else the TP group."""
    return _state.moe or _state.tp


def moe_size_name() -> str:
    """How the MoE group's size is given on the command line, for error messages."""
    return "tensor parallel size" + (" x data parallel size" if _state.dp.size > 1 else "")


@contextmanager
def moe_scope():
    """While the MoE layers are built, `tp()` is the MoE group: their parameters are split over it
    (a parameter records its split when made: models/layers.py `split_of`)."""
    global _state
    saved = _state
    if _state.moe is not None:
        _state = dataclasses.replace(_state, tp=_state.moe)
    try:
        yield
    finally:
        _state = saved


def set_dp_rows(rows: int) -> None:
    """The step's rows per DP rank in the MoE layers' gather (at least the most tokens any DP rank
    runs: engine/data_parallel.py; 0: this rank's own count, as in the start-up passes, which every
    rank runs alike)."""
    _state.dp_rows = rows


def dp_rows() -> int:
    return _state.dp_rows


@contextmanager
def as_rank(tp_size: int, rank: int, expert_parallel: bool = True, dp_size: int = 1):
    """For tests and benchmarks in one process: the state global rank `rank` of `-tp tp_size -dp
    dp_size` (with expert parallelism) sees while its modules are built, with no process group, so
    nothing may call a collective meanwhile (the caller replaces moe_all_reduce where a forward
    runs)."""
    global _state
    saved, g = _state, GroupInfo(tp_size, rank % tp_size)
    moe = GroupInfo(tp_size * dp_size, rank) if dp_size > 1 else None
    _state = _State(g, GroupInfo(), None, (moe or g) if expert_parallel else GroupInfo(),
                    GroupInfo(dp_size, rank // tp_size), moe)
    try:
        yield
    finally:
        _state = saved


def cpu_group() -> dist.ProcessGroup | None:
    """gloo over this rank's TP group, for control messages."""
    return _state.cpu


def world_cpu_group() -> dist.ProcessGroup | None:
    """gloo over every rank (the TP group's without DP)."""
    return _state.world_cpu if _state.moe is not None else _state.cpu


# ---- collectives (identity on one rank) ----

def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _state.tp.size > 1:
        dist.all_reduce(x, group=_state.tp.group)
    return x


def moe_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum a MoE layer's partial outputs over the MoE group."""
    g = moe()
    if g.size > 1:
        dist.all_reduce(x, group=g.group)
    return x


def moe_reduce_own_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """A MoE layer's partial outputs for every DP rank's `rows` rows (`[dp * rows, ...]`, DP-rank
    major), summed over the MoE group: this rank's DP rank's rows `[rows, ...]`. Without TP inside
    the DP ranks the MoE group is the DP group and those rows are this rank's chunk of a
    reduce-scatter (half an all-reduce's traffic); with it, an all-reduce and a slice."""
    g, d = moe(), _state.dp
    if g.size == 1:
        return x
    if _state.tp.size == 1:
        out = x.new_empty((rows, *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x.contiguous(), group=d.group)
        return out
    dist.all_reduce(x, group=g.group)
    return x[d.rank * rows:(d.rank + 1) * rows]


def _gather_stacked(x: torch.Tensor, g: GroupInfo) -> torch.Tensor:
    """All-gather into `[size, *x.shape]`, rank-major."""
    x = x.contiguous()
    if x.dim() == 0:
        x = x.view(1)
    out = x.new_empty((g.size * x.shape[0], *x.shape[1:]))  # gloo wants dim 0 concatenated
    dist.all_gather_into_tensor(out, x, group=g.group)
    return out.view(g.size, *x.shape)


def _all_gather(x: torch.Tensor, g: GroupInfo, dim: int) -> torch.Tensor:
    if g.size == 1:
        return x
    out = _gather_stacked(x, g)
    return out.flatten(0, 1) if dim == 0 else torch.cat(out.unbind(0), dim=dim)


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return _all_gather(x, _state.tp, dim % x.dim())


def dp_all_gather(x: torch.Tensor) -> torch.Tensor:
    """All-gather over the DP group along dim 0, DP-rank-major (equal row counts)."""
    return _all_gather(x, _state.dp, 0)


def dcp_all_gather(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    return _all_gather(x, _state.dcp, dim % x.dim())


def dcp_all_gather_stacked(x: torch.Tensor) -> torch.Tensor:
    """All-gather over the DCP group, returning `[dcp, *x.shape]` (rank-major)."""
    g = _state.dcp
    return x.unsqueeze(0) if g.size == 1 else _gather_stacked(x, g)


def dcp_reduce_scatter(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over the DCP group and keep this rank's 1/dcp slice of `dim`."""
    g = _state.dcp
    if g.size == 1:
        return x
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // g.size, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x, group=g.group)
    return out.movedim(0, dim)
