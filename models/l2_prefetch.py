"""Warm the GPU's L2 with weights that a later kernel of the step will read (CUDA sm_80+; bulk: sm_90).

A decode layer reads its bytes unevenly: the attention part (projections, the MLA decode, a dozen
kernels of a few µs each, bound by latency) leaves HBM mostly idle, then the MoE streams the
touched experts' weights at the copy rate. The shared experts' weights are known before the
router runs (every token takes them), so `l2_prefetch` asks the memory system for them while the
attention part runs, on a second stream: the MoE then finds them in L2, and its time is set by the
routed experts' bytes alone.

One program per `BLOCK` units a step, strided over the grid; each lane issues one prefetch:
- `evict_normal`: `prefetch.global.L2` of the unit's 128-byte line, at L2's normal priority;
- `evict_last`: the same with the evict-last priority (`prefetch.global.L2::evict_last`), meant
  to keep the lines over the attention's streamed reads. The CUDA guide ties that priority to the
  persisting-L2 set-aside (`cudaLimitPersistingL2CacheSize`, 0 unless a process sets it; this
  engine does not), so it may act as the normal one; and where a set-aside exists, nothing here
  lowers the lines' priority after the MoE has read them. Timing decides between the two;
- `bulk`: one `cp.async.bulk.prefetch.L2` per 4 KB chunk (sm_90; no cache hint: normal
  priority), the range's last chunk cut to its end.
Nothing is written, so the kernel needs no ordering with the readers for correctness; how far
ahead it runs is its whole point. Nothing is allocated either (the side stream runs it inside
CUDA-graph captures).

`probe=True` (the tests, and the interpreter, which runs no inline assembly) visits the same
units with real loads: it counts each unit's visits and keeps its first 4 bytes and the byte count
a bulk prefetch would ask for, so a test can check that every unit of every range is visited
once, at the right address, and that the sizes cover the ranges exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.launch_settings import interpreting

LINE = 128  # bytes per L2 line request
BULK = 4096  # bytes per bulk prefetch instruction
POLICIES = ("evict_normal", "evict_last", "bulk")
_ASM = {
    "evict_normal": "prefetch.global.L2 [$1]; mov.u32 $0, 0;",
    "evict_last": "prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;",
    "bulk": "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
}


@triton.jit
def _l2_prefetch_kernel(a_ptr, a_bytes, b_ptr, b_bytes, count_ptr, head_ptr, size_ptr,
                        UNIT: tl.constexpr, BLOCK: tl.constexpr, ASM: tl.constexpr, PROBE: tl.constexpr):
    """Units (lines, or bulk chunks) of range a (a_bytes long), then those of range b; program p
    takes units p*BLOCK.., then p*BLOCK + grid*BLOCK.., and so on."""
    pid = tl.program_id(0)
    a_units = tl.cdiv(a_bytes, UNIT)
    total = a_units + tl.cdiv(b_bytes, UNIT)
    for start in range(pid * BLOCK, total, tl.num_programs(0) * BLOCK):
        idx = start + tl.arange(0, BLOCK)
        valid = idx < total
        idx = tl.minimum(idx, total - 1)  # past the end: the last unit again (no mask on the asm)
        in_a = idx < a_units
        off_a = tl.where(in_a, idx, 0).to(tl.int64) * UNIT
        off_b = tl.where(in_a, 0, idx - a_units).to(tl.int64) * UNIT
        ptrs = tl.where(in_a, a_ptr + off_a, b_ptr + off_b)
        # the unit's bytes: whole units but the range's last (bulk prefetches read exactly these)
        size = tl.minimum(tl.where(in_a, a_bytes - off_a, b_bytes - off_b), UNIT).to(tl.int32)
        if PROBE:
            tl.atomic_add(count_ptr + idx, 1, mask=valid)
            tl.store(head_ptr + idx, tl.load(ptrs.to(tl.pointer_type(tl.int32)), mask=valid), mask=valid)
            tl.store(size_ptr + idx, size, mask=valid)
        else:
            tl.inline_asm_elementwise(ASM, "=r,l,r", [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)


def _byte_range(t: torch.Tensor | None) -> tuple[torch.Tensor | None, int]:
    """(a uint8 view of `t`, its length in bytes); (None, 0) for no range."""
    if t is None or t.numel() == 0:
        return None, 0
    if not t.is_contiguous():
        raise ValueError(f"l2_prefetch: ranges must be contiguous, got strides {t.stride()} for {tuple(t.shape)}")
    flat = t.reshape(-1).view(torch.uint8)
    if flat.data_ptr() % 16 or flat.numel() % 16:
        raise ValueError(f"l2_prefetch: ranges must start 16-byte aligned and be whole 16 bytes, got "
                         f"{flat.numel()} bytes at {flat.data_ptr():#x}")
    return flat, flat.numel()


def l2_prefetch(a: torch.Tensor, b: torch.Tensor | None = None, policy: str = "evict_normal",
                programs: int = 32, block: int = 256, probe: bool = False):
    """Prefetch the bytes of contiguous tensors `a` and `b` into L2 on the current stream.

    With `probe`, returns (visits, first 4 bytes, byte counts), each `[units]` int32 over a's
    units then b's, where a unit is a 128-byte line (`bulk`: a 4 KB chunk, the range's last one cut
    to its end); else None, having allocated nothing. Ranges start 16-byte aligned and are whole
    16 bytes (as the bulk copy needs), so every unit's first 4 bytes lie in its range."""
    if policy not in _ASM:
        raise ValueError(f"l2_prefetch: policy {policy!r}, expected one of {POLICIES}")
    if not probe and (a.device.type != "cuda" or interpreting()):
        raise ValueError("l2_prefetch issues PTX prefetches: CUDA only (probe=True visits the same addresses)")
    unit = BULK if policy == "bulk" else LINE
    fa, na = _byte_range(a)
    fb, nb = _byte_range(b)
    if fa is None:
        fa, na, fb, nb = fb, nb, None, 0
    if fa is None:  # nothing to ask for
        return (torch.zeros(0, dtype=torch.int32, device=a.device),) * 3 if probe else None
    if fb is None:
        fb = fa
    total = -(-na // unit) + -(-nb // unit)
    out = (fa,) * 3  # not probing: the probe's pointers are never read or written
    if probe:
        out = tuple(torch.zeros(total, dtype=torch.int32, device=a.device) for _ in range(3))
    grid = (max(1, min(programs, triton.cdiv(total, block))),)
    _l2_prefetch_kernel[grid](fa, na, fb, nb, *out, UNIT=unit, BLOCK=block, ASM=_ASM[policy], PROBE=probe,
                              num_warps=4)
    return out if probe else None
