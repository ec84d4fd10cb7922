"""The MLA decode kernel's tiles (`DecodeConfig`), their defaults per regime, and the split count
per sequence (attention/triton_decode.py runs them; the measurements behind the defaults are in
docs/kernel_notes.md). No Triton here: the choices are plain host-side functions.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from attention.kv_quant import is_fp8

# lazy_rescale: the running max used for p = 2^(s - m) is kept until some row's max grows past it
# by more than this (log2 domain), so p <= 2^LAZY_TAU = 256: far below fp16's overflow, and the fp32
# accumulator and row sums have ample range. Only then are the accumulator and sums rescaled.
LAZY_TAU = 8.0


@dataclass(frozen=True)
class DecodeConfig:
    block_h: int = 16        # query heads per program (>= 16: tl.dot needs M >= 16)
    block_n: int = 32        # cache rows per inner step
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 1  # resident stage-1 programs per SM, for the split heuristic
    min_split_tokens: int = 64   # fewer rows per split and the fp32 partials cost more than they save
    max_splits: int = 128
    fill_first: bool = False  # choose_num_splits: up to one program a SM, split so that each SM gets one
    qk_t: bool = False       # compute scores transposed (tokens as MMA rows)
    maxnreg: int | None = None  # register cap per thread, to fit more programs per SM
    prefetch_ids: bool = False  # load the next tile's block ids before this tile's math
    warp_specialize: bool = False  # Triton's warp-specialised loop (producer warps for the loads)
    reload_v: bool = False  # FP8 cache: load each tile twice (QK^T and PV), see the kernel
    stage_v: bool = False  # with reload_v on CUDA: PV's tile converted to fp16 before shared memory
    stage_c: bool = False  # FP8 cache on CUDA: one load, one conversion, the fp16 tile feeds both products
    lazy_rescale: bool = False  # rescale the accumulator only when a row's max grows by > 2^LAZY_TAU
    qk_fp8: bool = False  # FP8 cache: QK^T on e4m3 tensor cores, q rounded to e4m3 per row (kernel_notes)


WIDE_ROWS = 64  # query rows (heads x query tokens) per sequence from which 64-row tiles are used


def default_decode_config(num_rows: int, dtype: torch.dtype, smem_bytes: int | None = None,
                          cache_dtype: torch.dtype | None = None) -> DecodeConfig:
    """The decode kernel's tiles for `num_rows` = heads x q_len query rows per sequence, products
    in `dtype` over a cache of `cache_dtype` (default: the same).

    Two regimes (H200 sweeps, docs/kernel_notes.md): below WIDE_ROWS the kernel is bound by the
    cache's bytes and 16-row tiles (ids prefetched, 3 stages, 2 programs per SM) stream it at
    ~90% of copy; from WIDE_ROWS on (V3/R1 at -tp 1, DCP's gathered heads, multi-token decode)
    it is bound by the tensor cores: 64-row tiles, QK^T [64 x 576] x [576 x 64] and PV
    [64 x 64] x [64 x 512] per step. The 64x64 tile with 2 stages needs ~221 KB of shared memory
    per block (Hopper has 227 KB); with less (`smem_bytes`, the current CUDA device's opt-in limit
    when not given), 64-row tiles stay 32 rows deep.
    """
    if dtype == torch.float32:  # fp32 tiles are twice the bytes: keep shared memory in bounds
        return DecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=2, min_split_tokens=256)
    if num_rows >= WIDE_ROWS:
        if smem_bytes is None:
            smem_bytes = _device_smem_bytes()
        deep = smem_bytes is None or smem_bytes >= 224 * 1024
        return DecodeConfig(block_h=64, block_n=64 if deep else 32, num_warps=8, num_stages=2)
    if cache_dtype is not None and is_fp8(cache_dtype):
        # each tile loaded twice (reload_v: the only form Triton pipelines here), 2 stages: at
        # B = 128 on the H200 (bench_mla_decode.py --sweep) 721.9 us at S = 16k and 194.2 at 4k,
        # against 749.7 / 196.5 with PV's tile converted before shared memory (stage_v), 806-812 /
        # 210-213 with one load and one conversion (stage_c), 911.6 / 238.4 loaded once
        return DecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=2, programs_per_sm=2,
                            prefetch_ids=True, reload_v=True, fill_first=True)
    return DecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=3, programs_per_sm=2, prefetch_ids=True,
                        fill_first=True)


@functools.lru_cache(maxsize=None)
def _device_smem_bytes() -> int | None:
    """Opt-in shared memory per block of the current CUDA device (None without CUDA or the field)."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return getattr(props, "shared_memory_per_block_optin", None)


@functools.lru_cache(maxsize=1024)  # pure; called once per decode step
def choose_num_splits(batch: int, head_tiles: int, max_len: int, num_sms: int,
                      cfg: DecodeConfig) -> int:
    """Splits per sequence so that batch * head_tiles * splits fills the GPU in whole waves.

    `max_len` is an upper bound (the block table's width), so it costs no host sync.

    Up to one program a SM (with `cfg.fill_first`, which the narrow-row tiles of
    `default_decode_config` set, the ones timed): as many splits as give each SM one program
    (at most `limit`). Two programs a SM, each split half as long, were slower at every batch of
    8-128 sequences and context of 1k-16k (H100, 16 heads, bench_decode_splits.py --table-pages,
    µs, one program a SM against the wave model over `programs_per_sm` = 2): B 8 / 32 / 64 at 1k
    12.3 / 22.4 / 36.7 against 14.6 / 25.3 / 39.9, at 4k 23.0 / 61.9 / 111.9 against 25.9 / 65.6 /
    115.0, B 8 / 32 at 16k 62.4 / 210.1 against 67.1 / 213.9; B 128 (one split either way now)
    58.0 against 65.1 at 1k. Over an FP8 cache (the same kernel) B 8 at 1k took 12.8 with 16
    splits against 14.8 with 33, level at B 1 / 4 / 16.

    Past one program a SM, FlashAttention-2's wave model: the wave efficiency of s splits is
    n / ceil(n) with n = programs * s / slots (slots = SMs x programs_per_sm); take the fewest
    splits within 85% of the best.

    From 70% of the slots on, one split: the wave model then asks for 3-5 splits, each adding
    its per-program work and partials, for a last wave that is only a fifth short. H200, 16
    heads, 1050-token contexts (bench_decode_splits.py, µs per call): batch 200 / 211 took 78.8
    / 79.0 with one split against 93.5 / 98.7 with the model's 5, and
    batch 160 (61% of the slots) keeps its 3 splits (70.3 against 78.1 with one).
    """
    programs = batch * head_tiles
    slots = num_sms * cfg.programs_per_sm
    if programs == 0 or programs >= 0.7 * slots or max_len <= cfg.min_split_tokens:
        return 1
    limit = max(1, min(cfg.max_splits, max_len // cfg.min_split_tokens))
    if cfg.fill_first and programs <= num_sms:
        return max(1, min(limit, num_sms // programs))
    effs = []
    for s in range(1, limit + 1):
        waves = programs * s / slots
        effs.append(waves / math.ceil(waves))
    best = max(effs)
    return next(s for s, e in enumerate(effs, start=1) if e >= 0.85 * best)


def check_paged_decode_args(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                            seq_lens: torch.Tensor, kv_lora_rank: int, rope_dim: int, q_len: int,
                            q_pos: torch.Tensor | None, rows_multiple: int, aligned: tuple = ("kv_cache",)) -> None:
    """The shape, layout and alignment checks the Gluon decodes share (each a ValueError naming the
    argument and the limit): q `[B*q_len, H, kv_lora_rank + rope_dim]`, a paged cache of the same
    width with a power-of-two page, q_len * H a multiple of `rows_multiple`, seq_lens and an int32
    block table per sequence, unit last strides, q_pos per query row, and the tensors named in
    `aligned` 16-byte aligned with 16-element first strides (cp.async moves 16 bytes a thread;
    Triton proves the alignment only from arguments divisible by 16)."""
    width = kv_lora_rank + rope_dim
    if q.dim() != 3:
        raise ValueError(f"q must be [B*q_len, H, {width}], got shape {tuple(q.shape)}")
    T, H, D = q.shape
    if D != width:
        raise ValueError(f"kv_lora_rank must be {kv_lora_rank} and q's last dim {width} (got {kv_lora_rank}, {D})")
    if kv_cache.dim() != 3 or kv_cache.shape[2] != width:
        raise ValueError(f"kv_cache must be [num_blocks, page, {width}], got {tuple(kv_cache.shape)}")
    page = kv_cache.shape[1]
    if page < 1 or page & (page - 1):
        raise ValueError(f"the cache page size must be a power of two, got {page}")
    if q_len < 1 or T % q_len:
        raise ValueError(f"q_len must be >= 1 and divide q's {T} rows, got {q_len}")
    if (q_len * H) % rows_multiple:
        raise ValueError(f"q_len * heads must be a multiple of {rows_multiple}, got {q_len} * {H}")
    B = T // q_len
    if seq_lens.shape != (B,) or block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"seq_lens must be [{B}] and block_table [{B}, width], got "
                         f"{tuple(seq_lens.shape)} and {tuple(block_table.shape)}")
    if block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be int32, got {block_table.dtype}")
    if q.stride(2) != 1 or kv_cache.stride(2) != 1 or block_table.stride(1) != 1:
        raise ValueError("q, kv_cache and block_table must be contiguous in their last dim")
    for name, t in (("q", q), ("kv_cache", kv_cache)):
        if name in aligned and (t.data_ptr() % 16 or any(st % 16 for st in t.stride()[:2])):
            raise ValueError(f"{name} must be 16-byte aligned with its first two strides multiples of "
                             f"16 elements (got strides {t.stride()}, address % 16 = {t.data_ptr() % 16})")
    if q_pos is not None and q_pos.shape != (T,):
        raise ValueError(f"q_pos must be [{T}], got {tuple(q_pos.shape)}")
