"""moe_shared_prefetch_mb: the byte ranges it asks L2 for, the kernel's PTX prefetches on the GPU
(every policy, addresses checked by the probe mode at real sizes), and the engine's greedy tokens
with it equal to those without (it writes nothing; what the test guards is the side stream's
fork and join inside CUDA graphs)."""

from __future__ import annotations

import pytest
import torch

from models.moe import shared_prefetch_ranges


def test_shared_prefetch_ranges_take_the_shared_experts_gate_up_then_down_within_the_budget():
    E, S, I, D = 6, 2, 48, 32
    w13 = torch.arange(E + S, dtype=torch.float32)[:, None, None].expand(E + S, 2 * I, D).to(torch.bfloat16).contiguous()
    w2 = (100 + torch.arange(E + S, dtype=torch.float32))[:, None, None].expand(E + S, D, I).to(torch.bfloat16).contiguous()
    shared13, shared2 = S * 2 * I * D * 2, S * D * I * 2  # bytes
    a, b = shared_prefetch_ranges(w13, w2, S, 1 << 30)  # all of both
    assert a.numel() == shared13 and b.numel() == shared2
    assert a.data_ptr() == w13[E].data_ptr() and b.data_ptr() == w2[E].data_ptr()
    assert set(a.view(torch.bfloat16).tolist()) == {6.0, 7.0} and set(b.view(torch.bfloat16).tolist()) == {106.0, 107.0}
    a, b = shared_prefetch_ranges(w13, w2, S, shared13 + 1000)  # gate/up whole, down cut to whole 16 bytes
    assert a.numel() == shared13 and b.numel() == 992
    a, b = shared_prefetch_ranges(w13, w2, S, 5000)  # gate/up cut, no down
    assert a.numel() == 4992 and b is None


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["evict_last", "evict_normal", "bulk"])
def test_l2_prefetch_on_the_gpu(policy):
    """The PTX prefetches run over V2-Lite's shared experts' bytes (34.6 MB, and a range cut
    mid-unit) without a fault and leave the weights as they were; the probe mode, compiled for the
    GPU, visits each unit once at its address."""
    from models.l2_prefetch import BULK, LINE, l2_prefetch
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(66, 2816, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
    w2 = torch.randn(66, 2048, 1408, device="cuda", dtype=torch.bfloat16, generator=g)
    a, b = shared_prefetch_ranges(w13, w2, 2, 40 << 20)
    before = (w13[64:].clone(), w2[64:].clone())
    for ranges in ((a, b), (a[:BULK * 3 + 48], None)):
        l2_prefetch(*ranges, policy=policy)
        torch.cuda.synchronize()
        unit = BULK if policy == "bulk" else LINE
        count, head = l2_prefetch(*ranges, policy=policy, probe=True)
        n = sum(-(-r.numel() // unit) for r in ranges if r is not None)
        assert count.numel() == n and bool((count == 1).all())
        flat = torch.cat([r for r in ranges if r is not None])
        starts = torch.cat([torch.arange(0, r.numel(), unit, device="cuda") + off for r, off in
                            zip([r for r in ranges if r is not None], (0, ranges[0].numel()))])
        want = flat.view(-1)[starts[:, None] + torch.arange(4, device="cuda")].contiguous().view(torch.int32).view(-1)
        assert torch.equal(head, want)
    assert torch.equal(w13[64:], before[0]) and torch.equal(w2[64:], before[1])


@pytest.fixture(scope="module")
def gpu_v2(tmp_path_factory):
    from tiny_models import make_model
    path = tmp_path_factory.mktemp("gpu_v2_prefetch")
    return str(path), make_model(path, "v2", qk_rope_head_dim=16)


@pytest.mark.gpu
def test_moe_shared_prefetch_equals_no_prefetch(gpu_v2):
    """The engine with the prefetch (each policy; the fused path at 1-4 sequences, the block
    kernels at 8, CUDA graphs with and without PDL, and eagerly) gives the greedy tokens of the
    default plan."""
    from common.kernel_plan import use_pdl
    from test_gpu_engine import _prompts, _run
    path, _ = gpu_v2
    for prompts in (_prompts()[:1], _prompts()):
        ref = _run(path, prompts, kernels="auto,warmup=0")
        try:
            for extra in (",moe_shared_prefetch_mb=40", ",moe_shared_prefetch_mb=16,moe_shared_prefetch_policy=bulk",
                          ",moe_shared_prefetch_mb=40,moe_shared_prefetch_policy=evict_normal,pdl=1"):
                assert _run(path, prompts, kernels="auto,warmup=0" + extra) == ref, extra
            assert _run(path, prompts, kernels="auto,warmup=0,moe_shared_prefetch_mb=40", enforce_eager=True) == ref
        finally:
            use_pdl(False)
