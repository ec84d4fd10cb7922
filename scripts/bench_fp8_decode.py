"""Time the MLA decode over an FP8 latent cache against the bf16 cache, side by side, in CUDA graphs
(issue 24's FP8 criterion: 16 heads, B = 128, S = 16k, >= 1.6x the bf16 kernel's throughput).

Rows: the bf16 cache on the Triton default (attention/triton_decode.py), the FP8 cache on the
Triton default, and the FP8 cache on the Gluon e4m3-wgmma kernel (attention/gluon_decode_fp8.py)
with each Fp8DecodeConfig given. Inputs are bench_mla_decode's (random cache, page 64, every
sequence at S; calls rotate over caches that together exceed L2). The Gluon kernel's output is
compared with the Triton FP8 default's (same bytes); a disagreement is printed.

  python3 scripts/bench_fp8_decode.py --shapes 128x16384,128x4096 --heads 16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention.decode_config import default_decode_config  # noqa: E402
from attention.gluon_decode_fp8 import Fp8DecodeConfig, check_available, mla_decode_fp8_wgmma  # noqa: E402
from attention.kv_quant import FP8_DTYPE  # noqa: E402
from attention.triton_decode import mla_decode  # noqa: E402
from bench_mla_decode import decode_inputs, graph_ms  # noqa: E402

LKV, R = 512, 64
# names after their options on top of the first kernel's order (all four off: "s2"), except "s4x1"
# and "m256".."m1024" (stages and split sizes over the defaults); "default" is Fp8DecodeConfig() as
# the engine runs it
_FIRST = dict(vt_early=False, vt_prmt=False, p_hw_decode=False, fence_first=False)


def _cfg(**on) -> Fp8DecodeConfig:
    return Fp8DecodeConfig(**{**_FIRST, **on})


CONFIGS = {"default": Fp8DecodeConfig(), "s2": _cfg(), "p0": _cfg(qk_promote=0),
           "early": _cfg(vt_early=True), "p0early": _cfg(qk_promote=0, vt_early=True),
           "lazy": _cfg(lazy_rescale=True), "prmt": _cfg(vt_prmt=True), "prmt_early": _cfg(vt_prmt=True, vt_early=True),
           "hwdec": _cfg(p_hw_decode=True), "prmt_hwdec": _cfg(vt_prmt=True, p_hw_decode=True),
           "ff": _cfg(fence_first=True), "prmt_hwdec_ff": _cfg(vt_prmt=True, p_hw_decode=True, fence_first=True),
           "prmt_hwdec_ff_early": _cfg(vt_prmt=True, p_hw_decode=True, fence_first=True, vt_early=True),
           "hwdec_ff": _cfg(p_hw_decode=True, fence_first=True),
           "hwdec_ff_early": _cfg(p_hw_decode=True, fence_first=True, vt_early=True),
           "s4x1": Fp8DecodeConfig(num_stages=4, programs_per_sm=1),
           "m256": Fp8DecodeConfig(min_split_tokens=256), "m512": Fp8DecodeConfig(min_split_tokens=512),
           "m1024": Fp8DecodeConfig(min_split_tokens=1024)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="128x16384,128x4096,32x4096,8x4096", metavar="BxS,...",
                    help="batch x sequence length, every sequence at that length")
    ap.add_argument("--heads", type=int, default=16, help="query heads (a multiple of 16)")
    ap.add_argument("--configs", default="default", help=f"Gluon configs, from {', '.join(CONFIGS)}")
    args = ap.parse_args()
    dev = torch.device("cuda")
    check_available(dev)
    H = args.heads
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    sm = (LKV + R) ** -0.5
    print(f"{torch.cuda.get_device_name()}, {H} heads; µs per call in CUDA graphs; GB/s of cache bytes")
    for shape in args.shapes.split(","):
        B, S = (int(x) for x in shape.split("x"))
        base = None
        for cname, cdt in (("bf16", torch.bfloat16), ("fp8", FP8_DTYPE)):
            q, cache, bts, lens = decode_inputs(B, S, H, cache_dtype=cdt)
            cfg = default_decode_config(H, torch.bfloat16, cache_dtype=cdt)
            nbytes = B * S * (LKV + R) * cache.element_size()
            runs = [(f"{cname} triton", lambda bt, c=cfg, q=q, cache=cache: mla_decode(q, cache, bt, lens, sm, LKV, cfg=c,
                                                                                  num_sms=num_sms))]
            if cname == "fp8":
                runs += [(f"fp8 gluon {n}", lambda bt, c=CONFIGS[n], q=q, cache=cache: mla_decode_fp8_wgmma(
                    q, cache, bt, lens, sm, LKV, cfg=c)) for n in args.configs.split(",")]
            ref = None
            for label, fn in runs:
                out = fn(bts[0])
                if ref is None:
                    ref = out
                else:
                    err = ((out[0].float() - ref[0].float()).norm() / ref[0].float().norm()).item()
                    dl = (out[1] - ref[1]).abs().max().item()
                    if not err < 2e-2 or not dl < 2e-2:
                        print(f"  DISAGREES: {label} vs {runs[0][0]}: o rel {err:.3g}, lse max {dl:.3g}")
                us = graph_ms([lambda bt=bt: fn(bt) for bt in bts]) * 1e3
                if base is None:
                    base = us
                print(f"B={B} S={S} {label}: {us:.1f} us, {nbytes / us / 1e3:.0f} GB/s, "
                      f"{base / us:.2f}x bf16's throughput")
    return 0


if __name__ == "__main__":
    sys.exit(main())
