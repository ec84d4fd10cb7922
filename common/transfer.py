"""Copies between host and device that never make the host wait for the GPU.

A plain `.to("cuda")` of pageable memory synchronizes with the stream: with a step in flight
(async scheduling) it would wait for that step to end. Staged through pinned memory (torch's
caching host allocator, which keeps a buffer until its copy has run) the copy is queued on the
stream and the host moves on.
"""

from __future__ import annotations

import torch


def to_host(t: torch.Tensor) -> torch.Tensor:
    """Queue a device -> host copy of t without waiting (CUDA: into pinned memory, which torch
    allocates for a non-blocking copy to the CPU); read it only after the stream has passed it."""
    return t.to("cpu", non_blocking=True) if t.is_cuda else t


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`values` (a list or numpy array) as a `dtype` tensor on `device`, without a host sync."""
    t = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
