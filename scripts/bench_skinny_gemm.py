"""The few-row GEMM (models/skinny_gemm.py) against cuBLAS (F.linear) at decode shapes.

    python scripts/bench_skinny_gemm.py                      # V2-Lite's and V3's projections, M 1..64
    python scripts/bench_skinny_gemm.py --rows 1 8 --tiles   # every candidate tile too

µs per call in a CUDA graph over enough weight copies that each call streams its weight from
HBM (as in a decode step, where the other layers evict it from L2), bf16; the floor is the
weight's bytes at 4.3 TB/s.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_common import graph_us

from common.launch_settings import use_autotune
from models import skinny_gemm as sg

SHAPES = {  # name: (N, K)
    "v2lite q+kv_a": (3648, 2048), "v2lite o_proj": (2048, 2048), "v2lite dense gate_up": (21888, 2048),
    "v2lite dense down": (2048, 10944), "v3 q_a+kv_a": (2112, 7168), "v3 o_proj": (7168, 16384),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--tiles", action="store_true", help="time every candidate tile, not only the tuned pick")
    a = p.parse_args()
    use_autotune(True)
    dev = torch.device("cuda")
    print("| shape | M | floor us | cuBLAS us | skinny (tuned) us | cuBLAS / skinny | tuned tile | best tile us |")
    print("|---|---|---|---|---|---|---|---|")
    for name in a.shapes:
        N, K = SHAPES[name]
        copies = max(2, int(160e6 // (N * K * 2)) + 1)
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) / K ** 0.5 for _ in range(copies)]
        floor = N * K * 2 / 4.3e12 * 1e6
        for m in a.rows:
            x = torch.randn(m, K, device=dev, dtype=torch.bfloat16)
            calls = [(x, w) for w in ws]
            cub = graph_us(lambda x, w: F.linear(x, w), calls)
            sk = graph_us(sg.skinny_linear, calls)
            err = (sg.skinny_linear(x, ws[0]).float() - F.linear(x.float(), ws[0].float())).abs().max().item()
            key = [k for k in sg._skinny_gemm_tuned.cache if k[0] == N and k[1] == K and k[2] == sg.row_bucket(m)]
            tuned = sg._skinny_gemm_tuned.cache[key[0]] if key else None
            best = ""
            if a.tiles:
                times = []
                for cfg in sg._CONFIGS:
                    t = cfg.kwargs
                    def run(x, w, t=t, cfg=cfg):
                        y = torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device)
                        sg._skinny_gemm_kernel[(triton_cdiv(N, t["BLOCK_N"]), triton_cdiv(x.shape[0], sg.row_bucket(m)))](
                            x, w, y, x.shape[0], N, K, x.stride(0), w.stride(0), y.stride(0),
                            M_BUCKET=sg.row_bucket(m), IEEE=False, PDL=False, **t,
                            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
                        return y
                    try:
                        times.append((graph_us(run, calls), cfg))
                    except Exception as e:  # a tile that does not fit (shared memory)
                        times.append((float("inf"), f"{cfg}: {type(e).__name__}"))
                bt, bc = min(times, key=lambda t: t[0])
                best = f"{bt:.2f} ({bc})"
            print(f"| {name} | {m} | {floor:.2f} | {cub:.2f} | {sk:.2f} | {cub / sk:.2f} | {tuned} | {best} |"
                  f"  max err {err:.1e}", flush=True)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


if __name__ == "__main__":
    main()
