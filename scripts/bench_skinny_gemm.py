"""Decode-sized projections: the Triton skinny GEMM (models/skinny_gemm.py) vs cuBLAS
(`F.linear`), each timed inside a CUDA graph as the engine's decode runs them.

Shapes of DeepSeek-V2-Lite and V3 at tp 1 (bf16): the fused q/kv_a projection, o_proj, the
dense MLP's down projection. Each captured call reads another copy of the weight (enough copies
to exceed the L2), so the weights stream from HBM as in a step. Bytes = weight + x + y.

    python scripts/bench_skinny_gemm.py [--rows 1 8 16] [--json PATH]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_common import environment, graph_us, write_json

from models.skinny_gemm import skinny_linear

SHAPES = [("V2-Lite q+kv_a", 3648, 2048), ("V2-Lite o_proj", 2048, 2048), ("V2-Lite dense down", 2048, 10944),
          ("V3 q_a+kv_a", 2112, 7168), ("V3 q_b", 24576, 1536), ("V3 o_proj", 7168, 16384)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    print(f"{'shape':>20} {'M':>3} {'N':>6} {'K':>6} {'MB':>6} | {'cuBLAS us':>9} {'GB/s':>6} | "
          f"{'skinny us':>9} {'GB/s':>6} | speedup  rel err")
    for name, N, K in SHAPES:
        mb = N * K * 2 / 1e6
        copies = max(2, int(200 // mb))  # > the 50 MB L2 in all
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5 for _ in range(copies)]
        for M in args.rows:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            calls = [(x, w) for w in ws]
            ref = F.linear(x.float(), ws[0].float())
            err = ((skinny_linear(x, ws[0]).float() - ref).norm() / ref.norm()).item()
            t_cublas = graph_us(F.linear, calls)
            t_skinny = graph_us(skinny_linear, calls)
            nbytes = (N * K + M * K + M * N) * 2
            row = dict(shape=name, M=M, N=N, K=K, cublas_us=t_cublas, skinny_us=t_skinny,
                       cublas_gbs=nbytes / t_cublas / 1e3, skinny_gbs=nbytes / t_skinny / 1e3, rel_err=err)
            rows.append(row)
            print(f"{name:>20} {M:>3} {N:>6} {K:>6} {mb:6.1f} | {t_cublas:9.2f} {row['cublas_gbs']:6.0f} | "
                  f"{t_skinny:9.2f} {row['skinny_gbs']:6.0f} | {t_cublas / t_skinny:6.2f}x  {err:.1e}")
        del ws
    write_json(args.json, {"env": environment(), "rows": rows})


if __name__ == "__main__":
    main()
