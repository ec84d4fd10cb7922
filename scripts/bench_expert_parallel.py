"""One rank's MoE layer under `-tp N`, its routed experts split by expert (--enable-expert-parallel)
or every expert split N ways (the default), timed on one GPU: a proxy for the MoE's share of an
N-GPU decode step, which this project's one-GPU machines cannot run. The layer's all-reduce, the
same in both layouts, is not included (replaced by the identity here).

    python scripts/bench_expert_parallel.py [--model configs/models/DeepSeek-R1] [--tp 8]
        [--tokens 1 8 32 128 512] [--layers 2]

Per token count, µs per layer in CUDA graphs over `--layers` layers' weights (dummy weights,
each tensor a function of its name, so every rank holds the same router and the same experts as
the one-rank model would): TP rank 0's layer (every TP rank does the same work), then under EP
each rank's (each computes the pairs that chose its experts, so they differ): the slowest rank
(what a step waits for) and the mean. The kernel plan is the engine's default on this GPU (FP8
checkpoints kept in FP8, the W8A8 block kernels). The two layouts read the same bytes in all:
E x (3 x D x I) over the ranks; what differs is how the routed pairs spread over them.
"""

from __future__ import annotations

import argparse

import torch
from bench_common import graph_us

from common import distributed as pd
from common.kernel_plan import resolve_plan
from models.config import ModelConfig
from models.deepseek import finish_linears
from models.loader import init_dummy_weights
from models.moe import MoE


def build(cfg: ModelConfig, plan, tp: int, rank: int, ep: bool, layers: int, device: str = "cuda") -> list[MoE]:
    """`layers` MoE layers as rank `rank` of `-tp tp` builds and loads them."""
    keep_fp8 = cfg.fp8_block is not None
    out = []
    with pd.as_rank(tp, rank, expert_parallel=ep):
        for i in range(layers):
            with torch.device(device):
                moe = MoE(cfg, torch.bfloat16, plan, keep_fp8)
            init_dummy_weights(moe, seed=i, storage_dtype=torch.bfloat16)
            finish_linears(moe, plan, keep_fp8)
            moe.gate.keep_bf16_weight()
            moe.process_weights_after_loading()
            out.append(moe)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="configs/models/DeepSeek-R1")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    p.add_argument("--layers", type=int, default=2, help="layers' weights cycled through, to defeat L2")
    p.add_argument("--kernels", default="auto", help="the kernel plan (--kernels), e.g. auto,moe_fused_max_tokens=0")
    a = p.parse_args()
    cfg = ModelConfig.from_pretrained(a.model)
    plan, _ = resolve_plan(a.kernels, "auto", "cuda", "bfloat16", True, True, hopper=True)
    pd.moe_all_reduce = lambda t: t  # one process: the ranks' partial outputs are not summed here
    tp_layers = build(cfg, plan, a.tp, 0, False, a.layers)
    ep_ranks = [build(cfg, plan, a.tp, r, True, a.layers) for r in range(a.tp)]
    print(f"{torch.cuda.get_device_name()}, {a.model}, -tp {a.tp}, {a.layers} layers; "
          "µs per MoE layer (no all-reduce)")
    print("| tokens | TP split (each rank) | EP, slowest rank | EP, mean over ranks |\n|---|---|---|---|")
    for T in a.tokens:
        torch.manual_seed(T)
        xs = [torch.randn(T, cfg.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in range(a.layers)]
        tp_us = graph_us(lambda m, x: m(x), list(zip(tp_layers, xs)))
        ep_us = [graph_us(lambda m, x: m(x), list(zip(layers, xs))) for layers in ep_ranks]
        print(f"| {T} | {tp_us:.1f} | {max(ep_us):.1f} | {sum(ep_us) / len(ep_us):.1f} |", flush=True)


if __name__ == "__main__":
    main()
