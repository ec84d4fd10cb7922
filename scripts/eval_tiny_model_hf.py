"""Greedy k-shot accuracy of a tiny_arith model through transformers `generate` (the reference figure).

Prompts are built exactly as lm_eval's tiny_arith task renders them (shots joined by blank lines,
"Question: ...\\nAnswer:", shots drawn from train.jsonl by one random.Random(1234) over the test
items in order, as lm_eval does), so this figure and lm_eval's are on the same prompts. The generated text is
cut at "Question:" and scored with GSM8K's strict-match regex "#### (-?[0-9.,]+)".

Usage (from the repo root, CPU, fp32):
    python -m scripts.eval_tiny_model_hf --limit 50
"""

from __future__ import annotations

import argparse
import logging
import random
import time
from pathlib import Path

import torch

from scripts.make_task_data import answer_number, format_prompt, read_jsonl

DEFAULT_MODEL = Path("configs/models/tiny-deepseek-v3")
DEFAULT_DATA = Path("configs/lm_eval/tiny_arith")
STOP = "Question:"

logger = logging.getLogger(__name__)


def build_prompts(train: list[dict], test: list[dict], num_shots: int = 5,
                  shot_seed: int = 1234) -> list[str]:
    """The k-shot prompt of each test item, as lm_eval 0.4 builds them: one random.Random(1234)
    shared by all items, in order, each drawing `num_shots` shots from `train` (checked equal,
    prompt for prompt, to the samples lm_eval logs for tiny_arith)."""
    rng = random.Random(shot_seed)
    return [format_prompt(rng.sample(train, num_shots), doc) for doc in test]


@torch.no_grad()
def generate_greedy(model, tokenizer, prompts: list[str], add_bos: bool, batch_size: int = 50,
                    max_new_tokens: int = 40) -> list[str]:
    """Greedy continuations of `prompts` (left-padded batches), cut at the first 'Question:'."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    tokenizer.padding_side = "left"
    device = next(model.parameters()).device
    texts = []
    for start in range(0, len(prompts), batch_size):
        batch = tokenizer(prompts[start:start + batch_size], add_special_tokens=add_bos,
                          padding=True, return_tensors="pt").to(device)
        out = model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        for row in out[:, batch["input_ids"].shape[1]:]:
            texts.append(tokenizer.decode(row, skip_special_tokens=True).split(STOP)[0])
    return texts


def accuracy(texts: list[str], docs: list[dict]) -> float:
    """Fraction of generations whose '#### N' equals the gold '#### N' (lm_eval strict-match)."""
    if len(texts) != len(docs) or not docs:
        raise ValueError(f"need equal, non-zero counts, got {len(texts)} texts and {len(docs)} docs")
    hits = sum(answer_number(t) == answer_number(d["answer"]) for t, d in zip(texts, docs))
    return hits / len(docs)


def evaluate(model, tokenizer, data_dir: Path = DEFAULT_DATA, limit: int | None = None,
             add_bos: bool = True, batch_size: int = 50) -> tuple[float, list[str]]:
    """Greedy 5-shot accuracy on the first `limit` test items, and the generated texts."""
    data_dir = Path(data_dir)
    train, test = read_jsonl(data_dir / "train.jsonl"), read_jsonl(data_dir / "test.jsonl")
    if limit is not None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        test = test[:limit]
    texts = generate_greedy(model, tokenizer, build_prompts(train, test), add_bos, batch_size)
    return accuracy(texts, test), texts


def load(model_dir: Path, dtype: torch.dtype, device: str):
    """The model (eval mode) and tokenizer of an HF-format folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    return model, tokenizer


def main() -> None:
    """Print the greedy 5-shot accuracy with and without BOS."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="HF-format model folder")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder with train/test.jsonl")
    parser.add_argument("--limit", type=int, default=None, help="evaluate only the first N test items")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weights dtype")
    parser.add_argument("--device", default="cpu", help="torch device")
    parser.add_argument("--batch-size", type=int, default=25, help="prompts per generate call")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    model, tokenizer = load(args.model, getattr(torch, args.dtype), args.device)
    for add_bos in (True, False):
        start = time.time()
        acc, texts = evaluate(model, tokenizer, args.data, args.limit, add_bos, args.batch_size)
        print(f"accuracy bos={add_bos} dtype={args.dtype} device={args.device} n={len(texts)}: "
              f"{acc:.3f} ({time.time() - start:.1f} s)")
        logger.info("first output: %r", texts[0])


if __name__ == "__main__":
    main()
