"""Expert parallelism checked one MoE layer at a time, in one process: the layer as each of N EP
ranks builds and loads it (common.distributed's `as_rank`; the all-reduce left to the check,
which sums the ranks' outputs) against the one-rank layer on the same checkpoint tensors.
Used by tests/test_expert_parallel.py (torch plan) and tests/interpreted/ (the Triton block
kernels under the interpreter)."""

from __future__ import annotations

import torch

from common import distributed as pd
from common.distributed import as_rank
from models.config import ModelConfig
from models.deepseek import finish_linears
from models.fp8 import FP8
from models.loader import _copy_slice, _FullTensor, checkpoint_shards
from models.moe import MoE


def checkpoint_tensors(moe: MoE, seed: int) -> dict[str, torch.Tensor]:
    """A random value for every checkpoint tensor a one-rank layer reads (FP8 weights ~N(0, 64)
    with block scales near 1/1000, as a real FP8 checkpoint's)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (p, sh) in checkpoint_shards(moe).items():
        if p.dtype == FP8:
            out[name] = (torch.randn(sh.shape, generator=g) * 64).clamp(-448, 448).to(FP8)
        elif name.endswith("_scale_inv"):
            out[name] = torch.rand(sh.shape, generator=g) * 1e-3 + 5e-4
        elif name.endswith("e_score_correction_bias"):
            out[name] = torch.randn(sh.shape, generator=g) * 0.1
        else:
            out[name] = torch.randn(sh.shape, generator=g) * 0.05
    return out


def load(moe: MoE, tensors: dict[str, torch.Tensor]) -> MoE:
    """Each checkpoint tensor's slice into `moe` as the loader cuts it; the tensors it does not
    read must be exactly the ones it names as other ranks' (`foreign_tensors`)."""
    shards = checkpoint_shards(moe)
    for name, (p, sh) in shards.items():
        _copy_slice(p, sh, _FullTensor(tensors[name].to(p.device, p.dtype)), name)
    assert set(tensors) - set(shards) == set(moe.foreign_tensors), "foreign_tensors must name what is not read"
    finish_linears(moe, moe.plan, moe.keep_fp8)  # the shared experts' MLP, as the model's load finishes it
    moe.process_weights_after_loading()
    return moe


def check_expert_parallel(config: str, overrides: dict, T: int, dtype, device: str, tol: float, plan, n: int,
                          monkeypatch, keep_fp8: bool = False) -> float:
    """The sum over n EP ranks of the MoE layer's output (each rank's E / n routed experts whole,
    the shared experts split n ways) equals the one-rank layer's, on the same checkpoint tensors
    and tokens; returns the relative error."""
    cfg = ModelConfig.from_pretrained(config, overrides)
    with torch.device(device):
        full = MoE(cfg, dtype, plan, keep_fp8)
    assert not full.expert_parallel and not full.foreign_tensors
    tensors = checkpoint_tensors(full, seed=T)
    load(full, tensors)
    torch.manual_seed(T)
    x = torch.randn(T, cfg.hidden_size, dtype=dtype, device=device)
    ref = full(x).double()
    monkeypatch.setattr(pd, "moe_all_reduce", lambda t: t)  # the ranks' partial sums added below
    total = torch.zeros_like(ref)
    E = cfg.n_routed_experts
    for r in range(n):
        with as_rank(n, r):
            with torch.device(device):
                moe = MoE(cfg, dtype, plan, keep_fp8)
            assert moe.expert_parallel and moe.ep_first == r * E // n and moe.w13.shape[0] == E // n
            assert moe.w2.shape[-1] == cfg.moe_intermediate_size  # whole experts
            assert (moe.shared_experts is not None) == bool(cfg.n_shared_experts) and moe.n_shared == 0
            load(moe, tensors)
            total += moe(x).double()
    err = ((total - ref).norm() / ref.norm()).item()
    assert err < tol, (config, overrides, T, plan, n, err)
    return err
