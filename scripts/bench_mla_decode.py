"""Time (and with --check, verify on real shapes) the Triton MLA attention kernels on one CUDA GPU.

Decode: bytes = every cached row read once (Lkv+R values, 2 bytes each in a bf16 cache, 1 in an
FP8 cache) + q + o, compared with the measured device-to-device copy rate (read + write); FLOP/s
count QK^T over Lkv+R and PV over Lkv, 2 per multiply-add (the measure for many heads, where the
tensor cores bind). Each (B, S, heads, cache dtype) row names the kernel's tiles (`_short`: h rows
per program, n cache rows per step, w warps, s stages, p programs per SM, P prefetched block ids,
T transposed scores, W warp-specialised loop, V FP8 tile loaded twice, S its PV copy staged in
fp16, Q QK^T on e4m3 operands with q rounded to e4m3 per row). Decode times are CUDA-graph
replays over input sets rotated through 256 MB, so L2 holds none of them. Prefill is reported in
TFLOP/s (QK and PV products, causal counts only visible pairs), timed as CUDA-graph replays of 8
calls on one input set (an eager timing of a kernel of a few tens of µs measures its host launch,
not the kernel; the K and V of the small shapes then stay in L2, as the up-projection that has
just written them leaves them in a prefill step). Prints a table and writes JSON to --out (default
$OUT/bench_mla_decode.json).

  python3 scripts/bench_mla_decode.py --check --sweep
  python3 scripts/bench_mla_decode.py --decode-only --decode-shapes 128x4096 --heads 128 --cache-dtypes bf16 --impl gluon
  python3 scripts/bench_mla_decode.py --decode-only --decode-shapes 128x4096,128x16384 --heads 16,128 \
      --cache-dtypes bf16,fp8 --sweep
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from attention.gluon_decode import (SEESAW, GluonDecodeConfig, check_gluon_available,  # noqa: E402
                                    mla_decode_wgmma, plan_splits)
from attention.kv_quant import FP8_DTYPE, store_as  # noqa: E402
from attention.triton_cache import gather_context, write_kv  # noqa: E402
from attention.triton_decode import (DecodeConfig, choose_num_splits, default_decode_config,  # noqa: E402
                                     mla_decode)
from attention.triton_prefill import PrefillConfig, default_prefill_config, prefill_attention  # noqa: E402

LKV, R, P, V = 512, 64, 128, 128
DEVICE = "cuda"  # a CPU dry run under TRITON_INTERPRET=1 (tiny shapes) may point this at "cpu"
# The grid: B in {1, 32, 128} x length in {1k, 4k, 16k} (x H in {16, 128} below), plus a
# 32k single-sequence row for the long-context split heuristic.
DECODE_SHAPES = [(B, S) for B in (1, 32, 128) for S in (1024, 4096, 16384)] + [(1, 32768)]
PREFILL_SHAPES = [  # (name, [(Lq, Lk), ...], H, causal)
    ("8x1000 causal (a mixed step's prompts)", [(1000, 1000)] * 8, 16, True),
    ("1x(500q,1000ctx) noncausal (a chunk's cached context)", [(500, 1000)], 16, False),
    ("1x(600q,400ctx) noncausal (a chunk's cached context)", [(600, 400)], 16, False),
    ("1x600 causal (one short prompt)", [(600, 600)], 16, True),
    ("2x1000 causal (two prompts)", [(1000, 1000)] * 2, 16, True),
    ("1x4096 causal", [(4096, 4096)], 16, True),
    ("4x2048 causal", [(2048, 2048)] * 4, 16, True),
    ("1x8192 causal", [(8192, 8192)], 16, True),
    ("1x4096 causal H128", [(4096, 4096)], 128, True),
    ("2x(1024q,8192ctx) noncausal", [(1024, 8192)] * 2, 16, False),
]
# DecodeConfig candidates beyond the default, per (head count, cache dtype); fields as DecodeConfig's
_H16 = dict(block_h=16, num_warps=4, programs_per_sm=2, prefetch_ids=True)
_H64 = dict(block_h=64, num_warps=8)
DECODE_SWEEP = {
    (16, "bf16"): [dict(_H16, block_n=32, num_stages=2), dict(_H16, block_n=32, num_stages=3, lazy_rescale=True)],
    (16, "fp8"): [dict(_H16, block_n=32, num_stages=2, stage_c=True), dict(_H16, block_n=32, num_stages=3, stage_c=True),
                  dict(_H16, block_n=32, num_stages=2, stage_c=True, lazy_rescale=True),
                  dict(_H16, block_n=32, num_stages=3, stage_c=True, lazy_rescale=True, programs_per_sm=1),
                  dict(_H16, block_n=32, num_stages=2, reload_v=True, stage_v=True, lazy_rescale=True),
                  dict(_H16, block_n=32, num_stages=2, reload_v=True, stage_v=True),
                  dict(_H16, block_n=32, num_stages=3, reload_v=True, stage_v=True, programs_per_sm=1),
                  dict(_H16, block_n=32, num_stages=3), dict(_H16, block_n=32, num_stages=2, reload_v=True),
                  dict(_H16, block_n=64, num_stages=3, reload_v=True, programs_per_sm=1, num_warps=8),
                  dict(_H16, block_n=64, num_stages=3),
                  # qk_fp8: on sm_90 Triton runs an e4m3 dot with 16 rows as fp16 mma.sync after
                  # converting it (the first three); with scores transposed (64 cache rows as M) it is
                  # an e4m3 wgmma (scripts/decode_sass.py); timed in RESULTS.md's History
                  dict(_H16, block_n=32, num_stages=2, reload_v=True, qk_fp8=True),
                  dict(_H16, block_n=32, num_stages=2, reload_v=True, stage_v=True, qk_fp8=True),
                  dict(_H16, block_n=64, num_stages=3, reload_v=True, programs_per_sm=1, num_warps=8, qk_fp8=True),
                  dict(_H16, block_n=64, num_stages=2, reload_v=True, stage_v=True, qk_t=True, programs_per_sm=1,
                       num_warps=8, qk_fp8=True),
                  dict(_H16, block_n=64, num_stages=2, reload_v=True, stage_v=True, qk_t=True, programs_per_sm=1,
                       qk_fp8=True)],
    (128, "bf16"): [dict(_H64, block_n=64, num_stages=2, warp_specialize=True),
                    dict(_H64, block_n=64, num_stages=2, lazy_rescale=True)],
    (128, "fp8"): [dict(_H64, block_n=64, num_stages=3), dict(_H64, block_n=32, num_stages=3)],
}
CACHE_DTYPES = {"bf16": torch.bfloat16, "fp8": FP8_DTYPE}
PREFILL_SWEEP = [(128, 64, 8, 3, True), (128, 64, 8, 2), (128, 64, 8, 4), (128, 64, 8, 4, True), (128, 128, 8, 2),
                 (128, 128, 8, 2, True), (64, 64, 4, 2), (64, 64, 4, 3, True), (128, 32, 8, 3),
                 (64, 64, 4, 4, True), (64, 32, 4, 3, True), (64, 128, 4, 3, True), (64, 64, 8, 3, True),
                 (128, 32, 8, 4, True), (128, 64, 8, 3, False)]
L2_ROTATE_BYTES = 256 << 20  # graph timings cycle through input sets this large (L2 is 60 MB)


def bench_ms(fn) -> float:
    """Eager time: do_bench median (L2 flushed before each run; Python launch cost included)."""
    fn()  # compile outside the timed region
    torch.cuda.synchronize()
    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def graph_ms(calls, reps: int = 7) -> float:
    """Per-call time of `calls` captured once in a CUDA graph and replayed (no launch gaps)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / len(calls))
    return sorted(times)[len(times) // 2]


def copy_ceiling() -> float:
    """Device-to-device copy rate in GB/s, counting bytes read + written."""
    x = torch.randn(1 << 29, device=DEVICE, dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x))
    return 2 * x.numel() * 2 / ms / 1e6


