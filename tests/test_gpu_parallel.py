"""TP / DCP under NCCL on 2+ GPUs equal one GPU (skipped with fewer than 2 GPUs)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tiny_models import make_model
    path = tmp_path_factory.mktemp("gpu_par_v3")
    make_model(path, "v3", qk_rope_head_dim=16)
    return str(path)


def _outputs(path, tp, dcp, **kw):
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(2, 320, (21,), generator=g).tolist()
    prompts = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (5, 17, 33, 64)]
    prompts += [shared + torch.randint(2, 320, (n,), generator=g).tolist() for n in (2, 9, 14, 30)]
    llm = LLM(path, device="cuda", dtype="float32", block_size=16, num_kv_blocks=64 // dcp,
              max_num_batched_tokens=16, tensor_parallel_size=tp, decode_context_parallel_size=dcp, **kw)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts[:4], GREEDY) + llm.generate(prompts[4:], GREEDY)]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("layout", [(2, 1), (2, 2)])
def test_nccl_layouts_equal_one_gpu(model, layout):
    assert _outputs(model, *layout) == _outputs(model, 1, 1)


def test_nccl_async_scheduling_equals_one_gpu(model):
    """-tp 2 -dcp 2 with async scheduling (each rank launches step N+1 before finishing N)."""
    assert _outputs(model, 2, 2, async_scheduling=True) == _outputs(model, 1, 1, async_scheduling=False)



@pytest.mark.parametrize("kw", [{}, {"enable_expert_parallel": True, "async_scheduling": True},
                                {"enforce_eager": True}])
def test_nccl_data_parallel_equals_one_gpu(model, kw):
    """-dp 2 on 2 GPUs with CUDA graphs (decode and piecewise; a DP rank replays one only where
    its rows are the step's dp_rows), with EP and async scheduling, and eager: one GPU's tokens."""
    assert _outputs(model, 1, 1, data_parallel_size=2, **kw) == _outputs(model, 1, 1)
