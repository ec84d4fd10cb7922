"""lm_eval's loglikelihood workload offline: prompt logprobs with prefix caching on (the records of
scheduler/logprob_records.py let these requests use the cache) and off (every prompt computed
whole, as vLLM serves such requests).

The requests are MMLU-like by default: `--subjects` subjects, each with a few-shot preamble of
`--preamble` random tokens; `--questions` questions per subject, each `--question` tokens; per
question `--choices` requests of context (preamble + question) and a `--choice-len`-token
continuation, all with prompt_logprobs=1 and max_tokens=1, as lm_eval's local-completions sends
them (echo, logprobs 1, one hidden token). `--hellaswag` adds a HellaSwag-like zero-shot task
(no preamble, 80-token contexts, 20-token continuations), where only each question's choices
share their context, run in the same engines. Each task's requests go to one `LLM.generate`
(shuffled: lm_eval orders by length, not by question), after a reset of the prefix cache; the
wall time, req/s and prompt tokens computed are printed for each setting, and the two settings'
prompt logprobs compared (largest absolute difference; equal ranks and alternatives counted).
`--control`: with caching off the requests run again in reverse order (other batches), and once
more with each prompt cut into two chunks where "on" cuts it (`long_prefill_token_threshold` set
to its cache hit, so that the second chunk attends to the first through the cache: a prefix hit's
math without the cache), each compared with "off" the same way.

`--mode http` (or `both`, offline first): the same requests through `serve` (started here with the
same engine flags) as lm_eval's local-completions sends them: one POST /v1/completions a request
with its payload (`prompt: [[ids]]`, echo, logprobs 1, max_tokens 1), at most `--concurrency`
(lm_eval's num_concurrent) in flight on kept-alive aiohttp connections, lm_eval's client. Its
token_logprobs are compared with the offline run's where both ran. The server needs a tokenizer
to name every echoed token, as it would with a real model: `--synthetic-tokenizer` gives a
checkpoint without one (the V2-Lite config) a word-level tokenizer of the model's vocabulary size.

    python scripts/bench_loglikelihood.py [--model DIR] [--load-format dummy] [--subjects 8 ...]
    python scripts/bench_loglikelihood.py --mode both --settings on --synthetic-tokenizer --hellaswag
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench_common import add_engine_flags, engine_kwargs, environment, write_json

REPO = Path(__file__).resolve().parent.parent


def workload(a, vocab: int) -> list[list[int]]:
    r = random.Random(a.seed)

    def rand(n):
        return [r.randrange(100, vocab - 100) for _ in range(n)]
    prompts = []
    for _ in range(a.subjects):
        preamble = rand(a.preamble)
        for _ in range(a.questions):
            context = preamble + rand(a.question)
            prompts += [context + rand(a.choice_len) for _ in range(a.choices)]
    r.shuffle(prompts)
    return prompts


def synthetic_tokenizer(vocab: int, out: Path) -> Path:
    """A word-level tokenizer of `vocab` tokens "w0".."w{vocab-1}" saved in `out`: per-token names
    of a real vocabulary's length and a prompt decode of one string a token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w1", bos_token="w0").save_pretrained(out)
    return out


async def _score(url: str, prompts: list[list[int]], concurrency: int) -> tuple[float, list[list]]:
    """lm_eval's loglikelihood requests (local-completions, batch size 1); (seconds, each
    request's token_logprobs)."""
    import aiohttp
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency),
                                     timeout=aiohttp.ClientTimeout(total=3600)) as http:
        async with http.get(f"{url}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]

        async def one(p: list[int]) -> list:
            body = {"model": model, "prompt": [p], "temperature": 0, "max_tokens": 1, "logprobs": 1,
                    "seed": 1234, "echo": True}
            async with sem, http.post(f"{url}/v1/completions", json=body) as r:
                got = await r.read()
                if r.status != 200:
                    raise SystemExit(f"HTTP {r.status}: {got[:300]!r}")
                return json.loads(got)["choices"][0]["logprobs"]["token_logprobs"]
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - t0, outs


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"vllm:{name}_total"))


def _thread_cpu_s(pid: int) -> float:
    """CPU seconds of a process's main thread (its event loop, for `serve`), from /proc."""
    import os
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _loop_pids(pid: int) -> list[int]:
    """The HTTP processes of `serve` (pid): itself, or under --api-server-count N its N API server
    children (its spawned children but the first, the engine core)."""
    children = sorted(int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
                      if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes())
    return children[1:] if len(children) > 1 else [pid]


def _record(results: dict, key: str, row: dict) -> None:
    """A rep's row; with --reps, the fastest rep's row with every rep's req/s beside it."""
    reps = results.get(key, {}).get("reps_req_per_s", []) + [row["req_per_s"]]
    if key not in results or row["req_per_s"] >= results[key]["req_per_s"]:
        results[key] = row
    results[key]["reps_req_per_s"] = reps


