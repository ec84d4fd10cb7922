"""The one-kernel expert choice on small CPU shapes, every routing rule: the checks of
tests/test_triton_route.py."""

from __future__ import annotations

import pytest
import torch
from test_triton_route import CASES, check, check_norm_logits, check_ties


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,E,D", [(1, 16, 48), (5, 64, 100), (3, 8, 16)])
def test_norm_logits_kernel_interpreter(T, E, D, dtype):
    """moe_norm_in_router_max_tokens's kernel: the add + RMSNorm's and the logits kernel's bits."""
    check_norm_logits("cpu", dtype, T, E, D)
    check_norm_logits("cpu", dtype, T, E, D, strided=True)


def test_norm_logits_kernel_wide_rows_interpreter():
    """Past 2048 columns: one block for the norm and the logits (the logits kernel loops)."""
    check_norm_logits("cpu", torch.float32, 2, 8, 2100, exact_logits=False)
