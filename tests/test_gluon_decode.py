"""The Gluon many-heads MLA decode (attention/gluon_decode.py, opt-in).

CPU: argument validation, the errors when the path cannot run, the shared-memory plan and the
split choice; with Triton 3.6 (the GPU machine's) also an sm_90 compile without a GPU: no spills,
within shared memory, async wgmma of both shapes. GPU (`-m gpu`, sm_90): the kernel against the
fp32 torch reference and against `mla_decode` on random tensors for every shape class, with every
cache slot no sequence holds and every unused block-table entry pointing at NaN (a kernel that
reads one into a result shows NaN).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from test_triton_ops import check_lse, last_positions, poisoned, rel_err

from attention import gluon_decode as gd
from attention.gluon_decode import GluonDecodeConfig, mla_decode_wgmma, plan_splits, validate_inputs
from attention.decode_config import DecodeConfig, choose_num_splits

REPO = Path(__file__).resolve().parents[1]
bf16 = torch.bfloat16
LKV, R = 512, 64
TOL = 1.5e-2  # o's relative error vs the fp32 reference: q and p rounded to bf16 in the products


def _args(B=2, H=64, q_len=1, page=16, dtype=bf16, cache_dtype=bf16, d=LKV + R, width=4):
    q = torch.zeros(B * q_len, H, d, dtype=dtype)
    cache = torch.zeros(B * width, page, d, dtype=cache_dtype)
    bt = torch.arange(B * width, dtype=torch.int32).view(B, width)
    lens = torch.full((B,), page, dtype=torch.int32)
    return q, cache, bt, lens


BAD_INPUTS = {
    "fp16 q": (dict(dtype=torch.float16), {}, "bfloat16"),
    "fp32 cache": (dict(cache_dtype=torch.float32), {}, "bfloat16"),
    "heads not a multiple of 64": (dict(H=16), {}, "multiple of 64"),
    "q_len*heads not a multiple of 64": (dict(H=32, q_len=1), {}, "multiple of 64"),
    "rope width": (dict(d=LKV + 32), {}, "576"),
    "page not a power of two": (dict(page=24), {}, "power of two"),
    "two stages": ({}, dict(cfg=GluonDecodeConfig(num_stages=2)), "num_stages"),
    "q_pe in shared memory with 4 stages overflows": ({}, dict(cfg=GluonDecodeConfig(q_pe_regs=False)),
                                                      "shared memory"),
    "block_n": ({}, dict(cfg=GluonDecodeConfig(block_n=64)), "block_n"),
    "producer with q_pe in shared memory": ({}, dict(cfg=GluonDecodeConfig(producer=True, q_pe_regs=False,
                                                                            num_stages=3)), "q_pe_regs"),
    "producer with 3 stages": ({}, dict(cfg=GluonDecodeConfig(producer=True, num_stages=3)), "num_stages >= 4"),
    "producer registers": ({}, dict(cfg=GluonDecodeConfig(producer=True, producer_regs=60)), "producer_regs"),
    "kv_lora_rank": ({}, dict(kv_lora_rank=448), "kv_lora_rank"),
    "q_len does not divide rows": (dict(B=3, H=64), dict(q_len=2), "q_len"),
    "q_pos shape": ({}, dict(q_pos=torch.zeros(5, dtype=torch.int32)), "q_pos"),
}


def test_misaligned_views_are_refused():
    """A q or cache view off 16-byte alignment (or with strides the launcher cannot prove 16-aligned)
    would not compile (cp.async needs 16-byte vectors): a ValueError naming the tensor instead."""
    q, cache, bt, lens = _args(H=64)
    big = torch.zeros(q.shape[0], q.shape[1], LKV + R + 8, dtype=bf16)
    with pytest.raises(ValueError, match="^q must be 16-byte aligned"):
        validate_inputs(big[..., :LKV + R], cache, bt, lens, LKV, 1, None, GluonDecodeConfig())
    flat = torch.zeros(cache.numel() + 1, dtype=bf16)
    with pytest.raises(ValueError, match="^kv_cache must be 16-byte aligned"):
        validate_inputs(q, flat[1:].view(cache.shape), bt, lens, LKV, 1, None, GluonDecodeConfig())


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_inputs_name_the_argument(name):
    shape_kw, call_kw, match = BAD_INPUTS[name]
    q, cache, bt, lens = _args(**shape_kw)
    kw = dict(kv_lora_rank=LKV, q_len=1, q_pos=None, cfg=GluonDecodeConfig()) | call_kw
    with pytest.raises(ValueError, match=match):
        validate_inputs(q, cache, bt, lens, kw["kv_lora_rank"], kw["q_len"], kw["q_pos"], kw["cfg"])
    with pytest.raises(ValueError, match=match):  # the entry point validates before anything runs
        mla_decode_wgmma(q, cache, bt, lens, 0.1, kw["kv_lora_rank"], q_len=kw["q_len"], q_pos=kw["q_pos"],
                         cfg=kw["cfg"])


def test_valid_inputs_pass_validation():
    for H, q_len in ((64, 1), (128, 1), (32, 2), (128, 2)):
        q, cache, bt, lens = _args(H=H, q_len=q_len)
        validate_inputs(q, cache, bt, lens, LKV, q_len, None, GluonDecodeConfig())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA error")
def test_without_cuda_it_raises_naming_the_option():
    """No silent fallback: valid arguments on a CPU-only machine raise, naming the option."""
    q, cache, bt, lens = _args(H=128)
    with pytest.raises(RuntimeError, match="mla_decode_wgmma"):
        mla_decode_wgmma(q, cache, bt, lens, 0.1, LKV)


def _record(calls, name):
    def f(q, *args, **kw):
        calls.append(name)
        return torch.zeros(q.shape[0], q.shape[1], LKV), torch.zeros(q.shape[0], q.shape[1])
    return f


def test_plan_setting_routes_many_heads_to_the_gluon_decode(monkeypatch):
    """`--kernels ...,decode_wgmma_min_heads=N` reaches the attention backend, which sends decodes
    of N heads or more to mla_decode_wgmma and fewer to the Triton mla_decode (both recorded here:
    neither runs on the CPU)."""
    from attention import triton_backend as tb
    from attention.mla import make_attention_ops
    from common.kernel_plan import KernelPlan
    assert make_attention_ops(KernelPlan(attention="triton")).wgmma_min_heads == 0
    ops = make_attention_ops(KernelPlan(attention="triton", decode_wgmma_min_heads=64))
    calls = []
    monkeypatch.setattr(gd, "mla_decode_wgmma", _record(calls, "gluon"))
    monkeypatch.setattr(tb, "mla_decode", _record(calls, "triton"))
    for H in (16, 64, 128):
        q, cache, bt, lens = _args(H=H)
        ops.decode(q, cache, bt, lens, 0.1, LKV)
    make_attention_ops(KernelPlan(attention="triton")).decode(*_args(H=128), 0.1, LKV)
    assert calls == ["triton", "gluon", "gluon", "triton"]


def test_plan_setting_selects_the_producer_warpgroup(monkeypatch, tmp_path):
    """`--kernels ...,decode_wgmma_producer=1` reaches mla_decode_wgmma as GluonDecodeConfig(producer=True)
    (recorded: the kernel does not run on the CPU); off by default; refused without the Gluon decode."""
    from attention.mla import make_attention_ops
    from common.kernel_plan import KernelPlan, parse_kernels
    assert parse_kernels("triton,decode_wgmma_producer=1")[1] == {"decode_wgmma_producer": True}
    seen = []
    monkeypatch.setattr(gd, "mla_decode_wgmma",
                        lambda q, *a, cfg=None, **kw: (seen.append(cfg), torch.zeros(q.shape[0], q.shape[1], LKV),
                                                       torch.zeros(q.shape[0], q.shape[1]))[1:])
    for producer in (False, True):
        ops = make_attention_ops(KernelPlan(attention="triton", decode_wgmma_min_heads=64,
                                            decode_wgmma_producer=producer))
        ops.decode(*_args(H=128), 0.1, LKV)
    assert seen[0] is None and seen[1] == GluonDecodeConfig(producer=True)
    from tiny_models import make_model

    from engine import LLM
    make_model(tmp_path, "v3", qk_rope_head_dim=16)
    with pytest.raises(ValueError, match=r"decode_wgmma_producer=1 .*decode_wgmma_min_heads"):
        LLM(str(tmp_path), device="cpu", dtype="float32", kernels="torch,decode_wgmma_producer=1", num_kv_blocks=64)


def test_producer_failure_names_its_plan_setting(monkeypatch):
    """A failure of the producer variant names decode_wgmma_producer=0 and is charged to that key."""
    from attention.triton_backend import TritonAttentionOps

    def fail(*a, **k):
        raise RuntimeError("compile failed")
    monkeypatch.setattr(gd, "mla_decode_wgmma", fail)
    ops = TritonAttentionOps(wgmma_min_heads=64, wgmma_producer=True)
    with pytest.raises(RuntimeError, match=r"compile failed.*decode_wgmma_producer=0 runs the kernel without it") as info:
        ops.decode(*_args(H=64), 0.1, LKV)
    assert info.value.plan_key == "decode_wgmma_producer"


def test_gluon_decode_refusal_names_the_plan_setting(monkeypatch):
    """A decode the plan sends to the Gluon kernel and that it cannot run (here: an FP8 cache, then
    the CPU) raises naming decode_wgmma_min_heads and the value that avoids it."""
    from attention.triton_backend import TritonAttentionOps
    ops = TritonAttentionOps(wgmma_min_heads=64)
    q, cache, bt, lens = _args(H=64)
    with pytest.raises(ValueError, match=r"bfloat16.*decode_wgmma_min_heads=64 sent this decode of 64 heads"
                                         r" there; decode_wgmma_min_heads=0 avoids it"):
        ops.decode(q, cache.to(torch.float8_e4m3fn), bt, lens, 0.1, LKV)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"sm_90 only.*decode_wgmma_min_heads=0 avoids it"):
            ops.decode(q, cache, bt, lens, 0.1, LKV)
    # any other failure (a Gluon compile error) is charged to the setting in the plan's message
    from common.kernel_plan import KernelPlan, charged_key

    class CompileError(Exception):
        pass

    def failing_with(exc):
        def decode(*a, **k):
            raise exc
        return decode
    for exc in (CompileError("at warp_specialize"), ValueError("no")):
        monkeypatch.setattr(gd, "mla_decode_wgmma", failing_with(exc))
        with pytest.raises(type(exc)) as info:
            ops.decode(q, cache, bt, lens, 0.1, LKV)
        assert charged_key(info.value) == "decode_wgmma_min_heads"
        assert "--kernels auto,decode_wgmma_min_heads=0" in str(KernelPlan().error("warming up", info.value))


def test_engine_start_up_check_names_the_setting():
    """The worker's start-up check: model widths, dtypes, then the GPU, each refusal naming
    `decode_wgmma_min_heads` and telling to leave it at 0."""
    from attention.gluon_decode_plan import check_engine_fit
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"decode_wgmma_min_heads=64: .*kv_lora_rank 512 and qk_rope_head_dim 64, "
                                         r"this model has 128 and 16"):
        check_engine_fit(64, cpu, bf16, bf16, 128, 16)
    with pytest.raises(ValueError, match=r"decode_wgmma_min_heads=64: .*bf16 model and KV cache.*float8_e4m3fn"):
        check_engine_fit(64, cpu, bf16, torch.float8_e4m3fn, LKV, R)
    with pytest.raises(ValueError, match=r"decode_wgmma_min_heads=64: .*(sm_90|Gluon).*leave decode_wgmma_min_heads at 0"):
        check_engine_fit(64, cpu, bf16, bf16, LKV, R)


def test_shared_memory_plan():
    """Default: q's latent part (64 KB) + 4 stages of 32 rows (144 KB) + one exchange slot each way
    (16 KB) fit Hopper's 227 KB, q's rope slice in registers; with it in shared memory 4 stages do
    not fit, 3 stages with 2 slots each way do."""
    cfg = GluonDecodeConfig()
    assert cfg.q_pe_regs and cfg.num_stages == 4 and cfg.xbuf == 1
    assert cfg.smem_bytes() == 64 * 512 * 2 + 8 * 64 * 2 + 4 * 32 * 576 * 2 + 2 * 64 * 32 * 4 + 2 * 64 * 4 + 4 * 8
    assert cfg.smem_bytes() <= gd.SMEM_LIMIT < GluonDecodeConfig(q_pe_regs=False).smem_bytes()
    small = GluonDecodeConfig(num_stages=3, xbuf=2, q_pe_regs=False)
    assert small.smem_bytes() == 64 * 576 * 2 + 3 * 32 * 576 * 2 + 2 * 2 * 64 * 32 * 4 + 2 * 64 * 4 + 4 * 2 * 8
    assert small.smem_bytes() <= gd.SMEM_LIMIT


def test_split_plan():
    """Splits by the Triton decode's wave heuristic over 64-row programs, one per SM: none when
    batch x head tiles fill the GPU, enough to fill it at batch 1."""
    cfg = GluonDecodeConfig()
    assert plan_splits(128, 128, 4096, 132, cfg) == 1
    s1 = plan_splits(1, 128, 4096, 132, cfg)
    assert s1 == choose_num_splits(1, 2, 4096, 132, DecodeConfig(block_h=64, block_n=32, num_warps=8,
                                                                 num_stages=3, programs_per_sm=1))
    assert 2 * s1 >= 0.8 * 132 and s1 <= 4096 // cfg.min_split_tokens
    assert plan_splits(1, 64, 16, 132, cfg) == 1  # too short to split
    assert plan_splits(3, 256, 1 << 15, 132, cfg) > plan_splits(3, 256, 1 << 12, 132, cfg) // 2


# --- the sm_90 compile (Triton 3.6, the GPU machine's version; no GPU needed) ---

def _compile_module():
    spec = importlib.util.spec_from_file_location("compile_sm90", REPO / "scripts" / "compile_sm90.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("compile_sm90", mod)
    spec.loader.exec_module(mod)
    return mod


def _triton_36():
    import triton
    return triton.__version__.startswith("3.6")


@pytest.mark.skipif(not _triton_36(), reason="the kernel is written against Triton 3.6's Gluon")
@pytest.mark.parametrize("page,direct,has_pos,cfg", [
    (16, False, False, GluonDecodeConfig()), (64, True, False, GluonDecodeConfig()),
    (16, False, True, GluonDecodeConfig()),
    (16, False, False, GluonDecodeConfig(num_stages=3, xbuf=2, q_pe_regs=False)),
    (16, False, False, GluonDecodeConfig(block_n=16, num_stages=6)),
    (64, False, True, GluonDecodeConfig(lazy_rescale=True)),
    (16, False, False, GluonDecodeConfig(producer=True))])
def test_compiles_for_sm90_without_spills(page, direct, has_pos, cfg):
    rep = _compile_module().compile_report(page, direct, has_pos, cfg)
    assert rep["error"] is None, rep["error"]
    assert rep["spill_bytes"] == 0 and rep["regs"] is not None, rep["ptxas"]
    assert rep["smem"] <= gd.SMEM_LIMIT
    assert not rep["wgmma_serialised"], rep["ptxas"]
    assert rep["wgmma_shapes"] == sorted(["m64n256k16", f"m64n{cfg.block_n}k16"])
    # per warpgroup: QK^T 18 k-steps (16 latent + 2 rope) for the first tile and in the loop, PV
    # block_n / 16 k-steps in the loop and after it; two warpgroups
    assert rep["counts"]["wgmma.mma_async"][0] == 2 * (2 * 18 + 2 * cfg.block_n // 16)
    assert rep["counts"]["setmaxnreg"][0] > 0  # the partitions get their register budgets
    if cfg.producer:  # the compute loops issue no copies (~455 instructions a warp per tile, not ~650);
        # loops the detector reports past 1,000 instructions span the epilogue, not a tile
        tiles = [loop["instructions"] for loop in rep["loops"] if loop["instructions"] < 1000]
        assert tiles and max(tiles) < 560, rep["loops"]



def _poisoned_cache(lens, page, gen, spare_entries=2, extra_blocks=3):
    """(cache [NB, page, 576] bf16, block table [B, width] int32): each sequence's rows random in
    shuffled blocks; every slot past a sequence's length, every spare block and the blocks that the
    table's unused entries (`spare_entries` more per row than the longest sequence needs) point at
    hold NaN."""
    per_seq = max([1] + [-(-n // page) for n in lens])
    width = per_seq + spare_entries
    nb = per_seq * len(lens) + extra_blocks
    full = torch.full((nb, page, LKV + R), float("nan"))
    ids = torch.randperm(nb, generator=gen)
    used, spare = ids[: per_seq * len(lens)].view(len(lens), per_seq), ids[per_seq * len(lens):]
    bt = torch.empty(len(lens), width, dtype=torch.int64)
    for b, n in enumerate(lens):
        nblk = -(-n // page)
        rows = torch.randn(n, LKV + R, generator=gen) * 2.0
        pos = torch.arange(n)
        full[used[b, pos // page], pos % page] = rows
        bt[b, :nblk] = used[b, :nblk]
        # entries past the sequence: NaN blocks (its own unfilled ones, then the spare ones)
        tail = torch.cat([used[b, nblk:], spare])
        bt[b, nblk:] = tail[torch.arange(width - nblk) % len(tail)]
    return full.to(bf16), bt.to(torch.int32)


def check_gluon_decode(lens, H, page, q_len=1, num_splits=None, with_pos=False, dcp=(1, 0), seed=0,
                       cfg=None):
    """mla_decode_wgmma vs the fp32 torch reference (and vs mla_decode's contract) on one case."""
    from attention.torch_backend import TorchAttentionOps
    from attention.triton_decode import mla_decode
    gen = torch.Generator().manual_seed(seed * 1009 + len(lens) * 31 + H + page + q_len)
    B = len(lens)
    cache, bt = _poisoned_cache(lens, page, gen)
    cache, bt = cache.cuda(), bt.cuda()
    q = torch.randn(B * q_len, H, LKV + R, generator=gen).to(bf16).cuda()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q_pos = last_positions(lens, q_len, dcp, "cuda") if with_pos else None
    sm = (LKV + R) ** -0.5 * 3.0
    kw = dict(q_len=q_len, q_pos=q_pos, dcp_size=dcp[0], dcp_rank=dcp[1])
    with poisoned("cuda"):
        o, lse = mla_decode_wgmma(q, cache, bt, seq_lens, sm, LKV, num_splits=num_splits, cfg=cfg, **kw)
    torch.cuda.synchronize()
    ref_o, ref_lse = TorchAttentionOps().decode(q.float(), cache, bt, seq_lens, sm, LKV, **kw)
    tri_o, tri_lse = mla_decode(q, cache, bt, seq_lens, sm, LKV, num_splits=num_splits, **kw)
    assert o.shape == tri_o.shape == (B * q_len, H, LKV) and o.dtype == tri_o.dtype == bf16
    assert lse.shape == tri_lse.shape and lse.dtype == torch.float32
    # where it went wrong, to localise a failure: each warpgroup's column half, NaN, the lse
    halves = [rel_err(o[..., :LKV // 2], ref_o[..., :LKV // 2]), rel_err(o[..., LKV // 2:], ref_o[..., LKV // 2:])]
    where = (f"lens {lens[:4]}..., H={H}, page={page}, q_len={q_len}, splits={num_splits}: rel err per "
             f"column half {halves}, NaN in o {o.isnan().any().item()}, lse NaN {lse.isnan().any().item()}")
    check_lse(lse, ref_lse, "gluon decode " + where)
    err = rel_err(o, ref_o)
    assert err <= TOL, f"gluon decode rel err {err} > {TOL} ({where})"
    # rows without a visible key: exactly 0 (as mla_decode)
    empty = torch.isinf(ref_lse)
    if empty.any():
        assert (o[empty] == 0).all()
    return err


_S = {"S1": [1], "S17": [17], "S1000": [1000], "S4096": [4096]}
_B3 = {"B3_0_17_1000": [0, 17, 1000], "B3_4096_1_33": [4096, 1, 33]}
GPU_CASES = {}
for _name, _lens in {**_S, **_B3}.items():
    for _h in (64, 128):
        for _page in (16, 64):
            for _ns in (1, 5, None):
                GPU_CASES[f"{_name}_H{_h}_p{_page}_splits{_ns or 'auto'}"] = (
                    lambda lens=_lens, h=_h, page=_page, ns=_ns: check_gluon_decode(lens, h, page, num_splits=ns))
_g = torch.Generator().manual_seed(7)
_B128 = [4096] + torch.randint(1, 4097, (127,), generator=_g).tolist()
for _page in (16, 64):
    GPU_CASES[f"B128_S4096_H128_p{_page}_auto"] = (
        lambda page=_page: check_gluon_decode([4096] * 128, 128, page))
    GPU_CASES[f"B128_mixed_H128_p{_page}_splits3"] = (
        lambda page=_page: check_gluon_decode(_B128, 128, page, num_splits=3))
# multi-token decode: a 64-row tile spans q_len tokens (H=32, q_len=2), or one token's heads
for _h, _ql in ((32, 2), (64, 2), (128, 2)):
    for _pos in (False, True):
        GPU_CASES[f"qlen{_ql}_H{_h}_pos{int(_pos)}"] = (
            lambda h=_h, ql=_ql, pos=_pos: check_gluon_decode([1000, 17, 3], h, 16, q_len=ql, with_pos=pos))
GPU_CASES["qlen2_H64_dcp2_rank1"] = (
    lambda: check_gluon_decode([1000, 17, 3], 64, 16, q_len=2, with_pos=True, dcp=(2, 1), num_splits=4))
GPU_CASES["B1_S4096_H128_p64_splits64"] = lambda: check_gluon_decode([4096], 128, 64, num_splits=64)
# the other configurations: q's rope slice in shared memory with 3 stages; 16-row tiles
_ALT = {"s3x2": GluonDecodeConfig(num_stages=3, xbuf=2, q_pe_regs=False),
        "n16s6": GluonDecodeConfig(block_n=16, num_stages=6),
        "lazy": GluonDecodeConfig(lazy_rescale=True),
        "producer": GluonDecodeConfig(producer=True),
        "producer_lazy": GluonDecodeConfig(producer=True, lazy_rescale=True)}
for _cname, _cfg in _ALT.items():
    for _name, _lens in (("B3_0_17_1000", [0, 17, 1000]), ("B1_S4096", [4096])):
        GPU_CASES[f"cfg_{_cname}_{_name}_H128_p16_splits5"] = (
            lambda lens=_lens, cfg=_cfg: check_gluon_decode(lens, 128, 16, num_splits=5, cfg=cfg))
    GPU_CASES[f"cfg_{_cname}_qlen2_H64_pos"] = (
        lambda cfg=_cfg: check_gluon_decode([1000, 17, 3], 64, 16, q_len=2, with_pos=True, cfg=cfg))
_PRODUCER = GluonDecodeConfig(producer=True)
for _page in (16, 64):  # the producer-warpgroup kernel over the main shape classes too
    GPU_CASES[f"producer_B128_mixed_H128_p{_page}_splits3"] = (
        lambda page=_page: check_gluon_decode(_B128, 128, page, num_splits=3, cfg=_PRODUCER))
    for _name, _lens in {**_S, **_B3}.items():
        GPU_CASES[f"producer_{_name}_H128_p{_page}_auto"] = (
            lambda lens=_lens, page=_page: check_gluon_decode(lens, 128, page, cfg=_PRODUCER))
GPU_CASES["producer_qlen2_H64_dcp2_rank1"] = (
    lambda: check_gluon_decode([1000, 17, 3], 64, 16, q_len=2, with_pos=True, dcp=(2, 1), num_splits=4,
                               cfg=_PRODUCER))


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_gpu(name):
    GPU_CASES[name]()


def test_the_worker_defaults_to_the_gluon_decode_where_heads_and_checks_fit(monkeypatch):
    """The worker's `wgmma_fit` (the plan's default decode_wgmma_min_heads=64): a CUDA device,
    heads per rank (heads / TP, times DCP) a multiple of 64, and engine_fit_problem's checks; the
    device check is patched here (no sm_90 on the CPU)."""
    from types import SimpleNamespace

    import attention.gluon_decode_plan as gp
    from attention.gluon_decode_plan import decode_heads_fit
    from common import distributed as pd
    from engine.worker import wgmma_fit
    assert [h for h in (16, 32, 64, 96, 128, 192, 256) if decode_heads_fit(h)] == [64, 128, 192, 256]
    import triton
    monkeypatch.setattr(gd, "check_gluon_available", lambda device: None)
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    cuda = torch.device("cuda")

    def fit(heads, tp=1, dcp=1, cache=bf16, lkv=LKV):
        monkeypatch.setattr(pd, "_state", pd._State(pd.GroupInfo(size=tp), pd.GroupInfo(size=dcp), None))
        cfg = SimpleNamespace(num_attention_heads=heads, kv_lora_rank=lkv, qk_rope_head_dim=R)
        return wgmma_fit(cfg, cuda, bf16, cache)
    assert fit(128) and fit(128, tp=2) and not fit(128, tp=4) and fit(128, tp=4, dcp=2)
    assert not fit(16) and not fit(96)
    assert not fit(128, cache=torch.float8_e4m3fn) and not fit(128, lkv=256)
    assert not wgmma_fit(SimpleNamespace(num_attention_heads=128, kv_lora_rank=LKV, qk_rope_head_dim=R),
                         torch.device("cpu"), bf16, bf16)

    monkeypatch.setattr(triton, "__version__", "3.9.0")  # another release's Gluon API
    assert "written against Triton 3.6" in gp.engine_fit_problem(cuda, bf16, bf16, LKV, R) and not fit(128)
    monkeypatch.setattr(triton, "__version__", "3.6.1")

    def unavailable(device):
        raise RuntimeError("no Gluon")
    monkeypatch.setattr(gd, "check_gluon_available", unavailable)
    assert gp.engine_fit_problem(cuda, bf16, bf16, LKV, R) == "no Gluon" and not fit(128)
