"""The decode kernel's tile choice by query rows (heads x q_len): a plain function of the shape."""

from __future__ import annotations

import pytest
import torch

from attention.kv_quant import FP8_DTYPE
from attention.triton_decode import WIDE_ROWS, default_decode_config

H200_SMEM = 227 * 1024


@pytest.mark.parametrize("cache_dtype", [None, torch.bfloat16, FP8_DTYPE])
@pytest.mark.parametrize("heads,q_len,wide", [(16, 1, False), (32, 1, False), (128, 1, True), (64, 1, True),
                                              (16, 4, True), (8, 2, False), (256, 1, True)])
def test_rows_pick_the_tile_regime(heads, q_len, wide, cache_dtype):
    """16-row tiles while the cache's bytes bound the kernel; 64-row tensor-core tiles from
    WIDE_ROWS query rows on, whether the rows are heads or multi-token decode's tokens."""
    cfg = default_decode_config(heads * q_len, torch.bfloat16, smem_bytes=H200_SMEM, cache_dtype=cache_dtype)
    assert (heads * q_len >= WIDE_ROWS) == wide
    assert cfg.block_h == (64 if wide else 16)
    assert cfg.num_warps == (8 if wide else 4)


def test_fp32_compute_keeps_small_tiles():
    assert default_decode_config(128, torch.float32, smem_bytes=H200_SMEM).block_h == 16
