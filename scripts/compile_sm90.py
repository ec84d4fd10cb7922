"""Compile the Gluon MLA decode kernel (attention/gluon_decode.py) for sm_90 without a GPU and
print what the cubin costs: whether it compiled, shared memory, registers and spills (ptxas -v),
counts of the instructions that matter (wgmma, ldmatrix, cp.async, barriers) in PTX and SASS,
and the size of the KV-tile loop per warp.

Runs on a CPU-only machine: Triton lowers to PTX and runs its bundled ptxas; nothing executes.
The kernel is written against Triton 3.6's Gluon (the GPU machine's Triton); with another
installed, point PYTHONPATH at a 3.6 install:

  PYTHONPATH=<triton 3.6> python scripts/compile_sm90.py --page 16 --direct 0
  PYTHONPATH=<triton 3.6> python scripts/compile_sm90.py --lazy 1 --dump /tmp/gluon_mla  # keep IR

Exit status 1 when the kernel does not compile, spills, needs more than 227 KB of shared memory,
or ptxas serialises its wgmma.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from attention import gluon_decode as gd  # noqa: E402

SMEM_LIMIT = 227 * 1024

# runtime arguments of _mla_decode_wgmma_kernel and their Triton types
SIGNATURE = [
    ("q_ptr", "*bf16"), ("kv_ptr", "*bf16"), ("block_table_ptr", "*i32"), ("seq_lens_ptr", "*i32"),
    ("q_pos_ptr", "*i32"), ("o_ptr", None), ("lse_ptr", "*fp32"), ("qk_scale_log2", "fp32"),
    ("H", "i32"), ("num_splits", "i32"), ("q_len", "i32"), ("dcp_size", "i32"), ("dcp_rank", "i32"),
    ("stride_qb", "i32"), ("stride_qh", "i32"), ("stride_kvb", "i32"), ("stride_kvs", "i32"),
    ("stride_btb", "i32"), ("stride_ob", "i32"), ("stride_os", "i32"), ("stride_oh", "i32"),
    ("stride_lb", "i32"), ("stride_ls", "i32"), ("stride_lh", "i32"),
]
# arguments Triton's launcher would mark 16-divisible at the real shapes (pointers from torch's
# allocator; q/cache strides 576 * k; the o and lse strides of the split partials)
DIVISIBLE = {"q_ptr", "kv_ptr", "block_table_ptr", "seq_lens_ptr", "q_pos_ptr", "o_ptr", "lse_ptr",
             "stride_qb", "stride_qh", "stride_kvb", "stride_kvs", "stride_ob", "stride_os",
             "stride_oh"}


def tool(name: str) -> str:
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(path) if path.exists() else name


def count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text, flags=re.MULTILINE))


def compile_report(page: int = 16, direct: bool = False, has_pos: bool = False,
                   cfg: gd.GluonDecodeConfig | None = None) -> dict:
    """Compile the kernel for sm_90 and read its costs. Raises if Gluon is missing; a compile
    error is returned as report["error"]."""
    if gd._GLUON_ERROR is not None:
        raise RuntimeError(f"gluon import failed: {gd._GLUON_ERROR!r}")
    cfg = cfg or gd.GluonDecodeConfig()
    sig = {name: ty or ("*bf16" if direct else "*fp32") for name, ty in SIGNATURE}
    if cfg.seesaw:  # attention/gluon_seesaw.py: the same runtime arguments
        fn = gd._mla_decode_seesaw_kernel
        constexprs = dict(PAGE=page, BLOCK_N=cfg.block_n, DIRECT=bool(direct), HAS_POS=bool(has_pos),
                          LAZY=cfg.lazy_rescale, WORKER_REGS=cfg.worker_regs, PROD_REGS=cfg.producer_regs)
    else:
        fn = gd._mla_decode_wgmma_kernel
        constexprs = dict(PAGE=page, BLOCK_N=cfg.block_n, STAGES=cfg.num_stages, XBUF=cfg.xbuf,
                          DIRECT=bool(direct), HAS_POS=bool(has_pos), QPE_REGS=cfg.q_pe_regs,
                          LAZY=cfg.lazy_rescale, PROD=cfg.producer, WORKER_REGS=cfg.worker_regs,
                          PROD_REGS=cfg.producer_regs)
    sig.update({k: "constexpr" for k in constexprs})
    names = [n for n, _ in SIGNATURE]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in DIVISIBLE}
    src = gd.gluon._runtime.GluonASTSource(fn, sig, constexprs, attrs)
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except Exception as exc:  # noqa: BLE001 - reported to the caller
        return dict(error=f"{type(exc).__name__}: {exc}")
    asm = kernel.asm
    ptx = asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        ptx_path = os.path.join(tmp, "k.ptx")
        Path(ptx_path).write_text(ptx)
        res = subprocess.run([tool("ptxas"), "-arch=sm_90a", "-v", ptx_path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
        info = res.stdout + res.stderr
        cubin_path = os.path.join(tmp, "c.cubin")
        Path(cubin_path).write_bytes(asm["cubin"])
        sass = subprocess.run([tool("cuobjdump"), "-sass", cubin_path], capture_output=True,
                              text=True).stdout
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    counts = {label: (count(p_re, ptx), count(s_re, sass)) for label, p_re, s_re in COUNTED}
    loops = tile_loops(sass)
    return dict(error=None, smem=kernel.metadata.shared, ptxas=info.strip(), sass=sass, asm=asm,
                regs=int(regs.group(1)) if regs else None,
                spill_bytes=sum(int(a) + int(b) for a, b in spills),
                wgmma_serialised="wgmma" in info and "serializ" in info,
                wgmma_shapes=sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))),
                counts=counts, loops=loops)


def tile_loops(sass: str) -> list[dict]:
    """The KV-tile loops in the SASS (a backward branch over a body that issues wgmma): their
    instruction count per iteration (per warp) and the most frequent opcodes."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    where = {a: i for i, (a, _) in enumerate(ins)}
    out = []
    for i, (a, text) in enumerate(ins):
        m = re.search(r"\bBRA (0x[0-9a-f]+)", text)
        if not m or int(m.group(1), 16) >= a or int(m.group(1), 16) not in where:
            continue
        body = [t for _, t in ins[where[int(m.group(1), 16)]:i + 1]]
        ops = [t.split()[1] if t.startswith("@") else t.split()[0] for t in body]
        n_mma = sum(o.startswith("HGMMA") for o in ops)
        if n_mma and not any(o.startswith("EXIT") for o in ops) and len(body) < 2000:
            kinds = {}
            for o in ops:
                kinds[o.split(".")[0]] = kinds.get(o.split(".")[0], 0) + 1
            out.append(dict(instructions=len(body), hgmma=n_mma,
                            top=sorted(kinds.items(), key=lambda kv: -kv[1])[:8]))
    return out


