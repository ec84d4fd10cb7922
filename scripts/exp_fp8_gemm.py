"""Block-FP8 W8A8 GEMM design experiment (issue 9's 1.5x goal): kernel variants side by side.

Every variant computes y = sum_kb sa[m, kb] * sb[n // 128, kb] * (xq[:, kb] @ wq[:, kb]ᵀ), is
checked against dequantize-then-matmul in fp32 on fresh random data (output NaN-poisoned first),
then timed with do_bench (median) at the V3 shapes. Ceilings printed beside them: bf16 cuBLAS,
an unscaled Triton fp8 GEMM (what the scales cost) and torch._scaled_mm (cuBLAS fp8, row-wise and,
where this torch has it, block-wise).

Variants (constexpr switches of two kernels):
  loop   pointer loads, grouped order, one program per tile.
         SBS: weight scale per tile as a scalar (BN <= 128) instead of a per-column vector
         PIPE: the scale FMA of block kb-1 after issuing block kb's dot (a manual software pipeline)
         UNROLL: two K blocks per iteration; SAT: activation scales stored [K/128, M] (coalesced)
  tma    persistent grid over tiles, TMA descriptors for A, B and C; WS: warp specialization

    python scripts/exp_fp8_gemm.py [--ms 4096] [--quick] [--json PATH]
    TRITON_INTERPRET=1 python scripts/exp_fp8_gemm.py --check-only   (CPU, small shapes)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models.fp8 import dequantize, quantize  # noqa: E402
from models.fp8_gemm import _grouped_tile as _grouped  # noqa: E402
from models.fp8_gemm import act_quant_torch, w8a8_block_gemm  # noqa: E402

INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _scales(sa_ptr, sb_ptr, kb, offs_m, mm, offs_n, mn, pid_n, M, NKB,
            BN: tl.constexpr, BK: tl.constexpr, SBS: tl.constexpr, SAT: tl.constexpr):
    if SAT:
        sa = tl.load(sa_ptr + kb * M + offs_m, mask=mm, other=0.0)
    else:
        sa = tl.load(sa_ptr + offs_m * NKB + kb, mask=mm, other=0.0)
    if SBS:
        s = (sa * tl.load(sb_ptr + ((pid_n * BN) // BK) * NKB + kb))[:, None]
    else:
        s = sa[:, None] * tl.load(sb_ptr + (offs_n // BK) * NKB + kb, mask=mn, other=0.0)[None, :]
    return s


@triton.jit
def loop_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, M, N, K, NKB,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                SBS: tl.constexpr, PIPE: tl.constexpr, UNROLL: tl.constexpr, SAT: tl.constexpr,
                SCALED: tl.constexpr):
    pid_m, pid_n = _grouped(tl.program_id(0), M, N, BM, BN, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mm, mn = offs_m < M, offs_n < N
    a_base = a_ptr + offs_m[:, None].to(tl.int64) * K + tl.arange(0, BK)[None, :]
    b_base = b_ptr + offs_n[None, :].to(tl.int64) * K + tl.arange(0, BK)[:, None]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if not SCALED:  # the ceiling: plain fp8 GEMM, wgmma accumulating in place
        for kb in range(0, NKB):
            a = tl.load(a_base + kb * BK, mask=mm[:, None], other=0.0)
            b = tl.load(b_base + kb * BK, mask=mn[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
    elif UNROLL == 2:
        for kb in range(0, NKB, 2):
            a0 = tl.load(a_base + kb * BK, mask=mm[:, None], other=0.0)
            b0 = tl.load(b_base + kb * BK, mask=mn[None, :], other=0.0)
            a1 = tl.load(a_base + (kb + 1) * BK, mask=mm[:, None], other=0.0)
            b1 = tl.load(b_base + (kb + 1) * BK, mask=mn[None, :], other=0.0)
            s0 = _scales(sa_ptr, sb_ptr, kb, offs_m, mm, offs_n, mn, pid_n, M, NKB, BN, BK, SBS, SAT)
            s1 = _scales(sa_ptr, sb_ptr, kb + 1, offs_m, mm, offs_n, mn, pid_n, M, NKB, BN, BK, SBS, SAT)
            d0 = tl.dot(a0, b0)
            d1 = tl.dot(a1, b1)
            acc += d0 * s0 + d1 * s1
    elif PIPE:
        d_prev = tl.zeros([BM, BN], dtype=tl.float32)
        s_prev = tl.zeros([BM, 1], dtype=tl.float32)
        if not SBS:
            s_prev = tl.zeros([BM, BN], dtype=tl.float32)
        for kb in range(0, NKB):
            a = tl.load(a_base + kb * BK, mask=mm[:, None], other=0.0)
            b = tl.load(b_base + kb * BK, mask=mn[None, :], other=0.0)
            s = _scales(sa_ptr, sb_ptr, kb, offs_m, mm, offs_n, mn, pid_n, M, NKB, BN, BK, SBS, SAT)
            d = tl.dot(a, b)
            acc += d_prev * s_prev
            d_prev = d
            s_prev = s
        acc += d_prev * s_prev
    else:
        for kb in range(0, NKB):
            a = tl.load(a_base + kb * BK, mask=mm[:, None], other=0.0)
            b = tl.load(b_base + kb * BK, mask=mn[None, :], other=0.0)
            s = _scales(sa_ptr, sb_ptr, kb, offs_m, mm, offs_n, mn, pid_n, M, NKB, BN, BK, SBS, SAT)
            acc += tl.dot(a, b) * s
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=mm[:, None] & mn[None, :])


@triton.jit
def tma_kernel(a_desc, sa_ptr, b_desc, sb_ptr, c_desc, M, N, K, NKB,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
               NUM_PROGS: tl.constexpr, SBS: tl.constexpr, SAT: tl.constexpr, WS: tl.constexpr,
               FLAT: tl.constexpr):
    num_tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGS, flatten=FLAT, warp_specialize=WS):
        pid_m, pid_n = _grouped(tile, M, N, BM, BN, GROUP_M)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        mm, mn = offs_m < M, offs_n < N
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for kb in range(0, NKB):
            a = a_desc.load([pid_m * BM, kb * BK])
            b = b_desc.load([pid_n * BN, kb * BK])
            s = _scales(sa_ptr, sb_ptr, kb, offs_m, mm, offs_n, mn, pid_n, M, NKB, BN, BK, SBS, SAT)
            acc += tl.dot(a, b.T) * s
        c_desc.store([pid_m * BM, pid_n * BN], acc.to(c_desc.dtype))


def n_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 4


def run_loop(xq, sx, sxt, wq, sw, v):
    M, K = xq.shape
    N = wq.shape[0]
    y = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=xq.device)
    bm, bn = v["tile"]
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    kw = {} if INTERP else {"num_warps": v["w"], "num_stages": v["st"]}
    if "maxnreg" in v and not INTERP:
        kw["maxnreg"] = v["maxnreg"]
    loop_kernel[grid](xq, sxt if v.get("sat") else sx, wq, sw, y, M, N, K, K // 128, BM=bm, BN=bn, BK=128,
                      GROUP_M=8, SBS=v.get("sbs", True), PIPE=v.get("pipe", False), UNROLL=v.get("unroll", 1),
                      SAT=v.get("sat", False), SCALED=v.get("scaled", True), **kw)
    return y


def make_tma(xq, sx, sxt, wq, sw, v):
    from triton.tools.tensor_descriptor import TensorDescriptor
    M, K = xq.shape
    N = wq.shape[0]
    bm, bn = v["tile"]
    y = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=xq.device)
    a_d = TensorDescriptor.from_tensor(xq, [bm, 128])
    b_d = TensorDescriptor.from_tensor(wq, [bn, 128])
    c_d = TensorDescriptor.from_tensor(y, [bm, bn])
    progs = min(n_sms() * v.get("occ", 1), triton.cdiv(M, bm) * triton.cdiv(N, bn))
    kw = {} if INTERP else {"num_warps": v["w"], "num_stages": v["st"]}

    def call():
        tma_kernel[(progs,)](a_d, sxt if v.get("sat") else sx, b_d, sw, c_d, M, N, K, K // 128, BM=bm, BN=bn,
                             BK=128, GROUP_M=8, NUM_PROGS=progs, SBS=v.get("sbs", True), SAT=v.get("sat", False),
                             WS=v.get("ws", False), FLAT=v.get("flat", False), **kw)
        return y
    return call


def variants(quick: bool) -> list[dict]:
    vs = [
        {"name": "prod (autotuned)", "kind": "prod"},
        {"name": "unscaled fp8 128x128 w8 s4", "kind": "loop", "tile": (128, 128), "w": 8, "st": 4, "scaled": False},
        {"name": "unscaled fp8 128x256 w8 s3", "kind": "loop", "tile": (128, 256), "w": 8, "st": 3, "scaled": False},
        {"name": "loop 128x128 w8 s4", "kind": "loop", "tile": (128, 128), "w": 8, "st": 4},
        {"name": "loop 128x128 w8 s4 sat", "kind": "loop", "tile": (128, 128), "w": 8, "st": 4, "sat": True},
        {"name": "loop 128x128 w8 s4 pipe", "kind": "loop", "tile": (128, 128), "w": 8, "st": 4, "pipe": True},
        {"name": "loop 128x128 w8 s2 unroll2", "kind": "loop", "tile": (128, 128), "w": 8, "st": 2, "unroll": 2},
        {"name": "loop 128x128 w8 s3", "kind": "loop", "tile": (128, 128), "w": 8, "st": 3},
        {"name": "loop 64x128 w4 s3 maxnreg168", "kind": "loop", "tile": (64, 128), "w": 4, "st": 3, "maxnreg": 168},
        {"name": "loop 64x128 w4 s4 sat", "kind": "loop", "tile": (64, 128), "w": 4, "st": 4, "sat": True},
        {"name": "loop 128x64 w4 s4", "kind": "loop", "tile": (128, 64), "w": 4, "st": 4},
        {"name": "loop 128x128 w4 s4", "kind": "loop", "tile": (128, 128), "w": 4, "st": 4},
        {"name": "loop 128x256 w8 s3 vec", "kind": "loop", "tile": (128, 256), "w": 8, "st": 3, "sbs": False},
        {"name": "loop 256x128 w8 s3", "kind": "loop", "tile": (256, 128), "w": 8, "st": 3},
        {"name": "loop 64x128 w4 s4", "kind": "loop", "tile": (64, 128), "w": 4, "st": 4},
        {"name": "tma 128x128 w8 s4", "kind": "tma", "tile": (128, 128), "w": 8, "st": 4},
        {"name": "tma 128x128 w8 s4 sat", "kind": "tma", "tile": (128, 128), "w": 8, "st": 4, "sat": True},
        {"name": "tma 128x128 w8 s4 ws", "kind": "tma", "tile": (128, 128), "w": 8, "st": 4, "ws": True, "sat": True},
        {"name": "tma 128x128 w4 s4 ws", "kind": "tma", "tile": (128, 128), "w": 4, "st": 4, "ws": True, "sat": True},
        {"name": "tma 128x256 w8 s3 vec", "kind": "tma", "tile": (128, 256), "w": 8, "st": 3, "sbs": False, "sat": True},
        {"name": "tma 128x128 w8 s4 flat", "kind": "tma", "tile": (128, 128), "w": 8, "st": 4, "flat": True, "sat": True},
        {"name": "tma 128x128 w8 s3 occ2", "kind": "tma", "tile": (128, 128), "w": 8, "st": 3, "occ": 2, "sat": True},
    ]
    return vs[:2] if quick else vs


def torch_refs(x, xq, sx, wq, sw, wb):
    """cuBLAS ceilings: bf16, fp8 row-wise and block-wise torch._scaled_mm (None where unsupported)."""
    M, K = xq.shape
    out = {"bf16 cuBLAS": lambda: x @ wb.T}
    one = torch.ones((), device=x.device)
    try:
        sr = torch.ones(M, 1, device=x.device)
        sc = torch.ones(1, wq.shape[0], device=x.device)
        torch._scaled_mm(xq, wq.T, sr, sc, out_dtype=torch.bfloat16)
        out["fp8 cuBLAS row-wise"] = lambda: torch._scaled_mm(xq, wq.T, sr, sc, out_dtype=torch.bfloat16)
    except Exception as e:  # noqa: BLE001
        print("row-wise _scaled_mm:", type(e).__name__, str(e)[:120])
    try:  # 1x128 activation scales (M-major), 128x128 weight scales
        sxa = sx.t().contiguous().t()
        swb = sw.t().contiguous().t() if False else sw
        y = torch._scaled_mm(xq, wq.T, sxa, swb.T, out_dtype=torch.bfloat16)
        out["fp8 cuBLAS block-wise"] = lambda: torch._scaled_mm(xq, wq.T, sxa, swb.T, out_dtype=torch.bfloat16)
        out["_block_check"] = y
    except Exception as e:  # noqa: BLE001
        print("block-wise _scaled_mm:", type(e).__name__, str(e)[:200])
    del one
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ms", type=int, nargs="+", default=[4096])
    p.add_argument("--shapes", default="7168x2048,24576x1536,2048x7168,7168x16384")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--full-ms", type=int, nargs="+", default=[4096], help="Ms that time every variant")
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    if a.check_only:
        shapes, a.ms = [(256, 512)], [40]
    rows, t0 = [], time.time()
    for N, K in shapes:
        g = torch.Generator(device="cpu").manual_seed(N + K)
        w = torch.randn(N, K, generator=g).to(dev) * 0.02
        wq, sw = quantize(w)
        wb = w.bfloat16()
        wd = dequantize(wq, sw, (128, 128))
        for M in a.ms:
            x = (torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 4).to(dev).bfloat16()
            xq, sx = act_quant_torch(x)
            sxt = sx.t().contiguous()
            ref = (xq.float() * sx.repeat_interleave(128, 1)[:, :K]) @ wd.T
            flop = 2 * M * N * K
            refs = {} if (a.check_only or dev == "cpu") else torch_refs(x, xq, sx, wq, sw, wb)
            blk = refs.pop("_block_check", None)
            if blk is not None:
                print(f"  block-wise _scaled_mm rel err {((blk.float() - ref).norm() / ref.norm()).item():.2e}")
            for name, fn in refs.items():
                t = triton.testing.do_bench(fn, return_mode="median")
                rows.append({"M": M, "N": N, "K": K, "variant": name, "tflops": flop / t / 1e9, "err": None})
            for v in variants(a.quick or M not in a.full_ms):
                if v["kind"] == "prod":
                    if dev == "cpu" and not INTERP:
                        continue
                    fn = lambda: w8a8_block_gemm(xq, sx, wq, sw)  # noqa: E731
                elif v["kind"] == "loop":
                    fn = lambda v=v: run_loop(xq, sx, sxt, wq, sw, v)  # noqa: E731
                else:
                    fn = make_tma(xq, sx, sxt, wq, sw, v)
                try:
                    y = fn()
                    if dev == "cuda":
                        torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001
                    print(f"M={M} N={N} K={K} {v['name']}: {type(e).__name__}: {str(e)[-700:]}", flush=True)
                    continue
                if v.get("scaled", True):
                    err = ((y.float() - ref).norm() / ref.norm()).item() if not y.isnan().any() else float("nan")
                else:
                    err = None
                tf = None
                if dev == "cuda":
                    tf = flop / triton.testing.do_bench(fn, return_mode="median") / 1e9
                rows.append({"M": M, "N": N, "K": K, "variant": v["name"], "tflops": tf, "err": err})
                print(f"M={M} N={N} K={K} {v['name']:32s} {'' if tf is None else f'{tf:7.1f} TFLOP/s'}"
                      f"  err {err if err is None else f'{err:.1e}'}  ({time.time() - t0:.0f} s)", flush=True)
    bad = [r for r in rows if r["err"] is not None and not r["err"] <= 1e-2]
    print("\nvariant".ljust(34) + "".join(f"{f'{n}x{k}':>12s}" for n, k in shapes))
    for name in dict.fromkeys(r["variant"] for r in rows):
        cells = []
        for N, K in shapes:
            r = [r for r in rows if r["variant"] == name and (r["N"], r["K"]) == (N, K) and r["M"] == a.ms[-1]]
            cells.append(f"{r[0]['tflops']:12.1f}" if r and r[0]["tflops"] else f"{'-':>12s}")
        print(name.ljust(33) + "".join(cells))
    print("FAILED checks:", [(r["variant"], r["N"], r["K"], r["err"]) for r in bad] if bad else "none")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
