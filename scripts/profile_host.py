"""Host time of the offline workload's mixed step (running decodes + new prompts), by function.

    python scripts/profile_host.py --decodes 211 --prompts 8 --reps 4

Per rep: the step's wall time and the host time to enqueue the model's forward, once with the GPU
idle at the step's start and once with the GPU held busy (`torch.cuda._sleep`) for longer than the
step's launches take, so that no launch waits on the GPU: the second is the host's own cost, and
if the two agree the step is bound by the host, not by the GPU. Then one step under cProfile,
its functions by own time and by cumulative time, and own time summed by where the code lives
(this repository, Triton's runtime, torch, the rest).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

import torch
from bench_common import add_engine_flags, engine_kwargs, random_prompts

from engine import LLM, SamplingParams

REPO = str(Path(__file__).resolve().parent.parent)


def where(filename: str) -> str:
    if filename.startswith(REPO) and "site-packages" not in filename:
        return "repository"
    for key in ("triton", "torch/_dynamo", "torch/_inductor", "torch"):
        if f"/{key}/" in filename:
            return key
    return "builtins / C" if filename.startswith("~") or filename == "" else "other"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(p)
    p.add_argument("--decodes", type=int, default=211)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--busy-ms", type=float, default=400.0, help="GPU sleep queued before a 'busy' rep")
    p.add_argument("--top", type=int, default=45)
    a = p.parse_args()
    a.async_scheduling = False
    core = LLM(**engine_kwargs(a)).engine
    vocab = core.cfg.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for i, ids in enumerate(random_prompts(a.decodes, a.prompt_len, vocab, seed=7)):
        core.add_request(f"d{i}", ids, sp)
    while core.scheduler.stats.num_waiting or any(r.num_output_tokens == 0 for r in core.scheduler.running):
        core.step()
    model = core.executor.worker.runner.model
    forward, enqueue = model.forward, []

    def timed_forward(*args, **kwargs):
        t = time.perf_counter()
        out = forward(*args, **kwargs)
        enqueue.append(time.perf_counter() - t)
        return out

    model.forward = timed_forward
    # host clock at each decoder layer's entry: with the GPU held busy the first layers' gaps are
    # the host's own cost per layer even if the launch queue fills later in the step
    marks: list[float] = []
    hooks = [layer.register_forward_pre_hook(lambda m, args: marks.append(time.perf_counter()))
             for layer in model.model.layers]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    # cycles per ms at the SM clock under load (H200: ~1.98 GHz); only needs to outlast the launches
    cycles = int(a.busy_ms * 1.98e6)
    rows = []
    for rep in range(2 * a.reps + 1):
        for i, ids in enumerate(random_prompts(a.prompts, a.prompt_len, vocab, seed=100 + rep)):
            core.add_request(f"p{rep}-{i}", ids, one)
        torch.cuda.synchronize()
        busy = rep % 2 == 1
        if busy:
            torch.cuda._sleep(cycles)
        enqueue.clear()
        marks.clear()
        t0 = time.perf_counter()
        if rep == 2 * a.reps:  # the last: under cProfile
            prof = cProfile.Profile()
            prof.enable()
            core.step()
            torch.cuda.synchronize()
            prof.disable()
            prof_wall, prof_enq = time.perf_counter() - t0, sum(enqueue)
            continue
        core.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        per_layer = [(b - a_) * 1e3 for a_, b in zip(marks, marks[1:])]
        rows.append((busy, wall * 1e3, sum(enqueue) * 1e3, per_layer))
    model.forward = forward
    for h in hooks:
        h.remove()
    print(f"\n## mixed step: {a.decodes} decodes + {a.prompts} x {a.prompt_len} prompt tokens")
    print(f"(held busy: a {a.busy_ms:.0f} ms GPU sleep queued first, in the wall time)")
    print("| GPU at the step's start | wall ms | forward enqueue ms | host ms per layer, layers 1-26: "
          "min / median / max |\n|---|---|---|---|")
    for busy, wall, enq, pl in rows:
        s = sorted(pl[1:]) or [0.0]
        print(f"| {'held busy' if busy else 'idle'} | {wall:.1f} | {enq:.1f} | "
              f"{s[0]:.2f} / {s[len(s) // 2]:.2f} / {s[-1]:.2f} |")
    print("host ms per layer gap, last busy rep: " + " ".join(f"{x:.2f}" for x in rows[-1][3]))
    print(f"\nunder cProfile: wall {prof_wall * 1e3:.1f} ms, forward enqueue {prof_enq * 1e3:.1f} ms")
    st = pstats.Stats(prof)
    own: dict[str, float] = {}
    for (fname, _, _), (_, _, tt, _, _) in st.stats.items():
        own[where(fname)] = own.get(where(fname), 0.0) + tt
    print("own time by where the code lives: " + ", ".join(
        f"{k} {v * 1e3:.1f} ms" for k, v in sorted(own.items(), key=lambda kv: -kv[1])))
    st.sort_stats("tottime").print_stats(a.top)
    st.sort_stats("cumulative").print_stats(a.top)


if __name__ == "__main__":
    main()
