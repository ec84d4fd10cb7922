"""The `serve` CLI: every flag documented, bad flags and combinations refused in one line."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from server.cli import build_parser, engine_args_from
from tests.server_fixtures import REPO, TINY_MODEL

FLAGS = ["--model", "--host", "--port", "-tp", "--tensor-parallel-size", "-dcp",
         "--decode-context-parallel-size", "--max-num-batched-tokens", "--max-num-seqs",
         "--max-model-len", "--block-size", "--dtype", "--device", "--load-format", "--tokenizer",
         "--served-model-name", "--api-key", "--gpu-memory-utilization", "--num-kv-blocks",
         "--enable-prefix-caching", "--no-enable-prefix-caching", "--enforce-eager", "--seed",
         "--log-level", "--attention-backend", "--cpu-kv-cache-gb", "--hf-overrides"]


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
    defaults = engine_args_from(build_parser().parse_args(["--model", str(TINY_MODEL)]))
    assert defaults.enable_prefix_caching and defaults.max_num_batched_tokens == 2048
    assert defaults.async_scheduling is None  # auto: on with CUDA
    with pytest.raises(ValueError, match="async_scheduling"):
        dataclasses.replace(defaults, async_scheduling=1)
    for flag, want in (("--async-scheduling", True), ("--no-async-scheduling", False)):
        ns = build_parser().parse_args(["--model", str(TINY_MODEL), flag])
        assert engine_args_from(ns).async_scheduling is want


@pytest.mark.parametrize("argv,needle", [
    (["--model", "/no/such/dir"], "--model"),
    (["-tp", "3", "-dcp", "2"], "--decode-context-parallel-size"),
    (["-tp", "0"], "--tensor-parallel-size"),
    (["--block-size", "24"], "--block-size"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--dtype", "int4"], "--dtype"),
    (["--port", "notaport"], "--port"),
    (["--hf-overrides", "{bad json"], "--hf-overrides"),
    (["--device", "cuda", "-tp", "64"], "--"),
])
def test_bad_flags_exit_with_one_line(argv, needle):
    if "--model" not in argv:
        argv = ["--model", str(TINY_MODEL), *argv]
    out = serve(*argv)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("serve: error:"), out.stderr
