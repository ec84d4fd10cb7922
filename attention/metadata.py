"""Per-step MLA attention metadata with the decode/prefill split (DESIGN.md §5).

The batch is ordered decodes first. Everything each kernel needs is precomputed here, once per
step, and each path receives only its own rebased slices:
- decode part: rows `[:num_decode_tokens]`, its block-table rows and (local) sequence lengths;
  a decode computes 1 token, or 1 + k with k speculative tokens; the kernel takes one query
  length per call, so decodes of fewer tokens than the longest are padded to its `q_len` rows
  (position -1: a padding row sees no key), with each token's global position for the causal
  mask;
- prefill part: rows `[num_decode_tokens:]`, `query_start_loc` rebased to start at 0, and, when
  any prefill has cached context (a continuation chunk or a prefix-cache hit), the context
  chunks to gather from the paged cache.

Under DCP (D ranks share a sequence's cache), global position p lives on rank p % D at local
index p // D; a rank holds `local_len(L)` of a length-L sequence (DESIGN.md §7).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from common.transfer import to_device


def local_len(length, dcp_size: int, dcp_rank: int):
    """Tokens of a length-`length` sequence stored on DCP rank `dcp_rank` (works on arrays)."""
    return length // dcp_size + (dcp_rank < length % dcp_size)


@dataclass
class DecodeMetadata:
    block_table: torch.Tensor  # [Bd, max_blocks] int32
    seq_lens: torch.Tensor  # [Bd] int32, local lengths including this step's tokens
    q_len: int = 1  # query tokens per decode
    q_pos: torch.Tensor | None = None  # [Bd*q_len] int32 global positions, -1 padding; None when q_len == 1
    # [num_decode_tokens] int64: each decode token's row in the padded [Bd*q_len] layout; None
    # when every decode has q_len tokens
    row_index: torch.Tensor | None = None


@dataclass
class ContextChunk:
    """One bounded slice of the cached context of prefills 0 .. Bc-1 (Bc = the prefill
    metadata's `num_context_prefills`; local indices on this rank)."""

    starts: torch.Tensor  # [Bc] local start index of this chunk per prefill
    cu_lens: torch.Tensor  # [Bc+1] rows of this rank's gathered chunk per prefill
    num_tokens: int  # rows this rank gathers
    # After the DCP all-gather (`[D, max_tokens]` rows, rank-major): rows of each prefill made
    # contiguous by `gather_index` (None when D == 1), with `cu_seqlens_k` over them.
    max_tokens: int  # rows per rank in the all-gather buffer (max over ranks)
    gather_index: torch.Tensor | None
    cu_seqlens_k: torch.Tensor  # [Bc+1] int32
    max_seqlen_k: int


@dataclass
class PrefillMetadata:
    query_start_loc: torch.Tensor  # [Bp+1] int32, rebased: the prefill part's own rows
    max_query_len: int
    block_table: torch.Tensor  # [Bp, max_blocks] int32
    context_lens: list[int]  # global cached tokens per prefill (host)
    context_chunks: list[ContextChunk]
    # The context attention covers prefills 0 .. num_context_prefills-1 only (up to the last one
    # with cached context): their query rows `[:context_query_rows]`, longest `context_max_query_len`.
    num_context_prefills: int = 0
    context_query_rows: int = 0
    context_max_query_len: int = 0

    @property
    def has_context(self) -> bool:
        return len(self.context_chunks) > 0


@dataclass
class MLAMetadata:
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    slot_mapping: torch.Tensor  # [T] int64, -1: not stored on this rank
    decode: DecodeMetadata | None
    prefill: PrefillMetadata | None

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens


def build_mla_metadata(query_lens: list[int], context_lens: list[int], block_ids: list[list[int]],
                       block_size: int, device: torch.device | str, dcp_size: int = 1,
                       dcp_rank: int = 0, decode_threshold: int = 1,
                       context_chunk_tokens: int = 8192) -> MLAMetadata:
    """Metadata for a batch already ordered decodes first.

    query_lens[i]: tokens computed for request i this step; context_lens[i]: tokens already in
    the cache before them; block_ids[i]: its (virtual, under DCP) block table.
    Decodes are the requests of at most `decode_threshold` tokens (1 + k with k speculative
    tokens), all before the prefills.
    `context_chunk_tokens` bounds the rows one context chunk gathers on a rank.
    """
    n = len(query_lens)
    q = np.asarray(query_lens, dtype=np.int64)
    ctx = np.asarray(context_lens, dtype=np.int64)
    is_decode = q <= decode_threshold
    num_decodes = int(is_decode.sum())
    if not is_decode[:num_decodes].all():
        raise ValueError("batch must be ordered decodes first")
    num_decode_tokens = int(q[:num_decodes].sum())
    max_blocks = max((len(b) for b in block_ids), default=0)
    table = np.zeros((n, max(max_blocks, 1)), dtype=np.int32)
    for i, b in enumerate(block_ids):
        table[i, : len(b)] = b

    slot = _slot_mapping(q, ctx, table, block_size, dcp_size, dcp_rank)
    to = lambda a, dt=torch.int32: to_device(np.ascontiguousarray(a), dt, device)

    decode = None
    if num_decodes:
        qd, cd = q[:num_decodes], ctx[:num_decodes]
        seq = local_len(cd + qd, dcp_size, dcp_rank)
        dq = int(qd.max())
        q_pos = row_index = None
        if dq > 1:  # each token's global position: the causal mask inside the query (and DCP's)
            real = np.arange(dq)[None, :] < qd[:, None]  # [Bd, dq]: rows past a decode's tokens pad
            q_pos = to(np.where(real, cd[:, None] + np.arange(dq), -1).reshape(-1))
            if not real.all():
                row_index = to(np.flatnonzero(real.reshape(-1)), torch.int64)
        decode = DecodeMetadata(block_table=to(table[:num_decodes]), seq_lens=to(seq), q_len=dq,
                                q_pos=q_pos, row_index=row_index)

    prefill = None
    if num_decodes < n:
        qp, cp = q[num_decodes:], ctx[num_decodes:]
        qsl = np.concatenate([[0], np.cumsum(qp)])
        with_ctx = np.flatnonzero(cp > 0)
        nc = int(with_ctx[-1]) + 1 if len(with_ctx) else 0
        chunks = _context_chunks(cp[:nc], dcp_size, dcp_rank, context_chunk_tokens, to)
        prefill = PrefillMetadata(query_start_loc=to(qsl), max_query_len=int(qp.max()),
                                  block_table=to(table[num_decodes:]),
                                  context_lens=cp.tolist(), context_chunks=chunks,
                                  num_context_prefills=nc, context_query_rows=int(qsl[nc]),
                                  context_max_query_len=int(qp[:nc].max()) if nc else 0)
    return MLAMetadata(num_decodes=num_decodes, num_decode_tokens=num_decode_tokens,
                       num_prefills=n - num_decodes, num_prefill_tokens=int(q.sum()) - num_decode_tokens,
                       slot_mapping=to(slot, torch.int64), decode=decode, prefill=prefill)


def _slot_mapping(q, ctx, table, block_size, dcp_size, dcp_rank) -> np.ndarray:
    req = np.repeat(np.arange(len(q)), q)
    pos = np.concatenate([np.arange(c, c + n) for c, n in zip(ctx, q)]) if len(q) else np.zeros(0, np.int64)
    local = pos // dcp_size  # local index on the owning rank
    slot = table[req, local // block_size].astype(np.int64) * block_size + local % block_size
    if dcp_size > 1:
        slot[pos % dcp_size != dcp_rank] = -1
    return slot


def _context_chunks(ctx, dcp_size, dcp_rank, chunk_tokens, to) -> list[ContextChunk]:
    if not ctx.any():
        return []
    # local context per (rank, prefill): [D, Bp]
    local = np.stack([local_len(ctx, dcp_size, r) for r in range(dcp_size)])
    # rows per prefill per chunk on one rank: the budget shared by the prefills that have context
    per_req = max(1, chunk_tokens // int((ctx > 0).sum()))
    chunks = []
    for k in range(-(-int(local.max()) // per_req)):
        start = k * per_req
        lens = np.clip(local - start, 0, per_req)  # [D, Bp]
        cu = np.concatenate([np.zeros((dcp_size, 1), np.int64), np.cumsum(lens, 1)], axis=1)
        max_tokens = int(cu[:, -1].max())
        total_per_req = lens.sum(0)  # [Bp] keys per prefill after the all-gather
        cu_k = np.concatenate([[0], np.cumsum(total_per_req)])
        gather_index = None
        if dcp_size > 1:
            # rows of prefill b from every rank d, in the buffer flattened as [D * max_tokens]
            gather_index = to(np.concatenate([
                d * max_tokens + np.arange(cu[d, b], cu[d, b + 1])
                for b in range(len(ctx)) for d in range(dcp_size)]), torch.int64)
        chunks.append(ContextChunk(
            starts=to(np.full(len(ctx), start)), cu_lens=to(cu[dcp_rank]),
            num_tokens=int(cu[dcp_rank, -1]), max_tokens=max_tokens, gather_index=gather_index,
            cu_seqlens_k=to(cu_k), max_seqlen_k=int(total_per_req.max())))
    return chunks
