"""Time GluonDecodeConfig variants of the many-heads MLA decode (attention/gluon_decode.py) side by
side, in CUDA graphs, on bench_mla_decode's inputs (random bf16 cache, page 64, every sequence at
S; the calls rotate over sets of caches that together exceed L2, so the cache is read from HBM).
Each config's output is compared with the first config's; a disagreement is printed.

  python3 scripts/bench_gluon_configs.py                       # lockstep, lazy, producer, both, seesaw
  python3 scripts/bench_gluon_configs.py --shapes 128x4096 --hot-l2   # also an L2-resident cache

--hot-l2 adds each config over a block table whose every entry is the same block (the same
kernel and work, the cache read from L2): how much of the time is the cache's HBM reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention.gluon_decode import SEESAW, GluonDecodeConfig, check_gluon_available, mla_decode_wgmma  # noqa: E402
from bench_mla_decode import decode_inputs, graph_ms  # noqa: E402

LKV, R = 512, 64
# "lockstep": GluonDecodeConfig()'s schedule (attention/gluon_decode.py); the engine's default is SEESAW
CONFIGS = {"lockstep": GluonDecodeConfig(), "lazy": GluonDecodeConfig(lazy_rescale=True),
           "producer": GluonDecodeConfig(producer=True),
           "producer+lazy": GluonDecodeConfig(producer=True, lazy_rescale=True), "seesaw": SEESAW,
           "seesaw+lazy": dataclasses.replace(SEESAW, lazy_rescale=True)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="128x4096,128x16384,32x4096,8x4096", metavar="BxS,...")
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"from {', '.join(CONFIGS)}")
    ap.add_argument("--hot-l2", action="store_true", help="also time an L2-resident cache")
    args = ap.parse_args()
    check_gluon_available(torch.device("cuda"))
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    H = args.heads
    print(f"{torch.cuda.get_device_name()}, {H} heads; µs per call in CUDA graphs, TFLOP/s at "
          "2*B*S*H*(576 + 512)")
    for shape in args.shapes.split(","):
        B, S = (int(x) for x in shape.split("x"))
        q, cache, bts, lens = decode_inputs(B, S, H)
        flops = 2 * B * S * H * (LKV + R + LKV)
        tables = [("", bts)] + ([(" L2-resident", [torch.zeros_like(bts[0])])] if args.hot_l2 else [])
        ref = None
        for name in names:
            cfg = CONFIGS[name]
            o, _ = mla_decode_wgmma(q, cache, bts[0], lens, 0.1, LKV, cfg=cfg)
            if ref is None:
                ref = o.float()
            err = ((o.float() - ref).norm() / ref.norm()).item()
            if err > 1e-2:
                print(f"B={B} S={S} {name}: DISAGREES with {names[0]} (relative error {err:.3g})")
            for tag, bt_set in tables:
                calls = [lambda bt=bt: mla_decode_wgmma(q, cache, bt, lens, 0.1, LKV, cfg=cfg) for bt in bt_set]
                ms = graph_ms((calls * 4)[:max(4, len(calls))])
                print(f"B={B} S={S} {name}{tag}: {ms * 1e3:.1f} us, {flops / ms / 1e9:.1f} TFLOP/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
