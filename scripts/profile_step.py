"""Where a decode step's time goes: cProfile of engine steps plus the CUDA-graph replay alone.

    python scripts/profile_step.py --batch 1 --steps 50
    python scripts/profile_step.py --kernels --batch 1      # GPU time per kernel instead
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch
from bench_common import add_engine_flags, engine_kwargs, random_prompts, replay_ms, step_ms

from engine import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_engine_flags(p)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--kernels", action="store_true",
                   help="instead: GPU time per kernel over 5 eager decode steps (torch.profiler)")
    a = p.parse_args()
    if a.kernels:
        return kernels(a)
    llm = LLM(**engine_kwargs(a))
    core = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for i, ids in enumerate(random_prompts(a.batch, 1000, core.cfg.vocab_size)):
        core.add_request(str(i), ids, sp)
    for _ in range(10):
        core.step()
    print(f"step: {step_ms(core, a.steps):.3f} ms")
    runner = core.executor.worker.runner
    if runner.graphs is not None:
        print(f"graph replay alone (bucket {runner.graphs.bucket_for(a.batch)}): "
              f"{replay_ms(runner.graphs, a.batch, 50):.3f} ms")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.steps):
        core.step()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)




def kernels(a, steps: int = 5) -> None:
    """GPU kernel time per op over eager decode steps (what the graphs replay), at `a.batch`."""
    from torch.profiler import ProfilerActivity, profile
    batch = a.batch
    a.enforce_eager = True
    llm = LLM(**engine_kwargs(a))
    core = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for i, ids in enumerate(random_prompts(batch, 1000, core.cfg.vocab_size)):
        core.add_request(str(i), ids, sp)
    for _ in range(5):
        core.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            core.step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    launches = sum(e.count for e in events if e.self_device_time_total > 0)
    print(f"GPU time per step {total / steps / 1e3:.3f} ms in {launches / steps:.0f} kernels "
          f"(mean {total / max(launches, 1):.1f} us)")
    print(f"{'us/step':>9} {'calls/step':>10} {'us/call':>8}  kernel")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:45]:
        if e.self_device_time_total:
            print(f"{e.self_device_time_total / steps:9.1f} {e.count / steps:10.1f} "
                  f"{e.self_device_time_total / e.count:8.2f}  {e.key[:110]}")


if __name__ == "__main__":
    main()
