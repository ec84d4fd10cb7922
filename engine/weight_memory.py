"""Whether an FP8 checkpoint's weights stay in FP8 when `--fp8-gemm` is not given.

Dequantized (the default where they fit), DeepSeek-V3/R1's weights take 2 bytes a weight: about
1,250 GiB, 158 GiB a rank at `-tp 8`, more than an H200's 140 GiB. Kept in FP8 (`--fp8-gemm`) they
take half that. Unset, the flag keeps FP8 exactly when the dequantized weights would not leave a
working server: more than FP8_AUTO_SHARE of the rank's memory budget (`--gpu-memory-utilization`
of the GPU, less what other processes hold), where the rest would barely hold activations and a
KV cache. `--fp8-gemm` / `--no-fp8-gemm` decide it outright.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from common import distributed as pd
from models.fp8 import FP8

log = logging.getLogger(__name__)

FP8_AUTO_SHARE = 0.9


def dequantized_weight_bytes(cfg, dtype: torch.dtype, num_mtp_layers: int = 0) -> int:
    """Bytes of this rank's weights with FP8 ones dequantized to `dtype` and their scales dropped,
    counted on a model built on the meta device (no memory; the same sharding as the real one)."""
    from common.kernel_plan import KernelPlan
    from models.deepseek import DeepseekForCausalLM
    with torch.device("meta"):
        model = DeepseekForCausalLM(cfg, dtype, KernelPlan(), num_mtp_layers=num_mtp_layers)
    total = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        leaf = name.rsplit(".", 1)[-1]
        if t.dtype == FP8:
            total += t.numel() * dtype.itemsize
        elif not (leaf.endswith("_scale") or leaf.endswith("_scale_inv")):  # FP8 block scales go
            total += t.numel() * t.element_size()
    return total


def keep_fp8(requested: bool | None, fp8_checkpoint: bool, can_w8a8: bool, dequantized: int,
             budget: float) -> bool:
    """--fp8-gemm's value: as given; unset, True for an FP8 checkpoint whose dequantized weights
    (`dequantized` bytes) would exceed FP8_AUTO_SHARE of `budget`, where the W8A8 kernels can
    run (`can_w8a8`: CUDA and a Triton kernel plan). Never for a checkpoint that is not FP8."""
    if not fp8_checkpoint:
        return False
    if requested is not None:
        return requested
    return can_w8a8 and dequantized > FP8_AUTO_SHARE * budget


def resolve_fp8_gemm(requested: bool | None, cfg, dtype: torch.dtype, device: torch.device, any_triton: bool,
                     gpu_memory_utilization: float, num_mtp_layers: int = 0) -> bool:
    """keep_fp8 for this rank, with the dequantized size and the budget measured (the smallest over
    the ranks, so that all choose alike); logs the choice made for an unset flag."""
    if cfg.fp8_block is None or requested is not None:
        return keep_fp8(requested, cfg.fp8_block is not None, True, 0, 0.0)
    if device.type != "cuda":  # no GPU memory to run out of: dequantized
        return False
    need = dequantized_weight_bytes(cfg, dtype, num_mtp_layers)
    free, total = torch.cuda.mem_get_info(device)
    budget = total * gpu_memory_utilization - (total - free)  # what others (and our context) hold counts
    if pd.cpu_group() is not None:  # one choice for all ranks: the tightest rank's budget decides
        t = torch.tensor([budget], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=pd.cpu_group())
        budget = t.item()
    keep = keep_fp8(None, True, any_triton, need, budget)
    gib = 2 ** 30
    if pd.tp().rank != 0:  # every rank made the same choice: one log line
        return keep
    if keep:
        log.info("FP8 checkpoint: dequantized to %s its weights would take %.1f GiB of this rank's %.1f GiB "
                 "budget (--gpu-memory-utilization %.2f): kept in FP8 (W8A8 GEMMs, as --fp8-gemm; "
                 "--no-fp8-gemm dequantizes anyway)", dtype, need / gib, budget / gib, gpu_memory_utilization)
    else:
        log.info("FP8 checkpoint: dequantized to %s at load (%.1f GiB of this rank's %.1f GiB budget)%s",
                 dtype, need / gib, budget / gib,
                 "" if any_triton else "; --fp8-gemm would need a Triton kernel plan")
    return keep
