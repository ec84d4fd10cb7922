"""MTP draft acceptance of the bundled tiny V3 on its task's test prompts, per scheduling setting.

Greedy, k drafts per step; each setting is `--max-num-batched-tokens` / `--max-num-seqs` (64/1:
every prompt prefilled alone in chunks; 2048/256: the defaults). Prints accepted / drafted tokens.

    python scripts/mtp_acceptance.py [--prompts 40] [--k 1] [--settings 64/1 2048/256]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

from engine import LLM, SamplingParams  # noqa: E402
from scripts.eval_tiny_model_hf import DEFAULT_DATA, build_prompts  # noqa: E402
from scripts.make_task_data import read_jsonl  # noqa: E402
from tests.server_fixtures import TINY_MODEL  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--k", type=int, default=1, help="num_speculative_tokens")
    p.add_argument("--settings", nargs="+", default=["64/1", "2048/256"], help="BUDGET/MAX_NUM_SEQS")
    a = p.parse_args()
    prompts = build_prompts(read_jsonl(DEFAULT_DATA / "train.jsonl"), read_jsonl(DEFAULT_DATA / "test.jsonl"))
    params = SamplingParams(temperature=0, max_tokens=48, stop=["Question:"])
    print("| budget / max_num_seqs | accepted / drafted |\n|---|---|")
    for setting in a.settings:
        budget, seqs = map(int, setting.split("/"))
        llm = LLM(str(TINY_MODEL), device="cpu", dtype="float32", max_num_batched_tokens=budget, max_num_seqs=seqs,
                  speculative_config={"method": "mtp", "num_speculative_tokens": a.k})
        try:
            llm.generate(prompts[:a.prompts], params, use_tqdm=False)
            s = llm.scheduler.stats.spec
            print(f"| {budget} / {seqs} | {s.num_accepted_tokens} / {s.num_draft_tokens} = "
                  f"{s.num_accepted_tokens / s.num_draft_tokens:.3f} |", flush=True)
        finally:
            llm.engine.shutdown()


if __name__ == "__main__":
    main()
