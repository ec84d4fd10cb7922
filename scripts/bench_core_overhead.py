"""The control plane on the CPU: `serve` (front end + engine-core process) against the offline
LLM, both driving a stub model, so that what is left is scheduling, input/output plumbing and
HTTP work. Reports requests/s, steps/s, the engine core's time per step split by phase, where
its step loop lost time, and how far the front end ran behind it.

The stub: the real tiny model is built (configs/models/tiny-deepseek-v3, token-id prompts), but
ModelRunner.forward returns zero hidden states and ModelRunner.logits zero logits over its
512-token vocabulary, so every step samples token 0 (ignore_eos keeps requests going).
Everything else is the real code: Scheduler, ModelRunner input preparation and sampler (on the
CPU, over 512 logits), EngineCore, the core process's loop, pipes and threads, AsyncLLM, the
output processor, FastAPI, uvicorn, SSE.

Emulating a GPU step, two costs:
  device  --device-ms / --device-us-per-token: each launched step occupies an imaginary device
          for that long. It starts when the launch starts (kernels run as they are launched),
          once the step before is done, and ends no earlier than the launch; ModelRunner.finish
          sleeps until then (a sleep releases the GIL, as the wait on a CUDA event does), so
          async scheduling overlaps host work with it as on a GPU.
  host    --host-ms / --host-us-per-token / --prefill-host-ms: CPU time added to each launch, as
          busy pure Python in ~70 us slices, each ended by a tiny torch op (whose dispatch
          releases the GIL, as every kernel launch does), counted in the thread's own CPU time:
          while another thread of the core process holds the GIL, or the thread waits for a
          core, the launch takes longer, as on the GPU host. --prefill-host-ms is for steps
          with prompt tokens, which run eager on a GPU (no CUDA graph).
V2-Lite on one H200 (1000 x (1000 in, 100 out)): a mixed step of ~8,200 tokens takes ~100 ms
of host time to launch against ~85 ms of GPU, a decode step of 256 a few ms of host (graph
replays) against ~15 ms. `--device-ms 14 --device-us-per-token 9 --prefill-host-ms 92` gives
433 steps in ~19 s offline, as on the H200 (the stub's real input preparation and sampler add a
few ms per step on top).

Without device and host costs every cost here is on the critical path; with them, only what
does not fit in the device time, or takes the step loop's GIL, is. The client (a minimal asyncio
HTTP/1.1 client, one connection per request, or --client httpx: bench_serving.py's) shares this
machine's cores with the server: on a 2-core machine the three processes contend for cores,
which the "waiting for a core" figures show (Linux schedstat); "wall less that" is the wall time
without the step loop's waits for a core.

    python scripts/bench_core_overhead.py                       # both paths, 1000 x (1000 in, 100 out), streamed
    python scripts/bench_core_overhead.py --device-ms 14 --device-us-per-token 9 --prefill-host-ms 92
    python scripts/bench_core_overhead.py --mode http --client httpx --device-ms 14 --device-us-per-token 9 --prefill-host-ms 92
    python scripts/bench_core_overhead.py --num-prompts 256 --no-stream

The engine-core phases (ms per step, exclusive): schedule (Scheduler.schedule), launch (input
preparation, stub forward, sampler, the host cost; "of which off CPU": waiting for a core, or
blocked, i.e. for the GIL), device wait (the stub's imaginary device), finish (sampled ids back
to requests), update (Scheduler.update_from_output), step other (the rest of EngineCore.step),
add_request (EngineCore.add_request), commands (taking commands off the receiver thread's queue
and applying them, less add_request), report (building and queueing the output message), idle
(waiting for commands with nothing to run), loop other (the rest of the loop's wall time). The
sender rows are the core process's sender thread encoding, pickling and writing output messages
(concurrent with the loop; it holds the GIL while it encodes and pickles; a pipe write waits
while the front end is behind, without the GIL). The CPU time of each thread of the core
process (step loop, receiver, sender) and of the front end (event loop, pipe reader, pipe
writer) is reported over the run.

HTTP timeline figures: first request sent -> first in the core (EngineCore.add_request), the
span of the arrivals, when connections were accepted, reached the app and were handed to the
core (after the client's first send), the core's last step -> the last response read, per
response the core's report of its last token -> the client's reading its end (minimal client),
and per output message the core's queueing it -> the front end's reader thread and event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from core_stub import PHASES, STUB_ENV, TIMERS, _timed, gc_summary, install_stub  # noqa: E402

TINY = str(REPO / "configs" / "models" / "tiny-deepseek-v3")

if STUB_ENV in os.environ:  # the server process, and its engine-core child (spawn imports this)
    install_stub(json.loads(os.environ[STUB_ENV]))


def per_step_table(p: dict, wall_s: float) -> str:
    """ms per step of each exclusive phase of one busy period."""
    t, steps = dict(p["t"]), max(p["steps"], 1)
    inner = sum(t.get(k, 0.0) for k in ("schedule", "launch", "device wait", "finish", "update"))
    t["step other"] = t.get("step", 0.0) - inner
    if "commands" in t:  # the server's core loop: its wall time is the busy period
        t["commands"] -= t.get("idle", 0.0) + t.get("add_request", 0.0)
        t["loop other"] = p["wall"] - sum(t.get(k, 0.0) for k in PHASES if k != "loop other")
    rows = [f"  {k:<14}{t[k] * 1e3 / steps:>9.3f}" for k in PHASES if k in t]
    if "launch off-CPU" in t:
        rows.insert(PHASES.index("launch") + 1 if "schedule" in t else 0,
                    f"   of which off CPU {t['launch off-CPU'] * 1e3 / steps:.3f}: waiting for a core "
                    f"{t.get('launch runqueue', 0.0) * 1e3 / steps:.3f}, for the GIL (the rest) "
                    f"{max(0.0, t['launch off-CPU'] - t.get('launch runqueue', 0.0)) * 1e3 / steps:.3f}")
    for k in ("sender encode", "sender pickle", "pipe write"):
        if k in t:
            rows.append(f"  {k:<14}{t[k] * 1e3 / steps:>9.3f}   (sender thread, concurrent)")
    return "\n".join(rows)


# ---- offline ----

def run_offline(a: argparse.Namespace) -> dict:
    from bench_common import random_prompts

    from common.sampling_params import SamplingParams
    from engine import LLM
    from engine.output_processor import OutputProcessor
    install_stub(stub_settings(a))
    OutputProcessor.process = _timed("output processing", OutputProcessor.process)
    llm = LLM(**engine_kwargs(a))
    sp = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True, prompt_logprobs=a.echo_logprobs)
    prompts = random_prompts(a.num_prompts, a.input_len, 512)
    llm.generate(prompts[:8], sp)
    TIMERS.reset()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t0
    snap = TIMERS.snapshot()
    snap["wall"] = dt
    assert all(len(o.outputs[0].token_ids) == a.output_len for o in outs)
    return {"wall": dt, "core": snap, "sent": t0}


def stub_settings(a: argparse.Namespace) -> dict:
    return {"device_ms": a.device_ms, "device_us_per_token": a.device_us_per_token, "host_ms": a.host_ms,
            "host_us_per_token": a.host_us_per_token, "prefill_host_ms": a.prefill_host_ms, "vocab": 512,
            "switch_interval_ms": a.switch_interval_ms, "front_gc_threshold": a.front_gc_threshold}


def engine_kwargs(a: argparse.Namespace) -> dict:
    return dict(model=TINY, load_format="dummy", device="cpu", max_model_len=a.input_len + a.output_len + 16,
                max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs,
                async_scheduling=a.async_scheduling, skip_tokenizer_init=not a.tokenizer,
                num_kv_blocks=a.max_num_seqs * ((a.input_len + a.output_len) // 16 + 2) + 64)


def serve_argv(a: argparse.Namespace, port: int) -> list[str]:
    kw = engine_kwargs(a)
    argv = ["--model", kw["model"], "--load-format", "dummy", "--device", "cpu",
            "--max-model-len", str(kw["max_model_len"]), "--max-num-batched-tokens", str(kw["max_num_batched_tokens"]),
            "--max-num-seqs", str(kw["max_num_seqs"]), "--num-kv-blocks", str(kw["num_kv_blocks"]),
            "--async-scheduling" if a.async_scheduling else "--no-async-scheduling",
            "--port", str(port), "--log-level", "warning", "--api-server-count", str(a.api_server_count)]
    return argv + ([] if a.tokenizer else ["--skip-tokenizer-init"])


# ---- HTTP ----

async def _request(port: int, body: bytes, stream: bool) -> tuple[int, bytes, float]:
    """One POST /v1/completions on its own connection; (SSE events seen, the last bytes, when
    the response ended)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    events, tail, first, last = 0, b"", None, b""
    while data := await reader.read(65536):
        if first is None:
            first = data
        buf = tail + data
        events += buf.count(b"data: ")  # the tail is too short to hold a whole marker
        tail = buf[-5:]
        last = (last + data)[-4000:]
    end = time.perf_counter()
    writer.close()
    if first is None or not first.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"request failed: {(first or b'')[:300]!r}")
    return events, last, end


