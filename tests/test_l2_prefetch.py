"""moe_shared_prefetch_mb and prefetch_o_proj: the byte ranges it asks L2 for, the kernel's PTX prefetches on the GPU
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
    """The engine with the prefetch (each policy, the shared experts and / or o_proj and kv_b_proj;
    the fused path at 1 sequence, the block kernels at 8, CUDA graphs with and without PDL, and
    eagerly) gives the greedy tokens of the default plan."""
    from common.kernel_plan import use_pdl
    from test_gpu_engine import _prompts, _run
    path, _ = gpu_v2
    for prompts in (_prompts()[:1], _prompts()):
        ref = _run(path, prompts, kernels="auto,warmup=0")
        try:
            for extra in (",moe_shared_prefetch_mb=40", ",moe_shared_prefetch_mb=16,moe_shared_prefetch_policy=bulk",
                          ",moe_shared_prefetch_mb=40,moe_shared_prefetch_policy=evict_normal,pdl=1",
                          ",prefetch_o_proj=1", ",prefetch_o_proj=1,moe_shared_prefetch_mb=40"):
                assert _run(path, prompts, kernels="auto,warmup=0" + extra) == ref, extra
            assert _run(path, prompts, kernels="auto,warmup=0,moe_shared_prefetch_mb=40", enforce_eager=True) == ref
        finally:
            use_pdl(False)


def test_layers_ask_for_o_proj_kv_b_then_the_shared_experts_on_the_side_stream(monkeypatch):
    """The model's plumbing on the CPU, with the CUDA stream calls and the kernel replaced by
    recorders: a MoE layer whose step overlaps asks, on the side stream after it waited for the
    main one, for o_proj's and kv_b_proj's weights, then the shared experts' bytes under the
    budget, with the plan's policy; a dense layer and a step that does not overlap ask nothing."""
    import contextlib
    import json

    import models.l2_prefetch
    import models.moe as moe
    from common.args import DEFAULT_MODEL
    from common.kernel_plan import KernelPlan
    from models.config import ModelConfig
    from models.deepseek import DeepseekForCausalLM

    cfg = ModelConfig.from_dict(json.load(open(f"{DEFAULT_MODEL}/config.json")))
    plan = KernelPlan(moe_shared_stream=True, moe_shared_prefetch_mb=1, prefetch_o_proj=True,
                      moe_shared_prefetch_policy="bulk")
    model = DeepseekForCausalLM(cfg, torch.float32, plan)
    events = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            events.append(("wait", self.name, other.name))

    side, main = Stream("side"), Stream("main")
    monkeypatch.setattr(moe, "side_stream", lambda device: side)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)

    @contextlib.contextmanager
    def on(stream):
        events.append(("enter", stream.name))
        yield
        events.append(("exit", stream.name))

    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(models.l2_prefetch, "l2_prefetch",
                        lambda a, b=None, policy=None: events.append(("prefetch", a, b, policy)))
    layers = model.model.layers
    dense = [i for i, layer in enumerate(layers) if not isinstance(layer.mlp, moe.MoE)]
    sparse = [i for i, layer in enumerate(layers) if isinstance(layer.mlp, moe.MoE)]
    assert dense and sparse
    cpu = torch.device("cpu")
    layers[sparse[0]].prefetch(8, cpu)  # the real overlap test: a CPU step never overlaps
    layers[dense[0]].prefetch(8, cpu)
    assert events == []
    monkeypatch.setattr(moe.MoE, "overlaps_shared", lambda self, T, device: T == 8)
    layers[dense[0]].prefetch(8, cpu)
    layers[sparse[0]].prefetch(9, cpu)
    assert events == []
    layer = layers[sparse[0]]
    layer.prefetch(8, cpu)
    a = layer.self_attn
    assert events[:2] == [("wait", "side", "main"), ("enter", "side")] and events[-1] == ("exit", "side")
    calls = events[2:-1]
    assert len(calls) == 2 and all(c[0] == "prefetch" and c[3] == "bulk" for c in calls)
    assert calls[0][1] is a.o_proj.weight and calls[0][2] is a.kv_b_proj.weight
    want = shared_prefetch_ranges(layer.mlp.w13, layer.mlp.w2, layer.mlp.n_shared, 1 << 20)
    assert layer.mlp.n_shared > 0
    for got, ref in zip(calls[1][1:3], want):
        assert (got is None) == (ref is None)
        if ref is not None:
            assert got.data_ptr() == ref.data_ptr() and got.numel() == ref.numel()
