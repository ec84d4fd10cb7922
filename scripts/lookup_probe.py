"""Probe: does a tiny_arith model look facts up by name? (teacher-forced, CPU or CUDA)

For random fact lists followed by "Recall:" and the same facts shuffled, report how often the
argmax at each value position is (a) the value of the named person, (b) some other value of the
list, (c) neither. Keyed lookup is what the task's answers need; (b) means the model copies a
value from the context without binding it to the name.

    python -m scripts.lookup_probe MODEL_DIR [--facts 8] [--lists 64]
"""

from __future__ import annotations

import argparse
import random

import torch

from scripts.make_task_data import fact_text, make_facts


@torch.no_grad()
def probe(model, tokenizer, num_facts: int, lists: int, seed: int = 7) -> dict[str, float]:
    """Fractions of value positions predicted keyed / from-list / other."""
    rng = random.Random(seed)
    device = next(model.parameters()).device
    counts = {"keyed": 0, "other_value_in_list": 0, "neither": 0}
    for _ in range(lists):
        facts = make_facts(rng, num_facts)
        head = " ".join(fact_text(f) for f in facts) + "\nRecall:"
        order = rng.sample(facts, len(facts))
        text, value_spans = head, []
        for name, value, item in order:
            text += f" {name} has"
            value_spans.append((len(text), value))
            text += f" {value} {item}."
        enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=True)
        ids = torch.tensor([enc["input_ids"]], device=device)
        pred = model(input_ids=ids).logits[0].argmax(-1).tolist()
        starts = [s for s, _ in enc["offset_mapping"]]
        values = {v for _, v, _ in facts}
        for pos_char, value in value_spans:
            tok = starts.index(pos_char)  # token that starts with " <value>"
            got = tokenizer.decode([pred[tok - 1]]).strip()
            if got == str(value):
                counts["keyed"] += 1
            elif got.isdigit() and int(got) in values:
                counts["other_value_in_list"] += 1
            else:
                counts["neither"] += 1
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--facts", type=int, default=8)
    p.add_argument("--lists", type=int, default=64)
    a = p.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(a.model)
    print({k: round(v, 3) for k, v in probe(model, tok, a.facts, a.lists).items()})


if __name__ == "__main__":
    main()
