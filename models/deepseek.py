"""DeepSeek-V2 / V2-Lite / V3 / R1 decoder, module names equal to the checkpoint's.

The model never mentions process groups beyond its layers' sharding rules; the attention core
and the per-step metadata live in `attention/`. Notation as in attention/mla.py.
"""

from __future__ import annotations

import torch
from torch import nn

from attention.backend import AttentionOps
from attention.metadata import MLAMetadata
from attention.mla import MLAAttention, make_attention_ops
from common import distributed as pd
from common.fused import PairRows, glue_for
from common.kernel_plan import KernelPlan
from models.config import ModelConfig
from models.layers import Linear, PackedLinear, ParallelLMHead, RMSNorm, VocabParallelEmbedding, YarnRotaryEmbedding
from models.data_parallel_moe import gathered_moe, idle_pass
from models.moe import MLP, MoE, SideNorm


class DeepseekAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, plan: KernelPlan, ops: AttentionOps,
                 keep_fp8: bool = False):
        super().__init__()
        tp = pd.tp().size
        if cfg.num_attention_heads % tp:
            raise ValueError(f"num_attention_heads {cfg.num_attention_heads} is not divisible by "
                             f"tensor parallel size {tp}")
        self.Hl = cfg.num_attention_heads // tp
        self.P, self.R, self.Lkv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        D, H, qk, q8 = cfg.hidden_size, cfg.num_attention_heads, cfg.qk_head_dim, cfg.fp8_block
        # The projections that read x (q_proj or q_a_proj, and kv_a_proj_with_mqa) as one GEMM: at
        # decode each is a latency-bound GEMV, so one launch instead of two. Under TP q_proj holds
        # this rank's heads and kv_a is replicated: the local rows still stack.
        q_part = ("q_proj", H * qk, 0) if cfg.q_lora_rank is None else ("q_a_proj", cfg.q_lora_rank, None)
        q_rows = q_part[1] // tp if q_part[2] == 0 else q_part[1]
        self.qkv_a_proj = PackedLinear(D, [q_part, ("kv_a_proj_with_mqa", cfg.kv_cache_dim, None)], dtype,
                                       fp8_block=cfg.packed_fp8_block([q_rows, cfg.kv_cache_dim]),
                                       keep_fp8=keep_fp8)
        self.q_lora = cfg.q_lora_rank is not None  # V2, V3: q_a_proj's output is a latent, up-projected
        if self.q_lora:
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype, glue_for(plan))
            self.q_b_proj = Linear(cfg.q_lora_rank, H * qk, dtype, tp_dim=0, fp8_block=q8)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, dtype)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), dtype,
                                tp_dim=0, fp8_block=q8)
        self.o_proj = Linear(H * cfg.v_head_dim, D, dtype, tp_dim=1, fp8_block=q8)
        self.mla = MLAAttention(self.Hl, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                                cfg.kv_lora_rank, cfg.softmax_scale, plan, ops)

    def process_weights_after_loading(self) -> None:
        self.mla.set_kv_b_weight(self.kv_b_proj.weight)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The projections that read the normed hidden rows: q `[T, Hl, P+R]`, kv `[T, Lkv+R]`
        (shapes fixed by T: part of a piecewise CUDA graph)."""
        q, kv = self.qkv_a_proj(x).split(self.qkv_a_proj.sizes, dim=-1)
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(q))
        return q.reshape(-1, self.Hl, self.P + self.R), kv

    def attend(self, q: torch.Tensor, kv: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
               meta: MLAMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """The attention core `[T, Hl, V]`, into `out` when given: the new rows into the cache,
        then MLA over the step's metadata (always eager: its work depends on the metadata)."""
        q_nope, q_pe = q.split([self.P, self.R], dim=-1)
        n = self.kv_a_layernorm
        if self.mla.fuses_decode(meta, q.shape[0]):  # pure decode, decode_fuse_q_kv: one launch for both
            return self.mla.decode_fused(q_nope, q_pe, kv, n.weight, n.eps, cos_sin, kv_cache, meta, out=out)
        kv_row = self.mla.finish_kv(kv, n.weight, n.eps, cos_sin, kv_cache, meta)  # in the cache now
        return self.mla.forward(q_nope, q_pe, kv_row, kv_cache, meta, cos_sin, out=out)  # rotates q_pe

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: MLAMetadata) -> torch.Tensor:
        q, kv = self.project(x)
        return self.o_proj(self.attend(q, kv, cos_sin, kv_cache, meta).flatten(1))


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype, plan: KernelPlan,
                 ops: AttentionOps, keep_fp8: bool = False):
        super().__init__()
        self.glue = glue_for(plan)
        self.self_attn = DeepseekAttention(cfg, dtype, plan, ops, keep_fp8)
        if cfg.is_moe_layer(layer_idx):
            with pd.moe_scope():  # split over every rank under data parallelism
                self.mlp = MoE(cfg, dtype, plan, keep_fp8)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, glue=self.glue, keep_fp8=keep_fp8,
                           fp8_block=cfg.packed_fp8_block([cfg.intermediate_size // pd.tp().size] * 2))
        # data parallelism: the MoE runs on every DP rank's tokens (models/data_parallel_moe.py)
        self.dp_moe = isinstance(self.mlp, MoE) and pd.dp().size > 1
        if self.dp_moe:
            self.mlp.reduce_out = False  # summed into each rank's own rows by gathered_moe
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, self.glue)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # the MoE's pair rows summed by the next layer's add + RMSNorm (or the final norm)
        self.defer_sum = plan.moe_sum_in_norm and isinstance(self.mlp, MoE)
        # moe_norm_in_router_max_tokens: the post-attention add + norm inside the router's logits
        # kernel (the router says in which steps)
        self.norm_in_router = bool(plan.moe_norm_in_router_max_tokens) and isinstance(self.mlp, MoE)

    def pre_attention(self, x: torch.Tensor, residual: torch.Tensor | None):
        """(residual, q, kv): the residual stream's add and the input norm (x alone, the embedding,
        on the first layer: residual None), then the attention's projections."""
        n = self.input_layernorm
        if residual is None:
            residual, h = x, n(x)
        else:
            residual, h = self.glue.add_rms_norm(residual, x, n.weight, n.eps)
        return (residual, *self.self_attn.project(h))

    def post_attention(self, o: torch.Tensor, residual: torch.Tensor,
                       defer_sum: bool = False) -> tuple[torch.Tensor | PairRows, torch.Tensor]:
        """(mlp output, residual) from the attention core's output o `[T, Hl, V]`: o_proj, the
        add + post-attention norm, the MLP or MoE. The residual stream's add is left to the next
        layer's input norm (one fused add + RMSNorm instead of an add and a norm). With
        `defer_sum` (a caller whose next op is the glue's add + RMSNorm) and the plan's
        moe_sum_in_norm, an MoE's output may come as its unsummed pair rows (`PairRows`),
        which that Triton kernel sums. With moe_norm_in_router_max_tokens, in the steps the
        router's logits kernel takes up to that bound, the add + norm run inside it
        (`Router.add_norm_logits`), and where the shared experts run on the side stream, in a
        norm kernel of that stream too (`SideNorm`)."""
        h = self.self_attn.o_proj(o.flatten(1))
        n = self.post_attention_layernorm
        if self.dp_moe:
            residual, h = self.glue.add_rms_norm(residual, h, n.weight, n.eps)
            return gathered_moe(self.mlp, h), residual
        kw = {}
        if defer_sum and self.defer_sum:
            kw["defer_sum"] = True
        if self.norm_in_router and self.mlp.gate.fuses_norm(h):
            if self.mlp.takes_side_norm(h):  # launched inside the MoE, after its side stream forks
                side = SideNorm(self.mlp.gate, residual, h, n.weight, n.eps)
                return self.mlp(side.x, logits=side.logits, side_norm=side, **kw), side.s
            residual, h, kw["logits"] = self.mlp.gate.add_norm_logits(residual, h, n.weight, n.eps)
        else:
            residual, h = self.glue.add_rms_norm(residual, h, n.weight, n.eps)
        return self.mlp(h, **kw), residual

    def forward(self, x, residual, cos_sin, kv_cache, meta):
        """(x, residual) -> (mlp output, residual); residual None on the first layer, where x is the
        embedding."""
        residual, q, kv = self.pre_attention(x, residual)
        o = self.self_attn.attend(q, kv, cos_sin, kv_cache, meta)
        return self.post_attention(o, residual)


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, plan: KernelPlan, ops: AttentionOps,
                 keep_fp8: bool = False):
        super().__init__()
        self.glue = glue_for(plan)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, i, dtype, plan, ops, keep_fp8)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, self.glue)
        self.rotary_emb = YarnRotaryEmbedding(cfg.qk_rope_head_dim, cfg.max_position_embeddings, cfg.rope)

    # A step is pieces between the layers' attention cores (`first`, `after`), whose shapes depend
    # only on the token count (engine/piecewise_graph.py captures them as CUDA graphs), and the
    # cores themselves (`DeepseekAttention.attend`), whose work depends on the step's metadata.

    def first(self, input_ids: torch.Tensor):
        """Piece 0: the embedding, then layer 0's input norm and projections: (residual, q, kv)."""
        return self.layers[0].pre_attention(self.embed_tokens(input_ids), None)

    def after(self, i: int, o: torch.Tensor, residual: torch.Tensor):
        """Piece i + 1: layer i's work after its attention core (o_proj, norm, MLP), then layer
        i + 1's before it: (residual, q, kv); after the last layer the final norm's hidden rows."""
        x, residual = self.layers[i].post_attention(o, residual, defer_sum=True)  # both ends add + RMSNorm
        if i + 1 == len(self.layers):
            return self.glue.add_rms_norm(residual, x, self.norm.weight, self.norm.eps)[1]
        return self.layers[i + 1].pre_attention(x, residual)

    def forward(self, input_ids, positions, kv_caches, meta):
        if not self.layers:
            return self.norm(self.embed_tokens(input_ids))
        cos_sin = self.rotary_emb.at(positions)  # one gather per step, shared by the layers
        out = self.first(input_ids)
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            residual, q, kv = out
            out = self.after(i, layer.self_attn.attend(q, kv, cos_sin, cache, meta), residual)
        return out


