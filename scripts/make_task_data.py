"""Synthetic GSM8K-format task "tiny_arith" and the byte-level BPE tokenizer of the tiny model.

Each question lists 8-12 facts ("Mia has 7 apples.") and then asks for the sum or difference of
two of them, so the answer depends on tokens far back in the prompt and needs a little arithmetic:

    Question: Mia has 7 apples. Leo has 3 pens. ... How many are Mia's apples plus Leo's pens?
    Answer: Mia has 7 apples. Leo has 3 pens. 7 + 3 = 10.
    #### 10

Each name appears once per question (items may repeat), so a fact is found by its name: a
one-key lookup that a 6.7M-parameter model learns in a few minutes of GPU time (a first run with
repeated names, where only the (name, item) pair identifies a fact, reached 3% after 150 s).
Values are 1..49, so sums stay below 100 and differences are >= 0.

Usage (from the repo root):
    python -m scripts.make_task_data            # writes configs/lm_eval/tiny_arith/{train,test}.jsonl
    python -m scripts.make_task_data --tokenizer configs/models/tiny-deepseek-v3
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from pathlib import Path

NAMES = ("Mia", "Leo", "Ava", "Sam", "Zoe", "Max", "Ivy", "Ben",
         "Eva", "Tom", "Amy", "Jay", "Lily", "Noah", "Emma", "Owen")
ITEMS = ("apples", "pens", "books", "cards", "coins", "shells", "stamps", "marbles",
         "cookies", "stickers", "rocks", "buttons", "keys", "cups", "hats", "toys")
MIN_FACTS, MAX_FACTS = 8, 12
MAX_VALUE = 49

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
PAD = "<｜▁pad▁｜>"
SPECIAL_TOKENS = (BOS, EOS, PAD, USER, ASSISTANT)  # ids 0..4: BOS=0, EOS=1 as in DeepSeek

# The test split and the few-shot pool use fixed seeds apart from any training stream seed.
TEST_SEED, TRAIN_SEED = 20240601, 20240602
NUM_TEST, NUM_TRAIN = 200, 2000

# DeepSeek-style template: BOS, optional system text, then <｜User｜>/<｜Assistant｜> turns.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)

logger = logging.getLogger(__name__)


def make_facts(rng: random.Random, num_facts: int) -> list[tuple[str, int, str]]:
    """`num_facts` (name, value, item) facts, each name once, values 1..MAX_VALUE."""
    names = rng.sample(NAMES, num_facts)
    items = [rng.choice(ITEMS) for _ in names]  # draw order kept: the committed data depends on it
    return [(name, rng.randint(1, MAX_VALUE), item) for name, item in zip(names, items)]


def fact_text(fact: tuple[str, int, str]) -> str:
    """'Mia has 7 apples.'"""
    return f"{fact[0]} has {fact[1]} {fact[2]}."


def make_example(rng: random.Random, min_facts: int = MIN_FACTS, max_facts: int = MAX_FACTS) -> dict:
    """One task item: {'question': str, 'answer': str} with the answer ending in '#### N'."""
    if not 2 <= min_facts <= max_facts <= len(NAMES):
        raise ValueError(f"need 2 <= min_facts <= max_facts <= {len(NAMES)}, got {min_facts}, {max_facts}")
    facts = make_facts(rng, rng.randint(min_facts, max_facts))
    a, b = rng.sample(range(len(facts)), 2)
    op = rng.choice("+-")
    if op == "-" and facts[a][1] < facts[b][1]:
        a, b = b, a
    (na, va, ia), (nb, vb, ib) = facts[a], facts[b]
    result = va + vb if op == "+" else va - vb
    word = "plus" if op == "+" else "minus"
    question = " ".join(fact_text(f) for f in facts) + f" How many are {na}'s {ia} {word} {nb}'s {ib}?"
    answer = f"{fact_text(facts[a])} {fact_text(facts[b])} {va} {op} {vb} = {result}.\n#### {result}"
    return {"question": question, "answer": answer}


def make_split(seed: int, count: int) -> list[dict]:
    """A deterministic list of `count` items from `seed`."""
    rng = random.Random(seed)
    return [make_example(rng) for _ in range(count)]


def format_shot(doc: dict) -> str:
    """One solved example exactly as lm_eval's gsm8k-style task renders a few-shot example."""
    return f"Question: {doc['question']}\nAnswer: {doc['answer']}"


def format_prompt(shots: list[dict], doc: dict) -> str:
    """The k-shot prompt for `doc` (lm_eval: shots joined by '\\n\\n', then 'Question: ...\\nAnswer:')."""
    parts = [format_shot(s) for s in shots] + [f"Question: {doc['question']}\nAnswer:"]
    return "\n\n".join(parts)


def answer_number(text: str) -> str | None:
    """The '#### N' number of a generated answer (lm_eval strict-match regex), or None."""
    import re

    match = re.search(r"#### (\-?[0-9\.\,]+)", text)
    return match.group(1) if match else None


def write_jsonl(path: Path, docs: list[dict]) -> None:
    """Write one JSON object per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    """Read one JSON object per line."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def build_tokenizer(out_dir: Path, vocab_size: int = 1024, corpus_items: int = 20000) -> None:
    """Train a byte-level BPE on task text and save it as a transformers tokenizer in `out_dir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(12345)
    corpus = [format_shot(make_example(rng)) + "\n\n" for _ in range(corpus_items)]
    # Every number the task can print, so each of " 0".." 99" becomes one token.
    corpus += [" ".join(str(n) for n in range(100)) + f" = {n}." for n in range(100)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # String prompts start with BOS (DeepSeek's add_bos_token=True); no EOS is appended.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        add_bos_token=True, add_eos_token=False, model_max_length=2048,
        clean_up_tokenization_spaces=False, chat_template=CHAT_TEMPLATE)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    # Portable tokenizer_config: a class every transformers 4.x/5.x knows, the template inline.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg.pop("backend", None)
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", add_bos_token=True, add_eos_token=False,
               chat_template=CHAT_TEMPLATE)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)
    single = [n for n in range(100) if len(tok.encode(f" {n}", add_special_tokens=False).ids) != 1]
    if single:
        raise ValueError(f"numbers not single tokens: {single}")
    logger.info("tokenizer: %d tokens -> %s", tok.get_vocab_size(), out_dir)


def main() -> None:
    """Write the task's train/test jsonl (and optionally the tokenizer)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path("configs/lm_eval/tiny_arith"),
                        help="folder for train.jsonl and test.jsonl")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="also train the BPE tokenizer and save it to this folder")
    parser.add_argument("--vocab-size", type=int, default=1024, help="BPE vocabulary size cap")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    write_jsonl(args.out_dir / "test.jsonl", make_split(TEST_SEED, NUM_TEST))
    write_jsonl(args.out_dir / "train.jsonl", make_split(TRAIN_SEED, NUM_TRAIN))
    logger.info("wrote %d test and %d train items to %s", NUM_TEST, NUM_TRAIN, args.out_dir)
    if args.tokenizer is not None:
        build_tokenizer(args.tokenizer, args.vocab_size)


if __name__ == "__main__":
    main()
