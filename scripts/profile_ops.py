"""GPU time per op and per module for decode and prefill steps, against each op's floor.

    python scripts/profile_ops.py                                  # decode 32, 128; prefill 8x1024, 1x8192
    python scripts/profile_ops.py --decode 32 --prefill 8x1024 --kernel-plan auto,moe_fused_max_tokens=8

Eager steps under torch.profiler (the kernels a CUDA graph replays are the same; launch gaps are
not counted). Per module: device time of the kernels each module launched (forward hooks open a
profiler range). Per kernel: the top kernels by device time. Floors are computed from the model
config for the two that dominate: the MoE (bytes of the experts touched at decode, FLOPs at
prefill) and the attention projections.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from bench_common import add_engine_flags, engine_kwargs, random_prompts

from engine import LLM, SamplingParams

def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


BW, PEAK = 4.3e12, 790e12  # H200 copy bandwidth (bytes/s), bf16 dense (FLOP/s), DESIGN.md §10

MODULE_KINDS = {  # class name -> label; the innermost labelled module owns a kernel
    "DeepseekAttention": "attention (all)",
    "Linear": "linear",
    "MoE": "moe (experts + glue)",
    "Router": "router",
    "MLP": "dense mlp",
    "ParallelLMHead": "lm_head",
    "VocabParallelEmbedding": "embedding",
    "RMSNorm": "rmsnorm",
}


def install_ranges(model) -> None:
    """Open a profiler range named after each labelled module around its forward."""
    for name, m in model.named_modules():
        kind = MODULE_KINDS.get(type(m).__name__)
        if kind is None:
            continue
        if kind == "linear":
            kind = "linear " + name.rsplit(".", 1)[-1]
        label = f"mod::{kind}"

        def pre(mod, args, label=label):
            mod._prof_range = torch.autograd.profiler.record_function(label)
            mod._prof_range.__enter__()

        def post(mod, args, out):
            mod._prof_range.__exit__(None, None, None)

        m.register_forward_pre_hook(pre)
        m.register_forward_hook(post)


def profile_steps(core, n_steps: int):
    from torch.profiler import ProfilerActivity, profile
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])) as prof:
        for _ in range(n_steps):
            core.step()
        sync()
    return prof


def summarize(prof, n_steps: int, title: str, top: int) -> dict:
    ev = prof.key_averages()
    # kernels only: the CPU-side op entries (aten::*, launches) repeat their kernels' device time
    kernels = [e for e in ev if e.self_device_time_total > 0
               and not e.key.startswith(("mod::", "aten::", "cuLaunch", "cuda"))]
    total = sum(e.self_device_time_total for e in kernels) / n_steps
    launches = sum(e.count for e in kernels) / n_steps
    mods = sorted(((e.key[5:], e.device_time_total / n_steps, e.count / n_steps) for e in ev
                   if e.key.startswith("mod::")), key=lambda r: -r[1])
    print(f"\n## {title}: GPU time per step {total / 1e3:.3f} ms in {launches:.0f} kernels")
    host = sorted((e for e in ev if e.key.startswith(("aten::", "cuda")) and e.self_cpu_time_total > 0),
                  key=lambda e: -e.self_cpu_time_total)[:12]
    print("\nhost (self CPU time, top ops): " + "; ".join(
        f"{e.key} {e.self_cpu_time_total / n_steps / 1e3:.2f} ms x{e.count / n_steps:.0f}" for e in host))
    print("\n| module (inclusive) | us/step | calls/step |\n|---|---|---|")
    for k, us, c in mods:
        print(f"| {k} | {us:.1f} | {c:.0f} |")
    print("\n| kernel | us/step | calls/step | us/call |\n|---|---|---|---|")
    rows = []
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
        us = e.self_device_time_total / n_steps
        rows.append((e.key[:100], us, e.count / n_steps))
        print(f"| {e.key[:100]} | {us:.1f} | {e.count / n_steps:.1f} | {e.self_device_time_total / e.count:.2f} |")
    return {"title": title, "gpu_us": total, "kernels_per_step": launches,
            "modules": mods, "kernels": rows}


def moe_floor(cfg, tokens: int, prefill: bool) -> tuple[float, float]:
    """(us by bytes of the experts touched, us by FLOPs) for all MoE layers of one step."""
    D, I, E, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    touched = E * (1 - (1 - k / E) ** tokens) + cfg.n_shared_experts
    byts = touched * 3 * D * I * 2 * layers
    flops = 2 * 3 * D * I * tokens * (k + cfg.n_shared_experts) * layers
    return byts / BW * 1e6, flops / PEAK * 1e6


def attn_proj_floor(cfg, tokens: int) -> tuple[float, float]:
    D, H = cfg.hidden_size, cfg.num_attention_heads
    qk, V, Lkv, R = cfg.qk_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    q = D * H * qk if cfg.q_lora_rank is None else D * cfg.q_lora_rank + cfg.q_lora_rank * H * qk
    params = q + D * (Lkv + R) + Lkv * H * (qk - R + V) + H * V * D
    byts = params * 2 * cfg.num_hidden_layers
    return byts / BW * 1e6, 2 * params * tokens * cfg.num_hidden_layers / PEAK * 1e6


def admit_all(core, n: int) -> None:
    """Step until the `n` requests just added all decode. Without a length limit none frees its
    blocks, so a cache too small for them shows as a preemption: that stops the profile, naming
    the limits, instead of stepping until the longest sequences reach max_model_len."""
    preempted = core.scheduler.stats.num_preemptions
    while core.scheduler.stats.num_waiting or any(r.num_output_tokens == 0 for r in core.scheduler.running):
        core.step()
        if core.scheduler.stats.num_preemptions != preempted or len(core.scheduler.running) > n:
            break
    if core.scheduler.stats.num_preemptions != preempted or len(core.scheduler.running) != n:
        raise SystemExit(f"profile_ops: {len(core.scheduler.running)} of {n} sequences decode together, "
                         f"{core.scheduler.stats.num_preemptions - preempted} preempted: the KV cache does not "
                         "hold them (--gpu-memory-utilization, --max-model-len, --prompt-len)")


def run_decode(core, batch: int, prompt_len: int, n_steps: int, top: int) -> dict:
    """`batch` sequences decoding at once, each past its `prompt_len`-token prompt. The requests
    run until profiled and are then aborted: with a length limit, the first prompts (prefilled
    max_num_batched_tokens at a time) would finish before the last ones start decoding, and the
    profiled steps would hold fewer sequences than asked."""
    sp = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    rids = [f"d{batch}-{i}" for i in range(batch)]
    for rid, ids in zip(rids, random_prompts(batch, prompt_len, core.cfg.vocab_size, seed=batch)):
        core.add_request(rid, ids, sp)
    admit_all(core, batch)
    for _ in range(2):
        core.step()
    context = sum(r.num_tokens for r in core.scheduler.running) / batch  # at the first profiled step
    prof = profile_steps(core, n_steps)
    res = summarize(prof, n_steps, f"decode, batch {batch}, {prompt_len}-token prompts", top)
    mb, mf = moe_floor(core.cfg, batch, False)
    ab, af = attn_proj_floor(core.cfg, batch)
    kv = batch * (context + (n_steps - 1) / 2) * (core.cfg.kv_lora_rank + core.cfg.qk_rope_head_dim) * 2 \
        * core.cfg.num_hidden_layers / BW * 1e6
    print(f"\nfloors: MoE bytes {mb:.0f} us (FLOPs {mf:.0f}); attention projections bytes {ab:.0f} us; "
          f"KV read {kv:.0f} us ({context:.0f}-token contexts on average)")
    res["floors"] = {"moe_bytes_us": mb, "attn_proj_bytes_us": ab, "kv_us": kv}
    core.abort_requests(rids)
    while core.has_unfinished_requests():
        core.step()
    return res


def run_prefill(core, n: int, length: int, top: int) -> dict:
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    # warm the same shapes once (autotuning, allocator), then profile a fresh set
    for rep in range(2):
        for i, ids in enumerate(random_prompts(n, length, core.cfg.vocab_size, seed=100 + rep)):
            core.add_request(f"p{n}x{length}-{rep}-{i}", ids, sp)
        if rep == 0:
            while core.has_unfinished_requests():
                core.step()
    sync()
    t0 = time.perf_counter()
    prof = profile_steps(core, 1)
    wall = time.perf_counter() - t0
    while core.has_unfinished_requests():
        core.step()
    res = summarize(prof, 1, f"prefill step, {n} x {length} tokens", top)
    T = n * length
    mb, mf = moe_floor(core.cfg, T, True)
    ab, af = attn_proj_floor(core.cfg, T)
    print(f"\nfloors: MoE FLOPs {mf:.0f} us; attention projections FLOPs {af:.0f} us; wall {wall * 1e3:.1f} ms")
    res["floors"] = {"moe_flops_us": mf, "attn_proj_flops_us": af}
    return res


def run_mixed(core, decodes: int, new_prompts: int, prompt_len: int, top: int, host_profile: bool = False,
              sync_debug: bool = False) -> dict:
    """The offline workload's typical step: `decodes` running decodes plus the prefill of
    `new_prompts` fresh prompts, profiled, and the same step timed by wall clock (eager steps with
    prefill are not CUDA graphs, so host time may exceed GPU time)."""
    sp = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)  # aborted at the end, as in run_decode
    rids = [f"m{decodes}-{i}" for i in range(decodes)]
    for rid, ids in zip(rids, random_prompts(decodes, prompt_len, core.cfg.vocab_size, seed=7)):
        core.add_request(rid, ids, sp)
    admit_all(core, decodes)
    walls, enqueue = [], []
    model = core.executor.worker.runner.model
    forward = model.forward

    def timed_forward(*args, **kwargs):  # host time to enqueue the forward's kernels (no sync)
        t = time.perf_counter()
        out = forward(*args, **kwargs)
        enqueue.append(time.perf_counter() - t)
        return out

    model.forward = timed_forward
    for rep in range(3):
        for i, ids in enumerate(random_prompts(new_prompts, prompt_len, core.cfg.vocab_size, seed=200 + rep)):
            core.add_request(f"mp{rep}-{i}", ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        sync()
        if rep < 2:
            t0 = time.perf_counter()
            if rep == 0 and sync_debug:  # every call that synchronizes the host with the GPU
                import warnings
                torch.cuda.set_sync_debug_mode("warn")
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    core.step()
                torch.cuda.set_sync_debug_mode("default")
                sync()
                sites = {}
                for w in caught:
                    key = f"{w.filename}:{w.lineno}: {str(w.message)[:80]}"
                    sites[key] = sites.get(key, 0) + 1
                print(f"\nsynchronizing calls in one mixed step: {len(caught)}")
                for k, c in sorted(sites.items(), key=lambda kv: -kv[1]):
                    print(f"  {c} x {k}")
            elif rep == 1 and host_profile:  # Python-level cost of one warm step, by function
                import cProfile
                import pstats
                pr = cProfile.Profile()
                pr.enable()
                core.step()
                sync()
                pr.disable()
                print("\nhost profile of one mixed step (cProfile, by own time):")
                pstats.Stats(pr).sort_stats("tottime").print_stats(40)
                print("\nthe same, by cumulative time:")
                pstats.Stats(pr).sort_stats("cumulative").print_stats(60)
            else:
                core.step()
                sync()
            walls.append(time.perf_counter() - t0)
        else:
            prof = profile_steps(core, 1)
    model.forward = forward
    res = summarize(prof, 1, f"mixed step, {decodes} decodes + {new_prompts} x {prompt_len} prefill", top)
    print(f"\nwall per step (unprofiled): {', '.join(f'{w * 1e3:.1f}' for w in walls)} ms; host time to "
          f"enqueue the forward: {', '.join(f'{w * 1e3:.1f}' for w in enqueue[:2])} ms")
    res["wall_ms"] = [w * 1e3 for w in walls]
    res["enqueue_ms"] = [w * 1e3 for w in enqueue[:2]]
    core.abort_requests(rids)
    while core.has_unfinished_requests():
        core.step()
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(p)
    p.add_argument("--decode", type=int, nargs="*", default=[32, 128])
    p.add_argument("--prefill", nargs="*", default=["8x1024", "1x8192"])
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--mixed", nargs="*", default=[],
                   help="DECODESxPROMPTS: that many decodes plus the prefill of PROMPTS new prompts in one step")
    p.add_argument("--host-profile", action="store_true",
                   help="with --mixed: also cProfile one warm mixed step (its wall time is then not comparable)")
    p.add_argument("--sync-debug", action="store_true",
                   help="with --mixed: list the calls of the first mixed step that synchronize with the GPU "
                        "(torch.cuda.set_sync_debug_mode; its wall time is then not comparable)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    a.enforce_eager = True
    a.async_scheduling = False
    a.max_num_seqs = max([a.max_num_seqs] + a.decode + [int(s.split("x")[0]) + int(s.split("x")[1]) for s in a.mixed])
    if any(int(s.split("x")[1]) >= a.max_model_len for s in a.prefill):
        a.max_model_len = max(int(s.split("x")[1]) for s in a.prefill) + 64
    llm = LLM(**engine_kwargs(a))
    core = llm.engine
    install_ranges(core.executor.worker.runner.model)
    out = []
    for b in a.decode:
        out.append(run_decode(core, b, a.prompt_len, a.steps, a.top))
    for spec in a.prefill:
        n, length = map(int, spec.split("x"))
        out.append(run_prefill(core, n, length, a.top))
    for spec in a.mixed:
        d, n = map(int, spec.split("x"))
        out.append(run_mixed(core, d, n, a.prompt_len, a.top, a.host_profile, a.sync_debug))
    if a.json or "OUT" in os.environ:
        path = a.json or os.path.join(os.environ["OUT"], "profile_ops.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
