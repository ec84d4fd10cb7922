"""Compile the Gluon FP8-cache MLA decode (attention/gluon_decode_fp8.py) for sm_90 without a GPU and
print what the cubin costs: registers, spills, shared memory and the opcodes of one KV-tile loop
iteration (per warp). Triton lowers to PTX and runs its bundled ptxas; nothing executes. The
kernel is written against Triton 3.6's Gluon; with another Triton installed, point PYTHONPATH at
a 3.6 install:

  PYTHONPATH=<triton 3.6> python scripts/compile_fp8_decode.py --page 16 [--dump DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from attention import gluon_decode_fp8 as gf  # noqa: E402

SIGNATURE = [
    ("q_ptr", "*bf16"), ("kv_ptr", "*fp8e4nv"), ("block_table_ptr", "*i32"), ("seq_lens_ptr", "*i32"),
    ("q_pos_ptr", "*i32"), ("o_ptr", None), ("lse_ptr", "*fp32"), ("qk_scale_log2", "fp32"), ("o_scale", "fp32"),
    ("H", "i32"), ("num_splits", "i32"), ("q_len", "i32"), ("dcp_size", "i32"), ("dcp_rank", "i32"),
    ("stride_qb", "i32"), ("stride_qh", "i32"), ("stride_kvb", "i32"), ("stride_kvs", "i32"),
    ("stride_btb", "i32"), ("stride_ob", "i32"), ("stride_os", "i32"), ("stride_oh", "i32"),
    ("stride_lb", "i32"), ("stride_ls", "i32"), ("stride_lh", "i32"),
]
# arguments Triton's launcher marks 16-divisible at the real shapes
DIVISIBLE = {"q_ptr", "kv_ptr", "block_table_ptr", "seq_lens_ptr", "q_pos_ptr", "o_ptr", "lse_ptr",
             "stride_qb", "stride_qh", "stride_kvb", "stride_kvs", "stride_ob", "stride_os", "stride_oh"}


def _tool(name: str) -> str:
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(path) if path.exists() else name


def loop_opcodes(sass: str) -> Counter:
    """Opcodes (predicates dropped) of the longest backward-branch loop that issues wgmma."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           re.finditer(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", sass, flags=re.M)]
    where = {a: i for i, (a, _) in enumerate(ins)}
    best = Counter()
    for i, (a, text) in enumerate(ins):
        m = re.search(r"\bBRA (0x[0-9a-f]+)", text)
        if not m or int(m.group(1), 16) >= a or int(m.group(1), 16) not in where:
            continue
        body = [t for _, t in ins[where[int(m.group(1), 16)]:i + 1]]
        ops = Counter(t.split()[1] if t.startswith("@") else t.split()[0] for t in body)
        if any(k.startswith("QGMMA") for k in ops) and sum(ops.values()) > sum(best.values()):
            best = ops
    return best


def compile_report(page: int = 16, stages: int = 2, direct: bool = False, has_pos: bool = False,
                   dump: str | None = None, **options) -> dict:
    """Compile for sm_90 and read registers, spills, shared memory and the KV-tile loop's opcodes;
    `options` are Fp8DecodeConfig fields (lazy_rescale, vt_prmt, ...) over its defaults."""
    if gf._GLUON_ERROR is not None:
        raise RuntimeError(f"gluon import failed: {gf._GLUON_ERROR!r}")
    sig = {name: ty or ("*bf16" if direct else "*fp32") for name, ty in SIGNATURE}
    cfg = gf.Fp8DecodeConfig(num_stages=stages, **options)
    constexprs = dict(PAGE=page, STAGES=stages, DIRECT=bool(direct), HAS_POS=bool(has_pos), LAZY=cfg.lazy_rescale,
                      TAU=gf.LAZY_TAU, P_SCALE=cfg.p_scale(), QK_PROMOTE=cfg.qk_promote, VT_EARLY=cfg.vt_early,
                      VT_PRMT=cfg.vt_prmt, P_HW_DECODE=cfg.p_hw_decode, FENCE_FIRST=cfg.fence_first)
    sig.update({k: "constexpr" for k in constexprs})
    names = [n for n, _ in SIGNATURE]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in DIVISIBLE}
    src = gf.gluon._runtime.GluonASTSource(gf._mla_decode_fp8_kernel, sig, constexprs, attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "k.ptx").write_text(kernel.asm["ptx"])
        res = subprocess.run([_tool("ptxas"), "-arch=sm_90a", "-v", os.path.join(tmp, "k.ptx"), "-o",
                              os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
        Path(tmp, "c.cubin").write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([_tool("cuobjdump"), "-sass", os.path.join(tmp, "c.cubin")], capture_output=True,
                              text=True).stdout
    if dump:
        os.makedirs(dump, exist_ok=True)
        for key in ("ttgir", "ptx"):
            Path(dump, "k." + key).write_text(kernel.asm[key])
        Path(dump, "k.sass").write_text(sass)
    info = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    return dict(smem=kernel.metadata.shared, ptxas=info.strip(), regs=int(regs.group(1)) if regs else None,
                spill_bytes=sum(int(a) + int(b) for a, b in spills), loop=loop_opcodes(sass))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--page", type=int, default=16, help="cache page size (a power of two)")
    ap.add_argument("--stages", type=int, default=2, help="Fp8DecodeConfig.num_stages")
    ap.add_argument("--direct", type=int, default=0, help="1: one split, the final bf16 output (else fp32 partials)")
    ap.add_argument("--has-pos", type=int, default=0, help="1: with query positions (MTP / DCP)")
    options = {"lazy": "lazy_rescale", "qk_promote": "qk_promote", "vt_early": "vt_early", "vt_prmt": "vt_prmt",
               "p_hw_decode": "p_hw_decode", "fence_first": "fence_first"}
    for opt, field in options.items():
        ap.add_argument("--" + opt.replace("_", "-"), type=int, default=None,
                        help=f"Fp8DecodeConfig.{field} (default: the config's)")
    ap.add_argument("--dump", help="write the TTGIR, PTX and SASS here")
    args = ap.parse_args()
    given = {field: (getattr(args, opt) if field == "qk_promote" else bool(getattr(args, opt)))
             for opt, field in options.items() if getattr(args, opt) is not None}
    rep = compile_report(args.page, args.stages, bool(args.direct), bool(args.has_pos), args.dump, **given)
    print(f"shared memory {rep['smem']} bytes, {rep['regs']} registers, spills {rep['spill_bytes']} bytes")
    loop = rep["loop"]
    print(f"KV-tile loop: {sum(loop.values())} instructions a warp; top: {loop.most_common(24)}")
    return 1 if rep["spill_bytes"] else 0


if __name__ == "__main__":
    sys.exit(main())
