"""--enable-expert-parallel on the CPU: one MoE layer split by expert equals the one-rank layer
(torch plan; the Triton block kernels' version is in tests/interpreted/), the engine on 2 and 4
gloo ranks gives the one-rank tokens, and the layouts it cannot split are refused naming the flag."""

from __future__ import annotations

import pytest
import torch
from ep_checks import check_expert_parallel

from common.kernel_plan import KernelPlan
from engine import LLM, SamplingParams
from models.config import ModelConfig, check_parallel_layout
from models.moe import MoE

V2_LITE = "configs/models/DeepSeek-V2-Lite"
# V2-Lite's MoE narrowed: 8 routed experts (top 3), 2 shared, 96 units an expert
SMALL = {"hidden_size": 64, "moe_intermediate_size": 96, "n_routed_experts": 8, "num_experts_per_tok": 3}
# R1's FP8 MoE narrowed: 256 units (two 128-blocks) an expert, 8 routed (top 3), 4 shared
R1_SMALL = {"hidden_size": 256, "moe_intermediate_size": 256, "n_routed_experts": 8, "num_experts_per_tok": 3,
            "n_group": 1, "topk_group": 1, "n_shared_experts": 4}
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("moe_large", ["loop", "dense"])
@pytest.mark.parametrize("T", [1, 13])
def test_moe_layer_split_by_expert(n, moe_large, T, monkeypatch):
    """Each rank's E / n whole experts plus its 1 / n of the shared experts, summed over the
    ranks: the one-rank layer's output (fp32), on the loop and the dense torch paths."""
    check_expert_parallel(V2_LITE, SMALL, T, torch.float32, "cpu", 1e-6, KernelPlan(moe_large=moe_large), n,
                          monkeypatch)


@pytest.mark.parametrize("n", [2, 4])
def test_fp8_experts_split_by_expert(n, monkeypatch):
    """R1's FP8 MoE narrowed to two 128-unit blocks an expert (and 4 shared experts: 1024 units,
    128 a rank at n 4), its block scales loaded with each rank's whole experts, dequantized at
    load (the CPU's way; kept in FP8 through the Triton kernels: tests/interpreted/)."""
    check_expert_parallel("configs/models/DeepSeek-R1", R1_SMALL, 9, torch.float32, "cpu", 1e-5, KernelPlan(), n,
                          monkeypatch)


def test_grouped_path_refused_under_expert_parallel():
    from common.distributed import as_rank
    cfg = ModelConfig.from_pretrained(V2_LITE, SMALL)
    with as_rank(2, 0), pytest.raises(ValueError, match="--enable-expert-parallel: the grouped-GEMM"):
        MoE(cfg, torch.float32, KernelPlan(moe_large="grouped"))


def test_layouts_expert_parallel_cannot_split():
    cfg = ModelConfig.from_pretrained(V2_LITE, {"n_routed_experts": 6, "n_group": 1, "topk_group": 1})
    with pytest.raises(ValueError, match="--enable-expert-parallel: --tensor-parallel-size 4 must divide the "
                                         "model's 6 routed experts"):
        check_parallel_layout(cfg, 4, 1, expert_parallel=True)
    check_parallel_layout(cfg, 2, 1, expert_parallel=True)
    # without EP every expert is split, so its units must divide; with EP the routed experts stay
    # whole, and only the shared experts' 2 x 1400 units are split
    odd = ModelConfig.from_pretrained(V2_LITE, {"moe_intermediate_size": 1400})
    with pytest.raises(ValueError, match="must divide the model's moe_intermediate_size 1400"):
        check_parallel_layout(odd, 16, 1)
    check_parallel_layout(odd, 16, 1, expert_parallel=True)
    from common.distributed import as_rank
    with as_rank(16, 3), torch.device("meta"):  # and the layer builds: 4 whole experts, 175 shared units
        moe = MoE(odd, torch.bfloat16)
    assert moe.w13.shape == (4, 2 * 1400, 2048) and moe.shared_experts.down_proj.weight.shape == (2048, 175)
    with pytest.raises(ValueError, match=r"must divide the model's shared experts' units .* 2808"):
        check_parallel_layout(ModelConfig.from_pretrained(V2_LITE, {"moe_intermediate_size": 1404}), 16, 1, True)


def test_loader_skips_other_ranks_experts_by_name(tiny_v3, caplog):
    """The real loader on the tiny checkpoint as rank 1 of 2: each MoE layer's 4 other experts'
    12 tensors are skipped as other ranks' (logged once, no warning), nothing is missing, and the
    loaded experts are the checkpoint's experts 4-7."""
    import logging

    from safetensors import safe_open

    from common.distributed import as_rank
    from models.deepseek import DeepseekForCausalLM
    from models.loader import checkpoint_files, load_weights
    cfg = ModelConfig.from_pretrained(tiny_v3[0])
    with as_rank(2, 1):
        model = DeepseekForCausalLM(cfg, torch.float32)
        with caplog.at_level(logging.INFO, logger="models.loader"):
            load_weights(model, tiny_v3[0], cfg)
    moe_layers = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE)]
    assert moe_layers and not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert f"skipped {12 * len(moe_layers)} tensors of the routed experts other ranks hold" in caplog.text
    name, want = "model.layers.1.mlp.experts.5.down_proj.weight", None
    for path in checkpoint_files(tiny_v3[0]):
        with safe_open(str(path), framework="pt") as f:
            if name in f.keys():
                want = f.get_tensor(name).float()
    assert want is not None and torch.equal(model.model.layers[1].mlp.w2[1], want)  # expert 5: rank 1's local 1


@pytest.fixture(scope="module")
def prompts():
    torch.manual_seed(7)
    return [torch.randint(2, 320, (n,)).tolist() for n in (5, 17, 33, 64, 9)]


def _greedy(path, prompts, tp, dcp=1, ep=False, **kw):
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, tensor_parallel_size=tp,
              decode_context_parallel_size=dcp, enable_expert_parallel=ep, **kw)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    finally:
        llm.engine.shutdown()


def test_engine_with_expert_parallel_equals_one_rank(tiny_v3, prompts):
    """-tp 2 --enable-expert-parallel (4 of the tiny model's 8 experts a rank), with prompts
    chunked by 16 tokens: the one-rank greedy tokens. (With -dcp 2 too: test_data_parallel.py's
    -tp 2 -dcp 2 -dp 2 EP run; -tp 2 -dcp 2 alone: test_parallel.py.)"""
    ref = _greedy(tiny_v3[0], prompts, 1, max_num_batched_tokens=16)
    assert _greedy(tiny_v3[0], prompts, 2, ep=True, max_num_batched_tokens=16) == ref


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 128, 600])
def test_block_kernels_split_by_expert_on_the_gpu(T, monkeypatch):
    """V2-Lite's MoE layer at its real shapes (64 experts, 2 shared) on the Triton plan, as each
    of 4 EP ranks runs it on one GPU, summed, against the one-rank layer (its fused, block and
    grouped paths by T), bf16."""
    plan = KernelPlan(router="triton", moe="triton", moe_fused_max_tokens=4, moe_blocked_max_tokens=512,
                      moe_large="grouped", moe_shared_stream=True)
    check_expert_parallel(V2_LITE, {}, T, torch.bfloat16, "cuda", 2e-2, plan, 4, monkeypatch)
