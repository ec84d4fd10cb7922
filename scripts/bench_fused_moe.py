"""Routed MoE at decode batch sizes: fused Triton kernels vs the grouped-GEMM path (CUDA).

DeepSeek-V2-Lite shapes by default (D 2048, I 1408, 64 experts, top-6), bf16, random weights.
Bytes = the distinct chosen experts' weights (read once) + activations; GB/s against that.

    python scripts/bench_fused_moe.py [--model configs/models/DeepSeek-V2-Lite] [--json PATH]
"""

from __future__ import annotations

import argparse

import torch
import triton
from bench_common import environment, write_json

from models.config import ModelConfig
from models.loader import init_dummy_weights
from models.fused_moe import fused_moe_small, tuned_configs
from models.moe import MoE


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="configs/models/DeepSeek-V2-Lite")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--json", default=None)
    a = p.parse_args()
    cfg = ModelConfig.from_pretrained(a.model)
    torch.manual_seed(0)
    with torch.device("cuda"):
        moe = MoE(cfg, torch.bfloat16)
        init_dummy_weights(moe)
        moe.fuse_experts()
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    per_expert = 3 * D * I * 2
    rows = []
    for T in a.tokens:
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        w, ids = moe.gate(x)
        distinct = ids.unique().numel()
        ref = moe._routed_grouped(x, w, ids).float()
        got = fused_moe_small(x, moe.w13, moe.w2, w, ids).float()
        err = ((got - ref).norm() / ref.norm()).item()
        nbytes = distinct * per_expert + 2 * T * D * 2
        t_fused = triton.testing.do_bench(lambda: fused_moe_small(x, moe.w13, moe.w2, w, ids), return_mode="median")
        t_grouped = triton.testing.do_bench(lambda: moe._routed_grouped(x, w, ids), return_mode="median")
        r = {"T": T, "distinct_experts": distinct, "MB": nbytes / 1e6, "fused_us": t_fused * 1e3,
             "grouped_us": t_grouped * 1e3, "fused_GBps": nbytes / t_fused / 1e6,
             "grouped_GBps": nbytes / t_grouped / 1e6, "rel_err": err}
        rows.append(r)
        print(f"T={T}: {distinct} experts {r['MB']:.1f} MB | fused {r['fused_us']:7.1f} us "
              f"{r['fused_GBps']:7.0f} GB/s | grouped {r['grouped_us']:7.1f} us {r['grouped_GBps']:7.0f} GB/s"
              f" | rel err {err:.1e}", flush=True)
    print("tuned:", tuned_configs())
    write_json(a.json, {"bench": "fused_moe", "env": environment(), "results": rows, "tuned": tuned_configs()})


if __name__ == "__main__":
    main()
