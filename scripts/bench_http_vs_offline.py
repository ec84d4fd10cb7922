"""HTTP against offline on one workload: bench_throughput, then `serve` + bench_serving, one table.

Runs, one after the other on this machine (each in its own process, so the GPU is free between
them):
  1. scripts/bench_throughput.py with the engine flags below: offline `LLM.generate` req/s;
  2. `python -m server` with the same engine flags, then scripts/bench_serving.py against it with
     the same request count and shape (all sent at once unless --max-concurrency): HTTP req/s and
     TTFT / TPOT / ITL / e2e percentiles;
  3. with --single-stream N (default 10; 0: skip): the same server at concurrency 1 (N requests
     one after the other: TTFT and TPOT p50), against the offline batch-1 TPOT of
     scripts/bench_latency.py with the same engine flags;
and prints both with the HTTP / offline ratios. Results go to --out-dir (default $OUT or .).

    python scripts/bench_http_vs_offline.py                          # V2-Lite dummy, 1000 x (1000 in, 100 out)
    python scripts/bench_http_vs_offline.py --num-prompts 200 --serve-arg=--async-scheduling
    python scripts/bench_http_vs_offline.py --model configs/models/tiny-deepseek-v3 --load-format auto \\
        --device cpu --num-prompts 32 --input-len 64 --output-len 16 --max-model-len 512   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"

# bench_common's engine flags, each also a `serve` flag of the same name: (flag, takes a value)
ENGINE_FLAGS = [("--model", True), ("--load-format", True), ("--dtype", True),
                ("--max-model-len", True), ("--max-num-batched-tokens", True),
                ("--max-num-seqs", True), ("--attention-backend", True),
                ("--gpu-memory-utilization", True), ("--tensor-parallel-size", True),
                ("--decode-context-parallel-size", True), ("--hf-overrides", True)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sys.path.insert(0, str(SCRIPTS))
    from bench_common import add_engine_flags
    add_engine_flags(p)
    p.add_argument("--device", default=None, help="passed to serve (bench_throughput uses its default)")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=100)
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="bench_serving's cap on requests in flight (default: all at once)")
    p.add_argument("--single-stream", type=int, default=10,
                   help="requests sent one at a time after the main run (0: skip that phase)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="extra flag for `serve` only, e.g. --serve-arg=--skip-tokenizer-init")
    p.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds to wait for /health")
    p.add_argument("--out-dir", default=os.environ.get("OUT", "."), help="JSON results and logs go here")
    return p.parse_args(argv)


def engine_argv(a: argparse.Namespace, serve: bool = False) -> list[str]:
    """The engine flags for the offline scripts (bench_common's names), or with `serve` for
    `serve`, whose name of the kernel plan flag is --kernels."""
    out = []
    for flag, _ in ENGINE_FLAGS:
        v = getattr(a, flag.lstrip("-").replace("-", "_"))
        if v is not None:
            out += [flag, str(v)]
    if a.enforce_eager:
        out.append("--enforce-eager")
    if a.async_scheduling is not None:
        out.append("--async-scheduling" if a.async_scheduling else "--no-async-scheduling")
    if a.fp8_gemm is not None:
        out.append("--fp8-gemm" if a.fp8_gemm else "--no-fp8-gemm")
    out += ["--kernels" if serve else "--kernel-plan", a.kernel_plan]
    if a.enable_prefix_caching is not None:
        out.append("--enable-prefix-caching" if a.enable_prefix_caching else "--no-enable-prefix-caching")
    if a.skip_tokenizer_init:
        out.append("--skip-tokenizer-init")
    if a.enable_expert_parallel:
        out.append("--enable-expert-parallel")
    return out


def workload_argv(a: argparse.Namespace) -> list[str]:
    return ["--num-prompts", str(a.num_prompts), "--input-len", str(a.input_len),
            "--output-len", str(a.output_len)]


def run(cmd: list[str], log: Path) -> None:
    print("+", " ".join(cmd), flush=True)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.stdout.write(log.read_text()[-4000:])
        raise SystemExit(f"{cmd[1]} failed with exit code {rc} (log: {log})")


def offline(a: argparse.Namespace, out: Path) -> dict:
    path = out / "offline.json"
    run([sys.executable, str(SCRIPTS / "bench_throughput.py"), *engine_argv(a), *workload_argv(a),
         "--json", str(path)], out / "offline.log")
    return json.loads(path.read_text())["results"]


def serving(a: argparse.Namespace, out: Path) -> dict:
    from bench_common import free_port, stop_server, wait_healthy  # scripts/ is on sys.path (parse_args)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "server", *engine_argv(a, serve=True), "--port", str(port),
           *(["--device", a.device] if a.device else []), *a.serve_arg]
    print("+", " ".join(cmd), flush=True)
    log = open(out / "serve.log", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, url, a.startup_timeout, out / "serve.log")
        path = out / "serving.json"
        run([sys.executable, str(SCRIPTS / "bench_serving.py"), "--base-url", f"{url}/v1",
             *workload_argv(a), *(["--max-concurrency", str(a.max_concurrency)]
                                  if a.max_concurrency else []),
             "--json", str(path)], out / "bench_serving.log")
        main = json.loads(path.read_text())["results"][0]["summary"]
        single = None
        if a.single_stream:
            path = out / "serving_single.json"
            run([sys.executable, str(SCRIPTS / "bench_serving.py"), "--base-url", f"{url}/v1",
                 "--num-prompts", str(a.single_stream), "--input-len", str(a.input_len),
                 "--output-len", str(a.output_len), "--max-concurrency", "1", "--json", str(path)],
                out / "bench_serving_single.log")
            single = json.loads(path.read_text())["results"][0]["summary"]
        return main, single
    finally:
        stop_server(proc, 120)
        log.close()


def offline_batch1(a: argparse.Namespace, out: Path) -> float:
    """Offline batch-1 TPOT (ms) with the same engine flags and prompt length."""
    path = out / "latency.json"
    run([sys.executable, str(SCRIPTS / "bench_latency.py"), *engine_argv(a), "--batch-sizes", "1",
         "--prompt-len", str(a.input_len), "--decode-steps", str(a.output_len), "--json", str(path)],
        out / "latency.log")
    return json.loads(path.read_text())["results"][0]["tpot_ms"]


def single_table(single: dict, tpot1: float) -> str:
    t, f = single["tpot"]["p50_ms"], single["ttft"]["p50_ms"]
    return (f"concurrency 1 ({single['completed']} requests): TTFT p50 {f:.1f} ms, TPOT p50 {t:.3f} ms; "
            f"offline batch-1 TPOT {tpot1:.3f} ms; HTTP / offline TPOT {t / tpot1:.3f}")


def table(off: dict, http: dict, a: argparse.Namespace) -> str:
    def ms(k: str, s: str) -> str:
        v = http[k][f"{s}_ms"]
        return "-" if v is None or isinstance(v, str) else f"{v:.1f}"

    lines = [f"{a.num_prompts} x ({a.input_len} in, {a.output_len} out), model {a.model}",
             f"{'':<10}{'req/s':>10}{'out tok/s':>12}",
             f"{'offline':<10}{off['requests_per_s']:>10.2f}{off['output_tokens_per_s']:>12.0f}",
             f"{'HTTP':<10}{http['request_throughput']:>10.2f}{http['output_throughput']:>12.0f}"
             f"   ({http['completed']} ok, {http['failed']} failed)",
             f"HTTP / offline: {http['request_throughput'] / off['requests_per_s']:.3f}",
             f"engine steps with tokens: offline {off.get('num_steps', '-')} ({off.get('step_tokens', '-')} tokens), "
             f"HTTP {http.get('engine_steps', '-')} ({http.get('engine_step_tokens', '-')} tokens)",
             f"{'HTTP ms':<10}{'mean':>10}{'p50':>10}{'p99':>10}"]
    for k in ("ttft", "tpot", "itl", "e2e"):
        lines.append(f"{k.upper():<10}{ms(k, 'mean'):>10}{ms(k, 'p50'):>10}{ms(k, 'p99'):>10}")
    return "\n".join(lines)


def main(argv=None) -> None:
    a = parse_args(argv)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    off = offline(a, out)
    tpot1 = offline_batch1(a, out) if a.single_stream else None
    http, single = serving(a, out)
    text = table(off, http, a)
    if single is not None:
        text += "\n" + single_table(single, tpot1)
    print(text)
    (out / "http_vs_offline.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