async def _load_httpx(port: int, a: argparse.Namespace, prompts: list[list[int]]) -> tuple[float, list]:
    """The same load through scripts/bench_serving.py's client (httpx, one SSE parse per line),
    as the GPU comparison runs it."""
    import httpx
    from bench_serving import ClientShards, Target, run_load, shard_count

    limits = httpx.Limits(max_connections=len(prompts) + 1, max_keepalive_connections=len(prompts) + 1)
    shards = shard_count(len(prompts)) if a.client_shards is None else a.client_shards
    async with ClientShards(shards, limits, httpx.Timeout(600, connect=60)) as clients:
        t = Target(f"http://127.0.0.1:{port}/v1/completions", {}, None, a.output_len, 0.0, 600)
        t0 = time.perf_counter()
        results, dt = await run_load(clients, t, prompts, float("inf"), None, 0)
    failed = [r.error for r in results if not r.ok or r.output_tokens != a.output_len]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed or came back short, e.g. {failed[0]}")
    return dt, [(len(r.itl) + 2, f'"completion_tokens":{a.output_len}'.encode(), None) for r in results], t0


async def _load(port: int, a: argparse.Namespace, prompts: list[list[int]]) -> tuple[float, list]:
    if a.client == "httpx":
        return await _load_httpx(port, a, prompts)
    echo = {} if a.echo_logprobs is None else {"echo": True, "logprobs": a.echo_logprobs}
    bodies = [json.dumps({"model": None, "prompt": p, "max_tokens": a.output_len, "ignore_eos": True,
                          "temperature": 0.0, "stream": a.stream, **echo,
                          **({"stream_options": {"include_usage": True}} if a.stream else {})}).encode()
              for p in prompts]
    t0 = time.perf_counter()
    results = await asyncio.gather(*(_request(port, b, a.stream) for b in bodies))
    return time.perf_counter() - t0, results, t0


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads) from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _spawned(server_pid: int) -> list[int]:
    """The server's children started by multiprocessing's spawn (not its resource tracker), in
    start order: the engine core, then under --api-server-count N > 1 the N API servers."""
    out = []
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        for c in (task / "children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes():
                out.append(int(c))
    if not out:
        raise SystemExit("no engine-core process found under the server")
    return sorted(out)


def run_http(a: argparse.Namespace) -> dict:
    from bench_common import free_port, random_prompts, stop_server, wait_healthy

    port = free_port()
    out = Path(tempfile.mkdtemp(prefix="bench_core_")) / "core.json"
    env = {**os.environ, STUB_ENV: json.dumps({**stub_settings(a), "out": str(out)})}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--serve-child", *serve_argv(a, port)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env)
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", 300, poll_s=0.5)
        prompts = random_prompts(a.num_prompts + 8, a.input_len, 512, seed=1)
        asyncio.run(_load(port, a, prompts[:8]))  # warm-up
        time.sleep(1.5)  # the core goes idle: its warm-up period closes
        core_pid, *servers = _spawned(proc.pid)
        fronts = servers or [proc.pid]  # the HTTP processes

        def cpu() -> tuple[float, float, float]:
            return sum(map(_cpu_s, fronts)), _cpu_s(core_pid), time.process_time()

        cpu0 = cpu()
        dt, results, t_send = asyncio.run(_load(port, a, prompts[8:]))
        cpu1 = cpu()
        bad = [r for r in results if (a.stream and r[0] < a.output_len) or
               f'"completion_tokens":{a.output_len}'.encode() not in r[1].replace(b" ", b"")]
        if bad:
            raise SystemExit(f"{len(bad)} responses lack {a.output_len} tokens, e.g. {bad[0][1][-300:]!r}")
        events = sum(r[0] for r in results)
        time.sleep(1.5)
    finally:
        stop_server(proc, 60)
    periods = json.loads(out.read_text())
    c = periods[-1]
    front = Path(str(out) + ".front.json")
    fe = front_end_summary(json.loads(front.read_text()), t_send, t_send + dt) if front.exists() else None
    if fe:
        probe = json.loads(front.read_text())
        fe["arrivals"] = {k: [x - t_send for x in v if t_send <= x <= t_send + dt]
                          for k, v in probe["marks"].items()}
        fe["gc"] = gc_summary(probe["gc"], t_send, t_send + dt)
    return {"wall": dt, "core": c, "events": events, "sent": t_send, "front": fe,
            "finish_lag": finish_lags(results, c.get("finished", {})),
            "to_first_add": c["first_add"] - t_send, "adds_span": c["last_add"] - c["first_add"],
            "after_last_step": t_send + dt - c["end"],
            "front_cpu": cpu1[0] - cpu0[0], "core_cpu": cpu1[1] - cpu0[1], "client_cpu": cpu1[2] - cpu0[2]}


def front_end_summary(probe: dict, t0: float, t1: float) -> dict | None:
    """The front end's pace over the run [t0, t1]: how long output messages took from the core's
    queueing them to the reader thread and to the event loop's output processing, and the CPU
    time of the front end's threads between the first and the last message processed."""
    rows = [r for r in probe["rows"] if r[0] is not None and r[2] is not None and t0 <= r[0] <= t1]
    if not rows:
        return None

    def pct(xs: list[float]) -> dict:
        xs = sorted(xs)
        return {"p50": xs[len(xs) // 2], "p90": xs[int(len(xs) * 0.9)], "max": xs[-1]}

    first, last = rows[0], rows[-1]
    return {"messages": len(rows), "read_lag": pct([r[1] - r[0] for r in rows]),
            "loop_lag": pct([r[2] - r[0] for r in rows]), "last_loop_lag": last[2] - last[0],
            "span": last[2] - first[2],
            "thread_cpu": {k: v - first[5].get(k, 0.0) for k, v in last[5].items()}}


def finish_lags(results: list[tuple], finished: dict[str, float]) -> dict | None:
    """Per response (minimal client): seconds from the core's report of its last token to the
    client's reading the end of the response. How far the front end runs behind the core."""
    lags = []
    for _, last, end in results:
        m = re.search(rb'"id":\s*"([^"]+)"', last)
        if end is not None and m and m.group(1).decode() in finished:
            lags.append(end - finished[m.group(1).decode()])
    if not lags:
        return None
    lags.sort()
    return {"n": len(lags), "p50": lags[len(lags) // 2], "p90": lags[int(len(lags) * 0.9)], "max": lags[-1]}


def _threads(cpu: dict, wall: float) -> str:
    return ", ".join(f"{k} {v:.2f} s ({100 * v / max(wall, 1e-9):.0f}%)" for k, v in sorted(cpu.items()))


def report(name: str, r: dict, a: argparse.Namespace) -> str:
    c = r["core"]
    lines = [f"{name}: {a.num_prompts / r['wall']:.2f} req/s, {c['steps']} steps in {r['wall']:.2f} s "
             f"({c['steps'] / r['wall']:.1f} steps/s, {r['wall'] / max(c['steps'], 1) * 1e3:.3f} ms per step "
             f"of wall time), {c['tokens'] / max(c['steps'], 1):.0f} tokens per step"]
    log = c.get("step_log", [])
    eager = [x for x in log if x[3]]
    if log:
        lines.append(f"  steps with prompt tokens (eager on a GPU) {len(eager)}, "
                     f"{sum(x[1] for x in eager) / max(len(eager), 1):.0f} tokens each; decode-only steps "
                     f"{len(log) - len(eager)}, {sum(x[2] for x in log if not x[3]) / max(len(log) - len(eager), 1):.0f} "
                     f"requests each")
    if log and c["first_add"] is not None and c["last_add"] is not None:
        during = sum(x[4] for x in log if x[0] <= c["last_add"])
        lines.append(f"  launches blocked off CPU (for the GIL): {during:.3f} s while requests arrived "
                     f"(to the last add_request), {sum(x[4] for x in log) - during:.3f} s after; "
                     f"{sum(x[4] for x in eager):.3f} s of it in steps with prompt tokens (host-bound "
                     f"with --prefill-host-ms: on the critical path)")
    if "gc" in c:
        t0 = r.get("sent", c["start"] or 0.0)
        lines.append(f"  garbage collections in the stepping process: {gc_summary(c['gc'], t0, t0 + r['wall'])}")
    if "runqueue" in c:
        lines.append(f"  the step loop waited {c['runqueue']:.2f} s for a core (a contended CPU); "
                     f"wall less that: {r['wall'] - c['runqueue']:.2f} s")
    if "events" in r:
        lines.append(f"  core busy period {c['wall']:.2f} s; CPU s over the run: front end {r['front_cpu']:.2f}, "
                     f"engine core {r['core_cpu']:.2f}, client {r['client_cpu']:.2f}; {r['events']} SSE events")
        lines.append(f"  first request sent -> first in the core {r['to_first_add']:.3f} s; first -> last in the "
                     f"core {r['adds_span']:.3f} s; core's last step -> last response read {r['after_last_step']:.3f} s")
        lines.append(f"  engine-core threads, CPU over the busy period: {_threads(c.get('thread_cpu', {}), c['wall'])}")
        fl = r.get("finish_lag")
        if fl:
            lines.append(f"  core's report of a request's last token -> client has read the response's end, "
                         f"p50/p90/max over {fl['n']}: {fl['p50'] * 1e3:.1f}/{fl['p90'] * 1e3:.1f}/{fl['max'] * 1e3:.1f} ms")
        fe = r.get("front")
        if fe:
            lines.append(f"  front end, {fe['messages']} output messages: core -> reader thread p50/p90/max "
                         + "/".join(f"{fe['read_lag'][k] * 1e3:.1f}" for k in ("p50", "p90", "max"))
                         + " ms, core -> processed on the event loop "
                         + "/".join(f"{fe['loop_lag'][k] * 1e3:.1f}" for k in ("p50", "p90", "max"))
                         + f" ms (last message {fe['last_loop_lag'] * 1e3:.1f} ms)")
            lines.append(f"  front-end threads, CPU over {fe['span']:.2f} s of messages: "
                         f"{_threads(fe['thread_cpu'], fe['span'])}")
            if "gc" in fe:
                lines.append(f"  garbage collections in the front end: {fe['gc']}")
            arr = {k: v for k, v in fe.get("arrivals", {}).items() if v}
            if arr:
                lines.append("  after the first send (s), first/median/last: " + "; ".join(
                    f"{k} {v[0]:.3f}/{sorted(v)[len(v) // 2]:.3f}/{v[-1]:.3f} ({len(v)})"
                    for k, v in arr.items()))
    else:
        lines.append(f"  main thread CPU over the run: {_threads(c.get('thread_cpu', {}), r['wall'])}")
        lines.append(f"  output processing (front end, in-process) "
                     f"{c['t'].get('output processing', 0) * 1e3 / max(c['steps'], 1):.3f} ms per step")
    lines.append("  engine core, ms per step:")
    lines.append(per_step_table(c, r["wall"]))
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-child":
        from server.cli import main as serve
        prof = os.environ.get("BENCH_CORE_OVERHEAD_PROFILE")  # cProfile of the front end
        if not prof:
            sys.exit(serve(sys.argv[2:]))
        import cProfile
        profiler = cProfile.Profile()
        rc = profiler.runcall(serve, sys.argv[2:])
        profiler.dump_stats(prof)
        sys.exit(rc)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["both", "offline", "http"], default="both")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=100)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="as serve and LLM run on a GPU (their CPU default is off)")
    p.add_argument("--client", choices=["raw", "httpx"], default="raw",
                   help="raw: a minimal asyncio client that counts SSE events; httpx: bench_serving.py's")
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="sys.setswitchinterval of the stepping process (the engine core's; offline, "
                        "this one) and of the server: how long a thread may hold the GIL while "
                        "another waits (Python's default 5 ms)")
    p.add_argument("--front-gc-threshold", type=int, nargs=3, default=None, metavar=("G0", "G1", "G2"),
                   help="gc.set_threshold of the server (front end) process (Python's default 700 10 10)")
    p.add_argument("--client-shards", type=int, default=None,
                   help="httpx client: clients the requests are shared among (default: one per 32 "
                        "requests, as bench_serving.py; 1: one pool for all, its cost grows as N^2)")
    p.add_argument("--tokenizer", action="store_true", help="load the tiny model's tokenizer (detokenize)")
    p.add_argument("--echo-logprobs", type=int, default=None, metavar="K",
                   help="lm_eval's loglikelihood requests: echo with logprobs K over HTTP, prompt_logprobs K "
                        "offline (use with --output-len 1 --no-stream)")
    p.add_argument("--device-ms", type=float, default=0.0, help="imaginary device time per step")
    p.add_argument("--device-us-per-token", type=float, default=0.0, help="and per scheduled token")
    p.add_argument("--host-ms", type=float, default=0.0,
                   help="host CPU time (busy Python holding the GIL) added to each step's launch")
    p.add_argument("--host-us-per-token", type=float, default=0.0, help="and per scheduled token")
    p.add_argument("--prefill-host-ms", type=float, default=0.0,
                   help="and per step that schedules prompt tokens (eager on the GPU: no CUDA graph)")
    p.add_argument("--api-server-count", type=int, default=1, help="serve's: HTTP processes")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args()
    sys.path.insert(0, str(REPO / "scripts"))
    print(f"{a.num_prompts} x ({a.input_len} in, {a.output_len} out), max_num_seqs {a.max_num_seqs}, "
          f"{'streamed' if a.stream else 'not streamed'}, async scheduling {'on' if a.async_scheduling else 'off'}, "
          f"device {a.device_ms} ms + {a.device_us_per_token} us/token per step, host {a.host_ms} ms + "
          f"{a.host_us_per_token} us/token + {a.prefill_host_ms} ms with prompt tokens, {a.client} client", flush=True)
    res = {}
    if a.mode in ("both", "offline"):
        res["offline"] = run_offline(a)
        print(report("offline", res["offline"], a), flush=True)
    if a.mode in ("both", "http"):
        res["http"] = run_http(a)
        print(report("HTTP", res["http"], a), flush=True)
    if len(res) == 2:
        print(f"HTTP / offline req/s: {res['offline']['wall'] / res['http']['wall']:.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": res}, indent=2))


if __name__ == "__main__":
    main()
