"""Multi-head latent attention over a paged latent cache (DESIGN.md §4, §5, §7).

Notation: T tokens this step, Hl heads on this rank, P = qk_nope_head_dim, R = qk_rope_head_dim,
V = v_head_dim, Lkv = kv_lora_rank, D = DCP size. Cache rows are `[c ‖ k_pe]` (Lkv + R).

Decode rows (absorbed, data-movement-friendly):
    q_lat = q_nope @ W_UK            [Nd, Hl, Lkv]
    o_lat = softmax(q_lat·c + q_pe·k_pe) @ c   over the cache (an MQA with one latent head)
    o     = o_lat @ W_UVᵀ            [Nd, Hl, V]
Prefill rows (up-projected, compute-friendly): k_nope, v = kv_b_proj(c); causal attention over
the new tokens, plus non-causal attention over the cached context gathered chunk by chunk, each
part merged by LSE.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attention.backend import AttentionOps
from attention.kv_quant import as_cached
from attention.metadata import ContextChunk, MLAMetadata
from attention.torch_backend import TorchAttentionOps
from common import distributed as pd
from common.fused import apply_rope, glue_for
from common.kernel_plan import TRITON, KernelPlan

# decode_merge_in_absorb folds the merge of up to this many splits into absorb_o; more (a few
# sequences on many SMs: batch 1 takes ~130) keep the merge launch, whose programs each take one
# [splits, columns] tile, where absorb_o_merge's would loop over chunks of splits
MERGE_IN_ABSORB_MAX_SPLITS = 16


def make_attention_ops(plan: KernelPlan) -> AttentionOps:
    """The plan's AttentionOps backend (decode, prefill, context gather, KV write)."""
    if plan.attention == TRITON:
        from attention.triton_backend import TritonAttentionOps  # triton: CUDA installs only
        return TritonAttentionOps(wgmma_min_heads=plan.decode_wgmma_min_heads, qk_fp8=plan.decode_qk_fp8,
                                  wgmma_producer=plan.decode_wgmma_producer, wgmma_seesaw=plan.decode_wgmma_seesaw,
                                  fp8_wgmma=plan.decode_fp8_wgmma,
                                  fp8_wgmma_min_rows=plan.decode_fp8_wgmma_min_rows)
    return TorchAttentionOps(qk_fp8=plan.decode_qk_fp8)


# The prefill's up-projections meet a new row count nearly every step (the prompt rows after the
# step's decodes, each context chunk's length). cuBLAS chooses an algorithm per shape: ~120 us of
# host time the first time a row count is seen against ~19 us after (scripts/bench_host_calls.py,
# H200). Rounded up to this multiple, the counts repeat.
UP_PROJECT_ROWS = 128


