"""How often do greedy continuations agree between precisions / chunkings of the SAME backend?

The baseline for judging bf16 agreement between two attention backends: if the torch backend in
bf16 disagrees with itself when only the prefill chunking changes, no second backend can be
expected to agree with it more often.

    python scripts/bf16_agreement.py random   # tiny random V3 (rope 16), 64 random prompts
    python scripts/bf16_agreement.py trained  # the bundled model, 16 lm_eval-style task prompts
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from engine import LLM, SamplingParams  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", choices=("random", "trained"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="torch")
    a = p.parse_args()
    if a.model == "random":
        from tiny_models import make_model
        g = torch.Generator().manual_seed(1)
        lens = torch.randint(1, 200, (64,), generator=g).tolist()
        prompts = [torch.randint(2, 320, (n,), generator=g).tolist() for n in lens]
        path = tempfile.mkdtemp()
        make_model(path, "v3", qk_rope_head_dim=16)
        small = 16
    else:
        from scripts.eval_tiny_model_hf import build_prompts
        from scripts.make_task_data import read_jsonl
        data = REPO / "configs" / "lm_eval" / "tiny_arith"
        prompts = build_prompts(read_jsonl(data / "train.jsonl"), read_jsonl(data / "test.jsonl")[:16])
        path = str(REPO / "configs" / "models" / "tiny-deepseek-v3")
        small = 32
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run(dtype, budget):
        llm = LLM(path, device=a.device, dtype=dtype, num_kv_blocks=1024, max_num_batched_tokens=budget,
                  attention_backend=a.backend)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]

    f32, chunked, whole = run("float32", 2048), run("bfloat16", small), run("bfloat16", 2048)
    n = len(prompts)
    same = lambda x, y: sum(u == v for u, v in zip(x, y))  # noqa: E731
    print(f"{a.model} model, {a.backend} backend on {a.device}, {n} prompts, 24 greedy tokens:")
    print(f"  bf16 budget {small} vs bf16 budget 2048: {same(chunked, whole)} / {n}")
    print(f"  bf16 budget 2048 vs fp32:             {same(whole, f32)} / {n}")
    print(f"  bf16 budget {small} vs fp32:             {same(chunked, f32)} / {n}")


if __name__ == "__main__":
    main()
