"""The few-row GEMM on small CPU shapes (fp32 and fp16): the checks of tests/test_skinny_gemm.py."""

from __future__ import annotations

import pytest
import torch
from test_skinny_gemm import check


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M,N,K", [(1, 16, 32), (5, 40, 100), (16, 33, 64), (17, 24, 48), (40, 16, 70)])
def test_skinny_gemm_interpreter(M, N, K, dtype):
    check("cpu", dtype, M, N, K)


def test_skinny_gemm_interpreter_strided_rows():
    check("cpu", torch.float32, 3, 24, 40, x_stride=56)
