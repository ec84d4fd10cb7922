"""DeepSeek's expert choice after the router GEMM, as one Triton kernel per token row.

On CUDA the torch version (`models.router.route`) costs five kernels per layer at decode (softmax or
sigmoid, a radix top-k, its sort, a reduction, the gathers): ~14 µs of a 1-token step on an H200,
about as long as reading the layer's six experts. Here one program per token takes the fp32
logits `[T, E]` and does scoring, the group limit, top-k, normalisation and scaling in registers
(E <= a few hundred). The fp32 logits GEMM is a Triton kernel too for decode-sized batches
(`router_logits`): one program per (token, expert) reads the expert's row and the token's bf16
row, converting in registers. cuBLAS took three kernels there (the cast of x to fp32, a dot kernel and
its reduction: ~5 µs per layer at batch 1 on the H200); larger batches keep cuBLAS. Both
accumulate in fp32, in different orders (results differ in the last bits).

Same rules as `route`:
  softmax (V2, V2-Lite): scores = softmax(logits); group_limited_greedy keeps the `topk_group`
      groups with the highest max score; top-k of the scores.
  sigmoid (V3, R1): scores = sigmoid(logits); choice = scores + bias; with groups, the
      `topk_group` groups with the highest sum of their two best choices; top-k of the choice,
      weights = the chosen experts' scores.
  then weights / sum (norm_topk_prob, k > 1), times routed_scaling_factor.
Experts are returned best first, as torch.topk does; on exact ties this kernel takes the lower
expert id (groups likewise), where torch.topk promises no order, so the CPU and CUDA paths may
choose differently on ties (only degenerate weights make exact ties). A row with NaN logits
still gets k distinct valid ids.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.pdl import pdl_launch, pdl_prologue
from common.triton_launch import fast_launch
from common.triton_norm import add_rms_norm_row, norm_warps


LOGITS_MAX_TOKENS = 32
# Each program reads its expert's row for its own token (the T programs of a row run side by
# side, so all but the first read hit L2). Beyond one token the kernel is used within the
# envelope measured on the H200 (scripts/bench_router_logits.py): T * E * D up to V2-Lite's at 32
# tokens: larger routers take it at fewer tokens (V2's 160 x 5120 up to 5, V3's 256 x 7168 up
# to 2); at one token it reads the weight exactly once, as cuBLAS does.
_LOGITS_MAX_ELEMS = 32 * 64 * 2048


@fast_launch
@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, out_ptr, D, stride_x, E: tl.constexpr, BLOCK_K: tl.constexpr,
                          PDL: tl.constexpr):
    """logits[t, e] = x[t] . w[e] in fp32; program (t, e)."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1).to(tl.int64)
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        m = offs < D
        xv = tl.load(x_ptr + t * stride_x + offs, mask=m, other=0.0).to(tl.float32)
        acc += xv * tl.load(w_ptr + e * D + offs, mask=m, other=0.0)
    tl.store(out_ptr + t * E + e, tl.sum(acc, axis=0))


