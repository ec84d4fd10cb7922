"""The whole engine on the Triton kernel plan, on the CPU under the interpreter (fp32), against the
pure-torch plan in the same process: equal greedy tokens with prompts chunked by 16 tokens
(prefill with context, mixed steps) and not, every kernel of the plan called. A kernel that fails
in the start-up warm-up stops the engine with an error naming the --kernels setting that avoids it."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_model

import attention.triton_absorb as triton_absorb
import attention.triton_backend as triton_backend
import attention.triton_cache as triton_cache
import common.triton_argmax as triton_argmax
import common.triton_norm as triton_norm
import models.blocked_moe as blocked_moe
import models.fused_moe as fused_moe
import models.triton_route as triton_route
from common.kernel_plan import KernelError
from engine import LLM, SamplingParams

SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# (module, function): what each key of the Triton plan calls
KERNELS = {"finish_kv": (triton_cache, "kv_finish"), "absorb_q": (triton_absorb, "absorb_q"),
           "absorb_o": (triton_absorb, "absorb_o"), "router": (triton_route, "route_triton"),
           "moe_fused": (fused_moe, "fused_moe_small"), "moe_blocked": (blocked_moe, "fused_moe_blocked"),
           "decode": (triton_backend, "mla_decode"), "prefill": (triton_backend, "prefill_attention_parts"),
           "prefill_joined": (triton_backend, "prefill_attention"),  # widths the parts kernel cannot split
           "fused_q_kv": (triton_absorb, "absorb_q_kv_finish"),  # unless decode_fuse_q_kv=0
           "norm_pairs": (triton_norm, "_add_pairs_rms_norm"),
           "argmax": (triton_argmax, "argmax_rows")}  # norm=triton only (moe_sum_in_norm)


@pytest.fixture(scope="module", params=["v3", "v2"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"interp_{request.param}")
    make_model(path, request.param, qk_rope_head_dim=16)  # the Triton decode kernel needs rope >= 16
    return str(path)


def _llm(model, kernels, budget=16, spec=None):
    return LLM(model, device="cpu", dtype="float32", kernels=kernels, num_kv_blocks=64,
               max_num_batched_tokens=budget, speculative_config=spec)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def _count_calls(monkeypatch, targets: dict) -> dict:
    """{key: calls} of each (module, function) in `targets`, wrapped in place to count."""
    calls = dict.fromkeys(targets, 0)
    for key, (mod, name) in targets.items():
        def counting(*a, _key=key, _fn=getattr(mod, name), **k):
            calls[_key] += 1
            return _fn(*a, **k)
        monkeypatch.setattr(mod, name, counting)
    return calls


def _three_prompts(model, seed):
    """Three prompts of 5, 23 and 40 tokens and the torch plan's greedy tokens for them."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 300, (n,), generator=g).tolist() for n in (5, 23, 40)]
    return prompts, [o.outputs[0].token_ids for o in _llm(model, "torch").generate(prompts, SP)]


@pytest.mark.parametrize("budget,kernels,spec", [(16, "triton", None), (2048, "triton,norm=triton", None),
                                                 (16, "triton,moe_blocked_max_tokens=0,decode_fuse_q_kv=0", None),
                                                 (2048, "triton", NGRAM)])
def test_triton_plan_equals_torch_plan(model, budget, kernels, spec, monkeypatch):
    """With moe_blocked_max_tokens=0 the prefill chunks of 9-16 tokens take the torch experts loop
    instead of the expert-sorted block kernels; the pure decode steps run absorb_q and kv_finish
    as one launch, except with decode_fuse_q_kv=0; with norm=triton (torch under the interpreter
    unless set) the MoE's pair rows are summed by the next add + RMSNorm (moe_sum_in_norm); greedy
    argmax is the Triton one. With ngram speculation the decode kernel verifies drafts (q_len 1 + k, masks from positions); the torch engine runs without it."""
    calls = _count_calls(monkeypatch, KERNELS)
    g = torch.Generator().manual_seed(budget)
    prompts = [torch.randint(2, 300, (n,), generator=g).tolist() for n in (5, 23, 40)]
    sp = SP
    if spec is not None:  # repetitive prompts and longer outputs: the drafter finds matches
        prompts, sp = [p[:4] * 5 for p in prompts], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in _llm(model, "torch", budget).generate(prompts, sp)]
    assert sum(calls.values()) == 0  # the torch plan calls no Triton kernel
    llm = _llm(model, kernels, budget, spec)
    plan = llm.engine.executor.worker.plan
    assert (plan.attention, plan.router, plan.moe, plan.moe_fused_max_tokens) == ("triton", "triton", "triton", 4)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert got == want
    if spec is not None:
        assert llm.scheduler.stats.spec.num_accepted_tokens > 0, "no draft accepted: no multi-token decode"
    calls["prefill"] += calls.pop("prefill_joined")
    expect = set(calls) - ({"moe_blocked"} if "blocked_max_tokens=0" in kernels else set())
    expect -= {"fused_q_kv"} if "decode_fuse_q_kv=0" in kernels else set()
    if budget > 16 and "decode_fuse_q_kv=0" not in kernels:  # no mixed step: every decode takes the fused launch
        expect.discard("absorb_q")
    expect -= set() if "norm=triton" in kernels else {"norm_pairs"}
    assert all(calls[k] > 0 for k in expect), str(calls)
    assert "blocked_max_tokens=0" not in kernels or calls["moe_blocked"] == 0
    assert "decode_fuse_q_kv=0" not in kernels or calls["fused_q_kv"] == 0
    assert "norm=triton" in kernels or calls["norm_pairs"] == 0  # the interpreter's plan keeps the torch norms


