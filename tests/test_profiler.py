"""Profiling a running engine (engine/profiler.py): vLLM's --profiler-config checked, the core's
start / delay / stop schedule, and /start_profile + /stop_profile on the real tiny engine (its
core in a process of its own), then on two tensor- and two data-parallel ranks, each writing a torch trace."""

from __future__ import annotations

import asyncio
import gzip
import json
import os

import httpx
import pytest

from common.args import EngineArgs
from common.sampling_params import SamplingParams
from engine.profiler import ProfileControl, ProfilerConfig, RankProfiler
from tests.server_fixtures import TINY_MODEL


@pytest.mark.parametrize("value, message", [
    ("{", "not valid JSON"),
    ('["torch"]', "must be a JSON object"),
    ('{"profiler": "torch", "torch_profiler_dir": "/t", "depth": 1}', r"unknown key\(s\) \['depth'\]"),
    ('{"profiler": "nsys"}', "profiler must be one of"),
    ('{"profiler": "torch"}', "needs torch_profiler_dir"),
    ('{"profiler": "torch", "torch_profiler_dir": "/t", "torch_profiler_use_gzip": 1}',
     "torch_profiler_use_gzip must be true or false"),
    ('{"profiler": "torch", "torch_profiler_dir": "/t", "max_iterations": -1}',
     "max_iterations must be an integer >= 0"),
])
def test_profiler_config_refuses_bad_values(value, message):
    with pytest.raises(ValueError, match=f"--profiler-config.*{message}"):
        ProfilerConfig.parse(value)


def test_profiler_config_reads_vllm_keys():
    cfg = ProfilerConfig.parse('{"profiler": "torch", "torch_profiler_dir": "/t", "torch_profiler_with_stack": false, '
                               '"delay_iterations": 2, "ignore_frontend": true}')
    assert (cfg.torch_profiler_with_stack, cfg.torch_profiler_use_gzip, cfg.delay_iterations) == (False, True, 2)
    assert ProfilerConfig.parse('{"profiler": null}') is None and ProfilerConfig.parse(None) is None
    import torch
    with pytest.raises(ValueError, match="profiler 'cuda'.*needs a CUDA device"):
        RankProfiler(ProfilerConfig.parse('{"profiler": "cuda"}'), 0, torch.device("cpu"))


class _Ranks:
    """An executor's profile() that records the actions it was given."""

    def __init__(self):
        self.actions = []

    def profile(self, action):
        self.actions.append(action)
        return [f"trace{len(self.actions)}"] if action == "stop" else [None]


def test_control_waits_delay_iterations_and_stops_after_max_iterations():
    ranks = _Ranks()
    pc = ProfileControl(ProfilerConfig("torch", "/t", delay_iterations=2, max_iterations=3), ranks)
    pc.start()
    with pytest.raises(ValueError, match="already running"):
        pc.start()
    pc.after_step()
    assert ranks.actions == []  # one step of the delay left
    pc.after_step()
    assert ranks.actions == ["start"]  # the third step is the first recorded
    for _ in range(3):
        pc.after_step()
    assert ranks.actions == ["start", "stop"] and pc.state == "done"  # max_iterations reached
    pc.after_step()
    assert ranks.actions == ["start", "stop"]
    assert pc.stop() == ["trace2"]  # the traces of the profile max_iterations ended
    with pytest.raises(ValueError, match="not running"):
        pc.stop()
    pc.start()
    assert pc.stop() == []  # stopped in its delay: nothing recorded, no rank asked
    assert ranks.actions == ["start", "stop"]
    with pytest.raises(ValueError, match="start the server with --profiler-config"):
        ProfileControl(None, ranks).start()


def _trace_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def test_profile_routes_on_the_real_engine(tmp_path):
    """/start_profile, a completion, /stop_profile: one trace with the step's ops, and its op
    table; misuse is a 400; without --profiler-config the routes do not exist."""
    from types import SimpleNamespace

    from engine.async_llm import AsyncLLM
    from server.api_server import build_app

    config = json.dumps({"profiler": "torch", "torch_profiler_dir": str(tmp_path / "prof"),
                         "torch_profiler_with_stack": False})

    async def run(profiler_config):
        llm = AsyncLLM(EngineArgs(model=str(TINY_MODEL), device="cpu", num_kv_blocks=64,
                                  profiler_config=profiler_config))
        try:
            app = build_app(llm, SimpleNamespace(api_key="k"))
            auth = {"Authorization": "Bearer k"}
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                if profiler_config is None:
                    return (await c.post("/start_profile", headers=auth)).status_code
                got = [(await c.post("/stop_profile", headers=auth)).status_code,
                       (await c.post("/start_profile")).status_code,
                       (await c.post("/start_profile", headers=auth)).status_code]
                again = await c.post("/start_profile", headers=auth)
                r = await c.post("/v1/completions", headers=auth, json={"prompt": [5, 6, 7], "max_tokens": 3})
                assert r.status_code == 200
                stop = await c.post("/stop_profile", headers=auth)
                return got, again, stop
        finally:
            llm.shutdown()
    assert asyncio.run(run(None)) == 404
    got, again, stop = asyncio.run(run(config))
    assert got == [400, 401, 200]  # stop before start; no key; started
    assert again.status_code == 400 and "already running" in again.json()["error"]["message"]
    assert stop.status_code == 200
    [trace] = stop.json()["traces"]
    assert trace.endswith(".pt.trace.json.gz") and os.path.dirname(trace) == str(tmp_path / "prof")
    names = {e.get("name") for e in _trace_events(trace)}
    assert any(n and n.startswith("aten::") for n in names)  # the model's ops ran while it recorded
    assert os.path.exists(trace.replace(".pt.trace.json.gz", ".ops.txt"))


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"data_parallel_size": 2}])
def test_every_rank_writes_a_trace(tmp_path, layout):
    """-tp 2 and -dp 2 (two gloo processes), the offline LLM: each rank's trace; plain JSON
    without gzip."""
    from engine import LLM

    config = {"profiler": "torch", "torch_profiler_dir": str(tmp_path), "torch_profiler_use_gzip": False,
              "torch_profiler_dump_cuda_time_total": False, "torch_profiler_with_stack": False}
    llm = LLM(str(TINY_MODEL), device="cpu", dtype="float32", num_kv_blocks=32, profiler_config=config, **layout)
    try:
        llm.start_profile()
        llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2))
        traces = llm.stop_profile()
    finally:
        llm.engine.shutdown()
    assert sorted(os.path.basename(t).split(".")[0] for t in traces) == ["rank0", "rank1"]
    for t in traces:
        assert t.endswith(".pt.trace.json") and _trace_events(t)
    assert not any(name.endswith(".ops.txt") for name in os.listdir(tmp_path))


@pytest.mark.gpu
def test_a_gpu_trace_holds_the_kernels(tmp_path):
    """On a GPU the trace records the CUDA kernels too, and the op table sorts by their time."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from engine import LLM

    llm = LLM(str(TINY_MODEL), num_kv_blocks=64,
              profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path)})
    try:
        llm.start_profile()
        llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4))
        [trace] = llm.stop_profile()
    finally:
        llm.engine.shutdown()
    assert any(e.get("cat") == "kernel" for e in _trace_events(trace))
    with open(trace.replace(".pt.trace.json.gz", ".ops.txt")) as f:
        assert "CUDA" in f.read()
