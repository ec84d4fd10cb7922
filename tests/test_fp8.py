"""FP8 block-quantized checkpoints (DeepSeek-V3/R1 format) load and match transformers (issue 9)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from interpreted import run_interpreted
from safetensors import safe_open
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from models.fp8 import dequantize, quantize


def test_quantize_roundtrip_and_partial_blocks():
    torch.manual_seed(0)
    w = torch.randn(300, 200)  # partial edge blocks in both dims
    q, s = quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2)
    back = dequantize(q, s, (128, 128))
    assert ((back - w).norm() / w.norm()).item() < 0.05  # e4m3 has a 3-bit mantissa


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    """A tiny V3 (hidden 256, dims multiple of 128 where TP splits) quantized by the script, and
    the transformers model holding the dequantized weights."""
    from tiny_models import make_model
    src = tmp_path_factory.mktemp("v3_bf16")
    hf = make_model(src, "v3", hidden_size=256, q_lora_rank=128, kv_lora_rank=128, intermediate_size=256,
                    moe_intermediate_size=128, num_attention_heads=4, qk_nope_head_dim=32,
                    qk_rope_head_dim=32, v_head_dim=32)
    dst = tmp_path_factory.mktemp("v3_fp8")
    subprocess.run([sys.executable, "scripts/quantize_fp8.py", str(src), str(dst)], check=True)
    sd = {}
    with safe_open(str(dst / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            if not name.endswith("_scale_inv"):
                t = f.get_tensor(name)
                if t.dtype == torch.float8_e4m3fn:
                    t = dequantize(t, f.get_tensor(name + "_scale_inv"), (128, 128))
                sd[name] = t
    # transformers reads the dequantized weights from a plain checkpoint beside it
    deq = tmp_path_factory.mktemp("v3_deq")
    save_file(sd, str(deq / "model.safetensors"), metadata={"format": "pt"})
    hf.config.save_pretrained(deq)
    ref = type(hf).from_pretrained(deq, dtype=torch.float32).eval()
    return str(dst), ref


def test_fp8_checkpoint_matches_transformers_dequantized(fp8_model):
    path, hf = fp8_model
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        assert f.get_slice("model.layers.1.mlp.experts.0.gate_proj.weight").get_dtype() == "F8_E4M3"
    torch.manual_seed(1)
    prompt = torch.randint(2, 320, (40,)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1].float()
        gen = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, 40:].tolist()
    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=64)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                logprobs=0))[0].outputs[0]
    assert out.token_ids == gen
    lp = torch.log_softmax(ref, -1)[gen[0]].item()
    assert abs(out.logprobs[0].logprob - lp) < 1e-4


def test_tp_split_of_a_block_is_refused(fp8_model):
    with pytest.raises(ValueError, match="tensor-parallel-size 4 would split a 128x128 FP8 block"):
        LLM(fp8_model[0], device="cpu", dtype="float32", num_kv_blocks=64, tensor_parallel_size=4)


def test_fp8_gemm_path_runs_the_model(fp8_model):
    """--fp8-gemm keeps attention/MLP projections in FP8 and runs them through the Triton W8A8
    kernels (interpreter on CPU), and keeps the routed experts in FP8 (dequantized on the fly on
    the CPU path). Every W8A8 call the model makes equals a pure-torch emulation of the same
    arithmetic (activations quantized per 128-group, both operands dequantized, fp32 matmul) on
    the same input. Whole-model logprobs are not compared: with FP8 activations a one-ulp
    difference upstream flips an element's FP8 rounding downstream, so two correct
    implementations drift apart by ~1e-3 on a random tiny model."""
    code = f"""
import math
import torch
import models.fp8_gemm as g
from engine import LLM, SamplingParams
from models.fp8 import dequantize, quantize
p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)
prompt = list(range(5, 45))
llm = LLM({fp8_model[0]!r}, device="cpu", dtype="float32", num_kv_blocks=64, fp8_gemm=True)
attn = llm.engine.executor.worker.model.model.layers[0].self_attn
assert attn.q_a_proj.weight.dtype == torch.float8_e4m3fn and attn.kv_b_proj.weight.dtype == torch.float32
moe = llm.engine.executor.worker.model.model.layers[1].mlp
assert moe.w13.dtype == torch.float8_e4m3fn and moe.w13_scale.shape[1:] == (2, 2)  # experts stay FP8

def emulated(x, wq, sw):
    xq, sx = quantize(x.reshape(-1, x.shape[-1]), (1, 128))
    y = dequantize(xq, sx, (1, 128)) @ dequantize(wq, sw, (128, 128)).T
    return y.view(*x.shape[:-1], wq.shape[0]).to(x.dtype)

kernel, errs, shapes = g.fp8_linear, [], set()
def checked(x, wq, sw):
    y, want = kernel(x, wq, sw), emulated(x, wq, sw)
    errs.append(((y - want).norm() / want.norm()).item())
    shapes.add(tuple(wq.shape))
    return y

g.fp8_linear = checked
out = llm.generate([prompt], p)[0].outputs[0]
assert len(out.token_ids) == 4 and all(math.isfinite(lp.logprob) for lp in out.logprobs)
assert len(shapes) >= 4, shapes  # q_a, q_b, kv_a, o_proj and the MLPs all went through it
assert errs and max(errs) < 1e-5, max(errs)
"""
    run_interpreted(code)
