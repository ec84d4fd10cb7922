"""Process groups and collectives, in one module with accessor functions (STYLE.md rule 6).

Ranks: `world = tp` (one TP group; pipeline parallelism is not supported). DCP groups are
`tp / dcp` groups of `dcp` consecutive ranks inside the TP group (DESIGN.md §7). With expert
parallelism (--enable-expert-parallel) the EP group is the TP group: the MoE layers split their
routed experts by expert over it instead of splitting every expert (models/expert_parallel.py). With a single
rank nothing is initialised and every collective is the identity, so the model code never
branches on "distributed or not".
"""

from __future__ import annotations

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
    ep: GroupInfo = field(default_factory=GroupInfo)  # the TP group with expert parallelism, else size 1


_state = _State(GroupInfo(), GroupInfo(), None)  # set once by init_parallel, read by accessors


def init_parallel(tp_size: int, dcp_size: int, rank: int, init_method: str, backend: str,
                  timeout_s: float = 600.0, expert_parallel: bool = False) -> None:
    """Join the process group and build TP and DCP groups (and with `expert_parallel` the EP
    group, the TP group itself); every rank calls this once."""
    global _state
    if tp_size % dcp_size:
        raise ValueError(f"decode context parallel size {dcp_size} must divide tensor parallel size {tp_size}")
    if tp_size == 1:
        _state = _State(GroupInfo(), GroupInfo(), None)
        return
    dist.init_process_group(backend, init_method=init_method, world_size=tp_size, rank=rank,
                            timeout=datetime.timedelta(seconds=timeout_s))
    tp_group = dist.new_group(list(range(tp_size)))
    cpu_group = dist.new_group(list(range(tp_size)), backend="gloo") if backend != "gloo" else tp_group
    dcp = GroupInfo()
    if dcp_size > 1:
        for start in range(0, tp_size, dcp_size):  # every rank must create every group
            ranks = list(range(start, start + dcp_size))
            g = dist.new_group(ranks)
            if rank in ranks:
                dcp = GroupInfo(dcp_size, rank - start, g)
    tp_info = GroupInfo(tp_size, rank, tp_group)
    _state = _State(tp_info, dcp, cpu_group, tp_info if expert_parallel else GroupInfo())
    log.info("rank %d: tp %d/%d, dcp %d/%d%s", rank, rank, tp_size, dcp.rank, dcp.size,
             f", ep {rank}/{tp_size}" if expert_parallel else "")


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
    """The expert-parallel group: the TP group under --enable-expert-parallel, else one rank."""
    return _state.ep


@contextmanager
def as_rank(tp_size: int, rank: int, expert_parallel: bool = True):
    """For tests and benchmarks in one process: the state rank `rank` of `-tp tp_size` (with
    expert parallelism) sees while its modules are built, with no process group, so nothing may
    call a collective meanwhile (the caller replaces tp_all_reduce where a forward runs)."""
    global _state
    saved, g = _state, GroupInfo(tp_size, rank)
    _state = _State(g, GroupInfo(), None, g if expert_parallel else GroupInfo())
    try:
        yield
    finally:
        _state = saved


def cpu_group() -> dist.ProcessGroup | None:
    return _state.cpu


# ---- collectives (identity on one rank) ----

def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _state.tp.size > 1:
        dist.all_reduce(x, group=_state.tp.group)
    return x


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