def padded_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """x `[n, K]` (rows of stride s, last dim contiguous) as `[m, K]`, m = n rounded up to
    `multiple`, when x's storage already holds those m rows (the rows past n are whatever the
    buffer holds: a row-wise op's results there are to be dropped); else x itself."""
    n = x.shape[0]
    m = -(-n // multiple) * multiple
    if m == n or x.dim() != 2 or x.stride(-1) != 1:
        return x
    need = (x.storage_offset() + (m - 1) * x.stride(0) + x.shape[1]) * x.element_size()
    if need > x.untyped_storage().nbytes():
        return x
    return x.as_strided((m, x.shape[1]), x.stride())


class MLAAttention:
    """The attention core of one MLA layer; projections stay in the model."""

    def __init__(self, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, kv_lora_rank: int, scale: float, plan: KernelPlan,
                 ops: AttentionOps):
        self.H, self.P, self.R = num_heads, qk_nope_head_dim, qk_rope_head_dim
        self.V, self.Lkv, self.scale, self.ops = v_head_dim, kv_lora_rank, scale, ops
        self.glue = glue_for(plan)
        # the plan's fused decode-path kernels (None: the torch ops below)
        self.kv_finish = self.rope_kernel = self.absorb_q_kernel = self.absorb_o_kernel = None
        self.absorb_q_kv_finish = None  # decode_fuse_q_kv: absorb_q and kv_finish as one launch
        self.absorb_o_merge = None  # decode_merge_in_absorb: the decode's split merge inside absorb_o
        if plan.finish_kv == TRITON:
            from attention.triton_cache import kv_finish  # triton: CUDA installs only
            self.kv_finish = kv_finish
        if plan.absorb == TRITON:
            from attention import triton_absorb
            self.rope_kernel, self.absorb_q_kernel = triton_absorb.rope, triton_absorb.absorb_q
            self.absorb_o_kernel = triton_absorb.absorb_o
            if plan.decode_fuse_q_kv and plan.finish_kv == TRITON:
                self.absorb_q_kv_finish = triton_absorb.absorb_q_kv_finish
            if plan.decode_merge_in_absorb and plan.attention == TRITON:
                self.absorb_o_merge = triton_absorb.absorb_o_merge
        self.w_kv_b: torch.Tensor | None = None  # [Hl*(P+V), Lkv]
        self.w_uk: torch.Tensor | None = None  # [Hl, P, Lkv]
        self.w_uv: torch.Tensor | None = None  # [Hl, V, Lkv]

    def set_kv_b_weight(self, w: torch.Tensor) -> None:
        """Post-load: derive the absorbed W_UK / W_UV from kv_b_proj `[Hl*(P+V), Lkv]`."""
        self.w_kv_b = w
        w = w.view(self.H, self.P + self.V, self.Lkv)
        self.w_uk, self.w_uv = w[:, : self.P], w[:, self.P:]

    def finish_kv(self, kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos_sin: torch.Tensor,
                  kv_cache: torch.Tensor, meta: MLAMetadata) -> torch.Tensor:
        """The new tokens' cache rows from kv_a_proj's output `kv [T, Lkv+R]`: RMSNorm of c, RoPE of
        k_pe, `[c ‖ k_pe]` written to the cache at the slot mapping and returned `[T, Lkv+R]`.
        With the plan's finish_kv=triton one kernel (attention/triton_cache.py `kv_finish`), else
        the norm, rope, cat and the backend's write_kv."""
        if self.kv_finish is not None:
            return self.kv_finish(kv, norm_weight, eps, cos_sin, kv_cache, meta.slot_mapping, self.ops.kv_scale)
        c, k_pe = kv.split([self.Lkv, self.R], dim=-1)
        k_pe = apply_rope(cos_sin, k_pe, self.glue.rope)
        row = torch.cat([self.glue.rms_norm(c, norm_weight, eps), k_pe], dim=-1)
        self.ops.write_kv(kv_cache, row, meta.slot_mapping)
        return row

    def fuses_decode(self, meta: MLAMetadata, num_tokens: int) -> bool:
        """Whether `decode_fused` serves this step: a pure decode step with the plan's
        decode_fuse_q_kv (absorb_q and kv_finish as one launch)."""
        return (self.absorb_q_kv_finish is not None and meta.prefill is None
                and meta.num_decode_tokens == num_tokens)

    def decode_fused(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float, cos_sin: torch.Tensor, kv_cache: torch.Tensor, meta: MLAMetadata,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """`finish_kv` + `forward` for a pure decode step (`fuses_decode`): the new tokens' cache rows
        and the absorbed query in one launch, then the decode. The rows kv_finish would return are
        not needed: a decode reads its keys from the cache."""
        q = self.absorb_q_kv_finish(q_nope, q_pe, self.w_uk, cos_sin, kv, norm_weight, eps, kv_cache,
                                    meta.slot_mapping, self.ops.kv_scale)
        return self._decode_q(q, kv_cache, meta, q_nope.dtype, out=out)

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_row: torch.Tensor,
                kv_cache: torch.Tensor, meta: MLAMetadata, cos_sin: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """q_nope [T,Hl,P], q_pe [T,Hl,R] (not yet rotated), kv_row [T, Lkv+R] = [c ‖ k_pe] of the
        new tokens, already in the cache (`finish_kv`); cos_sin [T, R] the tokens' RoPE rows
        (`rope.at`) -> [T, Hl, V], written into `out` (contiguous `[T, Hl, V]`) when given."""
        c, k_pe = kv_row.split([self.Lkv, self.R], dim=-1)
        nd = meta.num_decode_tokens
        if meta.prefill is None and nd == q_nope.shape[0]:  # pure decode: no copy into a joint output
            return self._decode(q_nope, q_pe, kv_cache, meta, cos_sin, out=out)
        q_pe = self._rope(q_pe, cos_sin)
        if kv_cache.dtype != kv_row.dtype:
            # the prefill rows attend over their own keys as the cache holds them (FP8, or bf16
            # under fp32 compute), as a later chunk or a prefix-cache hit reads them: a prompt's
            # logprobs do not depend on what was cached
            c, k_pe = as_cached(kv_row, kv_cache.dtype, self.ops.kv_scale).split([self.Lkv, self.R], dim=-1)
        if meta.decode is None and nd == 0:
            return self._prefill(q_nope, q_pe, c, k_pe, kv_cache, meta, out=out)
        if out is None:
            out = q_nope.new_empty(q_nope.shape[0], self.H, self.V)
        if meta.decode is not None:  # written in place too (absorb_o's out)
            self._decode(q_nope[:nd], q_pe[:nd], kv_cache, meta, out=out[:nd])
        if meta.prefill is not None:  # written in place: no copy of the prefill rows
            self._prefill(q_nope[nd:], q_pe[nd:], c[nd:], k_pe[nd:], kv_cache, meta, out=out[nd:])
        return out

    def _rope(self, q_pe, cos_sin):
        """q_pe `[T, Hl, R]` rotated: one Triton kernel with absorb=triton, else `apply_rope`."""
        if self.rope_kernel is not None:
            return self.rope_kernel(q_pe, cos_sin)
        return apply_rope(cos_sin, q_pe, self.glue.rope)

    def _absorb_q(self, q_nope, q_pe, cos_sin=None):
        """[q_nope @ W_UK ‖ q_pe] `[Nd, Hl, Lkv+R]`, q_pe rotated first when `cos_sin` is given:
        one Triton kernel with absorb=triton (attention/triton_absorb.py), else the RoPE, a
        batched GEMM and a cat."""
        if self.absorb_q_kernel is not None:
            return self.absorb_q_kernel(q_nope, q_pe, self.w_uk, cos_sin)
        if cos_sin is not None:
            q_pe = apply_rope(cos_sin, q_pe, self.glue.rope)
        return torch.cat([torch.einsum("thp,hpl->thl", q_nope, self.w_uk), q_pe], dim=-1)

    def _absorb_o(self, o_lat, out=None):
        """o_lat @ W_UVᵀ as `[Nd, Hl, V]`, contiguous with absorb=triton (o_proj reads it flat);
        into `out` (contiguous) when given."""
        if self.absorb_o_kernel is not None:
            return self.absorb_o_kernel(o_lat, self.w_uv, out=out)
        o = torch.einsum("thl,hvl->thv", o_lat, self.w_uv)
        return o if out is None else out.copy_(o)

    def _decode(self, q_nope, q_pe, kv_cache, meta, cos_sin=None, out=None):
        """Decode rows; q_pe rotated already, or rotated here when `cos_sin` is given; written into
        `out` (contiguous `[Nd, Hl, V]`) when given."""
        q = self._absorb_q(q_nope, q_pe, cos_sin)  # [Nd, Hl, Lkv+R]
        return self._decode_q(q, kv_cache, meta, q_nope.dtype, out=out)

    def _decode_q(self, q, kv_cache, meta, dtype, out=None):
        """Decode rows from the absorbed query q `[Nd, Hl, Lkv+R]`: attention (DCP: over the
        group's gathered heads), then absorb_o into `out` when given."""
        dcp = pd.dcp()
        if dcp.size > 1:
            q = pd.dcp_all_gather(q, dim=1)  # [Nd, Hl*D, Lkv+R]: the group's heads, rank-major
        d = meta.decode
        if d.row_index is not None:  # decodes of fewer tokens: padded to q_len rows each
            padded = q.new_zeros(d.block_table.shape[0] * d.q_len, *q.shape[1:])
            padded[d.row_index] = q
            q = padded
        # decode_merge_in_absorb: where no DCP merge or row selection needs the merged lse, the
        # Triton decode hands back the partials of up to MERGE_IN_ABSORB_MAX_SPLITS splits, merged
        # inside absorb_o
        unmerged = ({"unmerged_max_splits": MERGE_IN_ABSORB_MAX_SPLITS}
                    if self.absorb_o_merge is not None and dcp.size == 1 and d.row_index is None else {})
        o_lat, lse = self.ops.decode(q, kv_cache, d.block_table, d.seq_lens, self.scale, self.Lkv,
                                     q_len=d.q_len, q_pos=d.q_pos, dcp_size=dcp.size, dcp_rank=dcp.rank, **unmerged)
        if o_lat.dim() == 4:  # [Nd, splits, Hl, Lkv] fp32 partials and their lse [Nd, splits, Hl]
            try:
                return self.absorb_o_merge(o_lat, lse, self.w_uv, out=out)
            except Exception as e:  # charged to the fold's key, not `absorb` (the same module)
                e.plan_key = "decode_merge_in_absorb"
                raise
        if d.row_index is not None:
            o_lat, lse = o_lat[d.row_index], lse[d.row_index]
        if dcp.size > 1:
            # Each rank attended over its own shard of the keys: rescale by the global LSE, sum
            # over ranks and keep this rank's heads. A rank where a query token saw no key has
            # lse -inf: its weight is exp(-inf) = 0 (nan when every rank has -inf, zeroed).
            lse_all = pd.dcp_all_gather_stacked(lse)  # [D, Nd, Hl*D]
            lse_g = torch.logsumexp(lse_all, dim=0)
            w = torch.exp(lse - lse_g).nan_to_num_(0.0).unsqueeze(-1)
            o_lat = pd.dcp_reduce_scatter(o_lat.float() * w, dim=1).to(dtype)  # [Nd, Hl, Lkv]
        return self._absorb_o(o_lat, out)

    def _up_project(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k_nope `[N, Hl, P]`, v `[N, Hl, V]`: views of one kv_b_proj GEMM's output. The GEMM
        runs over N rounded up to a multiple of UP_PROJECT_ROWS where c's storage holds those rows
        (`padded_rows`), its extra rows' outputs dropped."""
        n = c.shape[0]
        kv = F.linear(padded_rows(c, UP_PROJECT_ROWS), self.w_kv_b)[:n].view(n, self.H, self.P + self.V)
        k_nope, v = kv.split([self.P, self.V], dim=-1)
        return k_nope, v

    def _prefill(self, q_nope, q_pe, c, k_pe, kv_cache, meta, out=None):
        """Prefill rows' attention `[Tp, Hl, V]`, into `out` when given."""
        p = meta.prefill
        k_nope, v = self._up_project(c)
        qsl = p.query_start_loc
        o, lse = self.ops.prefill_mla(q_nope, q_pe, k_nope, k_pe, v, qsl, qsl, p.max_query_len,
                                      p.max_query_len, self.scale, causal=True, out=out)
        if not p.has_context:
            return o
        # Cached context: only the prefills up to the last one that has any (their rows come
        # first), attended chunk by chunk and merged into their rows of (o, lse) in place.
        r, nc = p.context_query_rows, p.num_context_prefills
        qn, qp, qsl_c = q_nope[:r], q_pe[:r], qsl[: nc + 1]
        o_c, lse_c = o[:r], lse[:r]
        for chunk in p.context_chunks:
            rows = self._gather_chunk(kv_cache, p.block_table, chunk, q_nope.dtype)  # [Nk, Lkv+R]
            ck, cv = self._up_project(rows[:, : self.Lkv])
            oc, lc = self.ops.prefill_mla(qn, qp, ck, rows[:, self.Lkv:], cv, qsl_c, chunk.cu_seqlens_k,
                                          p.context_max_query_len, chunk.max_seqlen_k, self.scale, causal=False)
            self.ops.merge_attn_states_(o_c, lse_c, oc, lc)
        return o

    def _gather_chunk(self, kv_cache, block_table, chunk: ContextChunk, dtype: torch.dtype) -> torch.Tensor:
        # in the compute dtype: an FP8 or bf16 cache is dequantised here, before kv_b_proj
        rows = self.ops.gather_context(kv_cache, block_table, chunk.starts, chunk.cu_lens,
                                       chunk.num_tokens, dtype)
        if chunk.gather_index is None:
            return rows
        # Under DCP each rank holds an interleaved share of the context: all-gather the shares
        # (padded to the same row count) and put each prefill's rows together. Order inside a
        # prefill's context does not matter: the attention is non-causal and k_pe has positions.
        padded = rows.new_zeros(chunk.max_tokens, rows.shape[-1])
        padded[: rows.shape[0]] = rows
        every = pd.dcp_all_gather_stacked(padded).flatten(0, 1)  # [D*max_tokens, Lkv+R]
        return every.index_select(0, chunk.gather_index)
