"""Train a multi-token-prediction (MTP) layer for the bundled tiny V3 on its own task, the main
model frozen, and add it to the checkpoint as V3 lays MTP out (models/mtp.py).

At position i the layer sees the main model's final hidden state h_i and the embedding of token
i+1 and learns token i+2 (the loss covers the answer spans, as the main model's training does):
    x = eh_proj([enorm(embed(t_{i+1})) ‖ hnorm(h_i)]);  g = block(x);  logits = head(norm(g))
with the embedding and the head the main model's (frozen, and not stored again: the loader shares
them). The block starts as a copy of the last decoder layer and eh_proj as a pass-through of h,
so training starts from "predict what the main head predicts next" and is short on a CPU.

The layer's tensors are written as `model.layers.{L}.*` (L = num_hidden_layers) to a separate
`mtp.safetensors` beside `model.safetensors`, and config.json gets num_nextn_predict_layers = 1:
this server's loader reads every *.safetensors file of a directory without an index, while
transformers reads model.safetensors only and so still loads the model without unexpected keys.

  python -m scripts.train_tiny_mtp --model configs/models/tiny-deepseek-v3 --steps 400
  python -m scripts.train_tiny_mtp --model configs/models/tiny-deepseek-v3 --eval-only   # acceptance
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from scripts.train_tiny_model import TaskStream, lr_at, official_state_dict, use_dense_experts

logger = logging.getLogger(__name__)


class MTPHead(nn.Module):
    """The trainable MTP layer, under the checkpoint's names (relative to model.layers.{L}.)."""

    def __init__(self, hf):
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm
        cfg, D = hf.config, hf.config.hidden_size
        last = hf.model.layers[-1]
        self.enorm = DeepseekV3RMSNorm(D, cfg.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(D, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        with torch.no_grad():
            self.eh_proj.weight.normal_(0.0, 0.01)
            self.eh_proj.weight[:, D:] += torch.eye(D)
        # the block's modules at the layer's top level, as in the checkpoint
        self.self_attn = copy.deepcopy(last.self_attn)
        self.mlp = copy.deepcopy(last.mlp)
        self.input_layernorm = copy.deepcopy(last.input_layernorm)
        self.post_attention_layernorm = copy.deepcopy(last.post_attention_layernorm)
        self.shared_head = nn.Module()
        self.shared_head.norm = copy.deepcopy(hf.model.norm)

    def forward(self, hf, next_ids, hidden, position_embeddings):
        x = self.eh_proj(torch.cat([self.enorm(hf.model.embed_tokens(next_ids)), self.hnorm(hidden)], -1))
        h = self.input_layernorm(x)
        h, _ = self.self_attn(hidden_states=h, attention_mask=None, position_embeddings=position_embeddings)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return hf.lm_head(self.shared_head.norm(x))


def train(a) -> None:
    from transformers import AutoModelForCausalLM
    torch.manual_seed(a.seed)
    hf = AutoModelForCausalLM.from_pretrained(str(a.model), dtype=torch.float32)
    hf.config._attn_implementation = "sdpa"
    hf.eval().requires_grad_(False)
    use_dense_experts(hf)  # no host syncs in the experts (and a check against transformers' own)
    mtp = MTPHead(hf).train().requires_grad_(True)
    opt = torch.optim.AdamW(mtp.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    stream = iter(TaskStream(a.model / "tokenizer.json", a.seed, a.batch_size, a.seq_len))
    start = time.time()
    for step in range(a.steps):
        ids, mask = next(stream)  # [B, S+1]
        with torch.no_grad():
            h = hf.model(input_ids=ids[:, :-1]).last_hidden_state  # [B, S, D], after the final norm
        S = h.shape[1]
        pos = torch.arange(S - 1).unsqueeze(0).expand(ids.shape[0], -1)
        pe = hf.model.rotary_emb(h, pos)
        logits = mtp(hf, ids[:, 1:S], h[:, : S - 1], pe)  # position i predicts token i + 2
        target, m = ids[:, 2:S + 1], mask[:, 2:S + 1].float()
        loss = (F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none") * m.flatten()).sum() / m.sum()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a.steps, a.lr, a.warmup)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
        opt.step()
        if step % 20 == 0 or step == a.steps - 1:
            if not math.isfinite(loss.item()):
                raise ValueError(f"loss is {loss.item()} at step {step}")
            acc = ((logits.argmax(-1) == target).float() * m).sum() / m.sum()
            logger.info("step %4d/%d loss %.4f top-1 %.3f %.0fs", step, a.steps, loss.item(), acc.item(),
                        time.time() - start)
    save(mtp, hf, a.model)


def save(mtp: MTPHead, hf, model_dir: Path) -> None:
    from safetensors.torch import save_file
    L = hf.config.num_hidden_layers
    # the block's experts in the official per-expert layout, like the rest of the checkpoint
    tensors = {f"model.layers.{L}.{k}": v for k, v in official_state_dict(mtp).items()}
    save_file(tensors, str(model_dir / "mtp.safetensors"), metadata={"format": "pt"})
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_nextn_predict_layers"] = 1
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    logger.info("wrote %d tensors to %s", len(tensors), model_dir / "mtp.safetensors")


def evaluate(a) -> None:
    """Acceptance of MTP drafts on the task's 5-shot test prompts, greedy, through the engine;
    outputs must equal those without speculation."""
    from engine import LLM, SamplingParams
    from scripts.eval_tiny_model_hf import DEFAULT_DATA, build_prompts
    from scripts.make_task_data import read_jsonl
    prompts = build_prompts(read_jsonl(DEFAULT_DATA / "train.jsonl"),
                            read_jsonl(DEFAULT_DATA / "test.jsonl"))[: a.eval_items]
    params = SamplingParams(temperature=0, max_tokens=48, stop=["Question:"])
    ref = None
    for spec in (None, *({"method": "mtp", "num_speculative_tokens": k} for k in a.eval_k)):
        llm = LLM(str(a.model), device="cpu", dtype="float32", speculative_config=spec)
        t0 = time.time()
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        dt = time.time() - t0
        s = llm.scheduler.stats.spec
        llm.engine.shutdown()
        if ref is None:
            ref = outs
            print(f"no speculation: {sum(map(len, outs))} tokens in {dt:.1f} s")
            continue
        same = outs == ref
        rate = s.num_accepted_tokens / max(s.num_draft_tokens, 1)
        per_pos = [n / max(s.num_drafts, 1) for n in s.accepted_per_pos]
        print(f"mtp k={spec['num_speculative_tokens']}: acceptance {rate:.3f} of draft tokens, "
              f"mean acceptance length {1 + s.num_accepted_tokens / max(s.num_drafts, 1):.2f}, "
              f"per position {[round(p, 3) for p in per_pos]}, {s.num_drafts} drafts, "
              f"outputs equal without speculation: {same}, {dt:.1f} s")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("configs/models/tiny-deepseek-v3"))
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=400)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eval-only", action="store_true")
    p.add_argument("--eval-items", type=int, default=50)
    p.add_argument("--eval-k", type=int, nargs="+", default=[1, 2])
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if not a.eval_only:
        train(a)
    evaluate(a)


if __name__ == "__main__":
    main()
