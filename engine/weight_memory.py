"""Whether an FP8 checkpoint's weights stay in FP8 when `--fp8-gemm` is not given.

Unset, the flag keeps an FP8 checkpoint's weights in FP8 wherever the W8A8 kernels run (CUDA and a
Triton kernel plan), as vLLM serves these checkpoints: kept in FP8 they take half the memory of
their dequantized copy (DeepSeek-V3/R1 dequantized: about 1,250 GiB, 158 GiB a rank at `-tp 8`,
more than an H200's 140 GiB), and R1's config with 4 layers decodes 1.33x / 1.48x / 1.59x / 1.45x
faster at batch 1 / 8 / 32 / 128 than dequantized to bf16 (RESULTS.md, an H100). Elsewhere (the CPU,
`--kernels torch`) they are dequantized. `--fp8-gemm` / `--no-fp8-gemm` decide it outright. The
start-up log says which, with the dequantized size next to the rank's memory budget.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from common import distributed as pd
from models.fp8 import FP8

log = logging.getLogger(__name__)

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


def keep_fp8(requested: bool | None, fp8_checkpoint: bool, can_w8a8: bool) -> bool:
    """--fp8-gemm's value: as given; unset, True for an FP8 checkpoint where the W8A8 kernels can
    run (`can_w8a8`: CUDA and a Triton kernel plan). Never for a checkpoint that is not FP8."""
    if not fp8_checkpoint:
        return False
    return can_w8a8 if requested is None else requested


def resolve_fp8_gemm(requested: bool | None, cfg, dtype: torch.dtype, device: torch.device, any_triton: bool,
                     gpu_memory_utilization: float, num_mtp_layers: int = 0) -> bool:
    """keep_fp8 for this rank (every rank has the same device type and plan, so all choose alike);
    for an unset flag on a GPU, logs the choice with the dequantized size and the rank's budget
    (the smallest over the ranks)."""
    keep = keep_fp8(requested, cfg.fp8_block is not None, device.type == "cuda" and any_triton)
    if cfg.fp8_block is None or requested is not None:
        return keep
    if device.type != "cuda":
        log.info("FP8 checkpoint on %s: dequantized to %s at load (the W8A8 kernels run on CUDA)", device, dtype)
        return keep
    need = dequantized_weight_bytes(cfg, dtype, num_mtp_layers)
    free, total = torch.cuda.mem_get_info(device)
    budget = total * gpu_memory_utilization - (total - free)  # what others (and our context) hold counts
    if pd.cpu_group() is not None:  # the tightest rank's budget, for the log
        t = torch.tensor([budget], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=pd.cpu_group())
        budget = t.item()
    gib = 2 ** 30
    if pd.tp().rank != 0:  # every rank made the same choice: one log line
        return keep
    if keep:
        log.info("FP8 checkpoint: kept in FP8 (W8A8 GEMMs and the FP8 MoE kernels, as --fp8-gemm); dequantized "
                 "to %s its weights would take %.1f GiB of this rank's %.1f GiB budget (--gpu-memory-utilization "
                 "%.2f); --no-fp8-gemm dequantizes them", dtype, need / gib, budget / gib, gpu_memory_utilization)
    else:
        log.info("FP8 checkpoint: dequantized to %s at load (%.1f GiB of this rank's %.1f GiB budget): "
                 "--fp8-gemm would need a Triton kernel plan", dtype, need / gib, budget / gib)
    return keep
