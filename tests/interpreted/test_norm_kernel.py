"""The Triton RMSNorm and residual add + RMSNorm on small CPU shapes: the checks of
tests/test_triton_norm.py (fp32 and fp16; the interpreter's bf16 is not trusted)."""

from __future__ import annotations

import pytest
import torch
from test_triton_norm import check


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,D", [(1, 16), (5, 48), (4, 100)])
def test_norm_kernels_interpreter(T, D, dtype):
    check("cpu", dtype, T, D)
    check("cpu", dtype, T, D, strided=True)
