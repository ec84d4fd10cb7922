"""The kernel plan: parsing --kernels, resolving it per device and dtype, charging a failure to
the key whose module raised it, and the flag named in the error."""

from __future__ import annotations

import pytest

from common.kernel_plan import CHOICES, KernelPlan, charged_key, parse_kernels, resolve_plan


def _resolve(spec, device="cuda", dtype="bfloat16", attention="auto", grouped_mm=True, dims_ok=True,
             wgmma_fit=False):
    return resolve_plan(spec, attention, device, dtype, grouped_mm, dims_ok, wgmma_fit)[0]


def test_every_choice_is_a_plan_field_and_the_default_plan_is_pure_torch():
    assert [c.key for c in CHOICES] == list(KernelPlan.__dataclass_fields__)
    assert KernelPlan() == _resolve("torch") == _resolve("auto", device="cpu")
    assert not KernelPlan().any_triton


def test_auto_on_cuda_is_the_triton_plan():
    plan = _resolve("auto")
    assert plan == _resolve("triton")
    assert (plan.attention, plan.finish_kv, plan.absorb, plan.router, plan.moe) == ("triton",) * 5
    assert (plan.moe_fused_max_tokens, plan.moe_fused_max_tokens_fp8, plan.moe_blocked_max_tokens,
            plan.moe_shared_dense_min_tokens, plan.moe_large) == (4, 8, 512, 1024, "grouped")
    assert plan.compile and plan.autotune and plan.warmup
    assert _resolve("auto", dtype="float32").moe_large == "dense"  # no grouped GEMM in fp32
    assert _resolve("auto", grouped_mm=False).moe_large == "dense"


def test_overrides_and_attention_backend():
    plan = _resolve("auto,router=torch,moe_fused_max_tokens=0,autotune=0,fp8_gemm=cublas")
    assert (plan.router, plan.moe_fused_max_tokens, plan.autotune, plan.fp8_gemm) == ("torch", 0, False, "cublas")
    assert plan.moe == "triton" and plan.warmup
    # --attention-backend torch: the attention ops and the decode-path kernels that go with them
    plan = _resolve("auto", attention="torch")
    assert (plan.attention, plan.finish_kv, plan.absorb, plan.router) == ("torch", "torch", "torch", "triton")
    assert _resolve("auto,absorb=triton", attention="torch").absorb == "triton"
    # MLA dims the Triton kernels do not take: attention stays torch under auto, not when asked for
    assert _resolve("auto", dims_ok=False).attention == "torch"
    assert _resolve("auto,attention=triton", dims_ok=False).attention == "triton"


def test_the_gluon_decode_is_the_default_where_it_fits():
    """decode_wgmma_min_heads is 64 under triton where the model, dtypes and GPU fit the Gluon
    decode, and 0 where they do not, under torch attention or base, or when set."""
    assert _resolve("auto").decode_wgmma_min_heads == 0
    assert _resolve("auto", wgmma_fit=True).decode_wgmma_min_heads == 64
    assert _resolve("triton", wgmma_fit=True).decode_wgmma_min_heads == 64
    assert _resolve("auto,decode_wgmma_min_heads=0", wgmma_fit=True).decode_wgmma_min_heads == 0
    assert _resolve("auto,decode_wgmma_min_heads=128", wgmma_fit=True).decode_wgmma_min_heads == 128
    assert _resolve("auto", attention="torch", wgmma_fit=True).decode_wgmma_min_heads == 0
    assert _resolve("torch", wgmma_fit=True).decode_wgmma_min_heads == 0


def test_the_seesaw_schedule_is_the_gluon_decodes_default():
    """decode_wgmma_seesaw follows the Gluon decode (default or asked for) unless set, or unless the
    lockstep schedule's producer variant is asked for; never without the Gluon decode."""
    assert _resolve("auto", wgmma_fit=True).decode_wgmma_seesaw
    assert _resolve("auto,decode_wgmma_min_heads=128").decode_wgmma_seesaw
    assert not _resolve("auto").decode_wgmma_seesaw
    assert not _resolve("auto,decode_wgmma_min_heads=0", wgmma_fit=True).decode_wgmma_seesaw
    assert not _resolve("auto,decode_wgmma_seesaw=0", wgmma_fit=True).decode_wgmma_seesaw
    p = _resolve("auto,decode_wgmma_producer=1", wgmma_fit=True)
    assert p.decode_wgmma_producer and not p.decode_wgmma_seesaw
    assert not _resolve("torch", wgmma_fit=True).decode_wgmma_seesaw
    assert not _resolve("auto", attention="torch", wgmma_fit=True).decode_wgmma_seesaw


