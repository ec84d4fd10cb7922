"""Compile the small-M W8A8 GEMM kernels (models/fp8_gemm.py's pointer kernel, its split-K form
with and without x quantized in it and the serial reduce, and the split reduce, models/fp8_gemm_splitk.py;
the weight-streaming kernel, models/fp8_w8a16.py) for sm_90a on any machine, no GPU needed: per
autotune candidate of the small range, Triton's shared memory, ptxas's registers and spills, and
the main K loop's size and tensor-core ops.

Use the device's Triton (3.6 on the H200 host) for figures that match its code:

    PYTHONPATH=<triton 3.6 install> python scripts/w8a8_sass.py

Exit status 1 when a kernel does not compile or spills.
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

from decode_sass import main_loop_ops  # noqa: E402
from models import fp8_gemm as g  # noqa: E402
from models import fp8_gemm_splitk as sk  # noqa: E402
from models import fp8_w8a16 as w16  # noqa: E402

POINTERS = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "sb_ptr": "*fp32", "c_ptr": "*bf16",
            "p_ptr": "*fp32", "y_ptr": "*bf16", "cnt_ptr": "*i32"}


# What the JIT specializes at the engine's calls: N and K are multiples of 16 at every R1 / V3
# projection (576, 1536, 2112, 7168, ...), and the activation scales of the CUDA act_quant are
# M-major (stride 1 along M: a constant to the JIT). M is do_not_specialize; the rest vary.
DIVISIBLE = {"N", "K", "MN"}
ONE = {"stride_sam"}


def compile_kernel(fn, const: dict, num_warps: int, num_stages: int, ptrs: dict = POINTERS,
                   divisible: set = DIVISIBLE, one: set = ONE):
    """fn for sm_90a with `const` as constexprs and the JIT's specializations (pointers of `ptrs`'
    types, 16-divisible as torch's allocations are; the ints in `divisible` 16-divisible, those
    in `one` equal to 1); the defaults are this script's W8A8 GEMM kernels'."""
    const = dict(const, **{n: 1 for n in one if n in fn.arg_names})
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name], attrs[(i,)] = ptrs[name], [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            if name in divisible:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def sass_of(ptx: str) -> tuple[str, str]:
    """(ptxas -v's register/spill lines, SASS) for sm_90a, with the first ptxas Triton bundles that
    takes this PTX version (Triton 3.9 emits PTX that only its ptxas-blackwell reads)."""
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as d:
        src, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        Path(src).write_text(ptx)
        for exe in ("ptxas", "ptxas-blackwell"):
            r = subprocess.run([str(bindir / exe), "-v", "-arch=sm_90a", src, "-o", cubin], capture_output=True, text=True)
            if r.returncode == 0:
                break
        else:
            raise RuntimeError(f"ptxas failed: {r.stderr.strip()[:300]}")
        regs = " ".join(line for line in r.stderr.splitlines() if "registers" in line or "spill" in line)
        sass = subprocess.run([str(bindir / "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    return regs, sass


def report(name: str, kernel) -> bool:
    regs, sass = sass_of(kernel.asm["ptx"])
    ops = main_loop_ops(sass)
    m = re.search(r"Used (\d+) registers", regs)
    s = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", regs)
    spills = (int(s.group(1)) + int(s.group(2))) if s else None
    hgmma = sum(n for op, n in ops.items() if op.startswith("HGMMA"))
    hmma = sum(n for op, n in ops.items() if op.startswith("HMMA"))
    print(f"| {name} | {kernel.metadata.shared / 1024:.1f} | {m.group(1) if m else '?'} | {spills} | "
          f"{sum(ops.values())} | {hgmma} | {hmma} |", flush=True)
    return m is not None and spills == 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.parse_args()
    print(f"triton {triton.__version__} ({triton.__file__}), sm_90a\n")
    print("| kernel (BM, BN, warps, stages, EVEN_K) | smem KB | registers | spill bytes | K-loop instructions | HGMMA | HMMA |")
    print("|---|---|---|---|---|---|---|")
    ok = True
    for bm, bn, w, st in g._TILES["small"]:
        for even in (True, False):
            tag = f"({bm}, {bn}, {w}, {st}, {even})"
            const = dict(BM=bm, BN=bn, BK=g.GROUP, EVEN_K=even)
            try:
                ok &= report(f"unsplit {tag}", compile_kernel(g._w8a8_kernel, dict(const, GROUP_M=8), w, st))
                # plain, fp8_gemm_fuse_act (x quantized in the kernel), fp8_gemm_splitk_serial (no reduce
                # launch), both (each constexpr given: one left out would compile as a runtime int)
                for quant_a, serial in ((False, False), (True, False), (False, True), (True, True)):
                    ok &= report(f"split-K {tag}{' quant_a' * quant_a}{' serial' * serial}",
                                 compile_kernel(sk._w8a8_splitk_kernel, dict(const, QUANT_A=quant_a, SERIAL=serial),
                                                w, st, ptrs=dict(POINTERS, a_ptr="*bf16") if quant_a else POINTERS))
            except Exception as e:  # noqa: BLE001 - reported, exit status 1
                print(f"| {tag} | COMPILE FAILED: {type(e).__name__}: {str(e)[:300]} |")
                ok = False
    ok &= report(f"split reduce (BLOCK {sk.REDUCE_BLOCK})",
                 compile_kernel(sk._splitk_reduce_kernel.kernel, dict(BLOCK=sk.REDUCE_BLOCK), 4, 1))
    # the weight-streaming kernel (fp8_gemm_w8a16_max_tokens), bf16 x and y, each autotune candidate
    w16_ptrs = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "y_ptr": "*bf16"}
    for bn, bk, w, st, *late in w16._TILES + [(32, 512, 4, 3, True)]:  # the last: PDL, the late signal
        try:
            const = dict(IEEE=False, PDL=bool(late), LATE=bool(late), BLOCK_N=bn, BLOCK_K=bk)
            ok &= report(f"w8a16 ({bn}, {bk}, {w}, {st}){' PDL late' if late else ''}",
                         compile_kernel(w16._w8a16_kernel, const, w, st,
                                        ptrs=w16_ptrs, divisible={"N", "K", "stride_xm", "stride_wn", "stride_ym"},
                                        one={"stride_sk"}))
        except Exception as e:  # noqa: BLE001 - reported, exit status 1
            print(f"| w8a16 ({bn}, {bk}, {w}, {st}) | COMPILE FAILED: {type(e).__name__}: {str(e)[:300]} |")
            ok = False
    print("\nRESULT:", "ok" if ok else "NOT OK (a compile failure or spills)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
