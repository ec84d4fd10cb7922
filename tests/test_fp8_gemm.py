"""Block-FP8 W8A8 GEMM vs dequantize-then-matmul (interpreter on CPU; real V3 shapes on GPU)."""

from __future__ import annotations

import pytest
import torch

from models.fp8 import dequantize, quantize
from models.fp8_gemm import _triton_gemm, act_quant, fp8_linear, w8a8_block_gemm


def check(M, N, K, device, tol, tile=None, backend="triton", out=torch.float32, tma=None, m_major=False,
          splits=None, split_k=False):
    torch.manual_seed(M * 7 + N)
    # rows of different magnitudes: a kernel that mixes up rows' scales is off by far more than 1e-3
    x = torch.randn(M, K, device=device) * (0.1 + 10 * torch.rand(M, 1, device=device))
    w = torch.randn(N, K, device=device) * 0.05
    wq, sw = quantize(w)
    xq, sx = act_quant(x)
    if m_major:  # scales as [K/128, M] memory, the Triton act_quant's and cuBLAS's layout
        sx = sx.t().contiguous().t()
    # exact part: the kernel must equal the product of the two dequantized operands
    ref_q = dequantize(xq, sx, (1, 128)) @ dequantize(wq, sw, (128, 128)).T
    if tma is not None:
        got = torch.full((M, N), float("nan"), device=device)
        _triton_gemm(xq, sx, wq, sw, got, tma=tma)
    else:
        got = w8a8_block_gemm(xq, sx, wq, sw, out, tile=tile, backend=backend, splits=splits,
                              split_k=split_k).float()
    e1 = ((got - ref_q).norm() / ref_q.norm()).item()
    # End to end against the unquantized product. e4m3 rounding alone costs ~2.5% per operand on
    # Gaussian data (measured: activation-only 2.54%, weight-only 2.64%), so 2e-2 is out of reach
    # for any w8a8 scheme (a single short row reaches ~5%); this is a sanity bound that wrong
    # scales would exceed many times over. The exact check above is the correctness test.
    e2 = ((fp8_linear(x, wq, sw).float() - x @ w.T).norm() / (x @ w.T).norm()).item()
    exact = 1e-5 if device == "cpu" else 1e-3 if out == torch.float32 else 5e-3  # bf16 out: 2^-9 rounding
    assert e1 < exact and e2 < tol, (M, N, K, e1, e2)
    return e1, e2


