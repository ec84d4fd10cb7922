"""MLA decode time by split count at the engine's decode shapes (16 heads, 1000-token contexts).

    python scripts/bench_decode_splits.py                       # B = 1, 8, 32, 128
    python scripts/bench_decode_splits.py --batches 32 --splits 4 8 16 32
    python scripts/bench_decode_splits.py --table-pages 256   # block tables as wide as the engine's

Each figure is device µs per call inside one CUDA graph over enough caches that they stream from
HBM (as a step's 27 layers stream theirs; one layer's cache at batch 32 fits in L2), partial +
reduce kernels, against the KV bytes' floor at 4.3 TB/s. "auto" is `choose_num_splits`' pick,
which sizes the grid by the block table's width: `--table-pages` makes the tables that wide, as
the engine's are (max_model_len / page), instead of just wide enough.
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
    p.add_argument("--table-pages", type=int, default=0,
                   help="block-table width in pages (0: just wide enough); the engine's is max_model_len / page")
    p.add_argument("--cache-dtype", choices=("bf16", "fp8"), default="bf16",
                   help="fp8: an e4m3 latent cache (the Triton kernel's FP8 path; scale 1)")
    p.add_argument("--copies", type=int, default=0,
                   help="caches cycled through, to defeat L2 (0: enough for 256 MB, at least 4)")
    a = p.parse_args()
    dev, L, R = "cuda", 512, 64
    ops = TritonAttentionOps()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cache_dtype = torch.bfloat16 if a.cache_dtype == "bf16" else torch.float8_e4m3fn
    width_bytes = (L + R) * cache_dtype.itemsize
    print("| B | splits | us/call | floor us | x floor |\n|---|---|---|---|---|")
    for B in a.batches:
        per_seq = -(-(a.context + 1) // a.page)
        width = max(per_seq, a.table_pages)
        copies = a.copies or max(4, -(-256 * 2**20 // (B * per_seq * a.page * width_bytes)))
        calls = []
        for c in range(copies):
            cache = torch.randn(B * per_seq + 1, a.page, L + R, device=dev).to(cache_dtype)
            bt = torch.randperm(B * per_seq, device=dev).view(B, per_seq).to(torch.int32)
            bt = torch.cat([bt, bt.new_zeros(B, width - per_seq)], 1)  # past the rows: never read
            q = torch.randn(B, a.heads, L + R, device=dev, dtype=torch.bfloat16)
            lens = torch.full((B,), a.context + 1, dtype=torch.int32, device=dev)
            calls.append((q, cache, bt, lens))
        floor = B * (a.context + 1) * width_bytes / 4.3e12 * 1e6
        runs = [("auto", lambda q, c, bt, n: ops.decode(q, c, bt, n, 0.1, L))]
        runs += [(str(s), lambda q, c, bt, n, s=s: mla_decode(q, c, bt, n, 0.1, L, num_splits=s, num_sms=sms))
                 for s in a.splits]
        for name, fn in runs:
            us = graph_us(fn, calls)
            print(f"| {B} | {name} | {us:.1f} | {floor:.1f} | {us / floor:.2f} |", flush=True)


if __name__ == "__main__":
    main()
