"""Triton attention ops vs the torch reference (attention/torch_backend.py).

CPU: `CPU_CASES` run under TRITON_INTERPRET=1 (tests/interpreted/test_attention_kernels.py); the
interpreter's bf16 dot is wrong, so CPU cases use fp32/fp16. GPU (`-m gpu`, skipped without CUDA):
real shapes (Lkv+R = 576, QK 192 / V 128), bf16/fp16/fp32. scripts/bench_mla_decode.py --check runs
the same GPU cases.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest

import torch

from attention.torch_backend import TorchAttentionOps, merge_attn_states

# Relative-error limits vs an fp32 reference (fp32 kernels use the "ieee" dot).
TOL = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 1e-2}


def last_positions(lens, q_len, dcp, device):
    """Query positions [B * q_len] int32: the last q_len global positions of each sequence, whose
    local length on DCP rank `rank` of D (dcp = (D, rank)) is n (a rank holds a share)."""
    D, rank = dcp
    glob = [max(q_len, n * D + rank) for n in lens]
    return torch.tensor([g - q_len + t for g in glob for t in range(q_len)], dtype=torch.int32, device=device)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in fp64; NaN anywhere gives inf."""
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def poison_allocator(device: str, nbytes: int = 1 << 28) -> None:
    """Fill freed allocator memory with NaN so outputs the kernel never writes show up as NaN."""
    if device == "cuda":  # large and small pools; the list is dropped at once, its blocks cached for reuse
        [torch.full((n // 4,), float("nan"), device=device)
         for n in [nbytes] + [1 << 12] * 16 + [1 << 16] * 16 + [1 << 19] * 8]


@contextlib.contextmanager
def poisoned(device: str):
    """Outputs the kernels never write read as NaN: on CUDA the allocator's freed memory is
    NaN-filled first; on the CPU torch fills new tensors itself meanwhile (NaN, integers at their
    maximum: `torch.utils.deterministic.fill_uninitialized_memory`, on with deterministic
    algorithms). The decode's partial rows of splits past a sequence's end are deliberately never
    written: a read of them would show."""
    poison_allocator(device)
    if device != "cpu":
        yield
        return
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def check_lse(lse: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """LSE: -inf exactly where the reference has -inf, close elsewhere; no NaN."""
    assert not torch.isnan(lse).any(), f"{what}: NaN in lse"
    empty = torch.isinf(ref)
    assert torch.equal(torch.isinf(lse), empty), f"{what}: -inf lse pattern differs"
    if (~empty).any():
        d = (lse[~empty] - ref[~empty]).abs().max().item()
        assert d < 2e-2, f"{what}: lse max abs diff {d}"


def paged_cache(lens, page, d, dtype, device, gen, extra_blocks=3):
    """Cache [NB, page, d] and a block table whose rows are shuffled, disjoint block ids."""
    per_seq = max([1] + [-(-n // page) for n in lens])
    nb = per_seq * len(lens) + extra_blocks
    cache = torch.randn(nb, page, d, generator=gen).to(dtype).to(device)
    ids = torch.randperm(nb, generator=gen)[: per_seq * len(lens)]
    return cache, ids.view(len(lens), per_seq).to(torch.int32).to(device)


def check_decode(device, dtype, H, lkv, r, page, lens, num_splits=None, seed=0, ops=None, cfg=None, ramp=0.0):
    """Triton decode vs reference on random data; returns (o rel err, splits used). `ramp` > 0
    scales each sequence's cache rows by 1 + ramp * position / length, so that the scores' max
    keeps growing along the scan (the running max is raised many times, by large steps)."""
    from attention.triton_backend import TritonAttentionOps
    from attention.triton_decode import mla_decode
    gen = torch.Generator().manual_seed(seed)
    B = len(lens)
    cache, bt = paged_cache(lens, page, lkv + r, dtype, "cpu", gen)
    if ramp:
        grow = torch.ones(cache.shape[:2])
        for b, n in enumerate(lens):
            pos = torch.arange(n)
            grow[bt[b, pos // page].long(), pos % page] = 1 + ramp * pos / max(n, 1)
        cache = (cache.float() * grow[..., None]).to(dtype)
    cache, bt = cache.to(device), bt.to(device)
    q = torch.randn(B, H, lkv + r, generator=gen).to(dtype).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    scale = (lkv + r) ** -0.5 * 3.0  # sharper than 1/sqrt(d): exercises the max tracking
    with poisoned(device):
        if num_splits is None and cfg is None:
            o, lse = (ops or TritonAttentionOps()).decode(q, cache, bt, seq_lens, scale, lkv)
        else:
            o, lse = mla_decode(q, cache, bt, seq_lens, scale, lkv, num_splits=num_splits, cfg=cfg)
    ref_o, ref_lse = TorchAttentionOps().decode(q.float(), cache.float(), bt, seq_lens, scale, lkv)
    assert o.shape == (B, H, lkv) and o.dtype == dtype and lse.dtype == torch.float32
    check_lse(lse, ref_lse, "decode")
    zero = seq_lens == 0
    assert not zero.any() or (o[zero] == 0).all(), "decode: zero-length rows must be 0"
    err = rel_err(o, ref_o)
    assert err <= TOL[dtype], f"decode rel err {err} > {TOL[dtype]} ({dtype}, H={H}, page={page})"
    return err


def check_prefill(device, dtype, H, d_qk, d_v, lens_qk, causal, seed=0, cfg=None):
    """Triton varlen prefill vs reference; lens_qk = [(Lq, Lk), ...]."""
    from attention.triton_prefill import prefill_attention
    gen = torch.Generator().manual_seed(seed)
    cq = torch.tensor([0] + [a for a, _ in lens_qk]).cumsum(0)
    ck = torch.tensor([0] + [b for _, b in lens_qk]).cumsum(0)
    tq, tk = int(cq[-1]), int(ck[-1])
    q = torch.randn(tq, H, d_qk, generator=gen).to(dtype).to(device)
    k = torch.randn(tk, H, d_qk, generator=gen).to(dtype).to(device)
    v = torch.randn(tk, H, d_v, generator=gen).to(dtype).to(device)
    cq, ck = cq.to(torch.int32).to(device), ck.to(torch.int32).to(device)
    max_q = max([0] + [a for a, _ in lens_qk])
    max_k = max([0] + [b for _, b in lens_qk])
    scale = d_qk ** -0.5
    poison_allocator(device)
    o, lse = prefill_attention(q, k, v, cq, ck, max_q, scale, causal, cfg=cfg)
    ref_o, ref_lse = TorchAttentionOps().prefill(q.float(), k.float(), v.float(), cq, ck, max_q, max_k,
                                                 scale, causal)
    assert o.shape == (tq, H, d_v) and o.dtype == dtype
    check_lse(lse, ref_lse, "prefill")
    empty = torch.isinf(ref_lse)
    assert not empty.any() or (o[empty] == 0).all(), "prefill: rows without keys must be 0"
    err = rel_err(o, ref_o)
    assert err <= TOL[dtype], f"prefill rel err {err} > {TOL[dtype]} ({dtype}, causal={causal})"
    return err


def check_prefill_mla(device, dtype, H, P, R, d_v, lens_qk, causal, seed=0, cfg=None, into_out=False):
    """MLA's parts (q_nope / q_pe, k_nope and v as views of one up-projection, k_pe shared by the
    heads) through the Triton backend equal the joined operands through the torch reference;
    `into_out`: written into rows 3.. of a larger NaN-filled buffer, the rows around untouched."""
    from attention.triton_backend import TritonAttentionOps
    gen = torch.Generator().manual_seed(seed)
    cq = torch.tensor([0] + [a for a, _ in lens_qk]).cumsum(0)
    ck = torch.tensor([0] + [b for _, b in lens_qk]).cumsum(0)
    tq, tk = int(cq[-1]), int(ck[-1])
    q = torch.randn(tq, H, P + R, generator=gen).to(dtype).to(device)
    kv = torch.randn(tk, H, P + d_v, generator=gen).to(dtype).to(device)  # kv_b_proj's output layout
    kv_row = torch.randn(tk, 8 + R, generator=gen).to(dtype).to(device)  # [c ‖ k_pe], k_pe a view
    k_nope, v = kv.split([P, d_v], dim=-1)
    k_pe = kv_row[:, 8:]
    cq, ck = cq.to(torch.int32).to(device), ck.to(torch.int32).to(device)
    max_q = max([0] + [a for a, _ in lens_qk])
    max_k = max([0] + [b for _, b in lens_qk])
    scale = (P + R) ** -0.5
    poison_allocator(device)
    ops = TritonAttentionOps(prefill_config=cfg)
    buf = out = None
    if into_out:
        buf = torch.full((tq + 5, H, d_v), float("nan"), dtype=dtype, device=device)
        out = buf[3:3 + tq]
    o, lse = ops.prefill_mla(q[..., :P], q[..., P:], k_nope, k_pe, v, cq, ck, max_q, max_k, scale, causal,
                             out=out)
    if into_out:
        assert o.data_ptr() == out.data_ptr(), "prefill_mla must return the out it was given"
        assert buf[:3].isnan().all() and buf[3 + tq:].isnan().all(), "prefill_mla wrote outside out"
    k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, H, -1)], dim=-1)
    ref_o, ref_lse = TorchAttentionOps().prefill(q.float(), k.float(), v.float(), cq, ck, max_q, max_k,
                                                 scale, causal)
    assert o.shape == (tq, H, d_v) and o.dtype == dtype
    check_lse(lse, ref_lse, "prefill_mla")
    err = rel_err(o, ref_o)
    assert err <= TOL[dtype], f"prefill_mla rel err {err} > {TOL[dtype]} ({dtype}, causal={causal})"
    return err


def check_write_kv(device, dtype, src_dtype, page, d, n_tokens, seed=0):
    """Written slots match the reference bit for bit; every other slot keeps its NaN poison."""
    from attention.triton_backend import TritonAttentionOps
    gen = torch.Generator().manual_seed(seed)
    nb = -(-n_tokens // page) + 2
    kv = torch.randn(n_tokens, d, generator=gen).to(src_dtype).to(device)
    slots = torch.randperm(nb * page, generator=gen)[:n_tokens]
    slots[torch.rand(n_tokens, generator=gen) < 0.25] = -1
    slots = slots.to(device)
    cache = torch.full((nb, page, d), float("nan"), dtype=dtype, device=device)
    ref = cache.clone()
    TritonAttentionOps().write_kv(cache, kv, slots)
    TorchAttentionOps().write_kv(ref, kv, slots)
    assert torch.equal(cache.isnan(), ref.isnan()), "write_kv: wrong set of slots written"
    assert torch.equal(cache.nan_to_num(0.0), ref.nan_to_num(0.0)), "write_kv: values differ"
    return 0.0


def check_gather(device, dtype, page, d, lens, starts, seed=0):
    """Gathered rows equal the reference's bit for bit (and none is left unwritten)."""
    from attention.triton_backend import TritonAttentionOps
    gen = torch.Generator().manual_seed(seed)
    cache, bt = paged_cache([s + n for s, n in zip(starts, lens)], page, d, dtype, device, gen)
    cu = torch.tensor([0] + list(lens)).cumsum(0).to(torch.int32).to(device)
    st = torch.tensor(starts, dtype=torch.int32, device=device)
    n = int(cu[-1])
    poison_allocator(device)
    out = TritonAttentionOps().gather_context(cache, bt, st, cu, n)
    ref = TorchAttentionOps().gather_context(cache, bt, st, cu, n)
    assert out.shape == (n, d) and torch.equal(out, ref), "gather_context differs"
    return 0.0


def check_merge(device, dtype, T, H, V, seed=0):
    """In-place merge of two partial attentions equals the torch reference's, including rows where
    one side or both saw no key (lse -inf), on a strided view (rows of a larger output)."""
    from attention.triton_backend import TritonAttentionOps
    gen = torch.Generator().manual_seed(seed)
    o_full = torch.randn(T + 3, H, V, generator=gen).to(dtype).to(device)
    lse_full = (torch.randn(T + 3, H, generator=gen) * 4).to(device)
    o_b = torch.randn(T, H, V, generator=gen).to(dtype).to(device)
    lse_b = (torch.randn(T, H, generator=gen) * 4).to(device)
    pick = torch.rand(T, H, generator=gen).to(device)
    lse_full[:T][pick < 0.2] = float("-inf")  # a side without keys has o = 0
    o_full[:T][pick < 0.2] = 0
    lse_b[(pick >= 0.1) & (pick < 0.3)] = float("-inf")  # 0.1-0.2: neither side
    o_b[(pick >= 0.1) & (pick < 0.3)] = 0
    ref_o, ref_lse = merge_attn_states(o_full[:T].float(), lse_full[:T], o_b.float(), lse_b)
    tail_o, tail_lse = o_full[T:].clone(), lse_full[T:].clone()
    TritonAttentionOps().merge_attn_states_(o_full[:T], lse_full[:T], o_b, lse_b)
    check_lse(lse_full[:T], ref_lse, "merge")
    assert torch.equal(o_full[T:], tail_o) and torch.equal(lse_full[T:], tail_lse), "merge wrote past its rows"
    both = torch.isinf(ref_lse)
    assert (o_full[:T][both] == 0).all(), "merge: rows without keys must be 0"
    err = rel_err(o_full[:T], ref_o)
    assert err <= TOL[dtype], f"merge rel err {err} > {TOL[dtype]} ({dtype})"
    return err


f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
# Tiny CPU cases: shuffled block tables, pages that do not divide lengths, lengths 0 and 1.
CPU_CASES = {
    "decode_page4_splits1": lambda: check_decode("cpu", f32, 4, 32, 16, 4, [0, 1, 37, 70], num_splits=1),
    "decode_page4_splits3": lambda: check_decode("cpu", f32, 4, 32, 16, 4, [0, 1, 37, 70], num_splits=3),
    "decode_page16_2tiles_fp16": lambda: check_decode("cpu", f16, 20, 32, 16, 16, [5, 0, 33], num_splits=2),
    "decode_page64_more_splits_than_rows": lambda: check_decode("cpu", f32, 16, 32, 16, 64, [3, 90], num_splits=8),
    # 17 splits: two reduce chunks (the second holds one split), empty splits for the short rows.
    "decode_17_splits": lambda: check_decode("cpu", f32, 4, 32, 16, 4, [0, 5, 544], num_splits=17),
    # 40 splits of a 128-wide latent: the reduce spreads the columns over two programs per row
    "decode_40_splits_two_column_blocks": lambda: check_decode("cpu", f32, 4, 128, 16, 4, [0, 5, 300],
                                                               num_splits=40),
    "decode_prefetch_ids": lambda: check_decode("cpu", f32, 4, 32, 16, 4, [0, 1, 37, 150], num_splits=2,
                                                cfg=_prefetch_cfg(16)),
    # The bf16 defaults' tiles (prefetched ids, 64-row tiles), run here on fp32 data.
    "decode_default_tiles_h16": lambda: check_decode("cpu", f32, 4, 32, 16, 16, [0, 1, 37, 150],
                                                     cfg=_default_cfg(4)),
    "decode_default_tiles_h64": lambda: check_decode("cpu", f32, 64, 32, 16, 16, [0, 1, 37, 150], num_splits=3,
                                                     cfg=_default_cfg(64)),
    "decode_ops_auto_splits": lambda: check_decode("cpu", f32, 8, 32, 16, 16, [17, 0, 1]),
    # pages holding whole tiles (one block id per tile), with and without the id prefetch
    "decode_one_page_tiles_prefetch": lambda: check_decode("cpu", f32, 4, 32, 16, 32, [0, 1, 37, 150, 64],
                                                           num_splits=3, cfg=_small_cfg(prefetch_ids=True)),
    "decode_one_page_tiles": lambda: check_decode("cpu", f32, 4, 32, 16, 16, [0, 1, 37, 150, 64], num_splits=2,
                                                  cfg=_small_cfg()),
    # lazy rescaling: scores whose max grows along the scan, and plain random ones
    "decode_lazy_rescale_ramp_fp16": lambda: check_decode("cpu", f16, 4, 32, 16, 4, [0, 1, 37, 150], num_splits=2,
                                                     cfg=_small_cfg(lazy_rescale=True), ramp=6.0),
    "decode_lazy_rescale_one_split": lambda: check_decode("cpu", f32, 4, 32, 16, 4, [0, 1, 37, 150], num_splits=1,
                                                          cfg=_small_cfg(lazy_rescale=True), seed=3),
    "decode_eager_rescale_ramp_fp16": lambda: check_decode("cpu", f16, 4, 32, 16, 4, [0, 1, 37, 150], num_splits=2,
                                                      cfg=_small_cfg(), ramp=6.0),
    "prefill_causal": lambda: check_prefill("cpu", f32, 2, 48, 32, [(3, 3), (0, 4), (5, 9), (1, 1), (7, 4)],
                                            True, cfg=_small_prefill()),
    "prefill_noncausal_empty_keys": lambda: check_prefill("cpu", f32, 2, 48, 32, [(3, 0), (6, 20), (2, 5)],
                                                          False, cfg=_small_prefill()),
    "prefill_causal_pow2_width_fp16": lambda: check_prefill("cpu", f16, 1, 32, 16, [(20, 20), (4, 33)],
                                                            True, cfg=_small_prefill()),
    # Every causal shift Lk - Lq in 0..33 against 16-wide tiles: tile-boundary off-by-ones show up.
    "prefill_causal_all_shifts": lambda: check_prefill("cpu", f32, 1, 48, 16, [(17, 17 + s) for s in range(34)],
                                                       True, cfg=_small_prefill()),
    # heavy tiles first (reverse_m): the same masks from the other end of the grid
    "prefill_causal_all_shifts_reversed": lambda: check_prefill(
        "cpu", f32, 1, 48, 16, [(17, 17 + s) for s in range(0, 34, 3)] + [(40, 5), (3, 3)], True,
        cfg=_small_prefill(reverse_m=True)),
    "prefill_mla_parts_causal": lambda: check_prefill_mla("cpu", f32, 2, 32, 16, 16, [(3, 3), (0, 4), (5, 9), (7, 4)],
                                                      True, cfg=_small_prefill()),
    "prefill_mla_parts_into_out": lambda: check_prefill_mla("cpu", f32, 2, 32, 16, 16, [(3, 3), (5, 9)],
                                                        True, cfg=_small_prefill(), into_out=True),
    "prefill_mla_joined_widths_into_out": lambda: check_prefill_mla("cpu", f32, 2, 24, 24, 16, [(5, 9)], True,
                                                                cfg=_small_prefill(), into_out=True),
    "prefill_mla_parts_noncausal": lambda: check_prefill_mla("cpu", f32, 2, 32, 16, 16, [(3, 0), (6, 20)],
                                                         False, cfg=_small_prefill()),
    # widths whose kernel split is not (P, R) (48 = 32 + 16 with P 24): the backend joins them
    "prefill_mla_joined_widths": lambda: check_prefill_mla("cpu", f32, 2, 24, 24, 16, [(5, 9), (2, 2)],
                                                       True, cfg=_small_prefill()),
    "prefill_default_tiles": lambda: check_prefill("cpu", f32, 1, 48, 32, [(9, 12), (0, 0)], True),
    "write_kv_fp32_to_fp16": lambda: check_write_kv("cpu", f16, f32, 4, 48, 21),
    "write_kv_page16": lambda: check_write_kv("cpu", f32, f32, 16, 48, 40),
    "merge_states_f32": lambda: check_merge("cpu", f32, 37, 5, 24),
    "merge_states_f16_one_head": lambda: check_merge("cpu", f16, 9, 1, 16, seed=1),
    "gather_page4": lambda: check_gather("cpu", f32, 4, 48, [5, 0, 9, 1], [0, 3, 6, 0]),
    "gather_page16": lambda: check_gather("cpu", f32, 16, 48, [17, 40], [15, 0]),
}


def _small_cfg(**kw):
    from attention.triton_decode import DecodeConfig
    return DecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, **kw)


def _prefetch_cfg(block_h):
    from attention.triton_decode import DecodeConfig
    return DecodeConfig(block_h=block_h, block_n=32, num_warps=4 if block_h == 16 else 8, num_stages=3,
                        prefetch_ids=True)


def _default_cfg(num_heads):
    from attention.triton_decode import default_decode_config
    return default_decode_config(num_heads, torch.bfloat16, smem_bytes=227 * 1024)


def _default_prefill():
    from attention.triton_prefill import default_prefill_config
    return default_prefill_config(torch.bfloat16)


def _small_prefill(reverse_m=False):
    from attention.triton_prefill import PrefillConfig
    return PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, reverse_m=reverse_m)


# Real shapes. Decode lengths span 1..16k with a 0 in each batch.
GPU_CASES = {}
for _h in (16, 128):
    for _page in (16, 64):
        GPU_CASES[f"decode_bf16_H{_h}_page{_page}"] = (
            lambda h=_h, p=_page: check_decode("cuda", bf16, h, 512, 64, p, [1, 0, 777, 4096, 16384, 3000]))
GPU_CASES["decode_fp32_H16_page64"] = lambda: check_decode("cuda", f32, 16, 512, 64, 64, [1, 0, 1000, 5000])
GPU_CASES["decode_bf16_H128_forced_splits7"] = (
    lambda: check_decode("cuda", bf16, 128, 512, 64, 16, [0, 100, 2049], num_splits=7))
GPU_CASES["decode_bf16_H16_batch64"] = (
    lambda: check_decode("cuda", bf16, 16, 512, 64, 64, [(37 * i) % 4000 for i in range(64)]))
for _h in (16, 128):
    GPU_CASES[f"decode_bf16_H{_h}_prefetch_ids"] = (
        lambda h=_h: check_decode("cuda", bf16, h, 512, 64, 16, [1, 0, 777, 4096, 16384, 3000], num_splits=5,
                                  cfg=_prefetch_cfg(16 if h == 16 else 64)))
    GPU_CASES[f"decode_bf16_H{_h}_lazy_rescale"] = (
        lambda h=_h: check_decode("cuda", bf16, h, 512, 64, 16, [1, 0, 777, 4096, 16384, 3000], num_splits=5,
                                  cfg=dataclasses.replace(_default_cfg(h), lazy_rescale=True)))
    GPU_CASES[f"decode_bf16_H{_h}_lazy_rescale_ramp"] = (
        lambda h=_h: check_decode("cuda", bf16, h, 512, 64, 64, [1, 0, 777, 4096, 16384, 3000],
                                  cfg=dataclasses.replace(_default_cfg(h), lazy_rescale=True), ramp=4.0))
_PREFILL_LENS = [(1, 1), (0, 5), (5, 0), (300, 1000), (1024, 1024), (1500, 2100), (77, 50)]
for _dt in (bf16, f16, f32):
    for _causal in (True, False):
        GPU_CASES[f"prefill_{str(_dt)[6:]}_causal{int(_causal)}"] = (
            lambda dt=_dt, c=_causal: check_prefill("cuda", dt, 16, 192, 128, _PREFILL_LENS, c))
GPU_CASES["prefill_bf16_causal1_in_order"] = lambda: check_prefill(
    "cuda", bf16, 16, 192, 128, _PREFILL_LENS, True, cfg=dataclasses.replace(_default_prefill(), reverse_m=False))
for _causal in (True, False):
    GPU_CASES[f"prefill_mla_parts_bf16_causal{int(_causal)}"] = (
        lambda c=_causal: check_prefill_mla("cuda", bf16, 16, 128, 64, 128, _PREFILL_LENS, c))
GPU_CASES["prefill_mla_parts_bf16_into_out"] = (
    lambda: check_prefill_mla("cuda", bf16, 16, 128, 64, 128, _PREFILL_LENS, True, into_out=True))
GPU_CASES["merge_states_bf16"] = lambda: check_merge("cuda", bf16, 5000, 16, 128)
GPU_CASES["merge_states_f32_h128"] = lambda: check_merge("cuda", f32, 300, 128, 128)
for _page in (16, 64):
    GPU_CASES[f"write_kv_page{_page}"] = lambda p=_page: check_write_kv("cuda", bf16, bf16, p, 576, 3000)
    GPU_CASES[f"gather_page{_page}"] = (
        lambda p=_page: check_gather("cuda", bf16, p, 576, [1000, 0, 37, 4096], [0, 5, 63, 100]))


def test_bad_arguments_raise_value_error():
    from attention.triton_backend import TritonAttentionOps
    ops = TritonAttentionOps()
    q = torch.zeros(2, 4, 48)
    cache = torch.zeros(3, 4, 48)
    bt = torch.zeros(2, 3, dtype=torch.int32)
    lens = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        ops.decode(q, cache, bt, lens, 1.0, 48)
    with pytest.raises(ValueError, match="seq_lens"):
        ops.decode(q, cache, bt, lens[:1], 1.0, 32)
    with pytest.raises(ValueError, match="kv_cache"):
        ops.decode(q, torch.zeros(3, 4, 40), bt, lens, 1.0, 32)
    with pytest.raises(ValueError, match="unit last stride"):
        ops.write_kv(cache.transpose(1, 2), torch.zeros(1, 4), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="v must be"):
        ops.prefill(q, q, torch.zeros(3, 4, 16), torch.tensor([0, 2]), torch.tensor([0, 2]), 2, 2, 1.0, True)
    with pytest.raises(ValueError, match="cu_lens"):
        ops.gather_context(cache, bt, torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), 0)


def test_default_decode_tiles_fit_shared_memory():
    from attention.triton_decode import default_decode_config
    assert default_decode_config(128, torch.bfloat16, smem_bytes=227 * 1024).block_n == 64  # H100/H200
    assert default_decode_config(128, torch.bfloat16, smem_bytes=163 * 1024).block_n == 32  # A100
    assert default_decode_config(16, torch.bfloat16, smem_bytes=163 * 1024).prefetch_ids


def test_split_heuristic_fills_gpu():
    from attention.triton_decode import DecodeConfig, choose_num_splits
    cfg = DecodeConfig(programs_per_sm=1)
    assert choose_num_splits(128, 1, 4096, 132, cfg) == 1          # batch alone fills 132 SMs
    s = choose_num_splits(1, 1, 32768, 132, cfg)
    assert 100 <= s <= cfg.max_splits                              # long single sequence: ~1 wave
    assert choose_num_splits(1, 1, cfg.min_split_tokens, 132, cfg) == 1  # too short to split
    assert choose_num_splits(4, 2, 4096, 132, cfg) <= 4096 // cfg.min_split_tokens
    two = DecodeConfig(programs_per_sm=2, fill_first=True)  # the 16-head decode's: 264 slots on 132 SMs
    # up to one program a SM: each SM one program (measured best at B 8-128, 1k-16k contexts), for
    # the narrow-row tiles it was timed with; the others keep the wave model
    from attention.decode_config import default_decode_config
    assert default_decode_config(16, torch.bfloat16).fill_first
    assert default_decode_config(16, torch.bfloat16, cache_dtype=torch.float8_e4m3fn).fill_first
    assert not default_decode_config(128, torch.bfloat16, smem_bytes=227 * 1024).fill_first
    assert choose_num_splits(0, 1, 4096, 132, two) == 1  # no sequences: no division by zero
    assert [choose_num_splits(b, 1, 4096, 132, two) for b in (8, 16, 32, 64, 128, 132)] == [16, 8, 4, 2, 1, 1]
    assert choose_num_splits(2, 1, 4096, 132, two) == 4096 // two.min_split_tokens  # capped by the rows
    assert choose_num_splits(211, 1, 1056, 132, two) == 1  # 80% of the slots: one split (measured best)
    assert choose_num_splits(160, 1, 1056, 132, two) == 3  # 61%: the wave model's 3 (measured best)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_gpu(name):
    GPU_CASES[name]()
