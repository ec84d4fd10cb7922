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

`--fp8`: experts kept in FP8 with 128x128 block scales (as --fp8-gemm keeps DeepSeek-V3/R1's),
DeepSeek-R1 shapes by default (D 7168, I 2048, 256 experts, top-8; the shared expert is an MLP of
its own there, not timed), 16-4096 tokens: the FP8 block kernels (`fp8_blocked16/32/64`, and 128
from 512 tokens; the pair-parallel `fp8_fused` at <= 8 tokens), their W8A8 form
(`fp8w8a8_blocked16/...`: activations quantized per token per 128 group, FP8 products, as
`--kernels ...,moe_fp8_w8a8=1`; the act_quant passes included in the time) and the bf16 block
kernels on the same weights dequantized (`blocked16/...`). Floors per row: the distinct chosen
experts' bytes over 4.3 TB/s (FP8 bytes + scales for the FP8 rows, bf16 bytes for the others)
and the products' FLOPs over 790 TFLOP/s; the reference is a torch loop over the experts hit on
the dequantized weights (bf16 activations), which the W8A8 rows miss by their activation
rounding (a few %: their error bound is 8e-2, the others' 2e-2).

    python scripts/bench_fused_moe.py --fp8 [--model configs/models/DeepSeek-R1] [--tokens 16 ... 4096]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_common import environment, graph_us, write_json

from models.config import ModelConfig
from models.loader import init_dummy_weights
from models.blocked_moe import fused_moe_blocked
from models.fused_moe import fused_moe_small, tuned_configs
from common.kernel_plan import KernelPlan
from models.moe import MoE


HBM_BPS, PEAK_FLOPS = 4.3e12, 790e12  # the H200's copy bandwidth and bf16 dense peak (DESIGN.md §10)
# the W8A8 rows against the bf16-activation reference: e4m3 rounding of x and h costs ~2.5% each
# on Gaussian data (tests/test_fp8_gemm.py); a sanity bound that wrong scales exceed many times
W8A8_TOL = 8e-2


def routed_calls(moe, T: int, n: int) -> list:
    """n calls' (x, routing weights, expert ids) for T tokens, routed by the layer's router; with
    few pairs, distinct routed experts, none in common with the previous call (so the timing
    streams weights from HBM, not L2)."""
    D, E, k = moe.cfg.hidden_size, moe.cfg.n_routed_experts, moe.cfg.num_experts_per_tok
    perm = torch.randperm(E)
    calls = []
    for c in range(n):
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        w, ids = moe.gate(x)
        if T * k <= E // 2:
            ids = perm.roll(-c * T * k)[:T * k].view(T, k).to("cuda")
        calls.append((x, w, ids))
    return calls


def loop_reference(x, w, ids, w13, w2):
    """Routed output (fp32) from a loop over the experts hit, on compute-dtype weights."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    I = w2.shape[-1]
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gu = x[tok] @ w13[e].T
        y = (F.silu(gu[:, :I]) * gu[:, I:]) @ w2[e].T
        out.index_add_(0, tok, y.float() * w[tok, slot, None].float())
    return out


def fp8_rows(a) -> tuple[list, list]:
    """The --fp8 table: FP8 experts through the block kernels, against the bf16 block kernels."""
    cfg = ModelConfig.from_pretrained(a.model)
    if cfg.fp8_block != (128, 128):
        raise SystemExit(f"--fp8 needs a config with 128x128 FP8 blocks, {a.model} has {cfg.fp8_block}")
    torch.manual_seed(0)
    with torch.device("cuda"):
        moe = MoE(cfg, torch.bfloat16, KernelPlan(moe="triton"), keep_fp8=True)
        init_dummy_weights(moe)
        moe.process_weights_after_loading()
    d13, d2 = moe._expert_weights(torch.bfloat16)  # the same experts dequantized, for the bf16 rows
    D, I, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    fp8_expert = 3 * D * I + 3 * (D // 128) * (I // 128) * 4  # FP8 bytes + fp32 block scales
    bf16_expert = 3 * D * I * 2
    rows, bad = [], []
    for T in a.tokens:
        calls = routed_calls(moe, T, a.calls)
        distinct = sum(ids.unique().numel() for _, _, ids in calls) / len(calls)
        act = 2 * T * D * 2
        b8, b16 = distinct * fp8_expert + act, distinct * bf16_expert + act
        flops = 2 * T * k * 3 * D * I
        x, w, ids = calls[0]
        ref = loop_reference(x, w, ids, d13, d2)
        r = {"T": T, "distinct_experts": distinct, "fp8_MB": b8 / 1e6, "bf16_MB": b16 / 1e6, "GFLOP": flops / 1e9,
             "fp8_bytes_floor_us": b8 / HBM_BPS * 1e6, "bf16_bytes_floor_us": b16 / HBM_BPS * 1e6,
             "flops_floor_us": flops / PEAK_FLOPS * 1e6}
        line = (f"T={T}: {distinct:.1f} experts, floors fp8 {r['fp8_bytes_floor_us']:.0f} us bf16 "
                f"{r['bf16_bytes_floor_us']:.0f} us flops {r['flops_floor_us']:.0f} us")
        s8 = dict(w13_scale=moe.w13_scale, w2_scale=moe.w2_scale, block=128)
        variants = []
        if T <= 8:
            variants.append(("fp8_fused", b8, lambda x, w, ids: fused_moe_small(
                x, moe.w13, moe.w2, w, ids, moe.w13_scale, moe.w2_scale, 128)))
        for bm in a.block_rows:  # 128-row blocks (not the MoE's choice) from 512 tokens, to compare
            if bm <= max(16, T) and (bm < 128 or T >= 512):
                for g in a.groups:
                    tag = "" if g is None else f"g{g}"
                    variants.append((f"fp8_blocked{bm}{tag}", b8, lambda x, w, ids, bm=bm, g=g: fused_moe_blocked(
                        x, moe.w13, moe.w2, w, ids, bm, **s8, group_b=g)))
                    variants.append((f"fp8w8a8_blocked{bm}{tag}", b8, lambda x, w, ids, bm=bm, g=g: fused_moe_blocked(
                        x, moe.w13, moe.w2, w, ids, bm, **s8, a8=True, group_b=g)))
                variants.append((f"blocked{bm}", b16, lambda x, w, ids, bm=bm: fused_moe_blocked(
                    x, d13, d2, w, ids, bm)))
        for name, nbytes, fn in variants:
            err = ((fn(x, w, ids).float() - ref).norm() / ref.norm()).item()
            us = graph_us(fn, calls)
            r.update({f"{name}_us": us, f"{name}_GBps": nbytes / us / 1e3, f"{name}_TFLOPs": flops / us / 1e6,
                      f"{name}_rel_err": err})
            line += f" | {name} {us:8.1f} us {nbytes / us / 1e3:5.0f} GB/s {flops / us / 1e6:4.0f} TF/s err {err:.1e}"
            if err > (W8A8_TOL if name.startswith("fp8w8a8") else 2e-2):
                bad.append((T, name, err))
        rows.append(r)
        print(line, flush=True)
    return rows, bad


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: configs/models/DeepSeek-V2-Lite, with --fp8 "
                   "configs/models/DeepSeek-R1")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="<= 8: the pair-parallel kernels; above: the blocked kernels; grouped GEMM at all "
                   "(default 1-512; with --fp8 16-4096)")
    p.add_argument("--fp8", action="store_true", help="FP8 experts (128x128 block scales) through the block "
                   "kernels, next to the bf16 block kernels")
    p.add_argument("--groups", type=lambda v: None if v == "auto" else int(v), nargs="+", default=[None],
                   help="the block kernels' program order, fused_moe_blocked's group_b: 0 (blocks "
                   "fastest), g > 0 (groups of g blocks, every tile of a group first), auto (block_group's "
                   "choice, the default)")
    p.add_argument("--block-rows", type=int, nargs="+", default=[16, 32, 64, 128],
                   help="the block kernels' block sizes to time (128 only from 512 / 1024 tokens)")
    p.add_argument("--calls", type=int, default=10, help="calls per graph, each on other experts")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.fp8:
        a.model = a.model or "configs/models/DeepSeek-R1"
        a.tokens = a.tokens or [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
        rows, bad = fp8_rows(a)
        print("tuned:", tuned_configs())
        write_json(a.json, {"bench": "fused_moe_fp8", "env": environment(), "results": rows,
                            "tuned": tuned_configs()})
        if bad:
            raise SystemExit(f"relative error above 2e-2 (W8A8 rows: {W8A8_TOL}) vs the torch loop: {bad}")
        return
    a.model = a.model or "configs/models/DeepSeek-V2-Lite"
    a.tokens = a.tokens or [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    cfg = ModelConfig.from_pretrained(a.model)
    torch.manual_seed(0)
    with torch.device("cuda"):
        moe = MoE(cfg, torch.bfloat16, KernelPlan(moe="triton", moe_large="grouped"))
        init_dummy_weights(moe)
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    per_expert = 3 * D * I * 2
    ns = moe.n_shared  # shared experts stacked after the routed ones in w13 / w2
    rows, bad = [], []
    for T in a.tokens:
        calls = routed_calls(moe, T, a.calls)
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
            for g in a.groups:  # the block kernels' program order (fused_moe_blocked's group_b)
                tag = "" if g is None else f"g{g}"
                variants += [(f"blocked{bm}{tag}", lambda x, w, ids, bm=bm, g=g: fused_moe_blocked(
                    x, moe.w13, moe.w2, *moe._with_shared(w, ids), bm, group_b=g))
                             for bm in a.block_rows if bm <= max(16, T) and (bm < 128 or T >= 1024)]
                if T >= 16:
                    variants += [(f"blocked{bm}{tag}+sd", lambda x, w, ids, bm=bm, g=g: moe._shared_dense(
                        x, fused_moe_blocked(x, moe.w13, moe.w2, w, ids, bm, group_b=g)))
                                 for bm in a.block_rows if bm < 128 or T >= 1024]
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
