"""Decode TPOT under launch variants in one engine: graphs captured again per variant, requests kept.

    python scripts/bench_pdl_variants.py --batch-sizes 1 8 32 128 --reps 2
    python scripts/bench_pdl_variants.py --batch-sizes 4 8 16 32 --variants base pdl

One engine (V2-Lite with dummy weights by default; --kernels as given; decode CUDA graphs only at
the timed batch sizes). For each batch the 1000-token prompts are prefilled once; then, `reps`
times in turn, each variant's decode graphs are captured again and `--steps` engine steps are
timed (TPOT, as served: async scheduling unless --no-async-scheduling) with the graph replay
alone. The variants differ only in what a capture reads at launch time, so no second engine is
built: PDL in the graphs of up to N sequences (`pdl_graph_max_batch`), the projections on the
Triton skinny GEMM up to N rows (`gemm_skinny_max_tokens`), the decode's split merge inside
absorb_o (`decode_merge_in_absorb`; needs the Triton attention and absorb kernels), the MoE
layers' add + norm inside the router's logits kernel (`moe_norm_in_router_max_tokens`; needs the
Triton router and norms) and the choice with the block MoE's alignment in one launch
(`moe_route_align_max_tokens`; needs the Triton router and MoE, and a router without expert
groups). The printed figures are the median over the reps of each variant; TPOT grows with the
contexts (40 + 3 steps a variant and rep), so the variants take turns, in reverse order every
other rep (an even --reps cancels a linear drift; in order every rep, the last of five variants
read ~1.7% slow at batch 128 on an H100, where none of them changed anything).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_common import add_engine_flags, engine_kwargs, replay_ms, start_decodes, step_ms

from attention import triton_absorb
from common.kernel_plan import PDL_GRAPH_MAX_BATCH
from engine import LLM
from models import fp8_w8a16
from models.deepseek import DeepseekDecoderLayer
from models.layers import Linear
from models.moe import MoE

# name: what the variant sets; anything it leaves out is "base", the plan's default on sm_90: PDL in
# the graphs of up to this batch (pdl), gemm_skinny_max_tokens (skinny), decode_merge_in_absorb
# (merge_o), moe_norm_in_router_max_tokens (norm_router), moe_route_align_max_tokens (route_align),
# and, for the projections of an FP8 model (`--quantization fp8` or an FP8 checkpoint),
# fp8_gemm_w8a16_max_tokens (w8a16; "w8a8" sets it to 0, "w8a16" to 16), fp8_gemm_fuse_act
# (fuse_act) and fp8_gemm_splitk_serial (serial), the last two W8A8 options; w8a16_signal: when
# that kernel lets its successor launch under PDL (models/fp8_w8a16.py PDL_SIGNAL, whose default
# the others keep). "norm_router_off"
# sets the norm in the router off whatever the default, "norm_router_b1" on at batch 1 alone; 1024
# is every step a key can take
B = PDL_GRAPH_MAX_BATCH
_W8A16_SIGNAL = fp8_w8a16.PDL_SIGNAL  # the module's default, for variants that leave it
VARIANTS = {
    "base": {},
    "pdl": {"pdl": 1024},
    "skinny": {"skinny": 1024},
    "pdl+skinny": {"pdl": 1024, "skinny": 1024},
    "merge_o": {"merge_o": True},
    "norm_router": {"norm_router": 1024},
    "norm_router_off": {"norm_router": 0},
    "norm_router_b1": {"norm_router": 1},
    "route_align": {"route_align": 1024},
    "merge_o+norm_router": {"merge_o": True, "norm_router": 1024},
    "norm_router+route_align": {"norm_router": 1024, "route_align": 1024},
    "all3": {"merge_o": True, "norm_router": 1024, "route_align": 1024},
    "w8a8": {"w8a16": 0},
    "w8a16": {"w8a16": 16},
    "w8a16_start": {"w8a16": 16, "w8a16_signal": "start"},
    "w8a16_late": {"w8a16": 16, "w8a16_signal": "late"},
    "w8a16_8": {"w8a16": 8},
    "w8a16_nopdl": {"w8a16": 16, "w8a16_signal": "none"},
    "fuse_act": {"fuse_act": True, "w8a16": 0},
    "serial": {"serial": True, "w8a16": 0},
    "fuse_act+serial": {"fuse_act": True, "serial": True, "w8a16": 0},
}


def set_variant(runner, model, name: str, plan) -> None:
    v = VARIANTS[name]
    merge_o = v.get("merge_o", False) or plan.decode_merge_in_absorb
    norm_router = v.get("norm_router", plan.moe_norm_in_router_max_tokens)
    route_align = v.get("route_align", plan.moe_route_align_max_tokens)
    for m in model.modules():
        if isinstance(m, Linear):
            m.skinny_max = v.get("skinny", 0)
            m.fp8_fuse_act = v.get("fuse_act", plan.fp8_gemm_fuse_act)
            m.fp8_serial = v.get("serial", plan.fp8_gemm_splitk_serial)
            if m.fp8_block == (128, 128):
                m.fp8_w8a16_max = v.get("w8a16", plan.fp8_gemm_w8a16_max_tokens)
        mla = getattr(m, "mla", None)
        if mla is not None:
            mla.absorb_o_merge = triton_absorb.absorb_o_merge if merge_o else None
        if isinstance(m, DeepseekDecoderLayer) and isinstance(m.mlp, MoE):
            m.norm_in_router = m.mlp.gate.norm_in_logits = norm_router
            m.mlp.route_align = route_align
    fp8_w8a16.PDL_SIGNAL = v.get("w8a16_signal", _W8A16_SIGNAL)
    runner.graphs.pdl_max_batch = v.get("pdl", B)
    torch.cuda.synchronize()
    runner.graphs.capture()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(p)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--variants", nargs="+", default=["base", "pdl"], choices=list(VARIANTS))
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--steps", type=int, default=40, help="timed engine steps per variant and rep")
    a = p.parse_args()
    a.max_num_seqs = max(a.max_num_seqs, max(a.batch_sizes))
    kw = engine_kwargs(a)
    kw["cuda_graph_sizes"] = tuple(sorted(set(a.batch_sizes)))
    llm = LLM(**kw)
    core = llm.engine
    plan = core.executor.worker.plan
    if any(VARIANTS[v].get("merge_o") for v in a.variants) and not plan.attention == plan.absorb == "triton":
        raise SystemExit(f"--variants merge_o folds the Triton decode's merge into the Triton absorb_o; this plan "
                         f"has attention={plan.attention} absorb={plan.absorb}")
    if any(VARIANTS[v].get("norm_router") for v in a.variants) and not plan.router == plan.norm == "triton":
        raise SystemExit(f"--variants norm_router runs the Triton add + RMSNorm inside the Triton router's logits "
                         f"kernel; this plan has router={plan.router} norm={plan.norm}")
    if any(VARIANTS[v].get("route_align") for v in a.variants):
        from models.route_align import route_align_refusal
        from models.triton_route import router_grouped
        cfg = core.executor.worker.cfg
        grouped = router_grouped(cfg.scoring_func, cfg.topk_method, cfg.n_group)
        why = (f"this plan has router={plan.router} moe={plan.moe}" if not plan.router == plan.moe == "triton"
               else route_align_refusal(cfg.n_routed_experts, grouped))
        if why is not None:
            raise SystemExit(f"--variants route_align makes the Triton router's choice and the block MoE's "
                             f"alignment in one launch: {why}")
    runner = core.executor.worker.runner
    model = runner.model
    if any({"fuse_act", "serial", "w8a16"} & VARIANTS[v].keys() for v in a.variants):
        if not any(isinstance(m, Linear) and m.fp8_block is not None for m in model.modules()):
            raise SystemExit("--variants w8a8 / fuse_act / serial change the projections of an FP8 model: pass "
                             "--quantization fp8 or an FP8 checkpoint")
    if any({"fuse_act", "serial"} & VARIANTS[v].keys() for v in a.variants):
        if not plan.fp8_gemm_splitk:
            raise SystemExit("--variants fuse_act / serial act on the split-K W8A8 GEMM: this plan has "
                             "fp8_gemm_splitk off")
    print(f"device {torch.cuda.get_device_name()}, --kernels {a.kernel_plan}, variants {a.variants}")
    table = {}
    for bs in a.batch_sizes:
        ids = start_decodes(core, bs, f"v{bs}-", seed=bs)
        tpot, replay = {v: [] for v in a.variants}, {v: [] for v in a.variants}
        for rep in range(a.reps):
            for v in a.variants if rep % 2 == 0 else a.variants[::-1]:  # ABBA: a linear drift cancels in pairs
                set_variant(runner, model, v, plan)
                for _ in range(3):
                    core.step()
                tpot[v].append(step_ms(core, a.steps))
                replay[v].append(replay_ms(runner.graphs, bs))
        for v in a.variants:
            table[bs, v] = statistics.median(tpot[v]), statistics.median(replay[v])
            print(f"batch {bs:4d}  {v:20s}  TPOT {' / '.join(f'{t:.3f}' for t in tpot[v])} ms, "
                  f"replay {' / '.join(f'{r:.3f}' for r in replay[v])} ms", flush=True)
        core.abort_requests(ids)
        while core.has_unfinished_requests():
            core.step()
    print("\nmedian TPOT / graph replay alone, ms")
    print(f"{'variant':20s} " + " ".join(f"{'batch ' + str(b):>17s}" for b in a.batch_sizes))
    for v in a.variants:
        print(f"{v:20s} " + " ".join(f"{table[b, v][0]:8.3f} /{table[b, v][1]:7.3f}" for b in a.batch_sizes))


if __name__ == "__main__":
    main()
