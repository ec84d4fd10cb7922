"""Triton attention ops: the AttentionOps protocol (attention/backend.py) on Triton kernels.

Runs on CUDA; on CPU only under TRITON_INTERPRET=1 (slow, for tests). Shapes are checked here, once,
so the kernels can assume them; a bad argument raises ValueError naming the field and the limit.
"""

from __future__ import annotations

import torch
import triton

from attention import gluon_decode, gluon_decode_fp8  # Gluon (Triton's Hopper dialect): importable without it
from attention.backend import check_prefill_out
from attention.gluon_decode_plan import SEESAW, GluonDecodeConfig
from attention.kv_quant import FP8_DTYPE
from attention.triton_cache import gather_context, write_kv
from attention.triton_decode import DecodeConfig, mla_decode
from attention.triton_prefill import (PrefillConfig, merge_attn_states_, prefill_attention, prefill_attention_parts,
                                      split_width)
from common.launch_settings import sm_count

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CACHE_DTYPES = _FLOAT_DTYPES + (FP8_DTYPE,)


def _check(cond: bool, msg) -> None:
    """Raise ValueError(msg()) unless cond: the message is a callable, formatted only on failure
    (these checks run on every launch; an f-string of shapes costs ~1-2 us of host time each)."""
    if not cond:
        raise ValueError(msg())


def _check_cache(kv_cache: torch.Tensor) -> None:
    # A copy of the cache would be slow (decode) or silently drop the write (write_kv): refuse.
    _check(kv_cache.stride(-1) == 1, lambda: f"kv_cache must have a unit last stride, got {kv_cache.stride()}")


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Kernels index the last dim with unit stride; other strides are passed through."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _wgmma_decode(min_heads: int, *args, **kw):
    """The Gluon wgmma decode; its refusals (cache dtype, widths, heads, GPU) name the plan
    setting that sent the call there and the one that avoids it, and any failure (a compile
    error among them) is charged to that setting in the kernel plan's message; with the producer
    warpgroup (decode_wgmma_producer=1) or the seesaw schedule (decode_wgmma_seesaw=1) to that
    setting, whose 0 avoids the variant."""
    cfg = kw.get("cfg")
    variant = None if cfg is None else ("decode_wgmma_seesaw" if cfg.seesaw else
                                        "decode_wgmma_producer" if cfg.producer else None)
    key = variant or "decode_wgmma_min_heads"
    try:
        return gluon_decode.mla_decode_wgmma(*args, **kw)
    except (ValueError, RuntimeError) as e:
        avoid = f"{variant}=0 runs the kernel without it, " if variant else ""
        err = type(e)(f"{e} (--kernels ...,decode_wgmma_min_heads={min_heads} sent this decode of "
                      f"{args[0].shape[1]} heads there; {avoid}decode_wgmma_min_heads=0 avoids it)")
        err.plan_key = key
        raise err from e
    except Exception as e:
        e.plan_key = key
        raise


def _fp8_wgmma_decode(*args, **kw):
    """The Gluon FP8-cache decode (the plan's decode_fp8_wgmma); any failure names that setting and is
    charged to it in the kernel plan's message."""
    try:
        return gluon_decode_fp8.mla_decode_fp8_wgmma(*args, **kw)
    except (ValueError, RuntimeError) as e:
        err = type(e)(f"{e} (--kernels ...,decode_fp8_wgmma=1 sent this decode of {args[0].shape[1]} heads there; "
                      f"decode_fp8_wgmma=0 avoids it)")
        err.plan_key = "decode_fp8_wgmma"
        raise err from e
    except Exception as e:
        e.plan_key = "decode_fp8_wgmma"
        raise


