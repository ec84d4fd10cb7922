"""Fused MoE kernels (small-batch, expert-sorted blocks, their glue) at real shapes on the GPU,
and the host checks and torch paths on the CPU; the checks themselves are in tests/moe_checks.py,
which the interpreter's suite (tests/interpreted/test_fused_moe_kernels.py) runs at small shapes."""

from __future__ import annotations

import pytest
import torch
from moe_checks import (SMALL_FP8_MOE, check, check_align_leaves_out, check_blocked, check_expert_sort, check_fp8,
                        check_fp8_blocked, check_fp8_blocked_a8, check_fp8_moe, check_glue, check_shared_dense,
                        check_side_norm, expert_sort_ids, fp8_experts, fp8_moe_pair, routed_reference)

@pytest.mark.gpu
@pytest.mark.parametrize("I", [2048, 256])
@pytest.mark.parametrize("T", [16, 300, 2048])
def test_fused_moe_blocked_fp8_real_shapes(T, I):
    """R1 expert shapes (D 7168; I 2048, and 256 as I/tp at tp 8), bf16 activations, FP8 weights
    through the block kernels at the block_m the MoE picks for T, and at 16; 2048 tokens x 8 pairs
    sort on the torch path (past ALIGN_KERNEL_MAX_PAIRS)."""
    from models.moe import block_rows
    bm = block_rows(T, fp8=True)
    for block_m in sorted({16, bm}):
        check_fp8_blocked(T, torch.bfloat16, "cuda", 2e-2, block_m, D=7168, I=I, E=32, k=8)


@pytest.mark.gpu
@pytest.mark.parametrize("I", [2048, 256])
@pytest.mark.parametrize("T", [16, 300, 2048])
def test_fused_moe_blocked_w8a8_real_shapes(T, I):
    """The W8A8 block kernels (a8=True) at R1 expert shapes, bf16 activations quantized by the CUDA
    act_quant, at the block_m the MoE picks for T and at 16, against the W8A8 reference (bf16
    output rounding and fp8 tensor-core sums: 1e-2); and about the activation rounding away from
    the weight-only kernels."""
    from models.moe import block_rows
    bm = block_rows(T, fp8=True)
    for block_m in sorted({16, bm}):
        err, dist = check_fp8_blocked_a8(T, torch.bfloat16, "cuda", 1e-2, block_m, D=7168, I=I, E=32, k=8)
        assert 5e-3 < dist < 1e-1, (T, I, block_m, err, dist)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [16, 300, 2048])
def test_moe_fp8_triton_equals_torch_real_shapes(T):
    """MoE.forward at R1 shapes (32 experts), bf16, FP8 experts kept: the Triton plan's block
    kernels against the torch plan's loop."""
    over = {"n_routed_experts": 32, "n_shared_experts": 0}
    check_fp8_moe(T, torch.bfloat16, "cuda", 2e-2, over, moe_fused_max_tokens_fp8=8,
                  moe_blocked_max_tokens=512)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 8])
def test_fused_moe_real_shapes(T):
    check({}, T, torch.bfloat16, "cuda", 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("T", [9, 64, 512])
def test_fused_moe_blocked_real_shapes(T, block_m):
    """The expert-sorted block kernels (9-512 tokens) at V2-Lite shapes, bf16 and fp32, and their
    one-kernel alignment against the torch sort at V2-Lite's and V3's expert counts."""
    check_glue(T, 8, 66, block_m, "cuda", seed=T)
    check_glue(T, 9, 257, block_m, "cuda", seed=T)
    check_blocked({}, T, torch.bfloat16, "cuda", 2e-2, block_m)
    check_blocked({}, T, torch.float32, "cuda", 1e-5, block_m)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 5, 8, 32])
