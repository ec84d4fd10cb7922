"""Compile the MLA decode partial kernel for sm_90 on any machine (no GPU needed) and count what its
main loop executes per KV tile: tensor-core ops, fp8 conversions, shared-memory and global loads,
register moves; with ptxas's registers and spills and Triton's shared memory per block.

A static profile, for comparing DecodeConfig variants where no GPU is at hand: instruction counts
per tile are what bound the FP8 and 128-head decodes (docs/kernel_notes.md). Use the device's
Triton version (3.6 on the H200 host) for figures that match its code: `pip install --target DIR
triton==3.6.0` and run with PYTHONPATH=DIR.

    python scripts/decode_sass.py                          # the default variants, a table
    python scripts/decode_sass.py --fp8 --cfg block_n=32,num_stages=2,stage_c=True --dump /tmp/k
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import attention.triton_decode as td  # noqa: E402

_H16 = "block_h=16,num_warps=4,prefetch_ids=True,programs_per_sm=2"
VARIANTS = [  # (name, fp8, DecodeConfig fields)
    ("bf16 default", False, f"{_H16},block_n=32,num_stages=3"),
    ("bf16 lazy", False, f"{_H16},block_n=32,num_stages=3,lazy_rescale=True"),
    ("fp8 reload (default)", True, f"{_H16},block_n=32,num_stages=2,reload_v=True"),
    ("fp8 reload+stage_v", True, f"{_H16},block_n=32,num_stages=2,reload_v=True,stage_v=True"),
    ("fp8 plain", True, f"{_H16},block_n=32,num_stages=3"),
    ("fp8 stage_c", True, f"{_H16},block_n=32,num_stages=2,stage_c=True"),
    ("fp8 stage_c lazy", True, f"{_H16},block_n=32,num_stages=2,stage_c=True,lazy_rescale=True"),
    ("fp8 qk_fp8 reload", True, f"{_H16},block_n=32,num_stages=2,reload_v=True,qk_fp8=True"),
    ("fp8 qk_fp8 reload+stage_v", True, f"{_H16},block_n=32,num_stages=2,reload_v=True,stage_v=True,qk_fp8=True"),
    ("fp8 qk_fp8 qk_t n64 w8", True, "block_h=16,num_warps=8,prefetch_ids=True,programs_per_sm=1,block_n=64,"
                                     "num_stages=2,reload_v=True,stage_v=True,qk_t=True,qk_fp8=True"),
    ("h64 bf16 default", False, "block_h=64,block_n=64,num_warps=8,num_stages=2"),
    ("h64 bf16 lazy", False, "block_h=64,block_n=64,num_warps=8,num_stages=2,lazy_rescale=True"),
]
CLASSES = ["HMMA", "HGMMA", "QGMMA", "F2FP", "LDS", "LDSM", "STS", "LDGSTS", "LDG", "FMUL", "IMAD.MOV", "BAR"]


def parse_cfg(text: str) -> td.DecodeConfig:
    kw = {}
    for item in filter(None, text.split(",")):
        k, v = item.split("=")
        kw[k] = {"True": True, "False": False}[v] if v in ("True", "False") else int(v)
    return dataclasses.replace(td.DecodeConfig(), **kw)


def compile_partial(cfg: td.DecodeConfig, fp8: bool, page: int = 16, direct: bool = False, pdl: bool = False):
    """The partial kernel for V2/V3 shapes (Lkv 512, R 64), bf16 q (fp16 products over FP8), as
    `mla_decode` launches it; pointers and the strides that the launch specializes are marked
    16-divisible, as the JIT does for the engine's tensors."""
    fn = td._mla_decode_partial_kernel.kernel  # the JITFunction under common/triton_launch's wrapper
    const = dict(PAGE=page, LKV=512, R=64, BLOCK_L=512, BLOCK_R=64, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
                 PRECISION="tf32", QK_T=cfg.qk_t, PREFETCH_IDS=cfg.prefetch_ids, DIRECT=direct, HAS_POS=False,
                 WARP_SPECIALIZE=cfg.warp_specialize, FP8=fp8,
                 PRODUCT_DTYPE=tl.float16 if fp8 else tl.bfloat16, HW_CVT=fp8,
                 RELOAD_V=fp8 and cfg.reload_v and not cfg.stage_c,
                 STAGE_V=fp8 and cfg.reload_v and cfg.stage_v and not cfg.stage_c, STAGE_C=fp8 and cfg.stage_c,
                 QK_FP8=fp8 and cfg.qk_fp8, LAZY=cfg.lazy_rescale, TAU=td.LAZY_TAU, PDL=pdl)
    ptrs = {"q_ptr": "*bf16", "kv_ptr": "*u8" if fp8 else "*bf16", "block_table_ptr": "*i32",
            "seq_lens_ptr": "*i32", "q_pos_ptr": "*i32", "o_ptr": "*bf16" if direct else "*fp32",
            "lse_ptr": "*fp32"}
    unspecialized = {fn.arg_names[i] if isinstance(i, int) else i for i in fn.do_not_specialize}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name], attrs[(i,)] = ptrs[name], [["tt.divisibility", 16]]
        elif name in ("qk_scale_log2", "o_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride") and name not in unspecialized:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "launch_pdl": pdl})


