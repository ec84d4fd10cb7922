"""TP / DCP / DP layouts of 4 and 8 ranks on the CPU (gloo): greedy outputs equal one rank.

The layouts (TPxDCP[xDP]: -tp 4, -tp 4 -dcp 2, -tp 4 -dcp 4, -tp 8 -dcp 8, -tp 8 -dcp 4, and with
data parallelism -tp 2 -dp 4, -tp 2 -dcp 2 -dp 4 with expert parallelism) on a tiny V3 model with 8
heads, fp32, every prompt chunked by 16 tokens, two waves (the second hits the prefix cache). The
4-rank layouts also run in CI (tests/test_parallel.py, tests/test_data_parallel.py); 8 ranks take
~1 min each on 2 cores, so they live here.

    python scripts/cpu_parallel_check.py [--layouts 4x1 4x2 4x4 8x8 8x4 2x1x4 2x2x4ep]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402


def run(path: str, prompts: list[list[int]], tp: int, dcp: int, dp: int = 1,
        ep: bool = False) -> tuple[list[list[int]], int]:
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, tensor_parallel_size=tp,
              decode_context_parallel_size=dcp, data_parallel_size=dp, enable_expert_parallel=ep,
              max_num_batched_tokens=16, num_kv_blocks=256 // dcp)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    try:
        outs = llm.generate(prompts[:4], greedy) + llm.generate(prompts[4:], greedy)
        return [o.outputs[0].token_ids for o in outs], llm.scheduler.stats.prefix_cache_hits
    finally:
        llm.engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", default=["4x1", "4x2", "4x4", "8x8", "8x4", "2x1x4", "2x2x4ep"],
                   help="TPxDCP or TPxDCPxDP, ep at the end for expert parallelism")
    a = p.parse_args()
    from tiny_models import make_model
    path = tempfile.mkdtemp()
    make_model(path, "v3", num_attention_heads=8)
    torch.manual_seed(5)
    shared = torch.randint(2, 320, (21,)).tolist()
    prompts = [torch.randint(2, 320, (n,)).tolist() for n in (5, 17, 33, 64)]
    prompts += [shared + torch.randint(2, 320, (n,)).tolist() for n in (2, 9, 14, 30)]
    ref, _ = run(path, prompts, 1, 1)
    failed = 0
    print("| layout | equal to one rank | prefix-cache hits | seconds |\n|---|---|---|---|")
    for layout in a.layouts:
        ep = layout.endswith("ep")
        tp, dcp, dp = (list(map(int, layout.removesuffix("ep").split("x"))) + [1])[:3]
        t = time.time()
        got, hits = run(path, prompts, tp, dcp, dp, ep)
        failed += got != ref
        name = f"-tp {tp} -dcp {dcp}" + (f" -dp {dp}" if dp > 1 else "") + (" -ep" if ep else "")
        print(f"| {name} | {'yes' if got == ref else 'NO'} | {hits} | {time.time() - t:.1f} |", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