def test_cublas_dispatch_pads_rows_and_keeps_m_major_scales(monkeypatch):
    """The cuBLAS block-scaled path, on the CPU against a stand-in for torch._scaled_mm that
    enforces what cuBLAS did on the H200 (rows a multiple of 4, M-major 1x128 scales, 128x128
    weight scales): row counts >= 4 are padded and cut back, fewer go to Triton, as does a K that
    is not a multiple of 512, a refusal is remembered, a forced backend that cannot run says so,
    and any other error propagates."""
    import models.fp8_cublas as cb
    import models.fp8_gemm as g
    from models.fp8 import dequantize, quantize
    calls = []

    def fake_scaled_mm(a, b, scale_a, scale_b, out_dtype):
        M, K = a.shape
        if M % 4 or scale_a.shape != (M, K // 128) or scale_a.stride(0) != 1:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        calls.append(M)
        return (dequantize(a, scale_a, (1, 128)) @ dequantize(b.t(), scale_b.t(), (128, 128)).t()).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm, raising=False)
    monkeypatch.setattr(cb, "cublas_device_ok", lambda t: True)
    monkeypatch.setattr(cb, "REFUSED", set())
    wq, sw = quantize(torch.randn(256, 512) * 0.05)
    for M, padded in ((4, 4), (5, 8), (17, 20), (3, None)):
        xq, sx = g.act_quant(torch.randn(M, 512) * (1 + 5 * torch.rand(M, 1)))
        ref = dequantize(xq, sx, (1, 128)) @ dequantize(wq, sw, (128, 128)).T
        calls.clear()
        y = g.w8a8_block_gemm(xq, sx, wq, sw) if padded else None
        if padded is None:  # under 4 rows: Triton (interpreter-only on the CPU), and "cublas" refuses
            with pytest.raises(ValueError, match="cuBLAS"):
                g.w8a8_block_gemm(xq, sx, wq, sw, backend="cublas")
            continue
        assert calls == [padded] and y.shape == (M, 256) and y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2)
    # a shape cuBLAS refuses is remembered: the next call of that shape goes straight to Triton
    refusals = []

    def refusing(*a, **k):
        refusals.append(a[0].shape[0])
        raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmulAlgoGetHeuristic")

    monkeypatch.setattr(torch, "_scaled_mm", refusing)
    ran = []
    monkeypatch.setattr(g, "_triton_gemm", lambda *a, **k: ran.append(a[0].shape[0]))
    xq, sx = g.act_quant(torch.randn(7, 512))
    g.w8a8_block_gemm(xq, sx, wq, sw)
    g.w8a8_block_gemm(xq, sx, wq, sw)
    assert refusals == [8] and ran == [7, 7] and cb.REFUSED == {(8, 256, 512, torch.bfloat16)}
    with pytest.raises(RuntimeError, match="NOT_SUPPORTED"):  # forced: the error, not a silent Triton
        g.w8a8_block_gemm(*g.act_quant(torch.randn(12, 512)), wq, sw, backend="cublas")
    # K of 1-3 blocks (here 3): Triton without asking cuBLAS (it returned wrong products at 1 and 2
    # K blocks on the H200), and a forced cuBLAS says why it cannot run
    wq3, sw3 = quantize(torch.randn(256, 384) * 0.05)
    g.w8a8_block_gemm(*g.act_quant(torch.randn(8, 384)), wq3, sw3)
    assert refusals == [8, 12] and ran == [7, 7, 8]  # 12: the forced call above
    with pytest.raises(ValueError, match="K a multiple of 512"):
        g.w8a8_block_gemm(*g.act_quant(torch.randn(8, 384)), wq3, sw3, backend="cublas")
    # any other error (a torch without the block-wise recipe) reaches the caller: no silent Triton
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("Invalid scaling configuration")))
    with pytest.raises(RuntimeError, match="Invalid scaling"):
        g.w8a8_block_gemm(*g.act_quant(torch.randn(16, 512)), wq, sw)
    assert ran == [7, 7, 8]
    # with split_k (the plan's fp8_gemm_splitk), auto takes Triton through 16 rows and asks cuBLAS
    # from 17 (here refused, so Triton too); a forced cuBLAS is still asked at 8
    monkeypatch.setattr(torch, "_scaled_mm", refusing)
    ran.clear(), refusals.clear(), cb.REFUSED.clear()
    for M in (4, 16, 17):
        g.w8a8_block_gemm(*g.act_quant(torch.randn(M, 512)), wq, sw, split_k=True)
    assert ran == [4, 16, 17] and refusals == [20], (ran, refusals)
    with pytest.raises(RuntimeError, match="NOT_SUPPORTED"):
        g.w8a8_block_gemm(*g.act_quant(torch.randn(8, 512)), wq, sw, split_k=True, backend="cublas")
    assert refusals == [20, 8]


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 257, 4096])
@pytest.mark.parametrize("N,K", [(7168, 2048), (24576, 1536), (2048, 7168)])  # V3: o_proj, q_b_proj, experts' down
def test_w8a8_real_shapes(M, N, K):
    """The Triton GEMM (TMA kernel above 256 rows), the pointer kernel forced at every M, and
    cuBLAS's block-scaled GEMM where this torch has it (bf16 out, M-major scales)."""
    check(M, N, K, "cuda", 8e-2)
    check(M, N, K, "cuda", 8e-2, tile=(64, 128))
    try:
        check(M, N, K, "cuda", 8e-2, backend="cublas", out=torch.bfloat16, m_major=True)
    except (ValueError, RuntimeError) as e:  # no block-scaled _scaled_mm in this torch, or M refused
        if M >= 16 and torch.cuda.get_device_capability() == (9, 0):
            raise
        print("cuBLAS refused", M, e)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [4, 16, 200])
@pytest.mark.parametrize("N,K", [(1024, 128), (1024, 256), (256, 128), (256, 384), (1024, 512),
                                 (256, 1024)])
