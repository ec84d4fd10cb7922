"""The L2 prefetch's addresses on the CPU: its probe mode visits what the PTX prefetches would ask
for (the interpreter runs no inline assembly), once each, at the right bytes."""

from __future__ import annotations

import pytest
import torch

from models.l2_prefetch import BULK, LINE, l2_prefetch


def expected_heads(ranges, unit):
    """Each unit's first 4 bytes, as int32, over the ranges in order."""
    out = []
    for t in ranges:
        if t is None:
            continue
        f = t.reshape(-1).view(torch.uint8)
        out += [f[o:o + 4].view(torch.int32).item() for o in range(0, f.numel(), unit)]
    return out


@pytest.mark.parametrize("policy", ["evict_normal", "bulk"])
def test_probe_visits_every_unit_once(policy):
    """Each unit once, its first bytes, and the byte counts a bulk prefetch asks for: whole units
    but each range's last, in (0, unit], whole 16 bytes, summing to the range."""
    unit = BULK if policy == "bulk" else LINE
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 300, 64, generator=g).to(torch.bfloat16)  # 38,400 bytes an expert
    flat = torch.randn(4000, generator=g).to(torch.bfloat16)
    cases = [
        (w[1:3], w[4]),  # two ranges: 76,800 and 38,400 bytes, a partial bulk chunk each
        (w[2], None),  # one range
        (w[0, :8], w[3, :5]),  # ranges shorter than a bulk chunk (1,024 and 640 bytes)
        (flat[:520], flat[1000:1024]),  # 1,040 and 48 bytes: a partial line each
    ]
    for a, b in cases:
        for programs, block in ((1, 16), (3, 16), (7, 64)):  # one program, a strided grid, a wide block
            count, head, size = l2_prefetch(a, b, policy=policy, programs=programs, block=block, probe=True)
            want = expected_heads((a, b), unit)
            assert count.numel() == len(want)
            assert bool((count == 1).all()), (programs, block)
            assert head.tolist() == want
            na = -(-a.numel() * 2 // unit)
            for part, t in ((size[:na], a), (size[na:], b)):
                n = 0 if t is None else t.numel() * 2
                assert int(part.sum()) == n
                assert bool((part > 0).all() and (part <= unit).all() and (part % 16 == 0).all())
                assert bool((part[:-1] == unit).all())  # only a range's last unit is cut


def test_ranges_must_be_contiguous_and_aligned():
    w = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch(w.t(), probe=True)
    with pytest.raises(ValueError, match="16-byte aligned and be whole 16 bytes"):
        l2_prefetch(w[0, 1:9], probe=True)
    with pytest.raises(ValueError, match="CUDA only"):
        l2_prefetch(w)
    count, head, size = l2_prefetch(w[:0], None, probe=True)  # nothing to ask for
    assert count.numel() == head.numel() == size.numel() == 0
