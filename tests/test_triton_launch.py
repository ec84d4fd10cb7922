"""common/triton_launch.py: the direct launch of kept compiled kernels (the plan's launch=fast).

On the CPU: the key against Triton's own specialization (never coarser), and the wrapper's
bookkeeping with a stand-in kernel (which call compiles, which launches directly, with which
arguments). On the GPU: real kernels launched both ways give the same bytes, and an engine with
launch=fast generates what one with launch=triton does.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from common import triton_launch
from common.triton_launch import FastKernel, _arg_key


def _values():
    t = torch.zeros(64, dtype=torch.bfloat16)
    return [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 2**31 - 1, 2**31 - 16, -2**31, -2**31 - 1, -2**31 - 16, 2**31,
            2**31 + 16, 2**32, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 1, True, False, 0.5, 1.0, None,
            t, t[1:], t[8:], t[16:], t.float(), t.float()[2:], t.float()[4:], t.to(torch.int32)]


def test_key_is_never_coarser_than_tritons_specialization():
    """Any two arguments with one key get one specialization from Triton's own function (the
    installed Triton's specialize_impl, specialized and not, as a kernel parameter may be)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl
    vals = _values()
    for a, b in itertools.combinations(vals, 2):
        if type(a) is not type(b) or _arg_key(a) != _arg_key(b):
            continue
        for specialize in (True, False):
            sa = native_specialize_impl(BaseBackend, a, False, specialize, True)
            sb = native_specialize_impl(BaseBackend, b, False, specialize, True)
            assert sa == sb, f"{a!r} and {b!r} share a key but Triton specializes them {sa} / {sb}"
    # and the key does tell apart what Triton does
    assert _arg_key(1) != _arg_key(2) != _arg_key(16) != _arg_key(2**31)
    t = vals[27]
    assert _arg_key(t) != _arg_key(t[1:]) and _arg_key(t) == _arg_key(t[8:]) != _arg_key(t.float())


class _Compiled:
    def __init__(self, log, name):
        self.log, self.function, self.packed_metadata = log, f"fn-{name}", (4, 1, 0)

    @property
    def run(self):
        return lambda *a: self.log.append(("direct",) + a)


