"""The decode kernel's experimental fused split reduce (DecodeConfig.fused_reduce): the last split
of each (sequence, head tile) merges the others, counted by an atomic; same results as the
two-launch path, and the counters reset themselves for the next launch."""

from __future__ import annotations

import pytest
import torch
from interpreted import run_interpreted


CHECK = r"""
import dataclasses
import torch
from attention.triton_decode import DecodeConfig, _COUNTS, default_decode_config, mla_decode

def check(B, H, L, R, page, lens, splits, dtype, device, cfg, reps=2):
    g = torch.Generator().manual_seed(B * 31 + H)
    nb = B * (max(lens) // page + 2)
    kv = torch.randn(nb, page, L + R, generator=g).to(device, dtype)
    q = torch.randn(B, H, L + R, generator=g).to(device, dtype)
    width = max(lens) // page + 1
    bt = torch.randperm(nb, generator=g)[: B * width].view(B, width).int().to(device)
    seq = torch.tensor(lens, dtype=torch.int32, device=device)
    fused = dataclasses.replace(cfg, fused_reduce=True)
    for ns in splits:
        o1, l1 = mla_decode(q, kv, bt, seq, 0.1, L, num_splits=ns, cfg=cfg)
        for _ in range(reps):  # a second launch sees counters the first one reset
            o2, l2 = mla_decode(q, kv, bt, seq, 0.1, L, num_splits=ns, cfg=fused)
            assert torch.equal(l1.isinf(), l2.isinf()), (ns, l1, l2)
            torch.testing.assert_close(o2.float(), o1.float(), rtol=1e-5, atol=1e-5)
            fin = ~l1.isinf()
            torch.testing.assert_close(l2[fin], l1[fin], rtol=1e-6, atol=1e-6)
        counts = _COUNTS.get(q.device)  # none yet when every launch so far was direct (1 split)
        assert (counts is None and ns == 1) or int(counts.abs().sum()) == 0
"""


def test_fused_reduce_interpreter():
    """Empty and short sequences, split counts 1 (direct), 3 and 4, two heads tiles."""
    code = CHECK + r"""
cfg = DecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=2, min_split_tokens=16)
check(5, 32, 32, 16, 4, [0, 1, 17, 45, 48], (1, 3, 4), torch.float32, "cpu", cfg)
"""
    run_interpreted(code)


@pytest.mark.gpu
@pytest.mark.parametrize("B,H", [(1, 16), (32, 16), (4, 128)])
def test_fused_reduce_real_shapes(B, H):
    """Real widths, many splits and repeated launches: a missing release/acquire or a counter
    left non-zero would show as a mismatch in some launch."""
    ns = {}
    exec(CHECK, ns)
    cfg = ns["default_decode_config"](H, torch.bfloat16)
    lens = [4096 - 37 * i for i in range(B)]
    ns["check"](B, H, 512, 64, 64, lens, (8, 32, 66), torch.bfloat16, "cuda", cfg, reps=20)
