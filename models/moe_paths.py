"""The routed experts' paths that are not the Triton fused or block kernels (models/moe.py picks
the path): torch's grouped GEMM between a sort and a weighted un-permute, every expert on every
token, and the loop over the experts hit (the reference); and the expert weights in the compute
dtype they read (FP8 experts dequantized per call). `MoE` takes them from `RoutedPaths`.

Under expert parallelism (models/expert_parallel.py) the ids hold this rank's local experts and
`E` (the expert count) for pairs another rank computes: the dense path drops that column and the
loop stops before it; the grouped path is refused at load (MoE.__init__).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.fp8 import dequantize


def capturing(device: torch.device) -> bool:
    """Whether CUDA-graph capture is recording on `device`'s current stream."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class RoutedPaths:
    """Methods of `MoE` (models/moe.py) over its stacked expert weights `w13`, `w2` (and FP8 scales)."""

    def _expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's w13 `[2I, D]`, w2 `[D, I]` in the compute dtype; FP8 experts dequantized
        here, per call (fp32 temporaries of this one expert)."""
        if self.fp8_block is None:
            return self.w13[e], self.w2[e]
        q = self.fp8_block
        return (dequantize(self.w13[e], self.w13_scale[e], q, dtype),
                dequantize(self.w2[e], self.w2_scale[e], q, dtype))

    def _expert_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """All experts' w13, w2 in the compute dtype, for the grouped GEMM. FP8 experts are
        dequantized per call into one scratch copy of the layer, expert by expert (fp32
        temporaries of one expert at a time): the torch plan's path only, the Triton plan's block
        kernels read FP8 as it is."""
        if self.fp8_block is None:
            return self.w13, self.w2
        w13 = torch.empty(self.w13.shape, dtype=dtype, device=self.w13.device)
        w2 = torch.empty(self.w2.shape, dtype=dtype, device=self.w2.device)
        for e in range(w13.shape[0]):
            w13[e], w2[e] = self._expert(e, dtype)
        return w13, w2

    def _routed_grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """CUDA path with no host sync (CUDA-graph safe): (token, expert) pairs sorted by expert,
        two grouped GEMMs over the expert segments, weighted scatter-add back to tokens. With the
        Triton plan the sort, the row gather, the SwiGLU and the weighted sum are Triton kernels
        (the sort a counting sort in three launches, models/expert_sort.py); else torch ops."""
        w13, w2 = self._expert_weights(x.dtype)
        glue = self.triton_glue
        if glue is not None:
            token_of, pos, offs = self.sort_by_expert(ids, self.w13.shape[0])
            gate_up = torch._grouped_mm(glue.gather_rows(x, token_of), w13.transpose(-2, -1), offs=offs)  # [T*k, 2I]
            y = torch._grouped_mm(glue.silu_mul(gate_up), w2.transpose(-2, -1), offs=offs)  # [T*k, D]
            return glue.unpermute_sum(y, pos, weights)  # weights and the sum over k in one pass
        T, k = ids.shape
        flat = ids.flatten().to(torch.int32)  # int32 keys: half the radix-sort passes of int64
        order = flat.argsort(stable=True)
        # each expert's end offset in the sorted pairs, by binary search (no host sync, no atomics)
        ends = self._expert_ends.get(x.device)
        if ends is None:  # 1 .. E: made once, not one launch per layer and step
            ends = torch.arange(1, self.w13.shape[0] + 1, dtype=torch.int32, device=x.device)
            if not capturing(x.device):
                self._expert_ends[x.device] = ends
        offs = torch.searchsorted(flat[order], ends, out_int32=True)
        token_of = order // k
        xs = x[token_of]  # [T*k, D], grouped by expert
        gate_up = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs)  # [T*k, 2I]
        y = torch._grouped_mm(self.glue.silu_mul(gate_up), w2.transpose(-2, -1), offs=offs)
        y = y * weights.flatten()[order].unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, y)

    def _routed_dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """CUDA path without host syncs for dtypes the grouped GEMM lacks (fp32 tiny models):
        every expert on every token, weighted by its routing weight (0 where not chosen)."""
        E, I = self.w2.shape[0], self.w2.shape[-1]
        dense_w = torch.zeros(x.shape[0], E + 1, dtype=weights.dtype, device=x.device)
        dense_w.scatter_(1, ids, weights)  # [T, E + 1]: column E takes the pairs EP leaves out
        out = torch.zeros_like(x)
        for e in range(E):
            w13, w2 = self._expert(e, x.dtype)
            gate_up = F.linear(x, w13)
            y = F.linear(F.silu(gate_up[:, :I]) * gate_up[:, I:], w2)
            out += y * dense_w[:, e:e + 1].to(y.dtype)
        return out

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Plain path: tokens grouped by expert with one sort, a loop over the experts hit (FP8
        experts dequantized one by one, only those hit)."""
        T, k = ids.shape
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        E = self.w13.shape[0]  # ids E (expert parallel: other ranks' pairs) sort last and are left out
        counts = torch.bincount(flat, minlength=E)[:E].tolist()
        token_of = order // k  # token index of each sorted (token, slot) pair
        out = torch.zeros_like(x)
        start = 0
        I = self.w2.shape[-1]
        for e, n in enumerate(counts):
            if n == 0:
                continue
            w13, w2 = self._expert(e, x.dtype)
            rows = token_of[start:start + n]
            gate_up = F.linear(x[rows], w13)  # [n, 2I]
            h = F.silu(gate_up[:, :I]) * gate_up[:, I:]
            y = F.linear(h, w2)  # [n, D]
            w = weights.flatten()[order[start:start + n]].unsqueeze(-1)
            out.index_add_(0, rows, (y * w).to(x.dtype))
            start += n
        return out
