"""Prefix-cache hits under -dp for prompts that share a prefix and arrive together (the n choices
of one request, few-shot prompts with one preamble): Q groups, each a C-token prefix shared by K
prompts that end in a few tokens of their own, all submitted at once to the offline engine on the
CPU (a tiny random V3, fp32, 4-token blocks). Prints, per layout, the prompt tokens found in the prefix cache, the
requests each DP rank took, the engine steps, and whether the greedy tokens equal the first
layout's. To compare: `--no-routing` turns off the DP scheduler's memory of routed prefixes
(DataParallelScheduler.ROUTED_BLOCKS = 0), `--no-in-step-wait` the scheduler's wait for prompt
blocks another request is computing (PrefixReuse.MIN_SHARED_TOKENS = a huge number); with
a step budget large enough to take a whole group at once (`--max-num-batched-tokens 2048`) the
latter decides the hits.

    python scripts/dp_prefix_hits.py --dp 1 2 4
    python scripts/dp_prefix_hits.py --dp 1 4 --max-num-batched-tokens 2048 [--no-in-step-wait]

With `--n K` each group is instead one request of the shared prefix alone with n = K choices,
sampled (temperature 1, seeded), 8 tokens each.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--questions", type=int, default=16, help="groups of prompts")
    p.add_argument("--context", type=int, default=40, help="tokens of each group's shared prefix")
    p.add_argument("--choices", type=int, default=4, help="prompts in a group")
    p.add_argument("--max-num-batched-tokens", type=int, default=64)
    p.add_argument("--no-routing", action="store_true")
    p.add_argument("--no-in-step-wait", action="store_true")
    p.add_argument("--n", type=int, default=0, help="one request of n choices a group instead")
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from engine import LLM, SamplingParams
    from engine.data_parallel import DataParallelScheduler
    from scheduler.prefix_reuse import PrefixReuse
    from scheduler.scheduler import Scheduler
    from tiny_models import make_model

    if a.no_routing:
        DataParallelScheduler.ROUTED_BLOCKS = 0
    if a.no_in_step_wait:
        PrefixReuse.MIN_SHARED_TOKENS = 1 << 40
    per_rank: Counter = Counter()
    add = Scheduler.add_request

    def counted(self, request):
        per_rank[self.engine_index] += 1
        return add(self, request)
    Scheduler.add_request = counted
    path = tempfile.mkdtemp(prefix="dp_prefix_")
    make_model(path, "v3")
    g = torch.Generator().manual_seed(0)
    prompts = []
    for _ in range(a.questions):
        ctx = torch.randint(2, 320, (a.context,), generator=g).tolist()
        if a.n:
            prompts.append(ctx)
        else:
            prompts += [ctx + torch.randint(2, 320, (3 + c,), generator=g).tolist() for c in range(a.choices)]
    params = (SamplingParams(temperature=1.0, seed=7, n=a.n, max_tokens=8) if a.n
              else SamplingParams(temperature=0, max_tokens=1))
    print("| -dp | prefix hits (tokens) | looked up | requests per rank | steps | same tokens as the first | s |")
    print("|---|---|---|---|---|---|---|")
    first = None
    for dp in a.dp:
        llm = LLM(path, device="cpu", dtype="float32", block_size=4, data_parallel_size=dp,
                  max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=32)
        try:
            per_rank.clear()
            steps = [0]
            run_step = llm.engine.step

            def counted_step():
                steps[0] += 1
                return run_step()
            llm.engine.step = counted_step
            t = time.time()
            toks = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
            s = llm.scheduler.stats
            first = toks if first is None else first
            print(f"| {dp} | {s.prefix_cache_hits} | {s.prefix_cache_queries} | "
                  f"{'/'.join(str(per_rank[d]) for d in range(dp))} | {steps[0]} | {toks == first} | "
                  f"{time.time() - t:.1f} |",
                  flush=True)
        finally:
            llm.engine.shutdown()


if __name__ == "__main__":
    main()