def test_decode_merge_in_absorb_in_the_engine(model, monkeypatch):
    """decode_merge_in_absorb with every decode split in 12 (on the CPU the decode would not split:
    one SM; most splits of these short contexts are empty): the torch plan's greedy tokens, every
    decode merged inside absorb_o and none by the merge launch; prompts chunked by 16, so mixed
    steps write their decode rows into the joint output. With 17 splits, more than the fold takes
    (mla.MERGE_IN_ABSORB_MAX_SPLITS), the merge launch serves them all."""
    if "interp_v2" not in model:
        pytest.skip("the fold is the attention's alone: V2's tiny model covers it")
    import attention.triton_decode as triton_decode
    splits = [12]
    monkeypatch.setattr(triton_decode, "choose_num_splits", lambda *a, **k: splits[0])
    calls = _count_calls(monkeypatch, {"merged": (triton_absorb, "absorb_o_merge"),
                                       "reduce": (triton_decode, "reduce_splits")})
    prompts, want = _three_prompts(model, 7)
    llm = _llm(model, "triton,warmup=0,decode_merge_in_absorb=1")
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, SP)] == want
    assert calls["merged"] > 0 and calls["reduce"] == 0, calls
    splits[0], calls["merged"] = 17, 0
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, SP)] == want
    assert calls["merged"] == 0 and calls["reduce"] > 0, calls


def test_decode_merge_in_absorb_failure_names_its_setting(model, monkeypatch):
    """The fold's kernel fails in the warm-up's decode: start-up stops naming
    decode_merge_in_absorb=0, not absorb (the same module's other kernels)."""
    if "interp_v2" not in model:
        pytest.skip("the fold is the attention's alone: V2's tiny model covers it")
    import attention.triton_decode as triton_decode
    monkeypatch.setattr(triton_decode, "choose_num_splits", lambda *a, **k: 12)

    def broken(*a, **k):
        raise RuntimeError("PTX: no such instruction")
    monkeypatch.setattr(triton_absorb, "absorb_o_merge", broken)
    with pytest.raises(KernelError, match=r"the decode_merge_in_absorb kernel failed while warming up: RuntimeError: "
                                          r"PTX: no such instruction\. --kernels auto,decode_merge_in_absorb=0"):
        _llm(model, "triton,warmup=1,decode_merge_in_absorb=1")


def test_router_fused_in_the_engine(model, monkeypatch):
    """router_fused_max_tokens: V2's tiny model (no expert groups) routes every step of up to 64
    tokens in one launch, with the torch plan's greedy tokens; V3's (grouped) does not start,
    the error naming the setting."""
    if "interp_v3" in model:  # refused at start-up, before any step (warm-up off)
        with pytest.raises(ValueError, match=r"router_fused_max_tokens=64: .* chosen by groups; leave"):
            _llm(model, "triton,warmup=0,router_fused_max_tokens=64")
        return
    launches = []
    real = triton_route._router_fused_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]
    monkeypatch.setattr(triton_route, "_router_fused_kernel", Counting())
    prompts = [[5, 6, 7, 8], list(range(10, 40))]
    want = [o.outputs[0].token_ids for o in _llm(model, "torch").generate(prompts, SP)]
    got = [o.outputs[0].token_ids for o in _llm(model, "triton,router_fused_max_tokens=64", 2048).generate(prompts, SP)]
    assert got == want
    assert launches


class _Broken:
    """A Triton kernel that does not compile: launching it raises."""

    def __getitem__(self, grid):
        raise RuntimeError("PTX: no such instruction")


