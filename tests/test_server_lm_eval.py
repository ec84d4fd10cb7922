"""End to end: `lm_eval --model local-completions` against a live `serve`, chunked vs unchunked.

The same lm_eval run (the local GSM8K-format task, generate_until, plus a loglikelihood variant
that drives echo + logprobs, and the multiple-choice tiny_arith_mc, 5-shot with one preamble for
every question) goes against a server with the default token budget, one with
`--max-num-batched-tokens 16`, where every prompt is prefilled in chunks, and the generations and
the multiple-choice task also against one with ngram speculative decoding and without prefix
caching, which computes every prompt whole. Per-sample outputs must agree: the greedy generations
exactly, the loglikelihoods to float32 rounding; the cached servers take most of the
multiple-choice prompts' tokens from the prefix cache (scheduler/logprob_records.py).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import transformers

from tests.server_fixtures import OFFLINE_ENV, REPO, TINY_MODEL, ServeProcess, tiny_model_dir

pytestmark = pytest.mark.slow

API_KEY = "lm-eval-key"
MAX_MODEL_LEN = 1024
CHUNK_BUDGET = 16
LIMIT = 8
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'

LOGLIKELIHOOD_TASK = """\
task: tiny_arith_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: configs/lm_eval/tiny_arith/test.jsonl
output_type: loglikelihood
test_split: test
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_target: " {{answer}}"
metric_list:
  - metric: acc
