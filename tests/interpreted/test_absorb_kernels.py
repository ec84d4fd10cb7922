"""The absorbed decode's per-head product kernels on small CPU shapes: the checks of
tests/test_triton_absorb.py."""

from __future__ import annotations

import torch
from test_triton_absorb import check, check_fused, check_merged


def test_absorb_kernels_interpreter():
    """Small shapes (P and R not powers of two, V below one tile), and the real widths at T 80
    (several L, V and T tiles: the loops and the rope copy's one-tile condition)."""
    for T in (1, 5, 17):
        check(T, 4, 16, 8, 32, 16, torch.float32, "cpu", 1e-6)
    check(3, 2, 24, 12, 48, 20, torch.float32, "cpu", 1e-6)
    check(19, 20, 16, 8, 32, 16, torch.float32, "cpu", 1e-6)  # heads over two partial tiles
    check(80, 2, 128, 64, 512, 128, torch.float32, "cpu", 1e-6)


def test_absorb_q_kv_finish_interpreter():
    """The one-launch absorb_q + kv_finish: q and the cache bytes equal to the two kernels'
    (several row and latent tiles; bf16-free: the interpreter's fp32 and fp16, and an FP8 cache)."""
    for T in (1, 5, 17):
        check_fused(T, 4, 16, 8, 32, 4, torch.float32, "cpu")
    check_fused(6, 3, 24, 16, 48, 16, torch.float16, "cpu")
    check_fused(5, 2, 16, 8, 32, 4, torch.float32, "cpu", fp8=True)


def test_absorb_o_merge_interpreter():
    """The split merge folded into absorb_o: one chunk of splits (BT 16 and 64 row tiles), several
    chunks (17 and 40 splits in 16-row tiles, 12 in 64-row tiles: the engine's case past 16 decode
    rows), a partial V tile, strided partials; fp32 against reduce_splits + absorb_o."""
    check_merged(3, 4, 2, 32, 16, torch.float32, "cpu", 1e-5)
    check_merged(5, 17, 3, 48, 20, torch.float32, "cpu", 1e-5, po_pad=8)
    check_merged(20, 3, 2, 64, 32, torch.float32, "cpu", 1e-5)
    check_merged(2, 40, 1, 32, 16, torch.float32, "cpu", 1e-5)
    check_merged(20, 12, 1, 32, 16, torch.float32, "cpu", 1e-5)  # 64-row tiles, chunks of 8 splits
