"""The attention-ops interface every backend implements (pure torch reference, Triton).

Notation (DESIGN.md §4): Lkv = kv_lora_rank, R = qk_rope_head_dim, P = qk_nope_head_dim,
V = v_head_dim, H = query heads on this rank. The paged cache of one layer is
`[num_blocks, block_size, Lkv + R]`, one latent "head" shared by all query heads.

Conventions shared by all backends:
- LSE is the natural-log sum of exp(scaled scores), fp32. A query that sees no key gets
  LSE = -inf and output 0 (so merging by LSE ignores it).
- Causal attention is bottom-right aligned: with `Lq` queries and `Lk` keys in a sequence, query i
  sees keys j <= i + Lk - Lq.
- Index tensors (block tables, lengths, cu_seqlens, slot mappings) are int32 or int64 on the
  device of the data.
- The cache may be stored in another dtype than the model computes in: bf16, or FP8 e4m3 with a
  per-tensor scale (`ops.kv_scale`, attention/kv_quant.py). Writes quantise, every read (decode,
  gather_context) dequantises with the same arithmetic in every backend.
"""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionOps(Protocol):
    name: str
    kv_scale: float  # an FP8 cache's per-tensor scale

    def write_kv(self, kv_cache: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store `kv [T, Lkv+R]` at flat slots `block * block_size + offset`; slot -1 is skipped."""

    def decode(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, kv_lora_rank: int, q_len: int = 1,
               q_pos: torch.Tensor | None = None, dcp_size: int = 1, dcp_rank: int = 0,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Absorbed MQA decode, `q_len` query tokens per sequence (the same for every sequence).

        q `[B*q_len, H, Lkv+R]` (`[q_lat ‖ q_pe]`), sequence-major: rows `b*q_len .. b*q_len +
        q_len - 1` are sequence b's query tokens in position order. Keys are the first
        `seq_lens[b]` cached rows of sequence b on this rank (blocks `block_table[b]`),
        this step's tokens included; scores use all Lkv+R dims, values are the first Lkv dims (`c`).

        `q_pos [B*q_len]` int32 is each query token's global position. Local key index j on DCP
        rank `dcp_rank` of `dcp_size` has global position `j * dcp_size + dcp_rank`; a query at
        global position p sees exactly the keys at global positions <= p (the causal mask inside
        the query, and DESIGN.md §7's per-token mask over interleaved shards); -1 marks a padding row
        (a sequence with fewer query tokens), which sees no key. `q_pos=None`: every
        query of sequence b sees all `seq_lens[b]` keys.

        Returns o `[B*q_len, H, Lkv]` (q's dtype) and lse `[B*q_len, H]` fp32; a query token that
        sees no key on this rank gets lse -inf and o 0, so the DCP merge by LSE stays exact.
        (TritonAttentionOps also takes `unmerged_max_splits`, which the attention passes only with
        the plan's decode_merge_in_absorb: the split partials unmerged, for absorb_o_merge.)
        """

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                max_seqlen_q: int, max_seqlen_k: int, scale: float, causal: bool,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Variable-length multi-head attention with QK width != V width.

        q `[Tq, H, P+R]`, k `[Tk, H, P+R]`, v `[Tk, H, V]`; sequence b owns rows
        `cu_seqlens_q[b]:cu_seqlens_q[b+1]` of q and `cu_seqlens_k[b]:cu_seqlens_k[b+1]` of k, v.
        Returns o `[Tq, H, V]` (q's dtype) and lse `[Tq, H]` fp32.
        """

    def prefill_mla(self, q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor,
                    k_pe: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float,
                    causal: bool, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`prefill` with MLA's operands in parts: q = [q_nope ‖ q_pe] `[Tq, H, P]` + `[Tq, H, R]`,
        k = [k_nope ‖ k_pe] with k_nope `[Tk, H, P]` and k_pe `[Tk, R]` shared by all heads.
        With `out` (`[Tq, H, V]` in q's dtype, last dim contiguous: e.g. the prefill rows of a
        mixed step's joint output) o is written there and returned."""

    def merge_attn_states_(self, o: torch.Tensor, lse: torch.Tensor, o_b: torch.Tensor,
                           lse_b: torch.Tensor) -> None:
        """In place: (o `[T, H, V]`, lse `[T, H]` fp32) becomes the merge of itself and (o_b, lse_b),
        two attentions of the same queries over disjoint key sets. A row that saw no key on
        either side keeps lse -inf and gets o = 0."""

    def gather_context(self, kv_cache: torch.Tensor, block_table: torch.Tensor,
                       starts: torch.Tensor, cu_lens: torch.Tensor, num_tokens: int,
                       dtype: torch.dtype | None = None) -> torch.Tensor:
        """Copy cached rows out of the paged cache into a dense workspace.

        For sequence b, rows of token positions `starts[b] .. starts[b] + len_b - 1` (positions
        index the sequence's blocks through `block_table[b]`) go to output rows
        `cu_lens[b] .. cu_lens[b+1] - 1`, with `len_b = cu_lens[b+1] - cu_lens[b]`.
        Returns `[num_tokens, Lkv+R]` in `dtype` (None: the cache's), dequantised from FP8.
        """


def check_prefill_out(out: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    """`prefill_mla(out=)`'s buffer: exactly `shape` and `dtype`, last dim contiguous."""
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.stride(-1) != 1:
        raise ValueError(f"prefill out must be {tuple(shape)} {dtype} with a contiguous last dim, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