def run_http(a, tasks: dict, vocab_of, results: dict, got: dict) -> None:
    """Each setting's server, each task's requests through it (after /reset_prefix_cache)."""
    from bench_common import free_port, stop_server, wait_healthy
    from bench_http_vs_offline import engine_argv
    tok_args = []
    if a.synthetic_tokenizer:
        vocab = vocab_of()
        tok_args = ["--tokenizer", str(synthetic_tokenizer(vocab, Path(tempfile.mkdtemp(prefix="ll_tok_"))))]
    for setting in a.settings:
        a.enable_prefix_caching = setting == "on"
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = Path(tempfile.mkdtemp(prefix="ll_serve_")) / "serve.log"
        cmd = [sys.executable, "-m", "server", *engine_argv(a, serve=True), "--port", str(port), *tok_args,
               *(["--device", a.device] if a.device != "auto" else []), *a.serve_arg]
        print("+", " ".join(cmd), flush=True)
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
            try:
                wait_healthy(proc, url, 1800, log)
                vocab = vocab_of()
                asyncio.run(_score(url, workload(argparse.Namespace(**{**vars(a), "seed": a.seed + 1, "subjects": 1,
                                                                      "questions": 2}), vocab), a.concurrency))
                for task, t in tasks.items():
                    prompts = workload(t, vocab)
                    for _ in range(a.reps):
                        urllib.request.urlopen(urllib.request.Request(f"{url}/reset_prefix_cache", method="POST"))
                        loops = _loop_pids(proc.pid)
                        hits, cpu = _metric(url, "prefix_cache_hits"), [_thread_cpu_s(p) for p in loops]
                        client_cpu = time.process_time()
                        dt, outs = asyncio.run(_score(url, prompts, a.concurrency))
                        client_cpu = (time.process_time() - client_cpu) / dt
                        busy = max((_thread_cpu_s(p) - c) / dt for p, c in zip(loops, cpu))
                        total = sum(map(len, prompts))
                        computed = total - (_metric(url, "prefix_cache_hits") - hits)
                        _record(results, f"{task} http {setting}", dict(
                            seconds=dt, req_per_s=len(prompts) / dt, prompt_tokens=total,
                            computed_prompt_tokens=computed, event_loop_busy=busy, client_cpu=client_cpu))
                        print(f"{task}, HTTP, prefix caching {setting}: {len(prompts)} requests at most "
                              f"{a.concurrency} at once, {computed:.0f} of {total} prompt tokens computed: {dt:.2f} s, "
                              f"{len(prompts) / dt:.1f} req/s; the server's event-loop thread busy {100 * busy:.0f}% "
                              f"of it (the busiest of {len(loops)}); this client's CPU {100 * client_cpu:.0f}%",
                              flush=True)
                    got.setdefault(task, {})[f"http {setting}"] = outs
            finally:
                stop_server(proc, 120)