num_fewshot: 0
"""


ALL_TASKS = ("tiny_arith", "tiny_arith_ll", "tiny_arith_mc")
# `lm_eval ...` with its task index limited to --include_path (the tasks run here): indexing the
# thousands of task configs lm_eval ships took ~7 s of every run
LM_EVAL = ("import runpy; from lm_eval.tasks.manager import TaskManager; init = TaskManager.__init__; "
           "TaskManager.__init__ = lambda self, *a, **k: init(self, *a, **{'include_defaults': False, **k}); "
           "runpy.run_module('lm_eval', run_name='__main__', alter_sys=True)")


def run_lm_eval(url: str, out: Path, ll_task: Path, names: tuple[str, ...] = ALL_TASKS) -> dict[str, list[dict]]:
    """One lm_eval run of the tasks `names`; returns {task: samples sorted by doc_id}."""
    model_args = (f"base_url={url}/v1/completions,model=tiny,num_concurrent=8,"
                  f"max_length={MAX_MODEL_LEN},max_retries=1")
    tasks = [str(ll_task) if t == "tiny_arith_ll" else t for t in names]
    cmd = [sys.executable, "-c", LM_EVAL, "run", "--model", "local-completions",
           "--model_args", model_args, "--tasks", ",".join(tasks),
           "--include_path", "configs/lm_eval", "--limit", str(LIMIT),
           "--gen_kwargs", "max_gen_toks=48", "--log_samples", "--output_path", str(out)]
    env = {**os.environ, **OFFLINE_ENV, "OPENAI_API_KEY": API_KEY}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    samples = {}
    for task in names:
        (path,) = glob.glob(str(out / "*" / f"samples_{task}_2*.jsonl"))
        rows = [json.loads(line) for line in open(path)]
        samples[task] = sorted(rows, key=lambda r: (r["doc_id"], r.get("filter", "")))
    return samples


def serve_and_evaluate(model: str, out: Path, ll_task: Path, extra: list[str],
                       names: tuple[str, ...]) -> tuple[dict[str, list[dict]], float]:
    """`serve` with the flags `extra`, one lm_eval run of `names` against it: (samples, the
    server's prefix-cache hits)."""
    with ServeProcess("--model", model, "--served-model-name", "tiny", "--device", "cpu",
                      "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
                      "--num-kv-blocks", "1024", "--api-key", API_KEY, *extra) as server:
        samples = run_lm_eval(server.url, out, ll_task, names)
        metrics = httpx.get(f"{server.url}/metrics").text
    return samples, float(next(line.split()[-1] for line in metrics.splitlines()
                               if line.startswith("mla_serve_prefix_cache_hits_total")))


def test_lm_eval_outputs_equal_with_every_prompt_chunked(tmp_path_factory, tmp_path):
    model = tiny_model_dir(tmp_path_factory)
    ll_task = tmp_path / "tiny_arith_ll.yaml"
    ll_task.write_text(LOGLIKELIHOOD_TASK)
    # speculation drafts only where tokens are generated (the scoring tasks' requests sample one
    # hidden token and never draft), so one server without the prefix cache is both the
    # multiple-choice task's reference and the ngram run (speculation with prefix-cache hits:
    # test_spec_decode.py::test_greedy_with_speculation_under_preemption_and_prefix_hits)
    configs = (("default", [], ALL_TASKS),
               ("chunked", ["--max-num-batched-tokens", str(CHUNK_BUDGET)], ALL_TASKS),
               ("ngram no cache", ["--speculative-config", NGRAM, "--no-enable-prefix-caching"],
                ("tiny_arith", "tiny_arith_mc")))
    # the three servers, each with its lm_eval run, side by side: a run is its client and its
    # server taking turns, and start-up is one process at a time, so one alone leaves a core idle
    with ThreadPoolExecutor(len(configs)) as pool:
        futures = {name: pool.submit(serve_and_evaluate, model, tmp_path / name, ll_task, extra, names)
                   for name, extra, names in configs}
    runs = {name: f.result()[0] for name, f in futures.items()}
    hits = {name: f.result()[1] for name, f in futures.items()}

    tok = transformers.AutoTokenizer.from_pretrained(TINY_MODEL)
    gen_a, gen_b = runs["default"]["tiny_arith"], runs["chunked"]["tiny_arith"]
    assert len(gen_a) == len(gen_b) >= LIMIT
    for a, b in zip(gen_a, gen_b):
        assert a["doc_id"] == b["doc_id"]
        context = a["arguments"]["gen_args_0"]["arg_0"]
        assert len(tok(context)["input_ids"]) > CHUNK_BUDGET  # really chunked
        assert a["resps"] == b["resps"], f"doc {a['doc_id']}: generations differ"
        assert a["resps"][0][0], "empty generation"
    for a, b in zip(gen_a, runs["ngram no cache"]["tiny_arith"]):  # drafts verified: the same generations
        assert a["resps"] == b["resps"], f"doc {a['doc_id']}: generations differ with speculation"
    ll_a, ll_b = runs["default"]["tiny_arith_ll"], runs["chunked"]["tiny_arith_ll"]
    assert len(ll_a) == len(ll_b) == LIMIT
    for a, b in zip(ll_a, ll_b):
        (la, ga), (lb, gb) = a["resps"][0][0], b["resps"][0][0]
        assert float(la) < 0 and abs(float(la) - float(lb)) < 1e-3 and ga == gb, (a, b)
    # multiple choice: 4 loglikelihood requests a question, one few-shot preamble for all of them;
    # the same scores from the prefix cache as computed whole, and the task solved
    whole = runs["ngram no cache"]["tiny_arith_mc"]
    assert len(whole) == LIMIT and hits["ngram no cache"] == 0
    for name in ("default", "chunked"):
        got = runs[name]["tiny_arith_mc"]
        assert [r["doc_id"] for r in got] == [r["doc_id"] for r in whole]
        for a, b in zip(got, whole):
            scores_a, scores_b = ([float(x[0][0]) for x in r["resps"]] for r in (a, b))
            assert max(abs(x - y) for x, y in zip(scores_a, scores_b)) < 1e-3, (name, a["doc_id"])
            assert a["acc"] == b["acc"] == 1.0, (name, a["doc_id"])
        # 32 multiple-choice prompts of ~600 tokens share one preamble: 15k tokens came from the
        # cache (CPU, fp32). The other tasks' 16 prompts hold under 6k tokens in all, so this many
        # hits needs the multiple-choice requests' prompt logprobs to have come from it too.
        assert hits[name] > 10_000, (name, hits)
