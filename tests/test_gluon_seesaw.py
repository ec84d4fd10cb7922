"""The seesaw schedule of the Gluon many-heads MLA decode (attention/gluon_seesaw.py, opt-in:
`--kernels ...,decode_wgmma_seesaw=1`).

CPU: the plan setting's route and refusals, the config checks; with Triton 3.6 (the GPU machine's)
the sm_90 compile without a GPU: no spills in any partition, within shared memory, the wgmma it is
written to issue. GPU (`-m gpu`, sm_90): the kernel against the fp32 torch reference with NaN in
every cache slot no sequence holds (`test_gluon_decode.check_gluon_decode`), over the shape classes
of the lockstep kernel's cases.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_gluon_decode import (LKV, _B3, _B128, _S, _args, _compile_module, _sm90, _triton_36,
                               check_gluon_decode)

from attention import gluon_decode as gd
from attention.gluon_decode import validate_inputs


def test_plan_setting_selects_the_seesaw_schedule(monkeypatch, tmp_path):
    """`--kernels ...,decode_wgmma_seesaw=1` reaches mla_decode_wgmma as gluon_decode_plan.SEESAW;
    refused without the Gluon decode and together with the producer variant; a failure names
    decode_wgmma_seesaw=0 and is charged to that key."""
    from attention.mla import make_attention_ops
    from attention.triton_backend import TritonAttentionOps
    from common.kernel_plan import KernelPlan, parse_kernels
    assert parse_kernels("triton,decode_wgmma_seesaw=1")[1] == {"decode_wgmma_seesaw": True}
    seen = []
    monkeypatch.setattr(gd, "mla_decode_wgmma",
                        lambda q, *a, cfg=None, **kw: (seen.append(cfg), torch.zeros(q.shape[0], q.shape[1], LKV),
                                                       torch.zeros(q.shape[0], q.shape[1]))[1:])
    make_attention_ops(KernelPlan(attention="triton", decode_wgmma_min_heads=64,
                                  decode_wgmma_seesaw=True)).decode(*_args(H=128), 0.1, LKV)
    assert seen == [gd.SEESAW] and gd.SEESAW.seesaw and gd.SEESAW.block_n == 64
    with pytest.raises(ValueError, match="set one"):
        TritonAttentionOps(wgmma_min_heads=64, wgmma_producer=True, wgmma_seesaw=True)
    from tiny_models import make_model

    from engine import LLM
    make_model(tmp_path, "v3", qk_rope_head_dim=16)
    with pytest.raises(ValueError, match=r"decode_wgmma_seesaw=1 .*decode_wgmma_min_heads"):
        LLM(str(tmp_path), device="cpu", dtype="float32", kernels="torch,decode_wgmma_seesaw=1", num_kv_blocks=64)

    def fail(*a, **k):
        raise RuntimeError("compile failed")
    monkeypatch.setattr(gd, "mla_decode_wgmma", fail)
    ops = TritonAttentionOps(wgmma_min_heads=64, wgmma_seesaw=True)
    with pytest.raises(RuntimeError, match=r"compile failed.*decode_wgmma_seesaw=0 runs the kernel without it") as info:
        ops.decode(*_args(H=64), 0.1, LKV)
    assert info.value.plan_key == "decode_wgmma_seesaw"


def test_seesaw_config_checks():
    """The seesaw schedule takes SEESAW's tile shape only, and its plan fits the shared memory."""
    q, cache, bt, lens = _args(H=128)
    for bad in (dict(block_n=32), dict(num_stages=3), dict(producer=True)):
        with pytest.raises(ValueError, match="seesaw"):
            validate_inputs(q, cache, bt, lens, LKV, 1, None, dataclasses.replace(gd.SEESAW, **bad))
    validate_inputs(q, cache, bt, lens, LKV, 1, None, gd.SEESAW)
    assert gd.SEESAW.smem_bytes() == 3 * 64 * 576 * 2 + 3 * 2 * 64 * 4 + 14 * 8 <= gd.SMEM_LIMIT


@pytest.mark.skipif(not _triton_36(), reason="the kernel is written against Triton 3.6's Gluon")
@pytest.mark.parametrize("page,direct,has_pos,lazy", [(16, False, False, False), (64, True, False, False),
                                                      (16, False, True, False), (32, False, True, True)])