def run_offline(a, tasks: dict, results: dict, got: dict) -> None:
    """Each setting's engine (LLM), each task's requests through one LLM.generate."""
    from engine import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    for setting in a.settings:
        a.enable_prefix_caching = setting == "on"
        llm = LLM(**engine_kwargs(a), device=a.device)
        vocab = llm.engine.cfg.vocab_size
        llm.generate(workload(argparse.Namespace(**{**vars(a), "seed": a.seed + 1, "subjects": 1, "questions": 2}),
                              vocab), params)  # warm-up on other tokens
        for task, t in tasks.items():
            prompts = workload(t, vocab)
            for _ in range(a.reps):
                llm.reset_prefix_cache()
                before = llm.scheduler.stats
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params)
                dt = time.perf_counter() - t0
                total = sum(map(len, prompts))
                computed = total - (llm.scheduler.stats.prefix_cache_hits - before.prefix_cache_hits)
                _record(results, f"{task} {setting}", dict(seconds=dt, req_per_s=len(prompts) / dt,
                                                           prompt_tokens=total, computed_prompt_tokens=computed))
                print(f"{task}, prefix caching {setting}: {len(prompts)} requests, {total} prompt tokens, {computed} "
                      f"computed ({100 * computed / total:.1f}%): {dt:.2f} s, {len(prompts) / dt:.1f} req/s", flush=True)
            got.setdefault(task, {})[setting] = [o.prompt_logprobs for o in outs]
            if setting == "off" and a.control:
                # the same requests in reverse order: other batches, the same math
                again = llm.generate(prompts[::-1], params)[::-1]
                got[task]["off, reversed"] = [o.prompt_logprobs for o in again]
                # each prompt in two chunks split where "on" splits it (its cache hit: all but
                # the last full block of its context), the second attending to the first through
                # the cache: the math of a prefix hit, without the cache
                tpb = llm.scheduler.block_manager.tokens_per_block
                cfg = llm.scheduler.config
                keep, cfg.long_prefill_token_threshold = cfg.long_prefill_token_threshold, \
                    ((t.preamble + t.question) // tpb - 1) * tpb
                chunked = llm.generate(prompts, params)
                cfg.long_prefill_token_threshold = keep
                got[task]["off, chunked there"] = [o.prompt_logprobs for o in chunked]
        del llm


def _value(e) -> float:
    """A token's logprob from an engine entry (TokenLogprobs) or an HTTP answer (a float)."""
    return e if isinstance(e, float) else e.logprob


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(p)
    p.add_argument("--subjects", type=int, default=8)
    p.add_argument("--questions", type=int, default=32)
    p.add_argument("--choices", type=int, default=4)
    p.add_argument("--preamble", type=int, default=500, help="few-shot tokens shared by a subject's questions")
    p.add_argument("--question", type=int, default=80)
    p.add_argument("--choice-len", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--settings", nargs="+", default=["on", "off"], choices=["on", "off"],
                   help="prefix caching on / off, in this order, each in an engine of its own")
    p.add_argument("--hellaswag", action="store_true", help="also a HellaSwag-like zero-shot task")
    p.add_argument("--mode", choices=["offline", "http", "both"], default="offline",
                   help="LLM.generate in this process, `serve` and lm_eval's requests over HTTP, or both")
    p.add_argument("--concurrency", type=int, default=256, help="HTTP: requests in flight (lm_eval's num_concurrent)")
    p.add_argument("--synthetic-tokenizer", action="store_true",
                   help="HTTP: serve with a word-level tokenizer of the model's vocabulary size (--tokenizer)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="HTTP: an extra flag for `serve` alone, e.g. --serve-arg=--event-loop=asyncio")
    p.add_argument("--reps", type=int, default=1, help="each task this many times in each engine or server")
    p.add_argument("--control", action="store_true",
                   help="with caching off, the requests again in reverse order: how far batching alone moves them")
    a = p.parse_args()
    if Path(a.model).exists():
        a.model = str(Path(a.model).resolve())  # `serve` runs in the repository's root
    tasks = {"mmlu-like": a}
    if a.hellaswag:
        tasks["hellaswag-like"] = argparse.Namespace(**{**vars(a), "subjects": 1, "preamble": 0, "question": 80,
                                                        "choice_len": 20, "questions": a.subjects * a.questions})
    results: dict = {}
    got: dict = {}
    if a.mode in ("http", "both"):  # first: the offline engines would keep this process's GPU memory
        run_http(a, tasks, lambda: json.loads((Path(a.model) / "config.json").read_text())["vocab_size"],
                 results, got)
    if a.mode in ("offline", "both"):
        run_offline(a, tasks, results, got)
    for task, by in got.items():
        for x, y in (("on", "off"), ("off, reversed", "off"), ("off, chunked there", "off"),
                     ("http on", "on"), ("http off", "off"), ("http on", "http off")):
            if x not in by or y not in by:
                continue
            pairs = [(u, v) for lx, ly in zip(by[x], by[y]) for u, v in zip(lx[1:], ly[1:])]
            diffs = sorted(abs(_value(u) - _value(v)) for u, v in pairs)
            row = dict(max_abs_logprob_diff=diffs[-1], p99_abs_logprob_diff=diffs[int(0.99 * (len(diffs) - 1))],
                       tokens=len(pairs))
            same = ""
            if not x.startswith("http") and not y.startswith("http"):  # HTTP answers carry values only
                row["same_rank_and_top"] = sum((u.rank, u.top[0][0]) == (v.rank, v.top[0][0]) for u, v in pairs)
                same = f"; rank and top alternative equal at {row['same_rank_and_top']} of {len(pairs)} tokens"
            if x == "on":
                row["speedup"] = results[f"{task} off"]["seconds"] / results[f"{task} on"]["seconds"]
                print(f"{task}: on against off {row['speedup']:.2f}x")
            if x.startswith("http") and y in ("on", "off"):
                row["http_over_offline"] = results[f"{task} {x}"]["req_per_s"] / results[f"{task} {y}"]["req_per_s"]
                print(f"{task}: HTTP against offline, prefix caching {y}: {row['http_over_offline']:.3f} of its req/s")
            results[f"{task} {x} against {y}"] = row
            print(f"{task}: prompt logprobs, {x} against {y}: |difference| largest {diffs[-1]:.3g}, 99th percentile "
                  f"{row['p99_abs_logprob_diff']:.3g}{same}")
    write_json(a.json, {"env": environment(), "args": vars(a), "results": results})


if __name__ == "__main__":
    main()
