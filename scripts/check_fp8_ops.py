"""Every FP8 GEMM and MoE call of an engine checked against the fp32 emulation of its arithmetic.

Builds a tiny FP8 V3 (tests/tiny_models.py, hidden size --hidden-size), runs a few greedy requests
with --fp8-gemm, and wraps `fp8_linear` (W8A8: activations quantized per 128-group) and the FP8
fused / block MoE kernels: each call is run twice and compared with the dequantized product in
fp32. Prints, per (op, backend, row range, shape), the calls, the largest relative error and how
many repeats differed bit for bit. It found the cuBLAS block-scaled GEMM's wrong products at
K = 128 / 256 (RESULTS.md, thirteenth session).

    python scripts/check_fp8_ops.py [--kernels auto,warmup=0] [--hidden-size 1024]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import models.blocked_moe as bm  # noqa: E402
import models.fp8_gemm as g  # noqa: E402
import models.fused_moe as fm  # noqa: E402
from models.fp8 import dequantize, quantize  # noqa: E402

STATS: dict = collections.defaultdict(lambda: [0, 0.0, 0])  # key -> [calls, max rel err, repeats that differed]


def _note(key, y, y2, want) -> None:
    s = STATS[key]
    s[0] += 1
    s[1] = max(s[1], ((y.float() - want).norm() / want.norm().clamp_min(1e-30)).item())
    s[2] += 0 if torch.equal(y, y2) else 1


def _rows(m: int) -> str:
    return "M<=3" if m <= 3 else "M<=16" if m <= 16 else "M>16"


def _moe_ref(x, w13, w2, weights, ids, s13, s2, n_shared=0):
    """sum over a token's pairs of w * (silu(x Wg^T) * (x Wu^T)) W2^T, h rounded to x's dtype as
    the kernels store it; FP8 experts dequantized (128 x 128 blocks)."""
    E, I, T = w13.shape[0], w2.shape[-1], x.shape[0]
    W13 = dequantize(w13, s13, (128, 128)) if s13 is not None else w13.float()
    W2 = dequantize(w2, s2, (128, 128)) if s2 is not None else w2.float()
    if n_shared:
        ids = torch.cat([ids, torch.arange(E - n_shared, E, device=x.device).expand(T, n_shared)], 1)
        weights = torch.cat([weights.float(), torch.ones(T, n_shared, device=x.device)], 1)
    out = torch.zeros(T, x.shape[1], device=x.device)
    for e in range(E):
        t, j = (ids == e).nonzero(as_tuple=True)
        if t.numel():
            gu = x[t].float() @ W13[e].T
            h = (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]).to(x.dtype).float()
            out.index_add_(0, t, (h @ W2[e].T) * weights[t, j].float()[:, None])
    return out


def install() -> None:
    """Wrap the module-level FP8 entry points (before the engine is built: the MoE binds its
    kernels at construction, the linears look `fp8_linear` up at each call)."""
    linear, blocked, small = g.fp8_linear, bm.fused_moe_blocked, fm.fused_moe_small

    def fp8_linear(x, wq, sw, backend="auto", split_k=False):
        y, y2 = linear(x, wq, sw, backend, split_k), linear(x, wq, sw, backend, split_k)
        x2 = x.reshape(-1, x.shape[-1])
        xq, sx = quantize(x2.float(), (1, 128))
        want = dequantize(xq, sx, (1, 128)) @ dequantize(wq, sw, (128, 128)).T
        _note(("linear", backend, split_k, _rows(x2.shape[0]), tuple(wq.shape)), y.reshape(want.shape), y2, want)
        return y

    def fused_moe_blocked(x, w13, w2, weights, ids, block_m=16, w13_scale=None, w2_scale=None, block=128, a8=False):
        args = (x, w13, w2, weights, ids, block_m, w13_scale, w2_scale, block, a8)
        y, y2 = blocked(*args), blocked(*args)
        _note(("moe_blocked", block_m, a8, _rows(x.shape[0])), y, y2,
              _moe_ref(x, w13, w2, weights, ids, w13_scale, w2_scale))
        return y

    def fused_moe_small(x, w13, w2, weights, ids, w13_scale=None, w2_scale=None, block=128, n_shared=0):
        args = (x, w13, w2, weights, ids, w13_scale, w2_scale, block, n_shared)
        y, y2 = small(*args), small(*args)
        _note(("moe_small", n_shared, _rows(x.shape[0])), y, y2,
              _moe_ref(x, w13, w2, weights, ids, w13_scale, w2_scale, n_shared))
        return y

    g.fp8_linear, bm.fused_moe_blocked, fm.fused_moe_small = fp8_linear, fused_moe_blocked, fused_moe_small


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", nargs="+",
                   default=["auto,warmup=0,autotune=0", "auto,warmup=0,autotune=0,fp8_gemm=triton"],
                   help="kernel plans to check, one engine each")
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    from engine import LLM, SamplingParams
    from tiny_models import make_fp8_model
    install()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 320, (n,), generator=gen).tolist()
               for n in torch.randint(1, 200, (a.prompts,), generator=gen).tolist()]
    with tempfile.TemporaryDirectory() as d:
        make_fp8_model(Path(d) / "src", Path(d) / "fp8", hidden_size=a.hidden_size)
        for kernels in a.kernels:
            STATS.clear()
            dtype = "bfloat16" if a.device == "cuda" else "float32"
            llm = LLM(str(Path(d) / "fp8"), device=a.device, dtype=dtype, num_kv_blocks=1024, fp8_gemm=True,
                      kernels=kernels, enforce_eager=True)
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
            print(f"\n## --kernels {kernels}\n")
            print("| op | calls | max rel. error vs fp32 emulation | repeats that differed |\n|---|---|---|---|")
            for key, (n, err, diff) in sorted(STATS.items(), key=str):
                print(f"| {' '.join(map(str, key))} | {n} | {err:.3e} | {diff} |")
            del llm
            if a.device == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
