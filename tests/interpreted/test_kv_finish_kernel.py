"""The fused cache-row kernel on small CPU shapes: the checks of tests/test_triton_kv_finish.py."""

from __future__ import annotations

import torch
from test_triton_kv_finish import check


def test_kv_finish_interpreter():
    for T in (1, 7, 20):
        check(T, 32, 16, 4, torch.float32, "cpu", 1e-6)
    check(5, 48, 12, 16, torch.float32, "cpu", 1e-6)  # widths that are not powers of two
    check(0, 32, 16, 4, torch.float32, "cpu", 1e-6)
