"""DeepSeek's routers (V2 softmax with optional group-limited greedy, V3 sigmoid + bias + group
top-k): the torch reference `route`, and `Router`, which runs it or the Triton kernels
(models/triton_route.py) as the kernel plan says."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.kernel_plan import TRITON, KernelPlan
from models.config import ModelConfig
from models.layers import shard_param


class Router(nn.Module):
    """Picks `top_k` experts per token and their weights, by the checkpoint's rule (fp32)."""

    def __init__(self, cfg: ModelConfig, plan: KernelPlan = KernelPlan()):
        super().__init__()
        self.cfg = cfg
        self.kernel = route
        self.fused_max_tokens = plan.router_fused_max_tokens
        # moe_norm_in_router_max_tokens: the decoder layer asks `fuses_norm`, then `add_norm_logits`
        # + `choose`
        self.norm_in_logits = plan.moe_norm_in_router_max_tokens
        if plan.router == TRITON:  # logits (Triton at decode sizes, else cuBLAS) + the choice kernel
            from models.triton_route import route_triton  # triton: CUDA installs only
            self.kernel = route_triton
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

    @property
    def appends_shared(self) -> bool:
        """Whether forward(x, n_shared) writes the folded shared experts' columns itself (the
        Triton choice kernel); else the caller appends them."""
        return self.kernel is not route

    def forward(self, x: torch.Tensor, n_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, ids) `[T, k]`; with `n_shared` (only where `appends_shared`) `[T, k + n_shared]`,
        the shared experts E.. with weight 1 last."""
        c = self.cfg
        args = (x, self.weight, self.e_score_correction_bias, c.scoring_func, c.topk_method,
                c.n_group, c.topk_group, c.num_experts_per_tok, c.norm_topk_prob, c.routed_scaling_factor)
        if self.kernel is route:
            if n_shared:
                raise ValueError("Router.forward(n_shared): the torch router does not append the shared experts")
            return route(*args)
        return self.kernel(*args, self.weight_bf16, n_shared, self.fused_max_tokens)

    def fuses_norm(self, h: torch.Tensor) -> bool:
        """Whether this step's residual add + norm before the router runs inside its logits kernel
        (moe_norm_in_router_max_tokens): the Triton router, in the steps of up to that many tokens
        its Triton logits kernel takes and the one-launch router (router_fused_max_tokens) does not."""
        T = h.shape[0]
        if T > self.norm_in_logits or self.kernel is route:
            return False
        from models.triton_route import logits_kernel_fits
        return self.fused_max_tokens < T and logits_kernel_fits(T, *self.weight.shape)

    def add_norm_logits(self, residual: torch.Tensor, h: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(residual + h, its RMSNorm, the router's fp32 logits of it) in one launch, where
        `fuses_norm`, written to `out` if given; `choose` then picks from the logits. A failure is
        charged to moe_norm_in_router_max_tokens (its 0 avoids this kernel)."""
        from models.triton_route import add_norm_router_logits
        try:
            return add_norm_router_logits(residual, h, norm_weight, eps, self.weight, self.weight_bf16, out)
        except Exception as e:
            e.plan_key = "moe_norm_in_router_max_tokens"
            raise

    def aligns(self, T: int) -> bool:
        """Whether `route_aligned` can take a step of T tokens (MoE bounds it by
        moe_route_align_max_tokens): the Triton router, in steps the one-launch router
        (router_fused_max_tokens) does not take and the choice's tile holds (models/route_align.py;
        the router's shape is checked at start-up)."""
        if self.kernel is route or T <= self.fused_max_tokens:
            return False
        from models.route_align import route_align_fits
        return route_align_fits(T, self.cfg.n_routed_experts)

    def route_aligned(self, x: torch.Tensor, logits: torch.Tensor | None, n_shared: int, block_m: int,
                      sort_shared: bool = False) -> tuple[torch.Tensor, ...]:
        """(weights, ids, rows, bexp): `forward`'s choice and its pairs' blocks of block_m rows
        (`align_pairs`'s layout: the routed pairs', and the n_shared folded shared experts' too
        with `sort_shared`) from one launch after the logits (`logits`, or computed here from x).
        A failure is charged to moe_route_align_max_tokens."""
        from models.route_align import route_align
        from models.triton_route import router_logits
        c = self.cfg
        if logits is None:
            logits = router_logits(x, self.weight, self.weight_bf16)
        try:
            return route_align(logits, self.e_score_correction_bias, c.scoring_func, c.topk_method, c.n_group,
                               c.num_experts_per_tok, c.norm_topk_prob, c.routed_scaling_factor, n_shared, block_m,
                               sort_shared)
        except Exception as e:
            e.plan_key = "moe_route_align_max_tokens"
            raise

    def choose(self, logits: torch.Tensor, n_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`'s (weights, ids) from `add_norm_logits`'s logits: the choice kernel alone."""
        from models.triton_route import route_choice
        c = self.cfg
        return route_choice(logits, self.e_score_correction_bias, c.scoring_func, c.topk_method, c.n_group,
                            c.topk_group, c.num_experts_per_tok, c.norm_topk_prob, c.routed_scaling_factor, n_shared)


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
