"""absorb_q / absorb_o (attention/triton_absorb.py) by tile, at the decode's row counts.

    python scripts/bench_absorb.py                      # V2-Lite per rank: 16 heads, P 128, L 512, R 64, V 128
    python scripts/bench_absorb.py --tokens 32 128

Device µs per call inside one CUDA graph over weight copies that do not fit in L2 together (as a
step's 27 layers stream theirs), each tile against the default one (`_absorb_q_tiles` / absorb_o's) (checked equal to it first:
the same products in another order, so within bf16 rounding), next to the bytes' floor at 4.3 TB/s.
Why: at batch 32 / 128 absorb_q took 8.1 / 10.9 µs a call in the decode step's profile, ~10x its
bytes (RESULTS.md), a sign of too few programs rather than of bandwidth.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from bench_common import graph_us

from attention.triton_absorb import absorb_o, absorb_q

Q_TILES = [dict(BL=bl, BT=bt, num_warps=w) for bl, bt, w in itertools.product((32, 64, 128), (16, 32, 64), (2, 4))]
O_TILES = [dict(BL=bl, BV=bv, BT=bt, num_warps=4, num_stages=2)
           for bl, bv, bt in itertools.product((64, 128), (16, 32, 64), (16, 32, 64))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="*", default=[1, 8, 32, 128, 256])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--copies", type=int, default=48, help="weight copies cycled through (2 MB each at 16 heads)")
    a = p.parse_args()
    dev, dt, H, P, L, R, V = "cuda", torch.bfloat16, a.heads, 128, 512, 64, 128
    w_uk = [torch.randn(H, P + V, L, device=dev, dtype=dt)[:, :P] for _ in range(a.copies)]
    w_uv = [torch.randn(H, P + V, L, device=dev, dtype=dt)[:, P:] for _ in range(a.copies)]
    print("| op | T | default µs | best µs | best tile | floor µs | tiles tried |\n|---|---|---|---|---|---|---|")
    for T in a.tokens:
        q = torch.randn(T, H, P + R, device=dev, dtype=dt)
        cs = torch.randn(T, R, device=dev, dtype=torch.float32)
        o_lat = torch.randn(T, H, L, device=dev, dtype=dt)
        for name, tiles, fn, calls, nbytes in (
                ("absorb_q", Q_TILES, lambda w, t: absorb_q(q[..., :P], q[..., P:], w, cs, tiles=t),
                 w_uk, H * P * L * 2 + T * H * (P + R + L + R) * 2),
                ("absorb_o", O_TILES, lambda w, t: absorb_o(o_lat, w, tiles=t), w_uv,
                 H * V * L * 2 + T * H * (L + V) * 2)):
            ref = fn(calls[0], None).float()
            base = graph_us(lambda w: fn(w, None), [(w,) for w in calls])
            best, best_t, tried = base, "default", 0
            for t in tiles:
                if t["BT"] > max(16, T) * 2:  # tiles of mostly masked rows
                    continue
                try:
                    got = fn(calls[0], t).float()
                    err = ((got - ref).norm() / ref.norm()).item()
                    if err > 1e-2:
                        print(f"{name} T={T} {t}: differs from the default by {err:.2e}")
                        continue
                    us = graph_us(lambda w, t=t: fn(w, t), [(w,) for w in calls])
                except Exception as e:  # a tile that does not compile (shared memory) is skipped
                    print(f"{name} T={T} {t}: {type(e).__name__} {str(e)[:120]}")
                    continue
                tried += 1
                if us < best:
                    best, best_t = us, t
            print(f"| {name} | {T} | {base:.2f} | {best:.2f} | {best_t} | {nbytes / 4.3e6:.2f} | {tried} |", flush=True)


if __name__ == "__main__":
    main()
