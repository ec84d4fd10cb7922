"""The router's fp32 logits at decode sizes: the Triton logits kernel (models/triton_route.py,
one program per (token, expert)) against the cuBLAS GEMM the router takes beyond the kernel's
envelope (bf16 x, the bf16 copy of the weight, fp32 output), each timed in a CUDA graph over
layer-sized weight copies (so each call reads its weight from HBM, as the engine's layers do).

V2-Lite shapes by default (D 2048, 64 experts). Run on a GPU machine:

    python scripts/bench_router_logits.py [--tokens 8 16 24 32 48 64] [--experts 64] [--hidden 2048]
    python scripts/bench_router_logits.py --route --tokens 8 32 128 256 512

`--route`: the whole router instead, logits and expert choice (softmax, top 6, two shared experts
appended): two launches (`route_triton` as the engine runs it by default) against one
(`router_fused_max_tokens`: `_router_fused_kernel`), and whether they chose the same experts.
"""

from __future__ import annotations

import argparse

import torch
from bench_common import graph_us

from models.triton_route import _router_logits_kernel, route_triton


def triton_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The Triton kernel's launch as router_logits makes it, whatever the envelope says."""
    T, D = x.shape
    E = w.shape[0]
    out = torch.empty(T, E, dtype=torch.float32, device=x.device)
    _router_logits_kernel[(T, E)](x, w, out, D, x.stride(0), E=E, BLOCK_K=min(2048, 1 << (D - 1).bit_length()),
                                  num_warps=4, PDL=False)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 24, 32, 48, 64])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--copies", type=int, default=26, help="weight copies, one per call (the MoE layers)")
    p.add_argument("--route", action="store_true", help="time the whole router: two launches against one")
    a = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(a.experts, a.hidden, device="cuda", generator=g).to(torch.bfloat16).float()
          for _ in range(a.copies)]  # fp32 weights holding bf16 values, as Router.keep_bf16_weight finds them
    wb = [w.to(torch.bfloat16) for w in ws]
    if a.route:
        print("| tokens | two launches µs | one launch µs | same experts |\n|---|---|---|---|")
        for T in a.tokens:
            x = torch.randn(T, a.hidden, device="cuda", generator=g).to(torch.bfloat16)

            def run(x, w, b, fused):
                return route_triton(x, w, None, "softmax", "greedy", 1, 1, 6, False, 1.0, b, 2,
                                    fused_max_tokens=T if fused else 0)
            two = graph_us(lambda x, w, b: run(x, w, b, False), [(x, w, b) for w, b in zip(ws, wb)])
            one = graph_us(lambda x, w, b: run(x, w, b, True), [(x, w, b) for w, b in zip(ws, wb)])
            same = torch.equal(run(x, ws[0], wb[0], False)[1], run(x, ws[0], wb[0], True)[1])
            print(f"| {T} | {two:.2f} | {one:.2f} | {same} |", flush=True)
        return
    print("| tokens | Triton kernel µs | cuBLAS bf16 -> fp32 µs | max |diff| |")
    print("|---|---|---|---|")
    for T in a.tokens:
        x = torch.randn(T, a.hidden, device="cuda", generator=g).to(torch.bfloat16)
        tri = graph_us(triton_logits, [(x, w) for w in ws])
        cub = graph_us(lambda x, w: torch.mm(x, w.t(), out_dtype=torch.float32), [(x, w) for w in wb])
        diff = (triton_logits(x, ws[0]) - torch.mm(x, wb[0].t(), out_dtype=torch.float32)).abs().max().item()
        print(f"| {T} | {tri:.2f} | {cub:.2f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
