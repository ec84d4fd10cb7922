"""moe_shared_prefetch_mb and prefetch_o_proj: the byte ranges they ask L2 for, the kernel's
machine code for sm_90 (compiled on the CPU; and moe_evict_first_max_tokens' hints in the MoE
kernels' PTX), the model's prefetch plumbing on the CPU (the CUDA
stream calls recorded), and on the GPU the prefetches over real sizes (every policy, addresses and
byte counts checked by the probe mode) and the engine's greedy tokens with them equal to those
without (the prefetch writes nothing; what that test guards is the side stream's fork and join
inside CUDA graphs)."""

from __future__ import annotations

import pytest
import torch

from models.moe import shared_prefetch_ranges


def test_shared_prefetch_ranges_take_the_shared_experts_gate_up_then_down_within_the_budget():
    E, S, I, D = 6, 2, 48, 32
    ids = torch.arange(E + S, dtype=torch.float32)[:, None, None]
    w13 = ids.expand(E + S, 2 * I, D).to(torch.bfloat16).contiguous()
    w2 = (100 + ids).expand(E + S, D, I).to(torch.bfloat16).contiguous()
    shared13, shared2 = S * 2 * I * D * 2, S * D * I * 2  # bytes
    a, b = shared_prefetch_ranges(w13, w2, S, 1 << 30)  # all of both
    assert a.numel() == shared13 and b.numel() == shared2
    assert a.data_ptr() == w13[E].data_ptr() and b.data_ptr() == w2[E].data_ptr()
    assert set(a.view(torch.bfloat16).tolist()) == {6.0, 7.0} and set(b.view(torch.bfloat16).tolist()) == {106.0, 107.0}
    a, b = shared_prefetch_ranges(w13, w2, S, shared13 + 1000)  # gate/up whole, down cut to whole 16 bytes
    assert a.numel() == shared13 and b.numel() == 992
    a, b = shared_prefetch_ranges(w13, w2, S, 5000)  # gate/up cut, no down
    assert a.numel() == 4992 and b is None


@pytest.mark.parametrize("policy,opcode", [("evict_normal", "CCTL.E.PF2"), ("evict_last", "CCTL.E.PML2"),
                                           ("bulk", "UBLKPF.L2")])
