"""Train the tiny DeepSeek-V3-architecture model on tiny_arith and save it in the official format.

Real architecture at tiny size: MLA with q_lora_rank, YaRN RoPE (factor 4 over 512 positions,
interleaved pairs), sigmoid-scored MoE with e_score_correction_bias (updated aux-loss-free during
training so it is non-zero), grouped top-k routing, a shared expert, first layer dense.

Sequences pack k-shot examples (70% plain with BOS, 20% plain without BOS as lm_eval's hf model
sends them, 10% DeepSeek chat turns); the loss covers answers and the text that follows them.

The checkpoint is written as the official DeepSeek-V3 layout: config.json with `rope_scaling`
(type yarn) and `rope_theta`, and model.safetensors with per-expert tensors
`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`, bf16 except the fp32
`e_score_correction_bias`.

Usage (device, from the repo root):  python3 -m scripts.train_tiny_model --out $OUT/tiny-deepseek-v3
CPU smoke test:                      python -m scripts.train_tiny_model --out /tmp/t --smoke
CPU run (see docs/tiny_model.md):    python -m scripts.train_tiny_model --out /tmp/t --size small --threads 1 \
                                         --workers 0 --batch-size 16 --seq-len 400 --save-every 300
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import shutil
import time
import types
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from scripts.make_task_data import (  # noqa: E402
    ASSISTANT, EOS, MAX_FACTS, MIN_FACTS, USER, fact_text, format_shot, make_example, make_facts)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
logger = logging.getLogger(__name__)


# Size presets over the base config below; "small" is the CPU-trainable one.
SIZES = {
    "base": {},
    "small": dict(hidden_size=128, intermediate_size=384, moe_intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, q_lora_rank=64,
                  kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32),
    "smoke": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8, q_lora_rank=32,
                  kv_lora_rank=32),
}


def model_config(vocab_size: int, size: str = "base") -> dict:
    """config.json contents in the official DeepSeek-V3 format (tiny sizes)."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": vocab_size, "hidden_size": 256, "intermediate_size": 768,
        "moe_intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 8, "n_shared_experts": 1, "n_routed_experts": 16,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 64, "q_lora_rank": 128,
        "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "n_group": 4, "topk_group": 2,
        "num_experts_per_tok": 2, "moe_layer_freq": 1, "first_k_dense_replace": 1,
        "norm_topk_prob": True, "aux_loss_alpha": 0.0, "seq_aux": True, "hidden_act": "silu",
        "max_position_embeddings": 2048, "initializer_range": 0.02, "rms_norm_eps": 1e-6,
        "use_cache": True, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
        "tie_word_embeddings": False, "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
        "attention_bias": False, "attention_dropout": 0.0, "num_nextn_predict_layers": 0,
        "torch_dtype": "bfloat16",
    }
    cfg.update(SIZES[size])
    return cfg


def build_model(cfg: dict):
    """A freshly initialised DeepseekV3ForCausalLM from the official-format config dict."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    hf_cfg = DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    hf_cfg._attn_implementation = "sdpa"
    return DeepseekV3ForCausalLM(hf_cfg)


def dense_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """All experts on all tokens, weighted by the (mostly zero) routing weights: no host syncs."""
    # hidden [N, D]; gate_up_proj [E, 2I, D]; down_proj [E, D, I]; weights [N, E], zero off the top-k
    weights = torch.zeros(hidden_states.shape[0], self.num_experts, device=hidden_states.device,
                          dtype=top_k_weights.dtype).scatter(1, top_k_index, top_k_weights)
    gate, up = torch.einsum("nd,efd->enf", hidden_states, self.gate_up_proj).chunk(2, dim=-1)
    out = torch.einsum("eni,edi->end", self.act_fn(gate) * up, self.down_proj)  # [E, N, D]
    return torch.einsum("end,ne->nd", out, weights.to(out.dtype)).to(hidden_states.dtype)


def use_dense_experts(model, dense: bool = True) -> list:
    """Swap each experts module's forward for the dense one (checked equal); return the routers."""
    routers = []
    for name, module in model.named_modules():
        if name.endswith("mlp.experts") and dense:
            if not (hasattr(module, "gate_up_proj") and hasattr(module, "down_proj")):
                raise ValueError(f"{name}: expected fused gate_up_proj/down_proj expert tensors")
            x = torch.randn(8, module.gate_up_proj.shape[-1], device=module.gate_up_proj.device)
            idx = torch.stack([torch.randperm(module.num_experts)[:2] for _ in range(8)]).to(x.device)
            w = torch.rand(8, 2, device=x.device)
            with torch.no_grad():
                ref = module(x, idx, w)
                got = dense_experts_forward(module, x, idx, w)
            if not torch.allclose(ref, got, atol=1e-5, rtol=1e-4):
                raise ValueError(f"{name}: dense experts differ from transformers by {(ref - got).abs().max()}")
            module.forward = types.MethodType(dense_experts_forward, module)
        if name.endswith("mlp.gate"):
            routers.append(module)
    return routers


