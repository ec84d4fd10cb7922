"""The --fp8-gemm path through the whole model, its W8A8 GEMMs on the Triton interpreter."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import make_fp8_model

import models.fp8_gemm as g
from engine import LLM, SamplingParams
from models.fp8 import dequantize, quantize


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    dst = tmp_path_factory.mktemp("v3_fp8")
    make_fp8_model(tmp_path_factory.mktemp("v3_bf16"), dst)
    return str(dst)


def emulated(x, wq, sw):
    """The W8A8 arithmetic in torch: activations quantized per 128-group, both operands
    dequantized, an fp32 matmul."""
    xq, sx = quantize(x.reshape(-1, x.shape[-1]), (1, 128))
    y = dequantize(xq, sx, (1, 128)) @ dequantize(wq, sw, (128, 128)).T
    return y.view(*x.shape[:-1], wq.shape[0]).to(x.dtype)


def test_fp8_gemm_path_runs_the_model(fp8_model, monkeypatch):
    """--fp8-gemm keeps attention/MLP projections in FP8 and runs them through the Triton W8A8
    kernels (the 40-token prefill) and the weight-streaming kernel (the decode steps' single rows,
    with fp8_gemm_w8a16_max_tokens=16), and keeps the routed experts in FP8 (read as FP8 by the Triton MoE
    kernels). Every W8A8 call the model makes equals `emulated` on the same input, and every
    weight-streaming call the product with the dequantized weight. Whole-model logprobs are not
    compared: with FP8 activations a one-ulp difference upstream flips an element's FP8 rounding
    downstream, so two correct implementations drift apart by ~1e-3 on a random tiny model."""
    import models.fp8_w8a16 as w16
    llm = LLM(fp8_model, device="cpu", dtype="float32", num_kv_blocks=64, fp8_gemm=True,
              kernels="triton,fp8_gemm_w8a16_max_tokens=16")
    model = llm.engine.executor.worker.model.model
    attn, moe = model.layers[0].self_attn, model.layers[1].mlp
    assert attn.qkv_a_proj.weight.dtype == torch.float8_e4m3fn and attn.kv_b_proj.weight.dtype == torch.float32
    assert moe.w13.dtype == torch.float8_e4m3fn and moe.w13_scale.shape[1:] == (2, 2)  # experts stay FP8
    errs, shapes, splitk, kernel = [], set(), set(), g.fp8_linear
    streamed, w16_errs, w16_kernel = set(), [], w16.w8a16_linear

    def checked_w16(x, wq, sw, tile=None):
        y, want = w16_kernel(x, wq, sw, tile), x @ dequantize(wq, sw, (128, 128)).T
        w16_errs.append(((y - want).norm() / want.norm()).item())
        streamed.add((x.shape[0], tuple(wq.shape)))
        return y

    monkeypatch.setattr(w16, "w8a16_linear", checked_w16)

    def checked(x, wq, sw, backend, split_k, fuse_act=False, serial=False):
        y, want = kernel(x, wq, sw, backend, split_k, fuse_act, serial), emulated(x, wq, sw)
        errs.append(((y - want).norm() / want.norm()).item())
        shapes.add(tuple(wq.shape))
        splitk.add(split_k)
        return y

    monkeypatch.setattr(g, "fp8_linear", checked)
    p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)
    out = llm.generate([list(range(5, 45))], p)[0].outputs[0]
    assert len(out.token_ids) == 4 and all(math.isfinite(lp.logprob) for lp in out.logprobs)
    assert len(shapes) >= 4, shapes  # q_a + kv_a, q_b, o_proj and the MLPs all went through it
    assert errs and max(errs) < 1e-5, max(errs)
    assert splitk == {True}  # the plan's fp8_gemm_splitk, on under triton
    assert {rows for rows, _ in streamed} == {1} and {w for _, w in streamed} == shapes, (streamed, shapes)
    assert max(w16_errs) < 1e-5, max(w16_errs)
    from models.layers import Linear
    llm = LLM(fp8_model, device="cpu", dtype="float32", num_kv_blocks=64, fp8_gemm=True,
              kernels="triton,fp8_gemm_splitk=0,fp8_gemm_w8a16_max_tokens=0")
    kept = [m for m in llm.engine.executor.worker.model.modules() if isinstance(m, Linear) and m.fp8_block]
    assert kept and not any(m.fp8_splitk or m.fp8_w8a16_max for m in kept)
    streamed.clear()
    llm.generate([list(range(5, 20))], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert not streamed  # with the key at 0 (its default) every projection is W8A8


def test_quantization_fp8_at_load_keeps_the_scripts_fp8_bytes(tmp_path_factory):
    """--quantization fp8 on the bf16 checkpoint with the W8A8 path (fp8_gemm=True): the FP8
    weights and scales the model keeps are byte for byte those of scripts/quantize_fp8.py's
    checkpoint."""
    src, dst = tmp_path_factory.mktemp("q_src"), tmp_path_factory.mktemp("q_dst")
    make_fp8_model(src, dst)
    kw = dict(device="cpu", dtype="float32", num_kv_blocks=64, fp8_gemm=True, kernels="triton")
    got = LLM(str(src), quantization="fp8", **kw).engine.executor.worker.model.state_dict()
    want = LLM(str(dst), **kw).engine.executor.worker.model.state_dict()
    assert got.keys() == want.keys()
    kept = [n for n, t in want.items() if t.dtype == torch.float8_e4m3fn]
    assert len(kept) >= 4, kept  # projections and experts stay FP8
    for name, t in want.items():
        a, b = (x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x for x in (got[name], t))
        assert torch.equal(a, b), name


def test_quantization_fp8_at_load_leaves_unpackable_weights_in_the_compute_dtype(tmp_path):
    """A dense MLP whose gate rows do not fill 128-row blocks (V2-Lite's 10944; 192 here) cannot
    be packed for the W8A8 GEMM: quantized at load it stays in the compute dtype (an FP8
    checkpoint's would be refused), the rest of the model is FP8, and the model runs."""
    from tiny_models import make_model
    make_model(tmp_path, "v3", hidden_size=256, q_lora_rank=128, kv_lora_rank=128, intermediate_size=192,
               moe_intermediate_size=128, num_attention_heads=4, qk_nope_head_dim=32, qk_rope_head_dim=32,
               v_head_dim=32)
    llm = LLM(str(tmp_path), quantization="fp8", device="cpu", dtype="float32", num_kv_blocks=64,
              fp8_gemm=True, kernels="triton")
    layers = llm.engine.executor.worker.model.model.layers
    assert layers[0].mlp.gate_up_proj.weight.dtype == layers[0].mlp.down_proj.weight.dtype == torch.float32
    assert layers[0].self_attn.qkv_a_proj.weight.dtype == layers[1].mlp.w13.dtype == torch.float8_e4m3fn
    out = llm.generate([list(range(5, 25))], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
