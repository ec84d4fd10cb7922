"""CUDA graphs of the steps that are not captured pure-decode batches, in pieces between the
layers' attention cores.

A step with prompts or chunks (and decodes beside them) runs the model as pieces
(models/deepseek.py `DeepseekModel.first` / `after`): everything between two attention cores
(o_proj, the norms, the MoE or MLP, the next layer's projections) has shapes fixed by the step's
token count, while the attention core (`DeepseekAttention.attend`: the cache write, decode and
prefill attention, context chunks) depends on the step's metadata. The pieces are captured once
per token count of `sizes` and replayed; the cores run eagerly between them and write their
output into a persistent buffer that the next piece reads. A step of T tokens replays the
smallest captured size >= T. Its rows past T (padding) hold earlier steps' finite values (the
buffers start zeroed), pass only through row-wise work (norms, GEMMs, the MoE's per-row routing)
and are dropped, so they never reach a real row.

Why: the eager forward of an 8192-token V2-Lite step took the host about as long as its 75 ms of
GPU work (RESULTS.md), so Python and launches paced the step; a replay is one call per piece.

Memory: every piece of every size shares one graph pool. Within a step the pieces replay in the
order they were captured, and a piece's outputs are read only by the next core and the next
piece. So once piece i + 1 is captured, piece i's outputs are kept as tensors that do not own
their memory (`unowned`) and the pool may give that memory to later pieces: at replay they
overwrite it only after its last reader ran. The last piece's output (the hidden rows) stays
owned: the caller reads it after the step.
"""

from __future__ import annotations

import logging
import time

import torch

from attention.metadata import MLAMetadata
from engine.cuda_graph import smallest_at_least

log = logging.getLogger(__name__)


class _DeviceMemory:
    """CUDA array interface (version 2: no stream to synchronize) over memory owned elsewhere."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 2}


def unowned(t: torch.Tensor) -> torch.Tensor:
    """A tensor over `t`'s memory (same dtype, shape, strides) that does not keep it allocated."""
    st = t.untyped_storage()
    raw = torch.as_tensor(_DeviceMemory(st.data_ptr(), st.nbytes()), device=t.device)
    return raw.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


class PiecewiseGraphs:
    """`model.model`'s pieces captured per token count; `run` replays them around eager cores."""

    def __init__(self, model, kv_caches: list[torch.Tensor], sizes: list[int], device: torch.device,
                 dtype: torch.dtype):
        self.inner, self.kv_caches = model.model, kv_caches
        self.sizes = sorted(set(sizes))
        attn = self.inner.layers[0].self_attn
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.o = torch.zeros(n, attn.Hl, attn.mla.V, dtype=dtype, device=device)  # the cores' output
        # per size: each piece's graph and its outputs ((residual, q, kv), or the hidden rows last)
        self.chains: dict[int, list[tuple[torch.cuda.CUDAGraph, object]]] = {}
        self.pool = None

    def size_for(self, num_tokens: int) -> int | None:
        """The smallest captured size >= num_tokens, or None."""
        return smallest_at_least(self.sizes, num_tokens)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        torch.cuda.empty_cache()
        free0 = torch.cuda.mem_get_info()[0]
        L = len(self.inner.layers)
        for T in reversed(self.sizes):  # largest first: the shared pool is sized by it
            chain, prev = [], None
            for i in range(L + 1):
                if i == 0:
                    def piece(T=T):
                        return self.inner.first(self.input_ids[:T])
                else:
                    def piece(T=T, i=i, residual=prev[0]):
                        return self.inner.after(i - 1, self.o[:T], residual)
                for _ in range(2):  # warm up: compiles, tuning, allocator; inputs hold values (below)
                    piece()
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    out = piece()
                self.pool = g.pool()
                g.replay()  # its outputs now hold values: the next piece's warm-up reads them
                if i < L:
                    chain.append((g, tuple(unowned(t) for t in out)))
                else:
                    chain.append((g, out))
                prev = out  # owned until the next piece is captured (it reads them), then released
            self.chains[T] = chain
            del prev, out
        torch.cuda.synchronize()
        log.info("captured %d piecewise CUDA graphs (%d pieces each, token counts %s) in %.1f s, %.2f GiB",
                 len(self.chains), L + 1, ",".join(map(str, self.sizes)), time.perf_counter() - t0,
                 (free0 - torch.cuda.mem_get_info()[0]) / 2**30)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: MLAMetadata,
            size: int | None = None) -> torch.Tensor:
        """The hidden rows `[T, hidden]` of a step of T = len(input_ids) tokens (T <= the largest
        size): the pieces of the smallest size >= T (or of `size`, a captured one >= T) replayed,
        the attention cores run eagerly on the real rows between them."""
        T = input_ids.shape[0]
        chain = self.chains[size or self.size_for(T)]
        self.input_ids[:T].copy_(input_ids, non_blocking=True)
        cos_sin = self.inner.rotary_emb.at(positions)
        o = self.o[:T]
        chain[0][0].replay()
        for i, (layer, cache) in enumerate(zip(self.inner.layers, self.kv_caches)):
            _, q, kv = chain[i][1]
            layer.self_attn.attend(q[:T], kv[:T], cos_sin, cache, meta, out=o)
            chain[i + 1][0].replay()
        return chain[-1][1][:T]
