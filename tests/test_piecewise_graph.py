"""Piecewise CUDA graphs (engine/piecewise_graph.py): the sizes flag, the model's pieces on the
CPU, and on the GPU the replayed pieces against the eager forward."""

from __future__ import annotations

import pytest
import torch

from common.args import EngineArgs, default_piecewise_sizes, piecewise_graph_sizes


def test_default_sizes_pad_little_past_512_tokens():
    assert default_piecewise_sizes(8192) == [128, 256] + list(range(512, 8193, 512))
    assert default_piecewise_sizes(2048) == [128, 256, 512, 1024, 1536, 2048]
    assert default_piecewise_sizes(2000) == [128, 256, 512, 1024, 1536, 2000]
    assert default_piecewise_sizes(200) == [128, 200]
    assert default_piecewise_sizes(16) == [16]


def test_sizes_flag_is_parsed_and_checked():
    assert piecewise_graph_sizes("auto", 1024) == [128, 256, 512, 1024]
    assert piecewise_graph_sizes("none", 1024) == piecewise_graph_sizes("0", 1024) == []
    assert piecewise_graph_sizes(" 64,32,64 ", 1024) == [32, 64]
    with pytest.raises(ValueError, match="--piecewise-graph-sizes 'a,b'"):
        piecewise_graph_sizes("a,b", 1024)
    with pytest.raises(ValueError, match=r"\[2048\] outside 1..1024 \(--max-num-batched-tokens"):
        piecewise_graph_sizes("512,2048", 1024)
    with pytest.raises(ValueError, match="--piecewise-graph-sizes"):
        EngineArgs(load_format="dummy", max_num_batched_tokens=64, piecewise_graph_sizes="128")


def test_cli_flag_reaches_engine_args():
    from server.cli import build_parser, engine_args_from
    from tests.server_fixtures import TINY_MODEL
    ns = build_parser().parse_args(["--model", str(TINY_MODEL), "--piecewise-graph-sizes", "256,512"])
    assert engine_args_from(ns).piecewise_graph_sizes == "256,512"
    assert engine_args_from(build_parser().parse_args(["--model", str(TINY_MODEL)])).piecewise_graph_sizes == "auto"


@pytest.mark.parametrize("kind", ["v2", "v3"])
def test_pieces_compose_to_the_layers_forward(tmp_path, kind):
    """DeepseekModel.forward (pieces around the attention cores, as the graphs run them) gives the
    bits of running each decoder layer's own forward in turn, on a prefill and on a mixed step."""
    from engine.llm import LLM
    from tiny_models import make_model
    make_model(tmp_path, kind)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=64, enforce_eager=True)
    runner = llm.engine.executor.worker.runner
    inner = runner.model.model
    g = torch.Generator().manual_seed(0)
    tables = [[4 * i + j for j in range(4)] for i in range(3)]

    def by_layers(b):
        x = inner.embed_tokens(b.input_ids)
        cos_sin = inner.rotary_emb.at(b.positions)
        residual = None
        for layer, cache in zip(inner.layers, runner.kv_caches):
            x, residual = layer(x, residual, cos_sin, cache, b.meta)
        return inner.glue.add_rms_norm(residual, x, inner.norm.weight, inner.norm.eps)[1]

    with torch.inference_mode():
        steps = [([torch.randint(2, 300, (n,), generator=g).tolist() for n in (9, 20, 5)], [0, 0, 0]),
                 ([[7], [8], torch.randint(2, 300, (11,), generator=g).tolist()], [9, 20, 5])]
        for prompts, ctx in steps:
            b = runner.prepare(prompts, ctx, tables)
            assert torch.equal(runner.model(b.input_ids, b.positions, runner.kv_caches, b.meta), by_layers(b))


# ---- GPU ----

gpu = pytest.mark.gpu


@gpu
def test_unowned_views_memory_without_keeping_it():
    from engine.piecewise_graph import unowned
    t = torch.arange(3 * 40, device="cuda", dtype=torch.float32).view(3, 40).to(torch.bfloat16)
    q, kv = t.split([32, 8], dim=-1)  # strided views of one storage, as a projection's split
    for v in (t, q, kv):
        u = unowned(v)
        assert (u.data_ptr(), u.shape, u.stride(), u.dtype) == (v.data_ptr(), v.shape, v.stride(), v.dtype)
        assert torch.equal(u, v)
    before = torch.cuda.memory_allocated()
    w = torch.empty(1 << 20, device="cuda")
    u = unowned(w)
    del w
    assert torch.cuda.memory_allocated() == before and u.numel() == 1 << 20


