"""The FP8 latent cache (attention/kv_quant.py): kernels vs the torch reference, flag, engine.

Kernel cases compare the Triton write (write_kv, kv_finish), read (decode, gather_context) with the
torch reference ops on random tensors: several batch sizes, lengths that are not multiples of the
block size (0 and 1 among them), shuffled block tables, and every cache slot no sequence holds
poisoned with NaN (a kernel that reads one shows NaN). CPU: `CPU_CASES` under TRITON_INTERPRET=1
(tests/interpreted/test_kv_cache_fp8_kernels.py), fp32 compute; GPU (`-m gpu`): real shapes
(Lkv 512, R 64), bf16 compute.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_triton_ops import check_lse, last_positions, poisoned, rel_err

from attention.kv_quant import FP8_DTYPE, FP8_MAX, e4m3_rows, load_as, resolve_kv_cache_dtype, store_as
from attention.torch_backend import TorchAttentionOps
from attention.triton_decode import DecodeConfig

REPO = Path(__file__).resolve().parents[1]

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
# o's relative error vs the reference on the same quantised cache: the kernels only differ from it
# in the order of the fp32 sums (fp32 compute) or by rounding q and p to bf16 (bf16 compute)
TOL = {f32: 1e-3, f16: 5e-3, bf16: 1.5e-2}
# DecodeConfig.qk_fp8 under fp32 compute: the same products as the q-rounding reference, exactly
# (e4m3 x e4m3 is exact in fp32), and fp32 sums: only their order differs
QK_FP8_TOL_F32 = 1e-5


def poisoned_cache(lens, page, d, cache_dtype, scale, device, gen, extra_blocks=3):
    """(cache, block table): each sequence's rows random, quantised with `scale`; every slot past
    a sequence's length and every spare block NaN. Block ids shuffled."""
    per_seq = max([1] + [-(-n // page) for n in lens])
    nb = per_seq * len(lens) + extra_blocks
    full = torch.full((nb, page, d), float("nan"))
    ids = torch.randperm(nb, generator=gen)[: per_seq * len(lens)].view(len(lens), per_seq)
    for b, n in enumerate(lens):
        rows = torch.randn(n, d, generator=gen) * 2.0
        pos = torch.arange(n)
        full[ids[b, pos // page], pos % page] = rows
    cache = store_as(full, cache_dtype, scale)  # NaN stays NaN (0x7f in e4m3)
    assert cache.isnan().any() or not extra_blocks
    return cache.to(device), ids.to(torch.int32).to(device)


def check_decode_cache(device, dtype, cache_dtype, H, lkv, r, page, lens, q_len=1, with_pos=False,
                       dcp=(1, 0), scale=1.0, num_splits=None, cfg=None):
    """Triton decode over a (poisoned, quantised) cache vs the torch reference over the same bytes.

    With `cfg.qk_fp8` the reference's q is rounded to e4m3 per row first (kv_quant.e4m3_rows), as
    the kernel's QK^T operand; the kernel must then be far nearer that reference than the plain
    one (a kernel that ignored qk_fp8 would sit at the plain one)."""
    from attention.triton_backend import TritonAttentionOps
    from attention.triton_decode import mla_decode
    gen = torch.Generator().manual_seed(len(lens) * 31 + H + page)
    B = len(lens)
    cache, bt = poisoned_cache(lens, page, lkv + r, cache_dtype, scale, device, gen)
    q = torch.randn(B * q_len, H, lkv + r, generator=gen).to(dtype).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q_pos = last_positions(lens, q_len, dcp, device) if with_pos else None
    sm = (lkv + r) ** -0.5 * 3.0
    kw = dict(q_len=q_len, q_pos=q_pos, dcp_size=dcp[0], dcp_rank=dcp[1])
    with poisoned(device):
        if num_splits is None and cfg is None:
            o, lse = TritonAttentionOps(kv_scale=scale).decode(q, cache, bt, seq_lens, sm, lkv, **kw)
        else:
            o, lse = mla_decode(q, cache, bt, seq_lens, sm, lkv, num_splits=num_splits, cfg=cfg, kv_scale=scale, **kw)
    qk_fp8 = cfg is not None and cfg.qk_fp8 and cache_dtype == FP8_DTYPE
    ref = TorchAttentionOps(kv_scale=scale)
    ref_q = q.float()
    if qk_fp8:
        # q rounded by torch on the CPU, products in fp64. The kernel's q bytes are the CPU cast's:
        # on the H200 (torch 2.11) its lse was 2e-6 from this reference at these very inputs,
        # and 0.10-0.23 from one whose rounding ran on CUDA (not investigated further)
        q8, sq = e4m3_rows(ref_q.cpu())
        ref_q = (q8.double() * sq.double()).to(ref_q.device)
    ref_o, ref_lse = ref.decode(ref_q, cache, bt, seq_lens, sm, lkv, **kw)
    assert o.shape == (B * q_len, H, lkv) and o.dtype == dtype
    check_lse(lse, ref_lse, "decode")
    err = rel_err(o, ref_o)
    tol = QK_FP8_TOL_F32 if qk_fp8 and dtype == f32 else TOL[dtype]
    assert err <= tol, f"decode rel err {err} > {tol} ({cache_dtype}, H={H}, page={page}, qk_fp8={qk_fp8})"
    if qk_fp8:  # q's rounding shows: ~5e-2 on these inputs
        far = rel_err(o, ref.decode(q.float(), cache, bt, seq_lens, sm, lkv, **kw)[0])
        assert far > max(1e-4, 4 * err), f"qk_fp8: {far} from the unrounded-q reference, {err} from the rounded"
    return err


def check_write(device, page, d, n_tokens, scale, src_dtype=f32):
    """write_kv into an FP8 cache: the reference's bytes (up to the sign of a zero), NaN left in
    every other slot."""
    from attention.triton_backend import TritonAttentionOps
    gen = torch.Generator().manual_seed(n_tokens + page)
    nb = -(-n_tokens // page) + 2
    kv = (torch.randn(n_tokens, d, generator=gen) * 3.0)
    kv[0, :4] = torch.tensor([1000.0, -1000.0, 1e-5, 0.0])  # saturation, underflow, zero
    kv = kv.to(src_dtype).to(device)
    slots = torch.randperm(nb * page, generator=gen)[:n_tokens]
    slots[1::4] = -1
    slots = slots.to(device)
    cache = torch.full((nb, page, d), float("nan"), device=device).to(FP8_DTYPE)
    ref = cache.clone()
    TritonAttentionOps(kv_scale=scale).write_kv(cache, kv, slots)
    TorchAttentionOps(kv_scale=scale).write_kv(ref, kv, slots)
    got, want = cache.view(torch.uint8), ref.view(torch.uint8)
    # the same numbers: bytes equal up to the sign of zero (both read back as 0)
    got, want = (torch.where((t & 0x7F) == 0, 0, t) for t in (got, want))
    if not torch.equal(got, want):
        # which values: the source value of each differing byte, and what the CPU cast gives
        src = torch.full((nb * page, d), float("nan"), device=device)
        keep = slots >= 0
        src[slots[keep].long()] = kv[keep].float()
        bad = (got != want).view(-1, d)
        x = src[bad][:6].cpu()
        raise AssertionError(f"write_kv fp8: {int(bad.sum())} bytes differ; x {x.tolist()} kernel "
                             f"{got.view(-1, d)[bad][:6].tolist()} torch {want.view(-1, d)[bad][:6].tolist()} "
                             f"torch cpu {store_as(x, FP8_DTYPE, scale).view(torch.uint8).tolist()}")
    return 0.0


def check_gather_fp8(device, dtype, page, d, lens, starts, scale):
    from attention.triton_backend import TritonAttentionOps
    gen = torch.Generator().manual_seed(sum(lens))
    cache, bt = poisoned_cache([s + n for s, n in zip(starts, lens)], page, d, FP8_DTYPE, scale, device, gen)
    cu = torch.tensor([0] + list(lens)).cumsum(0).to(torch.int32).to(device)
    st = torch.tensor(starts, dtype=torch.int32, device=device)
    n = int(cu[-1])
    out = TritonAttentionOps(kv_scale=scale).gather_context(cache, bt, st, cu, n, dtype)
    ref = TorchAttentionOps(kv_scale=scale).gather_context(cache, bt, st, cu, n, dtype)
    assert out.dtype == dtype and ref.dtype == dtype and not out.isnan().any()
    assert torch.equal(out, ref), "gather_context fp8: values differ"
    return 0.0


def check_kv_finish_fp8(device, dtype, T, L, R, page, scale):
    """The fused norm + rope + store into an FP8 cache: same bytes as the unfused torch path."""
    from attention.triton_cache import kv_finish
    from models.config import RopeConfig
    from common.fused import apply_rope, rms_norm
    from models.layers import YarnRotaryEmbedding
    g = torch.Generator().manual_seed(T + L)
    kv = (torch.randn(T, L + R, generator=g) * 2).to(device, dtype)
    w = (1 + 0.1 * torch.randn(L, generator=g)).to(device, dtype)
    rope = YarnRotaryEmbedding(R, 4096, RopeConfig()).to(device)
    cs = rope.at(torch.randint(0, 4096, (T,), generator=g).to(device))
    nb = max(8, -(-T // page) + 1)
    slots = torch.randperm(nb * page, generator=g)[:T].to(device)
    slots[1::3] = -1
    ref_cache = torch.full((nb, page, L + R), float("nan"), device=device).to(FP8_DTYPE)
    got_cache = ref_cache.clone()
    k_pe = apply_rope(cs, kv[:, L:])
    ref = torch.cat([rms_norm(kv[:, :L], w, 1e-6), k_pe], dim=-1)
    TorchAttentionOps(kv_scale=scale).write_kv(ref_cache, ref, slots)
    got = kv_finish(kv, w, 1e-6, cs, got_cache, slots, scale)
    assert got.dtype == dtype
    if dtype == f32:  # same rows bit for bit, so the same bytes
        assert torch.equal(got_cache.view(torch.uint8), ref_cache.view(torch.uint8)), "kv_finish fp8 bytes"
    else:  # bf16 rows may differ by one bf16 ulp (fused vs unfused norm): at most one e4m3 step
        a, b = load_as(got_cache, f32, scale), load_as(ref_cache, f32, scale)
        same = a.isnan() == b.isnan()
        assert same.all()
        d = (a - b).nan_to_num(0.0).abs()
        assert (d <= b.nan_to_num(0.0).abs() * 0.126 + 2 ** -9 * scale).all(), "kv_finish fp8 values"
    return 0.0


def _cfg(block_h, block_n=16, **kw):
    from attention.triton_decode import DecodeConfig
    return DecodeConfig(block_h=block_h, block_n=block_n, num_warps=4, num_stages=1, **kw)


F8 = FP8_DTYPE
CPU_CASES = {
    "write_scale1": lambda: check_write("cpu", 4, 48, 21, 1.0),
    "write_scale0.37_fp16_src": lambda: check_write("cpu", 16, 48, 40, 0.37, f16),
    "gather_fp32": lambda: check_gather_fp8("cpu", f32, 4, 48, [5, 0, 9, 1], [0, 3, 6, 0], 0.5),
    "gather_fp16": lambda: check_gather_fp8("cpu", f16, 16, 48, [17, 40], [15, 0], 1.0),
    "kv_finish": lambda: check_kv_finish_fp8("cpu", f32, 9, 32, 16, 4, 1.0),
    "kv_finish_scale": lambda: check_kv_finish_fp8("cpu", f32, 20, 48, 12, 16, 0.3),
    # decode over a quantised cache: batch 1, 3, 6; lengths 0, 1, non-multiples of the page
    "decode_b1_splits1": lambda: check_decode_cache("cpu", f32, F8, 4, 32, 16, 4, [37], num_splits=1, cfg=_cfg(16)),
    "decode_b3_splits3": lambda: check_decode_cache("cpu", f32, F8, 4, 32, 16, 4, [0, 1, 70], num_splits=3,
                                                    cfg=_cfg(16), scale=0.5),
    "decode_b6_auto": lambda: check_decode_cache("cpu", f32, F8, 20, 32, 16, 16, [5, 0, 33, 17, 1, 64], scale=2.0),
    "decode_h64_tiles": lambda: check_decode_cache("cpu", f32, F8, 64, 32, 16, 16, [0, 1, 37, 150], num_splits=2,
                                                   cfg=_cfg(64)),
    "decode_qlen3_pos_dcp": lambda: check_decode_cache("cpu", f32, F8, 4, 32, 16, 4, [0, 9, 30], q_len=3,
                                                       with_pos=True, dcp=(2, 1), num_splits=2, cfg=_cfg(16)),
    "decode_fp16_q_stage_c_lazy": lambda: check_decode_cache("cpu", f16, F8, 4, 32, 16, 4, [0, 1, 70, 33],
                                                             num_splits=2, cfg=_cfg(16, stage_c=True, lazy_rescale=True)),
    "decode_fp16_q_reload_v": lambda: check_decode_cache("cpu", f16, F8, 4, 32, 16, 4, [0, 1, 70, 33], num_splits=2,
                                                         cfg=_cfg(16, reload_v=True)),
    # QK^T on e4m3 operands (q rounded per row): 16 heads, partial last tiles, splits; q_len 2
    # with positions under DCP and one load per tile; transposed scores over 64 cache rows (the
    # form sm_90 runs on e4m3 wgmma) and over 64-head tiles
    "decode_qk_fp8_h16_splits3": lambda: check_decode_cache("cpu", f32, F8, 16, 32, 16, 4, [0, 1, 70, 33],
                                                            num_splits=3, cfg=_cfg(16, qk_fp8=True, reload_v=True),
                                                            scale=0.5),
    "decode_qk_fp8_h16_qlen2_pos_dcp": lambda: check_decode_cache("cpu", f32, F8, 16, 32, 16, 16, [0, 9, 30],
                                                                  q_len=2, with_pos=True, dcp=(2, 1), num_splits=2,
                                                                  cfg=_cfg(16, qk_fp8=True, lazy_rescale=True)),
    "decode_qk_fp8_h16_qk_t_n64": lambda: check_decode_cache("cpu", f32, F8, 16, 32, 16, 16, [37, 0, 150],
                                                             num_splits=2, cfg=_cfg(16, 64, qk_fp8=True, qk_t=True,
                                                                                    reload_v=True), scale=2.0),
    "decode_qk_fp8_h64_qk_t": lambda: check_decode_cache("cpu", f32, F8, 64, 32, 16, 16, [37, 0, 50], num_splits=1,
                                                         cfg=_cfg(64, qk_fp8=True, qk_t=True), scale=2.0),
    "decode_qk_fp8_fp16_q": lambda: check_decode_cache("cpu", f16, F8, 16, 32, 16, 4, [0, 1, 70, 33], num_splits=2,
                                                       cfg=_cfg(16, qk_fp8=True, reload_v=True)),
    # the model-dtype caches with the same NaN poisoning (no unused slot may be read)
    "decode_fp32_cache_poisoned": lambda: check_decode_cache("cpu", f32, f32, 8, 32, 16, 4, [3, 0, 41], num_splits=2,
                                                             cfg=_cfg(16)),
    "decode_bf16_cache_fp32_q": lambda: check_decode_cache("cpu", f32, bf16, 8, 32, 16, 4, [3, 41], num_splits=1,
                                                           cfg=_cfg(16)),
}

_LENS = [1, 0, 777, 4096, 16384, 3000]
GPU_CASES = {
    "write_real": lambda: check_write("cuda", 64, 576, 3000, 1.0, bf16),
    "gather_real": lambda: check_gather_fp8("cuda", bf16, 64, 576, [1000, 0, 37, 4096], [0, 5, 63, 100], 1.0),
    "kv_finish_real": lambda: check_kv_finish_fp8("cuda", bf16, 1000, 512, 64, 64, 1.0),
}
for _h in (16, 128):
    for _page in (16, 64):
        GPU_CASES[f"decode_fp8_H{_h}_page{_page}"] = (
            lambda h=_h, p=_page: check_decode_cache("cuda", bf16, F8, h, 512, 64, p, _LENS))
    GPU_CASES[f"decode_fp8_H{_h}_batch64"] = (
        lambda h=_h: check_decode_cache("cuda", bf16, F8, h, 512, 64, 64, [(37 * i) % 4000 for i in range(64)]))
    GPU_CASES[f"decode_fp8_H{_h}_qlen2_dcp"] = (
        lambda h=_h: check_decode_cache("cuda", bf16, F8, h, 512, 64, 64, _LENS, q_len=2, with_pos=True, dcp=(2, 0)))
    GPU_CASES[f"decode_fp8_H{_h}_stage_v"] = (
        lambda h=_h: check_decode_cache("cuda", bf16, F8, h, 512, 64, 64, _LENS, num_splits=5, cfg=DecodeConfig(
            block_h=16 if h == 16 else 64, block_n=32, num_warps=4 if h == 16 else 8, num_stages=2,
            reload_v=True, stage_v=True)))
    for _lazy in (False, True):
        GPU_CASES[f"decode_fp8_H{_h}_stage_c{'_lazy' if _lazy else ''}"] = (
            lambda h=_h, lazy=_lazy: check_decode_cache("cuda", bf16, F8, h, 512, 64, 16, _LENS, num_splits=5,
                                                        cfg=DecodeConfig(block_h=16 if h == 16 else 64, block_n=32,
                                                                         num_warps=4 if h == 16 else 8, num_stages=2,
                                                                         stage_c=True, lazy_rescale=lazy)))
    GPU_CASES[f"decode_bf16_H{_h}_poisoned"] = (
        lambda h=_h: check_decode_cache("cuda", bf16, bf16, h, 512, 64, 64, _LENS))
# DecodeConfig.qk_fp8 at 16 heads: the FP8 default's tiles, PV staged, 64-row steps, one load per
# tile, transposed scores over 64 rows (e4m3 wgmma on sm_90); B = 6 (lengths up to 16k, 5 splits),
# for two of them 128 (up to 4k, page 16, kv scale 0.5); q_len 2 under DCP
_QK8 = dict(block_h=16, num_warps=4, programs_per_sm=2, prefetch_ids=True, qk_fp8=True)
for _name, _kw in (("", dict(block_n=32, num_stages=2, reload_v=True)),
                   ("_stage_v", dict(block_n=32, num_stages=2, reload_v=True, stage_v=True)),
                   ("_n64", dict(block_n=64, num_stages=3, reload_v=True, programs_per_sm=1, num_warps=8)),
                   ("_one_load", dict(block_n=32, num_stages=2)),
                   ("_qk_t_n64", dict(block_n=64, num_stages=2, reload_v=True, stage_v=True, qk_t=True,
                                      programs_per_sm=1, num_warps=8))):
    _c = DecodeConfig(**(_QK8 | _kw))
    GPU_CASES[f"decode_fp8_H16_qk_fp8{_name}"] = (
        lambda c=_c: check_decode_cache("cuda", bf16, F8, 16, 512, 64, 64, _LENS, num_splits=5, cfg=c))
    if _name in ("", "_qk_t_n64"):
        GPU_CASES[f"decode_fp8_H16_qk_fp8{_name}_batch128"] = (
            lambda c=_c: check_decode_cache("cuda", bf16, F8, 16, 512, 64, 16, [(37 * i) % 4097 for i in range(128)],
                                            num_splits=3, cfg=c, scale=0.5))
_c = DecodeConfig(**(_QK8 | dict(block_n=32, num_stages=2, reload_v=True)))
GPU_CASES["decode_fp8_H16_qk_fp8_qlen2_dcp"] = (
    lambda c=_c: check_decode_cache("cuda", bf16, F8, 16, 512, 64, 64, _LENS, q_len=2, with_pos=True, dcp=(2, 0),
                                    num_splits=5, cfg=c))


# Known misses, run strict (a pass fails, so a fix shows): qk_fp8's e4m3 wgmma tile (not the engine's
# sm_90 path) misses by 0.027 on the H200 and the H100 alike: QK^T's e4m3 sum over K = 576 unpromoted.
GPU_KNOWN_MISSES = {"decode_fp8_H16_qk_fp8_qk_t_n64_batch128": "e4m3 wgmma QK^T unpromoted: lse 0.027 > 0.02"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=GPU_KNOWN_MISSES[n]))
                                  if n in GPU_KNOWN_MISSES else n for n in sorted(GPU_CASES)])
def test_gpu(name):
    GPU_CASES[name]()


def test_quantisation_error_bound_and_saturation():
    """e4m3 keeps 3 mantissa bits: |x - q| <= 2^-4 |x| in the normal range, 2^-10 * scale below it,
    and values past 448 * scale saturate (no inf, no NaN)."""
    torch.manual_seed(0)
    for scale in (1.0, 0.25, 3.0):
        x = torch.randn(100_000) * torch.logspace(-4, 3, 100_000) * scale
        q = load_as(store_as(x, FP8_DTYPE, scale), f32, scale)
        big = x.abs() > FP8_MAX * scale
        assert (q[big] == FP8_MAX * scale * x[big].sign()).all()
        normal = (x.abs() >= 2 ** -6 * scale) & ~big
        assert ((q - x).abs()[normal] <= x.abs()[normal] * 2 ** -4 * (1 + 1e-6)).all()
        assert ((q - x).abs()[~normal & ~big] <= 2 ** -10 * scale * (1 + 1e-6)).all()
        assert ((q - x).abs()[normal] > 0).any()  # it does round


def test_e4m3_rows_one_scale_per_row():
    """q's rounding for DecodeConfig.qk_fp8: each row's largest |value| maps to ±448, a row of
    zeros keeps scale 1, and every value is within e4m3's rounding step of x."""
    torch.manual_seed(0)
    x = torch.randn(5, 576) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 1e3])[:, None]
    x8, s = e4m3_rows(x)
    assert x8.dtype == FP8_DTYPE and s.shape == (5, 1) and s.dtype == f32
    assert s[3].item() == 1.0 and (x8[3].float() == 0).all()
    peak = x8.float().abs().gather(1, x.abs().argmax(1, keepdim=True))
    assert (peak[[0, 1, 2, 4]] == FP8_MAX).all()
    err, normal = (x8.float() * s - x).abs(), x.abs() >= 2 ** -6 * s
    assert (err[normal] <= x.abs()[normal] * 2 ** -4 * (1 + 1e-6)).all()
    assert (err <= (2 ** -10 * s).expand_as(x) * (1 + 1e-6))[~normal].all()
    assert (err > 0).any()


def test_kv_cache_dtype_flag_values():
    from common.args import EngineArgs
    for name, want in (("auto", bf16), ("bf16", bf16), ("bfloat16", bf16), ("fp8", F8), ("fp8_e4m3", F8)):
        assert resolve_kv_cache_dtype(name, bf16) == want
    assert resolve_kv_cache_dtype("auto", f32) == f32
    for bad in ("fp8_e5m2", "int8", "float16"):
        with pytest.raises(ValueError, match="--kv-cache-dtype"):
            EngineArgs(load_format="dummy", kv_cache_dtype=bad)
    from server.cli import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--kv-cache-dtype", "fp8_e5m2"])
    assert build_parser().parse_args(["--kv-cache-dtype", "fp8_e4m3"]).kv_cache_dtype == "fp8_e4m3"


def test_capacity_in_storage_bytes():
    """At equal memory an FP8 cache holds twice the tokens of a bf16 cache, four times fp32's."""
    from engine.worker import kv_cache_bytes_per_block
    from models.config import ModelConfig
    cfg = ModelConfig.from_dict(json.loads((REPO / "configs/models/DeepSeek-V3/config.json").read_text()))
    b16, b8 = (kv_cache_bytes_per_block(cfg, 64, dt) for dt in (bf16, F8))
    assert b16 == 61 * 64 * 576 * 2 and b16 == 2 * b8
    assert kv_cache_bytes_per_block(cfg, 64, f32) == 4 * b8


def _prompt_lp_err(path, kv_cache_dtype, prompts, ref=None):
    """Prompt log-probabilities with prefill chunks of 8 tokens (later chunks read the earlier
    tokens from the cache); mean |difference| against `ref` when given."""
    from engine import LLM, SamplingParams
    llm = LLM(path, device="cpu", dtype="float32", num_kv_blocks=256, max_num_batched_tokens=8,
              kv_cache_dtype=kv_cache_dtype)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    lps = torch.tensor([e.logprob for o in outs for e in o.prompt_logprobs[1:]])
    return lps if ref is None else (lps - ref).abs().mean().item()


@pytest.mark.parametrize("model", ["tiny_v3", "tiny_v2"])
def test_fp8_cache_error_scales_with_its_rounding_step(model, request):
    """Prompt log-prob error against the fp32 cache: bf16 rounds to 2^-8 relative, e4m3 to 2^-4,
    16x coarser, so the FP8 error should be about 16x the bf16 one (a missing scale, a cache read
    as zeros or a value never quantised falls far outside [4x, 64x]) and small in itself."""
    path = request.getfixturevalue(model)[0]
    torch.manual_seed(5)
    prompts = [torch.randint(2, 320, (n,)).tolist() for n in (20, 37, 64, 50)]
    ref = _prompt_lp_err(path, "auto", prompts)
    e16 = _prompt_lp_err(path, "bf16", prompts, ref)
    e8 = _prompt_lp_err(path, "fp8", prompts, ref)
    assert 4 <= e8 / e16 <= 64, (e8, e16)
    assert e8 < 0.05, e8


def test_fp8_cache_greedy_matches_bf16_on_the_bundled_model():
    """The trained tiny model answers its task questions: with the FP8 cache nearly every greedy
    answer equals the bf16 cache's, and where they agree the generated tokens' log-probabilities
    differ by little (a trained model is confident: its top logprobs are near 0 either way)."""
    from engine import LLM, SamplingParams
    from scripts.make_task_data import read_jsonl
    test = read_jsonl(str(REPO / "configs/lm_eval/tiny_arith/test.jsonl"))[:16]
    prompts = [f"Question: {d['question']}\nAnswer:" for d in test]
    params = SamplingParams(temperature=0, max_tokens=40, stop=["Question:"], logprobs=0)
    outs = {}
    for dt in ("bf16", "fp8"):
        llm = LLM(device="cpu", dtype="float32", max_num_batched_tokens=16, kv_cache_dtype=dt)
        outs[dt] = [o.outputs[0] for o in llm.generate(prompts, params)]
    same = sum(a.token_ids == b.token_ids for a, b in zip(outs["bf16"], outs["fp8"]))
    assert same >= 14, same
    diffs = [abs(x.logprob - y.logprob) for a, b in zip(outs["bf16"], outs["fp8"]) if a.token_ids == b.token_ids
             for x, y in zip(a.logprobs, b.logprobs)]
    assert sum(diffs) / len(diffs) < 0.01 and max(diffs) < 0.5, (sum(diffs) / len(diffs), max(diffs))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("budget", [16, 2048])
def test_fp8_cache_triton_engine_equals_torch_engine(budget):
    """The Triton engine over an FP8 cache (fused KV finish, decode, context gather, CUDA graphs)
    against the torch reference engine over an FP8 cache (the same quantisation arithmetic), both
    bf16, on the bundled model's 5-shot task prompts, chunked by 16 tokens and not: at least 61 of
    64 greedy answers equal (the bf16 cache's criterion in tests/test_gpu_engine.py)."""
    from scripts.eval_tiny_model_hf import build_prompts
    from scripts.make_task_data import read_jsonl
    from transformers import AutoTokenizer

    from engine import LLM, SamplingParams
    model, data = "configs/models/tiny-deepseek-v3", "configs/lm_eval/tiny_arith"
    tok = AutoTokenizer.from_pretrained(model)
    texts = build_prompts(read_jsonl(f"{data}/train.jsonl"), read_jsonl(f"{data}/test.jsonl")[:64])
    prompts = [tok(t)["input_ids"] for t in texts]
    params = SamplingParams(temperature=0, max_tokens=32, stop=["Question:"])
    outs = {}
    for backend in ("triton", "torch"):
        llm = LLM(model, device="cuda", dtype="bfloat16", kv_cache_dtype="fp8", attention_backend=backend,
                  max_num_batched_tokens=budget, num_kv_blocks=4096, enforce_eager=backend == "torch",
                  kernels="auto,warmup=0")
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
    same = sum(a == b for a, b in zip(outs["triton"], outs["torch"]))
    assert same >= 61, f"{same} of 64 greedy outputs equal"


@pytest.mark.parametrize("budget", [2048, 16])
def test_fp8_cache_under_dcp_equals_one_rank(tiny_v3, budget):
    """-tp 2 -dcp 2 over an FP8 cache (each rank quantises the tokens it stores; the context
    gather dequantises before the all-gather) gives one rank's greedy tokens over an FP8 cache:
    the stored values do not depend on which rank holds them."""
    from test_parallel import outputs
    torch.manual_seed(5)
    shared = torch.randint(2, 320, (21,)).tolist()
    prompts = [torch.randint(2, 320, (n,)).tolist() for n in (5, 17, 33, 64)]
    prompts += [shared + torch.randint(2, 320, (n,)).tolist() for n in (2, 9, 14, 30)]
    ref, _, cap1 = outputs(tiny_v3[0], prompts, 1, 1, max_num_batched_tokens=budget, num_kv_blocks=256,
                           kv_cache_dtype="fp8")
    got, _, cap2 = outputs(tiny_v3[0], prompts, 2, 2, max_num_batched_tokens=budget, num_kv_blocks=128,
                           kv_cache_dtype="fp8")
    assert got == ref and cap1 == cap2


def test_decode_qk_fp8_plan_key(tmp_path):
    """The plan's decode_qk_fp8 reaches the decode (torch plan: q rounded to e4m3 per row over the
    FP8 cache, so decode log-probabilities move, prefill's do not) and is refused without an FP8
    cache, naming the flag."""
    from tiny_models import make_model

    from engine import LLM, SamplingParams
    make_model(tmp_path, "v3", qk_rope_head_dim=16)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    prompt = [list(range(5, 30))]
    runs = {}
    for k in ("torch", "torch,decode_qk_fp8=1"):
        llm = LLM(str(tmp_path), device="cpu", dtype="float32", kernels=k, kv_cache_dtype="fp8", num_kv_blocks=64)
        out = llm.generate(prompt, sp)[0]
        runs[k] = ([e.logprob for e in out.prompt_logprobs[1:]],
                   [next(iter(d.values())).logprob if isinstance(d, dict) else d.logprob for d in out.outputs[0].logprobs])
    (p0, d0), (p1, d1) = runs.values()
    assert p0 == p1  # prefill attends to the new rows themselves: no decode, no rounding of q
    assert max(abs(a - b) for a, b in zip(d0, d1)) > 1e-6, (d0, d1)
    with pytest.raises(ValueError, match=r"decode_qk_fp8=1 rounds q .*--kv-cache-dtype fp8"):
        LLM(str(tmp_path), device="cpu", dtype="float32", kernels="torch,decode_qk_fp8=1", num_kv_blocks=64)