def test_side_norm_real_shapes(T, monkeypatch):
    """V2-Lite's MoE layer, bf16, the shared experts on a real second stream (the fused path at 1
    and 4 tokens, the block path from 5): the add + norm in the router's logits kernel and in the
    side stream's norm kernel (SideNorm) give the output and residual of the path after one add +
    norm kernel, bit for bit."""
    check_side_norm({}, T, torch.bfloat16, "cuda", monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("T,kt,E", [(1, 8, 66), (1000, 8, 66), (8192, 6, 64), (8192, 8, 66), (8192, 9, 257)])
@pytest.mark.parametrize("skewed", [False, True])
def test_expert_sort_real_shapes(T, kt, E, skewed):
    """The grouped path's counting sort at V2-Lite's and V3's prefill sizes (with and without the
    shared experts folded) equals the stable torch sort."""
    check_expert_sort(expert_sort_ids(T, kt, E, skewed, "cuda", seed=T), E)


@pytest.mark.gpu
def test_fused_moe_fp32_exact():
    """fp32 models (the tiny test models on CUDA) get fp32 products: no TF32."""
    check({}, 4, torch.float32, "cuda", 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8])
def test_fused_moe_fp8_real_shapes(T):
    """V3/R1 expert shapes (D 7168, I 2048/tp 8 = 256), bf16 activations, FP8 weights."""
    check_fp8(T, torch.bfloat16, "cuda", 2e-2, D=7168, I=256, E=32, k=8)


@pytest.mark.parametrize("T", [1, 5, 40])
def test_shared_experts_dense_equals_folded(T):
    """The torch plan (the experts loop), fp32, V2-Lite's layer narrowed: 2 shared experts."""
    check_shared_dense({"hidden_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 8,
                        "num_experts_per_tok": 3}, T, torch.float32, "cpu", 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [64, 256, 1024])
def test_shared_experts_dense_real_shapes(T):
    """The Triton plan's block kernels (64, 256 tokens) and grouped GEMM (1024) at V2-Lite shapes."""
    plan = dict(moe="triton", moe_blocked_max_tokens=512, moe_large="grouped")
    check_shared_dense({}, T, torch.bfloat16, "cuda", 2e-2, **plan)


def test_sort_pairs_into_blocks_layout():
    """Pairs t*kt+j grouped by expert, each run padded to the block with -1; unused blocks get
    expert id E (the kernels skip them)."""
    from models.expert_sort import sort_pairs_into_blocks
    rows, experts = sort_pairs_into_blocks(torch.tensor([[2, 0], [2, 1], [0, 2]]), 4, 4)
    assert rows.view(-1, 4).tolist() == [[1, 4, -1, -1], [3, -1, -1, -1], [0, 2, 5, -1],
                                         [-1] * 4, [-1] * 4, [-1] * 4]
    assert experts.tolist() == [0, 1, 2, 4, 4, 4]


def test_sort_pairs_into_blocks_leaves_out_ids_past_the_experts():
    """The torch sort with the overlapped path's shared ids appended (ids >= E): their pairs get no
    run, and the blocks are bounded by the others (the kernel's equality: the interpreter suite)."""
    from models.expert_sort import sort_pairs_into_blocks
    rows, experts = sort_pairs_into_blocks(torch.tensor([[2, 0, 4], [2, 1, 5], [0, 2, 4]]), 4, 4, max_pairs=6)
    assert rows.view(-1, 4).tolist() == [[1, 6, -1, -1], [4, -1, -1, -1], [0, 3, 7, -1],
                                         [-1] * 4, [-1] * 4, [-1] * 4]
    assert experts.tolist() == [0, 1, 2, 4, 4, 4]
    g = torch.Generator().manual_seed(0)
    for T, k, E, bm in ((5, 3, 8, 4), (40, 6, 64, 16)):
        check_align_leaves_out(torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]), E, bm, kernel=False)


