"""Shared helpers for the benchmark scripts: engine construction, random prompts, JSON output."""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

V2_LITE = str(Path(__file__).resolve().parent.parent / "configs" / "models" / "DeepSeek-V2-Lite")


def add_engine_flags(p) -> None:
    p.add_argument("--model", default=V2_LITE)
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV cache block (default: the engine's)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--piecewise-graph-sizes", default=None,
                   help="the engine's --piecewise-graph-sizes (auto | none | N,N,..; default: the engine's)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step N+1 while step N runs (default: on with CUDA)")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--kernel-plan", default="auto", help="the engine's --kernels (kernel plan)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("-dcp", "--decode-context-parallel-size", type=int, default=1)
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="the MoE layers' routed experts split by expert over the -tp ranks (serve's flag)")
    p.add_argument("--hf-overrides", default=None)
    p.add_argument("--fp8-gemm", action=argparse.BooleanOptionalAction, default=None,
                   help="keep FP8 checkpoints' projections in FP8 (W8A8 GEMM); unset: the engine's choice")
    p.add_argument("-q", "--quantization", choices=["fp8"], default=None,
                   help="fp8: the weights in FP8, a bf16 checkpoint's quantized at load (serve's flag)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="prefix caching (default: the engine's, on)")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="no tokenizer (token-id prompts only): for checkpoints without tokenizer files")
    p.add_argument("--json", default=None, help="write results here")


def engine_kwargs(a) -> dict:
    kw = dict(model=a.model, load_format=a.load_format, dtype=a.dtype, max_model_len=a.max_model_len,
              max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs,
              enforce_eager=a.enforce_eager, async_scheduling=a.async_scheduling,
              attention_backend=a.attention_backend, kernels=a.kernel_plan,
              gpu_memory_utilization=a.gpu_memory_utilization, tensor_parallel_size=a.tensor_parallel_size,
              decode_context_parallel_size=a.decode_context_parallel_size,
              enable_expert_parallel=a.enable_expert_parallel)
    if a.hf_overrides:
        kw["hf_overrides"] = a.hf_overrides
    if getattr(a, "piecewise_graph_sizes", None) is not None:
        kw["piecewise_graph_sizes"] = a.piecewise_graph_sizes
    if a.fp8_gemm is not None:
        kw["fp8_gemm"] = a.fp8_gemm
    if getattr(a, "quantization", None) is not None:
        kw["quantization"] = a.quantization
    if getattr(a, "block_size", None) is not None:
        kw["block_size"] = a.block_size
    if getattr(a, "enable_prefix_caching", None) is not None:
        kw["enable_prefix_caching"] = a.enable_prefix_caching
    if getattr(a, "skip_tokenizer_init", False):
        kw["skip_tokenizer_init"] = True
    return kw


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, length), generator=g).tolist()


def start_decodes(core, batch: int, prefix: str, seed: int) -> list[str]:
    """Add `batch` greedy requests of random 1000-token prompts (ids `prefix`0.., generating until
    aborted) to the engine core and step until every running request has its first token, so
    that the next steps are pure decodes. Returns their ids."""
    from engine import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    ids = [f"{prefix}{i}" for i in range(batch)]
    for rid, prompt in zip(ids, random_prompts(batch, 1000, core.cfg.vocab_size, seed=seed)):
        core.add_request(rid, prompt, sp)
    while core.scheduler.stats.num_waiting or any(r.num_output_tokens == 0 for r in core.scheduler.running):
        core.step()
    return ids


def step_ms(core, steps: int) -> float:
    """ms per engine step over `steps` steps, the GPU idle at the start."""
    import torch
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step()
    return (time.perf_counter() - t0) / steps * 1e3


def environment() -> dict:
    import torch
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "command": " ".join(sys.argv)}


def print_tuned_configs() -> None:
    """The Triton autotuner's choice per MoE kernel and key (models/fused_moe.py tuned_configs)."""
    from models.fused_moe import tuned_configs
    for name, got in tuned_configs().items():
        for key, cfg in got.items():
            print(f"tuned {name} {key}: {cfg}")


def write_json(path: str | None, payload: dict) -> None:
    path = path or (os.path.join(os.environ["OUT"], "bench.json") if "OUT" in os.environ else None)
    if path:
        Path(path).write_text(json.dumps(payload, indent=2))


def graph_us(fn, calls: list, reps: int = 20) -> float:
    """Device µs per call with the calls captured in one CUDA graph (as the engine runs decode),
    so host launch overhead is not in the figure. Give calls that read different weights (other
    experts, other copies of a matrix), so they stream from HBM as in a real step, where the
    other layers evict them from L2."""
    import torch  # here, not at the top: the serving client imports this module too
    for args in calls:  # autotune and warm up outside capture
        fn(*args)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            for args in calls:
                fn(*args)
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(calls))


def replay_ms(graphs, batch: int, reps: int = 20) -> float:
    """ms per replay of the decode CUDA graph (engine/cuda_graph.py DecodeGraphs) that serves
    `batch` sequences of one query token each, replayed alone; nan without such a graph."""
    import torch
    b = None if graphs is None else graphs.bucket_for(batch)
    if b is None:
        return float("nan")
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        graphs.graphs[b, 1].replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc, url: str, timeout_s: float, log_path: Path | None = None, poll_s: float = 1.0) -> None:
    """Wait until a started `serve` answers /health with 200; exit naming the cause if the process
    dies first (with the tail of its log) or `timeout_s` passes."""
    import httpx
    deadline = time.time() + timeout_s
    while True:
        if proc.poll() is not None:
            tail = ":\n" + log_path.read_text()[-4000:] if log_path is not None else ""
            raise SystemExit(f"serve exited with {proc.returncode} during start-up{tail}")
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            raise SystemExit(f"serve did not become healthy in {timeout_s} s")
        time.sleep(poll_s)


def stop_server(proc, timeout_s: float) -> None:
    """SIGINT (serve's graceful shutdown), then a kill if it takes longer than `timeout_s`."""
    import signal
    import subprocess
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
