"""Speculative decoding on one GPU: what a decode step of 1 + k query tokens costs against one
of 1 token, and end-to-end time per output token with and without ngram speculation.

  # step cost: model forward of B decodes x q_len tokens after 1k cached tokens, CUDA graphs
  python scripts/bench_spec_decode.py step --batch-sizes 1 2 4 8 16 32 64 --q-lens 1 2 3 4 5
  # end to end: a repetitive prompt, batch 1, greedy, with and without ngram drafts
  python scripts/bench_spec_decode.py e2e --batch-sizes 1 8 --num-speculative-tokens 3
  # MTP drafts on a V3-shaped model with few layers (dummy weights: its MTP layer is random too,
  # so this times the cost; acceptance needs a real checkpoint)
  python scripts/bench_spec_decode.py e2e --method mtp --num-speculative-tokens 1 --batch-sizes 1 \
      --model configs/models/DeepSeek-V3 --hf-overrides '{"num_hidden_layers": 4}'

`step` builds the engine once (V2-Lite config, dummy bf16 weights by default), captures one CUDA
graph per (batch, q_len) and times replays of the whole model forward (no sampling) with
CUDA events: a step that verifies k drafts pays off when the mean acceptance length exceeds
its cost ratio to a q_len 1 step (printed as `break-even`). `e2e` runs each configuration in
its own engine (one after the other in this process) and reports ms per output token, tokens
per step and the drafts' acceptance; with random weights the acceptance says little about a
real model, so pass `--model DIR --load-format auto` for a checkpoint.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from bench_common import add_engine_flags, engine_kwargs, environment, random_prompts, write_json

from engine import LLM, SamplingParams


def bench_step(a) -> list[dict]:
    from engine.cuda_graph import DecodeGraphs
    kw = engine_kwargs(a) | {"enforce_eager": True}  # graphs are captured here, per q_len
    llm = LLM(**kw)
    worker = llm.engine.executor.worker
    runner = worker.runner
    runner.decode_threshold = max(a.q_lens)
    bs = llm.engine.args.block_size
    per_seq = -(-(a.context_len + max(a.q_lens)) // bs)
    num_blocks = worker.kv_caches[0].shape[0]
    if per_seq * max(a.batch_sizes) > num_blocks:
        raise SystemExit(f"need {per_seq * max(a.batch_sizes)} KV blocks, the cache has {num_blocks}: "
                         f"lower --context-len or --batch-sizes")
    graphs = DecodeGraphs(worker.model, worker.kv_caches, per_seq, a.batch_sizes, torch.device("cuda"),
                          tuple(a.q_lens))
    graphs.capture()
    runner.graphs = graphs
    rows = []
    for B in a.batch_sizes:
        base = None
        for q in a.q_lens:
            toks = random_prompts(B, q, llm.engine.cfg.vocab_size, seed=B * 10 + q)
            tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(B)]
            batch = runner.prepare(toks, [a.context_len] * B, tables)
            assert batch.meta.num_decodes == B and batch.meta.decode.q_len == q
            for _ in range(3):
                runner.forward(batch)
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(a.iters):
                runner.forward(batch)
            e.record()
            torch.cuda.synchronize()
            ms = s.elapsed_time(e) / a.iters
            base = base or ms
            rows.append({"batch": B, "q_len": q, "context_len": a.context_len, "step_ms": ms,
                         "ratio_to_q1": ms / base})
            print(f"batch {B:3d} q_len {q}: {ms:8.3f} ms per step, {ms / base:5.2f}x q_len 1 "
                  f"(break-even mean acceptance length {ms / base:.2f})", flush=True)
    print("\n| batch | " + " | ".join(f"q_len {q} ms (x q1)" for q in a.q_lens) + " |")
    print("|---|" + "---|" * len(a.q_lens))
    for B in a.batch_sizes:
        cells = [f"{r['step_ms']:.3f} ({r['ratio_to_q1']:.2f}x)" for r in rows if r["batch"] == B]
        print(f"| {B} | " + " | ".join(cells) + " |")
    llm.engine.shutdown()
    return rows


def repetitive_prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    """Each prompt is one random 32-token passage repeated: lookup finds its continuation."""
    return [(p * (length // 32 + 1))[:length] for p in random_prompts(n, 32, vocab, seed=n)]


def start_batch(core, a, B: int, tag: str) -> None:
    """B repetitive prompts added and run until each has its first token (prefill done)."""
    prompts = repetitive_prompts(B, a.prompt_len, core.cfg.vocab_size)
    sp = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    for i, ids in enumerate(prompts):
        core.add_request(f"{tag}-{B}-{i}", ids, sp)
    while core.scheduler.stats.num_waiting or any(r.num_output_tokens == 0 for r in core.scheduler.running):
        core.step()


def profile_decode(core, a, B: int) -> None:
    """torch.profiler over `a.profile_steps` decode steps of B fresh requests: the GPU kernels and
    the host ops that take the time of a step (with speculation: verification and drafting)."""
    from torch.profiler import ProfilerActivity, profile
    start_batch(core, a, B, "prof")
    for _ in range(3):
        core.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(a.profile_steps):
            core.step()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    print(f"\nprofile of {a.profile_steps} steps at batch {B}, by GPU time:")
    print(ka.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))
    print("by host self time:")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    while core.has_unfinished_requests():
        core.step()


def bench_e2e(a) -> list[dict]:
    rows = []
    drafts = {"method": a.method, "num_speculative_tokens": a.num_speculative_tokens}
    if a.method == "ngram":
        drafts |= {"prompt_lookup_min": a.prompt_lookup_min, "prompt_lookup_max": a.prompt_lookup_max}
    for spec in (None, drafts):
        llm = LLM(**engine_kwargs(a), speculative_config=spec)
        core = llm.engine
        for rep, B in enumerate(a.batch_sizes):  # a batch size given twice: the second run is warm
            start_batch(core, a, B, str(rep))
            spec0 = core.scheduler.stats.spec
            d0, a0 = (spec0.num_drafts, spec0.num_accepted_tokens) if spec0 else (0, 0)
            out0 = sum(r.num_output_tokens for r in core.scheduler.running)
            torch.cuda.synchronize()
            t0, steps, outs = time.perf_counter(), 0, 0
            while core.has_unfinished_requests():
                outs += sum(len(o.new_token_ids) for o in core.step())
                steps += 1
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            per_req = outs / B  # output tokens each request got in the timed part
            s = core.scheduler.stats.spec
            row = {"spec": spec, "batch": B, "prompt_len": a.prompt_len, "output_len": a.output_len,
                   "tpot_ms": dt / per_req * 1e3, "tokens_per_step": outs / steps, "steps": steps,
                   "first_tokens": out0}
            if s is not None:
                row["mean_acceptance_length"] = 1 + (s.num_accepted_tokens - a0) / max(s.num_drafts - d0, 1)
                row["accepted_per_pos"] = s.accepted_per_pos
            rows.append(row)
            label = f"{a.method} k={a.num_speculative_tokens}" if spec else "no speculation"
            print(f"{label:14s} batch {B:3d}: "
                  f"{row['tpot_ms']:7.3f} ms per output token, {row['tokens_per_step']:.2f} output tokens per step (all requests)"
                  + (f", mean acceptance length {row['mean_acceptance_length']:.2f}" if s else ""), flush=True)
        if a.profile_steps:
            profile_decode(core, a, a.batch_sizes[-1])
        llm.engine.shutdown()
        del llm, core
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["step", "e2e"])
    add_engine_flags(p)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--q-lens", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="step: query tokens per decode")
    p.add_argument("--context-len", type=int, default=1024, help="step: cached tokens per sequence")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--method", choices=["ngram", "mtp"], default="ngram", help="e2e: the drafter")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--prompt-lookup-min", type=int, default=1)
    p.add_argument("--prompt-lookup-max", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--profile-steps", type=int, default=0,
                   help="e2e: also profile this many decode steps at the last batch size (torch.profiler tables)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_spec_decode.py needs a CUDA GPU")
    if a.what == "step" and a.q_lens[0] != 1:
        raise SystemExit("--q-lens must start with 1 (the baseline)")
    a.max_num_seqs = max(a.max_num_seqs, max(a.batch_sizes))
    rows = bench_step(a) if a.what == "step" else bench_e2e(a)
    write_json(a.json, {"bench": f"spec_decode_{a.what}", "env": environment(), "args": vars(a), "results": rows})


if __name__ == "__main__":
    main()
