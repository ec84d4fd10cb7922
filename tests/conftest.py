"""Shared fixtures: tiny transformers DeepSeek models built once per test session."""

from __future__ import annotations

import os
import sys

# One OpenMP thread per process, set before torch is imported (subprocesses inherit it): the
# suite runs on 2 cores and many tests start a server or rank processes beside the test
# process; 2 threads each oversubscribed the cores and made the suite ~2.5x slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))  # tests/ helpers (tiny_models)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from sharding import shard  # noqa: E402
from tiny_models import make_model  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--no-autotune", action="store_true",
                     help="GPU tests: one fixed tile per Triton kernel instead of tuning every test "
                          "shape (engines built by the tests then get --kernels ...,autotune=0)")
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run only the selected tests whose index is I modulo N (0 <= I < N): N runs "
                          "side by side, one per I, cover the selection once (scripts/gpu_check.sh quick; "
                          "on the CPU suite each shard holding an interpreter test starts that whole run)")


def pytest_configure(config):
    if config.getoption("--no-autotune"):
        from common.launch_settings import use_autotune
        use_autotune(False)


def pytest_unconfigure(config):
    import test_interpreted
    test_interpreted.stop(config)


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: the shards split what is selected
def pytest_collection_modifyitems(config, items):
    if config.getoption("--shard"):
        items[:], dropped = shard(items, config.getoption("--shard"))
        config.hook.pytest_deselected(items=dropped)
    interpreted = [item for item in items if item.nodeid.split("::")[0].endswith("test_interpreted.py")]
    if interpreted:
        import test_interpreted
        test_interpreted.start(config)  # the interpreter's run, in the background from now on
        # Its results are read last: the run takes minutes on one core, and every other test
        # runs on the other core meanwhile instead of after the wait.
        items.sort(key=lambda item: item in interpreted)  # stable: the others keep their order
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_v3(tmp_path_factory):
    """(path, hf model): V3 shape, q_lora set, sigmoid + bias + group top-k routing, YaRN."""
    path = tmp_path_factory.mktemp("tiny_v3")
    return str(path), make_model(path, "v3")


@pytest.fixture(scope="session")
def tiny_v2(tmp_path_factory):
    """(path, hf model): V2-Lite shape, no q_lora, softmax greedy routing, YaRN."""
    path = tmp_path_factory.mktemp("tiny_v2")
    return str(path), make_model(path, "v2")


@pytest.fixture(scope="session")
def tiny_v2_grouped(tmp_path_factory):
    """(path, hf model): V2 with group_limited_greedy routing (one group of four per token)."""
    path = tmp_path_factory.mktemp("tiny_v2g")
    return str(path), make_model(path, "v2", topk_method="group_limited_greedy", n_group=4, topk_group=1)
