"""Offline generation with the `LLM` API (no server).

    python scripts/generate_demo.py                                   # the bundled tiny model
    python scripts/generate_demo.py --model DIR -tp 2 --prompt "Hello" --temperature 0.7
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import LLM, SamplingParams  # noqa: E402
from common.args import DEFAULT_MODEL  # noqa: E402

QUESTION = ("Question: Mia has 7 apples. Leo has 3 pens. Amy has 12 cups. "
            "How many are Mia's apples plus Amy's cups?\nAnswer:")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prompt", action="append", help="repeat for several prompts")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("-dcp", "--decode-context-parallel-size", type=int, default=1)
    p.add_argument("--device", default="auto")
    a = p.parse_args()
    llm = LLM(a.model, tensor_parallel_size=a.tensor_parallel_size,
              decode_context_parallel_size=a.decode_context_parallel_size, device=a.device)
    params = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, seed=a.seed,
                            stop=["Question:"])
    t0 = time.perf_counter()
    outs = llm.generate(a.prompt or [QUESTION], params)
    dt = time.perf_counter() - t0
    for o in outs:
        c = o.outputs[0]
        print(f"--- prompt ({len(o.prompt_token_ids)} tokens): {o.prompt!r}")
        print(f"--- output ({len(c.token_ids)} tokens, finish {c.finish_reason}): {c.text!r}")
    print(f"{sum(len(o.outputs[0].token_ids) for o in outs)} tokens in {dt:.2f} s")


if __name__ == "__main__":
    main()