def router_logits(x: torch.Tensor, weight: torch.Tensor, weight_bf16: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 `x @ weight.T` `[T, E]` for x `[T, D]` (any float dtype), weight fp32 `[E, D]`.
    Beyond the Triton kernel's envelope: with bf16 x and `weight_bf16` (the same weight, exactly
    representable in bf16), cuBLAS's bf16 GEMM with fp32 output (exact products summed in fp32 by
    the tensor cores, in their order and rounding);
    otherwise the fp32 GEMM on an fp32 copy of x."""
    T, D = x.shape
    E = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != D:
        raise ValueError(f"router_logits: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    if (not logits_kernel_fits(T, E, D) or x.stride(-1) != 1
            or weight.dtype != torch.float32 or not weight.is_contiguous()):
        if weight_bf16 is not None and x.dtype == torch.bfloat16 and x.is_cuda:
            return torch.mm(x, weight_bf16.t(), out_dtype=torch.float32)
        return torch.nn.functional.linear(x.float(), weight).contiguous()
    out = torch.empty(T, E, dtype=torch.float32, device=x.device)
    if T:
        _router_logits_kernel[(T, E)](x, weight, out, D, x.stride(0), E=E,
                                      BLOCK_K=min(triton.next_power_of_2(D), 2048), num_warps=4, **pdl_launch())
    return out


def logits_kernel_fits(T: int, E: int, D: int) -> bool:
    """Whether `router_logits` takes its Triton kernel for T tokens of a router [E, D]."""
    return T <= LOGITS_MAX_TOKENS and (T <= 1 or T * E * D <= _LOGITS_MAX_ELEMS)


@fast_launch
@triton.jit
def _norm_logits_kernel(x_ptr, h_ptr, nw_ptr, s_ptr, y_ptr, w_ptr, out_ptr, D, eps,
                        stride_x, stride_h, stride_s, stride_y, E: tl.constexpr, BLOCK_D: tl.constexpr,
                        PDL: tl.constexpr):
    """Program (t, e): row t's residual add + RMSNorm (`add_rms_norm_row`: s = x + h, y =
    rms_norm(s) * nw, the norm kernel's arithmetic), then logits[t, e] = y . w[e] in fp32 as
    `_router_logits_kernel` computes it from the stored y. Every program of the row computes the
    row (it is 2 x D elements, from L2); program (t, 0) stores s and y."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    s, y = add_rms_norm_row(x_ptr, h_ptr, nw_ptr, t, D, eps, stride_x, stride_h, y_ptr.dtype.element_ty,
                            True, 0, BLOCK_D)
    if e == 0:
        tl.store(s_ptr + t * stride_s + offs, s, mask=m)
        tl.store(y_ptr + t * stride_y + offs, y, mask=m)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc += y.to(tl.float32) * tl.load(w_ptr + e * D + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * E + e, tl.sum(acc, axis=0))


