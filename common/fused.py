"""Elementwise glue of a decoder layer, written once in plain torch and compiled on CUDA.

A decode step at small batch is bound by kernel count, not bytes: eager RMSNorm, RoPE and
SwiGLU are ~6 kernels each. Where the kernel plan says `compile` (CUDA, Triton plan) the layers
call them through `torch.compile` (`COMPILED`: one fused kernel each, CUDA-graph safe), else as
written (`EAGER`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.kernel_plan import TRITON


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then norm: returns (x + h, rms_norm(x + h))."""
    s = x + h
    return s, rms_norm(s, w, eps)


@dataclass(frozen=True)
class PairRows:
    """An MoE output left unsummed: `part [T, KT, D]` (fp32), each token's KT weighted pair rows
    (routed and folded shared experts), whose sum rounded to `dtype` is the output. The next
    residual add + RMSNorm takes it as its h (common/triton_norm.py) and sums in the same kernel,
    so the MoE's pair-sum launch goes (`MoE.forward(defer_sum=True)`)."""

    part: torch.Tensor
    dtype: torch.dtype

    def sum(self) -> torch.Tensor:
        """The summed output `[T, D]`: the KT rows added in order in fp32, then rounded, as the
        pair-sum kernel does."""
        acc = self.part[:, 0].clone()
        for j in range(1, self.part.shape[1]):
            acc += self.part[:, j]
        return acc.to(self.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x `[T, ..., R]` by cos/sin `[T, 1.., R/2]`."""
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)


def apply_rope(cos_sin: torch.Tensor, x: torch.Tensor, rope_fn=rope) -> torch.Tensor:
    """Rotate x `[T, ..., R]` by its tokens' [cos | sin] rows `cos_sin [T, R]`
    (`YarnRotaryEmbedding.at`) with `rope_fn` (`rope`, or a glue's compiled one)."""
    cos, sin = cos_sin.chunk(2, dim=-1)  # [T, R/2] each
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    return rope_fn(x, cos.view(shape), sin.view(shape))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on `[.., 2I]` = [gate ‖ up]."""
    i = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :i]) * gate_up[..., i:]


# Dynamo keeps its compiled variants per code object, so every engine of a process shares one
# cache per glue function: each dtype, tensor rank, stride pattern and size-1 specialization
# (decode at batch 1) is a variant, and a process that builds several engines (tests, a server
# with the MTP drafter and FP8 layers) passes dynamo's default of 8. With fullgraph=True that
# limit is a hard failure, so the glue's compilations get a higher one.
RECOMPILE_LIMIT = 64


class Compiled:
    """`fn` through `torch.compile` (one fused kernel, CUDA-graph safe), compiled on first call.
    A compiler failure raises: the warm-up meets it and names `--kernels auto,compile=0`."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled = None
        self.__name__ = fn.__name__

    def __call__(self, *args):
        if self.compiled is None:
            import torch._dynamo.config as dynamo_config
            dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
            self.compiled = torch.compile(self.fn, dynamic=True, fullgraph=True)
        return self.compiled(*args)


@dataclass(frozen=True)
class Glue:
    """The elementwise glue a layer calls, eager or compiled (the plan's `compile`)."""

    rms_norm: Callable
    add_rms_norm: Callable
    rope: Callable  # rope(x, cos, sin); use `apply_rope(glue, cos_sin, x)`
    silu_mul: Callable


EAGER = Glue(rms_norm, add_rms_norm, rope, silu_mul)
COMPILED = Glue(Compiled(rms_norm), Compiled(add_rms_norm), Compiled(rope), Compiled(silu_mul))


_TRITON_NORMS: dict[Glue, Glue] = {}


def glue_for(plan) -> Glue:
    """The glue of a kernel plan: compiled or eager (`compile`), with the norms as Triton kernels
    where the plan's `norm` is triton (common/triton_norm.py: cheaper for the host to launch)."""
    glue = COMPILED if plan.compile else EAGER
    if plan.norm != TRITON:
        return glue
    if glue not in _TRITON_NORMS:
        from common import triton_norm  # triton: CUDA installs only
        _TRITON_NORMS[glue] = dataclasses.replace(glue, rms_norm=triton_norm.rms_norm,
                                                  add_rms_norm=triton_norm.add_rms_norm)
    return _TRITON_NORMS[glue]