def test_the_kernel_issues_its_prefetch_instructions_on_sm90(policy, opcode, tmp_path):
    """Compiled for sm_90 on the CPU (Triton's bundled ptxas and cuobjdump): the inline assembly is
    kept (nothing reads its result) and becomes the policy's prefetch instruction, and the kernel
    issues no load (a prefetch that became a load would stall on every line)."""
    import re
    import subprocess
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from models import l2_prefetch as lp
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (tools / "ptxas").exists() or not (tools / "cuobjdump").exists():
        pytest.skip("this Triton install has no bundled ptxas / cuobjdump")
    sig = {"a_ptr": "*u8", "a_bytes": "i64", "b_ptr": "*u8", "b_bytes": "i64", "count_ptr": "*u8",
           "head_ptr": "*u8", "size_ptr": "*u8", "UNIT": "constexpr", "BLOCK": "constexpr", "ASM": "constexpr",
           "PROBE": "constexpr"}
    const = dict(UNIT=lp.BULK if policy == "bulk" else lp.LINE, BLOCK=256, ASM=lp._ASM[policy], PROBE=False)
    kernel = triton.compile(ASTSource(lp._l2_prefetch_kernel, sig, const), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4})
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    sass = subprocess.run([str(tools / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    ops = set(re.findall(r"\b(CCTL\.E\.\w+|UBLKPF\.L2|LDG\S*)", sass))
    assert ops == {opcode}, ops


@pytest.mark.parametrize("kernel", ["blocked_gate_up", "blocked_down", "gate_up_dot", "down_dot"])
def test_moe_weight_loads_take_the_evict_first_hint_on_sm90(kernel):
    """moe_evict_first_max_tokens: compiled for sm_90 on the CPU, exactly the MoE kernels'
    expert-weight loads (gate and up, or down) carry the evict-first policy when asked (EVICT_W),
    the others (the activations, the pair ids) none, the PTX loads them with an L2 cache policy,
    and without it no load carries one."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from models import blocked_moe as bm
    from models import fused_moe as fm
    common = dict(QB=128, SCALED=False, IEEE=False, BLOCK_N=64, BLOCK_K=64, PDL=False)
    fn, const, ptrs, weights = {
        "blocked_gate_up": (bm._blocked_gate_up_kernel, dict(common, A8=False, BLOCK_M=16, GROUP_B=1),
                            {"rows_ptr": "*i32", "bexp_ptr": "*i32", "s13_ptr": "*fp32"}, {"wg", "wu"}),
        "blocked_down": (bm._blocked_down_kernel, dict(common, A8=False, BLOCK_M=16, GROUP_B=1),
                         {"rows_ptr": "*i32", "bexp_ptr": "*i32", "s2_ptr": "*fp32", "pw_ptr": "*fp32",
                          "part_ptr": "*fp32"}, {"w"}),
        "gate_up_dot": (fm._gate_up_dot_kernel, dict(common, K_TOP=6, NS=2, J0=0, JN=8),
                        {"ids_ptr": "*i32", "s13_ptr": "*fp32"}, {"wg", "wu"}),
        "down_dot": (fm._down_dot_kernel, dict(common, K_TOP=6, NS=2, J0=0, JN=8),
                     {"ids_ptr": "*i32", "s2_ptr": "*fp32", "wts_ptr": "*fp32", "part_ptr": "*fp32"}, {"w"}),
    }[kernel]
    for evict in ("evict_first", ""):
        c = dict(const, EVICT_W=evict)
        sig = {n: "constexpr" if n in c else ptrs.get(n, "*bf16") if n.endswith("_ptr") else "i32"
               for n in fn.arg_names}
        asm = triton.compile(ASTSource(fn, sig, c), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm
        loads = [line for line in asm["ttir"].splitlines() if "tt.load" in line]
        hinted = {re.match(r"\s*%([a-z]+)_\d+ = tt.load", line).group(1) for line in loads
                  if re.search(r"[eE]viction_?[pP]olicy = evict_first", line)}
        assert len(loads) > len(weights)
        assert hinted == (weights if evict else set()), hinted
        assert ("L2::cache_hint" in asm["ptx"]) == bool(evict)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["evict_normal", "evict_last", "bulk"])
def test_l2_prefetch_on_the_gpu(policy):
    """The PTX prefetches run over V2-Lite's shared experts' bytes (34.6 MB, and a range cut
    mid-unit) without a fault and leave the weights as they were; the probe mode, compiled for the
    GPU, visits each unit once at its address, with byte counts that cover the ranges exactly."""
    from models.l2_prefetch import BULK, LINE, l2_prefetch
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(66, 2816, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
    w2 = torch.randn(66, 2048, 1408, device="cuda", dtype=torch.bfloat16, generator=g)
    a, b = shared_prefetch_ranges(w13, w2, 2, 40 << 20)
    before = (w13[64:].clone(), w2[64:].clone())
    unit = BULK if policy == "bulk" else LINE
    for ranges in ((a, b), (a[:BULK * 3 + 48], None)):
        assert l2_prefetch(*ranges, policy=policy) is None
        torch.cuda.synchronize()
        count, head, size = l2_prefetch(*ranges, policy=policy, probe=True)
        parts = [r for r in ranges if r is not None]
        assert count.numel() == sum(-(-r.numel() // unit) for r in parts) and bool((count == 1).all())
        assert int(size.sum()) == sum(r.numel() for r in parts) and bool((size <= unit).all())
        flat = torch.cat(parts)
        starts = torch.cat([torch.arange(0, r.numel(), unit, device="cuda") + off
                            for r, off in zip(parts, (0, parts[0].numel()))])
        want = flat[starts[:, None] + torch.arange(4, device="cuda")].contiguous().view(torch.int32).view(-1)
        assert torch.equal(head, want)
    assert torch.equal(w13[64:], before[0]) and torch.equal(w2[64:], before[1])


@pytest.fixture(scope="module")
def gpu_v2(tmp_path_factory):
    from tiny_models import make_model
    path = tmp_path_factory.mktemp("gpu_v2_prefetch")
    return str(path), make_model(path, "v2", qk_rope_head_dim=16)


@pytest.mark.gpu
def test_moe_shared_prefetch_equals_no_prefetch(gpu_v2, monkeypatch):
    """The engine with the prefetch (each policy, the shared experts and / or o_proj, forked
    before the attention core or before o_proj, with the MoE's weight loads evict-first; the fused
    path at 1 sequence, the block kernels at 8, CUDA graphs with and without PDL, and eagerly)
    gives the greedy tokens of the default plan, and did prefetch."""
    import models.l2_prefetch
    from common.launch_settings import moe_evict_first, use_moe_evict_first, use_pdl
    from test_gpu_engine import _prompts, _run
    real, calls = models.l2_prefetch.l2_prefetch, []

    def counted(*args, **kw):
        calls.append(kw.get("policy"))
        return real(*args, **kw)

    monkeypatch.setattr(models.l2_prefetch, "l2_prefetch", counted)
    path, _ = gpu_v2
    every = ((",moe_shared_prefetch_mb=40", "evict_normal"),
             (",moe_shared_prefetch_mb=16,moe_shared_prefetch_policy=bulk", "bulk"),
             (",moe_shared_prefetch_mb=40,moe_shared_prefetch_policy=evict_last,pdl=1", "evict_last"),
             (",moe_shared_prefetch_mb=40,moe_evict_first_max_tokens=128", "evict_normal"),
             (",moe_shared_prefetch_mb=40,moe_shared_prefetch_at=o_proj,pdl=1", "evict_normal"),
             (",prefetch_o_proj=1", "evict_normal"),
             (",prefetch_o_proj=1,moe_shared_prefetch_mb=40", "evict_normal"),
             (",prefetch_next_qkv=1,moe_evict_first_max_tokens=128", "evict_normal"))
    # the fused path (1 sequence) with two of them, the block kernels (8) with every one
    for prompts, extras in ((_prompts()[:1], every[3:5]), (_prompts(), every)):
        ref = _run(path, prompts, kernels="auto,warmup=0")
        assert not calls
        try:
            for extra, policy in extras:
                assert _run(path, prompts, kernels="auto,warmup=0" + extra) == ref, extra
                assert calls and set(calls) == {policy}, extra
                # the worker set the plan's hint for the process (the last engine built sets it)
                assert moe_evict_first(8) == ("evict_first" if "moe_evict_first" in extra else ""), extra
                calls.clear()
            assert _run(path, prompts, kernels="auto,warmup=0,moe_shared_prefetch_mb=40", enforce_eager=True) == ref
            assert calls
            calls.clear()
        finally:
            use_pdl(False)  # process settings: kernels called directly by later tests launch without them
            use_moe_evict_first(0)


def _recording_streams(monkeypatch, events):
    """torch.cuda's stream calls replaced by recorders: (side, main) stand-ins."""
    import contextlib

    import models.moe as moe

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


def _bundled_model(plan):
    import json

    from common.args import DEFAULT_MODEL
    from models.config import ModelConfig
    from models.deepseek import DeepseekForCausalLM
    cfg = ModelConfig.from_dict(json.load(open(f"{DEFAULT_MODEL}/config.json")))
    return DeepseekForCausalLM(cfg, torch.float32, plan)


def test_layers_ask_for_o_proj_the_shared_experts_then_the_next_qkv_on_the_side_stream(monkeypatch):
    """The model's plumbing on the CPU, with the CUDA stream calls and the kernel replaced by
    recorders: a MoE layer whose step overlaps asks, on the side stream after it waited for the
    main one, for o_proj's weight, the shared experts' bytes under the budget, then the next
    layer's qkv_a weight (the last layer has none), with the plan's policy; a dense layer and a
    step that does not overlap ask nothing; a failing prefetch joins the side stream back and is
    charged to the key of the launch that failed."""
    import models.l2_prefetch
    import models.moe as moe
    from common.kernel_plan import KernelPlan, charged_key

    model = _bundled_model(KernelPlan(moe_shared_stream=True, moe_shared_prefetch_mb=1, prefetch_o_proj=True,
                                      prefetch_next_qkv=True, moe_shared_prefetch_policy="bulk"))
    names = [n for n, _ in model.named_parameters()]
    model.process_weights_after_loading()
    assert [n for n, _ in model.named_parameters()] == names  # the next layer's weight is not registered twice
    events = []
    _recording_streams(monkeypatch, events)
    monkeypatch.setattr(models.l2_prefetch, "l2_prefetch",
                        lambda a, b=None, policy=None: events.append(("prefetch", a, b, policy)))
    layers = model.model.layers
    dense = [i for i, layer in enumerate(layers) if not isinstance(layer.mlp, moe.MoE)]
    sparse = [i for i, layer in enumerate(layers) if isinstance(layer.mlp, moe.MoE)]
    assert dense and sparse
    cpu = torch.device("cpu")
    assert not layers[sparse[0]].prefetch(8, cpu)  # the real overlap test: a CPU step never overlaps
    assert not layers[dense[0]].prefetch(8, cpu)
    assert events == []
    monkeypatch.setattr(moe.MoE, "overlaps_shared", lambda self, T, device: T == 8)
    assert not layers[dense[0]].prefetch(8, cpu)
    assert not layers[sparse[0]].prefetch(9, cpu)
    assert events == []
    layer = layers[sparse[0]]
    assert layer.prefetch(8, cpu)
    assert events[:2] == [("wait", "side", "main"), ("enter", "side")] and events[-1] == ("exit", "side")
    calls = events[2:-1]
    assert len(calls) == 3 and all(c[0] == "prefetch" and c[3] == "bulk" for c in calls)
    assert calls[0][1] is layer.self_attn.o_proj.weight and calls[0][2] is None
    assert calls[2][1] is layers[sparse[0] + 1].self_attn.qkv_a_proj.weight and calls[2][2] is None
    assert layers[-1].next_qkv == ()
    want = shared_prefetch_ranges(layer.mlp.w13, layer.mlp.w2, layer.mlp.n_shared, 1 << 20)
    assert layer.mlp.n_shared > 0
    for got, ref in zip(calls[1][1:3], want):
        assert (got is None) == (ref is None)
        if ref is not None:
            assert got.data_ptr() == ref.data_ptr() and got.numel() == ref.numel()

    for failing, key in ((1, "prefetch_o_proj"), (2, "moe_shared_prefetch_mb"), (3, "prefetch_next_qkv")):
        events.clear()
        n = []

        def fails(a, b=None, policy=None):
            n.append(a)
            if len(n) == failing:
                raise RuntimeError("launch failed")

        monkeypatch.setattr(models.l2_prefetch, "l2_prefetch", fails)
        with pytest.raises(RuntimeError) as info:
            layer.prefetch(8, cpu)
        assert charged_key(info.value) == key
        assert events[-1] == ("wait", "main", "side")  # joined before the error left


@pytest.mark.parametrize("at", ["attention", "o_proj"])
def test_the_prefetch_and_the_moe_see_the_same_token_count(monkeypatch, at):
    """At the real call sites (the engine's steps on the CPU: prefills, decodes, a mixed step; the
    fork before the attention core or before o_proj), each MoE layer's prefetch is asked with the
    token count its MoE then runs: the overlap test decides both the fork and the join, so they
    must agree. A layer failing after a fork (in the attention core, or in o_proj) joins the side
    stream before its error leaves the layer."""
    from engine import LLM, SamplingParams
    from common.args import DEFAULT_MODEL
    import models.moe as moe

    seen = []
    real_prefetch, real_forward = moe.MoE.prefetch, moe.MoE.forward

    def prefetch(self, T, device, o_proj=None, next_qkv=None):
        seen.append(("prefetch", id(self), T))
        return real_prefetch(self, T, device, o_proj, next_qkv)

    def forward(self, x, defer_sum=False):
        seen.append(("moe", id(self), x.shape[0]))
        return real_forward(self, x, defer_sum)

    monkeypatch.setattr(moe.MoE, "prefetch", prefetch)
    monkeypatch.setattr(moe.MoE, "forward", forward)
    llm = LLM(DEFAULT_MODEL, device="cpu", dtype="float32", num_kv_blocks=64, max_num_batched_tokens=24)
    for layer in llm.engine.executor.worker.model.model.layers:
        layer.prefetch_at = at
    llm.generate([[5] * 30, [7] * 3, [9] * 11], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(seen) > 20 and len(seen) % 2 == 0
    for (k1, m1, t1), (k2, m2, t2) in zip(seen[::2], seen[1::2]):
        assert (k1, k2) == ("prefetch", "moe") and m1 == m2 and t1 == t2
    assert len({t for _, _, t in seen}) > 1  # steps of several sizes

    events = []
    _recording_streams(monkeypatch, events)
    monkeypatch.setattr(moe.MoE, "prefetch", lambda self, T, device, o_proj=None, next_qkv=None: True)  # forked
    layer = next(layer for layer in _bundled_model(moe.TORCH_PLAN).model.layers if isinstance(layer.mlp, moe.MoE))
    layer.prefetch_at = at

    def broken(*args, **kw):
        raise RuntimeError("layer failed")

    monkeypatch.setattr(layer.self_attn, "attend", broken)
    monkeypatch.setattr(layer.self_attn.o_proj, "forward", broken)
    x = torch.zeros(2, layer.input_layernorm.weight.shape[0])
    with pytest.raises(RuntimeError, match="layer failed"):
        if at == "attention":
            layer(x, None, None, None, None)  # fails in the attention core
        else:
            layer.post_attention(torch.zeros(2, 1, 1), x)  # fails in o_proj
    assert events == [("wait", "main", "side")]
