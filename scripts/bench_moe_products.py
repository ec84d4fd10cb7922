"""The block MoE's two product kernels, each alone, against a read-only stream of the same bytes:
how close each is to the bandwidth a plain read of the touched experts' weights gets, per tile.

    python scripts/bench_moe_products.py [--tokens 8 32 128] [--layers 8] [--tiles]

V2-Lite's routed experts (D 2048, I 1408, 64 experts, top-6), bf16, random weights and random
routing, the engine's block depth (`block_rows`). Each kernel is timed in one CUDA graph over
`--layers` layers' weights (other experts each call, so the weights stream from HBM as in a
decode step). Bytes: the touched experts' gate/up (or down) weights, plus the activations each
kernel reads and writes. `read`: a Triton kernel that only reads a buffer as large as the touched
experts' weights (its bandwidth is the row's floor). `--tiles`: every candidate tile too.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from bench_common import graph_us, print_tuned_configs

from common.launch_settings import use_autotune
from models import blocked_moe as bm
from models.expert_sort import align_pairs
from models.moe import block_rows

EXTRA_TILES = [(32, 256, 4, 3), (64, 256, 4, 3), (128, 128, 4, 3), (256, 64, 8, 3), (64, 64, 4, 6),
               (32, 64, 4, 6), (64, 128, 8, 4), (128, 64, 4, 4), (256, 128, 8, 2), (16, 256, 4, 4)]


@triton.jit
def _read_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    """out[pid] = the sum of this program's strided BLOCK-wide chunks of x (a pure read)."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * BLOCK, N, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


def read_us(nbytes: int, layers: int) -> float:
    bufs = [torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(sms * 8, device="cuda", dtype=torch.float32)
    best = float("inf")
    for progs, block, warps in ((sms * 4, 4096, 8), (sms * 8, 2048, 4), (sms * 2, 8192, 8)):
        us = graph_us(lambda b: _read_kernel[(progs,)](b, out, b.numel(), BLOCK=block, num_warps=warps),
                      [(b,) for b in bufs])
        best = min(best, us)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tiles", action="store_true")
    a = p.parse_args()
    use_autotune(True)
    D, I, E, K = 2048, 1408, 64, 6
    torch.manual_seed(0)
    w13s = [torch.randn(E, 2 * I, D, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(a.layers)]
    w2s = [torch.randn(E, D, I, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(a.layers)]
    tiles = [None] + (bm._BLOCKED_TILES + EXTRA_TILES if a.tiles else [])
    print("| tokens | kernel | tile | µs per layer | GB/s | % of read |\n|---|---|---|---|---|---|")
    for T in a.tokens:
        bmr = block_rows(T)
        calls = []
        for w13, w2 in zip(w13s, w2s):
            x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
            ids = torch.rand(T, E, device="cuda").topk(K, dim=1).indices
            pw = torch.rand(T * K, device="cuda")
            rows, bexp = align_pairs(ids, E, bmr)
            run = bm._BlockedMoE(x, w13, w2, K, None, None, 128, False, None)
            calls.append((run, rows, bexp, pw, ids))
        touched = sum(c[4].unique().numel() for c in calls) / len(calls)
        up_bytes, down_bytes = touched * 2 * I * D * 2, touched * D * I * 2
        r_up, r_down = read_us(int(up_bytes), a.layers), read_us(int(down_bytes), a.layers)
        print(f"| {T} | read | {touched:.1f} experts' gate/up | {r_up:.1f} | {up_bytes / r_up / 1e3:.0f} | 100 |")
        print(f"| {T} | read | {touched:.1f} experts' down | {r_down:.1f} | {down_bytes / r_down / 1e3:.0f} | 100 |")
        for t in tiles:
            for name, kern, tuned, n_dim, ref, nbytes in (
                    ("gate_up", bm._blocked_gate_up_kernel, bm._blocked_gate_up_tuned, I, r_up, up_bytes),
                    ("down", bm._blocked_down_kernel, bm._blocked_down_tuned, D, r_down, down_bytes)):
                def launch(run, rows, bexp, pw, ids, name=name, kern=kern, tuned=tuned, n_dim=n_dim, t=t):
                    nb = bexp.numel()
                    bucket = triton.next_power_of_2(T)
                    const = dict(run.const, BLOCK_M=bmr)
                    if name == "gate_up":
                        args = (run.x, run.x, rows, bexp, run.w13, run.x, run.h, D, I, E, K, bucket, 1, 1, 0, 0, nb)
                    else:
                        args = (run.h, run.h, rows, bexp, pw, run.w2, run.x, run.part, D, I, E, bucket, 1, 1, 0, 0, nb)
                    if t is None:
                        tuned[lambda m: (nb * triton.cdiv(n_dim, m["BLOCK_N"]),)](*args, **const)
                    else:
                        kern[(nb * triton.cdiv(n_dim, t[0]),)](*args, **const, BLOCK_N=t[0], BLOCK_K=t[1],
                                                               num_warps=t[2], num_stages=t[3])
                label = "autotuned" if t is None else f"{t[0]}x{t[1]} w{t[2]} s{t[3]}"
                try:
                    us = graph_us(launch, calls)
                except Exception as e:  # a tile past the shared memory
                    print(f"| {T} | {name} | {label} | {type(e).__name__} | | |", flush=True)
                    continue
                print(f"| {T} | {name} | {label} | {us:.1f} | {nbytes / us / 1e3:.0f} | {100 * ref / us:.1f} |",
                      flush=True)
        both = graph_us(lambda run, rows, bexp, pw, ids: run.launch(rows, bexp, pw, E, bmr), calls)
        print(f"| {T} | both (launch) | autotuned | {both:.1f} | {(up_bytes + down_bytes) / both / 1e3:.0f} | "
              f"{100 * (r_up + r_down) / both:.1f} |", flush=True)
    print_tuned_configs()


if __name__ == "__main__":
    main()