def add_norm_router_logits(x: torch.Tensor, h: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                           weight: torch.Tensor, weight_bf16: torch.Tensor | None = None,
                           out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(s, y, logits) in one launch for x, h `[T, D]`: s = x + h and y = rms_norm(s) *
    norm_weight with the Triton add + RMSNorm's arithmetic and bits (common/triton_norm.py), and
    the fp32 router logits y @ weight.T `[T, E]` (weight fp32 `[E, D]`) as `router_logits`'s
    kernel sums them up to 2048 columns (wider rows: one block, another order of the same fp32
    sums). `weight_bf16`: the same weight in bf16 (exact, `Router.keep_bf16_weight`), read
    instead: half the bytes, the same products. `out`: (s, y, logits) to write, contiguous and
    of those shapes and dtypes (`norm_logits_buffers`), allocated by a caller that hands them to
    another stream before this launch. Within `logits_kernel_fits` only: a ValueError beyond it,
    or for other layouts."""
    T, D = x.shape if x.dim() == 2 else (-1, -1)
    E = weight.shape[0]
    if (x.dim() != 2 or h.shape != x.shape or h.dtype != x.dtype or x.stride(-1) != 1 or h.stride(-1) != 1
            or norm_weight.shape != (D,) or norm_weight.stride(0) != 1 or weight.shape != (E, D)
            or weight.dtype != torch.float32 or not weight.is_contiguous() or not logits_kernel_fits(T, E, D)):
        raise ValueError(f"add_norm_router_logits: x {tuple(x.shape)} {x.dtype}, h {tuple(h.shape)} {h.dtype}, norm "
                         f"weight {tuple(norm_weight.shape)}, router {tuple(weight.shape)} {weight.dtype}: expected "
                         f"rows [T, D] of one dtype with unit last strides, a contiguous [D] norm weight, a "
                         f"contiguous fp32 [E, D] router and T * E * D within the logits kernel's envelope")
    if weight_bf16 is not None and (weight_bf16.shape != weight.shape or not weight_bf16.is_contiguous()):
        raise ValueError(f"add_norm_router_logits: the bf16 router {tuple(weight_bf16.shape)} is not a contiguous "
                         f"copy of {tuple(weight.shape)}")
    if out is None:
        s, y, logits = norm_logits_buffers(x, norm_weight, E)
    else:
        want = norm_logits_buffers(x, norm_weight, E, alloc=False)
        if any(o.shape != w[0] or o.dtype != w[1] or o.device != x.device or not o.is_contiguous()
               for o, w in zip(out, want)):
            raise ValueError(f"add_norm_router_logits: out {[(tuple(o.shape), o.dtype) for o in out]}, expected "
                             f"contiguous {[(tuple(w[0]), w[1]) for w in want]} on {x.device}")
        s, y, logits = out
    if T:
        block = triton.next_power_of_2(D)
        w = weight if weight_bf16 is None else weight_bf16
        _norm_logits_kernel[(T, E)](x, h, norm_weight, s, y, w, logits, D, eps, x.stride(0), h.stride(0), s.stride(0),
                                    y.stride(0), E=E, BLOCK_D=block, num_warps=norm_warps(block), **pdl_launch())
    return s, y, logits


def norm_logits_buffers(x: torch.Tensor, norm_weight: torch.Tensor, E: int, alloc: bool = True):
    """`add_norm_router_logits`' outputs for x `[T, D]` and a router of E experts: (s, y, logits),
    new and contiguous; with `alloc` False, their (shape, dtype) pairs."""
    T = x.shape[0]
    want = ((x.shape, x.dtype), (x.shape, torch.promote_types(x.dtype, norm_weight.dtype)),
            (torch.Size((T, E)), torch.float32))
    return tuple(torch.empty(shape, dtype=dt, device=x.device) for shape, dt in want) if alloc else want


@fast_launch
@triton.jit
def _route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, scale,
                  E: tl.constexpr, G: tl.constexpr, EPG: tl.constexpr, GP: tl.constexpr, EP: tl.constexpr,
                  TOPK_GROUP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, SIGMOID: tl.constexpr,
                  GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                  NS: tl.constexpr, NSP: tl.constexpr, PDL: tl.constexpr):
    """Row t: the top-K experts and weights, then (NS > 0) the NS folded shared experts E..E+NS-1
    with weight 1 in columns K..K+NS-1 of the same rows (row stride K + NS)."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GP)[:, None]
    j = tl.arange(0, EP)[None, :]
    valid = (g < G) & (j < EPG)
    e = g * EPG + j  # expert id of each [group, member] slot
    logit = tl.load(logits_ptr + t * E + e, mask=valid, other=float("-inf"))
    if SIGMOID:
        scores = tl.where(valid, 1.0 / (1.0 + tl.exp(-logit)), 0.0)
        choice = scores
        if HAS_BIAS:
            choice = scores + tl.load(bias_ptr + e, mask=valid, other=0.0)
        choice = tl.where(valid, choice, float("-inf"))
    else:
        ex = tl.exp(logit - tl.max(tl.max(logit, axis=1), axis=0))
        scores = ex / tl.sum(tl.sum(ex, axis=1), axis=0)
        choice = tl.where(valid, scores, float("-inf"))
    if GROUPED:
        best = tl.max(choice, axis=1)  # [GP]
        if SIGMOID:  # a group's score: the sum of its two best choices
            first = tl.min(tl.where(choice == best[:, None], j, EP), axis=1)
            best = best + tl.max(tl.where(j == first[:, None], float("-inf"), choice), axis=1)
        gid = tl.arange(0, GP)
        best = tl.where(gid < G, best, float("-inf"))
        keep = gid < 0
        for _ in tl.static_range(TOPK_GROUP):
            gm = tl.max(tl.where(keep, float("-inf"), best), axis=0)
            pick = tl.min(tl.where((best == gm) & (~keep), gid, GP), axis=0)
            keep = keep | (gid == pick)
        choice = tl.where(keep[:, None], choice, float("-inf"))
    # NaN (an overflowed activation) compares false everywhere: as -inf it can still be picked,
    # so a broken row gets valid expert ids (garbage for that request, never an id out of range)
    choice = tl.where(choice == choice, choice, float("-inf"))
    kk = tl.arange(0, KP)
    w_out = tl.zeros([KP], dtype=tl.float32)
    id_out = tl.zeros([KP], dtype=tl.int64)
    avail = valid
    for i in tl.static_range(K):
        m = tl.max(tl.max(tl.where(avail, choice, float("-inf")), axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(avail & (choice == m), e, E), axis=1), axis=0)
        hit = e == pick
        w = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=1), axis=0)
        w_out = tl.where(kk == i, w, w_out)
        id_out = tl.where(kk == i, pick.to(tl.int64), id_out)
        avail = avail & (~hit)
    if NORM:
        w_out = w_out / (tl.sum(w_out, axis=0) + 1e-20)
    tl.store(w_ptr + t * (K + NS) + kk, w_out * scale, mask=kk < K)
    tl.store(ids_ptr + t * (K + NS) + kk, id_out, mask=kk < K)
    if NS > 0:
        ss = tl.arange(0, NSP)
        tl.store(w_ptr + t * (K + NS) + K + ss, tl.full([NSP], 1.0, tl.float32), mask=ss < NS)
        tl.store(ids_ptr + t * (K + NS) + K + ss, (E + ss).to(tl.int64), mask=ss < NS)


