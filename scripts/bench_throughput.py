"""Offline throughput: N requests of random prompt tokens, fixed output length (ignore_eos).

    python scripts/bench_throughput.py                    # 1000 x (1000 in, 100 out), V2-Lite dummy bf16
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

from bench_common import add_engine_flags, engine_kwargs, environment, random_prompts, write_json

from engine import LLM, SamplingParams


def count_steps(core) -> list:
    """[steps, tokens]: the engine steps from now on that schedule tokens, and their tokens (what
    the server's `vllm:iteration_tokens_total` histogram counts, for bench_http_vs_offline.py)."""
    counts, schedule = [0, 0], core.scheduler.schedule

    def scheduling():
        so = schedule()
        if so.total_num_scheduled_tokens:
            counts[0] += 1
            counts[1] += so.total_num_scheduled_tokens
        return so

    core.scheduler.schedule = scheduling
    return counts


def watch_steps(core) -> list:
    """Record every engine step from now on: its scheduled tokens and decode rows, the wall time
    of the step() call that scheduled it, and (CUDA) the host time of its launch (input
    preparation, the forward's launches, the sampler) with CUDA events at the launch's start and
    end on the stream, from which print_step_stats gets each step's GPU span and the GPU's idle
    time between steps."""
    import torch

    from engine.model_runner import ModelRunner

    steps, schedule, step = [], core.scheduler.schedule, core.step
    runner = getattr(getattr(core.executor, "worker", None), "runner", None)
    last = {}
    cuda = torch.cuda.is_available()

    def scheduling():
        so = schedule()
        last["tokens"] = so.total_num_scheduled_tokens
        last["decodes"] = sum(n == 1 for n in so.num_scheduled_tokens.values())
        return so

    def stepping():
        t = time.perf_counter()
        last["launch"] = last["events"] = None
        out = step()
        steps.append({"tokens": last.get("tokens", 0), "decodes": last.get("decodes", 0),
                      "wall": time.perf_counter() - t, "launch": last["launch"], "events": last["events"]})
        return out

    if isinstance(runner, ModelRunner):  # one rank in this process (not -tp N)
        launch = runner.launch

        def launching(so):
            if cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
            t = time.perf_counter()
            pending = launch(so)
            last["launch"] = time.perf_counter() - t
            if cuda:
                e1.record()
                last["events"] = (e0, e1)
            return pending

        runner.launch = launching
    core.scheduler.schedule, core.step = scheduling, stepping
    return steps


def print_step_stats(steps: list) -> dict:
    """Per step kind: wall of the step() call, host time of the launch, GPU span from the launch's
    first to its last queued work (the GPU's kernels plus any wait for the host's launches inside
    the step); then the GPU's idle time between consecutive steps (the host was late)."""
    import torch
    if any(s["events"] for s in steps):
        torch.cuda.synchronize()
    kinds = {"pure decode": [s for s in steps if s["tokens"] == s["decodes"]],
             "with prefill": [s for s in steps if s["tokens"] > s["decodes"]]}
    res = {}
    print("| steps | count | wall s | ms / step | tokens / step | decode rows / step | launch ms / step "
          "| GPU span ms / step |\n|---|---|---|---|---|---|---|---|")
    for name, rows in kinds.items():
        if not rows:
            continue
        n, wall = len(rows), sum(r["wall"] for r in rows)
        launch = [r["launch"] for r in rows if r["launch"] is not None]
        span = [r["events"][0].elapsed_time(r["events"][1]) for r in rows if r["events"]]
        res[name] = {"count": n, "wall_s": wall, "launch_ms": sum(launch) / max(len(launch), 1) * 1e3,
                     "gpu_span_ms": sum(span) / max(len(span), 1)}
        print(f"| {name} | {n} | {wall:.2f} | {wall / n * 1e3:.1f} | {sum(r['tokens'] for r in rows) / n:.0f} "
              f"| {sum(r['decodes'] for r in rows) / n:.0f} | {res[name]['launch_ms']:.1f} "
              f"| {res[name]['gpu_span_ms']:.1f} |")
    ev = [s["events"] for s in steps if s["events"]]
    if len(ev) > 1:
        gaps = [a[1].elapsed_time(b[0]) for a, b in zip(ev, ev[1:])]
        total = ev[0][0].elapsed_time(ev[-1][1])
        res["gpu_total_ms"], res["idle_between_ms"] = total, sum(gaps)
        print(f"GPU from the first step's launch to the last's end: {total:.0f} ms; idle between steps "
              f"{sum(gaps):.0f} ms ({sum(g > 1 for g in gaps)} gaps over 1 ms)")
    res["step_calls_s"] = sum(s["wall"] for s in steps)
    return res


class HostSampler:
    """Where the main thread's time goes during the timed run: a thread samples its Python stack
    every `interval` s (a busy main thread gives the GIL up at least every switch interval, 5 ms), and gc.callbacks time every collection. Self counts are by the sampled
    leaf frame; inclusive counts by every frame of this repository on the stack."""

    def __init__(self, interval: float = 0.005):
        import gc
        import threading
        self.interval, self.samples = interval, 0
        self.leaf, self.incl = {}, {}
        self.gc = {}  # generation -> [collections, seconds]
        self._gc_t0 = None
        self._stop = threading.Event()
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._gc_module = gc
        self._repo = str(Path(__file__).resolve().parent.parent)

    def _on_gc(self, phase, info):
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            g = self.gc.setdefault(info["generation"], [0, 0.0])
            g[0] += 1
            g[1] += time.perf_counter() - self._gc_t0

    def _name(self, code) -> str | None:
        """`path:function` of a code object of this repository (outside site-packages), else None;
        cached, so that a sample costs a dict lookup per frame."""
        try:
            return self._names[code]
        except KeyError:
            f = code.co_filename
            name = (f"{Path(f).relative_to(self._repo)}:{code.co_name}"
                    if f.startswith(self._repo) and "site-packages" not in f else None)
            self._names[code] = name
            return name

    def _run(self):
        self._names = {}
        while not self._stop.wait(self.interval):
            f = sys._current_frames().get(self._main)
            if f is None:
                continue
            self.samples += 1
            key = (f.f_code, f.f_lineno)
            self.leaf[key] = self.leaf.get(key, 0) + 1
            seen = set()
            while f is not None:
                k = self._name(f.f_code)
                if k is not None and k not in seen:
                    seen.add(k)
                    self.incl[k] = self.incl.get(k, 0) + 1
                f = f.f_back

    def _watch_triton(self):
        """Time every Triton JIT compile (JITFunction._do_compile) by kernel name."""
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:
            return
        if not hasattr(JITFunction, "_do_compile"):
            print("host sampler: this Triton has no JITFunction._do_compile; compiles are not timed")
            return
        orig, compiles = JITFunction._do_compile, self.compiles

        def timed(fn_self, *args, **kwargs):
            t = time.perf_counter()
            try:
                return orig(fn_self, *args, **kwargs)
            finally:
                c = compiles.setdefault(fn_self.__name__, [0, 0.0, None])
                c[0] += 1
                c[1] += time.perf_counter() - t
                c[2] = c[2] or str(args[0])[:300]  # the first specialization key compiled in the run

        JITFunction._do_compile = timed
        self._unwatch = lambda: setattr(JITFunction, "_do_compile", orig)

    def __enter__(self):
        self.compiles, self._unwatch = {}, lambda: None
        self._watch_triton()
        self._gc_module.callbacks.append(self._on_gc)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._gc_module.callbacks.remove(self._on_gc)
        self._unwatch()

    def report(self, wall: float, top: int = 30) -> dict:
        n = max(self.samples, 1)
        print(f"\nhost samples of the main thread: {self.samples} over {wall:.2f} s")
        print("garbage collections: " + ", ".join(f"gen {g}: {c} in {t * 1e3:.0f} ms"
                                                 for g, (c, t) in sorted(self.gc.items())))
        print("Triton JIT compiles during the run: " + (", ".join(
            f"{k} {c} in {t * 1e3:.0f} ms" for k, (c, t, _) in sorted(self.compiles.items(), key=lambda kv: -kv[1][1]))
            or "none"))
        for k, (_, _, key) in sorted(self.compiles.items(), key=lambda kv: -kv[1][1])[:6]:
            print(f"  {k}: first key {key}")
        print("| leaf frame (self) | % |\n|---|---|")
        leaf = sorted(((f"{Path(code.co_filename).name}:{line} {code.co_name}", c)
                       for (code, line), c in self.leaf.items()), key=lambda kv: -kv[1])[:top]
        for k, c in leaf:
            print(f"| {k[:110]} | {100 * c / n:.1f} |")
        print("| repository function (inclusive) | % |\n|---|---|")
        for k, c in sorted(self.incl.items(), key=lambda kv: -kv[1])[:top]:
            print(f"| {k[:110]} | {100 * c / n:.1f} |")
        return {"samples": self.samples, "gc": self.gc, "triton_compiles": self.compiles,
                "leaf": leaf,
                "inclusive": sorted(self.incl.items(), key=lambda kv: -kv[1])[:top]}


def gpu_window(core, start: int, count: int) -> dict:
    """Trace the GPU's kernels (CUDA activity only, so the host runs nearly as unprofiled) over
    engine steps [start, start + count) of the timed run; `window` fills in once it has ended."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    window, step, n = {}, core.step, [0]

    def stepping():
        i = n[0]
        n[0] += 1
        if i == start:
            window["prof"] = profile(activities=[ProfilerActivity.CUDA])
            window["prof"].__enter__()
            window["t0"] = time.perf_counter()
        out = step()
        if i == start + count - 1:
            torch.cuda.synchronize()
            window["wall_s"] = time.perf_counter() - window["t0"]
            window["prof"].__exit__(None, None, None)
        return out

    core.step = stepping
    return window


def print_gpu_window(window: dict, count: int, top: int = 15) -> dict:
    """GPU busy time (the union of kernel and copy intervals) against the window's span, the idle
    gaps by size and where the largest fall, and the kernels by total time."""
    if "prof" not in window:
        print("GPU window: the run ended before the window did")
        return {}
    ev = [(e.start_ns(), e.start_ns() + e.duration_ns(), e.name())
          for e in window["prof"].profiler.kineto_results.events()
          if e.device_type().name == "CUDA" and e.duration_ns() > 0]
    if not ev:
        print("GPU window: no CUDA kernels traced")
        return {}
    ev.sort()
    busy, gaps, end, last = 0, [], ev[0][0], ev[0][2]
    for s, e, name in ev:
        if s > end:
            gaps.append((s - end, last, name))
        if e > end:
            busy += e - max(s, end)
            end, last = e, name
    span = end - ev[0][0]
    idle = sum(g[0] for g in gaps)
    print(f"\nGPU window of {count} steps: host wall {window['wall_s'] * 1e3:.1f} ms, GPU span "
          f"{span / 1e6:.1f} ms, busy {busy / 1e6:.1f} ms ({100 * busy / span:.1f}%), idle {idle / 1e6:.1f} ms "
          f"in {len(gaps)} gaps")
    print("| gap size | count | idle ms |\n|---|---|---|")
    for lo, hi in ((0, 5e3), (5e3, 50e3), (50e3, 1e6), (1e6, float("inf"))):
        sel = [g[0] for g in gaps if lo <= g[0] < hi]
        print(f"| {lo / 1e3:g}-{hi / 1e3:g} us | {len(sel)} | {sum(sel) / 1e6:.2f} |")
    print("largest gaps (us: kernel before -> kernel after):")
    for g, before, after in sorted(gaps, reverse=True)[:10]:
        print(f"  {g / 1e3:.0f}: {before[:60]} -> {after[:60]}")
    per = {}
    for s, e, name in ev:
        t = per.setdefault(name, [0, 0])
        t[0] += e - s
        t[1] += 1
    print("| kernel | ms in window | calls |\n|---|---|---|")
    for name, (t, c) in sorted(per.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"| {name[:90]} | {t / 1e6:.2f} | {c} |")
    return {"steps": count, "wall_ms": window["wall_s"] * 1e3, "span_ms": span / 1e6, "busy_ms": busy / 1e6,
            "idle_ms": idle / 1e6, "gaps": len(gaps)}


def _allocator_counts() -> dict | None:
    import torch
    if not torch.cuda.is_available():
        return None
    st = torch.cuda.memory_stats()
    return {k: st.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")}


def _dynamo_graphs() -> int | None:
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return None
    return counters["stats"]["unique_graphs"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(p)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=100)
    p.add_argument("--step-stats", action="store_true",
                   help="also print wall time per step kind (pure decode / with prefill tokens)")
    p.add_argument("--host-sample", action="store_true",
                   help="sample the main thread's Python stack during the timed run (self and inclusive "
                        "shares by function) and time the garbage collector")
    p.add_argument("--gpu-window", default=None, metavar="START:COUNT",
                   help="trace the GPU over steps START..START+COUNT-1 of the timed run: busy time, idle "
                        "gaps and top kernels (the trace slows those steps slightly)")
    a = p.parse_args()
    if a.gpu_window:
        import torch
        if not torch.cuda.is_available():
            p.error("--gpu-window traces CUDA kernels: it needs a GPU")
    llm = LLM(**engine_kwargs(a))
    prompts = random_prompts(a.num_prompts, a.input_len, llm.engine.cfg.vocab_size)
    sp = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    # warm-up (Triton compiles, allocator) on other prompts than the timed ones, as bench_serving.py
    # warms the server: with prefix caching on, the timed run must not find any of its prompts cached
    llm.generate(random_prompts(8, a.input_len, llm.engine.cfg.vocab_size, seed=-1), sp)
    steps = watch_steps(llm.engine) if a.step_stats else None
    counts = count_steps(llm.engine)
    if a.gpu_window:
        w_start, w_count = map(int, a.gpu_window.split(":"))
        window = gpu_window(llm.engine, w_start, w_count)
    sampler = HostSampler() if a.host_sample else contextlib.nullcontext()
    compiles = _dynamo_graphs()
    mem0 = _allocator_counts()
    with sampler:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp)
        dt = time.perf_counter() - t0
    host = sampler.report(dt) if a.host_sample else None
    if compiles is not None:
        print(f"torch.compile graphs compiled during the timed run: {_dynamo_graphs() - compiles}")
    mem = None
    if mem0 is not None:  # cudaMalloc / cudaFree calls and retries (a retry frees the cache: a sync)
        mem = {k: v - mem0[k] for k, v in _allocator_counts().items()}
        print("CUDA caching allocator during the timed run: " + ", ".join(f"{k} {v}" for k, v in mem.items()))
    stats = None
    if steps is not None:
        stats = print_step_stats(steps)
        print(f"outside engine.step (adding requests, output processing): "
              f"{dt - stats['step_calls_s']:.2f} s of {dt:.2f}")
    gpu = print_gpu_window(window, w_count) if a.gpu_window else None
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {"requests_per_s": a.num_prompts / dt, "output_tokens_per_s": out_tokens / dt,
           "total_tokens_per_s": (out_tokens + a.num_prompts * a.input_len) / dt, "elapsed_s": dt,
           "num_preemptions": llm.scheduler.stats.num_preemptions, "num_steps": counts[0],
           "step_tokens": counts[1], "gpu_window": gpu, "step_stats": stats, "host": host, "allocator": mem}
    print(f"{a.num_prompts} requests x ({a.input_len} in, {a.output_len} out) in {dt:.2f} s: "
          f"{res['requests_per_s']:.2f} req/s, {res['output_tokens_per_s']:.0f} output tok/s, "
          f"{res['total_tokens_per_s']:.0f} total tok/s, {res['num_preemptions']} preemptions, "
          f"{counts[0]} steps")
    write_json(a.json, {"bench": "throughput", "env": environment(), "args": vars(a), "results": res})


if __name__ == "__main__":
    main()
