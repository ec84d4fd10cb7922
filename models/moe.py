"""Dense MLP, routers (V2 softmax, V3 sigmoid + bias + group top-k) and the MoE block."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from engine import distributed as pd
from models.config import ModelConfig
from models.fp8 import dequantize
from models.fused import CudaCompiled, silu_mul_op, triton_fast_path, try_kernel
from models.layers import Linear, shard_param


# Which expert kernels serve a batch on CUDA (and under the Triton interpreter), by token count:
#   <= _FUSED_MAX_TOKENS (4; 8 for FP8 experts, which the block kernels do not take): the
#      pair-parallel fused MoE (models/fused_moe.py `fused_moe_small`); at batch 1 a V2-Lite
#      layer's routed + shared experts take 39 us instead of 111 us through the grouped GEMM (H200,
#      CUDA graphs, scripts/bench_fused_moe.py). It reads an expert once per (token, expert)
#      pair, so once pairs share experts the block kernels win: a V2-Lite decode step took 3.01 /
#      4.13 / 6.07 ms of GPU time at batch 2 / 4 / 8 with it and 3.32 / 4.18 / 5.57 ms with them.
#   <= BLOCKED_MAX_TOKENS (512), experts not in FP8: the expert-sorted block kernels
#      (`fused_moe_blocked`), which read each touched expert once per block of 16/32 pairs; at
#      32 and 128 tokens their two product kernels run at the copy bandwidth (RESULTS.md).
#   beyond: torch's grouped GEMM between a sort and a weighted un-permute (`_routed_grouped`).
# DSV_FUSED_MOE_MAX_TOKENS overrides the first bound (0 turns the fused path off);
# DSV_MOE_BLOCKED=0 turns the block kernels off.
_FUSED_MAX_TOKENS = int(os.environ.get("DSV_FUSED_MOE_MAX_TOKENS", "4"))
_FUSED_MAX_TOKENS_FP8 = max(_FUSED_MAX_TOKENS, 8)
_BLOCKED = os.environ.get("DSV_MOE_BLOCKED", "1") == "1"


def _use_grouped_mm(x: torch.Tensor) -> bool:
    # torch's grouped GEMM runs on CUDA (sm90+) in bf16; elsewhere the plain path is used.
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


class MLP(nn.Module):
    """SwiGLU: gate/up column-parallel, down row-parallel (reduced by the caller when reduce=False)."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, reduce: bool = True,
                 fp8_block: tuple[int, int] | None = None):
        super().__init__()
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
            return self.down_proj(silu_mul_op(F.linear(x, self.w13)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Picks `top_k` experts per token and their weights, by the checkpoint's rule (fp32)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        E = cfg.n_routed_experts
        self.weight = shard_param((E, cfg.hidden_size), None, torch.float32)
        if cfg.scoring_func == "sigmoid":
            self.e_score_correction_bias = shard_param((E,), None, torch.float32)
        else:
            self.e_score_correction_bias = None
        self.weight_bf16: torch.Tensor | None = None

    def keep_bf16_weight(self) -> None:
        """Post-load: a bf16 copy of the weight when it holds it exactly (checkpoints store the
        router in bf16). bf16 x bf16 products are exact in fp32, so a tensor-core GEMM with fp32
        accumulation and output computes the same sums as the fp32 GEMM (in another order) from
        half the weight bytes and without an fp32 copy of x."""
        w = self.weight.detach()
        lp = w.to(torch.bfloat16)
        self.weight_bf16 = lp if torch.equal(lp.float(), w) else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        args = (x, self.weight, self.e_score_correction_bias, c.scoring_func, c.topk_method,
                c.n_group, c.topk_group, c.num_experts_per_tok, c.norm_topk_prob, c.routed_scaling_factor)
        if triton_fast_path(x):  # logits (Triton at decode sizes, else cuBLAS) + the choice kernel
            from models.triton_route import route_triton  # triton: CUDA installs only
            out = try_kernel("route", route_triton, *args, self.weight_bf16)
            if out is not None:
                return out
            return route_op(*args)
        return route(*args)


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


route_op = CudaCompiled(route)  # the CUDA fallback if the Triton router cannot run


class MoE(nn.Module):
    """Routed experts + shared experts, summed locally, one all-reduce per layer under TP.

    Checkpoint names are kept (`experts.N.gate_proj`, ...) for loading; `fuse_experts()` then
    stacks them into `w13 [E, 2*I/tp, D]` and `w2 [E, D, I/tp]` for the compute path, with the
    shared experts appended as `n_shared` more experts that every token takes with weight 1.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        D, I = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Router(cfg)
        q = cfg.fp8_block
        self.experts = nn.ModuleList(
            MLP(D, I, dtype, reduce=False, fp8_block=q) for _ in range(cfg.n_routed_experts))
        self.shared_experts = (MLP(D, I * cfg.n_shared_experts, dtype, reduce=False, fp8_block=q)
                               if cfg.n_shared_experts else None)
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
        out = None
        fused_max = _FUSED_MAX_TOKENS_FP8 if self.fp8_block is not None and _FUSED_MAX_TOKENS else _FUSED_MAX_TOKENS
        if triton_fast_path(x) and x.shape[0] <= fused_max:
            from models.fused_moe import fused_moe_small  # triton: CUDA installs only
            block = self.fp8_block[0] if self.fp8_block else 128
            out = try_kernel("fused_moe", fused_moe_small, x, self.w13, self.w2, weights, ids, self.w13_scale,
                             self.w2_scale, block, self.n_shared)
        elif _BLOCKED and triton_fast_path(x) and self.fp8_block is None:
            from models.fused_moe import BLOCKED_MAX_TOKENS, fused_moe_blocked
            if x.shape[0] <= BLOCKED_MAX_TOKENS:
                # 16-row blocks up to 128 tokens, 32 beyond (bench_fused_moe.py on the H200: at 256
                # tokens 388 us with 32 rows against 455 with 16)
                out = try_kernel("fused_moe_blocked", fused_moe_blocked, x, self.w13, self.w2,
                                 *self._with_shared(weights, ids), 16 if x.shape[0] <= 128 else 32)
        if out is None:
            out = self._routed_any(x, *self._with_shared(weights, ids))
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

    def _routed_any(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if _use_grouped_mm(x):
            return self._routed_grouped(x, weights, ids)
        if x.is_cuda:
            return self._routed_dense(x, weights, ids)
        return self._routed(x, weights, ids)

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
        if triton_fast_path(x):
            from models.fused_moe import silu_mul, unpermute_sum  # triton: CUDA installs only
            y = torch._grouped_mm(silu_mul(gate_up), w2.transpose(-2, -1), offs=offs)  # [T*k, D]
            return unpermute_sum(y, order, weights)  # weights and the sum over k in one pass
        y = torch._grouped_mm(silu_mul_op(gate_up), w2.transpose(-2, -1), offs=offs)
        y = y * weights.flatten()[order].unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, y)

    def _routed_dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """CUDA fallback without host syncs for dtypes the grouped GEMM lacks (fp32 tiny models):
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