class _StandIn:
    """A JITFunction's surface: `fn`, `params` (is_constexpr), `[grid](...)` that 'compiles' (a new
    _Compiled per call) and records the call."""

    class _P:
        def __init__(self, name, ce):
            self.name, self.is_constexpr = name, ce

    def __init__(self):
        def kern(x_ptr, n, eps, stride=7, BLOCK=64, FLAG=False):  # constexprs by `params`, as Triton's
            pass
        self.fn, self.log, self.compiles = kern, [], 0
        self.params = [self._P(n, n in ("BLOCK", "FLAG")) for n in ("x_ptr", "n", "eps", "stride", "BLOCK", "FLAG")]

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.compiles += 1
            self.log.append(("triton", grid, args, tuple(sorted(kwargs.items()))))
            return _Compiled(self.log, self.compiles)
        return launch


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(triton_launch, "_fast", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(triton_launch, "_stream", lambda device: 1234)


def test_first_call_per_key_goes_through_triton_then_direct(fast):
    k = _StandIn()
    fk = FastKernel(k)
    x = torch.zeros(32)
    fk[(3,)](x, 17, 1e-6, BLOCK=64, num_warps=4)
    assert k.compiles == 1 and k.log[-1][0] == "triton"
    fk[(5, 2)](x, 33, 2e-6, BLOCK=64, num_warps=4)  # same key: n 17 and 33 both i32, not 1, not 16k
    assert k.compiles == 1
    # direct: grid padded to 3, the stream, the kept function and metadata, no launch metadata or
    # hooks, then every parameter in order: positional, the default stride, BLOCK given, FLAG default
    assert k.log[-1] == ("direct", 5, 2, 1, 1234, "fn-1", (4, 1, 0), None, None, None, x, 33, 2e-6, 7, 64, False)
    # what changes the specialization compiles again: n == 1, n % 16 == 0, a misaligned pointer,
    # another dtype, another constexpr or launch option, an i64 n
    for args, kw in (((x, 1, 1e-6), {}), ((x, 32, 1e-6), {}), ((x[1:], 17, 1e-6), {}),
                     ((x.double(), 17, 1e-6), {}), ((x, 17, 1e-6), {"BLOCK": 128}),
                     ((x, 17, 1e-6), {"num_warps": 8}), ((x, 2**40, 1e-6), {})):
        before = k.compiles
        fk[(1,)](*args, **{"BLOCK": 64, "num_warps": 4, **kw})
        assert k.compiles == before + 1, (args, kw)
        fk[(1,)](*args, **{"BLOCK": 64, "num_warps": 4, **kw})
        assert k.compiles == before + 1 and k.log[-1][0] == "direct", (args, kw)


def test_runtime_arguments_by_keyword_are_keyed_by_class_and_positional_constexprs_by_value(fast):
    k = _StandIn()
    fk = FastKernel(k)
    x = torch.zeros(32)
    fk[(1,)](x, 17, 1e-6, stride=3)
    fk[(1,)](x, 17, 1e-6, stride=5)  # a runtime stride by keyword: not its value
    assert k.compiles == 1 and k.log[-1][-3] == 5
    fk[(1,)](x, 17, 1e-6, 3, 64)
    fk[(1,)](x, 17, 1e-6, 3, 128)  # BLOCK positional: its value is the key
    assert k.compiles == 3 and k.log[-1][0] == "triton"


def test_off_or_callable_grid_is_tritons_launch(fast, monkeypatch):
    k = _StandIn()
    fk = FastKernel(k)
    x = torch.zeros(32)
    for _ in range(2):
        fk[lambda meta: (1,)](x, 17, 1e-6)
    assert k.compiles == 2
    monkeypatch.setattr(triton_launch, "_fast", False)
    for _ in range(2):
        fk[(1,)](x, 17, 1e-6)
    assert k.compiles == 4 and all(e[0] == "triton" for e in k.log)


def test_a_failed_direct_launch_is_charged_to_the_launch_key(fast):
    """A failure of the direct launch names launch=triton, not the calling module's key."""
    from common.kernel_plan import charged_key
    k = _StandIn()
    fk = FastKernel(k)
    x = torch.zeros(32)
    fk[(1,)](x, 17, 1e-6)
    entry = next(iter(fk._entries.values()))
    entry.run = lambda *a: (_ for _ in ()).throw(RuntimeError("CUDA error: invalid argument"))
    with pytest.raises(RuntimeError) as info:
        fk[(1,)](x, 17, 1e-6)
    assert charged_key(info.value) == "launch"


def test_missing_argument_is_named(fast):
    fk = FastKernel(_StandIn())
    with pytest.raises(TypeError, match="missing argument 'eps'"):
        fk[(1,)](torch.zeros(4), 3)


def test_the_plan_turns_it_on_for_triton_on_cuda_only():
    from common.kernel_plan import resolve_plan
    assert resolve_plan("auto", "auto", "cuda", "bfloat16", True, True)[0].launch == "fast"
    assert resolve_plan("auto,launch=triton", "auto", "cuda", "bfloat16", True, True)[0].launch == "triton"
    assert resolve_plan("auto", "auto", "cpu", "float32", False, True)[0].launch == "triton"
    plan = resolve_plan("auto", "auto", "cuda", "bfloat16", True, True)[0]
    assert plan.avoid("launch") == "--kernels auto,launch=triton (or --kernels torch)"


# ---------------------------------------------------------------------------------------------- GPU

@pytest.fixture
def on_gpu():
    triton_launch.use_fast_launch(True)
    yield
    triton_launch.use_fast_launch(False)  # a process setting: later tests launch as Triton does


def _both(fn):
    """fn() with Triton's launch, then three times with the direct one (a compile, then hits)."""
    triton_launch.use_fast_launch(False)
    ref = fn()
    triton_launch.use_fast_launch(True)
    return ref, [fn() for _ in range(3)]


@pytest.mark.parametrize("rows,D,offset", [(1, 512, 0), (7, 2048, 0), (33, 2048, 8), (5, 1408, 3), (300, 576, 1)])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_norms_equal_tritons_launch(on_gpu, rows, D, offset):
    """RMSNorm and add + RMSNorm through both launches, bit for bit, at row counts of 1 (Triton's
    ==1 specialization), widths that are and are not multiples of 16, and inputs at an offset that
    breaks 16-byte alignment."""
    from common.triton_norm import add_rms_norm, rms_norm
    g = torch.Generator(device="cuda").manual_seed(rows)
    buf = torch.randn(rows * D + offset, device="cuda", dtype=torch.bfloat16, generator=g)
    x = buf[offset:].view(rows, D)
    h = torch.randn(rows, D, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(D, device="cuda", dtype=torch.bfloat16, generator=g)
    ref, got = _both(lambda: (rms_norm(x, w, 1e-6), *add_rms_norm(x, h, w, 1e-6)))
    for outs in got:
        for a, b in zip(outs, ref):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_decode_and_prefill_equal_tritons_launch(on_gpu):
    """The MLA decode (partial + reduce, runtime split counts) and the prefill kernels, 48 and 32
    arguments, both ways, bit for bit."""
    from attention.triton_backend import TritonAttentionOps
    g = torch.Generator(device="cuda").manual_seed(0)
    ops = TritonAttentionOps()
    B, H, page = 5, 16, 16
    lens = torch.tensor([1, 17, 300, 64, 999], device="cuda", dtype=torch.int32)
    nblk = (lens.max().item() + page - 1) // page
    cache = torch.randn(B * nblk + 2, page, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    bt = torch.randperm(B * nblk, device="cuda", generator=g).to(torch.int32).view(B, nblk)
    q = torch.randn(B, H, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    ref, got = _both(lambda: ops.decode(q, cache, bt, lens, 0.07, 512))
    for o, lse in got:
        assert torch.equal(o, ref[0]) and torch.equal(lse, ref[1])
    T = 300
    qn, kn = (torch.randn(T, H, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    qp = torch.randn(T, H, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    kp = torch.randn(T, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(T, H, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = torch.tensor([0, 1, 120, 300], device="cuda", dtype=torch.int32)
    ref, got = _both(lambda: ops.prefill_mla(qn, qp, kn, kp, v, cu, cu, 180, 180, 0.07, causal=True))
    for o, lse in got:
        assert torch.equal(o, ref[0]) and torch.equal(lse, ref[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_engine_fast_launch_equals_tritons(tmp_path):
    """A tiny V2 engine, eager (every Triton kernel launched from the host each step: prefill,
    mixed and decode steps), fp32: launch=fast and launch=triton give the same greedy tokens."""
    from common.launch_settings import autotuning
    from engine import LLM, SamplingParams
    from tiny_models import make_model
    make_model(tmp_path, "v2", qk_rope_head_dim=16)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (3, 17, 40, 64, 9, 33, 1, 25, 130)]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = {}
    try:
        for launch in ("triton", "fast"):
            kernels = f"auto,warmup=0,launch={launch}" + ("" if autotuning() else ",autotune=0")
            llm = LLM(str(tmp_path), device="cuda", dtype="float32", num_kv_blocks=1024, kernels=kernels,
                      enforce_eager=True, max_num_batched_tokens=64)
            assert triton_launch.fast_launching() == (launch == "fast")
            outs[launch] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
            del llm
    finally:
        triton_launch.use_fast_launch(False)
    assert outs["fast"] == outs["triton"]
