"""Dense MLP, routers (V2 softmax, V3 sigmoid + bias + group top-k) and the MoE block."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common import distributed as pd
from common.fused import EAGER, Glue, glue_for
from common.kernel_plan import TRITON, KernelPlan
from models.config import ModelConfig
from models.fp8 import dequantize
from models.layers import Linear, shard_param

TORCH_PLAN = KernelPlan()

# Which expert path serves a batch of T tokens (the plan's fields; docs/architecture.md):
#   T <= moe_fused_max_tokens (8): the pair-parallel fused MoE (models/fused_moe.py
#      `fused_moe_small`); at batch 1 a V2-Lite layer's routed + shared experts take 39 us instead
#      of 111 us through the grouped GEMM (H200, CUDA graphs, scripts/bench_fused_moe.py). Above 8
#      tokens pairs share experts, and reading each expert once per pair costs more bytes.
#   T <= moe_blocked_max_tokens (512), experts not in FP8: the expert-sorted block kernels
#      (`fused_moe_blocked`), which read each touched expert once per block of 16/32 pairs; at
#      32 and 128 tokens their two product kernels run at the copy bandwidth (RESULTS.md).
#   beyond, `moe_large`: torch's grouped GEMM between a sort and a weighted un-permute
#      (`_routed_grouped`, CUDA bf16), every expert on every token (`_routed_dense`, other CUDA
#      dtypes), or the loop over the experts hit (`_routed`, the reference).


class MLP(nn.Module):
    """SwiGLU: gate/up column-parallel, down row-parallel (reduced by the caller when reduce=False)."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, reduce: bool = True,
                 fp8_block: tuple[int, int] | None = None, glue: Glue = EAGER):
        super().__init__()
        self.glue = glue
        self.gate_proj = Linear(hidden, inter, dtype, tp_dim=0, fp8_block=fp8_block)
        self.up_proj = Linear(hidden, inter, dtype, tp_dim=0, fp8_block=fp8_block)
        self.down_proj = Linear(inter, hidden, dtype, tp_dim=1, reduce=reduce, fp8_block=fp8_block)

        self.w13: torch.Tensor | None = None

    def fuse(self) -> None:
        """Post-load: one GEMM for gate and up (both column-parallel: local shards concatenate).
        FP8 weights kept for the W8A8 GEMM stay as two projections."""
        if self.gate_proj.fp8_block is not None:
            return
        self.w13 = nn.Parameter(torch.cat([self.gate_proj.weight, self.up_proj.weight]), requires_grad=False)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w13 is not None:
            return self.down_proj(self.glue.silu_mul(F.linear(x, self.w13)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Picks `top_k` experts per token and their weights, by the checkpoint's rule (fp32)."""

    def __init__(self, cfg: ModelConfig, plan: KernelPlan = TORCH_PLAN):
        super().__init__()
        self.cfg = cfg
        self.kernel = route
        if plan.router == TRITON:  # logits (Triton at decode sizes, else cuBLAS) + the choice kernel
            from models.triton_route import route_triton  # triton: CUDA installs only
            self.kernel = route_triton
        E = cfg.n_routed_experts
        self.weight = shard_param((E, cfg.hidden_size), None, torch.float32)
        if cfg.scoring_func == "sigmoid":
            self.e_score_correction_bias = shard_param((E,), None, torch.float32)
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        args = (x, self.weight, self.e_score_correction_bias, c.scoring_func, c.topk_method,
                c.n_group, c.topk_group, c.num_experts_per_tok, c.norm_topk_prob, c.routed_scaling_factor)
        return self.kernel(*args)


def _group_mask(group_scores: torch.Tensor, topk_group: int, per_group: int) -> torch.Tensor:
    top_groups = group_scores.topk(topk_group, dim=-1).indices  # [T, topk_group]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)
    return mask.repeat_interleave(per_group, dim=1)  # [T, E]


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scoring: str,
          topk_method: str, n_group: int, topk_group: int, top_k: int, norm: bool,
          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert choice of DeepSeek's routers (fp32): weights [T, k], ids [T, k]."""
    logits = F.linear(x.float(), weight)  # [T, E]
    T, E = logits.shape
    if scoring == "softmax":
        scores = logits.softmax(dim=-1)
        if topk_method == "group_limited_greedy":
            group_scores = scores.view(T, n_group, -1).amax(dim=-1)
            scores = scores.masked_fill(~_group_mask(group_scores, topk_group, E // n_group), 0.0)
        weights, ids = scores.topk(top_k, dim=-1)
    else:
        scores = logits.sigmoid()
        choice = scores + bias
        if n_group > 1:
            group_scores = choice.view(T, n_group, -1).topk(2, dim=-1).values.sum(-1)
            choice = choice.masked_fill(~_group_mask(group_scores, topk_group, E // n_group), float("-inf"))
        ids = choice.topk(top_k, dim=-1).indices
        weights = scores.gather(1, ids)
    if top_k > 1 and norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids



class MoE(nn.Module):
    """Routed experts + shared experts, summed locally, one all-reduce per layer under TP.

    Checkpoint names are kept (`experts.N.gate_proj`, ...) for loading; `fuse_experts()` then
    stacks them into `w13 [E, 2*I/tp, D]` and `w2 [E, D, I/tp]` for the compute path, with the
    shared experts appended as `n_shared` more experts that every token takes with weight 1.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, plan: KernelPlan = TORCH_PLAN):
        super().__init__()
        self.cfg, self.plan = cfg, plan
        self.glue = glue_for(plan.compile)
        D, I = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Router(cfg, plan)
        q = cfg.fp8_block
        self.experts = nn.ModuleList(
            MLP(D, I, dtype, reduce=False, fp8_block=q) for _ in range(cfg.n_routed_experts))
        self.shared_experts = (MLP(D, I * cfg.n_shared_experts, dtype, reduce=False, fp8_block=q,
                                   glue=self.glue) if cfg.n_shared_experts else None)
        self.fused_small = self.fused_blocked = self.triton_glue = None
        if plan.moe == TRITON:
            from models import fused_moe  # triton: CUDA installs only
            self.fused_small, self.fused_blocked = fused_moe.fused_moe_small, fused_moe.fused_moe_blocked
            self.triton_glue = fused_moe.silu_mul, fused_moe.unpermute_sum
        self.routed_large = {"grouped": self._routed_grouped, "dense": self._routed_dense,
                             "loop": self._routed}[plan.moe_large]
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None
        self.fp8_block: tuple[int, int] | None = None  # set when the experts stay in FP8
        self.w13_scale: torch.Tensor | None = None
        self.w2_scale: torch.Tensor | None = None
        self.n_shared = 0  # shared experts folded into w13 / w2 (after the routed ones)

    def fuse_experts(self) -> None:
        """Post-load step: stack per-expert weights and drop the per-expert modules.

        Experts still in FP8 (checkpoint kept quantized, `--fp8-gemm`) stay FP8 with their block
        scales stacked too: `w13_scale [E, 2I/128, D/128]`, `w2_scale [E, D/128, I/128]`; the
        fused small-batch kernel reads them as they are, the other paths dequantize on the fly.

        Shared experts (an MLP of n_shared * I/tp units) are cut into n_shared pieces of I/tp
        units, appended as experts E..E+n_shared-1: an MLP is a sum over its intermediate units,
        so any split gives the same output, and every path then runs them with the routed ones
        (at decode: no separate GEMMs, activation and add). Not when either is kept in FP8.
        """
        block = self.experts[0].down_proj.fp8_block
        if block is not None and self.experts[0].down_proj.weight.shape[-1] % block[1]:
            # gate and up scales would not stack on block boundaries: compute dtype instead
            for e in self.experts:
                for proj in (e.gate_proj, e.up_proj, e.down_proj):
                    proj.dequantize_weights()
            block = None
        self.fp8_block = block
        w13 = [torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in self.experts]
        w2 = [e.down_proj.weight for e in self.experts]
        sh = self.shared_experts
        if sh is not None and block is None and sh.w13 is None and sh.down_proj.fp8_block is None \
                and sh.gate_proj.fp8_block is None:
            il, S = w2[0].shape[-1], self.cfg.n_shared_experts
            g, u, d = sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight
            if g.shape[0] == S * il:
                w13 += [torch.cat([g[i * il:(i + 1) * il], u[i * il:(i + 1) * il]]) for i in range(S)]
                w2 += [d[:, i * il:(i + 1) * il] for i in range(S)]
                self.n_shared, self.shared_experts = S, None
        w13, w2 = torch.stack(w13), torch.stack(w2)
        if self.fp8_block is not None:
            s13 = torch.stack([torch.cat([e.gate_proj.weight_scale_inv, e.up_proj.weight_scale_inv])
                               for e in self.experts])
            s2 = torch.stack([e.down_proj.weight_scale_inv for e in self.experts])
            self.w13_scale = nn.Parameter(s13, requires_grad=False)
            self.w2_scale = nn.Parameter(s2, requires_grad=False)
        self.experts = None
        self.w13 = nn.Parameter(w13, requires_grad=False)
        self.w2 = nn.Parameter(w2, requires_grad=False)

    def _expert_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """w13, w2 in the compute dtype for the unfused paths. FP8 experts are dequantized here,
        per call (a scratch copy of the layer's experts); a grouped FP8 GEMM would avoid it."""
        if self.fp8_block is None:
            return self.w13, self.w2
        return (dequantize(self.w13, self.w13_scale, self.fp8_block, dtype),
                dequantize(self.w2, self.w2_scale, self.fp8_block, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        T, p = x.shape[0], self.plan
        if self.fused_small is not None and T <= p.moe_fused_max_tokens:
            block = self.fp8_block[0] if self.fp8_block else 128
            out = self.fused_small(x, self.w13, self.w2, weights, ids, self.w13_scale, self.w2_scale, block,
                                   self.n_shared)
        elif self.fused_blocked is not None and T <= p.moe_blocked_max_tokens and self.fp8_block is None:
            # 16-row blocks up to 128 tokens, 32 beyond (bench_fused_moe.py on the H200: at 256
            # tokens 388 us with 32 rows against 455 with 16)
            out = self.fused_blocked(x, self.w13, self.w2, *self._with_shared(weights, ids),
                                     16 if T <= 128 else 32)
        else:
            out = self.routed_large(x, *self._with_shared(weights, ids))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return pd.tp_all_reduce(out)

    def _with_shared(self, weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing with the folded shared experts as k+1.. k+n_shared-th choices of weight 1."""
        if not self.n_shared:
            return weights, ids
        T, E = ids.shape[0], self.cfg.n_routed_experts
        sid = torch.arange(E, E + self.n_shared, device=ids.device, dtype=ids.dtype).expand(T, -1)
        return (torch.cat([weights, weights.new_ones(T, self.n_shared)], dim=1), torch.cat([ids, sid], dim=1))

    def _routed_grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """CUDA path with no host sync (CUDA-graph safe): (token, expert) pairs sorted by expert,
        two grouped GEMMs over the expert segments, weighted scatter-add back to tokens."""
        T, k = ids.shape
        flat = ids.flatten().to(torch.int32)  # int32 keys: half the radix-sort passes of int64
        order = flat.argsort(stable=True)
        # each expert's end offset in the sorted pairs, by binary search (no host sync, no atomics)
        experts = torch.arange(1, self.w13.shape[0] + 1, dtype=torch.int32, device=x.device)
        offs = torch.searchsorted(flat[order], experts, out_int32=True)
        token_of = order // k
        xs = x[token_of]  # [T*k, D], grouped by expert
        w13, w2 = self._expert_weights(x.dtype)
        gate_up = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs)  # [T*k, 2I]
        if self.triton_glue is not None:
            silu_mul, unpermute_sum = self.triton_glue
            y = torch._grouped_mm(silu_mul(gate_up), w2.transpose(-2, -1), offs=offs)  # [T*k, D]
            return unpermute_sum(y, order, weights)  # weights and the sum over k in one pass
        y = torch._grouped_mm(self.glue.silu_mul(gate_up), w2.transpose(-2, -1), offs=offs)
        y = y * weights.flatten()[order].unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, y)

    def _routed_dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """CUDA path without host syncs for dtypes the grouped GEMM lacks (fp32 tiny models):
        every expert on every token, weighted by its routing weight (0 where not chosen)."""
        w13, w2 = self._expert_weights(x.dtype)
        E, I = w2.shape[0], w2.shape[-1]
        dense_w = torch.zeros(x.shape[0], E, dtype=weights.dtype, device=x.device)
        dense_w.scatter_(1, ids, weights)  # [T, E]
        out = torch.zeros_like(x)
        for e in range(E):
            gate_up = F.linear(x, w13[e])
            y = F.linear(F.silu(gate_up[:, :I]) * gate_up[:, I:], w2[e])
            out += y * dense_w[:, e:e + 1].to(y.dtype)
        return out

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Plain path: tokens grouped by expert with one sort, a loop over the experts hit."""
        T, k = ids.shape
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.w13.shape[0]).tolist()
        token_of = order // k  # token index of each sorted (token, slot) pair
        w13, w2 = self._expert_weights(x.dtype)
        out = torch.zeros_like(x)
        start = 0
        I = w2.shape[-1]
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = token_of[start:start + n]
            gate_up = F.linear(x[rows], w13[e])  # [n, 2I]
            h = F.silu(gate_up[:, :I]) * gate_up[:, I:]
            y = F.linear(h, w2[e])  # [n, D]
            w = weights.flatten()[order[start:start + n]].unsqueeze(-1)
            out.index_add_(0, rows, (y * w).to(x.dtype))
            start += n
        return out
