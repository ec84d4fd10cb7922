"""The one-kernel expert choice on small CPU shapes, every routing rule: the checks of
tests/test_triton_route.py."""

from __future__ import annotations

import pytest
from test_triton_route import CASES, check, check_ties


@pytest.mark.parametrize("case", CASES)
def test_route_kernel_interpreter(case):
    check(case, "cpu")


def test_route_logits_kernel_loops_over_wide_rows():
    check(CASES[0], "cpu", T=3, D=2100)  # the logits kernel's K loop takes two passes, the second masked
    check(CASES[2], "cpu", T=1, D=200)


@pytest.mark.parametrize("case", CASES)
def test_route_fused_kernel_interpreter(case):
    """The one-launch router: tiles of 16 tokens (17: a second, mostly empty tile), the K loop in
    several steps and with a masked tail (D 200)."""
    check(case, "cpu", T=17, D=200, fused=True)
    check(case, "cpu", T=5, fused=True)


def test_route_ties_interpreter():
    check_ties("cpu")
