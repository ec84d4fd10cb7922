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


def test_w8a8_splitk_interpreter():
    """The split-K kernel against the dequantized product (fp32, exact to 1e-5, so one K block
    skipped or counted twice fails by far): one, three and 16 rows; split counts that divide the
    8 K blocks and ones that do not, one block per split; partial N tiles; a K tail (K 1000 and
    200); M-major scales; forced tiles, and two row tiles at 33 rows."""
    for M in (1, 3, 16):
        for splits in (2, 3, 5, 8):
            check(M, 200, 1024, "cpu", 8e-2, splits=splits)
        check(M, 300, 1000, "cpu", 8e-2, splits=3)  # K tail: the last block has 104 columns
        check(M, 128, 200, "cpu", 8e-2, splits=2, m_major=True)
    check(5, 256, 768, "cpu", 8e-2, splits=4, tile=(16, 128))
    check(33, 130, 640, "cpu", 8e-2, splits=3, tile=(32, 64))


def test_w8a8_splitk_equals_unsplit():
    """Split and unsplit products agree to fp32 rounding (the sums are only grouped differently),
    and a split product is the same bits on a second run."""
    torch.manual_seed(0)
    for M, N, K, splits in ((1, 192, 1152, 4), (3, 200, 1000, 3), (16, 64, 896, 7)):
        xq, sx = act_quant(torch.randn(M, K) * (1 + 4 * torch.rand(M, 1)))
        wq, sw = quantize(torch.randn(N, K) * 0.05)
        one = w8a8_block_gemm(xq, sx, wq, sw, torch.float32, splits=1)
        split = w8a8_block_gemm(xq, sx, wq, sw, torch.float32, splits=splits)
        assert ((split - one).norm() / one.norm()).item() < 1e-6, (M, N, K, splits)
        assert torch.equal(split, w8a8_block_gemm(xq, sx, wq, sw, torch.float32, splits=splits))


def test_w8a8_splitk_quantizing_x_equals_act_quant_then_split():
    """fp8_gemm_fuse_act: the split-K kernel quantizing x itself gives the bits of the act_quant
    kernel followed by the split kernel (both under the interpreter, whose e4m3 rounding they
    share): one, three and 16 rows, a K tail, partial N tiles. Without an SM count (the CPU) no
    split is chosen, so fp8_linear keeps act_quant there."""
    from models.fp8_gemm import _act_quant_triton, fused_act_splitk
    torch.manual_seed(1)
    for M, N, K, splits in ((1, 192, 1152, 4), (3, 200, 1000, 3), (16, 64, 896, 7)):
        x = torch.randn(M, K) * (1 + 4 * torch.rand(M, 1))
        wq, sw = quantize(torch.randn(N, K) * 0.05)
        want = w8a8_block_gemm(*_act_quant_triton(x), wq, sw, torch.float32, splits=splits)
        got = fused_act_splitk(x, wq, sw, splits=splits)
        assert got.dtype == torch.float32 and torch.equal(got, want), (M, N, K, splits)
    wq, sw = quantize(torch.randn(128, 256))
    assert fused_act_splitk(torch.randn(2, 256), wq, sw) is None
    with pytest.raises(ValueError, match="splits of 2 K blocks"):
        fused_act_splitk(torch.randn(2, 256), wq, sw, splits=3)


