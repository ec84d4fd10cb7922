"""Block-FP8 W8A8 GEMM vs bf16 torch.matmul at DeepSeek-V3 shapes (CUDA): TFLOP/s table + JSON.

Columns: bf16 cuBLAS; the Triton GEMM (persistent TMA kernel at M > 256, autotuned pointer kernel
below); cuBLAS's block-scaled FP8 GEMM through torch._scaled_mm (where this torch has it);
`fp8_linear` as the engine runs it (act_quant + the default backend); act_quant alone. Then which
row counts cuBLAS's block-scaled GEMM accepts.

    python scripts/bench_fp8_gemm.py [--ms 1 16 256 4096] [--json PATH]
"""

from __future__ import annotations

import argparse

import torch
import triton
from bench_common import environment, write_json

from models.fp8 import quantize
from models.fp8_gemm import act_quant, fp8_linear, tuned_configs, w8a8_block_gemm

SHAPES = [(7168, 2048), (24576, 1536), (2048, 7168), (7168, 16384)]  # (N, K) of V3 projections


def bench(fn) -> float | None:
    try:
        fn()
    except (RuntimeError, ValueError) as e:
        print("  refused:", str(e).splitlines()[0][:160])
        return None
    return triton.testing.do_bench(fn, return_mode="median")


def cublas_rows(ms: list[int]) -> dict[int, str]:
    """Which M the block-scaled cuBLAS GEMM takes as it is called (N 2048, K 1024, M-major
    scales with strides (1, M), no padding): "ok", "wrong" or the error's first line."""
    wq, sw = quantize(torch.randn(2048, 1024, device="cuda") * 0.02)
    out = {}
    for M in ms:
        xq, sx = act_quant(torch.randn(M, 1024, device="cuda", dtype=torch.bfloat16))
        sx = sx.t().contiguous().t()
        try:
            y = torch._scaled_mm(xq, wq.t(), sx, sw.t(), out_dtype=torch.bfloat16)
            ref = w8a8_block_gemm(xq, sx, wq, sw, backend="triton")
            out[M] = "ok" if ((y.float() - ref.float()).norm() / ref.float().norm()) < 1e-2 else "wrong"
        except (RuntimeError, ValueError) as e:
            out[M] = str(e).splitlines()[0][:100]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ms", type=int, nargs="+", default=[1, 16, 256, 4096])
    p.add_argument("--json", default=None)
    p.add_argument("--probe-only", action="store_true", help="only which M cuBLAS accepts")
    a = p.parse_args()
    rows = []
    for N, K in SHAPES:
        w = torch.randn(N, K, device="cuda") * 0.02
        wq, sw = quantize(w)
        wb = w.bfloat16()
        for M in (a.ms if not a.probe_only else []):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            xq, sx = act_quant(x)
            flop = 2 * M * N * K
            t = {"bf16": bench(lambda: x @ wb.T),
                 "triton": bench(lambda: w8a8_block_gemm(xq, sx, wq, sw, backend="triton")),
                 "cublas": bench(lambda: w8a8_block_gemm(xq, sx, wq, sw, backend="cublas")),
                 "fp8_linear": bench(lambda: fp8_linear(x, wq, sw))}
            r = {"M": M, "N": N, "K": K, **{f"{k}_tflops": (flop / v / 1e9 if v else None) for k, v in t.items()},
                 "act_quant_us": bench(lambda: act_quant(x)) * 1e3}
            rows.append(r)
            cells = "  ".join(f"{k} {r[f'{k}_tflops']:7.1f}" if r[f"{k}_tflops"] else f"{k}       -" for k in t)
            print(f"M={M:5d} N={N:6d} K={K:6d}: {cells} TFLOP/s  act quant {r['act_quant_us']:.1f} us", flush=True)
    print("\n| M | N | K | bf16 | triton | ratio | cuBLAS fp8 block | ratio | fp8_linear (auto) | act quant us |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    def f(v, d=1):
        return f"{v:.{d}f}" if v else "-"
    for r in rows:
        b, tr, cb = r["bf16_tflops"], r["triton_tflops"], r["cublas_tflops"]
        print(f"| {r['M']} | {r['N']} | {r['K']} | {f(b)} | {f(tr)} | {f(tr and tr / b, 2)} | {f(cb)} | "
              f"{f(cb and cb / b, 2)} | {f(r['fp8_linear_tflops'])} | {r['act_quant_us']:.1f} |")
    rows_ok = cublas_rows([1, 2, 3, 4, 5, 7, 8, 12, 15, 16, 17, 24, 31, 32, 33, 48, 64, 100, 255, 256, 257, 1000])
    print("cuBLAS block-scaled GEMM takes M", [m for m, v in rows_ok.items() if v == "ok"])
    for m, v in rows_ok.items():
        if v != "ok":
            print(f"  M {m}: {v}")
    print("tuned:", tuned_configs())
    write_json(a.json, {"bench": "fp8_gemm", "env": environment(), "results": rows, "tuned": tuned_configs(),
                        "cublas_rows": rows_ok})


if __name__ == "__main__":
    main()