def test_kernel_failure_in_warm_up_names_the_flag(model, monkeypatch):
    """The router kernel fails when first launched (in the warm-up): start-up stops with a
    KernelError naming `router=torch`; with that setting the same engine starts and serves."""
    monkeypatch.setattr(triton_route, "_route_kernel", _Broken())
    with pytest.raises(KernelError, match=r"the router kernel failed while warming up: RuntimeError: "
                                          r"PTX: no such instruction\. --kernels auto,router=torch"):
        _llm(model, "triton,warmup=1")
    llm = _llm(model, "triton,warmup=1,router=torch")
    assert llm.engine.executor.worker.plan.router == "torch"
    assert len(llm.generate([[5, 6, 7]], SP)[0].outputs[0].token_ids) == 6


def test_moe_norm_in_router_in_the_engine(model, monkeypatch):
    """moe_norm_in_router_max_tokens with the Triton norms: the torch plan's greedy tokens, and
    with prompts chunked by 16 every MoE layer's step (at most 16 tokens: within the logits
    kernel's envelope) runs its add + norm inside the router's logits kernel, so the two-launch
    router is never called; V3's grouped choice and V2's plain one."""
    calls = _count_calls(monkeypatch, {"fused": (triton_route, "add_norm_router_logits"),
                                       "two_launch": (triton_route, "route_triton")})
    prompts, want = _three_prompts(model, 11)
    llm = _llm(model, "triton,norm=triton,moe_norm_in_router_max_tokens=32")
    assert llm.engine.executor.worker.plan.moe_norm_in_router_max_tokens == 32
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, SP)] == want
    assert calls["fused"] > 0 and calls["two_launch"] == 0, calls


BOTH = "triton,norm=triton,moe_norm_in_router_max_tokens=64,moe_route_align_max_tokens=64"


@pytest.mark.parametrize("kernels", ["triton,moe_route_align_max_tokens=64", BOTH])
def test_moe_route_align_in_the_engine(model, kernels, monkeypatch):
    """moe_route_align_max_tokens: V2's tiny model (no expert groups) with prompts chunked by 16
    makes every block-MoE step's choice and alignment in one launch (alone, and after the norm + logits
    kernel), with the torch plan's greedy tokens, and `align_pairs` is never called; V3's grouped
    router does not start, the error naming the setting."""
    if "interp_v3" in model:
        with pytest.raises(ValueError, match=r"moe_route_align_max_tokens=64: .* chosen by groups; leave "
                                             r"moe_route_align_max_tokens at 0"):
            _llm(model, "triton,warmup=0,moe_route_align_max_tokens=64")
        return
    import models.route_align as route_align
    calls = _count_calls(monkeypatch, {"route_align": (route_align, "route_align"),
                                       "align_pairs": (blocked_moe, "align_pairs"),
                                       "norm_logits": (triton_route, "add_norm_router_logits")})
    prompts, want = _three_prompts(model, 13)
    assert [o.outputs[0].token_ids for o in _llm(model, kernels).generate(prompts, SP)] == want
    assert calls["route_align"] > 0 and calls["align_pairs"] == 0, calls
    assert (calls["norm_logits"] > 0) == (kernels == BOTH), calls  # the choice from the norm kernel's logits


@pytest.mark.parametrize("kernel,key,spec", [
    ("_router_fused_kernel", "router_fused_max_tokens", "router_fused_max_tokens=64"),
    ("_norm_logits_kernel", "moe_norm_in_router_max_tokens", "norm=triton,moe_norm_in_router_max_tokens=32"),
    ("route_align._route_align_kernel", "moe_route_align_max_tokens", "moe_route_align_max_tokens=64")])
def test_opt_in_router_kernel_failure_names_its_setting(model, monkeypatch, kernel, key, spec):
    """A router kernel taken by an opt-in fails when first launched (the warm-up): start-up stops
    naming that setting's 0 (not router, whose module they share or call), the setting that
    leaves the router on its two launches."""
    if "interp_v2" not in model:
        pytest.skip("V3's grouped router never takes the one launch; one model covers the charge")
    import models.route_align as route_align
    mod, name = (route_align, kernel.split(".")[1]) if "." in kernel else (triton_route, kernel)
    monkeypatch.setattr(mod, name, _Broken())
    with pytest.raises(KernelError, match=rf"the {key} kernel failed while warming up: RuntimeError: PTX: no such "
                                          rf"instruction\. --kernels auto,{key}=0"):
        _llm(model, "triton,warmup=1," + spec)
