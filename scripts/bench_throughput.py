"""Offline throughput: N requests of random prompt tokens, fixed output length (ignore_eos).

    python scripts/bench_throughput.py                    # 1000 x (1000 in, 100 out), V2-Lite dummy bf16
"""

from __future__ import annotations

import argparse
import time

from bench_common import add_engine_flags, engine_kwargs, environment, random_prompts, write_json

from engine import LLM, SamplingParams


def watch_steps(core) -> list:
    """Record (scheduled tokens, decode rows, wall seconds) of every engine step from now on."""
    steps, schedule, step = [], core.scheduler.schedule, core.step
    last = {}

    def scheduling():
        so = schedule()
        last["tokens"] = so.total_num_scheduled_tokens
        last["decodes"] = sum(n == 1 for n in so.num_scheduled_tokens.values())
        return so

    def stepping():
        t = time.perf_counter()
        out = step()
        steps.append((last.get("tokens", 0), last.get("decodes", 0), time.perf_counter() - t))
        return out

    core.scheduler.schedule, core.step = scheduling, stepping
    return steps


def print_step_stats(steps: list) -> None:
    kinds = {"pure decode": [s for s in steps if s[0] == s[1]], "with prefill": [s for s in steps if s[0] > s[1]]}
    print("| steps | count | wall s | ms / step | tokens / step | decode rows / step |\n|---|---|---|---|---|---|")
    for name, rows in kinds.items():
        if rows:
            n, wall = len(rows), sum(r[2] for r in rows)
            print(f"| {name} | {n} | {wall:.2f} | {wall / n * 1e3:.1f} | {sum(r[0] for r in rows) / n:.0f} "
                  f"| {sum(r[1] for r in rows) / n:.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(p)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=100)
    p.add_argument("--step-stats", action="store_true",
                   help="also print wall time per step kind (pure decode / with prefill tokens)")
    a = p.parse_args()
    llm = LLM(**engine_kwargs(a))
    prompts = random_prompts(a.num_prompts, a.input_len, llm.engine.cfg.vocab_size)
    sp = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    llm.generate(prompts[:8], sp)  # warm-up (Triton compiles, allocator)
    steps = watch_steps(llm.engine) if a.step_stats else None
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t0
    if steps is not None:
        print_step_stats(steps)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {"requests_per_s": a.num_prompts / dt, "output_tokens_per_s": out_tokens / dt,
           "total_tokens_per_s": (out_tokens + a.num_prompts * a.input_len) / dt, "elapsed_s": dt,
           "num_preemptions": llm.scheduler.stats.num_preemptions}
    print(f"{a.num_prompts} requests x ({a.input_len} in, {a.output_len} out) in {dt:.2f} s: "
          f"{res['requests_per_s']:.2f} req/s, {res['output_tokens_per_s']:.0f} output tok/s, "
          f"{res['total_tokens_per_s']:.0f} total tok/s, {res['num_preemptions']} preemptions")
    write_json(a.json, {"bench": "throughput", "env": environment(), "args": vars(a), "results": res})


if __name__ == "__main__":
    main()
