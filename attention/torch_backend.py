"""Pure-torch reference attention ops: readable, runs anywhere, the test oracle for the fast paths."""

from __future__ import annotations

import torch

from attention.backend import check_prefill_out
from attention.kv_quant import e4m3_rows, is_fp8, load_as, store_as


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention in fp32 with LSE. q [H, Lq, Dk], k [H, Lk, Dk], v [H, Lk, Dv], mask [Lq, Lk]."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [H, Lq, Lk]
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [H, Lq]
    # exp(s - lse) is 0 where masked; rows with no key have lse -inf -> nan, zero them.
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num_(0.0)
    return torch.matmul(p, v.float()), lse


class TorchAttentionOps:
    """`kv_scale`: the per-tensor scale of an FP8 cache (attention/kv_quant.py); unused otherwise.
    `qk_fp8` (the plan's decode_qk_fp8): over an FP8 cache the decode rounds each query row to
    e4m3 with its own scale (kv_quant.e4m3_rows) before QK^T, as the Triton kernel's e4m3 QK^T does."""

    name = "torch"

    def __init__(self, kv_scale: float = 1.0, qk_fp8: bool = False):
        self.kv_scale = kv_scale
        self.qk_fp8 = qk_fp8

    def write_kv(self, kv_cache, kv, slot_mapping):
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        keep = slot_mapping >= 0
        flat[slot_mapping[keep].long()] = store_as(kv[keep], kv_cache.dtype, self.kv_scale)

    def _rows(self, kv_cache, block_row, start: int, length: int, dtype: torch.dtype) -> torch.Tensor:
        """Cached rows of positions start .. start+length-1, dequantised to `dtype`: [length, Lkv+R]."""
        bs = kv_cache.shape[1]
        pos = torch.arange(start, start + length, device=kv_cache.device)
        blocks = block_row.long()[pos // bs]
        return load_as(kv_cache[blocks, pos % bs], dtype, self.kv_scale)

    def decode(self, q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, q_len=1, q_pos=None,
               dcp_size=1, dcp_rank=0):
        T, H, _ = q.shape
        o = torch.zeros(T, H, kv_lora_rank, dtype=q.dtype, device=q.device)
        lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
        qk = q
        if self.qk_fp8 and is_fp8(kv_cache):  # q as QK^T's e4m3 operand sees it (fp32: exact)
            q8, sq = e4m3_rows(q)
            qk = q8.float() * sq
        for b, n in enumerate(seq_lens.tolist()):
            if n == 0:
                continue
            rows = slice(b * q_len, (b + 1) * q_len)
            kv = self._rows(kv_cache, block_table[b], 0, n, torch.float32)  # [n, Lkv+R]
            mask = None
            if q_pos is not None:  # [q_len, n]: key j holds global position j*D + r
                key_pos = torch.arange(n, device=q.device) * dcp_size + dcp_rank
                mask = key_pos.unsqueeze(0) <= q_pos[rows].to(q.device).long().unsqueeze(1)
            ob, lb = _attend(qk[rows].transpose(0, 1), kv.unsqueeze(0), kv[:, :kv_lora_rank].unsqueeze(0),
                             scale, mask)  # [H, q_len, Lkv], [H, q_len]
            o[rows] = ob.transpose(0, 1).to(q.dtype)
            lse[rows] = lb.transpose(0, 1)
        return o, lse

    def prefill(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                causal):
        Tq, H, _ = q.shape
        o = torch.zeros(Tq, H, v.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.full((Tq, H), float("-inf"), dtype=torch.float32, device=q.device)
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for b in range(len(cq) - 1):
            q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
            lq, lk = q1 - q0, k1 - k0
            if lq == 0:
                continue
            mask = None
            if causal:
                i = torch.arange(lq, device=q.device).unsqueeze(1)
                j = torch.arange(lk, device=q.device).unsqueeze(0)
                mask = j <= i + (lk - lq)
            ob, lb = _attend(q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1),
                             v[k0:k1].transpose(0, 1), scale, mask)
            o[q0:q1] = ob.transpose(0, 1).to(q.dtype)
            lse[q0:q1] = lb.transpose(0, 1)
        return o, lse

    def prefill_mla(self, q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, scale, causal, out=None):
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, k_nope.shape[1], -1)], dim=-1)
        o, lse = self.prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal)
        if out is None:
            return o, lse
        check_prefill_out(out, o.shape, o.dtype)
        return out.copy_(o), lse

    def merge_attn_states_(self, o, lse, o_b, lse_b):
        mo, ml = merge_attn_states(o, lse, o_b, lse_b)
        o.copy_(mo)
        lse.copy_(ml)

    def gather_context(self, kv_cache, block_table, starts, cu_lens, num_tokens, dtype=None):
        dtype = dtype or kv_cache.dtype
        out = kv_cache.new_empty(num_tokens, kv_cache.shape[-1], dtype=dtype)
        cu = cu_lens.tolist()
        for b, s in enumerate(starts.tolist()):
            if cu[b + 1] > cu[b]:
                out[cu[b]:cu[b + 1]] = self._rows(kv_cache, block_table[b], s, cu[b + 1] - cu[b], dtype)
        return out


def merge_attn_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                      lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions over disjoint key sets. o [T, H, D], lse [T, H] fp32."""
    lse = torch.logaddexp(lse_a, lse_b)
    # Both -inf: keep -inf and weights 0 (nan_to_num), output stays 0.
    w_a = torch.exp(lse_a - lse).nan_to_num_(0.0).unsqueeze(-1)
    w_b = torch.exp(lse_b - lse).nan_to_num_(0.0).unsqueeze(-1)
    o = (o_a.float() * w_a + o_b.float() * w_b).to(o_a.dtype)
    return o, lse
