"""PDL (common/pdl.py) in the PTX of a decode-path kernel compiled for sm_90 on the CPU: with PDL
the kernel signals its successor and then waits for its predecessor, at exit it only waits,
without it neither; and the launch dicts follow the process settings."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import common.launch_settings as ls  # noqa: E402
from common.pdl import pdl_launch  # noqa: E402


def _ptx(mode: int) -> str:
    import common.triton_norm as tn
    fn = tn._rms_norm_kernel.kernel  # the JITFunction under common/triton_launch's wrapper
    const = dict(ADD=False, KT=0, BLOCK_D=2048, PDL=mode)
    sig = {n: "constexpr" if n in const else "*bf16" if n.endswith("_ptr") else "fp32" if n == "eps" else "i32"
           for n in fn.arg_names}
    return triton.compile(ASTSource(fn, sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                          options={"launch_pdl": bool(mode)}).asm["ptx"]


@pytest.mark.parametrize("mode,signals,waits", [(0, 0, 0), (1, 1, 1), (2, 0, 1)])
def test_the_signal_and_the_wait(mode, signals, waits):
    ptx = _ptx(mode)
    assert ptx.count("griddepcontrol.launch_dependents") == signals
    assert ptx.count("griddepcontrol.wait") == waits


def test_launch_dicts_follow_the_settings(monkeypatch):
    monkeypatch.setattr(ls, "_pdl", False)
    monkeypatch.setattr(ls, "_pdl_multi_wave_at_exit", True)
    assert pdl_launch() == pdl_launch(multi_wave=True) == {"PDL": 0}
    monkeypatch.setattr(ls, "_pdl", True)
    assert pdl_launch() == {"PDL": 1, "launch_pdl": True}
    assert pdl_launch(multi_wave=True) == {"PDL": 2, "launch_pdl": True}
    monkeypatch.setattr(ls, "_pdl_multi_wave_at_exit", False)
    assert pdl_launch(multi_wave=True) == {"PDL": 1, "launch_pdl": True}
