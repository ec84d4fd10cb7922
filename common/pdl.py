"""Programmatic dependent launch (PDL, sm_90+) for the decode path's Triton kernels.

A decode step is a chain of small kernels, each waiting for the one before. Launched with PDL
(`--kernels ...,pdl=1`), a kernel's CTAs may start while its predecessor is still finishing: each
kernel first signals that its successor may launch (`griddepcontrol.launch_dependents`: the
successor starts once every CTA of this kernel has signalled or exited), then waits until its
predecessor has completed and its writes are visible (`griddepcontrol.wait`) before it touches
memory. What overlaps is the launch and CTA set-up, not the work, so every read and write stays
after the wait and the kernels' results are those without PDL. A kernel whose predecessor is not
PDL-aware (a cuBLAS GEMM) simply starts when it ends.

With the plan's `pdl_prefetch`, kernels whose first bytes no predecessor writes (a projection's
weight slice, the MLA decode's first cache pages) ask L2 for them between the signal and the wait
(`pdl_prologue_prefetch`): a hint with no result, so the outputs stay those without it, and the
loads after the wait start from L2 instead of HBM.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from common.launch_settings import pdl, pdl_prefetch


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """The first statement of a PDL-aware kernel: let the successor launch, wait for the
    predecessor. Nothing when PDL is off."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def l2_prefetch(ptr, nbytes):
    """Ask L2 for the `nbytes` (a multiple of 16) from `ptr` (16-byte aligned): one
    `cp.async.bulk.prefetch.L2` (sm_90+), issued by the program's thread 0 only (the bulk unit
    fetches the whole range; every thread issuing it would repeat the request). A hint: no result,
    no wait; what it fetches may be stale (L2 is where the GPU's writes land, so a later load still
    sees the latest bytes), but the range must lie inside an allocation."""
    tl.inline_asm_elementwise(
        "{\n\t.reg .pred p;\n\t.reg .b32 t;\n\tmov.u32 t, %tid.x;\n\tsetp.eq.u32 p, t, 0;\n\t"
        "@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\t}\n\tmov.u32 $0, 0;",
        "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def pdl_prologue_prefetch(PDL: tl.constexpr, PREFETCH: tl.constexpr, ptr, nbytes):
    """`pdl_prologue` with an L2 prefetch of bytes no predecessor writes (a weight slice) between
    the successor's signal and the wait: while the predecessor drains, this kernel's first loads
    are already on their way, so they hit L2 after the wait instead of starting from HBM."""
    if PDL:
        gdc_launch_dependents()
        if PREFETCH:
            l2_prefetch(ptr, nbytes)
        gdc_wait()


_ON, _OFF = {"PDL": True, "launch_pdl": True}, {"PDL": False}  # unpacked at each launch, never changed
_PF_ON, _PF_OFF = {"PREFETCH": True}, {"PREFETCH": False}


def pdl_launch() -> dict:
    """Keyword arguments for launching a PDL-aware kernel: its PDL flag and, when on, the launch
    attribute (one of two constant dicts: no work per launch beyond the lookup)."""
    return _ON if pdl() else _OFF


def prefetch_launch(aligned: bool = True) -> dict:
    """The PREFETCH flag of a kernel with `pdl_prologue_prefetch`: on when PDL and the plan's
    `pdl_prefetch` are, and the kernel's prefetched ranges are 16-byte aligned multiples of 16
    bytes (`aligned`, the caller's check)."""
    return _PF_ON if aligned and pdl() and pdl_prefetch() else _PF_OFF


def contiguous_rows(t) -> bool:
    """Whether any run of rows of `t`'s last two dims is one contiguous, 16-byte aligned range of
    a multiple of 16 bytes: what one bulk prefetch of a weight slice needs."""
    row_bytes = t.shape[-1] * t.element_size()
    return (t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] and row_bytes % 16 == 0 and t.data_ptr() % 16 == 0
            and all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1]))
