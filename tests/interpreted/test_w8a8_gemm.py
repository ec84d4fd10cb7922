"""The block-FP8 W8A8 GEMM kernels on small CPU shapes: the checks of tests/test_fp8_gemm.py."""

from __future__ import annotations

import pytest
import torch
from test_fp8_gemm import check

from models.fp8 import quantize
from models.fp8_gemm import act_quant, w8a8_block_gemm


def test_w8a8_interpreter():
    """Partial blocks in M, N and K under TRITON_INTERPRET=1: the pointer kernel (default and
    128-wide tiles, row-major and M-major activation scales) and the persistent TMA kernel."""
    for M, N, K in ((1, 300, 256), (5, 128, 200), (33, 64, 384)):
        check(M, N, K, "cpu", 8e-2)
        check(M, N, K, "cpu", 8e-2, m_major=True)
    for M, N, K in ((3, 384, 256), (17, 300, 200)):  # N 300: a partial tile; K 200: a partial K block
        check(M, N, K, "cpu", 8e-2, tile=(16, 128))
    # persistent TMA kernel: 4 programs over 6 tiles (some take two), partial tiles in M and N
    for M, N, K, mm in ((130, 300, 256, True), (40, 128, 384, False)):
        check(M, N, K, "cpu", 8e-2, tma=True, m_major=mm)
    with pytest.raises(ValueError, match="must divide"):
        w8a8_block_gemm(*act_quant(torch.randn(2, 128)), *quantize(torch.randn(128, 128)), tile=(16, 256))