class TritonAttentionOps:
    """`kv_scale`: the per-tensor scale of an FP8 cache (attention/kv_quant.py); unused otherwise.
    `wgmma_min_heads` (the plan's decode_wgmma_min_heads): decodes of at least this many query
    heads run on the Gluon wgmma kernel (attention/gluon_decode.py); 0: never. `qk_fp8` (the plan's
    decode_qk_fp8): over an FP8 cache the decode's QK^T runs on e4m3 operands (DecodeConfig.qk_fp8).
    `wgmma_producer` (the plan's decode_wgmma_producer): the Gluon decode with its producer warpgroup;
    `wgmma_seesaw` (decode_wgmma_seesaw): its seesaw schedule (attention/gluon_seesaw.py).
    `fp8_wgmma` (the plan's decode_fp8_wgmma): decodes over an FP8 cache of at least
    `fp8_wgmma_min_rows` query rows (decode_fp8_wgmma_min_rows; tokens x heads) run on the Gluon e4m3
    kernel (attention/gluon_decode_fp8.py), smaller ones on the Triton kernel."""

    name = "triton"

    def __init__(self, decode_config: DecodeConfig | None = None,
                 prefill_config: PrefillConfig | None = None, kv_scale: float = 1.0, wgmma_min_heads: int = 0,
                 qk_fp8: bool = False, wgmma_producer: bool = False, fp8_wgmma: bool = False,
                 fp8_wgmma_min_rows: int = 0, wgmma_seesaw: bool = False):
        self.kv_scale = kv_scale
        self.fp8_wgmma = fp8_wgmma
        self.fp8_wgmma_min_rows = fp8_wgmma_min_rows
        if wgmma_producer and wgmma_seesaw:
            raise ValueError("wgmma_producer and wgmma_seesaw are two schedules of the Gluon decode: set one")
        self.wgmma_cfg = SEESAW if wgmma_seesaw else GluonDecodeConfig(producer=True) if wgmma_producer else None
        self.qk_fp8 = qk_fp8
        self.decode_config = decode_config
        self.wgmma_min_heads = wgmma_min_heads
        self.prefill_config = prefill_config

    def write_kv(self, kv_cache, kv, slot_mapping):
        _check(kv_cache.dim() == 3, lambda: f"kv_cache must be [num_blocks, block_size, D], got {tuple(kv_cache.shape)}")
        _check(kv.dim() == 2 and kv.shape[1] == kv_cache.shape[2],
               lambda: f"kv must be [T, {kv_cache.shape[2]}], got {tuple(kv.shape)}")
        _check(slot_mapping.shape == (kv.shape[0],),
               lambda: f"slot_mapping must be [{kv.shape[0]}], got {tuple(slot_mapping.shape)}")
        _check(kv_cache.dtype in _CACHE_DTYPES, lambda: f"kv_cache must be fp16/bf16/fp32/fp8_e4m3, got {kv_cache.dtype}")
        _check_cache(kv_cache)
        write_kv(kv_cache, _last_contiguous(kv), slot_mapping.contiguous(), self.kv_scale)

    def decode(self, q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, q_len=1, q_pos=None,
               dcp_size=1, dcp_rank=0, unmerged_max_splits=0):
        """AttentionOps.decode; where the Triton kernel takes 2 to `unmerged_max_splits` splits its
        result is the splits' fp32 partials `[B*q_len, splits, H, Lkv]` and their lse
        `[B*q_len, splits, H]` (triton_decode `mla_decode`), for triton_absorb.absorb_o_merge. The
        Gluon kernels merge."""
        _check(q.dim() == 3, lambda: f"q must be [B*q_len, H, Lkv+R], got {tuple(q.shape)}")
        _check(kv_cache.dim() == 3 and kv_cache.shape[2] == q.shape[2],
               lambda: f"kv_cache must be [num_blocks, block_size, {q.shape[2]}], got {tuple(kv_cache.shape)}")
        _check(0 < kv_lora_rank < q.shape[2],
               lambda: f"kv_lora_rank must be in (0, {q.shape[2]}), got {kv_lora_rank}")
        _check(q.shape[2] - kv_lora_rank >= 16 and kv_lora_rank >= 16,
               lambda: f"kv_lora_rank {kv_lora_rank} and rope width {q.shape[2] - kv_lora_rank} must be >= 16")
        _check(q_len >= 1 and q.shape[0] % q_len == 0,
               lambda: f"q_len must be >= 1 and divide q's {q.shape[0]} rows, got {q_len}")
        _check(0 <= dcp_rank < dcp_size, lambda: f"dcp_rank must be in [0, {dcp_size}), got {dcp_rank}")
        B = q.shape[0] // q_len
        _check(block_table.dim() == 2 and block_table.shape[0] == B,
               lambda: f"block_table must be [{B}, max_blocks], got {tuple(block_table.shape)}")
        _check(seq_lens.shape == (B,), lambda: f"seq_lens must be [{B}], got {tuple(seq_lens.shape)}")
        _check(q_pos is None or q_pos.shape == (q.shape[0],),
               lambda: f"q_pos must be [{q.shape[0]}], got {None if q_pos is None else tuple(q_pos.shape)}")
        _check(q.dtype in _FLOAT_DTYPES and kv_cache.dtype in _CACHE_DTYPES,
               lambda: f"q must be fp16/bf16/fp32 and kv_cache that or fp8_e4m3, got {q.dtype}, {kv_cache.dtype}")
        _check_cache(kv_cache)
        args = (_last_contiguous(q), kv_cache, _last_contiguous(block_table), seq_lens.contiguous(), scale,
                kv_lora_rank)
        kw = dict(q_len=q_len, q_pos=None if q_pos is None else q_pos.contiguous(), dcp_size=dcp_size,
                  dcp_rank=dcp_rank, num_sms=sm_count(q.device) if q.is_cuda else 1)
        if self.wgmma_min_heads and q.shape[1] >= self.wgmma_min_heads:
            return _wgmma_decode(self.wgmma_min_heads, *args, **kw, cfg=self.wgmma_cfg)
        if self.fp8_wgmma and kv_cache.dtype == FP8_DTYPE and q.shape[0] * q.shape[1] >= self.fp8_wgmma_min_rows:
            return _fp8_wgmma_decode(*args, **kw, kv_scale=self.kv_scale)
        return mla_decode(*args, **kw, cfg=self.decode_config, kv_scale=self.kv_scale, qk_fp8=self.qk_fp8,
                          unmerged_max_splits=unmerged_max_splits)

    def prefill(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal):
        _check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3,
               lambda: f"q, k, v must be [T, H, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
        _check(k.shape[1:] == q.shape[1:], lambda: f"k must be [Tk, {q.shape[1]}, {q.shape[2]}], got {tuple(k.shape)}")
        _check(v.shape[:2] == k.shape[:2], lambda: f"v must be [{k.shape[0]}, {k.shape[1]}, V], got {tuple(v.shape)}")
        _check(q.shape[2] >= 16 and v.shape[2] >= 16,
               lambda: f"head widths must be >= 16, got qk {q.shape[2]}, v {v.shape[2]}")
        _check(q.dtype in _FLOAT_DTYPES and k.dtype == q.dtype and v.dtype == q.dtype,
               lambda: f"q, k, v must share one of fp16/bf16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}")
        _check(cu_seqlens_q.dim() == 1 and cu_seqlens_q.shape == cu_seqlens_k.shape,
               lambda: f"cu_seqlens_q and cu_seqlens_k must be [B+1], got {tuple(cu_seqlens_q.shape)}, "
               f"{tuple(cu_seqlens_k.shape)}")
        _check(max_seqlen_q >= 0, lambda: f"max_seqlen_q must be >= 0, got {max_seqlen_q}")
        return prefill_attention(_last_contiguous(q), _last_contiguous(k), _last_contiguous(v),
                                 cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(),
                                 max_seqlen_q, scale, causal, cfg=self.prefill_config)

    def prefill_mla(self, q_nope, q_pe, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, scale, causal, out=None):
        P, R = q_nope.shape[-1], q_pe.shape[-1]
        H = q_nope.shape[1]
        _check(k_nope.shape[1:] == q_nope.shape[1:] and k_pe.dim() == 2 and k_pe.shape[1] == R
               and q_pe.shape[:2] == q_nope.shape[:2] and k_pe.shape[0] == k_nope.shape[0],
               lambda: f"MLA prefill parts do not fit: q_nope {tuple(q_nope.shape)}, q_pe {tuple(q_pe.shape)}, "
               f"k_nope {tuple(k_nope.shape)}, k_pe {tuple(k_pe.shape)}")
        if split_width(P + R) != (P, triton.next_power_of_2(R)):
            # the kernel's two QK parts are not (P, R) for this width: join the operands
            q = torch.cat([q_nope, q_pe], dim=-1)
            k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, H, -1)], dim=-1)
            o, lse = self.prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal)
            if out is None:
                return o, lse
            check_prefill_out(out, o.shape, o.dtype)
            return out.copy_(o), lse
        _check(q_nope.dtype in _FLOAT_DTYPES and all(t.dtype == q_nope.dtype for t in (q_pe, k_nope, k_pe, v)),
               lambda: f"MLA prefill operands must share one of fp16/bf16/fp32, got {q_nope.dtype}, {q_pe.dtype}, "
               f"{k_nope.dtype}, {k_pe.dtype}, {v.dtype}")
        _check(v.shape[:2] == k_nope.shape[:2] and v.shape[2] >= 16,
               lambda: f"v must be [{k_nope.shape[0]}, {H}, V >= 16], got {tuple(v.shape)}")
        _check(cu_seqlens_q.dim() == 1 and cu_seqlens_q.shape == cu_seqlens_k.shape,
               lambda: f"cu_seqlens_q and cu_seqlens_k must be [B+1], got {tuple(cu_seqlens_q.shape)}, "
               f"{tuple(cu_seqlens_k.shape)}")
        kb = _last_contiguous(k_pe).unsqueeze(1).expand(-1, H, -1)  # head stride 0: one row for all heads
        return prefill_attention_parts(_last_contiguous(q_nope), _last_contiguous(q_pe), _last_contiguous(k_nope),
                                       kb, _last_contiguous(v), cu_seqlens_q.contiguous(),
                                       cu_seqlens_k.contiguous(), max_seqlen_q, scale, causal,
                                       cfg=self.prefill_config, out=out)

    def merge_attn_states_(self, o, lse, o_b, lse_b):
        merge_attn_states_(o, lse, o_b, lse_b)

    def gather_context(self, kv_cache, block_table, starts, cu_lens, num_tokens, dtype=None):
        _check(kv_cache.dim() == 3, lambda: f"kv_cache must be [num_blocks, block_size, D], got {tuple(kv_cache.shape)}")
        B = starts.shape[0]
        _check(block_table.dim() == 2 and block_table.shape[0] >= B,
               lambda: f"block_table must have >= {B} rows, got {tuple(block_table.shape)}")
        _check(cu_lens.shape == (B + 1,), lambda: f"cu_lens must be [{B + 1}], got {tuple(cu_lens.shape)}")
        _check(num_tokens >= 0, lambda: f"num_tokens must be >= 0, got {num_tokens}")
        _check_cache(kv_cache)
        _check(kv_cache.dtype in _CACHE_DTYPES, lambda: f"kv_cache must be fp16/bf16/fp32/fp8_e4m3, got {kv_cache.dtype}")
        return gather_context(kv_cache, _last_contiguous(block_table),
                              starts.contiguous(), cu_lens.contiguous(), num_tokens, dtype, self.kv_scale)
