"""Building blocks: RMSNorm, YaRN RoPE, tensor-parallel linears and vocab-parallel embedding.

Sharding is declared per parameter (`param.tp_dim`: the dimension split over TP ranks, or None
for replicated); the loader reads only this rank's slice (DESIGN.md §6, STYLE.md rule 4). A
packed parameter holds several checkpoint tensors (`param.shards`, one `Shard` each: q_a_proj and
kv_a_proj_with_mqa as one GEMM, gate and up, the stacked experts); the loader writes each
checkpoint tensor's slice straight into its place, so the module tree is the same before and
after loading.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common import distributed as pd
from common.launch_settings import interpreting
from models.config import RopeConfig, yarn_mscale
from models.fp8 import FP8, dequantize
from common.fused import EAGER, Glue


@dataclass(frozen=True)
class Shard:
    """One checkpoint tensor of a packed parameter: `name` relative to the parameter's module
    ("../" for its parent's), its full checkpoint `shape`, `tp_dim` the checkpoint dimension split
    over TP ranks (None: replicated), and `index` the place of this rank's slice in the parameter.
    With `stack`, the slice is cut into equal pieces along that checkpoint dimension, stacked on
    the index's leading dimension (the shared experts, folded into expert rows)."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    index: tuple
    stack: int | None = None


def packed_param(shape: tuple[int, ...], dtype: torch.dtype, shards: list[Shard]) -> nn.Parameter:
    """An uninitialised parameter `shape` (this rank's) filled by the loader from `shards`."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.shards = shards
    p.tp_split = (pd.tp().size, pd.tp().rank)
    return p


def shard_param(shape: tuple[int, ...], tp_dim: int | None, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised parameter holding this rank's slice, tagged with its sharding rule."""
    shape = list(shape)
    if tp_dim is not None:
        size = pd.tp().size
        if shape[tp_dim] % size:
            raise ValueError(f"dimension {shape[tp_dim]} is not divisible by tensor parallel size {size}")
        shape[tp_dim] //= size
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.tp_dim = tp_dim
    p.tp_split = (pd.tp().size, pd.tp().rank)
    return p


def split_of(p: torch.Tensor) -> tuple[int, int]:
    """(ranks, this rank's index) that a parameter's `tp_dim` is split over: the TP group's as the
    parameter was made (the MoE group's for the MoE layers under data parallelism,
    common/distributed.py `moe_scope`)."""
    return getattr(p, "tp_split", None) or (pd.tp().size, pd.tp().rank)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, glue: Glue = EAGER):
        super().__init__()
        self.eps, self.glue = eps, glue
        self.weight = shard_param((dim,), None, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.glue.rms_norm(x, self.weight, self.eps)


class Linear(nn.Module):
    """y = x W^T with W `[out, in]` sharded by `tp_dim` (0: column-parallel, 1: row-parallel).

    A row-parallel linear all-reduces its output unless `reduce=False` (the caller reduces).
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 tp_dim: int | None = None, reduce: bool = True,
                 fp8_block: tuple[int, int] | None = None):
        super().__init__()
        self.dtype, self.fp8_block = dtype, fp8_block
        self.reduce = reduce and tp_dim == 1
        self.fp8_gemm = "auto"  # the plan's W8A8 GEMM backend, for weights kept in FP8
        self.fp8_splitk = False  # the plan's fp8_gemm_splitk
        self.fp8_fuse_act = False  # the plan's fp8_gemm_fuse_act
        self.fp8_serial = False  # the plan's fp8_gemm_splitk_serial
        self.fp8_w8a16_max = 0  # the plan's fp8_gemm_w8a16_max_tokens
        self.skinny_max = 0  # the plan's gemm_skinny_max_tokens
        if fp8_block is None:
            self.weight = shard_param((out_features, in_features), tp_dim, dtype)
            return
        # FP8 checkpoint: fp8 weight + one scale per block; a TP split must keep whole blocks.
        if tp_dim is not None:
            size = (out_features, in_features)[tp_dim] // pd.tp().size
            if size % fp8_block[tp_dim]:
                raise ValueError(f"tensor parallel size {pd.tp().size} would split a "
                                 f"{fp8_block[0]}x{fp8_block[1]} FP8 block: a {out_features}x{in_features} "
                                 f"weight split along dim {tp_dim} gives {size} per rank")
        self.weight = shard_param((out_features, in_features), tp_dim, FP8)
        self.weight_scale_inv = shard_param(
            (-(-out_features // fp8_block[0]), -(-in_features // fp8_block[1])), tp_dim, torch.float32)

    def dequantize_weights(self) -> None:
        """Post-load: replace an FP8 weight by its dequantized compute-dtype copy."""
        if self.fp8_block is None:
            return
        w = dequantize(self.weight, self.weight_scale_inv, self.fp8_block, self.dtype)
        del self.weight_scale_inv
        self.weight = nn.Parameter(w, requires_grad=False)
        self.fp8_block = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_block is not None and 0 < x.numel() <= self.fp8_w8a16_max * x.shape[-1] and (
                x.is_cuda or interpreting()):  # kept in FP8, few rows: the weight-streaming kernel
            from models.fp8_w8a16 import w8a16_linear  # triton: CUDA installs only
            y = w8a16_linear(x.reshape(-1, x.shape[-1]), self.weight, self.weight_scale_inv)
            y = y.view(*x.shape[:-1], y.shape[-1])
        elif self.fp8_block is not None:  # kept in FP8 for the W8A8 block GEMM (--fp8-gemm)
            from models.fp8_gemm import fp8_linear  # triton: CUDA installs only
            y = fp8_linear(x, self.weight, self.weight_scale_inv, self.fp8_gemm, self.fp8_splitk,
                           self.fp8_fuse_act, self.fp8_serial)
        elif 0 < x.shape[0] <= self.skinny_max and x.dim() == 2:
            from models.skinny_gemm import skinny_linear  # triton: CUDA installs only
            y = skinny_linear(x, self.weight)
        else:
            y = F.linear(x, self.weight)
        return pd.tp_all_reduce(y) if self.reduce else y


class PackedLinear(Linear):
    """Column-parallel or replicated projections of one input as one GEMM: `parts` are
    (checkpoint module name, out_features, tp_dim 0 or None), their rows stacked in that order
    (`sizes`: each part's rows on this rank). FP8 weights keep one scale per 128-row block, each
    part's blocks after the previous part's; a kept-FP8 GEMM needs every part but the last to
    fill whole blocks."""

    def __init__(self, in_features: int, parts: list[tuple[str, int, int | None]], dtype: torch.dtype,
                 fp8_block: tuple[int, int] | None = None, keep_fp8: bool = False):
        nn.Module.__init__(self)
        self.dtype, self.fp8_block, self.reduce = dtype, fp8_block, False
        self.fp8_gemm, self.fp8_splitk, self.skinny_max = "auto", False, 0
        self.fp8_fuse_act = self.fp8_serial = False
        tp = pd.tp().size
        self.sizes = [out // tp if tp_dim == 0 else out for _, out, tp_dim in parts]
        for (name, out, tp_dim), n in zip(parts, self.sizes):
            if tp_dim == 0 and out % tp:
                raise ValueError(f"{name}: dimension {out} is not divisible by tensor parallel size {tp}")
            if fp8_block is not None and tp_dim == 0 and n % fp8_block[0]:
                raise ValueError(f"tensor parallel size {tp} would split a {fp8_block[0]}x{fp8_block[1]} "
                                 f"FP8 block: {name}'s {out} rows give {n} per rank")
        starts = [sum(self.sizes[:i]) for i in range(len(parts))]
        self.weight = packed_param((sum(self.sizes), in_features), FP8 if fp8_block else dtype, [
            Shard(f"../{name}.weight", (out, in_features), tp_dim, (slice(r0, r0 + n),))
            for (name, out, tp_dim), r0, n in zip(parts, starts, self.sizes)])
        if fp8_block is None:
            return
        bn, bk = fp8_block
        if keep_fp8 and any(n % bn for n in self.sizes[:-1]):
            raise ValueError(f"--fp8-gemm (FP8 weights kept in FP8, the default on CUDA): "
                             f"{', '.join(p[0] for p in parts)} ({self.sizes} rows) do not pack on {bn}-row "
                             f"FP8 blocks; --no-fp8-gemm dequantizes them")
        self.block_rows = [-(-n // bn) for n in self.sizes]  # each part's scale rows
        b0 = [sum(self.block_rows[:i]) for i in range(len(parts))]
        self.weight_scale_inv = packed_param((sum(self.block_rows), -(-in_features // bk)), torch.float32, [
            Shard(f"../{name}.weight_scale_inv", (-(-out // bn), -(-in_features // bk)), tp_dim, (slice(r, r + nb),))
            for (name, out, tp_dim), r, nb in zip(parts, b0, self.block_rows)])

    def dequantize_weights(self) -> None:
        """Post-load: the compute-dtype weight, part by part (each part's blocks start anew)."""
        if self.fp8_block is None:
            return
        w, s = self.weight.split(self.sizes), self.weight_scale_inv.split(self.block_rows)
        deq = torch.cat([dequantize(a, b, self.fp8_block, self.dtype) for a, b in zip(w, s)])
        del self.weight_scale_inv
        self.weight = nn.Parameter(deq, requires_grad=False)
        self.fp8_block = None


class VocabParallelEmbedding(nn.Module):
    """Rows split by vocabulary range over TP ranks; masked lookup then all-reduce."""

    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.padded_vocab = math.ceil(vocab_size / pd.tp().size) * pd.tp().size
        self.weight = shard_param((self.padded_vocab, dim), 0, dtype)
        self.weight.vocab_size = vocab_size  # rows past it are padding, zero-filled by the loader
        self.start = pd.tp().rank * self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if pd.tp().size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        ok = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        out = out * ok.unsqueeze(-1).to(out.dtype)
        return pd.tp_all_reduce(out)


class ParallelLMHead(nn.Module):
    """Logits `[N, vocab]`: each rank computes its vocabulary slice, then all-gather."""

    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.vocab_size = vocab_size
        padded = math.ceil(vocab_size / pd.tp().size) * pd.tp().size
        self.weight = shard_param((padded, dim), 0, dtype)
        self.weight.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)
        return pd.tp_all_gather(logits, dim=-1)[..., : self.vocab_size]


class YarnRotaryEmbedding(nn.Module):
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ... (GPT-J style, as in DeepSeek's weights).

    With YaRN the frequencies blend interpolated and extrapolated ones over a linear ramp between
    the beta_fast / beta_slow correction dims, and cos/sin carry mscale / mscale_all_dim.
    """

    def __init__(self, rot_dim: int, max_positions: int, rope: RopeConfig):
        super().__init__()
        inv_freq = 1.0 / rope.theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
        mscale = 1.0
        if rope.type == "yarn":
            inv_freq = self._yarn_inv_freq(inv_freq, rot_dim, rope)
            mscale = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
        self.max_positions = max_positions
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_pos, R/2]
        # [cos | sin] per position, one row per token gathered once per step (`at`), not per layer
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1) * mscale, persistent=False)

    @staticmethod
    def _yarn_inv_freq(inv_freq_extra: torch.Tensor, dim: int, rope: RopeConfig) -> torch.Tensor:
        def correction_dim(rotations: float) -> float:
            return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) \
                / (2 * math.log(rope.theta))

        low = max(math.floor(correction_dim(rope.beta_fast)), 0)
        high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extra_weight = 1.0 - ramp  # 1: keep the original frequency (high-frequency dims)
        inv_freq_inter = inv_freq_extra / rope.factor
        return inv_freq_inter * (1 - extra_weight) + inv_freq_extra * extra_weight

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """The rows `[T, R]` = [cos | sin] of `positions [T]`, for `apply_rope` in every layer."""
        return self.cos_sin[positions]