def finish_linears(module: nn.Module, plan: KernelPlan, keep_fp8: bool) -> None:
    """The plan's GEMM choices on every `Linear` of `module`; FP8 weights dequantized unless kept
    (`kv_b_proj` always: it feeds W_UK / W_UV)."""
    for name, m in module.named_modules():
        if isinstance(m, Linear):
            m.fp8_gemm, m.fp8_splitk = plan.fp8_gemm, plan.fp8_gemm_splitk
            m.fp8_fuse_act, m.fp8_serial = plan.fp8_gemm_fuse_act, plan.fp8_gemm_splitk_serial
            m.fp8_w8a16_max = plan.fp8_gemm_w8a16_max_tokens if m.fp8_block == (128, 128) else 0
            m.skinny_max = plan.gemm_skinny_max_tokens
            if not keep_fp8 or name.endswith("kv_b_proj"):
                m.dequantize_weights()


class DeepseekForCausalLM(nn.Module):
    """Token ids + positions + per-layer caches + step metadata -> hidden states; logits on demand.
    Every op runs as the kernel plan says (common/kernel_plan.py; default: pure torch).

    FP8 checkpoints: the projections are dequantized to the compute dtype after loading, except,
    with `keep_fp8` (--fp8-gemm), the attention and dense/shared MLP projections that the W8A8
    GEMM reads as they are and the routed experts, stacked in FP8 for the fused MoE (kv_b_proj
    feeds W_UK / W_UV, so it is always dequantized)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, plan: KernelPlan = KernelPlan(),
                 keep_fp8: bool = False, num_mtp_layers: int = 0):
        super().__init__()
        self.config, self.plan, self.dtype = cfg, plan, dtype
        self.keep_fp8 = keep_fp8 and cfg.fp8_block is not None
        self.ops = make_attention_ops(plan)
        self.model = DeepseekModel(cfg, dtype, plan, self.ops, self.keep_fp8)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype)
        if num_mtp_layers > cfg.num_nextn_predict_layers:
            raise ValueError(f"--speculative-config method mtp: the checkpoint has "
                             f"num_nextn_predict_layers = {cfg.num_nextn_predict_layers}, no MTP layer "
                             f"to draft with; use method ngram")
        from models.mtp import DeepseekMTPLayer
        # the drafter's layers, checkpoint layers num_hidden_layers + i (models/mtp.py)
        self.mtp = nn.ModuleList(DeepseekMTPLayer(cfg, cfg.num_hidden_layers + i, dtype, plan, self.ops, self.keep_fp8)
                                 for i in range(num_mtp_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: MLAMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)  # [T, hidden]

    @torch.inference_mode()
    def dp_idle_step(self, mtp_passes: int = 0, main: bool = True) -> None:
        """Under data parallelism, this DP rank's part in a step it has no tokens for: the MoE
        layers' collectives (models/data_parallel_moe.py `idle_pass`) of the model (`main`), then
        of `mtp_passes` passes of the MTP layer (the drafter's, engine/mtp_drafter.py)."""
        layers = (list(self.model.layers) if main else []) + [m.block for m in self.mtp[:1]] * mtp_passes
        idle_pass(layers, self.config.hidden_size, self.dtype, self.model.embed_tokens.weight.device)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """Logits `[N, vocab]`: fp32, or with fp32=False in the LM head's dtype (the sampler
        converts only where its processing needs it)."""
        logits = self.lm_head(hidden)
        return logits.float() if fp32 else logits

    def process_weights_after_loading(self) -> None:
        """Derived weights, made once after loading: FP8 weights dequantized unless kept, the
        absorbed MLA matrices, the tied LM head."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        finish_linears(self, self.plan, self.keep_fp8)
        for layer in [*self.model.layers, *(m.block for m in self.mtp)]:
            layer.self_attn.process_weights_after_loading()
            if isinstance(layer.mlp, MoE):
                layer.mlp.gate.keep_bf16_weight()
                layer.mlp.process_weights_after_loading()
