"""Programmatic dependent launch (PDL, sm_90+) for the decode path's Triton kernels.

A decode step is a chain of small kernels, each waiting for the one before. Launched with PDL
(`--kernels ...,pdl=1`), a kernel's CTAs may start while its predecessor is still finishing: each
kernel first signals that its successor may launch (`griddepcontrol.launch_dependents`: the
successor starts once every CTA of this kernel has signalled or exited), then waits until its
predecessor has completed and its writes are visible (`griddepcontrol.wait`) before it touches
memory. What overlaps is the launch and CTA set-up, not the work, so every read and write stays
after the wait and the kernels' results are those without PDL. A kernel whose predecessor is not
PDL-aware (a cuBLAS GEMM) simply starts when it ends.

With the plan's `pdl_multi_wave_at_exit`, the kernels that run in several waves at decode sizes
(the block MoE's two products) signal nothing: their successor may launch once every CTA has
exited, at their tail. Signalled at the start, a multi-wave kernel lets its successor launch
during its last wave, and the successor's CTAs fill SM slots as they free up and wait there,
unevenly spread when the predecessor ends (PDL cost 8.9% at batch 128 on an H200 that way, 0.7%
with every kernel signalling at exit: docs/kernel_notes.md). One-wave kernels keep the early
signal, where PDL's gain at small batches comes from.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from common.launch_settings import pdl, pdl_multi_wave_at_exit


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """The first statement of a PDL-aware kernel: let the successor launch, wait for the
    predecessor. Nothing when PDL is off."""
    if PDL:
        if PDL == 1:  # 2: at exit (no signal; every CTA's exit counts as one)
            gdc_launch_dependents()
        gdc_wait()


# PDL: 0 off, 1 signal at the start, 2 at exit; unpacked at each launch, never changed
_ON, _AT_EXIT, _OFF = {"PDL": 1, "launch_pdl": True}, {"PDL": 2, "launch_pdl": True}, {"PDL": 0}


def pdl_launch(multi_wave: bool = False) -> dict:
    """Keyword arguments for launching a PDL-aware kernel: its PDL mode and, when on, the launch
    attribute (one of three constant dicts: no work per launch beyond the lookups).
    `multi_wave`: the kernel runs in several waves at decode sizes, and signals at exit when the
    plan says so."""
    if not pdl():
        return _OFF
    return _AT_EXIT if multi_wave and pdl_multi_wave_at_exit() else _ON
