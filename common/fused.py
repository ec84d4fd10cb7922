"""Elementwise glue of a decoder layer, written once in plain torch and compiled on CUDA.

A decode step at small batch is bound by kernel count, not bytes: eager RMSNorm, RoPE and
SwiGLU are ~6 kernels each. On CUDA these functions go through `torch.compile` (one fused
Triton kernel each, CUDA-graph safe); on CPU, or if compilation fails, they run as written.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then norm: returns (x + h, rms_norm(x + h))."""
    s = x + h
    return s, rms_norm(s, w, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x `[T, ..., R]` by cos/sin `[T, 1.., R/2]`."""
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)


def apply_rope(cos_sin: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Rotate x `[T, ..., R]` by its tokens' [cos | sin] rows `cos_sin [T, R]`
    (`YarnRotaryEmbedding.at`), compiled on CUDA (`rope_op`)."""
    cos, sin = cos_sin.chunk(2, dim=-1)  # [T, R/2] each
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    return rope_op(x, cos.view(shape), sin.view(shape))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on `[.., 2I]` = [gate ‖ up]."""
    i = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :i]) * gate_up[..., i:]


class CudaCompiled:
    """Calls the compiled version on CUDA tensors, the plain one elsewhere."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled = None
        self.failed = False

    def __call__(self, *args):
        if not args[0].is_cuda or self.failed:
            return self.fn(*args)
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, dynamic=True, fullgraph=True)
        try:
            return self.compiled(*args)
        except Exception as e:  # noqa: BLE001 - a compiler problem must not take serving down
            log.warning("torch.compile of %s failed (%s): running it eagerly", self.fn.__name__, e)
            self.failed = True
            return self.fn(*args)


_FAILED: set[str] = set()  # fast-path kernels that raised once in this process


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (Triton on the CPU, for tests): no autotuning there."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def autotuning() -> bool:
    """Autotune Triton tiles on CUDA (the default). DSV_AUTOTUNE=0 uses one fixed tile per kernel
    instead: for quick GPU test runs, where tuning every test shape costs minutes of device time."""
    return not interpreting() and os.environ.get("DSV_AUTOTUNE", "1") != "0"


def triton_fast_path(t: torch.Tensor) -> bool:
    """Whether the Triton decode kernels serve tensor t: on CUDA, and on the CPU under
    TRITON_INTERPRET=1 (tests run the whole engine that way, in fp32)."""
    return t.is_cuda or interpreting()


def try_kernel(name: str, fn, *args):
    """fn(*args) for a Triton fast path, or None when it raised, now or before in this process,
    so the caller runs its plain torch ops instead. A kernel that does not compile on some GPU
    must not stop serving (logged once); a ValueError is a bad argument and propagates, and so
    does running out of GPU memory (transient, and the torch ops would need more, not less). The
    first call of each path is an eager warm-up step, before any CUDA-graph capture."""
    if name in _FAILED:
        return None
    try:
        return fn(*args)
    except (ValueError, torch.cuda.OutOfMemoryError):
        raise
    except Exception as e:  # noqa: BLE001
        log.warning("Triton %s failed (%s: %s); plain torch ops from now on", name, type(e).__name__, e)
        _FAILED.add(name)
        return None


rms_norm_op = CudaCompiled(rms_norm)
add_rms_norm_op = CudaCompiled(add_rms_norm)
rope_op = CudaCompiled(rope)
silu_mul_op = CudaCompiled(silu_mul)
