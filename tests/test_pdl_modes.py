"""PDL (common/pdl.py) in the PTX of a decode-path kernel compiled for sm_90 on the CPU: with PDL
the kernel signals its successor and then waits for its predecessor, without it neither; and the
launch dicts follow the process setting."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import common.launch_settings as ls  # noqa: E402
from common.pdl import pdl_launch  # noqa: E402


def _ptx(on: bool) -> str:
    import common.triton_norm as tn
    fn = tn._rms_norm_kernel.kernel  # the JITFunction under common/triton_launch's wrapper
    const = dict(ADD=False, KT=0, BLOCK_D=2048, PDL=on)
    sig = {n: "constexpr" if n in const else "*bf16" if n.endswith("_ptr") else "fp32" if n == "eps" else "i32"
           for n in fn.arg_names}
    return triton.compile(ASTSource(fn, sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                          options={"launch_pdl": on}).asm["ptx"]


@pytest.mark.parametrize("on", [False, True])
def test_the_signal_and_the_wait(on):
    ptx = _ptx(on)
    assert ptx.count("griddepcontrol.launch_dependents") == ptx.count("griddepcontrol.wait") == int(on)


def test_launch_dicts_follow_the_setting(monkeypatch):
    monkeypatch.setattr(ls, "_pdl", False)
    assert pdl_launch() == {"PDL": False}
    monkeypatch.setattr(ls, "_pdl", True)
    assert pdl_launch() == {"PDL": True, "launch_pdl": True}