def test_w8a8_auto_backend_small_k(M, N, K, monkeypatch):
    """The default backend where a tiny model's projections fall (K of 1-8 blocks): cuBLAS at 4 and
    8 blocks (where this torch has its block-scaled GEMM), Triton below; equal to the dequantized
    product either way (cuBLAS's block-scaled GEMM returned wrong products at 1 and 2 blocks on the
    H200)."""
    import models.fp8_cublas as cb
    ran, cublas = [], cb.cublas_gemm
    monkeypatch.setattr(cb, "cublas_gemm", lambda *a: ran.append(a[0].shape) or cublas(*a))
    check(M, N, K, "cuda", 8e-2, backend="auto", out=torch.bfloat16, m_major=True)
    has_cublas = cb.cublas_device_ok(torch.empty(1, device="cuda"))
    assert bool(ran) == (has_cublas and K % 512 == 0), (ran, has_cublas)


@pytest.mark.gpu
@pytest.mark.parametrize("M,K", [(1, 7168), (37, 1536), (4096, 2048), (5, 200)])
def test_act_quant_triton_equals_torch(M, K):
    """The Triton act_quant kernel gives the torch reference's fp8 bytes and scales exactly."""
    from models.fp8_gemm import _act_quant_triton, act_quant_torch
    torch.manual_seed(M + K)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16) * torch.rand(M, 1, device="cuda") * 10
    x[0, :5] = 0  # a zero run inside a group
    q, s = _act_quant_triton(x)
    q_ref, s_ref = act_quant_torch(x)
    ds = (s != s_ref).nonzero()
    assert ds.numel() == 0, f"{ds.shape[0]} scales differ, first {ds[:3].tolist()}: {s[tuple(ds[0])]} vs {s_ref[tuple(ds[0])]}"
    bad = (q.view(torch.uint8) != q_ref.view(torch.uint8)).nonzero()
    if bad.numel():
        i = tuple(bad[0].tolist())
        xs = x.float()[i] / s[i[0], i[1] // 128]
        raise AssertionError(f"{bad.shape[0]} of {q.numel()} fp8 codes differ; first at {i}: x/s = {xs.item()!r}, "
                             f"triton {q.float()[i].item()} vs torch {q_ref.float()[i].item()}; max code diff "
                             f"{(q.view(torch.uint8).int() - q_ref.view(torch.uint8).int()).abs().max().item()}")


# R1's W8A8 projections at decode (-tp 1), (N, K): q_a + kv_a as one GEMM, q_b, o_proj, the dense
# layers' gate_up and down, the shared expert's gate_up and down (with FP8 kept, an MLP of its
# own), and kv_a alone (a narrow shape; the engine packs it with q_a)
R1_DECODE_SHAPES = [(2112, 7168), (24576, 1536), (7168, 16384), (36864, 7168), (7168, 18432),
                    (4096, 7168), (7168, 2048), (576, 7168)]


def test_choose_k_splits_fills_the_gpu_twice():
    """The split rule: no split where the tiles alone fill the SMs, above 16 rows or without an SM
    count; else the fewest splits whose grid reaches PROGRAMS_PER_SM programs per SM, capped so
    that every split keeps MIN_SPLIT_BLOCKS K blocks."""
    from models.fp8_gemm_splitk import MIN_SPLIT_BLOCKS, PROGRAMS_PER_SM, SPLIT_TILE_N, choose_k_splits
    for sms in (132, 78, 8):
        for m in (1, 2, 3, 8, 16):
            for n, k in R1_DECODE_SHAPES + [(256, 1024), (64, 128), (7168, 256)]:
                nkb = -(-k // 128)
                tiles = -(-m // 16) * -(-n // SPLIT_TILE_N)
                s = choose_k_splits(m, n, nkb, sms)
                assert 1 <= s <= max(1, nkb // MIN_SPLIT_BLOCKS), (m, n, k, sms, s)
                if tiles >= sms:
                    assert s == 1, (m, n, k, sms, s)
                elif s < nkb // MIN_SPLIT_BLOCKS:  # not capped: the fewest splits reaching the target
                    assert tiles * s >= PROGRAMS_PER_SM * sms > tiles * (s - 1), (m, n, k, sms, s)
                else:
                    assert s == nkb // MIN_SPLIT_BLOCKS or nkb < MIN_SPLIT_BLOCKS
    # R1's decode projections on a 132-SM H200 at one row (N tiles of 64: o_proj 112, q_a + kv_a 33,
    # kv_a alone 9; q_b's 384 and the dense gate_up's 576 fill the GPU already)
    assert [choose_k_splits(1, n, -(-k // 128), 132) for n, k in R1_DECODE_SHAPES] == [8, 1, 3, 1, 3, 5, 3, 28]
    assert choose_k_splits(17, 7168, 128, 132) == 1 and choose_k_splits(1, 7168, 128, None) == 1
    assert choose_k_splits(1, 64, 1, 132) == 1  # one K block: nothing to split


def test_splitk_dispatch_and_limits(monkeypatch):
    """w8a8_block_gemm takes the split-K form exactly where choose_k_splits splits (here on the CPU
    with a stand-in SM count), the unsplit kernel at 17 rows and with a forced tile, and refuses
    split counts it cannot run. The kernels themselves are the interpreter tests' concern: the
    launches are recorded, not run."""
    import models.fp8_gemm as g
    from models.fp8_gemm_splitk import choose_k_splits
    wq, sw = quantize(torch.randn(256, 1024) * 0.05)
    launched = []
    monkeypatch.setattr(g, "_num_sms", lambda t: 8)
    monkeypatch.setattr(g, "_splitk_gemm", lambda *a, **k: launched.append(("split", a[0].shape[0], a[5])))

    class Unsplit:  # stands in for the plain kernel
        def __getitem__(self, grid):
            return lambda *a, **k: launched.append(("plain", a[0].shape[0], 1))

    monkeypatch.setattr(g, "_w8a8_kernel", Unsplit())
    monkeypatch.setattr(g, "autotuning", lambda: False)  # the plain kernel, not its autotuned forms
    for M, kw in ((1, {}), (16, {}), (17, {}), (1, {"tile": (16, 64)}), (3, {"splits": 1}), (3, {"splits": 5})):
        launched.clear()
        g.w8a8_block_gemm(*act_quant(torch.randn(M, 1024)), wq, sw, torch.float32, split_k=True, **kw)
        want = kw.get("splits") or (1 if "tile" in kw else choose_k_splits(M, 256, 8, 8))
        assert launched == [("split" if want > 1 else "plain", M, want)], (M, kw, launched)
    assert choose_k_splits(1, 256, 8, 8) == 4 and choose_k_splits(17, 256, 8, 8) == 1
    launched.clear()  # without split_k (the plan's fp8_gemm_splitk=0; fp8_linear's default): the unsplit kernel
    g.fp8_linear(torch.randn(1, 1024), wq, sw)
    g.fp8_linear(torch.randn(1, 1024), wq, sw, split_k=True)
    assert launched == [("plain", 1, 1), ("split", 1, 4)]
    with pytest.raises(ValueError, match="splits forces the Triton kernel"):
        g.w8a8_block_gemm(*act_quant(torch.randn(1, 1024)), wq, sw, splits=2, backend="cublas")
    xq, sx = act_quant(torch.randn(2, 1024))
    for bad in (0, 9):
        with pytest.raises(ValueError, match="split-K"):
            g.w8a8_block_gemm(xq, sx, wq, sw, splits=bad)
    with pytest.raises(ValueError, match="split-K"):
        _triton_gemm(xq, sx, wq, sw, torch.empty(2, 256), tma=True, splits=2)
    # a failure of the split-K kernel is charged to fp8_gemm_splitk, whose =0 avoids it
    from common.kernel_plan import KernelPlan, charged_key

    def failing(*a, **k):
        raise RuntimeError("out of resources")
    monkeypatch.setattr(g, "_splitk_gemm", failing)
    with pytest.raises(RuntimeError) as info:
        g.w8a8_block_gemm(xq, sx, wq, sw, split_k=True)
    assert charged_key(info.value) == "fp8_gemm_splitk"
    assert "--kernels auto,fp8_gemm_splitk=0 (or --kernels torch) avoids it" in str(KernelPlan().error("warming up", info.value))
    with pytest.raises(RuntimeError) as info:  # with the serial reduce, charged to its own key
        g.w8a8_block_gemm(xq, sx, wq, sw, split_k=True, serial=True)
    assert charged_key(info.value) == "fp8_gemm_splitk_serial"


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("N,K", R1_DECODE_SHAPES)
def test_w8a8_splitk_r1_shapes(M, N, K):
    """The small-M Triton GEMM at R1's decode shapes: as dispatched with split_k (split-K where this
    GPU's SM count calls for it), forced unsplit and forced to a split count that does not divide the K
    blocks, each against the dequantized product; the split result within fp32 rounding of the
    unsplit one, the same bits on every run and when replayed from a CUDA graph."""
    from models.fp8_gemm_splitk import choose_k_splits
    nkb = K // 128
    odd = next(s for s in (3, 5, 7, 9) if nkb % s)
    for splits in (None, 1, odd):
        check(M, N, K, "cuda", 8e-2, splits=splits, split_k=True)
    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    wq, sw = quantize(torch.randn(N, K, device="cuda") * 0.02)
    xq, sx = act_quant(x)
    s = max(choose_k_splits(M, N, nkb, torch.cuda.get_device_properties(0).multi_processor_count), 2)
    one = w8a8_block_gemm(xq, sx, wq, sw, torch.float32, backend="triton", splits=1)
    split = w8a8_block_gemm(xq, sx, wq, sw, torch.float32, backend="triton", splits=s)
    assert ((split - one).norm() / one.norm()).item() < 1e-5, s
    # the engine's call with fp8_gemm_splitk=1 (bf16 out, act_quant in front): eager twice and a
    # graph replay, same bits
    def run():
        return fp8_linear(x, wq, sw, backend="triton", split_k=True)
    eager = [run() for _ in range(2)]
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warmed up (tuned) before capture
        with torch.cuda.graph(g, stream=stream):
            graphed = run()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(eager[0], eager[1]) and torch.equal(graphed, eager[0])


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 5, 16])
@pytest.mark.parametrize("N,K", [(3648, 2048), (2048, 2816), *R1_DECODE_SHAPES[:2]])
def test_w8a8_splitk_quantizing_x_is_act_quant_bit_for_bit(M, N, K):
    """fp8_gemm_fuse_act at V2-Lite's (q + kv_a, the shared experts' down) and R1's decode shapes:
    the split-K kernel quantizing bf16 x itself gives the bits of act_quant's kernel followed by
    the split kernel, and fp8_linear takes it only with fuse_act (the same bits either way)."""
    from models.fp8_gemm import fused_act_splitk
    torch.manual_seed(M)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16) * 3
    wq, sw = quantize(torch.randn(N, K, device="cuda") * 0.02)
    for splits in (2, 5):
        want = w8a8_block_gemm(*act_quant(x), wq, sw, torch.bfloat16, backend="triton", splits=splits)
        assert torch.equal(fused_act_splitk(x, wq, sw, splits=splits), want), splits
    assert torch.equal(fp8_linear(x, wq, sw, backend="triton", split_k=True, fuse_act=True),
                       fp8_linear(x, wq, sw, backend="triton", split_k=True))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 5, 16])
@pytest.mark.parametrize("N,K", [(3648, 2048), (2048, 2816), *R1_DECODE_SHAPES[:3]])
def test_w8a8_splitk_serial_reduce_is_the_reduce_launch_bit_for_bit(M, N, K):
    """fp8_gemm_splitk_serial on the GPU, at V2-Lite's and R1's decode shapes: each tile's last
    program sums the partials (the counters' atomics order it across SMs) with the bits of the
    reduce launch, with x quantized before the kernel and in it; 20 launches in a row and 3 CUDA
    graph replays give the same bits, and the counters are all zero afterwards."""
    from models.fp8_gemm import fused_act_splitk
    from models.fp8_gemm_splitk import tile_counters
    torch.manual_seed(M + N)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16) * 3
    wq, sw = quantize(torch.randn(N, K, device="cuda") * 0.02)
    xq, sx = act_quant(x)
    for splits in (2, 5):
        want = w8a8_block_gemm(xq, sx, wq, sw, torch.bfloat16, backend="triton", splits=splits)
        for _ in range(20):
            assert torch.equal(w8a8_block_gemm(xq, sx, wq, sw, torch.bfloat16, backend="triton",
                                               splits=splits, serial=True), want), splits
        assert torch.equal(fused_act_splitk(x, wq, sw, splits=splits, serial=True), want), splits
    eager = fp8_linear(x, wq, sw, backend="triton", split_k=True, fuse_act=True, serial=True)
    assert torch.equal(eager, fp8_linear(x, wq, sw, backend="triton", split_k=True))
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fp8_linear(x, wq, sw, backend="triton", split_k=True, serial=True)  # tuned before capture
        with torch.cuda.graph(g, stream=stream):
            graphed = fp8_linear(x, wq, sw, backend="triton", split_k=True, serial=True)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graphed.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(graphed, eager)
    assert not tile_counters(x.device, 1).any()
    with torch.cuda.stream(stream):
        assert not tile_counters(x.device, 1).any()


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 5, 16])
@pytest.mark.parametrize("N,K", [(3648, 2048), (2048, 2048), (5632, 2048), (2048, 2816), *R1_DECODE_SHAPES])
def test_w8a16_real_shapes(M, N, K):
    """The weight-streaming FP8 kernel at V2-Lite's (q + kv_a, o_proj, the shared experts' gate/up
    and down) and R1's decode shapes, bf16: the autotuned and the fixed tile each within bf16
    rounding of x @ the weight dequantized to bf16 (the same weight values; only the order of the
    fp32 sums differs), the same bits on a second run and from a CUDA graph."""
    from models import fp8_w8a16
    torch.manual_seed(M + N)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    wq, sw = quantize(torch.randn(N, K, device="cuda") * 0.02)
    want = (x.float() @ dequantize(wq, sw, (128, 128), torch.bfloat16).float().T)
    fixed = fp8_w8a16.w8a16_linear(x, wq, sw, tile=(fp8_w8a16._FIXED["BLOCK_N"], fp8_w8a16._FIXED["BLOCK_K"]))
    for got in (fp8_w8a16.w8a16_linear(x, wq, sw), fixed):
        assert got.dtype == torch.bfloat16
        assert ((got.float() - want).norm() / want.norm()).item() < 5e-3, (M, N, K)

    def run():
        return fp8_w8a16.w8a16_linear(x, wq, sw)
    eager = [run() for _ in range(2)]
    assert torch.equal(eager[0], eager[1]) and torch.equal(_graph_replay(run), eager[0])


