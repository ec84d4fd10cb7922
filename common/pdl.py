"""Programmatic dependent launch (PDL, sm_90+) for the decode path's Triton kernels.

A decode step is a chain of small kernels, each waiting for the one before. Launched with PDL
(`--kernels ...,pdl=1`), a kernel's CTAs may start while its predecessor is still finishing: each
kernel first signals that its successor may launch (`griddepcontrol.launch_dependents`: the
successor starts once every CTA of this kernel has signalled or exited), then waits until its
predecessor has completed and its writes are visible (`griddepcontrol.wait`) before it touches
memory. What overlaps is the launch and CTA set-up, not the work, so every read and write stays
after the wait and the kernels' results are those without PDL. A kernel whose predecessor is not
PDL-aware (a cuBLAS GEMM) simply starts when it ends.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from common.launch_settings import pdl


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """The first statement of a PDL-aware kernel: let the successor launch, wait for the
    predecessor. Nothing when PDL is off."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


_ON, _OFF = {"PDL": True, "launch_pdl": True}, {"PDL": False}  # unpacked at each launch, never changed


def pdl_launch() -> dict:
    """Keyword arguments for launching a PDL-aware kernel: its PDL flag and, when on, the launch
    attribute (one of two constant dicts: no work per launch beyond the lookup)."""
    return _ON if pdl() else _OFF
