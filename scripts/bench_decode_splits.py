"""MLA decode time by split count at the engine's decode shapes (16 heads, 1000-token contexts).

    python scripts/bench_decode_splits.py                       # B = 1, 8, 32, 128
    python scripts/bench_decode_splits.py --batches 32 --splits 4 8 16 32

Each figure is device µs per call inside one CUDA graph over several caches (as a step's 27
layers stream theirs from HBM; one layer's cache at batch 32 fits in L2), partial + reduce
kernels, against the KV bytes' floor at 4.3 TB/s. "auto" is `choose_num_splits`' pick.
"""

from __future__ import annotations

import argparse

import torch
from bench_common import graph_us

from attention.triton_backend import TritonAttentionOps
from attention.triton_decode import mla_decode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32, 128])
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--splits", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--copies", type=int, default=4, help="caches cycled through, to defeat L2")
    a = p.parse_args()
    dev, L, R = "cuda", 512, 64
    ops = TritonAttentionOps()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("| B | splits | us/call | floor us | x floor |\n|---|---|---|---|---|")
    for B in a.batches:
        per_seq = -(-(a.context + 1) // a.page)
        calls = []
        for c in range(a.copies):
            cache = torch.randn(B * per_seq + 1, a.page, L + R, device=dev, dtype=torch.bfloat16)
            bt = torch.randperm(B * per_seq, device=dev).view(B, per_seq).to(torch.int32)
            q = torch.randn(B, a.heads, L + R, device=dev, dtype=torch.bfloat16)
            lens = torch.full((B,), a.context + 1, dtype=torch.int32, device=dev)
            calls.append((q, cache, bt, lens))
        floor = B * (a.context + 1) * (L + R) * 2 / 4.3e12 * 1e6
        for s in [None] + a.splits:
            fn = (lambda q, c, bt, n: ops.decode(q, c, bt, n, 0.1, L)) if s is None else \
                (lambda q, c, bt, n, s=s: mla_decode(q, c, bt, n, 0.1, L, num_splits=s, num_sms=sms))
            us = graph_us(fn, calls)
            print(f"| {B} | {'auto' if s is None else s} | {us:.1f} | {floor:.1f} | {us / floor:.2f} |", flush=True)


if __name__ == "__main__":
    main()