def decode_inputs(B, S, H, page=64, cache_dtype=torch.bfloat16):
    """q [B, H, 576] bf16 and a paged cache (bf16, or FP8 with scale 1) holding `n` disjoint sets
    of B sequences of S rows."""
    nblk = triton.cdiv(S, page)
    n = max(1, min(64, L2_ROTATE_BYTES // (B * nblk * page * (LKV + R) * cache_dtype.itemsize)))
    cache = store_as(torch.randn(n * B * nblk, page, LKV + R, device=DEVICE), cache_dtype, 1.0)
    perm = torch.randperm(n * B * nblk, device=DEVICE).to(torch.int32)
    bts = [perm[i * B * nblk:(i + 1) * B * nblk].view(B, nblk) for i in range(n)]
    q = torch.randn(B, H, LKV + R, device=DEVICE, dtype=torch.bfloat16)
    lens = torch.full((B,), S, dtype=torch.int32, device=DEVICE)
    return q, cache, bts, lens


def run_decode(rows, sweep: bool, num_sms: int, log, deadline: float, shapes, heads, cache_names,
               impl: str = "triton", sweep_match: str | None = None, page: int = 64):
    for B, S in shapes:
        for H in heads:
            for cname in cache_names:
                cdt = CACHE_DTYPES[cname]
                q, cache, bts, lens = decode_inputs(B, S, H, page=page, cache_dtype=cdt)
                # bytes: every cached row once, q read, o written (bf16)
                nbytes = B * S * (LKV + R) * cdt.itemsize + B * H * (LKV + R + LKV) * 2
                flops = 2 * B * S * H * (LKV + R + LKV)
                cfgs = [default_decode_config(H, torch.bfloat16, cache_dtype=cdt)]
                if sweep:
                    cfgs += [DecodeConfig(**c) for c in DECODE_SWEEP.get((H, cname), [])
                             if sweep_match is None or re.search(sweep_match, _short(vars(DecodeConfig(**c))))]
                if impl == "gluon":  # attention/gluon_decode.py, timed after the Triton default
                    if H % 64 == 0 and cname == "bf16":
                        cfgs.append(SEESAW)  # the engine's Gluon default (the plan's decode_wgmma_seesaw)
                        if sweep:  # the lockstep schedule and its variants
                            cfgs += [GluonDecodeConfig(), GluonDecodeConfig(producer=True),
                                     GluonDecodeConfig(lazy_rescale=True),
                                     GluonDecodeConfig(producer=True, lazy_rescale=True),
                                     GluonDecodeConfig(num_stages=3, xbuf=2, q_pe_regs=False)]
                    else:
                        log.append(f"decode B={B} S={S} H={H} {cname}: --impl gluon needs H % 64 == 0 "
                                   "and a bf16 cache; Triton only")
                _time_configs(rows, log, deadline, num_sms, sweep, B, S, H, cname, q, cache, bts, lens, nbytes,
                              flops, cfgs)
                del q, cache, bts, lens
                torch.cuda.empty_cache()


def _time_configs(rows, log, deadline, num_sms, sweep, B, S, H, cname, q, cache, bts, lens, nbytes, flops, cfgs):
    tried, ref = [], None
    for cfg in dict.fromkeys(cfgs):
        gluon = isinstance(cfg, GluonDecodeConfig)
        if gluon:
            auto = plan_splits(B, H, bts[0].shape[1] * 64, num_sms, cfg)
        else:
            bh = max(16, min(cfg.block_h, H))
            auto = choose_num_splits(B, triton.cdiv(H, bh), bts[0].shape[1] * 64, num_sms, cfg)
        split_opts = [auto]
        if sweep and (cfg == cfgs[0] or gluon) and B == 1:  # is the heuristic's choice the best split count?
            split_opts += [s for s in dict.fromkeys((16, 32, 66, 132, 264)) if s != auto]
        for ns in split_opts:
            if gluon:
                calls = [lambda bt=bt: mla_decode_wgmma(q, cache, bt, lens, 0.1, LKV, num_splits=ns,
                                                        num_sms=num_sms, cfg=cfg) for bt in bts]
            else:
                calls = [lambda bt=bt: mla_decode(q, cache, bt, lens, 0.1, LKV, num_splits=ns,
                                                  num_sms=num_sms, cfg=cfg) for bt in bts]
            calls = (calls * 4)[:max(4, len(calls))]
            if tried and time.time() > deadline:
                break
            try:
                o, lse = calls[0]()
                if ref is None:  # the default config (verified by --check) is the yardstick
                    ref = (o.float(), lse)
                agree = max((o.float() - ref[0]).norm().item() / ref[0].norm().item(),
                            (lse - ref[1]).abs().max().item())
                ms = graph_ms(calls)
            except Exception as e:  # a config that does not compile is reported, not fatal
                log.append(f"decode B={B} S={S} H={H} {cname} {cfg} splits={ns}: {type(e).__name__} {e}"[:300])
                continue
            # qk_fp8 rounds q to e4m3: o ~5e-2 and lse up to ~0.25 from the default on these random
            # inputs (sharp softmax; the GPU tests check it against a reference that rounds q too)
            if agree > (0.4 if getattr(cfg, "qk_fp8", False) else 1e-2):
                short = _short(vars(cfg) | ({"impl": "gluon"} if gluon else {}))
                log.append(f"decode B={B} S={S} H={H} {cname} {short}/{ns} DISAGREES {agree:.3g}")
            tried.append(dict(agree=agree, cfg={k: v for k, v in vars(cfg).items() if k not in ("min_split_tokens",
                                                                                   "max_splits")}
                              | ({"impl": "gluon"} if gluon else {}),
                              splits=ns, auto=ns == auto, ms=ms, default=cfg == cfgs[0]))
    if not tried:
        return
    dflt = [t for t in tried if t["default"] and t["auto"]]
    best = min(tried, key=lambda t: t["ms"])
    glu = [t for t in tried if t["cfg"].get("impl") == "gluon" and t["auto"]]  # --impl gluon's own row
    for tag, t in (("default", dflt[0] if dflt else None), ("best", best), ("gluon", glu[0] if glu else None)):
        if t is not None:
            rows.append(dict(kind="decode", B=B, S=S, H=H, cache=cname, which=tag, cfg=t["cfg"], splits=t["splits"],
                             us=t["ms"] * 1e3, GBps=nbytes / t["ms"] / 1e6, TFLOPs=flops / t["ms"] / 1e9))
    rows[-1]["tried"] = tried
    print(f"decode B={B} S={S} H={H} {cname}: " + ", ".join(
        f"{_short(t['cfg'])}/{t['splits']}={t['ms'] * 1e3:.1f}us" for t in tried), flush=True)


def _short(cfg: dict) -> str:
    """Compact tile description: h16n32w4s2p2[r168][T][P][W][V][S][C][L][Q] (the flags: qk_t,
    prefetch_ids, warp_specialize, reload_v, stage_v, stage_c, lazy_rescale, qk_fp8); the
    Gluon kernel's as gluon-n32s4x1[R][L][P] (R: q's rope slice in registers, L: lazy rescale,
    P: the producer warpgroup)."""
    if cfg.get("impl") == "gluon":
        return (f"gluon-n{cfg['block_n']}s{cfg['num_stages']}x{cfg['xbuf']}" + ("R" if cfg.get("q_pe_regs") else "")
                + ("L" if cfg.get("lazy_rescale") else "") + ("P" if cfg.get("producer") else ""))
    out = f"h{cfg['block_h']}n{cfg['block_n']}w{cfg['num_warps']}s{cfg['num_stages']}p{cfg['programs_per_sm']}"
    out += f"r{cfg['maxnreg']}" if cfg.get("maxnreg") else ""
    return (out + ("T" if cfg.get("qk_t") else "") + ("P" if cfg.get("prefetch_ids") else "")
            + ("W" if cfg.get("warp_specialize") else "") + ("V" if cfg.get("reload_v") else "")
            + ("S" if cfg.get("stage_v") else "") + ("C" if cfg.get("stage_c") else "")
            + ("L" if cfg.get("lazy_rescale") else "") + ("Q" if cfg.get("qk_fp8") else ""))


def prefill_flops(lens, H, causal):
    pairs = 0
    for lq, lk in lens:
        if causal:
            pairs += sum(max(0, min(lk, i + lk - lq + 1)) for i in range(lq))
        else:
            pairs += lq * lk
    return 2 * pairs * H * (P + R + V)


def run_prefill(rows, sweep: bool, log, deadline: float, match: str | None = None):
    for name, lens, H, causal in PREFILL_SHAPES:
        if match is not None and not re.search(match, name):
            continue
        cq = torch.tensor([0] + [a for a, _ in lens], device=DEVICE).cumsum(0).to(torch.int32)
        ck = torch.tensor([0] + [b for _, b in lens], device=DEVICE).cumsum(0).to(torch.int32)
        q = torch.randn(int(cq[-1]), H, P + R, device=DEVICE, dtype=torch.bfloat16)
        k = torch.randn(int(ck[-1]), H, P + R, device=DEVICE, dtype=torch.bfloat16)
        v = torch.randn(int(ck[-1]), H, V, device=DEVICE, dtype=torch.bfloat16)
        max_q = max(a for a, _ in lens)
        flops = prefill_flops(lens, H, causal)
        cfgs = [default_prefill_config(torch.bfloat16)] + ([PrefillConfig(*c) for c in PREFILL_SWEEP] if sweep else [])
        tried, ref = [], None
        for cfg in dict.fromkeys(cfgs):
            if tried and time.time() > deadline:
                break
            try:
                o, _ = prefill_attention(q, k, v, cq, ck, max_q, 0.1, causal, cfg=cfg)
                ref = o.float() if ref is None else ref
                agree = (o.float() - ref).norm().item() / ref.norm().item()
                ms = graph_ms([lambda: prefill_attention(q, k, v, cq, ck, max_q, 0.1, causal, cfg=cfg)] * 8)
            except Exception as e:
                log.append(f"prefill {name} {cfg}: {type(e).__name__} {e}"[:300])
                continue
            if agree > 1e-2:
                log.append(f"prefill {name} {cfg} DISAGREES {agree:.3g}")
            tried.append(dict(agree=agree, cfg=[cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages] + (["rev"] if cfg.reverse_m else []), ms=ms,
                              default=cfg == cfgs[0]))
        for tag, t in (("default", tried[0] if tried and tried[0]["default"] else None),
                       ("best", min(tried, key=lambda t: t["ms"]) if tried else None)):
            if t is not None:
                rows.append(dict(kind="prefill", shape=name, H=H, which=tag, cfg=t["cfg"], us=t["ms"] * 1e3,
                                 TFLOPs=flops / t["ms"] / 1e9))
        if tried:
            rows[-1]["tried"] = tried
            print(f"prefill {name}: " + ", ".join(f"{t['cfg']}={t['ms'] * 1e3:.0f}us" for t in tried), flush=True)


def run_cache_ops(rows, T=16384, page=64):
    D = LKV + R
    cache = torch.randn(T // page + 8, page, D, device=DEVICE, dtype=torch.bfloat16)
    kv = torch.randn(T, D, device=DEVICE, dtype=torch.bfloat16)
    slots = torch.randperm(cache.shape[0] * page, device=DEVICE)[:T]
    ms = bench_ms(lambda: write_kv(cache, kv, slots))
    rows.append(dict(kind="write_kv", T=T, us=ms * 1e3, GBps=2 * T * D * 2 / ms / 1e6))
    bt = torch.randperm(cache.shape[0], device=DEVICE).to(torch.int32)[: T // page].view(4, -1)
    cu = torch.tensor([0, T // 4, T // 2, 3 * T // 4, T], device=DEVICE, dtype=torch.int32)
    starts = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    ms = bench_ms(lambda: gather_context(cache, bt, starts, cu, T))
    rows.append(dict(kind="gather", T=T, us=ms * 1e3, GBps=2 * T * D * 2 / ms / 1e6))


def run_checks():
    """The real-shape GPU cases of tests/test_triton_ops.py and tests/test_kv_cache_fp8.py."""
    sys.path.insert(0, str(REPO / "tests"))
    out = {}
    for name in ("test_triton_ops", "test_kv_cache_fp8"):
        spec = importlib.util.spec_from_file_location(name, REPO / "tests" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        out.update(mod.run_cases(mod.GPU_CASES))
    return out


def print_table(info, checks, rows, log):
    print(f"\n{info['date']}  {info['gpu']}  SMs={info['sms']}  torch {info['torch']}  triton {info['triton']}")
    print(f"copy ceiling: {info['copy_GBps']:.0f} GB/s")
    if checks is not None:
        bad = {k: v for k, v in checks.items() if v[0] != "ok"}
        print(f"checks: {len(checks) - len(bad)}/{len(checks)} ok")
        for k, v in checks.items():
            print(f"  {k:40s} {v[0]:4s} {v[1] if v[0] == 'ok' else v[1][:200]}")
    print(f"\n{'decode':6s} {'B':>4s} {'S':>6s} {'H':>4s} {'cache':5s} {'which':8s} {'kernel tiles':24s} "
          f"{'splits':>6s} {'graph us':>9s} {'GB/s':>7s} {'%copy':>6s} {'TFLOP/s':>8s}")
    for r in rows:
        if r["kind"] == "decode":
            print(f"{'':6s} {r['B']:4d} {r['S']:6d} {r['H']:4d} {r['cache']:5s} {r['which']:8s} {_short(r['cfg']):24s} "
                  f"{r['splits']:6d} {r['us']:9.1f} {r['GBps']:7.0f} "
                  f"{100 * r['GBps'] / info['copy_GBps']:6.1f} {r['TFLOPs']:8.1f}")
    print(f"\n{'prefill':30s} {'H':>4s} {'which':8s} {'cfg':18s} {'us':>9s} {'TFLOP/s':>8s}")
    for r in rows:
        if r["kind"] == "prefill":
            print(f"{r['shape']:30s} {r['H']:4d} {r['which']:8s} {str(r['cfg']):18s} {r['us']:9.1f} "
                  f"{r['TFLOPs']:8.1f}")
    for r in rows:
        if r["kind"] in ("write_kv", "gather"):
            print(f"{r['kind']:10s} T={r['T']} {r['us']:.1f} us {r['GBps']:.0f} GB/s")
    for line in log:
        print("LOG", line)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="run the real-shape correctness cases first")
    ap.add_argument("--sweep", action="store_true", help="also time candidate tile configs and split counts")
    ap.add_argument("--skip-bench", action="store_true", help="checks only")
    ap.add_argument("--decode-shapes", default=None, metavar="BxS,...",
                    help="decode shapes, e.g. 128x4096,128x16384 (default: the full grid)")
    ap.add_argument("--heads", default="16,128", help="query heads per rank to time decode at")
    ap.add_argument("--cache-dtypes", default="bf16,fp8", help="cache dtypes to time decode over (bf16, fp8)")
    ap.add_argument("--decode-only", action="store_true", help="skip the prefill and cache-op timings")
    ap.add_argument("--prefill-only", action="store_true", help="time the prefill kernel only")
    ap.add_argument("--prefill-match", default=None, metavar="REGEX",
                    help="time only the prefill shapes whose name matches (e.g. '8x1000')")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="after 70%% (decode) / 90%% (prefill) of this many seconds, time default configs only")
    ap.add_argument("--sweep-match", default=None, metavar="REGEX",
                    help="--sweep times only the candidates whose tile tag matches (e.g. 'Q$': the qk_fp8 ones)")
    ap.add_argument("--impl", choices=("triton", "gluon"), default="triton",
                    help="gluon: also time the Gluon decode in the engine's schedule (SEESAW, "
                         "attention/gluon_seesaw.py; H %% 64 == 0, bf16 cache, sm_90) next to the Triton default, "
                         "and with --sweep the lockstep schedule's configs (attention/gluon_decode.py)")
    ap.add_argument("--page", type=int, default=64, help="cache rows per page (the engine's --block-size)")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/bench_mla_decode.json or ./)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_mla_decode.py needs a CUDA GPU")
    if args.impl == "gluon":
        check_gluon_available(torch.device("cuda"))  # raises naming --impl gluon's kernel
    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    info = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                gpu=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                triton=triton.__version__, argv=sys.argv[1:])
    info["copy_GBps"] = copy_ceiling()
    checks = run_checks() if args.check else None
    if checks is not None:
        print(f"checks done in {time.time() - t0:.0f} s", flush=True)
    rows, log = [], []
    out = Path(args.out or os.path.join(os.environ.get("OUT", "."), "bench_mla_decode.json"))

    def save():  # after every stage, so a run cut short still leaves its numbers
        info["seconds"] = time.time() - t0
        out.write_text(json.dumps(dict(info=info, checks=checks, rows=rows, log=log), indent=1))

    save()
    if not args.skip_bench:
        shapes = [tuple(int(v) for v in x.split("x")) for x in args.decode_shapes.split(",")] if args.decode_shapes \
            else DECODE_SHAPES
        if not args.prefill_only:
            run_decode(rows, args.sweep, props.multi_processor_count, log, t0 + args.budget_s * 0.7, shapes,
                       [int(h) for h in args.heads.split(",")], args.cache_dtypes.split(","), args.impl,
                       args.sweep_match, args.page)
            save()
            print(f"decode done in {time.time() - t0:.0f} s", flush=True)
        if not args.decode_only:
            run_prefill(rows, args.sweep, log, t0 + args.budget_s * 0.9, args.prefill_match)
            save()
            if not args.prefill_only:
                run_cache_ops(rows)
                save()
    print_table(info, checks, rows, log)
    if checks is not None and any(v[0] != "ok" for v in checks.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
