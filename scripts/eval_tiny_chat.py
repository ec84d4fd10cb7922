"""The bundled tiny model through our engine: zero-shot completions and chat (DeepSeek template).

Greedy, CPU fp32, the first N test items of configs/lm_eval/tiny_arith; an answer is right when
the number after '####' is the gold one. Three ways of asking:
  zeroshot  completion of "Question: ...\\nAnswer:" (no shots)
  chat_qa   chat, the user message being "Question: ...\\nAnswer:" (how chat turns were trained)
  chat_q    chat, the bare question

    python -m scripts.eval_tiny_chat [--limit 100]
"""

from __future__ import annotations

import argparse
import re

from scripts.make_task_data import read_jsonl

DATA = "configs/lm_eval/tiny_arith/test.jsonl"


def answer(text: str) -> str | None:
    m = re.search(r"#### (\d+)", text)
    return m.group(1) if m else None


def main() -> None:
    from transformers import AutoTokenizer

    from engine import LLM, SamplingParams
    from common.args import DEFAULT_MODEL

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=100, help="test items")
    test = read_jsonl(DATA)[:ap.parse_args().limit]
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    llm = LLM(device="cpu", dtype="float32")

    def chat(content: str) -> str:
        return tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                       add_generation_prompt=True)

    asks = {"zeroshot": lambda q: f"Question: {q}\nAnswer:",
            "chat_qa": lambda q: chat(f"Question: {q}\nAnswer:"),
            "chat_q": chat}
    params = SamplingParams(temperature=0, max_tokens=60, stop=["Question:"])
    for mode, ask in asks.items():
        outs = llm.generate([ask(d["question"]) for d in test], params)
        ok = sum(answer(o.outputs[0].text) == d["answer"].split("####")[-1].strip() for o, d in zip(outs, test))
        print(f"{mode:9s} {ok}/{len(test)} right; first: {outs[0].outputs[0].text[:70]!r}")


if __name__ == "__main__":
    main()
