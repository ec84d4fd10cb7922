"""The expert choice and the block MoE's alignment in one launch (models/route_align.py,
moe_route_align_max_tokens) against the two launches it replaces: `route_choice`, then `align_pairs`."""

from __future__ import annotations

import pytest
import torch

from models.expert_sort import align_pairs
from models.route_align import ROUTE_ALIGN_MAX_ELEMS, route_align, route_align_fits
from models.triton_route import route_choice


def check(device, T, E, k, n_shared, block_m, sigmoid=False, norm=False, nan_rows=(), sort_shared=False):
    """Equal ids and blocks, weights within the softmax's rounding (its sums in another order);
    `sort_shared`: the shared experts' pairs sorted too, as `align_pairs` over all experts."""
    g = torch.Generator().manual_seed(T * 100 + E + k)
    logits = (torch.randn(T, E, generator=g) * 3).to(device)
    for r in nan_rows:
        logits[r] = float("nan")
    bias = (torch.randn(E, generator=g) * 0.1).to(device) if sigmoid else None
    args = (bias, "sigmoid" if sigmoid else "softmax", "greedy", 1)
    w, i, rows, bexp = route_align(logits, *args, k, norm, 2.5, n_shared, block_m, sort_shared)
    cw, ci = route_choice(logits, *args, 1, k, norm, 2.5, n_shared)
    want_rows, want_bexp = (align_pairs(ci, E + n_shared, block_m) if sort_shared else
                            align_pairs(ci, E, block_m, max_pairs=T * k))
    assert w.shape == i.shape == (T, k + n_shared) and i.dtype == torch.int64
    assert torch.equal(i, ci), (i, ci)
    torch.testing.assert_close(w, cw, rtol=1e-6, atol=1e-7, equal_nan=True)  # NaN rows: NaN weights in both
    assert torch.equal(rows, want_rows) and torch.equal(bexp, want_bexp)
    if T:  # every routed pair in exactly one block, of its own expert
        placed = rows[rows >= 0]
        sorted_k = k + n_shared if sort_shared else k
        assert sorted(placed.tolist()) == [t * (k + n_shared) + j for t in range(T) for j in range(sorted_k)]
        flat = i.flatten().cpu()
        for b, blk in enumerate(rows.view(-1, block_m).cpu()):
            real = blk[blk >= 0]
            sorted_e = E + n_shared if sort_shared else E
            assert bool((flat[real] == int(bexp[b])).all()) if int(bexp[b]) < sorted_e else real.numel() == 0

CASES = [  # (T, E, k, n_shared, block_m, sigmoid, norm, nan_rows, sort_shared)
    (5, 64, 6, 2, 16, False, False, (), False),  # V2-Lite at batch 5, the shared experts' blocks apart
    (32, 64, 6, 2, 16, False, False, (), False),  # at the tile's bound
    (32, 64, 6, 2, 16, False, False, (), True),  # the shared experts' pairs sorted too
    (1, 16, 4, 0, 16, True, True, (), False),  # sigmoid with a bias, normalised, no shared experts
    (20, 16, 4, 1, 32, True, False, (), True),
    (9, 8, 2, 2, 16, False, False, (), True),  # the tiny V2 on the CPU (no second stream)
    (6, 16, 4, 2, 16, False, False, (0, 4), False),  # overflowed rows: k distinct valid ids all the same
    (0, 64, 6, 2, 16, False, False, (), False),  # an empty step: every block unused
    (0, 64, 6, 2, 16, False, False, (), True),
]


def test_route_align_refuses_what_it_cannot_serve():
    assert route_align_fits(32, 64) and not route_align_fits(33, 64)
    assert route_align_fits(ROUTE_ALIGN_MAX_ELEMS // 16, 8)
    logits = torch.randn(33, 64)
    with pytest.raises(ValueError, match=r"moe_route_align_max_tokens: .* 33 tokens x 64 experts exceed .*; leave "
                                         r"moe_route_align_max_tokens at 0"):
        route_align(logits, None, "softmax", "greedy", 1, 6, False, 1.0, 2, 16)
    with pytest.raises(ValueError, match=r"moe_route_align_max_tokens: .* chosen by groups; leave"):
        route_align(logits[:4], None, "softmax", "group_limited_greedy", 4, 6, False, 1.0, 2, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_route_align_gpu(case):
    check("cuda", *case)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [8, 16, 24, 32])
def test_route_align_v2_lite_gpu(T):
    """V2-Lite's decode steps as the engine takes them (blocks of 16), NaN rows included."""
    check("cuda", T, 64, 6, 2, 16, nan_rows=(1, 3))
    check("cuda", T, 64, 6, 2, 16, sort_shared=True)
