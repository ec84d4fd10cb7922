"""`--load-format dummy` builds one model whatever the layout: under `-tp N` replicated parameters
are equal on every rank and each sharded parameter is this rank's slice of the `-tp 1` tensor."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from common import distributed as pd
from common.args import DEFAULT_MODEL
from common.distributed import GroupInfo
from models.config import ModelConfig
from models.deepseek import DeepseekForCausalLM
from models.fp8 import FP8
from models.loader import checkpoint_shards, init_dummy_weights

FP8_OVERRIDES = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
                 "moe_intermediate_size": 256, "qk_rope_head_dim": 32}  # whole blocks at -tp 2


def dummy_params(cfg: ModelConfig, tp_size: int, tp_rank: int, monkeypatch) -> dict[str, tuple]:
    """This rank's dummy weights, built in this process as rank `tp_rank` of `tp_size`: checkpoint
    name -> (this rank's slice as loaded, its Shard, the parameter)."""
    monkeypatch.setattr(pd, "_state", pd._State(GroupInfo(tp_size, tp_rank), GroupInfo(), None))
    model = DeepseekForCausalLM(cfg, torch.float32)
    init_dummy_weights(model, seed=3)
    out = {}
    for name, (p, sh) in checkpoint_shards(model).items():
        part = (p[sh.index] if sh.index else p).detach()
        if sh.stack is not None:  # pieces stacked on the leading dim: back to the slice's layout
            part = torch.cat(part.unbind(0), dim=sh.stack)
        out[name] = (part, sh, p)
    monkeypatch.setattr(pd, "_state", pd._State(GroupInfo(), GroupInfo(), None))
    return out


@pytest.mark.parametrize("tp,overrides", [(2, {}), (4, {}), (2, FP8_OVERRIDES)], ids=["tp2", "tp4", "tp2-fp8"])
def test_dummy_shards_are_slices_of_the_one_rank_model(tp, overrides, monkeypatch):
    cfg = ModelConfig.from_dict(json.load(open(f"{DEFAULT_MODEL}/config.json")), overrides)
    ref = dummy_params(cfg, 1, 0, monkeypatch)
    assert any(p.dtype == FP8 for _, _, p in ref.values()) == bool(overrides)
    assert any(sh.stack is not None for _, sh, _ in ref.values())  # folded shared experts are checked too
    replicated = sharded = 0
    for rank in range(tp):
        got = dummy_params(cfg, tp, rank, monkeypatch)
        assert got.keys() == ref.keys()
        for name, (part, sh, p) in got.items():
            full = ref[name][0]
            if sh.tp_dim is None:
                want = full
                replicated += rank == 0
            else:
                n = part.shape[sh.tp_dim]
                want = full.narrow(sh.tp_dim, rank * n, min(n, full.shape[sh.tp_dim] - rank * n))
                sharded += rank == 0
            if getattr(p, "vocab_size", None) is not None:  # rows past the vocabulary are padding
                assert not part[want.shape[0]:].any(), name
                part = part[: want.shape[0]]
            assert torch.equal(part.float(), want.float()), (name, rank)
    assert replicated > 10 and sharded > 10
    # not a constant: distinct parameters of one shape get distinct values
    assert not torch.equal(ref["model.layers.1.mlp.experts.0.gate_proj.weight"][0].float(),
                           ref["model.layers.1.mlp.experts.1.gate_proj.weight"][0].float())


def test_dummy_model_under_tp_and_dcp_equals_one_rank(tiny_v3):
    torch.manual_seed(7)
    prompts = [torch.randint(2, 320, (n,)).tolist() for n in (5, 19, 40)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = {}
    for tp, dcp in [(1, 1), (2, 1), (2, 2)]:
        llm = LLM(tiny_v3[0], load_format="dummy", device="cpu", dtype="float32", block_size=4,
                  num_kv_blocks=64 // dcp, tensor_parallel_size=tp, decode_context_parallel_size=dcp)
        try:
            got[tp, dcp] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        finally:
            llm.engine.shutdown()
    assert got[2, 1] == got[1, 1] and got[2, 2] == got[1, 1]
    assert len({t for ids in got[1, 1] for t in ids}) > 3  # the dummy model says more than one word


def test_dummy_fp32_parameters_hold_values_of_the_storage_dtype(monkeypatch):
    """With bf16 storage the fp32 router weight holds bf16 values (as loaded from a bf16
    checkpoint), so Router.keep_bf16_weight keeps its bf16 copy; without, it does not."""
    cfg = ModelConfig.from_dict(json.load(open(f"{DEFAULT_MODEL}/config.json")))
    for storage, exact in ((torch.bfloat16, True), (None, False)):
        model = DeepseekForCausalLM(cfg, torch.float32)
        init_dummy_weights(model, seed=3, storage_dtype=storage)
        gate = next(m for m in model.modules() if hasattr(m, "keep_bf16_weight"))
        assert gate.weight.dtype == torch.float32 and gate.weight.abs().sum() > 0
        gate.keep_bf16_weight()
        assert (gate.weight_bf16 is not None) == exact