# The one-launch router (`_router_fused_kernel`): tiles of FUSED_ROWS tokens (tl.dot needs 16
# rows), each program reading the whole router weight; routers of at most FUSED_MAX_EXPERTS
# experts (V2-Lite's 64). At decode sizes one to a few programs each stream the whole weight
# (V2-Lite's: 256 KB in bf16), so each keeps several wide k steps in flight: 256 columns a step
# in bf16 (64 in fp32, whose dot runs on FMAs with its operands in registers), 4 stages (at 64
# experts 40 KB a step, 160 KB of shared memory), 8 warps. Timed on an H100 it lost (so it stays
# opt-in): ~10.5 us a call at every size from 1 to 512 tokens, against 3.6-7.4 us for the two
# launches (scripts/bench_router_logits.py --route), since one program streams the 256 KB weight
# at ~25 GB/s, a quarter of the per-SM rate this tiling assumed.
FUSED_ROWS, FUSED_MAX_EXPERTS = 16, 64
FUSED_TILE = dict(num_warps=8, num_stages=4)


def router_grouped(scoring: str, topk_method: str, n_group: int) -> bool:
    """Whether the router chooses its experts by groups first (V2's group-limited greedy, V3's
    group top-k), as `route` does."""
    return n_group > 1 and (scoring != "softmax" or topk_method == "group_limited_greedy")


def fused_router_refusal(num_experts: int, grouped: bool) -> str | None:
    """Why `_router_fused_kernel` cannot serve a router of this shape (None: it can); the worker
    asks at start-up, `_fused_weight` at each call."""
    if grouped:
        return "its experts are chosen by groups"
    if num_experts > FUSED_MAX_EXPERTS:
        return f"it has {num_experts} experts, more than {FUSED_MAX_EXPERTS}"
    return None


