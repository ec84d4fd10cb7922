"""Profiling a running engine (vLLM's `--profiler-config` and its `/start_profile` and
`/stop_profile` routes).

`ProfilerConfig` is vLLM's JSON object, checked. Between a start and a stop every rank records:
with `"profiler": "torch"` a torch.profiler trace of its process (CPU ops, and CUDA kernels on a
GPU), written at the stop as Chrome-trace JSON (gzipped by default; Perfetto and
chrome://tracing read it) to `torch_profiler_dir`, one file a rank, and its per-op time table
beside it; with `"profiler": "cuda"` cudaProfilerStart / Stop around the span, for `nsys profile
--capture-range=cudaProfilerApi`.

The engine core decides when (engine/core.py): `delay_iterations` engine steps after the start
before recording, and with `max_iterations` a stop of its own after that many steps.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, fields

import torch

from common.args import json_object

log = logging.getLogger(__name__)

PROFILERS = ("torch", "cuda")


@dataclass(frozen=True)
class ProfilerConfig:
    profiler: str
    torch_profiler_dir: str = ""
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    torch_profiler_dump_cuda_time_total: bool = True  # the per-op table beside each trace
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    delay_iterations: int = 0  # engine steps after /start_profile before recording
    max_iterations: int = 0  # engine steps recorded before a stop of its own (0: until /stop_profile)
    ignore_frontend: bool = False  # accepted (vLLM's): the HTTP front end is never profiled here

    @classmethod
    def parse(cls, value: dict | str | ProfilerConfig | None) -> ProfilerConfig | None:
        """From `--profiler-config` (a JSON object or a dict); ValueError naming the key. None,
        and an object whose profiler is null, mean no profiling."""
        if value is None or isinstance(value, ProfilerConfig):
            return value
        value = json_object(value, "--profiler-config")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"--profiler-config: unknown key(s) {unknown}; supported: {sorted(known)}")
        if value.get("profiler") is None:
            return None
        if value["profiler"] not in PROFILERS:
            raise ValueError(f"--profiler-config: profiler must be one of {list(PROFILERS)}, got {value['profiler']!r}")
        for name, v in value.items():
            want = known[name].type
            if want == "bool" and not isinstance(v, bool):
                raise ValueError(f"--profiler-config: {name} must be true or false, got {v!r}")
            if want == "int" and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"--profiler-config: {name} must be an integer >= 0, got {v!r}")
            if want == "str" and not isinstance(v, str):
                raise ValueError(f"--profiler-config: {name} must be a string, got {v!r}")
        cfg = cls(**value)
        if cfg.profiler == "torch" and not cfg.torch_profiler_dir:
            raise ValueError("--profiler-config: profiler 'torch' needs torch_profiler_dir, the directory "
                             "the traces are written to")
        return cfg


class RankProfiler:
    """One rank's side: start and stop recording; the stop writes the trace."""

    def __init__(self, cfg: ProfilerConfig, rank: int, device: torch.device) -> None:
        if cfg.profiler == "cuda" and device.type != "cuda":
            raise ValueError("--profiler-config: profiler 'cuda' (cudaProfilerStart/Stop, for nsys) needs a "
                             f"CUDA device, not {device}; use profiler 'torch'")
        if cfg.profiler == "torch":
            os.makedirs(cfg.torch_profiler_dir, exist_ok=True)  # a directory it cannot make fails at start-up
        self.cfg, self.rank, self.device = cfg, rank, device
        self._prof = None

    def apply(self, action: str) -> str | None:
        """"start" or "stop"; a stop returns the trace's path (None for the cuda profiler)."""
        return self.start() if action == "start" else self.stop()

    def start(self) -> None:
        if self.cfg.profiler == "cuda":
            torch.cuda.profiler.start()
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        c = self.cfg
        self._prof = torch.profiler.profile(activities=activities, record_shapes=c.torch_profiler_record_shapes,
                                            profile_memory=c.torch_profiler_with_memory,
                                            with_stack=c.torch_profiler_with_stack,
                                            with_flops=c.torch_profiler_with_flops)
        self._prof.start()

    def stop(self) -> str | None:
        if self.cfg.profiler == "cuda":
            torch.cuda.profiler.stop()
            return None
        prof, self._prof = self._prof, None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the kernels launched before the stop, recorded whole
        prof.stop()
        c = self.cfg
        stem = os.path.join(c.torch_profiler_dir, f"rank{self.rank}.{time.strftime('%Y%m%d-%H%M%S')}"
                                                  f".{time.time_ns() % 1_000_000_000:09d}")
        path = stem + ".pt.trace.json" + (".gz" if c.torch_profiler_use_gzip else "")
        t0 = time.perf_counter()
        prof.export_chrome_trace(path)  # torch gzips a path ending in .gz
        if c.torch_profiler_dump_cuda_time_total:
            key = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            with open(stem + ".ops.txt", "w") as f:
                f.write(prof.key_averages().table(sort_by=key, row_limit=100))
        log.info("rank %d: profile written to %s (%.1f s)", self.rank, path, time.perf_counter() - t0)
        return path


class ProfileControl:
    """The engine core's side: when the ranks record. `executor.profile(action)` starts or stops
    every rank and returns the stop's trace paths."""

    def __init__(self, cfg: ProfilerConfig | None, executor) -> None:
        self.cfg, self.executor = cfg, executor
        self.state = "off"  # off | waiting (delay_iterations) | on | done (stopped by max_iterations)
        self._wait = self._steps = 0
        self.traces: list[str] = []

    def _check(self) -> ProfilerConfig:
        if self.cfg is None:
            raise ValueError("profiling is off: start the server with --profiler-config")
        return self.cfg

    def start(self) -> None:
        cfg = self._check()
        if self.state in ("waiting", "on"):
            raise ValueError("the profiler is already running: /stop_profile first")
        self.state, self._wait, self._steps, self.traces = "waiting", cfg.delay_iterations, 0, []
        if not self._wait:
            self._begin()

    def stop(self) -> list[str]:
        """Stop recording (a profile still waiting out its delay recorded nothing); returns the
        traces written, also those of a profile that max_iterations stopped."""
        self._check()
        if self.state == "off":
            raise ValueError("the profiler is not running: /start_profile first")
        if self.state == "on":
            self._end()
        self.state = "off"
        return [t for t in self.traces if t]

    def after_step(self) -> None:
        """Count one engine step."""
        if self.state == "waiting":
            self._wait -= 1
            if self._wait <= 0:
                self._begin()
        elif self.state == "on" and self.cfg.max_iterations:
            self._steps += 1
            if self._steps >= self.cfg.max_iterations:
                self._end()
                self.state = "done"

    def _begin(self) -> None:
        self.executor.profile("start")
        self.state = "on"
        log.info("profiler started (%s)", self.cfg.profiler)

    def _end(self) -> None:
        self.traces = self.executor.profile("stop")
        log.info("profiler stopped: %s", ", ".join(t for t in self.traces if t) or "cudaProfilerStop")
