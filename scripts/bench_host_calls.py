"""Host time of single calls the forward makes, on the GPU: what a launch costs the host before
its kernel runs (the GPU is idle before each call, so no call waits on a full launch queue).

Compares a repeated shape with a new row count every call (cuBLAS picks an algorithm per shape),
and the host-to-device copy of step metadata through freshly pinned memory against a reused
pinned staging buffer, with the GPU idle and with it busy.

    python scripts/bench_host_calls.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common.transfer import to_device  # noqa: E402


def host_us(fn, args_list, sync_each: bool = True) -> float:
    """Median host time of fn(*args) over args_list, the stream drained before each call."""
    times = []
    for args in args_list:
        if sync_each:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return float(np.median(times)) * 1e6


def main() -> None:
    dev = torch.device("cuda")
    w = torch.randn(3072, 2048, device=dev, dtype=torch.bfloat16)
    wr = torch.randn(64, 2048, device=dev, dtype=torch.bfloat16)
    xs = torch.randn(8192, 2048, device=dev, dtype=torch.bfloat16)
    same = [(xs[:8000],)] * 50
    varying = [(xs[:7900 + i],) for i in range(50)]
    lin = lambda x: torch.nn.functional.linear(x, w)
    mm32 = lambda x: torch.mm(x, wr.t(), out_dtype=torch.float32)
    for _ in range(3):
        lin(xs[:8000]), mm32(xs[:8000])
    print("| call | host us, same rows each call | host us, new row count each call |\n|---|---|---|")
    print(f"| F.linear [M, 2048] x [2048, 3072] bf16 | {host_us(lin, same):.1f} | {host_us(lin, varying):.1f} |")
    varying2 = [(xs[:7800 + i],) for i in range(50)]
    print(f"| torch.mm(out_dtype=fp32) [M, 2048] x [2048, 64] | {host_us(mm32, same):.1f} "
          f"| {host_us(mm32, varying2):.1f} |")
    again = [(xs[:7900 + i],) for i in range(50)]
    print(f"| F.linear, the same 50 row counts again | | {host_us(lin, again):.1f} |")

    small = np.arange(256, dtype=np.int64)
    big = np.arange(8192, dtype=np.int64)
    busy_a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def busy():
        for _ in range(20):  # ~20 ms of GPU work queued ahead
            busy_a @ busy_a

    print("\n| copy to the GPU | GPU idle, host us | GPU busy, host us |\n|---|---|---|")
    for name, arr in (("256 int64", small), ("8192 int64", big)):
        idle = host_us(lambda a: to_device(a, torch.int64, dev), [(arr,)] * 50)
        ts = []
        for _ in range(20):
            busy()
            t = time.perf_counter()
            for _ in range(10):
                to_device(arr, torch.int64, dev)
            ts.append((time.perf_counter() - t) / 10)
            torch.cuda.synchronize()
        print(f"| to_device {name} (pin_memory + copy) | {idle:.1f} | {np.median(ts) * 1e6:.1f} |")
    print(f"| torch.empty(8192, int64, pin_memory=True) | "
          f"{host_us(lambda: torch.empty(8192, dtype=torch.int64, pin_memory=True), [()] * 50):.1f} | |")


if __name__ == "__main__":
    main()