def test_w8a8_splitk_serial_reduce_is_the_reduce_launch_bit_for_bit():
    """fp8_gemm_splitk_serial: each output tile's last program sums the split partials (no reduce
    launch) and gives the bits of the reduce kernel, with x quantized before or in the kernel;
    the tile counters are all back at zero after every launch (the next launch relies on it),
    and a forced tile too small for the counters is refused."""
    from models.fp8_gemm import _act_quant_triton, fused_act_splitk
    from models.fp8_gemm_splitk import SERIAL_TILES, tile_counters
    torch.manual_seed(2)
    counters = tile_counters(torch.device("cpu"), 1)
    for M, N, K, splits, tile in ((1, 192, 1152, 4, None), (3, 200, 1000, 3, None), (16, 64, 896, 7, None),
                                  (33, 130, 640, 3, (32, 64)), (5, 256, 768, 4, (16, 128))):
        x = torch.randn(M, K) * (1 + 4 * torch.rand(M, 1))
        wq, sw = quantize(torch.randn(N, K) * 0.05)
        xq, sx = _act_quant_triton(x)
        want = w8a8_block_gemm(xq, sx, wq, sw, torch.float32, splits=splits, tile=tile)
        got = w8a8_block_gemm(xq, sx, wq, sw, torch.float32, splits=splits, tile=tile, serial=True)
        assert torch.equal(got, want), (M, N, K, splits)
        assert not counters.any()
        fused = fused_act_splitk(x, wq, sw, splits=splits, tile=tile, serial=True)
        assert torch.equal(fused, want) and not counters.any(), (M, N, K, splits)
    assert counters.numel() == SERIAL_TILES and tile_counters(torch.device("cpu"), 5) is counters
    with pytest.raises(ValueError, match="output tiles"):
        tile_counters(torch.device("cpu"), SERIAL_TILES + 1)


def test_w8a8_splitk_serial_last_program_alone_writes_the_output(monkeypatch):
    """The counters order the serial sum: with the split buffers poisoned with NaN, a normal
    launch reads only partials already stored (finite output equal to the reduce launch's), and
    with a tile's counter set as if three of its four splits had finished, the first program
    takes itself for the last and sums partials not yet stored (NaN); the other tile is unchanged."""
    import models.fp8_gemm as g
    from models.fp8_gemm_splitk import tile_counters
    torch.manual_seed(3)
    x = torch.randn(2, 512)
    wq, sw = quantize(torch.randn(128, 512) * 0.05)  # two tiles of 64
    xq, sx = act_quant(x)
    want = w8a8_block_gemm(xq, sx, wq, sw, torch.float32, splits=4)

    class PoisonedTorch:  # models.fp8_gemm's torch, its fp32 buffers NaN instead of uninitialised
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*shape, dtype=None, device=None):
            return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(g, "torch", PoisonedTorch())
    assert torch.equal(w8a8_block_gemm(xq, sx, wq, sw, torch.float32, splits=4, serial=True), want)
    counters = tile_counters(torch.device("cpu"), 1)
    counters[0] = 3
    try:
        early = w8a8_block_gemm(xq, sx, wq, sw, torch.float32, splits=4, serial=True)
    finally:
        counters.zero_()
    assert early[:, :64].isnan().all() and torch.equal(early[:, 64:], want[:, 64:])


def test_w8a16_interpreter():
    """The weight-streaming FP8 kernel (models/fp8_w8a16.py) against x @ the dequantized weight,
    fp32, exact to 1e-5 (a K step or scale block skipped or misplaced fails by far): one to 16
    rows of different magnitudes, partial column tiles, K tails inside a scale block and across
    one, forced tiles; and its argument checks."""
    from models.fp8 import dequantize
    from models.fp8_w8a16 import w8a16_linear
    torch.manual_seed(2)
    for M, N, K, tile in ((1, 300, 256, None), (5, 128, 200, None), (16, 384, 1000, None),
                          (3, 200, 384, (32, 128)), (7, 256, 640, (64, 256)), (2, 130, 136, (16, 32))):
        x = torch.randn(M, K) * (0.1 + 10 * torch.rand(M, 1))
        wq, sw = quantize(torch.randn(N, K) * 0.05)
        want = x @ dequantize(wq, sw, (128, 128)).T
        got = w8a16_linear(x, wq, sw, tile=tile)
        assert got.dtype == torch.float32 and got.shape == (M, N)
        assert ((got - want).norm() / want.norm()).item() < 1e-5, (M, N, K, tile)
    wq, sw = quantize(torch.randn(128, 256))
    with pytest.raises(ValueError, match="at most 16"):
        w8a16_linear(torch.randn(17, 256), wq, sw)
    with pytest.raises(ValueError, match="must divide"):
        w8a16_linear(torch.randn(2, 256), wq, sw, tile=(48, 64))
    with pytest.raises(ValueError, match="does not fit"):
        w8a16_linear(torch.randn(2, 256), wq, sw[:, :1])
