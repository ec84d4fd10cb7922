"""Process-wide settings the Triton kernels read at launch: whether Triton interprets (tests on
the CPU), autotunes, and launches with programmatic dependent launch. Each but the first is set
from the kernel plan (common/kernel_plan.py) by the worker that builds the model, once, and read
at every launch; kernels called directly (benchmarks, kernel tests) see the defaults."""

from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, read once: grid sizes and split counts."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1: Triton kernels run on the CPU (tests, fp32 only). The one
    environment read of the kernel code: Triton itself reads it when imported, so it cannot be
    a flag of ours."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_autotune = True


def autotuning() -> bool:
    """Whether the Triton kernels tune their tiles per token bucket (else one fixed tile each).
    Triton's autotuners cache per process, so this is a process setting: the plan's `autotune`,
    set by `use_autotune` when a worker builds its model (on by default for kernels called
    directly, as in benchmarks); never under the interpreter."""
    return _autotune and not interpreting()


def use_autotune(on: bool) -> None:
    global _autotune
    _autotune = on


_pdl = False


def pdl() -> bool:
    """Whether the decode path's Triton kernels launch with programmatic dependent launch
    (common/pdl.py): a process setting, the plan's `pdl`, set by `use_pdl` when a worker builds
    its model (off by default, as for kernels called directly); never under the interpreter.
    Read at every launch of those kernels: the setting is resolved once, in `use_pdl`."""
    return _pdl


def use_pdl(on: bool) -> None:
    global _pdl
    _pdl = on and not interpreting()
