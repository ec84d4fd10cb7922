"""PDL's L2 prefetch (`--kernels ...,pdl_prefetch=1`): where it sits in the compiled kernels and how
the plan refuses it where it cannot act. Its effect on the outputs (none) is checked on the GPU
(tests/test_gpu_engine.py test_pdl_equals_no_pdl); here the kernels are compiled for sm_90 on the
CPU (Triton lowers to PTX without a GPU) and the PTX is read: each prefetch must come after the
successor's signal and before the wait for the predecessor, and nothing else may load before the
wait in the kernels whose prefetch is a weight slice."""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from engine import LLM  # noqa: E402

FLOATS = {"qk_scale_log2", "o_scale", "eps", "inv_scale"}
INT64_PTRS = {"slot_ptr"}


def kernel_fn(k):
    """The JITFunction under common/triton_launch's fast-launch wrapper (or `k` itself)."""
    return getattr(k, "kernel", k)


def _ptx(fn, const: dict, ptr_types: dict | None = None, **options) -> str:
    """PTX of `fn` for sm_90 with `const` as its constexprs: pointers bf16 (or as `ptr_types`
    says) and 16-byte aligned, float scalars fp32, other scalars i32."""
    ptr_types = ptr_types or {}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ptr_types.get(name, "*i64" if name in INT64_PTRS else "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    k = triton.compile(ASTSource(fn, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4, num_stages=2) | options)
    return k.asm["ptx"]


def _prologue(ptx: str) -> tuple[list[str], list[str]]:
    """(the instructions between launch_dependents and the wait, those before launch_dependents)."""
    lines = [line.strip() for line in ptx.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith("griddepcontrol.launch_dependents"))
    wait = next(i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait"))
    assert start < wait
    return lines[start + 1:wait], lines[:start]


def _is_prefetch(line: str) -> bool:
    """A bulk L2 prefetch, predicated on thread 0 (common/pdl.py l2_prefetch)."""
    return re.match(r"@p cp\.async\.bulk\.prefetch\.L2\.global ", line) is not None


def _skinny(prefetch: bool) -> str:
    import models.skinny_gemm as sg
    return _ptx(sg._skinny_gemm_kernel, dict(M_BUCKET=16, IEEE=False, PDL=True, PREFETCH=prefetch,
                                             BLOCK_N=32, BLOCK_K=256))


def _absorb_o(prefetch: bool) -> str:
    import attention.triton_absorb as ta
    return _ptx(kernel_fn(ta._absorb_o_kernel), dict(H=16, L=512, V=128, BL=128, BV=32, BT=16, IEEE=False,
                                                     PDL=True, PREFETCH=prefetch))


def _absorb_q_kv(prefetch: bool) -> str:
    import attention.triton_absorb as ta
    return _ptx(kernel_fn(ta._absorb_q_kv_finish_kernel),
                dict(H=16, P=128, L=512, R=64, BP=128, BL=32, BR=64, BT=16, IEEE=False, PAGE=16, LKV=512, RK=64,
                     BLOCK_L=512, BLOCK_H=32, IS_FP8=False, PDL=True, PREFETCH=prefetch),
                {"cs_ptr": "*fp32", "nw_ptr": "*bf16", "slot_ptr": "*i64"}, num_stages=1)


def _decode(prefetch: bool) -> str:
    import triton.language as tl

    import attention.triton_decode as td
    const = dict(PAGE=16, LKV=512, R=64, BLOCK_L=512, BLOCK_R=64, BLOCK_H=16, BLOCK_N=32, PRECISION="tf32",
                 QK_T=False, PREFETCH_IDS=True, DIRECT=True, HAS_POS=False, WARP_SPECIALIZE=False, FP8=False,
                 PRODUCT_DTYPE=tl.bfloat16, RELOAD_V=False, HW_CVT=False, STAGE_V=False, STAGE_C=False,
                 QK_FP8=False, LAZY=False, TAU=8.0, PDL=True, PREFETCH=prefetch, PF_PAGES=8)
    return _ptx(kernel_fn(td._mla_decode_partial_kernel), const,
                {"block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "q_pos_ptr": "*i32", "lse_ptr": "*fp32"})


WEIGHT_KERNELS = {"skinny_gemm": _skinny, "absorb_o": _absorb_o, "absorb_q_kv_finish": _absorb_q_kv}


@pytest.mark.parametrize("name", sorted(WEIGHT_KERNELS))
def test_weight_prefetch_sits_between_the_signal_and_the_wait(name):
    """The weight kernels ask L2 for their slice after letting the successor launch and before
    waiting; they load nothing before the wait (their inputs are the predecessor's outputs), and
    without PREFETCH the prologue is the signal and the wait alone."""
    between, before = _prologue(WEIGHT_KERNELS[name](True))
    assert any(_is_prefetch(line) for line in between), between
    assert not any(re.match(r"ld\.global|cp\.async(?!\.bulk\.prefetch)", line) for line in between + before)
    assert not any("prefetch" in line for line in before)
    between, _ = _prologue(WEIGHT_KERNELS[name](False))
    assert not any("prefetch" in line or line.startswith("ld.global") for line in between)


def test_decode_prefetches_its_first_pages_before_the_wait():
    """The MLA decode reads its sequence's length and block ids before the wait (written before
    the step, never by a predecessor) and asks L2 for those pages; the cache rows themselves are
    loaded after it."""
    ptx = _decode(True)
    between, _ = _prologue(ptx)
    assert any(_is_prefetch(line) for line in between)
    assert any(line.startswith("ld.global") for line in between)  # the length and the ids
    assert not any(line.startswith("cp.async.cg") or line.startswith("cp.async.ca") for line in between)
    between, _ = _prologue(_decode(False))
    assert not any("prefetch" in line or line.startswith("ld.global") for line in between)


def test_pdl_prefetch_is_refused_where_it_cannot_act(tiny_v2):
    """pdl_prefetch acts between PDL's signal and wait (and PDL, like the bulk prefetch, needs
    sm_90+): without PDL the start-up stops naming the setting."""
    with pytest.raises(ValueError, match=r"pdl_prefetch=1 acts only under programmatic dependent launch"):
        LLM(tiny_v2[0], device="cpu", dtype="float32", kernels="torch,pdl_prefetch=1")
