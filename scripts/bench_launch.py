"""Host cost of one Triton launch, by argument count, through `kernel[grid](...)` and through the
compiled kernel's own launcher; beside it torch.empty and a small F.linear.

    python scripts/bench_launch.py

Why: after the Triton norms and the counting sort, the offline workload's mixed step is still
paced by the host (scripts/profile_host.py), and 507 Triton launches took ~40% of its forward's
time under cProfile. `kernel[grid](...)` binds and specializes every argument, builds a cache key
and checks globals on each call; the CompiledKernel it returns can be launched directly
(`compiled[grid](*all_args)`), which skips that. This measures what a launch cache keyed by the
caller would save per launch before one is built. The GPU is held busy (`torch.cuda._sleep`) while
the launches are queued, so that none of them waits on it.
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _store_few(out_ptr, a1, a2):
    tl.store(out_ptr, a1 + a2)


@triton.jit
def _store_many(out_ptr, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16,
                a17, a18, a19, a20, a21, a22, a23, a24, a25, a26, a27, a28, a29, a30, a31, a32,
                FLAG: tl.constexpr):
    """33 arguments and a constexpr, as the MLA kernels have: a launch that is all its cost."""
    s = (a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11 + a12 + a13 + a14 + a15 + a16 + a17 + a18
         + a19 + a20 + a21 + a22 + a23 + a24 + a25 + a26 + a27 + a28 + a29 + a30 + a31 + a32)
    if FLAG:
        tl.store(out_ptr, s)


def per_call_us(fn, n: int, busy_ms: float) -> float:
    torch.cuda.synchronize()
    torch.cuda._sleep(int(busy_ms * 1.98e6))  # ~1.98 GHz SM clock: keep the GPU busy meanwhile
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=400, help="launches timed per row (fewer than the launch queue holds)")
    p.add_argument("--busy-ms", type=float, default=300.0)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_launch.py needs CUDA")
    out = torch.zeros(1, dtype=torch.int64, device="cuda")
    # ints of 17 (not 1, not a multiple of 16): one specialization, as a stride or length would have
    ints = [17] * 32
    rows = []
    for name, kern, args, consts in (("3 args", _store_few, [out, 17, 17], {}),
                                     ("33 args + a constexpr", _store_many, [out, *ints], {"FLAG": True})):
        compiled = kern[(1,)](*args, **consts)
        rows.append((f"Triton kernel[grid](...), {name}", per_call_us(
            lambda: kern[(1,)](*args, **consts), a.calls, a.busy_ms)))
        if hasattr(compiled, "__getitem__"):
            direct = compiled[(1, 1, 1)]
            rows.append(("the same, compiled[grid](*all_args): no binding", per_call_us(
                lambda: direct(*args, *consts.values()), a.calls, a.busy_ms)))
    x = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    xs = x[:64]
    rows.append(("torch.empty(8192, 2048)", per_call_us(lambda: torch.empty(8192, 2048, device="cuda"),
                                                        a.calls, a.busy_ms)))
    torch.nn.functional.linear(xs, w)  # cuBLAS's choice for the shape, made before the timing
    rows.append(("F.linear [64, 2048] x [2048, 2048] bf16 (shape seen)", per_call_us(
        lambda: torch.nn.functional.linear(xs, w), a.calls, a.busy_ms)))
    print(f"\ntriton {triton.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| call | host µs per call |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")
    assert int(out.item()) == 17 * 32, "the last launches did not store 17 * 32"


if __name__ == "__main__":
    main()
