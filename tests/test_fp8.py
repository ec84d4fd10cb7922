"""FP8 block-quantized checkpoints (DeepSeek-V3/R1 format) load and match transformers. The W8A8
GEMM path through the whole model: tests/interpreted/test_fp8_model.py."""

from __future__ import annotations

import pytest
import torch
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


def _fp8_and_reference(tmp_path_factory, **overrides):
    """A tiny V3 quantized by the script, and the transformers model holding the dequantized
    weights."""
    from tiny_models import make_fp8_model
    dst = tmp_path_factory.mktemp("v3_fp8")
    hf = make_fp8_model(tmp_path_factory.mktemp("v3_bf16"), dst, **overrides)
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


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    """Dims multiples of 128 where TP splits."""
    return _fp8_and_reference(tmp_path_factory)


def _greedy_matches(path, hf):
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


def test_fp8_checkpoint_matches_transformers_dequantized(fp8_model):
    path, hf = fp8_model
    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        assert f.get_slice("model.layers.1.mlp.experts.0.gate_proj.weight").get_dtype() == "F8_E4M3"
    _greedy_matches(path, hf)


def test_fp8_partial_blocks_match_transformers_dequantized(tmp_path_factory):
    """q_a_proj rows that do not fill 128-row blocks (q_lora_rank 96, replicated): packed with
    kv_a_proj_with_mqa into one weight, each part's blocks dequantize apart."""
    path, hf = _fp8_and_reference(tmp_path_factory, q_lora_rank=96)
    _greedy_matches(path, hf)


def test_tp_split_of_a_block_is_refused(fp8_model):
    with pytest.raises(ValueError, match="tensor-parallel-size 4 would split a 128x128 FP8 block"):
        LLM(fp8_model[0], device="cpu", dtype="float32", num_kv_blocks=64, tensor_parallel_size=4)


def test_weights_out_of_memory_names_fp8_gemm(fp8_model, monkeypatch):
    """Weights that do not fit a rank's GPU stop start-up with a MemoryError that says what to do:
    for an FP8 checkpoint dequantized by default (here: the CPU), --fp8-gemm (or more -tp); with --fp8-gemm set
    or a bf16 checkpoint, more -tp only. (The out-of-memory error is raised by a stand-in for the
    model build: this machine has no GPU.)"""
    from engine.worker import Worker

    def oom(self, fp8_gemm):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.00 GiB")
    monkeypatch.setattr(Worker, "_build_model", oom)
    with pytest.raises(MemoryError, match=r"loading the model's weights on cpu: this FP8 checkpoint is dequantized "
                                          r"to torch.float32 by default where the W8A8 kernels do not run \(the "
                                          r"CPU, --kernels torch\); --fp8-gemm keeps "
                                          r"its weights in FP8 .*a larger --tensor-parallel-size than 1"):
        LLM(fp8_model[0], device="cpu", dtype="float32", num_kv_blocks=64)
    with pytest.raises(MemoryError, match=r"dequantized to torch.float32 with --no-fp8-gemm; --fp8-gemm keeps"):
        LLM(fp8_model[0], device="cpu", dtype="float32", num_kv_blocks=64, fp8_gemm=False)
    # with --fp8-gemm (or a checkpoint that is not FP8) only more ranks help
    from types import SimpleNamespace
    w = Worker.__new__(Worker)
    w.device, w.dtype = torch.device("cpu"), torch.bfloat16
    w.args = SimpleNamespace(tensor_parallel_size=2)
    w.cfg = SimpleNamespace(fp8_block=(128, 128))
    msg = w._weights_oom_message(fp8_gemm=True)
    assert msg.endswith("on cpu: a larger --tensor-parallel-size than 2 splits them over more GPUs"), msg
    w.cfg = SimpleNamespace(fp8_block=None)
    assert w._weights_oom_message(fp8_gemm=False) == msg


