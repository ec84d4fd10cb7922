"""Tiny random DeepSeek models built with `transformers` on the fly (the golden reference)."""

from __future__ import annotations

import torch
import transformers

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_shared_experts=1,
              first_k_dense_replace=1, max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
              tie_word_embeddings=False)


def v2_config(**kw) -> transformers.DeepseekV2Config:
    """V2-Lite shape: no q_lora, softmax routing (greedy unless topk_method given), YaRN."""
    c = dict(COMMON, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2,
             topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0,
             norm_topk_prob=False, rope_scaling=dict(YARN, mscale=1.0, mscale_all_dim=1.0))
    c.update(kw)
    return transformers.DeepseekV2Config(**c)


def v3_config(**kw) -> transformers.DeepseekV3Config:
    """V3 shape: q_lora, sigmoid + bias + group top-k routing, YaRN with mscale_all_dim."""
    c = dict(COMMON, q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
             topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, rope_scaling=dict(YARN))
    c.update(kw)
    return transformers.DeepseekV3Config(**c)


def build(cfg, path, seed: int = 0):
    """Random weights (larger than HF's init so routing and attention are not near-uniform)."""
    torch.manual_seed(seed)
    cls = transformers.DeepseekV3ForCausalLM if cfg.model_type == "deepseek_v3" else transformers.DeepseekV2ForCausalLM
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.3, 0.3)  # non-zero: the bias must change the choice, not the weight
    model.save_pretrained(path)
    return model


BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
_CORPUS = ["Question: Mia has 7 apples and Leo has 3 pens. How many in all?\nAnswer: 7 + 3 = 10 #### 10",
           "The quick brown fox jumps over the lazy dog. naïve café 数学 🙂",
           "Hello world! Hello there, general. 0123456789 + - * / = ####"] * 20


def save_tokenizer(path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer with DeepSeek's BOS/EOS spellings (BOS id 0, EOS id 1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)
    fast.chat_template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
                          "<｜User｜>{{ m['content'] }}{% else %}<｜Assistant｜>{{ m['content'] }}"
                          "{{ eos_token }}{% endif %}{% endfor %}"
                          "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")
    fast.save_pretrained(path)


def make_model(path, kind: str = "v3", seed: int = 0, **kw):
    """Build, save and return a tiny HF model plus its tokenizer in `path`."""
    cfg = (v3_config if kind == "v3" else v2_config)(**kw)
    model = build(cfg, path, seed)
    save_tokenizer(path, cfg.vocab_size)
    return model


def make_fp8_model(src, dst, **overrides):
    """A tiny V3 (hidden 256, dims multiples of 128 where TP splits, unless `overrides` say
    otherwise) saved in `src`, quantized by scripts/quantize_fp8.py into `dst`; returns the
    transformers model of `src`."""
    import subprocess
    import sys
    from pathlib import Path

    dims = dict(hidden_size=256, q_lora_rank=128, kv_lora_rank=128, intermediate_size=256,
                moe_intermediate_size=128, num_attention_heads=4, qk_nope_head_dim=32,
                qk_rope_head_dim=32, v_head_dim=32)
    hf = make_model(src, "v3", **{**dims, **overrides})
    script = Path(__file__).resolve().parents[1] / "scripts" / "quantize_fp8.py"
    subprocess.run([sys.executable, str(script), str(src), str(dst)], check=True)
    return hf


def add_mtp_layer(path, seed: int = 0, copies: bool = True, near_main: bool = True) -> None:
    """Append one multi-token-prediction layer to a saved tiny V3 (transformers has no MTP):
    `model.layers.{L}.*` with L = num_hidden_layers, in the V3 checkpoint layout (enorm, hnorm,
    eh_proj, a MoE decoder block, shared_head.norm / head, embed_tokens), and
    num_nextn_predict_layers = 1 in config.json. `copies`: store the embedding and head copies
    (else the loader must share the main model's). `near_main`: eh_proj passes the main hidden
    state through and the block adds little, so the MTP head guesses roughly what the main head
    does next (drafts are accepted sometimes); else all random."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    assert len(files) == 1, files
    tensors = load_file(str(files[0]))
    L, D = cfg["num_hidden_layers"], cfg["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    src = f"model.layers.{L - 1}."  # a MoE layer: the MTP block has its shapes
    for name, t in list(tensors.items()):
        if name.startswith(src):
            new = name.replace(src, f"model.layers.{L}.", 1)
            if name.endswith("norm.weight"):
                tensors[new] = torch.empty_like(t).uniform_(0.8, 1.2, generator=g)
            elif name.endswith("e_score_correction_bias"):
                tensors[new] = torch.empty_like(t).uniform_(-0.3, 0.3, generator=g)
            else:
                scale = 0.01 if near_main and ("o_proj" in name or "down_proj" in name) else 0.08
                tensors[new] = torch.empty_like(t).normal_(0.0, scale, generator=g)
    p = f"model.layers.{L}."
    tensors[p + "enorm.weight"] = torch.ones(D)
    tensors[p + "hnorm.weight"] = torch.ones(D)
    eh = torch.empty(D, 2 * D).normal_(0.0, 0.02 if near_main else 0.08, generator=g)
    if near_main:
        eh[:, D:] += torch.eye(D)
    tensors[p + "eh_proj.weight"] = eh
    tensors[p + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    if copies:
        tensors[p + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
        tensors[p + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(files[0]), metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
