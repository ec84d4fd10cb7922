"""DeepSeek-V3 / R1 multi-token-prediction (MTP) layer, the drafter of `{"method": "mtp"}`.

A V3 checkpoint with `num_nextn_predict_layers = n` stores n MTP layers after the decoder, as
`model.layers.{L + i}.*` with L = num_hidden_layers (DeepSeek-V3 report, §2.2): `enorm` and `hnorm`
(RMSNorms), `eh_proj` `[D, 2D]`, one decoder block (`self_attn`, `mlp`, `input_layernorm`,
`post_attention_layernorm`, as in layer L), `shared_head.norm` and `shared_head.head` (the output
head), and `embed_tokens`. The report shares the embedding and the output head with the main
model; checkpoints may also store copies: a copy present is loaded, a missing one is shared
(`share_missing`).

At position i, with h_i the main model's final hidden state (after its norm, the input of the
LM head) and t_{i+1} the token after position i:
    x = eh_proj([enorm(embed(t_{i+1})) ‖ hnorm(h_i)])
    g = block(x)                        (attention over the MTP layer's own KV cache)
    logits of t_{i+2} = head(shared_head.norm(g))
A second draft reuses the layer with g in place of h (and the first draft as the token).
"""

from __future__ import annotations

import torch
from torch import nn

from attention.backend import AttentionOps
from attention.metadata import MLAMetadata
from common.kernel_plan import KernelPlan
from models.config import ModelConfig
from models.layers import Linear, ParallelLMHead, RMSNorm, VocabParallelEmbedding


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype)


class DeepseekMTPLayer(nn.Module):
    """One MTP layer; its decoder block is built as decoder layer `layer_idx` (MoE or dense)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype, plan: KernelPlan, ops: AttentionOps,
                 keep_fp8: bool = False):
        super().__init__()
        from models.deepseek import DeepseekDecoderLayer
        D = cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, D, dtype)
        self.enorm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.eh_proj = Linear(2 * D, D, dtype, fp8_block=cfg.fp8_block)
        self.block = DeepseekDecoderLayer(cfg, layer_idx, dtype, plan, ops, keep_fp8)
        self.shared_head = SharedHead(cfg, dtype)

    # checkpoint names of the block's parameters sit at the layer's top level
    @staticmethod
    def checkpoint_to_param(name: str) -> str:
        """`self_attn.x` -> `block.self_attn.x` (names under model.layers.{L+i}.)."""
        for part in ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm."):
            if name.startswith(part):
                return "block." + name
        return name

    def share_missing(self, embed: VocabParallelEmbedding, lm_head: ParallelLMHead, missing: set[str]) -> None:
        """Use the main model's embedding / head where the checkpoint has no copy."""
        if "embed_tokens.weight" in missing:
            self.embed_tokens = embed
        if "shared_head.head.weight" in missing:
            self.shared_head.head = lm_head

    def forward(self, input_ids: torch.Tensor, positions_cos_sin: torch.Tensor, hidden: torch.Tensor,
                kv_cache: torch.Tensor, meta: MLAMetadata) -> torch.Tensor:
        """input_ids [T] (the token after each position), hidden [T, D] (h_i, or the previous
        draft's output) -> the layer's output [T, D], before shared_head.norm."""
        x = self.eh_proj(torch.cat([self.enorm(self.embed_tokens(input_ids)), self.hnorm(hidden)], dim=-1))
        out, residual = self.block(x, None, positions_cos_sin, kv_cache, meta)
        return out + residual

    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(out)).float()  # [N, vocab] fp32