def test_fp8_gemm_unset_keeps_fp8_where_the_w8a8_kernels_run(fp8_model, monkeypatch, caplog):
    """--fp8-gemm unset (engine/weight_memory.py): an FP8 checkpoint stays in FP8 wherever the W8A8
    kernels run (CUDA and a Triton plan), whatever memory is left, and is dequantized elsewhere (the
    CPU, the torch plan); set either way, the flag wins; a checkpoint that is not FP8 is never
    kept in FP8. The log line gives the dequantized size, counted on a meta-device model (equal to
    the bytes the dequantized model really holds), next to the tightest rank's budget."""
    import logging

    import engine.weight_memory as wm
    from models.config import ModelConfig
    llm = LLM(fp8_model[0], device="cpu", dtype="float32", num_kv_blocks=64)  # unset, on the CPU: dequantized
    model = llm.engine.executor.worker.model
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert not any(t.dtype == torch.float8_e4m3fn for t in model.parameters())
    cfg = ModelConfig.from_pretrained(fp8_model[0])
    need = wm.dequantized_weight_bytes(cfg, torch.float32)
    assert need == held, (need, held)
    assert wm.dequantized_weight_bytes(cfg, torch.bfloat16) < need  # 2 bytes a dequantized weight, not 4
    for requested, fp8_ckpt, can, want in ((None, True, True, True), (None, True, False, False),
                                           (False, True, True, False), (True, True, False, True),
                                           (True, False, True, False), (None, False, True, False)):
        assert wm.keep_fp8(requested, fp8_ckpt, can) is want, (requested, fp8_ckpt, can)
    # on a "GPU" of 80 GB with 1 GB held elsewhere: budget 0.9 * 80 - 1 = 71 GB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (79e9, 80e9))
    cuda = torch.device("cuda")
    monkeypatch.setattr(wm, "dequantized_weight_bytes", lambda *a: 10e9)  # fits easily: FP8 all the same
    with caplog.at_level(logging.INFO, logger="engine.weight_memory"):
        assert wm.resolve_fp8_gemm(None, cfg, torch.bfloat16, cuda, True, 0.9) is True
    assert "kept in FP8" in caplog.text and "would take 9.3 GiB of this rank's 66.1 GiB budget" in caplog.text
    assert "--no-fp8-gemm dequantizes" in caplog.text
    assert wm.resolve_fp8_gemm(False, cfg, torch.bfloat16, cuda, True, 0.9) is False
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.weight_memory"):
        assert wm.resolve_fp8_gemm(None, cfg, torch.bfloat16, cuda, False, 0.9) is False  # torch plan
    assert "dequantized to torch.bfloat16 at load" in caplog.text and "Triton kernel plan" in caplog.text
    assert wm.resolve_fp8_gemm(None, cfg, torch.bfloat16, torch.device("cpu"), True, 0.9) is False
    # under TP the log gives the smallest budget over the ranks (an all-reduce MIN on the CPU group)
    reduced = []

    def all_reduce(t, op, group):
        reduced.append((t.item(), op, group))
        t.fill_(50e9)  # another rank's budget: 50 GB
    monkeypatch.setattr(wm.pd, "cpu_group", lambda: "cpu-group")
    monkeypatch.setattr(wm.dist, "all_reduce", all_reduce)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.weight_memory"):
        assert wm.resolve_fp8_gemm(None, cfg, torch.bfloat16, cuda, True, 0.9) is True
    assert reduced == [(71e9, wm.dist.ReduceOp.MIN, "cpu-group")] and "46.6 GiB budget" in caplog.text


def test_fp8_gemm_flag_is_tri_state():
    """serve's --fp8-gemm / --no-fp8-gemm / unset map to True / False / None (auto)."""
    from common.args import EngineArgs
    from server.flags import build_parser, engine_args_from
    for argv, want in (([], None), (["--fp8-gemm"], True), (["--no-fp8-gemm"], False)):
        ns = build_parser().parse_args(["--load-format", "dummy", *argv])
        assert engine_args_from(ns).fp8_gemm is want, argv
    with pytest.raises(ValueError, match="fp8_gemm must be a bool or None"):
        EngineArgs(load_format="dummy", fp8_gemm="false")


def _weights(llm) -> dict[str, torch.Tensor]:
    return dict(llm.engine.executor.worker.runner.model.state_dict())


def test_quantization_fp8_at_load_equals_the_script(tmp_path_factory, caplog):
    """--quantization fp8 on the bf16 checkpoint: the weights scripts/quantize_fp8.py writes
    (here dequantized alike: no W8A8 kernels on the CPU, which the log says), so the same tokens
    and logprobs as that FP8 checkpoint; a checkpoint quantized another way is refused, and a
    bf16 tensor in an FP8 checkpoint is an error naming it."""
    import json
    import logging

    from safetensors.torch import load_file

    from tiny_models import make_fp8_model
    src, dst = tmp_path_factory.mktemp("q_src"), tmp_path_factory.mktemp("q_dst")
    make_fp8_model(src, dst)
    kw = dict(device="cpu", dtype="float32", num_kv_blocks=64)
    with caplog.at_level(logging.INFO, logger="engine.worker"):
        online = LLM(str(src), quantization="fp8", **kw)
    assert "--quantization fp8: no W8A8 kernels on cpu" in caplog.text
    offline, plain = LLM(str(dst), **kw), LLM(str(src), **kw)
    got, want, bf16 = _weights(online), _weights(offline), _weights(plain)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert not torch.equal(got["model.layers.0.self_attn.o_proj.weight"],
                           bf16["model.layers.0.self_attn.o_proj.weight"])  # quantized, not the bf16 weights
    prompt = torch.randint(2, 320, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    a, b = (llm.generate([prompt], sp)[0].outputs[0] for llm in (online, offline))
    assert a.token_ids == b.token_ids and [x.logprob for x in a.logprobs] == [x.logprob for x in b.logprobs]

    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantization_config .* is not supported"):
        LLM(str(src), quantization="fp8", **kw)
    tensors = load_file(str(dst / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = dequantize(tensors[name], tensors[name + "_scale_inv"], (128, 128), torch.bfloat16)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"checkpoint tensor {name} is BF16 where this FP8 checkpoint"):
        LLM(str(dst), **kw)
