"""Compile the decode's split merge folded into absorb_o (attention/triton_absorb.py
`_absorb_o_merge_kernel`) for sm_90a on any machine, no GPU needed, at the tiles `absorb_o_merge`
picks for V2-Lite's decode (16 heads, Lkv 512, V 128) at the split counts the decode takes on a
132-SM GPU: rows, splits, whether the splits are summed in chunks, shared memory, ptxas's
registers and spills. Use the device's Triton (3.6) for its compiler's verdict:

    PYTHONPATH=<triton 3.6 install> python scripts/absorb_merge_sass.py

Exit status 1 when a case does not compile or spills.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from w8a8_sass import compile_kernel, sass_of  # noqa: E402

from attention import triton_absorb as ta  # noqa: E402

PTRS = {"po_ptr": "*fp32", "plse_ptr": "*fp32", "w_ptr": "*bf16", "out_ptr": "*bf16"}
CASES = ((1, 132), (4, 33), (8, 16), (16, 8), (20, 6), (32, 4), (40, 3), (64, 2), (40, 12))  # (rows, splits)


def main() -> int:
    fn = getattr(ta._absorb_o_merge_kernel, "kernel", ta._absorb_o_merge_kernel)  # under fast_launch
    ok = True
    print(f"triton {triton.__version__}")
    for T, S in CASES:
        BT = ta._bt(T)
        BS = min(triton.next_power_of_2(S), 16 if BT == 16 else 8)
        BL = max(16, min(128, 512, (4096 if S > BS else 8192) // (BT * BS)))
        const = dict(H=16, L=512, V=128, BS=BS, CHUNKS=S > BS, BL=BL, BV=32, BT=BT, IEEE=False, PDL=False)
        try:
            k = compile_kernel(fn, const, 4, 2, ptrs=PTRS, divisible={"s_pt", "s_ps", "s_ph", "s_w_h", "s_w_v"},
                               one={"s_lh"})
        except Exception as e:  # noqa: BLE001 - reported, and the exit status says it
            ok = False
            print(f"T {T:3d} S {S:3d} chunks {S > BS!s:5s}: does not compile: {str(e).splitlines()[0][:160]}")
            continue
        regs = sass_of(k.asm["ptx"])[0]
        spills = "0 bytes spill stores" not in regs
        ok &= not spills
        print(f"T {T:3d} S {S:3d} chunks {S > BS!s:5s} BT {BT} BS {BS} BL {BL}: shared {k.metadata.shared} B, "
              + " ".join(line.split(":", 1)[-1].strip() for line in regs.splitlines() if "registers" in line or "spill" in line))
    print("RESULT", "ok" if ok else "failed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
