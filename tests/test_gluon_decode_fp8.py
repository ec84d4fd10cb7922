"""The Gluon MLA decode over an FP8 cache on e4m3 wgmma (attention/gluon_decode_fp8.py).

CPU: the argument checks (each names the argument), the row permutation of O^T, and with Triton
3.6 (the GPU machine's) an sm_90 compile without a GPU: no spills, e4m3 wgmma, no byte-wise
shared loads. GPU (marker `gpu`): the kernel against the torch reference over the same quantised,
NaN-poisoned cache, at real shapes: 16 and 128 heads, pages 1, 16, 32, 64 and 256, lengths 0 to
16k, one and several splits, batch 128, q_len 2 and 3 with positions under DCP, kv scales 0.5
and 2, and the configs' options (4 stages, lazy rescale, V^T under QK^T, V^T's explicit byte
transposes, P's hi term decoded in hardware).
"""

from __future__ import annotations

import re

import pytest
import torch
from test_kv_cache_fp8 import poisoned_cache
from test_triton_ops import check_lse, last_positions, poisoned, rel_err

from attention import gluon_decode_fp8 as gf
from attention.gluon_decode_fp8 import Fp8DecodeConfig, mla_decode_fp8_wgmma, perm_rows, validate_inputs
from attention.kv_quant import FP8_DTYPE
from attention.torch_backend import TorchAttentionOps

LKV, R = 512, 64
bf16 = torch.bfloat16
# o's relative error vs the reference over the same bytes and q as the kernel writes it (two e4m3
# terms, `two_term_q`): p is carried to ~2^-8 (two e4m3 terms), as a bf16 kernel rounds it; lse
# within check_lse's 2e-2
TOL = 1.5e-2


def two_term_q(q: torch.Tensor) -> torch.Tensor:
    """q [T, H, 576] as the kernel multiplies it: each row scaled by sq = amax / 448 and written as
    e4m3 hi + e4m3(q / sq - hi), times sq (on the CPU: torch's e4m3 cast, nearest even)."""
    q = q.float().cpu()
    amax = q.abs().amax(-1, keepdim=True)
    sq = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    x = q * (1.0 / sq)
    hi = x.to(FP8_DTYPE).float()
    lo = (x - hi).to(FP8_DTYPE).float()
    return (hi + lo) * sq


def test_two_term_q_is_near_bf16():
    """The kernel's q differs from the bf16 q by ~2^-9 of each row's largest value, a bf16 rounding."""
    q = torch.randn(64, 16, LKV + R, generator=torch.Generator().manual_seed(0)).to(bf16)
    err = (two_term_q(q) - q.float()).abs() / q.float().abs().amax(-1, keepdim=True)
    assert err.max() < 2 ** -8 and err.mean() < 2 ** -11, (err.max(), err.mean())


def _args(B=2, H=16, q_len=1, page=16, dtype=bf16, cache_dtype=FP8_DTYPE, d=LKV + R, width=4,
          table_dtype=torch.int32, q_pos=None, misaligned=False, cfg=None):
    q = torch.zeros(B * q_len, H, d, dtype=dtype)
    cache = torch.zeros(8, page, d + (16 if misaligned else 0), dtype=torch.float32).to(cache_dtype)
    cache = cache[:, :, 8:8 + d] if misaligned else cache  # rows start 8 bytes into a 16-byte unit
    bt = torch.zeros(B, width, dtype=table_dtype)
    lens = torch.ones(B, dtype=torch.int32)
    return dict(q=q, kv_cache=cache, block_table=bt, seq_lens=lens, kv_lora_rank=LKV, q_len=q_len, q_pos=q_pos,
                cfg=cfg or Fp8DecodeConfig())


