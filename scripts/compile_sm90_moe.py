"""Compile the fused small MoE's two kernels (models/fused_moe.py) for sm_90 without a GPU: bf16
and FP8 weights, with and without LEFT_OUT (expert parallelism's skipped pairs), at R1's shapes'
constants (8 routed pairs a token, 128-wide blocks). Prints each variant's PTX and cubin sizes;
exits non-zero when one does not compile.

Runs on a CPU-only machine (Triton lowers to PTX and runs its bundled ptxas). Written against the
GPU machine's Triton 3.6; with another installed, point PYTHONPATH at a 3.6 install:

  PYTHONPATH=<triton 3.6> python scripts/compile_sm90_moe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from models import fused_moe as fm  # noqa: E402

CONSTS = dict(K_TOP=8, NS=0, J0=0, JN=8, QB=128, IEEE=False, BLOCK_N=64, BLOCK_K=128, PDL=False)


def compile_kernel(fn, args: dict[str, str], consts: dict):
    sig = dict(args, **{k: "constexpr" for k in consts})
    return triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "num_stages": 4})


def main() -> None:
    print(f"triton {triton.__version__}, sm_90")
    for left_out in (False, True):
        for scaled, wdt in ((False, "*bf16"), (True, "*fp8e4nv")):
            c = dict(CONSTS, SCALED=scaled, LEFT_OUT=left_out)
            up = compile_kernel(fm._gate_up_dot_kernel, {
                "x_ptr": "*bf16", "ids_ptr": "*i32", "w13_ptr": wdt, "s13_ptr": "*fp32", "h_ptr": "*bf16", "D": "i32",
                "I": "i32", "E_R": "i32", "T_BUCKET": "i32", "S_ROWS": "i32", "S_COLS": "i32"}, c)
            down = compile_kernel(fm._down_dot_kernel, {
                "h_ptr": "*bf16", "ids_ptr": "*i32", "wts_ptr": "*fp32", "w2_ptr": wdt, "s2_ptr": "*fp32",
                "part_ptr": "*fp32", "D": "i32", "I": "i32", "E_R": "i32", "T_BUCKET": "i32", "S_ROWS": "i32",
                "S_COLS": "i32"}, c)
            sizes = [f"{len(k.asm['ptx'])} B PTX, {len(k.asm['cubin'])} B cubin" for k in (up, down)]
            print(f"LEFT_OUT={int(left_out)} {'fp8' if scaled else 'bf16'}: gate/up {sizes[0]}; down {sizes[1]}")


if __name__ == "__main__":
    main()