COUNTED = [  # (label, PTX regex, SASS regex)
    ("wgmma.mma_async", r"wgmma\.mma_async", r"HGMMA"),
    ("wgmma.wait_group", r"wgmma\.wait_group", r"WARPGROUP\.DEPBAR"),
    ("ldmatrix", r"ldmatrix", r"LDSM"),
    ("cp.async", r"cp\.async\.(?:ca|cg)", r"LDGSTS"),
    ("cp.async.commit/wait", r"cp\.async\.(?:commit|wait)_group", r"LDGDEPBAR|DEPBAR\.LE SB0"),
    ("bar.sync (partition / CTA)", r"\bbar(?:rier)?\.(?:sync|arrive)", r"\bBAR\.SYNC"),
    ("mbarrier", r"mbarrier\.", r"SYNCS"),
    ("st.shared", r"st\.shared", r"\bSTS\b"),
    ("ld.shared", r"ld\.shared", r"\bLDS\b"),
    ("setmaxnreg", r"setmaxnreg", r"USETMAXREG"),
    ("fence.proxy.async", r"fence\.proxy\.async", r"FENCE\.VIEW\.ASYNC"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--direct", type=int, default=0, help="1: one split (bf16 output), 0: split partials")
    ap.add_argument("--has-pos", type=int, default=0)
    ap.add_argument("--block-n", type=int, default=gd.GluonDecodeConfig.block_n)
    ap.add_argument("--stages", type=int, default=gd.GluonDecodeConfig.num_stages)
    ap.add_argument("--xbuf", type=int, default=gd.GluonDecodeConfig.xbuf)
    ap.add_argument("--worker-regs", type=int, help="default: the config's own")
    ap.add_argument("--q-pe-regs", type=int, default=int(gd.GluonDecodeConfig.q_pe_regs))
    ap.add_argument("--lazy", type=int, default=int(gd.GluonDecodeConfig.lazy_rescale))
    ap.add_argument("--producer", type=int, default=int(gd.GluonDecodeConfig.producer))
    ap.add_argument("--producer-regs", type=int, help="default: the config's own")
    ap.add_argument("--dump", help="directory to write the ttgir / llir / ptx / sass into")
    ap.add_argument("--seesaw", type=int, default=0, help="1: the seesaw kernel (gluon_decode_plan.SEESAW; "
                    "the tile options above are ignored, --worker-regs / --producer-regs kept if given)")
    args = ap.parse_args()
    print(f"triton {triton.__version__} ({triton.__file__})")
    # Register budgets given on the command line override the chosen config's; the others keep its own.
    regs = {k: getattr(args, k) for k in ("worker_regs", "producer_regs") if getattr(args, k) is not None}
    cfg = gd.GluonDecodeConfig(block_n=args.block_n, num_stages=args.stages, xbuf=args.xbuf,
                               q_pe_regs=bool(args.q_pe_regs), lazy_rescale=bool(args.lazy),
                               producer=bool(args.producer), **regs)
    if args.seesaw:
        cfg = dataclasses.replace(gd.SEESAW, lazy_rescale=bool(args.lazy), **regs)
    print(f"config {cfg}, page {args.page}, direct {bool(args.direct)}, q_pos {bool(args.has_pos)}; "
          f"planned shared memory {cfg.smem_bytes()} bytes")
    rep = compile_report(args.page, bool(args.direct), bool(args.has_pos), cfg)
    if rep["error"]:
        print(f"COMPILE FAILED: {rep['error']}")
        return 1
    smem = rep["smem"]
    print(f"compiled: yes; shared memory {smem} bytes ({smem / 1024:.1f} KB, limit {SMEM_LIMIT})")
    print("ptxas -v:")
    for line in rep["ptxas"].splitlines():
        print("   ", line.strip())
    print(f"registers: {rep['regs']} per thread at launch (before setmaxnreg); spill bytes: {rep['spill_bytes']}")
    print(f"wgmma shapes: {', '.join(rep['wgmma_shapes'])}")
    if rep["wgmma_serialised"]:
        print("WARNING: ptxas serialised wgmma (see above)")
    for lp in rep["loops"]:
        print(f"KV-tile loop: {lp['instructions']} instructions per iteration per warp "
              f"({lp['hgmma']} HGMMA; " + ", ".join(f"{k} {v}" for k, v in lp["top"]) + ")")
    print(f"{'instruction':<28}{'PTX':>8}{'SASS':>8}")
    for label, (n_ptx, n_sass) in rep["counts"].items():
        print(f"{label:<28}{n_ptx:>8}{n_sass:>8}")
    if args.dump:
        out = Path(args.dump)
        out.mkdir(parents=True, exist_ok=True)
        for key in ("ttgir", "llir", "ptx"):
            (out / f"kernel.{key}").write_text(rep["asm"][key])
        (out / "kernel.sass").write_text(rep["sass"])
        print(f"IR written to {out}")
    ok = smem <= SMEM_LIMIT and rep["spill_bytes"] == 0 and rep["regs"] is not None and not rep["wgmma_serialised"]
    print("RESULT:", "ok" if ok else "NOT OK (spills, shared memory, serialised wgmma or no ptxas report)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
