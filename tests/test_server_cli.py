"""The `serve` CLI: every flag documented, bad flags and combinations refused in one line."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server.cli import build_parser, engine_args_from
from tests.server_fixtures import REPO, TINY_MODEL, ServeProcess, metric, side_by_side

FLAGS = ["--model", "--host", "--port", "-tp", "--tensor-parallel-size", "-dcp",
         "--decode-context-parallel-size", "--max-num-batched-tokens", "--max-num-seqs",
         "--max-model-len", "--block-size", "--dtype", "--device", "--load-format", "--tokenizer",
         "--served-model-name", "--api-key", "--gpu-memory-utilization", "--num-kv-blocks",
         "--enable-prefix-caching", "--no-enable-prefix-caching", "--enforce-eager", "--piecewise-graph-sizes", "--seed",
         "--log-level", "--attention-backend", "--cpu-kv-cache-gb", "--hf-overrides", "--speculative-config",
         "--shutdown-timeout", "--max-request-body-bytes", "--http-header-timeout",
         "--http-body-timeout", "--http-keep-alive-timeout", "--max-prompts-per-request",
         "--max-seqs-per-request", "--max-stop-strings", "--max-stop-str-len",
         "--engine-stall-timeout"]


def serve(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_help_explains_every_flag():
    parser = build_parser()
    documented = {s: a.help for a in parser._actions for s in a.option_strings}
    for flag in FLAGS:
        assert flag in documented, flag
        assert documented[flag] and len(documented[flag]) > 10, flag
    out = serve("--help")
    assert out.returncode == 0 and all(f in out.stdout for f in FLAGS)


def test_flags_map_to_engine_args():
    ns = build_parser().parse_args([
        "--model", str(TINY_MODEL), "-tp", "4", "-dcp", "2", "--max-num-batched-tokens", "16",
        "--max-num-seqs", "8", "--max-model-len", "300", "--block-size", "32", "--dtype",
        "float32", "--device", "cpu", "--load-format", "dummy", "--served-model-name", "tiny",
        "--num-kv-blocks", "100", "--no-enable-prefix-caching", "--enforce-eager", "--seed", "7",
        "--attention-backend", "torch", "--cpu-kv-cache-gb", "0.5",
        "--hf-overrides", '{"num_hidden_layers": 2}'])
    a = engine_args_from(ns)
    assert (a.tensor_parallel_size, a.decode_context_parallel_size) == (4, 2)
    assert (a.max_num_batched_tokens, a.max_num_seqs, a.max_model_len, a.block_size) == (16, 8, 300, 32)
    assert (a.dtype, a.device, a.load_format, a.model_name) == ("float32", "cpu", "dummy", "tiny")
    assert (a.num_kv_blocks, a.enable_prefix_caching, a.enforce_eager, a.seed) == (100, False, True, 7)
    assert (a.attention_backend, a.cpu_kv_cache_gb, a.hf_overrides) == ("torch", 0.5, {"num_hidden_layers": 2})
    # vLLM's name for the block count
    vllm = build_parser().parse_args(["--model", str(TINY_MODEL), "--num-gpu-blocks-override", "64"])
    assert engine_args_from(vllm).num_kv_blocks == 64
    defaults = engine_args_from(build_parser().parse_args(["--model", str(TINY_MODEL)]))
    assert defaults.enable_prefix_caching and defaults.max_num_batched_tokens == 2048
    assert defaults.async_scheduling is None  # auto: on with CUDA
    with pytest.raises(ValueError, match="async_scheduling"):
        dataclasses.replace(defaults, async_scheduling=1)
    ns = build_parser().parse_args(["--model", str(TINY_MODEL), "--speculative-config",
                                    '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}'])
    spec = engine_args_from(ns).speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 2, 4)
    assert defaults.speculative_config is None
    for flag, want in (("--async-scheduling", True), ("--no-async-scheduling", False)):
        ns = build_parser().parse_args(["--model", str(TINY_MODEL), flag])
        assert engine_args_from(ns).async_scheduling is want


BAD_FLAGS = [
    (["--model", "/no/such/dir"], "--model"),
    (["-tp", "3", "-dcp", "2"], "--decode-context-parallel-size"),
    (["-tp", "0"], "--tensor-parallel-size"),
    (["--block-size", "24"], "--block-size"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--dtype", "int4"], "--dtype"),
    (["--port", "notaport"], "--port"),
    (["--hf-overrides", "{bad json"], "--hf-overrides"),
    (["--device", "cuda", "-tp", "64"], "--"),
    (["--max-request-body-bytes", "0"], "--max-request-body-bytes"),
    (["--engine-stall-timeout", "0"], "--engine-stall-timeout"),
    (["--speculative-config", '{"method": "ngram"}'], "num_speculative_tokens"),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}', "--async-scheduling"],
     "--async-scheduling"),
]


@pytest.fixture(scope="module")
def bad_flag_runs():
    """`serve` on each of BAD_FLAGS' argv, four at a time (each is a process importing torch on
    its own): {argv: its CompletedProcess}."""
    argvs = [tuple(argv if "--model" in argv else ["--model", str(TINY_MODEL), *argv]) for argv, _ in BAD_FLAGS]
    with ThreadPoolExecutor(4) as pool:
        return dict(zip(argvs, pool.map(lambda argv: serve(*argv), argvs)))


@pytest.mark.parametrize("argv,needle", BAD_FLAGS)
def test_bad_flags_exit_with_one_line(argv, needle, bad_flag_runs):
    if "--model" not in argv:
        argv = ["--model", str(TINY_MODEL), *argv]
    out = bad_flag_runs[tuple(argv)]
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("serve: error:"), out.stderr


def test_port_in_use_fails_before_the_model_loads():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        out = serve("--model", str(TINY_MODEL), "--device", "cpu", "--port", str(port))
        took = time.monotonic() - t0
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1, out.stderr
    assert len(lines) == 1 and lines[0].startswith("serve: error:") and str(port) in lines[0], lines
    assert took < 30


def _children(pid: int) -> set[int]:
    kids = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids |= {int(k) for k in f.read().split()}
    return kids


def _core(pid: int) -> int:
    """serve's engine core: its one child started by multiprocessing's spawn (not a resource tracker)."""
    cores = []
    for k in _children(pid):
        with open(f"/proc/{k}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                cores.append(k)
    (core,) = cores
    return core


def _descendants(pid: int) -> set[int]:
    """Every process under pid: the engine core, its rank workers, resource trackers."""
    kids = _children(pid)
    for k in list(kids):
        if os.path.exists(f"/proc/{k}"):
            kids |= _descendants(k)
    return kids


def _alive(pids) -> list[int]:
    out = []
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().split()[2] != "Z":
                    out.append(p)
        except FileNotFoundError:
            pass
    return out


@pytest.fixture(scope="module")
def drain_servers():
    """A -tp 2 `serve` for each signal below, the two started side by side."""
    flags = ("--model", str(TINY_MODEL), "--device", "cpu", "--dtype", "float32", "-tp", "2",
             "--num-kv-blocks", "64", "--max-model-len", "256", "--shutdown-timeout", "60")
    with side_by_side(ServeProcess(*flags), ServeProcess(*flags)) as (term, interrupt):
        yield {signal.SIGTERM: term, signal.SIGINT: interrupt}


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signals_drain_and_stop_every_worker(sig, drain_servers):
    max_tokens = 64
    s = drain_servers[sig]
    workers = _descendants(s.proc.pid)
    assert len(workers) >= 3  # the engine core, its two ranks (and resource trackers)
    core = _core(s.proc.pid)
    result = {}
    body = {"prompt": "Mia has", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    t = threading.Thread(target=lambda: result.setdefault(
        "r", httpx.post(f"{s.url}/v1/completions", json=body, timeout=120)))
    t.start()
    deadline = time.monotonic() + 30
    while True:  # the signal goes once the request runs, however fast or slow the machine
        m = httpx.get(f"{s.url}/metrics", timeout=30).text
        if metric(m, "mla_serve_num_requests_running") == 1:
            break
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.01)
    s.proc.send_signal(sig)
    rc = s.proc.wait(timeout=120)
    t.join(60)
    assert rc == 0 and not _alive([core])  # serve joined its engine core before exiting
    assert result["r"].status_code == 200  # drained, not cut
    assert result["r"].json()["usage"]["completion_tokens"] == max_tokens
    # serve has joined the core and the ranks before exiting; multiprocessing's resource
    # trackers leave once they see their pipes close: none may outlive that by more than a moment
    deadline = time.monotonic() + 5
    while _alive(workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(workers)