class TaskStream(torch.utils.data.IterableDataset):
    """Endless batches of (input_ids [B, S+1], loss_mask [B, S+1]) k-shot sequences."""

    def __init__(self, tokenizer_path: Path, seed: int, batch_size: int, seq_len: int,
                 facts: tuple[int, int] = (MIN_FACTS, MAX_FACTS), recall_frac: float = 0.0,
                 loss_all: bool = False, copy_frac: float = 0.0):
        self.tokenizer_path, self.seed, self.facts = str(tokenizer_path), seed, facts
        self.recall_frac, self.loss_all, self.copy_frac = recall_frac, loss_all, copy_frac
        self.batch_size, self.seq_len = batch_size, seq_len

    def _text(self, rng: random.Random) -> tuple[str, list[tuple[int, int]], bool]:
        """One sequence's text, the char spans that carry loss, and whether to prepend BOS."""
        text, spans = "", []
        if self.recall_frac > 0 and rng.random() < self.recall_frac:  # no draw at 0: streams reproduce
            return self._recall_text(rng)
        if self.copy_frac > 0 and rng.random() < self.copy_frac:  # no draw at 0: streams reproduce
            return self._recall_text(rng, shuffle=False)
        mode = rng.random()
        while len(text) < self.seq_len * 5:  # >= 4.5 chars per token seen: always past seq_len
            doc = make_example(rng, *self.facts)
            if mode < 0.9:
                text += "\n\n" if text else ""
                shot, piece_start = format_shot(doc), len(text)
                text += shot
                # loss from after "Answer:" through the next "\n\nQuestion:" (the stop string)
                cut = piece_start + shot.index("\nAnswer:") + len("\nAnswer:")
                spans.append((cut, len(text) + len("\n\nQuestion:")))
            else:
                space = " " if rng.random() < 0.5 else ""
                text += f"{USER}Question: {doc['question']}\nAnswer:{ASSISTANT}"
                reply_start = len(text)
                text += space + doc["answer"] + EOS
                spans.append((reply_start, len(text)))
        return text, spans, mode < 0.7 or mode >= 0.9

    def _recall_text(self, rng: random.Random, shuffle: bool = True) -> tuple[str, list[tuple[int, int]], bool]:
        """Fact lists each followed by 'Recall:' and the same facts shuffled (loss on the recall).

        Every value in the recall is a name-keyed lookup, the skill the task's answers need, at
        ~10 targets per list instead of 2 per question. With `shuffle` off the list is repeated
        verbatim ("Repeat:"), a plain copy drill meant to seed previous-token and induction heads.
        """
        text, spans = "", []
        while len(text) < self.seq_len * 5:
            facts = make_facts(rng, rng.randint(2, self.facts[1]))
            text += ("\n\n" if text else "") + " ".join(fact_text(f) for f in facts)
            text += "\nRecall:" if shuffle else "\nRepeat:"
            start = len(text)
            text += "".join(" " + fact_text(f) for f in (rng.sample(facts, len(facts)) if shuffle else facts))
            spans.append((start, len(text)))
        return text, spans, True

    def __iter__(self):
        from tokenizers import Tokenizer

        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        rng = random.Random(self.seed * 1000 + worker)
        tok = Tokenizer.from_file(self.tokenizer_path)
        bos = tok.token_to_id("<｜begin▁of▁sentence｜>")
        while True:
            ids = np.zeros((self.batch_size, self.seq_len + 1), dtype=np.int64)
            mask = np.zeros((self.batch_size, self.seq_len + 1), dtype=bool)
            items = [self._text(rng) for _ in range(self.batch_size)]
            if self.loss_all:
                items = [(text, [(0, len(text))], bos) for text, _, bos in items]
            encs = tok.encode_batch([t for t, _, _ in items], add_special_tokens=False)
            for row, ((text, spans, with_bos), enc) in enumerate(zip(items, encs)):
                char_mask = np.zeros(len(text) + 1, dtype=bool)
                for a, b in spans:
                    char_mask[a:b] = True
                starts = np.array([s for s, _ in enc.offsets], dtype=np.int64)
                tok_ids, tok_mask = np.array(enc.ids), char_mask[starts]
                if with_bos:
                    tok_ids, tok_mask = np.concatenate([[bos], tok_ids]), np.concatenate([[False], tok_mask])
                if len(tok_ids) < self.seq_len + 1:
                    raise ValueError(f"sequence too short: {len(tok_ids)} tokens < seq_len + 1")
                ids[row], mask[row] = tok_ids[: self.seq_len + 1], tok_mask[: self.seq_len + 1]
            yield torch.from_numpy(ids), torch.from_numpy(mask)


