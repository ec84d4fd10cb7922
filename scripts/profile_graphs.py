"""Where a CUDA-graph decode step's time goes: kernel time and the idle time before each kernel.

    python scripts/profile_graphs.py --batch-sizes 1 8 32 128
    python scripts/profile_graphs.py --batch-sizes 1 --kernel-plan auto,pdl=1 --seq-file /tmp/seq.txt

For each batch (1000-token prompts, greedy, CUDA graphs as served): the engine step's wall time
(TPOT), the host's busy time per step (the wall time less its wait for the step's event), the
graph replay alone, then torch.profiler over a few engine steps. Kernels are ordered
by start time; the idle time between one kernel's end and the next one's start is charged to the
next kernel ("gap before"). Idle stretches longer than --step-gap-us are the host's time between
steps and are reported apart from the in-graph gaps. With --seq-file one step's kernel sequence
(start, duration, gap) is appended per batch.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from bench_common import add_engine_flags, engine_kwargs, replay_ms, start_decodes, step_ms

from engine import LLM


def short(name: str) -> str:
    return name.split("(")[0][:90]


def device_events(prof) -> list[tuple[int, int, str]]:
    """(start ns, end ns, name) of every GPU activity (kernels, memsets, copies), by start."""
    out = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == torch.autograd.DeviceType.CUDA:
            out.append((e.start_ns(), e.start_ns() + e.duration_ns(), e.name()))
    return sorted(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(p)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--steps", type=int, default=6, help="profiled engine steps per batch")
    p.add_argument("--step-gap-us", type=float, default=40.0,
                   help="idle longer than this is counted as between steps, not in the graph")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--seq-file", default=None, help="append one step's kernel sequence per batch here")
    a = p.parse_args()
    from torch.profiler import ProfilerActivity, profile
    a.max_num_seqs = max(a.max_num_seqs, max(a.batch_sizes))
    llm = LLM(**engine_kwargs(a))
    core = llm.engine
    runner = core.executor.worker.runner
    for bs in a.batch_sizes:
        ids = start_decodes(core, bs, f"g{bs}-", seed=bs)
        for _ in range(5):
            core.step()
        n = 50
        tpot = step_ms(core, n)
        # The host's own time per step: the wall time less the time it sat waiting for a step's
        # event (ModelRunner.finish, the one sync per step). If it is near the TPOT, the host
        # sets the pace, not the GPU.
        blocked = [0.0]
        real_sync = torch.cuda.Event.synchronize

        def timed_sync(ev, _real=real_sync):
            t = time.perf_counter()
            _real(ev)
            blocked[0] += time.perf_counter() - t
        torch.cuda.Event.synchronize = timed_sync
        try:
            t0 = time.perf_counter()
            for _ in range(n):
                core.step()
            wall = (time.perf_counter() - t0) / n * 1e3
        finally:
            torch.cuda.Event.synchronize = real_sync
        host = wall - blocked[0] / n * 1e3
        replay = replay_ms(runner.graphs, bs)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(a.steps):
                core.step()
            torch.cuda.synchronize()
        ev = device_events(prof)
        if not ev:
            print(f"\n## batch {bs}: TPOT {tpot:.3f} ms, graph replay alone {replay:.3f} ms; the profiler "
                  "recorded no GPU activity")
            continue
        busy = defaultdict(float)
        gap = defaultdict(float)
        calls = defaultdict(int)
        step_gaps, stretches = 0.0, 0
        prev_end = None
        for start, end, name in ev:
            k = short(name)
            busy[k] += (end - start) / 1e3
            calls[k] += 1
            if prev_end is not None:
                idle = max(0, start - prev_end) / 1e3
                if idle > a.step_gap_us:
                    step_gaps += idle
                    stretches += 1
                else:
                    gap[k] += idle
            prev_end = end if prev_end is None else max(prev_end, end)
        window = (ev[-1][1] - ev[0][0]) / 1e3
        nk = len(ev) / a.steps
        tb, tg = sum(busy.values()) / a.steps, sum(gap.values()) / a.steps
        print(f"\n## batch {bs}: host busy {host:.3f} ms of a {wall:.3f} ms step (the rest waiting for the GPU)")
        print(f"## batch {bs}: TPOT {tpot:.3f} ms, graph replay alone {replay:.3f} ms; per profiled step "
              f"(of {a.steps}): kernels {tb / 1e3:.3f} ms in {nk:.0f}, idle in the step {tg / 1e3:.3f} ms "
              f"({tg / max(nk, 1):.2f} us a kernel), idle between steps {step_gaps / a.steps / 1e3:.3f} ms "
              f"({stretches} stretches over {a.step_gap_us:.0f} us), window {window / a.steps / 1e3:.3f} ms")
        print(f"{'busy us/step':>12} {'gap us/step':>11} {'calls':>6} {'us/call':>8}  kernel")
        for k in sorted(busy, key=lambda k: -(busy[k] + gap[k]))[:a.top]:
            print(f"{busy[k] / a.steps:12.1f} {gap[k] / a.steps:11.1f} {calls[k] / a.steps:6.1f} "
                  f"{busy[k] / calls[k]:8.2f}  {k}")
        if a.seq_file:  # one step's share of the kernels, in order: the third (past the profiler's start)
            k = len(ev) // a.steps
            seq = ev[2 * k: 3 * k] if a.steps >= 3 else ev[:k]
            lines, prev = [f"## batch {bs}", "start_us  dur_us  gap_us  kernel"], seq[0][0]
            for s0, e0, name in seq:
                lines.append(f"{(s0 - seq[0][0]) / 1e3:10.2f} {(e0 - s0) / 1e3:8.2f} {max(0, s0 - prev) / 1e3:7.2f}  {short(name)}")
                prev = max(prev, e0)
            with open(a.seq_file, "a") as f:
                f.write("\n".join(lines) + "\n")
        core.abort_requests(ids)
        while core.has_unfinished_requests():
            core.step()


if __name__ == "__main__":
    main()
