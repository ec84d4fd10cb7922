"""The committed tiny DeepSeek-V3 checkpoint: format, tokenizer, chat template, greedy accuracy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO / "configs" / "models" / "tiny-deepseek-v3"
DATA_DIR = REPO / "configs" / "lm_eval" / "tiny_arith"
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()


def test_config_is_official_v3_layout():
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3"
    assert cfg["q_lora_rank"] and cfg["scoring_func"] == "sigmoid" and cfg["topk_method"] == "noaux_tc"
    assert cfg["rope_scaling"]["type"] == "yarn" and cfg["rope_scaling"]["factor"] > 1
    assert cfg["n_routed_experts"] % cfg["n_group"] == 0 and cfg["topk_group"] < cfg["n_group"]
    assert cfg["first_k_dense_replace"] == 1 and cfg["n_shared_experts"] == 1
    assert (MODEL_DIR / "model.safetensors").stat().st_size < 30 * 2**20


def test_safetensors_has_per_expert_official_names():
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    with safe_open(str(MODEL_DIR / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
        gate = f.get_tensor("model.layers.1.mlp.experts.0.gate_proj.weight")
    assert not any("gate_up_proj" in k for k in keys)
    last = cfg["num_hidden_layers"] - 1
    for e in range(cfg["n_routed_experts"]):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert f"model.layers.{last}.mlp.experts.{e}.{proj}.weight" in keys
    assert "model.layers.0.mlp.gate_proj.weight" in keys  # first layer dense
    assert gate.dtype == torch.bfloat16 and gate.shape == (cfg["moe_intermediate_size"], cfg["hidden_size"])
    # trained aux-loss-free bias: fp32 and not all zero, so a loader that drops it is caught
    assert bias.dtype == torch.float32 and bias.abs().max() > 0


def test_tokenizer_round_trip_and_special_tokens(tokenizer):
    assert tokenizer.bos_token == BOS and tokenizer.eos_token == EOS
    assert tokenizer.bos_token_id == 0 and tokenizer.eos_token_id == 1
    text = "Question: Mia has 7 apples. Leo has 13 pens.\nAnswer: 7 + 13 = 20.\n#### 20 ünïcode ✓"
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.eos_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(ids) == BOS + text


def test_chat_template_renders_deepseek_markers(tokenizer):
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == f"{BOS}sys<｜User｜>hi<｜Assistant｜>yo{EOS}<｜User｜>again<｜Assistant｜>"
    ids = tokenizer.apply_chat_template(messages[:2], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.convert_ids_to_tokens(ids[-1]) == "<｜Assistant｜>"


def test_model_loads_with_vocab_covering_tokenizer(model, tokenizer):
    assert model.config.vocab_size >= len(tokenizer)
    assert model.config.rope_parameters["rope_type"] == "yarn"


def test_greedy_five_shot_accuracy(model, tokenizer):
    """The committed checkpoint scores 1.00 on all 200 test items (docs/tiny_model.md); the bar
    is 0.6. Here 20 items in one padded batch, with a margin for a retrained checkpoint."""
    from scripts.eval_tiny_model_hf import evaluate

    acc, texts = evaluate(model, tokenizer, DATA_DIR, limit=20, add_bos=True, batch_size=20)
    assert acc >= 0.9, f"5-shot greedy accuracy {acc:.2f} on 20 items; first output {texts[0]!r}"


@pytest.mark.parametrize("budget", [32, 2048])
def test_engine_greedy_equals_transformers_on_task_prompts(model, tokenizer, budget):
    """Our engine (fp32, CPU) generates exactly what transformers does on lm_eval's 5-shot prompts,
    with every prompt chunked (budget 32) and not: the basis of the server-vs-reference accuracy."""
    from engine import LLM, SamplingParams
    from scripts.eval_tiny_model_hf import build_prompts, generate_greedy
    from scripts.make_task_data import read_jsonl

    prompts = build_prompts(read_jsonl(DATA_DIR / "train.jsonl"), read_jsonl(DATA_DIR / "test.jsonl")[:6])
    ref = generate_greedy(model, tokenizer, prompts, add_bos=True, batch_size=1, max_new_tokens=30)
    llm = LLM(str(MODEL_DIR), device="cpu", dtype="float32", max_num_batched_tokens=budget)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30, stop=["Question:"]))
    got = [o.outputs[0].text for o in outs]
    assert [g.strip() for g in got] == [r.strip() for r in ref]
    assert all("####" in g for g in got)  # the model answers in the task's format