@triton.jit
def choose_rows(logit, real, live, e, bias_ptr, E: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                BT: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr):
    """The choice of routers without groups for rows of fp32 logits `[BT, EP]` (-inf where the
    expert is not `real`; rows not `live` choose nothing): as `_route_kernel` does for one row,
    the scores, the top-K (lower id on ties, NaN as -inf) and their weights, normalised with
    NORM, not yet scaled: (weights `[BT, KP]`, ids `[BT, KP]` int64)."""
    if SIGMOID:
        scores = tl.where(real[None, :], 1.0 / (1.0 + tl.exp(-logit)), 0.0)
        choice = scores
        if HAS_BIAS:
            choice = scores + tl.load(bias_ptr + e, mask=real, other=0.0)[None, :]
    else:
        ex = tl.exp(logit - tl.max(logit, axis=1)[:, None])
        scores = ex / tl.sum(ex, axis=1)[:, None]
        choice = scores
    choice = tl.where(real[None, :] & (choice == choice), choice, float("-inf"))
    kk = tl.arange(0, KP)[None, :]
    w_out = tl.zeros([BT, KP], dtype=tl.float32)
    id_out = tl.zeros([BT, KP], dtype=tl.int64)
    avail = real[None, :] & live[:, None]
    for i in tl.static_range(K):
        m = tl.max(tl.where(avail, choice, float("-inf")), axis=1)
        pick = tl.min(tl.where(avail & (choice == m[:, None]), e[None, :], E), axis=1)
        hit = e[None, :] == pick[:, None]
        w = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        w_out = tl.where(kk == i, w[:, None], w_out)
        id_out = tl.where(kk == i, pick[:, None].to(tl.int64), id_out)
        avail = avail & (~hit)
    if NORM:
        w_out = w_out / (tl.sum(w_out, axis=1)[:, None] + 1e-20)
    return w_out, id_out


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _router_fused_kernel(x_ptr, w_ptr, bias_ptr, w_out_ptr, ids_ptr, T, D, stride_x, scale,
                         E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                         SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                         NS: tl.constexpr, NSP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                         PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Rows [BT] of tokens: their logits x . w over all E experts on the tensor cores (fp32
    accumulation; bf16 x bf16 products are exact), then their choice (`choose_rows`), and the NS
    folded shared experts after them."""
    pdl_prologue(PDL)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    live = rows < T
    e = tl.arange(0, EP)
    real = e < E
    acc = tl.zeros([BT, EP], dtype=tl.float32)
    for k0 in range(0, D, BK):
        offs_k = k0 + tl.arange(0, BK)
        mk = offs_k < D
        xv = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + offs_k[None, :],
                     mask=live[:, None] & mk[None, :], other=0.0)
        wv = tl.load(w_ptr + e[None, :] * D + offs_k[:, None], mask=real[None, :] & mk[:, None], other=0.0)
        acc = tl.dot(xv, wv, acc, input_precision=PRECISION)  # [BT, EP]
    w_out, id_out = choose_rows(tl.where(real[None, :], acc, float("-inf")), real, live, e, bias_ptr,
                                E, K, KP, BT, SIGMOID, HAS_BIAS, NORM)
    kk = tl.arange(0, KP)[None, :]
    out = rows[:, None].to(tl.int64) * (K + NS)
    tl.store(w_out_ptr + out + kk, w_out * scale, mask=live[:, None] & (kk < K))
    tl.store(ids_ptr + out + kk, id_out, mask=live[:, None] & (kk < K))
    if NS > 0:
        ss = tl.arange(0, NSP)[None, :]
        tl.store(w_out_ptr + out + K + ss, tl.full([BT, NSP], 1.0, tl.float32), mask=live[:, None] & (ss < NS))
        tl.store(ids_ptr + out + K + ss, tl.zeros([BT, NSP], tl.int64) + E + ss, mask=live[:, None] & (ss < NS))


def _fused_weight(x: torch.Tensor, weight: torch.Tensor, weight_bf16: torch.Tensor | None,
                  E: int, grouped: bool) -> torch.Tensor:
    """The weight `_router_fused_kernel` multiplies x by: the exact bf16 copy under bf16
    activations, the fp32 weight under fp32 ones. A ValueError naming the setting where the one
    launch cannot serve this router: expert groups (their choice is `_route_kernel`'s), more than
    FUSED_MAX_EXPERTS experts, or other activations or weights."""
    why = fused_router_refusal(E, grouped)
    if why is None:
        if x.dtype == torch.bfloat16 and weight_bf16 is not None:
            return weight_bf16.contiguous()
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            return weight.contiguous()
        why = (f"its weight is not exactly bf16 (activations {x.dtype})" if x.dtype == torch.bfloat16 else
               f"the activations are {x.dtype} (bf16 or fp32 only)")
    raise ValueError(f"router_fused_max_tokens: the one-launch router cannot serve this router: {why}; "
                     f"leave router_fused_max_tokens at 0")


def _layout(E: int, scoring: str, topk_method: str, n_group: int, topk_group: int,
            top_k: int) -> tuple[bool, bool, int]:
    """(sigmoid scoring, chosen by groups, groups) of a router; a ValueError where top-k cannot fill."""
    grouped = router_grouped(scoring, topk_method, n_group)
    G = n_group if grouped else 1
    if E % G or top_k > E or (grouped and topk_group * (E // G) < top_k):
        raise ValueError(f"router: {E} experts in {G} groups, top {topk_group} groups, top-{top_k} does not fit")
    return scoring != "softmax", grouped, G


def route_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scoring: str,
                 topk_method: str, n_group: int, topk_group: int, top_k: int, norm: bool,
                 scale: float, weight_bf16: torch.Tensor | None = None,
                 n_shared: int = 0, fused_max_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`models.router.route` as two Triton kernels (`router_logits`, cuBLAS beyond decode sizes,
    then the expert choice): weights fp32 [T, k], ids int64 [T, k]. With `n_shared`, `[T, k +
    n_shared]`: the folded shared experts E.. E+n_shared-1 with weight 1 after the k choices, as
    `MoE._with_shared` appends them (written by the choice kernel: no cat).
    Up to `fused_max_tokens` tokens (the kernel plan's router_fused_max_tokens) one launch instead
    (`_router_fused_kernel`), for routers without groups (`_fused_weight` says which; others are
    refused, naming the setting)."""
    T, E = x.shape[0], weight.shape[0]
    sigmoid, grouped, _ = _layout(E, scoring, topk_method, n_group, topk_group, top_k)
    if 0 < T <= fused_max_tokens:
        weights = torch.empty(T, top_k + n_shared, dtype=torch.float32, device=x.device)
        ids = torch.empty(T, top_k + n_shared, dtype=torch.int64, device=x.device)
        D = x.shape[1]
        try:
            w_fused = _fused_weight(x, weight, weight_bf16, E, grouped)
            x = x.contiguous()
            _router_fused_kernel[(triton.cdiv(T, FUSED_ROWS),)](
                x, w_fused, bias if bias is not None else weight, weights, ids, T, D, x.stride(0), float(scale),
                E=E, EP=max(16, triton.next_power_of_2(E)), K=top_k, KP=triton.next_power_of_2(top_k),
                SIGMOID=sigmoid, HAS_BIAS=bias is not None, NORM=bool(norm and top_k > 1),
                NS=n_shared, NSP=max(1, triton.next_power_of_2(n_shared)), BT=FUSED_ROWS,
                BK=max(16, min(64 if x.dtype == torch.float32 else 256, triton.next_power_of_2(D))),
                PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **FUSED_TILE, **pdl_launch())
        except Exception as e:  # charged to the setting whose 0 avoids this kernel (KernelPlan.error)
            e.plan_key = "router_fused_max_tokens"
            raise
        return weights, ids
    logits = router_logits(x, weight, weight_bf16)  # [T, E] fp32
    return route_choice(logits, bias, scoring, topk_method, n_group, topk_group, top_k, norm, scale, n_shared)


def route_choice(logits: torch.Tensor, bias: torch.Tensor | None, scoring: str, topk_method: str, n_group: int,
                 topk_group: int, top_k: int, norm: bool, scale: float,
                 n_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The expert choice from fp32 logits `[T, E]` (`_route_kernel`, one program a token): the
    second of `route_triton`'s launches, also run after `add_norm_router_logits`."""
    T, E = logits.shape
    sigmoid, grouped, G = _layout(E, scoring, topk_method, n_group, topk_group, top_k)
    if logits.dtype != torch.float32 or not logits.is_contiguous():
        raise ValueError(f"route_choice: logits {tuple(logits.shape)} {logits.dtype} must be contiguous fp32")
    weights = torch.empty(T, top_k + n_shared, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k + n_shared, dtype=torch.int64, device=logits.device)
    if T:
        _route_kernel[(T,)](logits, bias if bias is not None else logits, weights, ids, float(scale),
                            E=E, G=G, EPG=E // G, GP=triton.next_power_of_2(G),
                            EP=triton.next_power_of_2(E // G), TOPK_GROUP=topk_group if grouped else 1,
                            K=top_k, KP=triton.next_power_of_2(top_k), SIGMOID=sigmoid, GROUPED=grouped,
                            HAS_BIAS=bias is not None, NORM=bool(norm and top_k > 1),
                            NS=n_shared, NSP=max(1, triton.next_power_of_2(n_shared)),
                            num_warps=1 if E <= 64 else 2, **pdl_launch())
    return weights, ids