@pytest.fixture(scope="module")
def gpu_v2_grouped(tmp_path_factory):
    """A tiny V2 engine in bf16 whose MoE takes the grouped GEMM past 4 tokens (as V2-Lite's steps
    with prefill do), with pieces captured at 64 and 128 tokens."""
    from common.launch_settings import autotuning
    from engine.llm import LLM
    from tiny_models import make_model
    path = tmp_path_factory.mktemp("pw_v2")
    make_model(path, "v2", qk_rope_head_dim=16)
    kernels = "auto,warmup=0,moe_blocked_max_tokens=0" + ("" if autotuning() else ",autotune=0")
    return LLM(str(path), device="cuda", dtype="bfloat16", num_kv_blocks=1024, max_num_batched_tokens=128,
               piecewise_graph_sizes="64,128", kernels=kernels)


def _compare(runner, prompts, ctx, tables):
    b = runner.prepare(prompts, ctx, tables)
    size = runner.piecewise.size_for(b.input_ids.shape[0])
    got = runner.forward(b).float()  # the pieces replayed: not a pure decode step
    ref = runner.model(b.input_ids, b.positions, runner.kv_caches, b.meta).float()
    return size, got, ref


@gpu
def test_piecewise_graphs_equal_eager(gpu_v2_grouped):
    """Replayed pieces around eager attention cores against the eager forward of the same step:
    the same bits at a captured size (a prefill of 128 tokens, then decodes beside a chunk after
    cached context: 64), within bf16 rounding when padded (100 tokens in the 128 graphs: cuBLAS
    may take another kernel for 100 rows)."""
    runner = gpu_v2_grouped.engine.executor.worker.runner
    assert runner.piecewise is not None and runner.piecewise.sizes == [64, 128]
    g = torch.Generator().manual_seed(0)
    tables = [[8 * i + j for j in range(8)] for i in range(6)]
    rand = lambda n: torch.randint(2, 320, (n,), generator=g).tolist()  # noqa: E731
    size, got, ref = _compare(runner, [rand(n) for n in (60, 40, 28)], [0, 0, 0], tables)
    assert size == 128 and torch.equal(got, ref)
    size, got, ref = _compare(runner, [[rand(1)[0]], [rand(1)[0]], rand(62)], [60, 40, 28], tables)
    assert size == 64 and torch.equal(got, ref)
    size, got, ref = _compare(runner, [rand(n) for n in (50, 30, 20)], [0, 0, 0], tables[3:])
    assert size == 128 and got.shape == ref.shape == (100, ref.shape[1])
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2


@gpu
def test_piecewise_graph_engine_equals_eager(gpu_v2_grouped, tmp_path):
    """64 prompts of 1-199 tokens under the 128-token budget (chunks beside decodes, padded
    steps): the same greedy tokens as the eager engine, but for near ties."""
    from common.launch_settings import autotuning
    from engine import LLM
    from test_gpu_engine import _assert_same_greedy, _greedy_top, _prompts64
    prompts = _prompts64()
    got = _greedy_top(gpu_v2_grouped, prompts)
    path = gpu_v2_grouped.engine.executor.worker.args.model
    kernels = "auto,warmup=0,moe_blocked_max_tokens=0" + ("" if autotuning() else ",autotune=0")
    ref = _greedy_top(LLM(path, device="cuda", dtype="bfloat16", num_kv_blocks=1024, max_num_batched_tokens=128,
                          piecewise_graph_sizes="none", kernels=kernels), prompts)
    _assert_same_greedy(got, ref)


@gpu
def test_cuda_graph_sizes_are_the_ones_captured(tmp_path_factory):
    """--cuda-graph-sizes: those decode sizes are captured (above --max-num-seqs left out), and
    the 8 prompts' decode steps (batches of 1-8) run in the smallest graph that holds them: the
    same greedy tokens as eagerly."""
    from common.launch_settings import autotuning
    from engine import LLM
    from test_gpu_engine import GREEDY, _prompts, _run
    from tiny_models import make_model
    path = str(tmp_path_factory.mktemp("sizes_v2"))
    make_model(path, "v2", qk_rope_head_dim=16)
    kernels = "auto,warmup=0" + ("" if autotuning() else ",autotune=0")
    llm = LLM(path, device="cuda", dtype="float32", num_kv_blocks=1024, kernels=kernels,
              cuda_graph_sizes=(3, 8, 512), max_num_seqs=16)
    assert llm.engine.executor.worker.runner.graphs.buckets == [3, 8]
    got = [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY)]
    assert got == _run(path, enforce_eager=True)