def sass_of(ptx: str) -> tuple[str, str]:
    """(ptxas -v's register/spill line, SASS text) for sm_90a, with the ptxas Triton bundles."""
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as d:
        src, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        Path(src).write_text(ptx)
        r = subprocess.run([str(bindir / "ptxas"), "-v", "-arch=sm_90a", src, "-o", cubin],
                           capture_output=True, text=True, check=True)
        regs = " ".join(line.split("info    :")[-1].strip() for line in r.stderr.splitlines()
                        if "registers" in line or "spill" in line)
        sass = subprocess.run([str(bindir / "cuobjdump"), "-sass", cubin], capture_output=True,
                              text=True, check=True).stdout
    return regs, sass


def main_loop_ops(sass: str) -> collections.Counter:
    """Opcodes between the target and the source of the longest backward branch (the KV loop)."""
    ins = []
    for line in sass.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,5})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)([^;]*);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    lo = hi = None
    for addr, op, rest in ins:
        t = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if t and int(t.group(1), 16) < addr and (lo is None or addr - int(t.group(1), 16) > hi - lo):
            lo, hi = int(t.group(1), 16), addr
    return collections.Counter(op for addr, op, _ in ins if lo is not None and lo <= addr <= hi)


def op_class(op: str) -> str | None:
    for k in sorted(CLASSES, key=len, reverse=True):  # LDSM before LDS, LDGSTS before LDG
        if op == k or op.startswith(k + "."):
            return k
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fp8", action="store_true", help="with --cfg: an FP8 cache")
    p.add_argument("--cfg", help="one DecodeConfig, fields as k=v,... (default: the VARIANTS table)")
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--dump", help="with --cfg: write PREFIX.ptx and PREFIX.sass")
    p.add_argument("--all-ops", action="store_true", help="also print every opcode of the loop")
    p.add_argument("--pdl", action="store_true", help="compile with programmatic dependent launch (common/pdl.py)")
    a = p.parse_args()
    variants = [("cfg", a.fp8, a.cfg)] if a.cfg else VARIANTS
    print(f"triton {triton.__version__}, sm_90a, page {a.page}; loop = instructions per KV tile per warp\n")
    print("| variant | smem KB | registers, spills | loop | " + " | ".join(CLASSES) + " |")
    print("|---|---|---|---|" + "---|" * len(CLASSES))
    for name, fp8, text in variants:
        k = compile_partial(parse_cfg(text), fp8, a.page, pdl=a.pdl)
        regs, sass = sass_of(k.asm["ptx"])
        if a.pdl:
            print(f"  griddepcontrol in PTX: {k.asm['ptx'].count('griddepcontrol')}, launch_pdl {k.metadata.launch_pdl}")
        if a.dump and a.cfg:
            Path(a.dump + ".ptx").write_text(k.asm["ptx"])
            Path(a.dump + ".sass").write_text(sass)
        ops = main_loop_ops(sass)
        cls = collections.Counter()
        for op, n in ops.items():
            if op_class(op):
                cls[op_class(op)] += n
        m = re.search(r"Used (\d+) registers", regs)
        s = re.search(r"(\d+) bytes spill stores", regs)
        print(f"| {name} | {k.metadata.shared / 1024:.1f} | {m.group(1) if m else '?'}, {s.group(1) if s else '?'} B "
              f"| {sum(ops.values())} | " + " | ".join(str(cls[c]) for c in CLASSES) + " |", flush=True)
        if a.all_ops:
            print("  " + "  ".join(f"{op}:{n}" for op, n in ops.most_common()))


if __name__ == "__main__":
    main()
