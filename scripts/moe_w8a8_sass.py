"""Compile the FP8 block MoE kernels (models/blocked_moe.py, weight-only and W8A8) for sm_90a on
any machine, no GPU needed: per block size (16/32/64 rows) and autotune candidate, Triton's shared
memory, ptxas's registers and spills, the main k loop's size, the tensor-core instruction
(QGMMA: FP8 wgmma; HGMMA: bf16 wgmma; none: mma.sync) and the FP8 conversions in the SASS.

Use the device's Triton (3.6 on the H200 host) for figures that match its code:

    PYTHONPATH=<triton 3.6 install> python scripts/moe_w8a8_sass.py

Exit status 1 when a W8A8 candidate does not compile, spills, or does not get QGMMA.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402

from decode_sass import main_loop_ops  # noqa: E402
from models import blocked_moe as bm  # noqa: E402
from w8a8_sass import compile_kernel as compile_w8a8, sass_of  # noqa: E402

DIVISIBLE = {"D", "I"}  # 16-divisible at the real shapes (pointers too, from torch's allocator)


def pointers(a8: bool) -> tuple[dict, dict]:
    """The gate/up and down kernels' pointer types: activations FP8 under W8A8, else bf16."""
    act = "*fp8e4nv" if a8 else "*bf16"
    up = {"x_ptr": act, "sx_ptr": "*fp32", "rows_ptr": "*i64", "bexp_ptr": "*i64", "w13_ptr": "*fp8e4nv",
          "s13_ptr": "*fp32", "h_ptr": "*bf16"}
    down = {"h_ptr": act, "sh_ptr": "*fp32", "rows_ptr": "*i64", "bexp_ptr": "*i64", "pw_ptr": "*fp32",
            "w2_ptr": "*fp8e4nv", "s2_ptr": "*fp32", "part_ptr": "*fp32"}
    return up, down


def compile_kernel(fn, ptrs: dict, const: dict, num_warps: int, num_stages: int):
    """fn for sm_90a (w8a8_sass.compile_kernel with these kernels' pointers and divisible ints)."""
    return compile_w8a8(fn, const, num_warps, num_stages, ptrs=ptrs, divisible=DIVISIBLE, one=set())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.parse_args()
    print(f"triton {triton.__version__} ({triton.__file__}), sm_90a\n")
    print("| mode | block_m | kernel (BLOCK_N, BLOCK_K, warps, stages) | smem KB | registers | spill bytes | "
          "k-loop instructions | tensor-core op | FP8 conversions |")
    print("|---|---|---|---|---|---|---|---|---|")
    fixed = (bm._BLOCKED_FIXED["BLOCK_N"], bm._BLOCKED_FIXED["BLOCK_K"], bm._BLOCKED_FIXED["num_warps"],
             bm._BLOCKED_FIXED["num_stages"])
    ok = True
    for a8, tiles in ((True, bm._BLOCKED_TILES_W8A8), (False, bm._BLOCKED_TILES_FP8)):
        up, down = pointers(a8)
        for block_m in (16, 32, 64):
            for n, k, w, st in dict.fromkeys([*tiles, fixed]):  # the fixed tile is also the first tuned one
                const = dict(QB=128, SCALED=True, A8=a8, IEEE=False, BLOCK_M=block_m, BLOCK_N=n, BLOCK_K=k,
                             PDL=False)
                for name, fn, ptrs in (("gate/up", bm._blocked_gate_up_kernel, up),
                                       ("down", bm._blocked_down_kernel, down)):
                    tag = f"| {'W8A8' if a8 else 'weight-only'} | {block_m} | {name} {(n, k, w, st)}"
                    try:
                        kern = compile_kernel(fn, ptrs, const, w, st)
                    except Exception as e:  # noqa: BLE001 - reported, exit status 1
                        print(f"{tag} | COMPILE FAILED: {type(e).__name__}: {str(e)[:300]} |")
                        ok &= not a8
                        continue
                    regs, sass = sass_of(kern.asm["ptx"])
                    m = re.search(r"Used (\d+) registers", regs)
                    s = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", regs)
                    spills = int(s.group(1)) + int(s.group(2)) if s else None
                    mma = sorted(set(re.findall(r"\b([QH]GMMA[.\w]*)", sass))) or ["mma.sync"]
                    cvt = len(re.findall(r"F2FP[.A-Z0-9]*E4M3", sass))
                    print(f"{tag} | {kern.metadata.shared / 1024:.0f} | {m.group(1) if m else '?'} | {spills} | "
                          f"{sum(main_loop_ops(sass).values())} | {' '.join(mma)} | {cvt} |", flush=True)
                    if a8:
                        ok &= spills == 0 and mma[0].startswith("QGMMA") and cvt == 0
    print("\nRESULT:", "ok" if ok else "NOT OK (a W8A8 kernel failed to compile, spills or lacks QGMMA)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
