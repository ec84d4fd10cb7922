"""Dense MLP and the MoE block (its router: models/router.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common import distributed as pd
from common.fused import EAGER, Glue, PairRows, glue_for
from common.kernel_plan import TRITON, KernelPlan, charged_key
from models.config import ModelConfig
from models.expert_parallel import local_range, routed_shards, to_local
from models.fp8 import FP8, dequantize
from models.layers import Linear, PackedLinear, Shard, packed_param
from models.moe_paths import RoutedPaths, capturing
from models.router import Router

TORCH_PLAN = KernelPlan()


def block_rows(T: int, fp8: bool = False) -> int:
    """Pairs per expert block of the block kernels for a batch of T tokens, from bench_fused_moe.py
    on the H200 (CUDA graphs; RESULTS.md). bf16 (V2-Lite, µs per layer with 16 / 32 / 64-row
    blocks): 291.7 / 290.5 / 300.8 at 128 tokens, 381.5 / 307.2 / 313.7 at 256, 574.5 / 483.0 /
    345.1 at 512. FP8 experts (R1, µs per layer with 16 / 32 / 64): 4018 / 5042 / 6445 at 256
    tokens, 5491 / 5343 / 6488 at 512 (128-row blocks 13432); past 512 untimed, left at 32."""
    if fp8:
        return 16 if T <= 256 else 32
    return 16 if T <= 128 else 32 if T <= 256 else 64

# Which expert path serves a batch of T tokens (the plan's fields; docs/architecture.md):
#   T <= moe_fused_max_tokens (4; moe_fused_max_tokens_fp8, 8, for FP8 experts): the
#      pair-parallel fused MoE (models/fused_moe.py `fused_moe_small`);
#      at batch 1 a V2-Lite layer's routed + shared experts take 39 us instead of 111 us through
#      the grouped GEMM (H200, CUDA graphs, scripts/bench_fused_moe.py). It reads an expert once
#      per (token, expert) pair, so once pairs share experts the block kernels win: a V2-Lite
#      decode step took 3.01 / 4.13 / 6.07 ms of GPU time at batch 2 / 4 / 8 with it and 3.32 /
#      4.18 / 5.57 ms with them.
#   T <= moe_blocked_max_tokens (512), and FP8 experts at any T: the expert-sorted block kernels
#      (`fused_moe_blocked`), which read each touched expert once per block of 16/32/64 pairs
#      (`block_rows`; FP8 scaled per tile product); at 32 and 128 tokens their two product kernels run at
#      the copy bandwidth (RESULTS.md).
#   beyond (experts not in FP8), `moe_large`: torch's grouped GEMM between a sort and a weighted
#      un-permute (`_routed_grouped`, CUDA bf16), every expert on every token (`_routed_dense`,
#      other CUDA dtypes), or the loop over the experts hit (`_routed`, the reference).
# The shared experts ride along as experts every token takes (`_with_shared`), except from
# moe_shared_dense_min_tokens tokens on (1024; past the fused bound): there
# every token's rows of them are a dense GEMM, so `_shared_dense` runs them as one gate-up GEMM,
# the SwiGLU and one down GEMM per piece, accumulated into the routed output, and the routed paths
# see k pairs per token instead of k + n_shared (fewer blocks, gathered rows and pair sums). On the
# H200 (V2-Lite bf16, grouped GEMM, µs per layer) that took 542 to 524 at 1024 tokens, 805 to 771 at
# 2048 and 2487 to 2398 at 8192; at 512 and below, on the block kernels, it did not win.
# With moe_shared_stream (CUDA, the fused and the block paths) the shared experts' pairs run on a
# second stream while the router and the routed pairs run (`fused_moe_small_overlapped`,
# `fused_moe_blocked_overlapped`): their work does not wait for the router's chain of small kernels.


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The second CUDA stream of `device` (one for all layers) that the plan's moe_shared_stream
    runs the shared experts on; made at load by `MoE.process_weights_after_loading` (CUDA weights),
    so that no stream is made during a graph capture, else on first use."""
    got = _SIDE_STREAMS.get(device)
    if got is None:
        got = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return got


