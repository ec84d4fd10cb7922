"""Greedy sampling's two-launch argmax (common/triton_argmax.py) against torch's argmax."""

from __future__ import annotations

import pytest
import torch


def check(device: str, rows: int, n: int, dtype: torch.dtype = torch.float32) -> None:
    from common.triton_argmax import BLOCK, argmax_rows
    g = torch.Generator().manual_seed(rows * 31 + n)
    x = torch.randn(rows, n, generator=g)
    # ties across blocks and within one (the first index wins), +inf, NaN (wins over everything,
    # first NaN), a row of -inf only, a row whose best value sits in the last, partial block
    if rows > 1:
        x[1, [3, n - 1]] = 50.0
    if rows > 2 and n > BLOCK:
        x[2, [BLOCK + 5, 7]] = float("inf")
    if rows > 3:
        x[3, [n // 2, n - 2, 1]] = float("nan")
        x[3, 0] = float("inf")
    if rows > 4:
        x[4] = float("-inf")
    if rows > 5:
        x[5, n - 1] = 99.0
    x = x.to(device, dtype)
    got = argmax_rows(x)
    want = x.float().cpu().argmax(dim=-1)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got.cpu(), want), (got.cpu(), want)


def test_argmax_rows_refuses_what_it_cannot_take():
    from common.triton_argmax import argmax_rows
    with pytest.raises(ValueError, match="contiguous rows"):
        argmax_rows(torch.randn(4, 6).T)
    with pytest.raises(ValueError, match="2-d float"):
        argmax_rows(torch.zeros(3, dtype=torch.int64))
    assert argmax_rows(torch.zeros(0, 5)).shape == (0,)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 128, 300])
@pytest.mark.parametrize("n", [102400, 129280, 3000])
def test_argmax_rows_gpu(rows, n):
    check("cuda", rows, n)


@pytest.mark.gpu
def test_argmax_rows_gpu_bf16():
    check("cuda", 9, 102400, torch.bfloat16)
