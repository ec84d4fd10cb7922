"""The MoE layer with its shared experts on a second stream (the plan's moe_shared_stream) or on
one, and its pieces, at decode batch sizes: each timed inside one CUDA graph over several layers'
weights (as a decode step streams them from HBM).

    python scripts/bench_moe_stream.py [--tokens 8 32 128] [--layers 6]

Rows, µs per layer (V2-Lite shapes, bf16, random weights, the Triton plan's router):
- `one stream` / `two streams`: `MoE.forward` (router, sort, block kernels, pair sum) with
  moe_shared_stream off / on;
- `two streams, shared blocks of N`: `fused_moe_blocked_overlapped` with the shared experts in
  blocks of N rows (`shared_block_m`; the default, SHARED_BLOCK_M, is what `two streams` runs);
- `router + sort`: the router (logits and choice kernels, the shared columns appended) and the
  sort of the routed pairs into blocks, the chain the side stream is meant to hide;
- `routed blocks`: the two product kernels over the routed pairs' blocks alone;
- `shared blocks, BLOCK_N x BLOCK_K, warps, stages`: the shared experts' blocks alone, as deep as
  the overlapped path makes them (`_shared_blocks_kernel` and the two product kernels), with the
  autotuned tile and with each
  candidate tile, to see how fast the side stream can stream the shared experts by itself.
The autotuned tiles per kernel and key are printed last.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import triton
from bench_common import graph_us, print_tuned_configs

from common.kernel_plan import KernelPlan
from common.launch_settings import use_autotune
from models import blocked_moe as bm
from models.config import ModelConfig
from models.expert_sort import align_pairs
from models.loader import init_dummy_weights
from models.moe import MoE, block_rows, side_stream


def shared_launch(moe: MoE, x: torch.Tensor, tile: dict | None) -> None:
    """The shared experts' blocks of `fused_moe_blocked_overlapped` (SHARED_BLOCK_M rows deep),
    on the current stream, with `tile` (BLOCK_N, BLOCK_K, num_warps, num_stages) or the
    autotuned one (None)."""
    T, E, S, k = x.shape[0], moe.w13.shape[0], moe.n_shared, moe.cfg.num_experts_per_tok
    kt, block_m = k + S, bm.SHARED_BLOCK_M
    run = bm._BlockedMoE(x, moe.w13, moe.w2, kt, None, None, 128, False, None)
    nbt = triton.cdiv(T, block_m)
    rows = torch.empty(S * nbt * block_m, dtype=torch.int64, device=x.device)
    bexp = torch.empty(S * nbt, dtype=torch.int64, device=x.device)
    pw = torch.empty(T * kt, dtype=torch.float32, device=x.device)
    bm._shared_blocks_kernel[(S * nbt,)](rows, bexp, pw, T, kt, k, E - S, nbt, BLOCK_M=block_m, PDL=False)
    if tile is None:
        run.launch(rows, bexp, pw, E, block_m)
        return
    D, I = x.shape[1], moe.w2.shape[-1]
    const = dict(run.const, BLOCK_M=block_m, BLOCK_N=tile["BLOCK_N"], BLOCK_K=tile["BLOCK_K"], num_warps=tile["num_warps"],
                 num_stages=tile["num_stages"])
    bucket = triton.next_power_of_2(T)
    bm._blocked_gate_up_kernel[(S * nbt * triton.cdiv(I, tile["BLOCK_N"]),)](
        x, x, rows, bexp, moe.w13, x, run.h, D, I, E, kt, bucket, 1, 1, 0, 0, S * nbt, **const)
    bm._blocked_down_kernel[(S * nbt * triton.cdiv(D, tile["BLOCK_N"]),)](
        run.h, run.h, rows, bexp, pw, moe.w2, x, run.part, D, I, E, bucket, 1, 1, 0, 0, S * nbt, **const)


def routed_launch(moe: MoE, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> None:
    T, E, S = x.shape[0], moe.w13.shape[0], moe.n_shared
    run = bm._BlockedMoE(x, moe.w13, moe.w2, ids.shape[1], None, None, 128, False, None)
    rows, bexp = align_pairs(ids, E - S, block_rows(T))
    run.launch(rows, bexp, w.flatten(), E - S, block_rows(T))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="configs/models/DeepSeek-V2-Lite")
    p.add_argument("--tokens", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--layers", type=int, default=6, help="layers' weights cycled through, to defeat L2")
    a = p.parse_args()
    use_autotune(True)
    cfg = ModelConfig.from_pretrained(a.model)
    plan = KernelPlan(moe="triton", router="triton", moe_fused_max_tokens=4, moe_blocked_max_tokens=512,
                      moe_shared_stream=False)
    torch.manual_seed(0)
    layers = []
    for i in range(a.layers):
        moe = MoE(cfg, torch.bfloat16, plan).cuda()
        init_dummy_weights(moe, seed=i, storage_dtype=torch.bfloat16)  # a bf16-exact router, as checkpoints give
        moe.gate.keep_bf16_weight()
        moe.process_weights_after_loading()
        layers.append(moe)
    on, off = dataclasses.replace(plan, moe_shared_stream=True), plan
    tiles = [dict(BLOCK_N=n, BLOCK_K=kk, num_warps=w, num_stages=s) for n, kk, w, s in bm._BLOCKED_TILES]
    print("| tokens | row | µs per layer |\n|---|---|---|")
    for T in a.tokens:
        xs = [torch.randn(T, cfg.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in layers]
        calls = list(zip(layers, xs))

        def fwd(m, x, pl):
            m.plan = pl
            return m(x)

        rows = [("one stream", lambda m, x: fwd(m, x, off)), ("two streams", lambda m, x: fwd(m, x, on)),
                ("one stream, again", lambda m, x: fwd(m, x, off)), ("two streams, again", lambda m, x: fwd(m, x, on)),
                ("router + sort", lambda m, x: align_pairs(m.gate(x, m.n_shared)[1], m.w13.shape[0] - m.n_shared,
                                                              block_rows(T)))]
        for sbm in sorted({block_rows(T), 32, 64, 128}):
            if sbm < block_rows(T):
                continue

            def ovl(m, x, sbm=sbm):
                return bm.fused_moe_blocked_overlapped(
                    x, m.w13, m.w2, lambda: m.gate(x, m.n_shared), m.cfg.num_experts_per_tok, m.n_shared,
                    side_stream(x.device), block_rows(T), shared_block_m=sbm)
            rows.append((f"two streams, shared blocks of {sbm}", ovl))
        routed = [m.gate(x, m.n_shared) for m, x in calls]
        for name, fn in rows:
            print(f"| {T} | {name} | {graph_us(fn, calls):.1f} |", flush=True)
        rcalls = [(m, x, w, i) for (m, x), (w, i) in zip(calls, routed)]
        print(f"| {T} | routed blocks | {graph_us(routed_launch, rcalls):.1f} |", flush=True)
        print(f"| {T} | shared blocks, autotuned | {graph_us(lambda m, x: shared_launch(m, x, None), calls):.1f} |",
              flush=True)
        for t in tiles:
            try:
                us = graph_us(lambda m, x, t=t: shared_launch(m, x, t), calls)
            except Exception as e:  # a tile past the shared memory
                print(f"| {T} | shared blocks, {t} | {type(e).__name__} |")
                continue
            print(f"| {T} | shared blocks, {t['BLOCK_N']}x{t['BLOCK_K']} w{t['num_warps']} s{t['num_stages']} "
                  f"| {us:.1f} |", flush=True)
    print_tuned_configs()


if __name__ == "__main__":
    main()