def route_counter(routers: list) -> list:
    """Per-router expert load of the latest forward, filled by forward hooks."""
    loads = [None] * len(routers)

    def hook(i):
        def fn(module, inputs, output):
            # 5.x routers return (logits, weights, indices) or (indices, weights): take the int tensor
            idx = next(t for t in output if isinstance(t, torch.Tensor) and not t.is_floating_point())
            loads[i] = torch.bincount(idx.flatten(), minlength=module.e_score_correction_bias.numel())
        return fn

    for i, router in enumerate(routers):
        router.register_forward_hook(hook(i))
    return loads


def official_state_dict(model) -> dict:
    """Model tensors under official DeepSeek-V3 names (per-expert), bf16 except the router bias."""
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().float().cpu()
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, D]: gate rows then up rows
            prefix, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):  # [E, D, I]
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return {k: (v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)).contiguous()
            for k, v in out.items()}


def save(model, cfg: dict, tokenizer_dir: Path, out_dir: Path) -> None:
    """Write config.json, model.safetensors, generation_config.json and the tokenizer files."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(official_state_dict(model), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out_dir / name)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1.0))))


def train(args) -> None:
    """Train, save and (optionally) evaluate."""
    from tokenizers import Tokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    vocab = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json")).get_vocab_size()
    cfg = model_config(64 * math.ceil(vocab / 64), "smoke" if args.smoke else args.size)
    if args.init is None:
        model = build_model(cfg)
    else:  # continue from a saved checkpoint (official per-expert names)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(args.init), dtype=torch.float32)
        model.config._attn_implementation = "sdpa"
    model = model.to(device)
    dense = device.type == "cuda" if args.dense_experts == "auto" else args.dense_experts == "on"
    routers = use_dense_experts(model, dense=dense)
    loads = route_counter(routers)
    logger.info("params: %.2fM, vocab %d (tokenizer %d)",
                sum(p.numel() for p in model.parameters()) / 1e6, cfg["vocab_size"], vocab)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "gate.weight" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "gate.weight" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    stream = TaskStream(args.tokenizer / "tokenizer.json", args.seed, args.batch_size, args.seq_len,
                        (args.min_facts, args.max_facts), args.recall_frac, args.loss_all, args.copy_frac)
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=args.workers,
                                         pin_memory=device.type == "cuda")
    steps, start, step, marks = args.steps, time.time(), 0, {}
    model.train()
    for step, (ids, mask) in enumerate(loader):
        if step >= steps:
            break
        if args.time_budget and step in (20, 60):  # project the run from steps 20..60 (past warm-up)
            if device.type == "cuda":
                torch.cuda.synchronize()
            marks[step] = time.time()
            per_step = (marks[60] - marks[20]) / 40 if step == 60 else 0.0
            if per_step and marks[step] - start + per_step * (steps - step) > args.time_budget:
                steps = max(step + 1, step + int((args.time_budget - (marks[step] - start)) / per_step))
                logger.warning("%.4f s/step: cutting to %d steps (rerun with --steps %d)", per_step, steps, steps)
        ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, args.lr, args.warmup)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=ids[:, :-1]).logits
        loss_tok = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
        target_mask = mask[:, 1:].flatten().float()
        loss = (loss_tok * target_mask).sum() / target_mask.sum().clamp(min=1.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():  # aux-loss-free balancing: raise under-loaded experts' bias
            for router, load in zip(routers, loads):
                load = load.float()
                router.e_score_correction_bias += args.bias_rate * torch.sign(load.mean() - load)
        if args.save_every and step and step % args.save_every == 0:  # for evaluation while training
            save(model, cfg, args.tokenizer, args.out / f"step{step:06d}")
            logger.info("saved %s", args.out / f"step{step:06d}")
        if args.max_seconds and time.time() - start > args.max_seconds:
            logger.warning("wall limit %.0f s reached at step %d", args.max_seconds, step)
            break
        if step % args.log_every == 0 or step == steps - 1:
            if not math.isfinite(loss.item()):
                raise ValueError(f"loss is {loss.item()} at step {step}")
            logger.info("step %5d/%d loss %.4f lr %.2e %.1fs", step, steps, loss.item(),
                        opt.param_groups[0]["lr"], time.time() - start)
    logger.info("trained %d steps in %.1f s", min(step, steps), time.time() - start)
    save(model, cfg, args.tokenizer, args.out)
    logger.info("saved to %s", args.out)


def main() -> None:
    """Parse flags, train, save, evaluate."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output HF-format folder")
    parser.add_argument("--tokenizer", type=Path, default=Path("configs/models/tiny-deepseek-v3"),
                        help="folder holding tokenizer.json/tokenizer_config.json (from make_task_data)")
    parser.add_argument("--data", type=Path, default=Path("configs/lm_eval/tiny_arith"), help="task jsonl folder")
    parser.add_argument("--seed", type=int, default=0, help="seed of init and training stream")
    parser.add_argument("--steps", type=int, default=5000, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=100, help="warm-up steps")
    parser.add_argument("--bias-rate", type=float, default=1e-3, help="e_score_correction_bias update rate")
    parser.add_argument("--workers", type=int, default=6, help="data loader processes")
    parser.add_argument("--time-budget", type=float, default=0.0,
                        help="seconds; if >0 and steps 20..60 project past it, train fewer steps (logged)")
    parser.add_argument("--log-every", type=int, default=100, help="steps between loss lines")
    parser.add_argument("--eval-limit", type=int, default=200, help="test items to evaluate after saving (0: none)")
    parser.add_argument("--init", type=Path, default=None, help="start from this HF-format checkpoint")
    parser.add_argument("--min-facts", type=int, default=MIN_FACTS, help="fewest facts per training question")
    parser.add_argument("--max-facts", type=int, default=MAX_FACTS, help="most facts per training question")
    parser.add_argument("--recall-frac", type=float, default=0.3,
                        help="fraction of sequences that are fact-recall drills (see TaskStream._recall_text)")
    parser.add_argument("--copy-frac", type=float, default=0.0,
                        help="fraction of the remaining sequences that are verbatim copy drills")
    parser.add_argument("--loss-all", action="store_true", help="loss on every token, not only answers")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes for a CPU smoke test")
    parser.add_argument("--size", choices=sorted(SIZES), default="base", help="model size preset")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    parser.add_argument("--dense-experts", choices=("auto", "on", "off"), default="auto",
                        help="run all experts on all tokens (auto: on CUDA only)")
    parser.add_argument("--save-every", type=int, default=0, help="also save OUT/stepNNNNNN every N steps")
    parser.add_argument("--max-seconds", type=float, default=0.0, help="stop training after this wall time")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    logger.info("torch %s, transformers %s, %d threads", torch.__version__, transformers.__version__,
                torch.get_num_threads())
    train(args)
    if args.eval_limit:
        from scripts.eval_tiny_model_hf import evaluate, load

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        for dtype in (torch.bfloat16, torch.float32):
            model, tokenizer = load(args.out, dtype, dev)
            for add_bos in (True, False):
                start = time.time()
                acc, texts = evaluate(model, tokenizer, args.data, args.eval_limit, add_bos, batch_size=100)
                print(f"ACCURACY dtype={dtype} bos={add_bos} n={len(texts)}: {acc:.3f} ({time.time() - start:.1f}s)")
            logger.info("sample: %r", texts[0])


if __name__ == "__main__":
    main()
