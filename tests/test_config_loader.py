"""Config parsing (both RoPE spellings, real configs), dummy weights, MTP tensors skipped."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from models.config import ModelConfig

REAL = ["DeepSeek-V2-Lite", "DeepSeek-V2", "DeepSeek-V3", "DeepSeek-R1"]


def test_rope_spellings_agree():
    old = {"model_type": "deepseek_v2", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 1, "kv_lora_rank": 8, "qk_nope_head_dim": 8,
           "qk_rope_head_dim": 8, "v_head_dim": 8, "rope_theta": 500.0,
           "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                            "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}}
    new = {k: v for k, v in old.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 40,
                              "original_max_position_embeddings": 4096, "mscale": 0.707,
                              "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
    a, b = ModelConfig.from_dict(old), ModelConfig.from_dict(new)
    assert a.rope == b.rope and a.rope.theta == 500.0 and a.rope.type == "yarn"


@pytest.mark.parametrize("name", REAL)
def test_real_configs_parse(name):
    cfg = ModelConfig.from_pretrained(f"configs/models/{name}")
    assert cfg.kv_cache_dim == 576 and cfg.qk_head_dim == 192
    if name == "DeepSeek-V2-Lite":
        assert cfg.q_lora_rank is None and abs(cfg.softmax_scale - 0.1147) < 1e-4  # DESIGN.md §4
    if name in ("DeepSeek-V3", "DeepSeek-R1"):
        assert cfg.scoring_func == "sigmoid" and cfg.fp8_block == (128, 128)


def test_bad_config_value_is_named():
    d = json.load(open("configs/models/DeepSeek-V2-Lite/config.json"))
    with pytest.raises(ValueError, match="n_routed_experts 64 is not divisible by n_group 5"):
        ModelConfig.from_dict(d, {"n_group": 5})


def test_dummy_weights_need_no_checkpoint(tiny_v3, tmp_path):
    shutil.copy(f"{tiny_v3[0]}/config.json", tmp_path / "config.json")  # no safetensors at all
    llm = LLM(str(tmp_path), load_format="dummy", device="cpu", num_kv_blocks=32)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_max_model_len_auto_fits_the_kv_cache(tiny_v3, caplog):
    """`auto` is the model's limit cut to what the cache holds; a number is kept as given."""
    limit = ModelConfig.from_pretrained(tiny_v3[0]).max_position_embeddings
    assert limit > 8 * 16
    with caplog.at_level(logging.WARNING, logger="engine.core"):
        llm = LLM(tiny_v3[0], load_format="dummy", device="cpu", num_kv_blocks=8, max_model_len="auto")
    assert llm.engine.max_model_len == 8 * 16 and f"{8 * 16} tokens" in caplog.text
    with pytest.raises(ValueError, match="max_model_len"):  # the fitted length is what requests meet
        llm.generate([[5] * 120], SamplingParams(max_tokens=20))
    kept = LLM(tiny_v3[0], load_format="dummy", device="cpu", num_kv_blocks=8, max_model_len=100)
    assert kept.engine.max_model_len == 100


def test_mtp_layer_tensors_are_skipped_with_a_log(tiny_v3, tmp_path, caplog):
    dst = tmp_path / "with_mtp"
    shutil.copytree(tiny_v3[0], dst)
    t = load_file(dst / "model.safetensors")
    n = ModelConfig.from_pretrained(dst).num_hidden_layers
    t[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(4, 4)  # an MTP layer past the decoder
    t[f"model.layers.{n}.enorm.weight"] = torch.zeros(4)
    save_file(t, dst / "model.safetensors")
    with caplog.at_level(logging.INFO, logger="models.loader"):
        llm = LLM(str(dst), device="cpu", dtype="float32", num_kv_blocks=32)
    assert "skipped 2 tensors of multi-token-prediction layers" in caplog.text
    ref = LLM(tiny_v3[0], device="cpu", dtype="float32", num_kv_blocks=32)
    p = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    assert llm.generate([[3, 4, 5]], p)[0].outputs[0].token_ids == ref.generate([[3, 4, 5]], p)[0].outputs[0].token_ids


def test_sharded_checkpoint_with_index(tiny_v3, tmp_path):
    src = tiny_v3[0]
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    t = load_file(f"{src}/model.safetensors")
    names = sorted(t)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in halves.items():
        save_file({k: t[k] for k in keys}, dst / fname)
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, ks in halves.items() for k in ks}}))
    p = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0)
    a = LLM(str(dst), device="cpu", dtype="float32", num_kv_blocks=32).generate([[3, 4, 5]], p)[0].outputs[0]
    b = LLM(src, device="cpu", dtype="float32", num_kv_blocks=32).generate([[3, 4, 5]], p)[0].outputs[0]
    assert a.token_ids == b.token_ids and a.logprobs[0].logprob == b.logprobs[0].logprob
