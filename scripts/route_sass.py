"""Compile the one-launch router (`models/triton_route.py` `_router_fused_kernel`) for sm_90 without
a GPU and print what its cubin costs: shared memory, registers, local memory (spills), and its
MMA and copy instructions. No timing: a check, before a device call, that the kernel compiles under
the installed Triton (the GPU machine has 3.6: PYTHONPATH=<a triton 3.6 install>) with its tiles
pipelined (cp.async, LDGSTS) and without spills.

  python scripts/route_sass.py                  # V2-Lite's router: 64 experts, top-6, D 2048, 2 shared
  python scripts/route_sass.py --experts 32 --top-k 4 --hidden 1024
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import models.triton_route as tr  # noqa: E402

INSTRUCTIONS = ["HGMMA", "HMMA", "LDGSTS", "LDG", "LDSM", "STS", "BAR"]


def compile_router(dtype: str, E: int, K: int, D: int, NS: int):
    """The kernel as `route_triton` launches it for `dtype` ("bf16" or "fp32") activations; the
    pointers, D and the row stride marked 16-divisible as the JIT specializes them for the
    engine's tensors."""
    fn = tr._router_fused_kernel.kernel  # the JITFunction under common/triton_launch's wrapper
    bk = max(16, min(64 if dtype == "fp32" else 256, triton.next_power_of_2(D)))
    const = dict(E=E, EP=max(16, triton.next_power_of_2(E)), K=K, KP=triton.next_power_of_2(K), SIGMOID=False,
                 HAS_BIAS=False, NORM=False, NS=NS, NSP=max(1, triton.next_power_of_2(NS)), BT=tr.FUSED_ROWS,
                 BK=bk, PRECISION="ieee" if dtype == "fp32" else "tf32", PDL=False)
    ptrs = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "bias_ptr": f"*{dtype}", "w_out_ptr": "*fp32",
            "ids_ptr": "*i64"}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name], attrs[(i,)] = ptrs[name], [["tt.divisibility", 16]]
        elif name == "scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name in ("D", "stride_x"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(tr.FUSED_TILE))


def cubin_report(cubin: bytes) -> tuple[str, str]:
    """(cuobjdump's resource line: registers, stack, shared, local; the SASS), from the bundled
    cuobjdump."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        Path(path).write_bytes(cubin)
        res = subprocess.run([str(tool), "-res-usage", path], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([str(tool), "-sass", path], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:\d+.*", res)
    return (found.group(0) if found else res.strip()), sass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--shared", type=int, default=2, help="folded shared experts written after the choices")
    a = ap.parse_args()
    print(f"triton {triton.__version__}, sm_90, {tr.FUSED_TILE}, E {a.experts}, top-{a.top_k}, D {a.hidden}")
    bad = False
    for dtype in ("bf16", "fp32"):
        k = compile_router(dtype, a.experts, a.top_k, a.hidden, a.shared)
        res, sass = cubin_report(k.asm["cubin"])
        counts = {op: len(re.findall(rf"\b{op}\b", sass)) for op in INSTRUCTIONS}
        spills = re.search(r"LOCAL:(\d+)", res)
        bad |= bool(spills and int(spills.group(1))) or counts["LDGSTS"] == 0
        print(f"{dtype}: shared {k.metadata.shared} B | {res} | "
              + " ".join(f"{op} {n}" for op, n in counts.items()))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