@pytest.mark.parametrize("spec,match", [
    ("fast", "must start with auto, triton or torch"),
    ("auto,router", "not key=value"),
    ("auto,nope=1", "not key=value with a key of attention"),
    ("auto,router=cuda", r"router=cuda: expected one of triton, torch"),
    ("auto,moe_fused_max_tokens=-1", "expected a token count"),
    ("auto,warmup=yes", "expected 0 or 1"),
])
def test_bad_kernels_spec_names_the_flag(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_kernels(spec)


def test_fp8_w8a16_rows_are_bounded_by_its_row_tile():
    """fp8_gemm_w8a16_max_tokens: opt-in (0 under every base), at most 16 rows (its one row tile)."""
    assert _resolve("auto").fp8_gemm_w8a16_max_tokens == 0
    assert _resolve("auto,fp8_gemm_w8a16_max_tokens=16").fp8_gemm_w8a16_max_tokens == 16
    with pytest.raises(ValueError, match="w8a16_max_tokens=17: the weight-streaming FP8 kernel takes at most 16"):
        _resolve("auto,fp8_gemm_w8a16_max_tokens=17")


def test_triton_on_cpu_is_refused_with_the_flag():
    with pytest.raises(ValueError, match="--kernels triton: Triton kernels need a CUDA device"):
        _resolve("triton", device="cpu")
    with pytest.raises(ValueError, match="--kernels / --attention-backend"):
        _resolve("auto", device="cpu", attention="triton")


def test_a_failure_is_charged_to_the_module_that_raised_it():
    import torch

    import models.fp8_gemm as g  # a module of the fp8_gemm key
    x = torch.zeros(2, 128)
    with pytest.raises(ValueError) as info:
        g.w8a8_block_gemm(x, x, x, x, backend="nope")
    assert charged_key(info.value) == "fp8_gemm"
    err = str(KernelPlan().error("warming up", info.value))
    assert "the fp8_gemm kernel failed while warming up: ValueError" in err
    assert "--kernels auto,fp8_gemm=triton (or --kernels torch) avoids it" in err
    from models.fp8_w8a16 import w8a16_linear  # the weight-streaming FP8 kernel's own key
    with pytest.raises(ValueError) as info:
        w8a16_linear(torch.zeros(17, 128), torch.zeros(128, 128, dtype=torch.float8_e4m3fn), torch.ones(1, 1))
    assert "--kernels auto,fp8_gemm_w8a16_max_tokens=0 (or --kernels torch) avoids it" in str(
        KernelPlan().error("warming up", info.value))
    with pytest.raises(RuntimeError) as info:
        raise RuntimeError("elsewhere")
    assert charged_key(info.value) is None
    err = str(KernelPlan().error("warming up", info.value))
    assert "a kernel of the plan failed" in err and "--kernels torch avoids it" in err


def test_a_kernel_called_by_the_attention_backend_is_charged_to_the_backend():
    """write_kv runs a kernel of attention/triton_cache.py (finish_kv's module) for the Triton
    backend: its failure (here: no GPU to launch on) names attention, the outermost module."""
    import torch

    from attention.triton_backend import TritonAttentionOps
    with pytest.raises(Exception) as info:
        TritonAttentionOps().write_kv(torch.zeros(3, 4, 48), torch.zeros(2, 48), torch.zeros(2, dtype=torch.int64))
    assert charged_key(info.value) == "attention"
    assert "--kernels torch avoids it" in str(KernelPlan().error("warming up", info.value))


def test_describe_is_one_line_with_every_key():
    line = _resolve("auto").describe()
    assert "\n" not in line and all(f" {c.key}=" in line for c in CHOICES)
    assert "moe_fused_max_tokens=4" in line and "compile=1" in line


def test_pdl_without_a_hopper_gpu_is_refused_with_the_flag(tiny_v2):
    """pdl=1 asks for a launch attribute only sm_90+ has: on the CPU the engine refuses to start
    (nothing is silently left off), naming the setting."""
    from engine import LLM
    assert _resolve("auto,pdl=1").pdl and not _resolve("auto").pdl
    with pytest.raises(ValueError, match=r"pdl=1: programmatic dependent launch needs an sm_90\+ GPU"):
        LLM(tiny_v2[0], device="cpu", dtype="float32", kernels="torch,pdl=1")


def test_pdl_in_small_decode_graphs_by_default_on_hopper_only(tiny_v2):
    """Under triton on sm_90+ the decode graphs of up to PDL_GRAPH_MAX_BATCH sequences are
    captured with PDL; not elsewhere, not with torch attention (no graphs), and an explicit value
    stands. On the CPU asking for it is refused, naming the setting."""
    from common.kernel_plan import PDL_GRAPH_MAX_BATCH
    from engine import LLM

    def plan(spec, hopper, attention="auto"):
        return resolve_plan(spec, attention, "cuda", "bfloat16", True, True, False, hopper)[0]
    assert plan("auto", True).pdl_graph_max_batch == PDL_GRAPH_MAX_BATCH
    assert plan("auto", False).pdl_graph_max_batch == 0
    assert plan("auto,pdl_graph_max_batch=0", True).pdl_graph_max_batch == 0
    assert plan("auto,pdl_graph_max_batch=16", True).pdl_graph_max_batch == 16
    assert plan("auto", True, attention="torch").pdl_graph_max_batch == 0
    assert plan("torch", True).pdl_graph_max_batch == 0
    with pytest.raises(ValueError, match=r"pdl_graph_max_batch=4: programmatic dependent launch needs an sm_90\+"):
        LLM(tiny_v2[0], device="cpu", dtype="float32", kernels="torch,pdl_graph_max_batch=4")


def test_decode_fuse_q_kv_without_the_triton_kernels_is_refused(tiny_v2):
    """decode_fuse_q_kv fuses two Triton kernels: asked for on a plan without them, the engine does
    not start (nothing silently left unfused), naming the setting."""
    from engine import LLM
    with pytest.raises(ValueError, match=r"decode_fuse_q_kv=1 fuses the Triton absorb_q and kv_finish"):
        LLM(tiny_v2[0], device="cpu", dtype="float32", kernels="torch,decode_fuse_q_kv=1")


def test_decode_merge_in_absorb_without_the_triton_kernels_is_refused(tiny_v2):
    """decode_merge_in_absorb folds the Triton decode's merge into the Triton absorb_o: asked for on
    a plan without them, the engine does not start, naming the setting."""
    from engine import LLM
    with pytest.raises(ValueError, match=r"decode_merge_in_absorb=1 merges the Triton decode's splits"):
        LLM(tiny_v2[0], device="cpu", dtype="float32", kernels="torch,decode_merge_in_absorb=1")


def test_router_fused_without_the_triton_router_is_refused(tiny_v2):
    from engine import LLM
    with pytest.raises(ValueError, match=r"router_fused_max_tokens=8 is an option of the Triton router"):
        LLM(tiny_v2[0], device="cpu", dtype="float32", kernels="torch,router_fused_max_tokens=8")


def test_moe_sum_in_norm_where_moe_and_norm_are_triton():
    """The MoE's pair sum moves into the Triton add + RMSNorm under the triton plan; where the norms
    are torch's (the interpreter's default) it is off, and asked for there it is refused, naming
    the setting."""
    assert _resolve("auto").moe_sum_in_norm
    assert not _resolve("auto,moe_sum_in_norm=0").moe_sum_in_norm
    assert not _resolve("auto,norm=torch").moe_sum_in_norm and not _resolve("auto,moe=torch").moe_sum_in_norm
    with pytest.raises(ValueError, match=r"moe_sum_in_norm=1 sums the Triton MoE's pair rows .* moe=triton norm=torch"):
        _resolve("auto,norm=torch,moe_sum_in_norm=1")


def test_moe_norm_in_router_where_the_router_and_norm_are_triton():
    """The triton plan's default (NORM_IN_ROUTER_MAX_TOKENS), and any bound asked for, where the
    router and the norms are Triton's; 0 where either is torch's (the interpreter's default
    norms), and asked for there it is refused, naming it."""
    from common.kernel_plan import NORM_IN_ROUTER_MAX_TOKENS
    assert _resolve("auto").moe_norm_in_router_max_tokens == NORM_IN_ROUTER_MAX_TOKENS
    assert _resolve("auto,moe_norm_in_router_max_tokens=32").moe_norm_in_router_max_tokens == 32
    assert _resolve("auto,norm=torch,router=triton").moe_norm_in_router_max_tokens == 0
    assert _resolve("auto,router=torch").moe_norm_in_router_max_tokens == 0
    for spec, have in (("auto,norm=torch,moe_norm_in_router_max_tokens=8", "router=triton norm=torch"),
                       ("auto,router=torch,moe_norm_in_router_max_tokens=8", "router=torch norm=triton")):
        with pytest.raises(ValueError, match=rf"moe_norm_in_router_max_tokens=8 runs the Triton add \+ RMSNorm .* "
                                             rf"{have} \(leave"):
            _resolve(spec)


def test_moe_route_align_needs_the_triton_router_and_moe():
    assert _resolve("auto").moe_route_align_max_tokens == 0
    assert _resolve("auto,moe_route_align_max_tokens=16").moe_route_align_max_tokens == 16
    for spec, have in (("auto,moe=torch,moe_route_align_max_tokens=16", "router=triton moe=torch"),
                       ("auto,router=torch,moe_route_align_max_tokens=16", "router=torch moe=triton")):
        with pytest.raises(ValueError, match=rf"moe_route_align_max_tokens=16 makes the Triton router's choice .* "
                                             rf"{have} \(leave"):
            _resolve(spec)