def test_seesaw_compiles_for_sm90_without_spills(page, direct, has_pos, lazy):
    """The seesaw kernel (attention/gluon_seesaw.py) at SEESAW's register split: no spills in any
    partition, shared memory within the limit, and the wgmma it is written to issue."""
    rep = _compile_module().compile_report(page, direct, has_pos, dataclasses.replace(gd.SEESAW, lazy_rescale=lazy))
    assert rep["error"] is None, rep["error"]
    assert rep["spill_bytes"] == 0 and rep["regs"] is not None, rep["ptxas"]
    assert gd.SEESAW.smem_bytes() <= rep["smem"] <= gd.SMEM_LIMIT
    assert not rep["wgmma_serialised"], rep["ptxas"]
    assert rep["wgmma_shapes"] == ["m64n256k16", "m64n64k16"]
    # per warpgroup and pair: QK^T over 576 columns (36 k-steps), PV of both tiles (2 x 4)
    assert rep["counts"]["wgmma.mma_async"][0] == 2 * (36 + 8)
    assert rep["counts"]["cp.async"][0] > 0 and rep["counts"]["setmaxnreg"][0] > 0
    # the compute loops, per pair of 64-row tiles (128 cache rows): the lockstep kernel issues
    # ~650 a warp per 32 rows (docs/kernel_notes.md)
    pairs = [loop["instructions"] for loop in rep["loops"] if loop["instructions"] < 1000]
    assert pairs and max(pairs) < 1000, rep["loops"]


GPU_CASES = {}
# the seesaw schedule (attention/gluon_seesaw.py): 64-row tiles in pairs, odd tile counts, empty
# splits, both page sizes, many splits, multi-token queries with positions under DCP
_SEESAW = gd.SEESAW
for _page in (16, 64):
    GPU_CASES[f"seesaw_B128_mixed_H128_p{_page}_splits3"] = (
        lambda page=_page: check_gluon_decode(_B128, 128, page, num_splits=3, cfg=_SEESAW))
    for _name, _lens in {**_S, **_B3}.items():
        GPU_CASES[f"seesaw_{_name}_H128_p{_page}_auto"] = (
            lambda lens=_lens, page=_page: check_gluon_decode(lens, 128, page, cfg=_SEESAW))
GPU_CASES["seesaw_S1000_H64_p16_splits5"] = lambda: check_gluon_decode([1000], 64, 16, num_splits=5, cfg=_SEESAW)
GPU_CASES["seesaw_B1_S4096_H128_p64_splits64"] = (
    lambda: check_gluon_decode([4096], 128, 64, num_splits=64, cfg=_SEESAW))
GPU_CASES["seesaw_qlen2_H32_pos"] = (  # a 64-row tile spans two query tokens
    lambda: check_gluon_decode([1000, 17, 3], 32, 16, q_len=2, with_pos=True, cfg=_SEESAW))
GPU_CASES["seesaw_qlen2_H64_pos"] = (
    lambda: check_gluon_decode([1000, 17, 3], 64, 16, q_len=2, with_pos=True, cfg=_SEESAW))
GPU_CASES["seesaw_qlen2_H64_dcp2_rank1"] = (
    lambda: check_gluon_decode([1000, 17, 3], 64, 16, q_len=2, with_pos=True, dcp=(2, 1), num_splits=4,
                               cfg=_SEESAW))
_SEESAW_LAZY = dataclasses.replace(gd.SEESAW, lazy_rescale=True)
for _name, _lens in (("B3_0_17_1000", [0, 17, 1000]), ("B1_S4096", [4096])):
    GPU_CASES[f"seesaw_lazy_{_name}_H128_p16_splits5"] = (
        lambda lens=_lens: check_gluon_decode(lens, 128, 16, num_splits=5, cfg=_SEESAW_LAZY))
GPU_CASES["seesaw_lazy_B128_mixed_H128_p64_splits3"] = (
    lambda: check_gluon_decode(_B128, 128, 64, num_splits=3, cfg=_SEESAW_LAZY))
GPU_CASES["seesaw_lazy_qlen2_H64_pos"] = (
    lambda: check_gluon_decode([1000, 17, 3], 64, 16, q_len=2, with_pos=True, cfg=_SEESAW_LAZY))

@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_gpu(name):
    GPU_CASES[name]()
