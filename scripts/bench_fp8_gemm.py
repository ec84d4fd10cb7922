"""Block-FP8 W8A8 GEMM vs bf16 torch.matmul at DeepSeek-V3 shapes (CUDA): TFLOP/s table + JSON.

    python scripts/bench_fp8_gemm.py [--json PATH]
"""

from __future__ import annotations

import argparse

import torch
import triton
from bench_common import environment, write_json

from models.fp8 import quantize
from models.fp8_gemm import act_quant, act_quant_torch, fp8_linear, tuned_configs, w8a8_block_gemm

SHAPES = [(7168, 2048), (24576, 1536), (2048, 7168), (7168, 16384)]  # (N, K) of V3 projections


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ms", type=int, nargs="+", default=[1, 16, 256, 4096])
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = []
    for N, K in SHAPES:
        w = torch.randn(N, K, device="cuda") * 0.02
        wq, sw = quantize(w)
        wb = w.bfloat16()
        for M in a.ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            xq, sx = act_quant(x)
            flop = 2 * M * N * K
            t_bf16 = triton.testing.do_bench(lambda: x @ wb.T, return_mode="median")
            t_gemm = triton.testing.do_bench(lambda: w8a8_block_gemm(xq, sx, wq, sw), return_mode="median")
            t_e2e = triton.testing.do_bench(lambda: fp8_linear(x, wq, sw), return_mode="median")
            t_aq = triton.testing.do_bench(lambda: act_quant(x), return_mode="median")
            t_aq_torch = triton.testing.do_bench(lambda: act_quant_torch(x), return_mode="median")
            r = {"M": M, "N": N, "K": K, "bf16_tflops": flop / t_bf16 / 1e9,
                 "fp8_gemm_tflops": flop / t_gemm / 1e9, "fp8_with_act_quant_tflops": flop / t_e2e / 1e9,
                 "act_quant_us": t_aq * 1e3, "act_quant_torch_us": t_aq_torch * 1e3}
            rows.append(r)
            print(f"M={M:5d} N={N:6d} K={K:6d}: bf16 {r['bf16_tflops']:7.1f}  fp8 gemm {r['fp8_gemm_tflops']:7.1f}"
                  f"  fp8 + act quant {r['fp8_with_act_quant_tflops']:7.1f} TFLOP/s"
                  f"  (act quant {r['act_quant_us']:.1f} us, torch {r['act_quant_torch_us']:.1f} us)", flush=True)
    print("tuned:", tuned_configs())
    write_json(a.json, {"bench": "fp8_gemm", "env": environment(), "results": rows, "tuned": tuned_configs()})


if __name__ == "__main__":
    main()
