"""Time per output token (decode step time) at several batch sizes with 1k-token prompts.

    python scripts/bench_latency.py                       # DeepSeek-V2-Lite config, dummy bf16
    python scripts/bench_latency.py --batch-sizes 1 8 --decode-steps 64
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_common import add_engine_flags, engine_kwargs, environment, random_prompts, write_json

from engine import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(p)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--decode-steps", type=int, default=100)
    a = p.parse_args()
    a.max_num_seqs = max(a.max_num_seqs, max(a.batch_sizes))
    llm = LLM(**engine_kwargs(a))
    core = llm.engine
    rows = []
    for bs in a.batch_sizes:
        prompts = random_prompts(bs, a.prompt_len, llm.engine.cfg.vocab_size, seed=bs)
        sp = SamplingParams(temperature=0, max_tokens=a.decode_steps + 8, ignore_eos=True)
        for i, ids in enumerate(prompts):
            core.add_request(f"b{bs}-{i}", ids, sp)
        t0 = time.perf_counter()
        while core.scheduler.stats.num_waiting or any(  # every request has its first token
                r.num_output_tokens == 0 for r in core.scheduler.running):
            core.step()
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        prefill_s = time.perf_counter() - t0
        for _ in range(3):  # warm decode steps
            core.step()
        t0 = time.perf_counter()
        for _ in range(a.decode_steps):
            core.step()  # each step ends with the sampled ids on the host: a full sync
        tpot = (time.perf_counter() - t0) / a.decode_steps
        while core.has_unfinished_requests():
            core.step()
        rows.append({"batch": bs, "prompt_len": a.prompt_len, "tpot_ms": tpot * 1e3,
                     "tokens_per_s": bs / tpot, "prefill_s": prefill_s})
        print(f"batch {bs:4d}: {tpot * 1e3:8.3f} ms per output token, {bs / tpot:10.1f} tok/s, "
              f"prefill of {bs}x{a.prompt_len} tokens {prefill_s:.2f} s", flush=True)
    print("\n| batch | ms / output token | output tok/s |\n|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['tpot_ms']:.3f} | {r['tokens_per_s']:.0f} |")
    write_json(a.json, {"bench": "latency", "env": environment(), "args": vars(a), "results": rows})


if __name__ == "__main__":
    main()