class MLP(nn.Module):
    """SwiGLU: gate and up column-parallel as one GEMM (`gate_up_proj`, loaded from the
    checkpoint's gate_proj and up_proj), down row-parallel (reduced by the caller when reduce=False)."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, reduce: bool = True,
                 fp8_block: tuple[int, int] | None = None, glue: Glue = EAGER, keep_fp8: bool = False):
        super().__init__()
        self.glue = glue
        self.gate_up_proj = PackedLinear(hidden, [("gate_proj", inter, 0), ("up_proj", inter, 0)], dtype,
                                         fp8_block=fp8_block, keep_fp8=keep_fp8)
        self.down_proj = Linear(inter, hidden, dtype, tp_dim=1, reduce=reduce, fp8_block=fp8_block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.glue.silu_mul(self.gate_up_proj(x)))


class SideNorm:
    """A MoE layer's input add + RMSNorm on both streams, for the fused and the block paths with
    the shared experts on the side stream (`MoE.takes_side_norm`) where moe_norm_in_router_max_tokens puts
    the norm inside the router's logits kernel. That kernel computes it for the routed pairs on
    the current stream (`main`: s = residual + h, x = its norm, the logits); a norm kernel of its
    own computes the same x for the shared experts on the side stream (`side`, bit for bit: the
    two kernels share the norm's code, block and warps). So the side stream forks before the
    router's first launch instead of after the norm. Every buffer is made here, on the current
    stream, before the fork; neither kernel writes what the other reads."""

    def __init__(self, gate: Router, residual: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float):
        from models.triton_route import norm_logits_buffers
        self.gate, self.residual, self.h, self.weight, self.eps = gate, residual, h, weight, eps
        self.s, self.x, self.logits = norm_logits_buffers(residual, weight, gate.weight.shape[0])
        self._side_out = (torch.empty_like(self.s), torch.empty_like(self.x))

    def main(self) -> None:
        self.gate.add_norm_logits(self.residual, self.h, self.weight, self.eps, out=(self.s, self.x, self.logits))

    def side(self) -> torch.Tensor:
        from common.triton_norm import add_rms_norm
        try:
            return add_rms_norm(self.residual, self.h, self.weight, self.eps, out=self._side_out)[1]
        except Exception as e:
            e.plan_key = "moe_norm_in_router_max_tokens"
            raise


class MoE(RoutedPaths, nn.Module):
    """Routed experts + shared experts, summed locally, one all-reduce per layer over the MoE group
    (the TP group, or every rank under data parallelism: built inside `pd.moe_scope()`, where
    `pd.tp()` is that group).

    The experts are stacked at load: `w13 [E, 2*I/tp, D]` (each expert's gate rows, then its up
    rows) and `w2 [E, D, I/tp]`, filled from the checkpoint's `experts.N.{gate,up,down}_proj`
    (models/layers.py `Shard`). The shared experts (an MLP of n_shared * I/tp units) are cut into
    n_shared pieces of I/tp units, stacked as experts E..E+n_shared-1 that every token takes with
    weight 1: an MLP is a sum over its intermediate units, so any split gives the same output, and
    every path then runs them with the routed ones (at decode: no separate GEMMs, activation and
    add). Not when FP8 weights are kept for the W8A8 GEMM (`keep_fp8`): then `shared_experts` is
    an MLP of its own.

    FP8 checkpoints (I/tp whole 128-row blocks) load as FP8 with their block scales stacked too:
    `w13_scale [E, 2I/tp/128, D/128]` (gate blocks, then up blocks) and `w2_scale [E, D/128,
    I/tp/128]`. After loading they stay FP8 with `keep_fp8` (the Triton kernels read them as they
    are; the torch paths dequantize the experts they use, per call), else they are dequantized to
    the compute dtype once.

    Expert parallelism (--enable-expert-parallel, models/expert_parallel.py): this rank's E / tp
    routed experts whole (`w13 [E/tp, 2I, D]`, `w2 [E/tp, D, I]`), the shared experts an MLP of
    their own split over the TP ranks, and the router's choices made local (`to_local`) before the
    block kernels (every batch size) or the torch paths.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, plan: KernelPlan = TORCH_PLAN,
                 keep_fp8: bool = False):
        super().__init__()
        self.cfg, self.plan, self.dtype, self.keep_fp8 = cfg, plan, dtype, keep_fp8
        self.glue = glue_for(plan)
        E, S, D, I = cfg.n_routed_experts, cfg.n_shared_experts, cfg.hidden_size, cfg.moe_intermediate_size
        tp = pd.tp().size
        q = cfg.fp8_block
        # expert parallel: this rank's routed experts are ep_first .. ep_first + El - 1 (`to_local`)
        self.ep_first, El = local_range(E)
        self.expert_parallel = El < E
        if I % tp and not self.expert_parallel:  # under EP only the shared MLP is split (its own check)
            raise ValueError(f"moe_intermediate_size {I} is not divisible by {pd.moe_size_name()} {tp}")
        w13, w2, Il, foreign = routed_shards(E, I, D)
        self.foreign_tensors = foreign + [f"{n}_scale_inv" for n in foreign if q is not None]  # for the loader
        self.gate = Router(cfg, plan)
        # Router.route_aligned up to this many tokens (its blocks are over all E experts: not with EP)
        self.route_align = 0 if self.expert_parallel else plan.moe_route_align_max_tokens
        if q is not None and Il % q[0]:
            raise ValueError(f"{pd.moe_size_name()} {tp} would split a {q[0]}x{q[1]} FP8 block: "
                             f"moe_intermediate_size {I} gives {Il} per rank")
        # shared experts stacked after the routed (pieces of Il units: not with EP, whose Il is I)
        self.n_shared = S if S and not keep_fp8 and not self.expert_parallel else 0
        self.shared_experts = (MLP(D, I * S, dtype, reduce=False, fp8_block=q, glue=self.glue, keep_fp8=keep_fp8)
                               if S and not self.n_shared else None)
        n, wdt = El + self.n_shared, FP8 if q else dtype
        if self.n_shared:  # this rank's units of the shared MLP, in n_shared pieces (Shard.stack)
            w13 += [Shard(f"shared_experts.{name}.weight", (S * I, D), 0, (slice(El, n), slice(h * Il, (h + 1) * Il)),
                          stack=0) for h, name in enumerate(("gate_proj", "up_proj"))]
            w2.append(Shard("shared_experts.down_proj.weight", (D, S * I), 1, (slice(El, n),), stack=1))
        self.w13 = packed_param((n, 2 * Il, D), wdt, w13)
        self.w2 = packed_param((n, D, Il), wdt, w2)
        self.fp8_block: tuple[int, int] | None = None  # set when the experts stay in FP8
        self.w13_scale: torch.Tensor | None = None
        self.w2_scale: torch.Tensor | None = None
        if q is not None:
            # one scale per 128 x 128 block: the weights' shards on the block grid
            cb, db = Il // q[0], -(-D // q[1])
            s13 = [Shard(f"{sh.name}_scale_inv", (sh.shape[0] // q[0], db), sh.tp_dim,
                         sh.index[:-1] + (slice(sh.index[-1].start // q[0], sh.index[-1].stop // q[0]),),
                         stack=sh.stack) for sh in w13]
            s2 = [Shard(f"{sh.name}_scale_inv", (db, sh.shape[1] // q[1]), sh.tp_dim, sh.index, stack=sh.stack)
                  for sh in w2]
            self.w13_scale = packed_param((n, 2 * cb, db), torch.float32, s13)
            self.w2_scale = packed_param((n, db, cb), torch.float32, s2)
        self.fused_small = self.fused_small_overlapped = self.fused_blocked = self.fused_blocked_overlapped = None
        self.triton_glue = self.sort_by_expert = None
        self.to_local = to_local  # expert parallel: the choices made this rank's
        if plan.moe == TRITON:
            from models import blocked_moe, expert_sort, fused_moe, grouped_glue  # triton: CUDA installs only
            from models.expert_parallel_kernel import to_local_triton
            self.to_local = to_local_triton
            self.fused_small, self.fused_blocked = fused_moe.fused_moe_small, blocked_moe.fused_moe_blocked
            self.fused_blocked_overlapped = blocked_moe.fused_moe_blocked_overlapped
            self.fused_small_overlapped = fused_moe.fused_moe_small_overlapped
            self.triton_glue = grouped_glue  # the grouped path's gather, SwiGLU and un-permute kernels
            self.sort_by_expert = expert_sort.sort_by_expert
        self._shared_cache: dict = {}  # _shared_choice's tensors by (device, dtypes)
        self.reduce_out = True  # False: the caller sums the partial outputs (models/data_parallel_moe.py)
        self._expert_ends: dict = {}  # _routed_grouped's expert end keys by device
        if self.expert_parallel and plan.moe != TRITON and plan.moe_large == "grouped":
            raise ValueError("--enable-expert-parallel: the grouped-GEMM MoE path does not leave out other ranks' "
                             "experts; --kernels ...,moe=triton or moe_large=dense|loop")
        self.routed_large = {"grouped": self._routed_grouped, "dense": self._routed_dense,
                             "loop": self._routed}[plan.moe_large]

    def process_weights_after_loading(self) -> None:
        """FP8 experts: kept for the fused kernel with `keep_fp8`, else dequantized to the compute
        dtype once."""
        if self.plan.moe_shared_stream and self.n_shared and self.w13.device.type == "cuda":
            side_stream(self.w13.device)
        q = self.cfg.fp8_block
        if q is None:
            return
        if self.keep_fp8:
            if self.fused_small is not None and q[0] != q[1]:  # the kernels take one block size
                raise ValueError(f"the Triton MoE kernels take square FP8 blocks, not {q[0]}x{q[1]}: "
                                 f"--no-fp8-gemm or --kernels ...,moe=torch")
            self.fp8_block = q
            return
        w13 = torch.empty(self.w13.shape, dtype=self.dtype, device=self.w13.device)
        w2 = torch.empty(self.w2.shape, dtype=self.dtype, device=self.w2.device)
        for e in range(w13.shape[0]):  # expert by expert: fp32 temporaries of one expert at a time
            w13[e] = dequantize(self.w13[e], self.w13_scale[e], q, self.dtype)
            w2[e] = dequantize(self.w2[e], self.w2_scale[e], q, self.dtype)
        self.w13, self.w2 = nn.Parameter(w13, requires_grad=False), nn.Parameter(w2, requires_grad=False)
        self.w13_scale = self.w2_scale = None

    def _paths(self, T: int, device: torch.device) -> tuple[bool, bool, bool, bool]:
        """(small, dense, blocked, overlapped) for a step of T tokens: the fused MoE takes it,
        the shared experts run dense, the block kernels take it, the shared experts' pairs run
        on the side stream (moe_shared_stream, the fused or the block path)."""
        p = self.plan
        fused_max = p.moe_fused_max_tokens_fp8 if self.fp8_block is not None else p.moe_fused_max_tokens
        small = self.fused_small is not None and T <= fused_max
        if self.expert_parallel:  # the fused MoE or the block kernels, skipping other ranks' pairs (or torch)
            return small, False, self.fused_blocked is not None and not small, False
        dense = not small and bool(self.n_shared) and 0 < p.moe_shared_dense_min_tokens <= T
        blocked = self.fused_blocked is not None and (self.fp8_block is not None or T <= p.moe_blocked_max_tokens)
        overlapped = (p.moe_shared_stream and bool(self.n_shared) and device.type == "cuda"
                      and (small or (blocked and not dense)))
        return small, dense, blocked, overlapped

    def takes_side_norm(self, h: torch.Tensor) -> bool:
        """Whether a step whose input norm runs in the router's logits kernel takes `SideNorm`:
        the fused or the block path with the shared experts on the side stream."""
        return self._paths(h.shape[0], h.device)[3]

    def forward(self, x: torch.Tensor, defer_sum: bool = False, logits: torch.Tensor | None = None,
                side_norm: SideNorm | None = None) -> torch.Tensor | PairRows:
        """The layer's output `[T, D]`; with `defer_sum` (the plan's moe_sum_in_norm, one TP rank,
        the shared experts folded in) the Triton paths return their pair rows unsummed
        (`PairRows`) for the next add + RMSNorm to sum. `logits`: the router's, already computed
        with x's norm (moe_norm_in_router_max_tokens: `Router.add_norm_logits`); the choice alone
        remains. `side_norm` (where `takes_side_norm`): x and logits are its buffers, which its
        launches fill once the side stream has forked (see `SideNorm`)."""
        T, p = x.shape[0], self.plan
        align = T <= self.route_align and self.gate.aligns(T)

        def gate(n_shared: int, block_m: int | None = None, sort_shared: bool = False) -> tuple[torch.Tensor, ...]:
            """(weights, ids); with `block_m` where moe_route_align_max_tokens takes the step, the
            pairs' blocks too (`Router.route_aligned`; the shared experts' with `sort_shared`):
            (weights, ids, rows, bexp)."""
            if block_m is not None and align:
                return self.gate.route_aligned(x, logits, n_shared, block_m, sort_shared)
            return self.gate(x, n_shared) if logits is None else self.gate.choose(logits, n_shared)
        small, dense, blocked, overlapped = self._paths(T, x.device)
        if side_norm is not None and not overlapped:
            raise ValueError(f"MoE.forward: a SideNorm for a step of {T} tokens that does not run the shared "
                             "experts on their own stream (MoE.takes_side_norm)")
        # the block and large paths take the shared experts as pairs of every token: the Triton
        # router writes their columns beside its choices (two cats fewer per layer)
        fold = not small and not dense and bool(self.n_shared) and self.gate.appends_shared
        defer = defer_sum and self.shared_experts is None and pd.moe().size == 1
        block = self.fp8_block[0] if self.fp8_block else 128
        # moe_shared_stream: the shared experts' pairs on the side stream while the router and the
        # routed pairs run (the fused and the block paths; n_shared > 0 means the experts are not
        # kept in FP8, so never W8A8)
        if overlapped:
            choose = ((lambda: gate(0)) if small else (lambda: gate(self.n_shared, block_rows(T))) if fold else
                      (lambda: self._with_shared(*gate(0))))
            # with a SideNorm, route() first launches the norm + logits kernel, and the side stream
            # computes the shared experts' input itself
            route = choose if side_norm is None else (lambda: (side_norm.main(), choose())[1])
            shared_x = None if side_norm is None else side_norm.side
            try:
                if small:
                    out = self.fused_small_overlapped(
                        x, self.w13, self.w2, route, self.cfg.num_experts_per_tok,
                        self._shared_choice(x.device, torch.int32, torch.float32), side_stream(x.device),
                        self.w13_scale, self.w2_scale, block, defer_sum=defer, shared_x=shared_x)
                else:
                    out = self.fused_blocked_overlapped(
                        x, self.w13, self.w2, route, self.cfg.num_experts_per_tok, self.n_shared, side_stream(x.device),
                        block_rows(T), defer_sum=defer, shared_x=shared_x)
            except Exception as e:
                if charged_key(e) in (None, "moe"):  # the split launches, not the router inside them
                    e.plan_key = "moe_shared_stream"
                raise
            return out if isinstance(out, PairRows) or not self.reduce_out else pd.moe_all_reduce(out)
        # moe_route_align_max_tokens on the block path (the shared experts folded in, or none): the
        # blocks of the pairs come with the choice
        sorts = blocked and not small and not dense and (fold or not self.n_shared)
        weights, ids, *aligned = gate(self.n_shared if fold else 0,
                                      block_rows(T, fp8=self.fp8_block is not None) if sorts else None, fold)
        aligned = tuple(aligned) or None
        ep = {}
        if self.expert_parallel:  # other ranks' pairs: id El, left out of the products and the sum
            weights, ids = self.to_local(weights, ids, self.ep_first, self.w13.shape[0])
            ep["left_out"] = True
        if small:
            out = self.fused_small(x, self.w13, self.w2, weights, ids, self.w13_scale, self.w2_scale, block,
                                   self.n_shared, defer_sum=defer, **ep)
        else:
            pairs = (weights, ids) if dense or fold else self._with_shared(weights, ids)
            if blocked and self.fp8_block is not None:  # FP8 experts: any size
                try:
                    out = self.fused_blocked(x, self.w13, self.w2, *pairs, block_rows(T, fp8=True), self.w13_scale,
                                             self.w2_scale, self.fp8_block[0], a8=p.moe_fp8_w8a8,
                                             defer_sum=defer and not dense, aligned=aligned, **ep)
                except Exception as e:
                    if p.moe_fp8_w8a8:  # its kernels and act_quant: the plan names moe_fp8_w8a8=0
                        e.plan_key = "moe_fp8_w8a8"
                    raise
            elif blocked:
                out = self.fused_blocked(x, self.w13, self.w2, *pairs, block_rows(T), defer_sum=defer and not dense,
                                         aligned=aligned, **ep)
            else:
                out = self.routed_large(x, *pairs)
            if dense:
                out = self._shared_dense(x, out)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out if isinstance(out, PairRows) or not self.reduce_out else pd.moe_all_reduce(out)

    def _shared_dense(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out + the shared experts' MLP of x, from their stacked pieces E.. E+n_shared-1 of w13 /
        w2: one GEMM over all pieces' gate and up rows (a view of w13), the SwiGLU per piece, and
        per piece a down GEMM that cuBLAS accumulates into `out` (in place; out is the routed
        paths' fresh output)."""
        E, S = self.cfg.n_routed_experts, self.n_shared
        w13, w2 = self._expert_weights(x.dtype)
        T, D = x.shape
        Il = w2.shape[-1]
        gate_up = F.linear(x, w13[E:E + S].reshape(S * 2 * Il, D))  # [T, S * 2Il]: [g0 u0 g1 u1 ..]
        silu_mul = self.triton_glue.silu_mul if self.triton_glue is not None else self.glue.silu_mul
        h = silu_mul(gate_up.view(T * S, 2 * Il)).view(T, S, Il)
        for s in range(S):
            out.addmm_(h[:, s], w2[E + s].t())
        return out

    def _with_shared(self, weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing with the folded shared experts as k+1.. k+n_shared-th choices of weight 1."""
        if not self.n_shared:
            return weights, ids
        sid, one = self._shared_choice(ids.device, ids.dtype, weights.dtype)
        T = ids.shape[0]
        return (torch.cat([weights, one.expand(T, -1)], dim=1), torch.cat([ids, sid.expand(T, -1)], dim=1))

    def _shared_choice(self, device, id_dtype, w_dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared experts' ids `[1, n_shared]` and weights (ones), made once per device and
        dtype: two launches fewer per layer and step (and fixed addresses inside CUDA graphs)."""
        key = (device, id_dtype, w_dtype)
        got = self._shared_cache.get(key)
        if got is None:
            E = self.cfg.n_routed_experts
            got = (torch.arange(E, E + self.n_shared, device=device, dtype=id_dtype).unsqueeze(0),
                   torch.ones(1, self.n_shared, device=device, dtype=w_dtype))
            if not capturing(device):  # made inside a graph capture, they would hold values only in replays
                self._shared_cache[key] = got
        return got
