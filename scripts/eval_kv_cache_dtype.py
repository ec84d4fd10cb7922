"""Accuracy of the bundled tiny model with each --kv-cache-dtype: its tiny_arith task and the
log-probability error against the full-precision cache. CPU, fp32 compute, greedy.

The task as configs/lm_eval/tiny_arith/tiny_arith.yaml states it: 5-shot "Question: ...\\nAnswer:"
prompts joined by blank lines, generation until "Question:", strict match of the number after
"####". The shots are the first five train items (lm_eval draws them at random; fixed here so every
cache dtype sees the same prompts). Log-probabilities: the gold answer's tokens after the zero-shot
prompt (lm_eval's loglikelihood request), teacher-forced.

Prefill runs in chunks of --budget tokens, so every chunk after the first and every decode step read
the earlier tokens from the cache (a chunk attends over its own new rows as the cache holds them
too, attention/mla.py, so the budget changes the figures only by the order of the sums).

    python -m scripts.eval_kv_cache_dtype [--limit 200] [--budget 16]
"""

from __future__ import annotations

import argparse
import json
import re
import time

from scripts.make_task_data import read_jsonl

TEST = "configs/lm_eval/tiny_arith/test.jsonl"
TRAIN = "configs/lm_eval/tiny_arith/train.jsonl"


def strict_answer(text: str) -> str | None:
    m = re.search(r"#### (\-?[0-9\.\,]+)", text)
    return m.group(1).replace(",", "").rstrip(".") if m else None


def main() -> None:
    from engine import LLM, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=200, help="test items")
    ap.add_argument("--budget", type=int, default=16, help="--max-num-batched-tokens (prefill chunk)")
    ap.add_argument("--dtypes", default="auto,bf16,fp8", help="cache dtypes; the first is the reference")
    ap.add_argument("--out", default=None, help="also write the figures as JSON here")
    args = ap.parse_args()
    test = read_jsonl(TEST)[: args.limit]
    shots = "\n\n".join(f"Question: {d['question']}\nAnswer: {d['answer']}" for d in read_jsonl(TRAIN)[:5])
    gen_prompts = [f"{shots}\n\nQuestion: {d['question']}\nAnswer:" for d in test]
    gold = [d["answer"].split("####")[-1].strip() for d in test]
    gen = SamplingParams(temperature=0, max_tokens=64, stop=["Question:"])
    ll = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)

    results, ref = {}, None
    for name in args.dtypes.split(","):
        t0 = time.time()
        llm = LLM(device="cpu", dtype="float32", kv_cache_dtype=name, max_num_batched_tokens=args.budget)
        outs = llm.generate(gen_prompts, gen)
        texts = [o.outputs[0].text for o in outs]
        tokens = [o.outputs[0].token_ids for o in outs]
        right = sum(strict_answer(t) == g for t, g in zip(texts, gold))
        # answer log-likelihood: the logprobs of the prompt tokens after "Answer:"
        full = [f"Question: {d['question']}\nAnswer: {d['answer']}" for d in test]
        lp_outs = llm.generate(full, ll)
        n_ctx = [len(o.prompt_token_ids) for o in llm.generate([f"Question: {d['question']}\nAnswer:" for d in test],
                                                               SamplingParams(max_tokens=1))]
        answer_lps = [[e.logprob for e in o.prompt_logprobs[n:]] for o, n in zip(lp_outs, n_ctx)]
        prompt_lps = [[e.logprob for e in o.prompt_logprobs[1:]] for o in lp_outs]
        r = dict(accuracy=right / len(test), right=right, items=len(test), seconds=round(time.time() - t0, 1))
        if ref is None:
            ref = dict(tokens=tokens, lps=answer_lps, prompt=prompt_lps)
        else:
            every = [abs(a - b) for xs, ys in zip(prompt_lps, ref["prompt"]) for a, b in zip(xs, ys)]
            diffs = [abs(a - b) for xs, ys in zip(answer_lps, ref["lps"]) for a, b in zip(xs, ys)]
            seq = [abs(sum(xs) - sum(ys)) for xs, ys in zip(answer_lps, ref["lps"])]
            r.update(same_greedy=sum(a == b for a, b in zip(tokens, ref["tokens"])),
                     token_lp_abs_err_mean=sum(diffs) / len(diffs), token_lp_abs_err_max=max(diffs),
                     answer_lp_abs_err_mean=sum(seq) / len(seq), answer_tokens=len(diffs),
                     prompt_lp_abs_err_mean=sum(every) / len(every), prompt_lp_abs_err_max=max(every),
                     prompt_tokens=len(every))
        results[name] = r
        print(name, json.dumps(r), flush=True)
        del llm
    names = list(results)
    print(f"\n{'cache':6s} {'accuracy':>9s} {'same greedy':>12s} {'answer |dlogp| mean/token':>26s} {'max':>8s} "
          f"{'mean/answer':>12s} {'prompt |dlogp| mean/token':>26s} {'max':>8s}")
    for n in names:
        r = results[n]
        extra = (f"{r['same_greedy']:>8d}/{r['items']:<3d} {r['token_lp_abs_err_mean']:26.2e} "
                 f"{r['token_lp_abs_err_max']:8.2e} {r['answer_lp_abs_err_mean']:12.2e} "
                 f"{r['prompt_lp_abs_err_mean']:26.2e} {r['prompt_lp_abs_err_max']:8.2e}" if "same_greedy" in r
                 else f"{'(reference)':>12s}")
        print(f"{n:6s} {r['accuracy']:9.3f} {extra}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