BAD = {
    "q_dtype": (dict(dtype=torch.float16), "q must be bfloat16"),
    "table_dtype": (dict(table_dtype=torch.int64), "block_table must be int32"),
    "q_pos_shape": (dict(q_pos=torch.zeros(3, dtype=torch.int32)), "q_pos must be"),
    "misaligned_cache": (dict(misaligned=True), "16-byte aligned"),
    "stages": (dict(cfg=Fp8DecodeConfig(num_stages=1)), "num_stages must be >= 2"),
    "cache_dtype": (dict(cache_dtype=bf16), "kv_cache float8_e4m3fn"),
    "heads": (dict(H=8), "multiple of 16"),
    "width": (dict(d=LKV + 32), "kv_lora_rank must be 512"),
    "page": (dict(page=12), "power of two"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_inputs_name_the_argument(name):
    kw, msg = BAD[name]
    with pytest.raises(ValueError, match=msg):
        validate_inputs(**_args(**kw))


def test_valid_inputs_and_shared_memory_plan():
    validate_inputs(**_args())
    validate_inputs(**_args(H=8, q_len=2))  # 16 rows: 2 tokens x 8 heads
    a = _args()
    a["cfg"] = Fp8DecodeConfig(num_stages=4, programs_per_sm=2)  # 2 x 168 KB do not fit one SM
    with pytest.raises(ValueError, match="shared memory"):
        validate_inputs(**a)
    assert Fp8DecodeConfig().smem_bytes() * 2 <= gf.SMEM_LIMIT


def test_split_plan_keeps_the_wave_model():
    """The Gluon FP8 kernel's splits stay the wave model's over two programs a SM (fill_first off:
    one program a SM was measured for the Triton kernel only): 14 at 16 sequences, not 132 // 16."""
    from attention.decode_config import choose_num_splits
    cfg = Fp8DecodeConfig().split_config()
    assert not cfg.fill_first
    assert choose_num_splits(16, 1, 4096, 132, cfg) == 14


def test_without_cuda_it_raises_naming_the_option():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    a = _args()
    with pytest.raises(RuntimeError, match=r"Gluon FP8-cache decode .*sm_90 only"):
        mla_decode_fp8_wgmma(a["q"], a["kv_cache"], a["block_table"], a["seq_lens"], 0.1, LKV)


def test_row_permutation():
    """O^T's row order: a permutation of the 512 latent columns in which each thread's 16 rows
    (register bits h and i of wgmma's A fragment) are 16 consecutive columns, as the 16-byte
    shared loads of V^T need."""
    r = torch.arange(512)
    lat = perm_rows(r)
    assert torch.equal(lat.sort().values, r)
    for warp in range(4):
        for g in range(8):
            mine = [64 * i + 16 * warp + 8 * h + g for i in range(8) for h in range(2)]
            cols = lat[mine].sort().values
            assert torch.equal(cols, cols[0] + torch.arange(16)) and cols[0] % 16 == 0


def _triton_36():
    import triton
    return triton.__version__.startswith("3.6")


@pytest.mark.skipif(not _triton_36(), reason="the kernel is written against Triton 3.6's Gluon")
@pytest.mark.parametrize("page,direct,has_pos,stages,vt_prmt", [(16, False, False, 2, False), (64, True, True, 2, False),
                                                                (16, False, False, 4, False), (1, False, False, 2, False),
                                                                (256, False, True, 2, False), (16, False, False, 2, True)])
def test_compiles_for_sm90_without_spills(page, direct, has_pos, stages, vt_prmt):
    """The sm_90 compile (Triton 3.6, no GPU): no spills, shared memory for 2 programs an SM (1 with
    4 stages), the wgmma and shared-load counts of the design, no byte-wise shared loads; with
    vt_prmt 8 byte permutes a 4 x 4 block of V^T."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "scripts" / "compile_fp8_decode.py"
    spec = importlib.util.spec_from_file_location("compile_fp8_decode", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rep = mod.compile_report(page, stages, direct, has_pos, vt_prmt=vt_prmt)
    assert rep["spill_bytes"] == 0 and rep["regs"] is not None, rep["ptxas"]
    assert rep["smem"] <= gf.SMEM_LIMIT // (2 if stages == 2 else 1)
    loop = rep["loop"]
    # per tile: QK^T 16 latent + 2 rope k-steps on e4m3 wgmma (N = 32: both q terms); PV 8
    # 64-row blocks x 2 k-steps x 2 p terms, A from registers; V^T by 16-byte shared loads and
    # byte permutes within the thread (8 a 4 x 4 block with vt_prmt: 16 blocks a thread)
    assert loop["QGMMA.64x32x32.F32.E4M3.E4M3"] == 18 and loop["QGMMA.64x16x32.F32.E4M3.E4M3"] == 32, loop
    assert loop["LDS.128"] == 16 and not any(k.startswith("LDS.U8") for k in loop), loop
    if vt_prmt:
        assert loop["PRMT"] == 128, loop


def check_fp8_decode(H, page, lens, q_len=1, with_pos=False, dcp=(1, 0), scale=1.0, num_splits=None,
                     cfg=None):
    gen = torch.Generator().manual_seed(len(lens) * 31 + H + page)
    B = len(lens)
    cache, bt = poisoned_cache(lens, page, LKV + R, FP8_DTYPE, scale, "cuda", gen)
    q = torch.randn(B * q_len, H, LKV + R, generator=gen).to(bf16).cuda()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q_pos = last_positions(lens, q_len, dcp, "cuda") if with_pos else None
    sm = (LKV + R) ** -0.5 * 3.0
    kw = dict(q_len=q_len, q_pos=q_pos, dcp_size=dcp[0], dcp_rank=dcp[1])
    with poisoned("cuda"):
        o, lse = mla_decode_fp8_wgmma(q, cache, bt, seq_lens, sm, LKV, num_splits=num_splits, kv_scale=scale,
                                      cfg=cfg, **kw)
    ref_q = two_term_q(q).cuda()
    ref_o, ref_lse = TorchAttentionOps(kv_scale=scale).decode(ref_q, cache, bt, seq_lens, sm, LKV, **kw)
    assert o.shape == (B * q_len, H, LKV) and o.dtype == bf16
    check_lse(lse, ref_lse, "fp8 decode")
    err = rel_err(o, ref_o)
    assert err <= TOL, f"fp8 decode rel err {err} > {TOL} (H={H}, page={page}, splits={num_splits})"


_LENS = [1, 0, 777, 4096, 16384, 3000]
GPU_CASES = {
    "H16_page16": lambda: check_fp8_decode(16, 16, _LENS),
    "H16_page64_splits5": lambda: check_fp8_decode(16, 64, _LENS, num_splits=5, scale=2.0),
    "H16_one_split": lambda: check_fp8_decode(16, 64, [0, 1, 65, 2000], num_splits=1),
    "H16_batch128": lambda: check_fp8_decode(16, 16, [(37 * i) % 4097 for i in range(128)], num_splits=3, scale=0.5),
    "H128_page64": lambda: check_fp8_decode(128, 64, [1, 0, 777, 4096]),
    "H16_qlen2_dcp": lambda: check_fp8_decode(16, 64, _LENS, q_len=2, with_pos=True, dcp=(2, 0), num_splits=5),
    "H8_qlen2_pos_dcp_rank1": lambda: check_fp8_decode(8, 16, [0, 9, 300], q_len=2, with_pos=True, dcp=(2, 1)),
    "H16_stages4": lambda: check_fp8_decode(16, 16, _LENS, cfg=Fp8DecodeConfig(num_stages=4, programs_per_sm=1)),
    "H16_page1": lambda: check_fp8_decode(16, 1, [1, 0, 777, 300], num_splits=3),
    "H16_page32": lambda: check_fp8_decode(16, 32, _LENS, num_splits=5),
    "H16_page256": lambda: check_fp8_decode(16, 256, [1, 0, 777, 4096, 3000], num_splits=3),
    "H16_qlen3_pos_dcp": lambda: check_fp8_decode(16, 64, _LENS, q_len=3, with_pos=True, dcp=(2, 1), num_splits=4),
    "H16_lazy": lambda: check_fp8_decode(16, 16, _LENS, cfg=Fp8DecodeConfig(lazy_rescale=True)),
    # each option off the default (Fp8DecodeConfig) once
    "H16_vt_late": lambda: check_fp8_decode(16, 64, _LENS, cfg=Fp8DecodeConfig(vt_early=False)),
    "H16_vt_prmt": lambda: check_fp8_decode(16, 16, _LENS, num_splits=3, cfg=Fp8DecodeConfig(vt_prmt=True)),
    "H128_vt_prmt_qlen2": lambda: check_fp8_decode(128, 64, [1, 0, 777, 4096], q_len=2, with_pos=True, dcp=(2, 0),
                                                   cfg=Fp8DecodeConfig(vt_prmt=True)),
    "H16_p_sw_decode": lambda: check_fp8_decode(16, 16, _LENS, num_splits=3, scale=0.5,
                                                cfg=Fp8DecodeConfig(p_hw_decode=False)),
    "H16_vt_prmt_batch128": lambda: check_fp8_decode(
        16, 16, [(37 * i) % 4097 for i in range(128)], cfg=Fp8DecodeConfig(vt_prmt=True)),
    "H16_fence_after": lambda: check_fp8_decode(16, 64, _LENS, num_splits=2, cfg=Fp8DecodeConfig(fence_first=False)),
    "H16_s2_old_default": lambda: check_fp8_decode(16, 16, _LENS, num_splits=3, cfg=Fp8DecodeConfig(
        vt_early=False, p_hw_decode=False, fence_first=False)),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_gpu(name):
    GPU_CASES[name]()


def _record(calls, name):
    def f(q, *a, **kw):
        calls.append((name, kw.get("kv_scale")))
        return torch.zeros(q.shape[0], q.shape[1], LKV), torch.zeros(q.shape[0], q.shape[1])
    return f


def test_plan_setting_routes_fp8_cache_decodes(monkeypatch):
    """`--kernels ...,decode_fp8_wgmma=1` reaches the attention backend, which sends decodes over an
    FP8 cache (with its kv scale) to mla_decode_fp8_wgmma and those over a bf16 cache to the Triton
    mla_decode (both recorded here: neither runs on the CPU); off, FP8 decodes go to Triton too."""
    from attention import triton_backend as tb
    from attention.mla import make_attention_ops
    from common.kernel_plan import FP8_WGMMA_MIN_ROWS, KernelPlan, parse_kernels, resolve_plan
    assert parse_kernels("triton,decode_fp8_wgmma=1")[1] == {"decode_fp8_wgmma": True}
    calls = []
    monkeypatch.setattr(gf, "mla_decode_fp8_wgmma", _record(calls, "gluon"))
    monkeypatch.setattr(tb, "mla_decode", _record(calls, "triton"))
    for on in (True, False):
        ops = make_attention_ops(KernelPlan(attention="triton", decode_fp8_wgmma=on))
        ops.kv_scale = 0.5
        for cache_dtype in (FP8_DTYPE, bf16):
            a = _args(cache_dtype=cache_dtype)
            ops.decode(a["q"], a["kv_cache"], a["block_table"], a["seq_lens"], 0.1, LKV)
    assert calls == [("gluon", 0.5), ("triton", 0.5), ("triton", 0.5), ("triton", 0.5)]
    # decode_fp8_wgmma_min_rows 64: 2 sequences x 16 heads (32 rows) stay on Triton, with q_len 2 (64
    # rows) they go to Gluon
    calls.clear()
    ops = make_attention_ops(KernelPlan(attention="triton", decode_fp8_wgmma=True, decode_fp8_wgmma_min_rows=64))
    for q_len in (1, 2):
        a = _args(q_len=q_len)
        ops.decode(a["q"], a["kv_cache"], a["block_table"], a["seq_lens"], 0.1, LKV, q_len=q_len)
    assert [c[0] for c in calls] == ["triton", "gluon"]
    assert resolve_plan("auto", "auto", "cuda", "bfloat16", True, True, fp8_wgmma_fit=True)[0].decode_fp8_wgmma_min_rows \
        == FP8_WGMMA_MIN_ROWS == 256


def test_failure_names_the_plan_setting(monkeypatch):
    """A decode the plan sends to the Gluon FP8 kernel that cannot run (here: the CPU, then a compile
    error) raises naming decode_fp8_wgmma=0, charged to that key in the plan's message."""
    from attention.triton_backend import TritonAttentionOps
    from common.kernel_plan import KernelPlan, charged_key
    ops = TritonAttentionOps(fp8_wgmma=True)
    a = _args()
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"sm_90 only.*decode_fp8_wgmma=0 avoids it"):
            ops.decode(a["q"], a["kv_cache"], a["block_table"], a["seq_lens"], 0.1, LKV)

    class CompileError(Exception):
        pass

    def fail(*args, **kw):
        raise CompileError("at the wgmma")
    monkeypatch.setattr(gf, "mla_decode_fp8_wgmma", fail)
    with pytest.raises(CompileError) as info:
        ops.decode(a["q"], a["kv_cache"], a["block_table"], a["seq_lens"], 0.1, LKV)
    assert charged_key(info.value) == "decode_fp8_wgmma"
    assert "--kernels auto,decode_fp8_wgmma=0" in str(KernelPlan().error("warming up", info.value))


def test_default_plan_takes_it_only_where_it_fits():
    """resolve_plan: on by default under base triton where the engine's checks found it fits, and
    attention is triton; never under torch, never with decode_qk_fp8 (a Triton-kernel option), and
    an explicit setting wins."""
    from common.kernel_plan import resolve_plan

    def plan(spec, fit, attention="auto"):
        return resolve_plan(spec, attention, "cuda", "bfloat16", True, True, False, True, fit)[0]
    assert plan("auto", True).decode_fp8_wgmma
    assert not plan("auto", False).decode_fp8_wgmma
    assert not plan("auto,decode_fp8_wgmma=0", True).decode_fp8_wgmma
    assert not plan("auto,decode_qk_fp8=1", True).decode_fp8_wgmma
    assert not plan("auto", True, attention="torch").decode_fp8_wgmma
    assert not plan("torch", True).decode_fp8_wgmma


def test_engine_fit_problems_name_the_reason():
    """The engine's check: the cache, widths, dtype, heads per rank (1-8 tiles of 16), page size
    (the GPU-tested 16 and 64), then Triton and the GPU, each refusal saying which."""
    cpu = torch.device("cpu")
    fit = gf.engine_fit_problem
    assert "--kv-cache-dtype fp8" in fit(cpu, bf16, bf16, LKV, R, 16, 16)
    assert "kv_lora_rank 512" in fit(cpu, bf16, FP8_DTYPE, 128, 16, 16, 16)
    assert "bf16 model" in fit(cpu, torch.float16, FP8_DTYPE, LKV, R, 16, 16)
    for heads in (8, 24, 144, 256):
        assert f"this rank decodes {heads}" in fit(cpu, bf16, FP8_DTYPE, LKV, R, heads, 16)
    for page in (1, 32, 256):
        assert f"not {page}" in fit(cpu, bf16, FP8_DTYPE, LKV, R, 16, page)
    for heads, page in ((16, 16), (48, 64), (128, 16)):  # past those checks: Triton 3.6, then CUDA sm_90
        assert re.search(r"Triton|sm_90", fit(cpu, bf16, FP8_DTYPE, LKV, R, heads, page))


def test_worker_refuses_an_explicit_setting_that_cannot_run(tmp_path):
    """decode_fp8_wgmma=1 on a CPU engine: refused at start-up, naming it."""
    from tiny_models import make_model

    from engine import LLM
    make_model(tmp_path, "v3", qk_rope_head_dim=16)
    with pytest.raises(ValueError, match=r"decode_fp8_wgmma=1: .*leave decode_fp8_wgmma at 0"):
        LLM(str(tmp_path), device="cpu", dtype="float32", kernels="torch,decode_fp8_wgmma=1", num_kv_blocks=64)