def _blocks_reference(ids, E, block_m, max_pairs=None):
    """sort_pairs_into_blocks' layout, built pair by pair in Python."""
    runs = {e: [] for e in range(E)}
    for pair, e in enumerate(ids.flatten().tolist()):
        if e < E:
            runs[e].append(pair)
    rows, experts = [], []
    for e in range(E):
        padded = runs[e] + [-1] * (-len(runs[e]) % block_m)
        rows += padded
        experts += [e] * (len(padded) // block_m)
    nb = -(-(ids.numel() if max_pairs is None else max_pairs) // block_m) + E
    return rows + [-1] * (nb * block_m - len(rows)), experts + [E] * (nb - len(experts))


def test_sort_pairs_into_blocks_equals_a_python_reference():
    """Random routings (repeated experts, experts with no pair, ids past E left out, a max_pairs
    bound): the torch sort, written without host syncs for piecewise CUDA graphs, equals the
    layout built pair by pair."""
    from models.expert_sort import sort_pairs_into_blocks
    g = torch.Generator().manual_seed(3)
    for T, kt, E, bm, n_out in ((1, 1, 4, 4, 0), (7, 3, 5, 4, 1), (50, 6, 16, 16, 0), (300, 9, 64, 32, 2)):
        ids = torch.randint(0, E, (T, kt), generator=g)
        if n_out:
            ids = torch.cat([ids, torch.arange(E, E + n_out).expand(T, -1)], 1)
        max_pairs = T * kt if n_out else None
        rows, experts = sort_pairs_into_blocks(ids, E, bm, max_pairs)
        assert (rows.tolist(), experts.tolist()) == _blocks_reference(ids, E, bm, max_pairs), (T, kt, E, bm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sort_pairs_into_blocks_in_a_cuda_graph():
    """The torch sort (the FP8 block MoE's past ALIGN_KERNEL_MAX_PAIRS pairs, prefill steps in
    piecewise CUDA graphs) captures, and its replay on new ids equals the eager result."""
    from models.expert_sort import sort_pairs_into_blocks
    ids = torch.randint(0, 64, (2048, 8), device="cuda")
    sort_pairs_into_blocks(ids, 64, 64)  # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        rows, experts = sort_pairs_into_blocks(ids, 64, 64)
    ids.copy_(torch.randint(0, 70, (2048, 8), device="cuda"))  # some left out (>= 64)
    g.replay()
    want = sort_pairs_into_blocks(ids, 64, 64)
    assert torch.equal(rows, want[0]) and torch.equal(experts, want[1])


def test_fused_moe_blocked_fp8_refusals():
    """The block kernels' host checks, before any launch: FP8 weights need both scale tensors on
    the weights' block grid, and a block that the kernels' k tiles divide."""
    from models.blocked_moe import fused_moe_blocked
    E, D, I, T, k = 4, 256, 256, 3, 2
    q13, s13, q2, s2 = fp8_experts(E, D, I)
    x, w, ids = torch.randn(T, D), torch.rand(T, k), torch.zeros(T, k, dtype=torch.long)
    with pytest.raises(ValueError, match="expected torch.float32 weights"):
        fused_moe_blocked(x, q13, q2, w, ids)
    with pytest.raises(ValueError, match="need both w13_scale and w2_scale"):
        fused_moe_blocked(x, q13, q2, w, ids, w13_scale=s13)
    with pytest.raises(ValueError, match=r"expected \(4, 4, 2\) / \(4, 2, 2\)"):
        fused_moe_blocked(x, q13, q2, w, ids, w13_scale=s13[:, :3], w2_scale=s2)
    s13_64, s2_64 = (s.repeat_interleave(2, 1).repeat_interleave(2, 2) for s in (s13, s2))  # 64x64 blocks
    with pytest.raises(ValueError, match=r"k tiles \[64, 128\] must divide the block"):
        fused_moe_blocked(x, q13, q2, w, ids, w13_scale=s13_64, w2_scale=s2_64, block=64)


def test_fused_moe_blocked_w8a8_refusals():
    """a8=True needs FP8 experts, and 128x128 weight blocks (the activations' group width)."""
    from models.blocked_moe import fused_moe_blocked
    E, D, I, T, k = 4, 256, 256, 3, 2
    x, w, ids = torch.randn(T, D), torch.rand(T, k), torch.zeros(T, k, dtype=torch.long)
    with pytest.raises(ValueError, match=r"a8=True\) needs FP8 experts"):
        fused_moe_blocked(x, torch.randn(E, 2 * I, D), torch.randn(E, D, I), w, ids, a8=True)
    q13, s13, q2, s2 = fp8_experts(E, D, I)
    s13_64, s2_64 = (s.repeat_interleave(2, 1).repeat_interleave(2, 2) for s in (s13, s2))
    with pytest.raises(ValueError, match="must be 128x128, not 64x64"):
        fused_moe_blocked(x, q13, q2, w, ids, w13_scale=s13_64, w2_scale=s2_64, block=64, a8=True)


def test_fp8_experts_torch_paths():
    """The torch plan's FP8 experts, dequantized per call expert by expert: the loop (experts hit
    only) and the dense path equal the reference on the whole layer dequantized at once, and the
    grouped GEMM's stacked copy equals that dequantization."""
    from models.fp8 import dequantize
    torch_moe, _, x = fp8_moe_pair(7, torch.float32, "cpu", SMALL_FP8_MOE)
    w, ids = torch_moe.gate(x)
    d13 = dequantize(torch_moe.w13, torch_moe.w13_scale, (128, 128))
    d2 = dequantize(torch_moe.w2, torch_moe.w2_scale, (128, 128))
    ref = routed_reference(x, d13, d2, w, ids)
    for got in (torch_moe._routed(x, w, ids), torch_moe._routed_dense(x, w, ids)):
        assert ((got - ref).norm() / ref.norm()).item() < 1e-6
    s13, s2 = torch_moe._expert_weights(torch.float32)
    assert torch.equal(s13, d13) and torch.equal(s2, d2)


@pytest.mark.gpu
def test_grouped_moe_matches_plain_path():
    """The grouped MoE path (torch._grouped_mm) and the fused small-batch kernel against the
    plain per-expert path, bf16, at 1-4096 tokens."""
    from common.kernel_plan import KernelPlan
    from models.config import ModelConfig
    from models.moe import MoE
    cfg = ModelConfig.from_pretrained("configs/models/DeepSeek-V2-Lite",
                                      {"hidden_size": 512, "moe_intermediate_size": 256})
    torch.manual_seed(0)
    with torch.device("cuda"):
        moe = MoE(cfg, torch.bfloat16, KernelPlan(moe="triton", moe_large="grouped"))
        for p in moe.parameters():
            p.data.normal_(0, 0.05)
        for T in (1, 7, 300, 4096):
            x = torch.randn(T, 512, dtype=torch.bfloat16)
            w, ids = moe.gate(x)
            plain = moe._routed(x, w, ids).float()
            fast = moe._routed_grouped(x, w, ids).float()
            assert ((fast - plain).norm() / plain.norm()).item() < 2e-2
            if T <= 8:
                from models.fused_moe import fused_moe_small
                fused = fused_moe_small(x, moe.w13, moe.w2, w, ids).float()
                assert ((fused - plain).norm() / plain.norm()).item() < 2e-2


def test_fused_moe_small_fp8_refusal():
    """The pair-parallel kernels scale each k tile's product by one block scale a row, so FP8
    experts whose blocks the k tiles do not divide are refused before any launch."""
    E, D, I, T, k = 4, 256, 256, 3, 2
    q13, s13, q2, s2 = fp8_experts(E, D, I)
    x, w, ids = torch.randn(T, D), torch.rand(T, k), torch.zeros(T, k, dtype=torch.long)
    s13_32, s2_32 = (s.repeat_interleave(4, 1).repeat_interleave(4, 2) for s in (s13, s2))  # 32x32 blocks
    from models.fused_moe import fused_moe_small
    with pytest.raises(ValueError, match=r"k tiles \[64, 128\] must divide the block"):
        fused_moe_small(x, q13, q2, w, ids, s13_32, s2_32, 32)
