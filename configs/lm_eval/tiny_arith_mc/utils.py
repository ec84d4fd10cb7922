"""tiny_arith_mc's choices: the test answer and three with a wrong result (off by 1 and by 10), in
an order fixed by the question's text, so that lm_eval scores the task by loglikelihood."""

import hashlib
import random
import re


def _with_result(answer: str, old: int, new: int) -> str:
    """The answer's worked line and final line with `new` as the result."""
    return re.sub(rf"= {old}\.\n#### {old}$", f"= {new}.\n#### {new}", answer)


def process_docs(dataset):
    def add_choices(doc):
        result = int(doc["answer"].rsplit("#### ", 1)[1])
        wrong = [w for w in (result + 1, result - 1, result + 10, result - 10, result + 2) if w >= 0][:3]
        choices = [doc["answer"]] + [_with_result(doc["answer"], result, w) for w in wrong]
        order = list(range(4))
        random.Random(hashlib.sha256(doc["question"].encode()).digest()).shuffle(order)
        return {"choices": [choices[i] for i in order], "label": order.index(0)}
    return dataset.map(add_choices)
