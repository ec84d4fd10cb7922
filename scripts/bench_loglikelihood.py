"""lm_eval's loglikelihood workload offline: prompt logprobs with prefix caching on (the records of
scheduler/logprob_records.py let these requests use the cache) and off (every prompt computed
whole, as vLLM serves such requests).

The requests are MMLU-like by default: `--subjects` subjects, each with a few-shot preamble of
`--preamble` random tokens; `--questions` questions per subject, each `--question` tokens; per
question `--choices` requests of context (preamble + question) and a `--choice-len`-token
continuation, all with prompt_logprobs=1 and max_tokens=1, as lm_eval's local-completions sends
them (echo, logprobs 1, one hidden token). `--hellaswag` adds a HellaSwag-like zero-shot task
(no preamble, 80-token contexts, 20-token continuations), where only each question's choices
share their context, run in the same engines. Each task's requests go to one `LLM.generate`
(shuffled: lm_eval orders by length, not by question), after a reset of the prefix cache; the
wall time, req/s and prompt tokens computed are printed for each setting, and the two settings'
prompt logprobs compared (largest absolute difference; equal ranks and alternatives counted).
`--control`: with caching off the requests run again in reverse order (other batches), and once
more with each prompt cut into two chunks where "on" cuts it (`long_prefill_token_threshold` set
to its cache hit, so that the second chunk attends to the first through the cache: a prefix hit's
math without the cache), each compared with "off" the same way.

    python scripts/bench_loglikelihood.py [--model DIR] [--load-format dummy] [--subjects 8 ...]
"""

from __future__ import annotations

import argparse
import random
import time

from bench_common import add_engine_flags, engine_kwargs, environment, write_json


def workload(a, vocab: int) -> list[list[int]]:
    r = random.Random(a.seed)

    def rand(n):
        return [r.randrange(100, vocab - 100) for _ in range(n)]
    prompts = []
    for _ in range(a.subjects):
        preamble = rand(a.preamble)
        for _ in range(a.questions):
            context = preamble + rand(a.question)
            prompts += [context + rand(a.choice_len) for _ in range(a.choices)]
    r.shuffle(prompts)
    return prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(p)
    p.add_argument("--subjects", type=int, default=8)
    p.add_argument("--questions", type=int, default=32)
    p.add_argument("--choices", type=int, default=4)
    p.add_argument("--preamble", type=int, default=500, help="few-shot tokens shared by a subject's questions")
    p.add_argument("--question", type=int, default=80)
    p.add_argument("--choice-len", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--settings", nargs="+", default=["on", "off"], choices=["on", "off"],
                   help="prefix caching on / off, in this order, each in an engine of its own")
    p.add_argument("--hellaswag", action="store_true", help="also a HellaSwag-like zero-shot task")
    p.add_argument("--control", action="store_true",
                   help="with caching off, the requests again in reverse order: how far batching alone moves them")
    a = p.parse_args()
    from engine import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    tasks = {"mmlu-like": a}
    if a.hellaswag:
        tasks["hellaswag-like"] = argparse.Namespace(**{**vars(a), "subjects": 1, "preamble": 0, "question": 80,
                                                        "choice_len": 20, "questions": a.subjects * a.questions})
    results: dict = {}
    got: dict = {}
    for setting in a.settings:
        a.enable_prefix_caching = setting == "on"
        llm = LLM(**engine_kwargs(a), device=a.device)
        vocab = llm.engine.cfg.vocab_size
        llm.generate(workload(argparse.Namespace(**{**vars(a), "seed": a.seed + 1, "subjects": 1, "questions": 2}),
                              vocab), params)  # warm-up on other tokens
        for task, t in tasks.items():
            prompts = workload(t, vocab)
            llm.reset_prefix_cache()
            before = llm.scheduler.stats
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            dt = time.perf_counter() - t0
            total = sum(map(len, prompts))
            computed = total - (llm.scheduler.stats.prefix_cache_hits - before.prefix_cache_hits)
            results[f"{task} {setting}"] = dict(seconds=dt, req_per_s=len(prompts) / dt, prompt_tokens=total,
                                                computed_prompt_tokens=computed)
            got.setdefault(task, {})[setting] = [o.prompt_logprobs for o in outs]
            print(f"{task}, prefix caching {setting}: {len(prompts)} requests, {total} prompt tokens, {computed} "
                  f"computed ({100 * computed / total:.1f}%): {dt:.2f} s, {len(prompts) / dt:.1f} req/s", flush=True)
            if setting == "off" and a.control:
                # the same requests in reverse order: other batches, the same math
                again = llm.generate(prompts[::-1], params)[::-1]
                got[task]["off, reversed"] = [o.prompt_logprobs for o in again]
                # each prompt in two chunks split where "on" splits it (its cache hit: all but
                # the last full block of its context), the second attending to the first through
                # the cache: the math of a prefix hit, without the cache
                tpb = llm.scheduler.block_manager.tokens_per_block
                cfg = llm.scheduler.config
                keep, cfg.long_prefill_token_threshold = cfg.long_prefill_token_threshold, \
                    ((t.preamble + t.question) // tpb - 1) * tpb
                chunked = llm.generate(prompts, params)
                cfg.long_prefill_token_threshold = keep
                got[task]["off, chunked there"] = [o.prompt_logprobs for o in chunked]
        del llm
    for task, by in got.items():
        for x, y in (("on", "off"), ("off, reversed", "off"), ("off, chunked there", "off")):
            if x not in by or y not in by:
                continue
            pairs = [(u, v) for lx, ly in zip(by[x], by[y]) for u, v in zip(lx[1:], ly[1:])]
            same = sum((u.rank, u.top[0][0]) == (v.rank, v.top[0][0]) for u, v in pairs)
            diffs = sorted(abs(u.logprob - v.logprob) for u, v in pairs)
            row = dict(max_abs_logprob_diff=diffs[-1], p99_abs_logprob_diff=diffs[int(0.99 * (len(diffs) - 1))],
                       same_rank_and_top=same, tokens=len(pairs))
            if x == "on":
                row["speedup"] = results[f"{task} off"]["seconds"] / results[f"{task} on"]["seconds"]
                print(f"{task}: on against off {row['speedup']:.2f}x")
            results[f"{task} {x} against {y}"] = row
            print(f"{task}: prompt logprobs, {x} against {y}: |difference| largest {diffs[-1]:.3g}, 99th percentile "
                  f"{row['p99_abs_logprob_diff']:.3g}; rank and top alternative equal at {same} of {len(pairs)} tokens")
    write_json(a.json, {"env": environment(), "args": vars(a), "results": results})


if __name__ == "__main__":
    main()