def _graph_replay(fn) -> torch.Tensor:
    """fn() captured in a CUDA graph on a side stream (called once before, so that autotuning
    and compiles happen outside the capture), replayed once: its output."""
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        with torch.cuda.graph(g, stream=stream):
            out = fn()
    torch.cuda.current_stream().wait_stream(stream)
    g.replay()
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16])
def test_w8a16_pdl_signal_changes_no_bits(M, monkeypatch):
    """Where the weight-streaming kernel lets its successor launch under PDL (PDL_SIGNAL: after its
    K loop, the default; at its first statement; or no PDL) moves scheduling only: the same bits
    from each, eagerly and from a CUDA graph, chained to the next projection as in a layer."""
    from common.launch_settings import use_pdl
    from models import fp8_w8a16
    torch.manual_seed(M)
    x = torch.randn(M, 2048, device="cuda", dtype=torch.bfloat16)
    w1, s1 = quantize(torch.randn(3648, 2048, device="cuda") * 0.02)
    w2, s2 = quantize(torch.randn(2048, 3648, device="cuda") * 0.02)

    def chain():
        return fp8_w8a16.w8a16_linear(fp8_w8a16.w8a16_linear(x, w1, s1), w2, s2)
    outs = {}
    use_pdl(True)
    try:
        for signal in ("late", "start", "none"):
            monkeypatch.setattr(fp8_w8a16, "PDL_SIGNAL", signal)
            eager = chain()
            assert torch.equal(_graph_replay(chain), eager), signal
            outs[signal] = eager
    finally:
        use_pdl(False)  # a process setting: later tests' kernels launch without it
    assert torch.equal(outs["late"], outs["start"]) and torch.equal(outs["late"], outs["none"])
