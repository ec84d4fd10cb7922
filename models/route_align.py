"""The expert choice and the block MoE's alignment in one launch (moe_route_align_max_tokens).

At decode sizes the block MoE (models/blocked_moe.py) runs after the router's logits two small
launches: the choice (`_route_kernel`, one program a token) and the alignment of the chosen pairs
into blocks of one expert each (`align_pairs`, one program an expert). Each is a short chain of
loads and reductions, and in a decode step's CUDA graph each costs its launch and its wait more
than its work. Here one launch does both: each of its E + 1 programs makes the choice of every
token from the logits `[T, E]` (a `[T, E]` tile: T * E fp32 values from L2, the same work in
every program), program E stores the weights and ids, and every program then writes its expert's
run as `align_pairs` does (models/expert_sort.py `write_runs`).

For routers without expert groups (V2-Lite's; `models.triton_route.choose_rows` is the choice of
the one-launch router) and up to ROUTE_ALIGN_MAX_ELEMS logits a step (V2-Lite's 64 experts at 32
tokens); the choice's arithmetic is the one-launch router's: its softmax sums in another order
than the two-launch router's, so its weights may differ from those in the last bits, and its
expert ids too where two scores are within such a rounding of each other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.pdl import pdl_launch, pdl_prologue
from common.triton_launch import fast_launch
from models.expert_sort import write_runs
from models.triton_route import choose_rows, router_grouped

ROUTE_ALIGN_MAX_ELEMS = 32 * 64  # T * E in one program's tile


def route_align_refusal(num_experts: int, grouped: bool) -> str | None:
    """Why `route_align` cannot serve a router of this shape at any size (None: it can)."""
    if grouped:
        return "its experts are chosen by groups"
    if num_experts > ROUTE_ALIGN_MAX_ELEMS:
        return f"it has {num_experts} experts, more than {ROUTE_ALIGN_MAX_ELEMS}"
    return None


def route_align_fits(T: int, num_experts: int) -> bool:
    """Whether a step of T tokens fits one program's tile."""
    return _rows(T) * max(16, triton.next_power_of_2(num_experts)) <= ROUTE_ALIGN_MAX_ELEMS


def _rows(T: int) -> int:
    return max(1, triton.next_power_of_2(T))


@fast_launch
@triton.jit(do_not_specialize=["T", "NB"])
def _route_align_kernel(logits_ptr, bias_ptr, w_out_ptr, ids_ptr, rows_ptr, bexp_ptr, T, NB, scale,
                        E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, NS: tl.constexpr, KP: tl.constexpr,
                        SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                        SORT_SHARED: tl.constexpr, ES: tl.constexpr, TP: tl.constexpr, BLOCK_M: tl.constexpr,
                        BINS: tl.constexpr, PDL: tl.constexpr):
    """Program p: every token's choice from its logits (`choose_rows`), with the NS folded shared
    experts E.. (weight 1) after the K choices; the last program stores weights and ids `[T, K +
    NS]`; then `write_runs` over the pairs (pair index t * (K + NS) + j) of the routed experts,
    and with SORT_SHARED of the shared ones too: expert p's run of the ES sorted experts (E, or E +
    NS with SORT_SHARED)."""
    pdl_prologue(PDL)
    p = tl.program_id(0)
    t = tl.arange(0, TP)
    live = t < T
    e = tl.arange(0, EP)
    real = e < E
    logit = tl.load(logits_ptr + t[:, None].to(tl.int64) * E + e[None, :], mask=live[:, None] & real[None, :],
                    other=float("-inf"))
    w_out, id_out = choose_rows(logit, real, live, e, bias_ptr, E, K, KP, TP, SIGMOID, HAS_BIAS, NORM)
    kk = tl.arange(0, KP)[None, :]
    shared = (kk >= K) & (kk < K + NS)
    pair = t[:, None].to(tl.int64) * (K + NS) + kk
    if p == ES:
        stored = live[:, None] & (kk < K + NS)
        tl.store(w_out_ptr + pair, tl.where(shared, 1.0, w_out * scale), mask=stored)
        tl.store(ids_ptr + pair, tl.where(shared, E - K + kk, id_out), mask=stored)
    in_run = live[:, None] & (kk < (K + NS if SORT_SHARED else K))
    flat = tl.reshape(tl.where(in_run, tl.where(shared, E - K + kk, id_out), ES).to(tl.int32), [TP * KP])
    write_runs(flat, tl.reshape(pair, [TP * KP]), p, ES, NB, rows_ptr, bexp_ptr, BLOCK_M, BINS)


def route_align(logits: torch.Tensor, bias: torch.Tensor | None, scoring: str, topk_method: str, n_group: int,
                top_k: int, norm: bool, scale: float, n_shared: int, block_m: int,
                sort_shared: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights, ids, rows, bexp) from fp32 logits `[T, E]` in one launch: `route_choice`'s weights
    and ids `[T, top_k + n_shared]` (the shared experts E.. last, weight 1) and the blocks of their
    pairs, as `align_pairs(ids, E, block_m, max_pairs=T * top_k)` makes them for the routed pairs
    alone (the shared experts' blocks made apart: `fused_moe_blocked_overlapped`), or with
    `sort_shared` as `align_pairs(ids, E + n_shared, block_m)` makes them for all (the shared
    experts folded into the block kernels' launch). A ValueError (naming its setting) for
    routers with groups or steps past the tile (`route_align_fits`)."""
    T, E = logits.shape
    why = route_align_refusal(E, router_grouped(scoring, topk_method, n_group))
    if why is None and not route_align_fits(T, E):
        why = f"{T} tokens x {E} experts exceed its {ROUTE_ALIGN_MAX_ELEMS} logits a step"
    if why is None and (logits.dtype != torch.float32 or not logits.is_contiguous() or top_k > E):
        why = f"logits {tuple(logits.shape)} {logits.dtype} (contiguous fp32 [T, E >= {top_k}] only)"
    if why is not None:
        raise ValueError(f"moe_route_align_max_tokens: the one-launch choice and alignment cannot serve this "
                         f"router: {why}; leave moe_route_align_max_tokens at 0")
    dev = logits.device
    kt = top_k + n_shared
    weights = torch.empty(T, kt, dtype=torch.float32, device=dev)
    ids = torch.empty(T, kt, dtype=torch.int64, device=dev)
    sort_shared = bool(sort_shared and n_shared)
    es = E + n_shared if sort_shared else E  # the experts sorted into blocks
    nb = -(-(T * (kt if sort_shared else top_k)) // block_m) + es
    rows = torch.empty(nb * block_m, dtype=torch.int64, device=dev)
    bexp = torch.empty(nb, dtype=torch.int64, device=dev)
    _route_align_kernel[(es + 1,)](logits, bias if bias is not None else logits, weights, ids, rows, bexp, T, nb,
                                   float(scale), E=E, EP=max(16, triton.next_power_of_2(E)), K=top_k, NS=n_shared,
                                   KP=triton.next_power_of_2(kt), SIGMOID=scoring != "softmax",
                                   HAS_BIAS=bias is not None, NORM=bool(norm and top_k > 1),
                                   SORT_SHARED=sort_shared, ES=es, TP=_rows(T), BLOCK_M=block_m,
                                   BINS=max(16, triton.next_power_of_2(es + 1)), num_warps=4, **pdl_launch())
    return weights, ids, rows, bexp
