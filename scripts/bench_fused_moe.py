"""Routed MoE at decode batch sizes: the fused Triton kernels (pair-parallel up to 8 tokens,
expert-sorted blocks of 16/32/64 rows above) vs the grouped-GEMM path (CUDA), each timed inside a
CUDA graph as the engine's decode runs it.

DeepSeek-V2-Lite shapes by default (D 2048, I 1408, 64 experts, top-6, 2 shared experts run as
two more pairs per token, as the engine does; the `+sd` rows, from 16 tokens, run them as their
own GEMMs instead, as `--kernels ...,moe_shared_dense_min_tokens=N` does), bf16, random weights.
Bytes = the distinct chosen experts' weights and the shared ones (read once) + activations. The
captured calls route to other experts each time, but the shared experts are the same weights in
every call and may partly stay in L2 (the engine's layers each have their own): slightly optimistic.

    python scripts/bench_fused_moe.py [--model configs/models/DeepSeek-V2-Lite] [--json PATH]
"""

from __future__ import annotations

import argparse

import torch
from bench_common import environment, graph_us, write_json

from models.config import ModelConfig
from models.loader import init_dummy_weights
from models.fused_moe import fused_moe_blocked, fused_moe_small, tuned_configs
from common.kernel_plan import KernelPlan
from models.moe import MoE


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="configs/models/DeepSeek-V2-Lite")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
                   help="<= 8: the pair-parallel kernels; above: the blocked kernels; grouped GEMM at all")
    p.add_argument("--calls", type=int, default=10, help="calls per graph, each on other experts")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    cfg = ModelConfig.from_pretrained(a.model)
    torch.manual_seed(0)
    with torch.device("cuda"):
        moe = MoE(cfg, torch.bfloat16, KernelPlan(moe="triton", moe_large="grouped"))
        init_dummy_weights(moe)
    D, I, E, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    per_expert = 3 * D * I * 2
    ns = moe.n_shared  # shared experts stacked after the routed ones in w13 / w2
    rows, bad = [], []
    for T in a.tokens:
        calls = []
        perm = torch.randperm(E)
        for c in range(a.calls):
            x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
            w, ids = moe.gate(x)
            if T * k <= E // 2:  # few pairs: distinct routed experts, none in common with the previous call
                ids = perm.roll(-c * T * k)[:T * k].view(T, k).to("cuda")
            calls.append((x, w, ids))
        distinct = sum(ids.unique().numel() for _, _, ids in calls) / len(calls) + ns
        nbytes = distinct * per_expert + 2 * T * D * 2
        x, w, ids = calls[0]
        ref = moe._routed_grouped(x, *moe._with_shared(w, ids)).float()
        r = {"T": T, "distinct_experts": distinct, "shared_experts": ns, "MB": nbytes / 1e6}
        line = f"T={T}: {distinct:.1f} experts {r['MB']:.1f} MB"
        variants = [("grouped", lambda x, w, ids: moe._routed_grouped(x, *moe._with_shared(w, ids)))]
        if T >= 16:  # the shared experts as their own GEMMs (--kernels ...,moe_shared_dense_min_tokens=N)
            variants.append(("grouped+sd", lambda x, w, ids: moe._shared_dense(x, moe._routed_grouped(x, w, ids))))
        if T <= 8:
            variants.append(("fused", lambda x, w, ids: fused_moe_small(x, moe.w13, moe.w2, w, ids, n_shared=ns)))
        else:
            variants += [(f"blocked{bm}", lambda x, w, ids, bm=bm: fused_moe_blocked(
                x, moe.w13, moe.w2, *moe._with_shared(w, ids), bm))
                         for bm in (16, 32, 64) if bm <= max(16, T)]
            if T >= 16:
                variants += [(f"blocked{bm}+sd", lambda x, w, ids, bm=bm: moe._shared_dense(
                    x, fused_moe_blocked(x, moe.w13, moe.w2, w, ids, bm))) for bm in (16, 32, 64)]
        for name, fn in variants:
            err = ((fn(x, w, ids).float() - ref).norm() / ref.norm()).item()
            us = graph_us(fn, calls)
            r.update({f"{name}_us": us, f"{name}_GBps": nbytes / us / 1e3, f"{name}_rel_err": err})
            line += f" | {name} {us:7.1f} us {nbytes / us / 1e3:6.0f} GB/s err {err:.1e}"
            if err > 2e-2:  # the autotuned tiles are checked here, the tests use fixed ones
                bad.append((T, name, err))
        rows.append(r)
        print(line, flush=True)
    print("tuned:", tuned_configs())
    write_json(a.json, {"bench": "fused_moe", "env": environment(), "results": rows, "tuned": tuned_configs()})
    if bad:
        raise SystemExit(f"relative error above 2e-2 vs the grouped path: {bad}")


if __name__ == "__main__":
    main()
