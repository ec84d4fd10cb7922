"""Block-FP8 W8A8 GEMM vs bf16 torch.matmul (CUDA). Two tables:

Default, DeepSeek-V3 shapes at M 1-4096, TFLOP/s + JSON: bf16 cuBLAS; the Triton GEMM (persistent
TMA kernel at M > 256, autotuned pointer kernel below); cuBLAS's block-scaled FP8 GEMM through
torch._scaled_mm (where this torch has it); `fp8_linear` as the engine runs it (act_quant + the
default backend); act_quant alone. Then which row counts cuBLAS's block-scaled GEMM accepts.
Timed by do_bench of eager calls: below ~256 rows that is the host's launch time, not the GPU's.

    python scripts/bench_fp8_gemm.py [--ms 1 16 256 4096] [--json PATH]

`--decode`: the W8A8 projections of a model's decode step (R1 by default, from its config.json:
q_a + kv_a as one GEMM, q_b, o_proj, the dense MLP's gate_up / down, the shared expert's gate_up /
down, and kv_a alone for reference; kv_b is always dequantized, not here) at M 1-16, µs per call
timed inside a CUDA graph (bench_common.graph_us: the calls captured once, each on its own copy
of the weights so that they stream from HBM as in a step, replayed). Each FP8 column is act_quant
+ the GEMM, as `--fp8-gemm` runs a linear: the Triton kernel unsplit (splits 1), split-K at
choose_k_splits' count for this GPU (and at `--splits` counts), cuBLAS's block-scaled GEMM
(M >= 4), the default backend ("auto", what the engine runs); then the weight-streaming kernel
(fp8_gemm_w8a16_max_tokens, models/fp8_w8a16.py: no act_quant) autotuned and at its fixed tile;
next to bf16 torch.matmul on the dequantized weights and
the FP8 weight-byte floor (N * K bytes / 4.3 TB/s).

    python scripts/bench_fp8_gemm.py --decode [--ms 1 2 4 8 16] [--splits 2 4 8 16] [--json PATH]
    python scripts/bench_fp8_gemm.py --decode --dry-run [--sms 132]   # the rows, no GPU
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
from bench_common import environment, graph_us, write_json

from models.fp8 import dequantize, quantize
from models.fp8_gemm import act_quant, fp8_linear, tuned_configs, w8a8_block_gemm
from models.fp8_gemm_splitk import choose_k_splits
from models.fp8_w8a16 import _FIXED as W16_FIXED
from models.fp8_w8a16 import w8a16_linear

SHAPES = [(7168, 2048), (24576, 1536), (2048, 7168), (7168, 16384)]  # (N, K) of V3 projections
R1 = str(Path(__file__).resolve().parent.parent / "configs" / "models" / "DeepSeek-R1")
HBM_BPS = 4.3e12  # the H200's copy bandwidth (DESIGN.md §10)
STREAM_BYTES = 256 << 20  # FP8 weight bytes per shape across the captured calls: 5x the H200's L2
MAX_CALLS = 64


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


def decode_shapes(model: str, tp: int) -> list[tuple[str, int, int]]:
    """(name, N, K) of the W8A8 GEMMs of one decode step on one of `tp` ranks, from config.json."""
    c = json.loads((Path(model) / "config.json").read_text())
    D, H, lkv = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"]
    qk, v = c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["v_head_dim"]
    kv_a = lkv + c["qk_rope_head_dim"]
    out = []
    if c.get("q_lora_rank"):
        out += [("q_a+kv_a", c["q_lora_rank"] + kv_a, D), ("q_b", H * qk // tp, c["q_lora_rank"])]
    else:
        out += [("q+kv_a", H * qk // tp + kv_a, D)]
    out += [("o_proj", D, H * v // tp)]
    if c.get("first_k_dense_replace", 0):
        out += [("dense gate_up", 2 * c["intermediate_size"] // tp, D), ("dense down", D, c["intermediate_size"] // tp)]
    shared = c.get("n_shared_experts") or 0
    if shared:
        inter = shared * c["moe_intermediate_size"] // tp
        out += [("shared gate_up", 2 * inter, D), ("shared down", D, inter)]
    return out + [("kv_a alone", kv_a, D)]


def decode_plan(a, num_sms: int) -> list[dict]:
    """The rows --decode times: shape, M, split count on `num_sms` SMs, floor, calls per graph."""
    rows = []
    for name, N, K in decode_shapes(a.model, a.tp):
        nkb = triton.cdiv(K, 128)
        calls = max(1, min(MAX_CALLS, -(-STREAM_BYTES // (N * K))))
        for M in a.ms:
            rows.append(dict(name=name, M=M, N=N, K=K, splits=choose_k_splits(M, N, nkb, num_sms),
                             extra_splits=[s for s in a.splits if 1 < s <= nkb], calls=calls,
                             floor_us=N * K / HBM_BPS * 1e6))
    return rows


def timed(fn, calls: list) -> float | None:
    try:
        return graph_us(fn, calls)
    except (RuntimeError, ValueError) as e:  # cuBLAS refusing a shape, a torch without its recipe
        print("  refused:", str(e).splitlines()[0][:160])
        torch.cuda.synchronize()
        return None


def decode_table(a) -> list[dict]:
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = decode_plan(a, num_sms)
    weights = {}
    for r in plan:
        N, K, M = r["N"], r["K"], r["M"]
        if (N, K) not in weights:
            weights.clear()  # one shape's copies at a time
            torch.cuda.empty_cache()
            ws = [quantize(torch.randn(N, K, device="cuda") * 0.02) for _ in range(r["calls"])]
            weights[(N, K)] = [(wq, sw, dequantize(wq, sw, (128, 128), torch.bfloat16)) for wq, sw in ws]
        ws = weights[(N, K)]
        xs = [torch.randn(M, K, device="cuda", dtype=torch.bfloat16) for _ in ws]
        fp8_calls = [(x, wq, sw) for x, (wq, sw, _) in zip(xs, ws)]

        def triton_fn(s):
            return lambda x, wq, sw: w8a8_block_gemm(*act_quant(x), wq, sw, x.dtype, backend="triton", splits=s)
        t = {"bf16": timed(lambda x, wb: x @ wb.T, [(x, wb) for x, (_, _, wb) in zip(xs, ws)]),
             "unsplit": timed(triton_fn(1), fp8_calls)}
        for s in sorted({r["splits"], *r["extra_splits"]} - {1}):
            t[f"split{s}"] = timed(triton_fn(s), fp8_calls)
        t["cublas"] = timed(lambda x, wq, sw: fp8_linear(x, wq, sw, "cublas"), fp8_calls) if M >= 4 else None
        t["auto"] = timed(lambda x, wq, sw: fp8_linear(x, wq, sw), fp8_calls)
        t["w8a16"] = timed(lambda x, wq, sw: w8a16_linear(x, wq, sw), fp8_calls)
        w16_tile = (W16_FIXED["BLOCK_N"], W16_FIXED["BLOCK_K"])
        t["w8a16 fixed"] = timed(lambda x, wq, sw: w8a16_linear(x, wq, sw, tile=w16_tile), fp8_calls)
        t["act_quant"] = timed(lambda x: act_quant(x), [(x,) for x in xs])
        # the split product against the unsplit one (fp32 out), a check that the timed kernel is right
        x, wq, sw = fp8_calls[0]
        one = w8a8_block_gemm(*act_quant(x), wq, sw, torch.float32, backend="triton", splits=1)
        errs = {s: ((w8a8_block_gemm(*act_quant(x), wq, sw, torch.float32, backend="triton", splits=s) - one).norm()
                    / one.norm()).item() for s in {r["splits"], *r["extra_splits"]} - {1}}
        r.update(us=t, split_vs_unsplit_rel_err=errs)
        cells = "  ".join(f"{k} {v:7.1f}" if v else f"{k}       -" for k, v in t.items())
        print(f"{r['name']:>14} M={M:2d} N={N:5d} K={K:5d} S={r['splits']:2d}: floor {r['floor_us']:6.1f}  {cells} us"
              f"  split err {max(errs.values(), default=0):.1e}", flush=True)
    return plan


def print_decode(rows: list[dict], splits: list[int]) -> None:
    def f(v, d=1):
        return f"{v:.{d}f}" if v else "-"
    print("\nµs per call inside a CUDA graph; each FP8 column includes act_quant (as --fp8-gemm runs a linear)")
    print("| shape | M | N | K | fp8 floor | bf16 | triton unsplit | S | triton split-K | split / unsplit | "
          "cuBLAS fp8 | auto | w8a16 | w8a16 fixed tile | best fp8 / bf16 | act quant |"
          + "".join(f" S={s} |" for s in splits))
    print("|" + "---|" * (16 + len(splits)))
    for r in rows:
        u = r["us"]
        sp = u.get(f"split{r['splits']}") if r["splits"] > 1 else None
        fp8 = [v for k, v in u.items() if v and k not in ("bf16", "act_quant")]
        best = min(fp8) if fp8 else None
        print(f"| {r['name']} | {r['M']} | {r['N']} | {r['K']} | {f(r['floor_us'])} | {f(u['bf16'])} | {f(u['unsplit'])} | "
              f"{r['splits']} | {f(sp)} | {f(sp and u['unsplit'] and sp / u['unsplit'], 2)} | {f(u['cublas'])} | "
              f"{f(u['auto'])} | {f(u['w8a16'])} | {f(u['w8a16 fixed'])} | "
              f"{f(best and u['bf16'] and best / u['bf16'], 2)} | {f(u['act_quant'])} |"
              + "".join(f" {f(u.get(f'split{s}'))} |" for s in splits))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ms", type=int, nargs="+", default=None,
                   help="row counts (default 1 16 256 4096; with --decode 1 2 4 8 16)")
    p.add_argument("--json", default=None)
    p.add_argument("--probe-only", action="store_true", help="only which M cuBLAS accepts")
    p.add_argument("--decode", action="store_true",
                   help="the model's decode projections at M <= 16, timed inside CUDA graphs (see above)")
    p.add_argument("--model", default=R1, help="with --decode: the model directory whose config.json gives the shapes")
    p.add_argument("-tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="with --decode: shapes of one rank under this TP size")
    p.add_argument("--splits", type=int, nargs="*", default=[],
                   help="with --decode: also time the split-K kernel at these split counts")
    p.add_argument("--dry-run", action="store_true", help="with --decode: print the rows it would time and exit")
    p.add_argument("--sms", type=int, default=132, help="with --dry-run: the SM count for the split choice (H200: 132)")
    a = p.parse_args()
    if a.decode:
        a.ms = a.ms or [1, 2, 4, 8, 16]
        if a.dry_run:
            for r in decode_plan(a, a.sms):
                print(f"{r['name']:>14} M={r['M']:2d} N={r['N']:5d} K={r['K']:5d}: splits {r['splits']:2d} on {a.sms} SMs"
                      f" (also {r['extra_splits']}), {r['calls']} calls per graph, fp8 floor {r['floor_us']:.1f} us")
            return
        rows = decode_table(a)
        print_decode(rows, a.splits)
        print("tuned:", tuned_configs())
        write_json(a.json, {"bench": "fp8_gemm_decode", "env": environment(), "results": rows,
                            "tuned": tuned_configs()})
        return
    a.ms = a.ms or [1, 16, 256, 4096]
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
