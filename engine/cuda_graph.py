"""CUDA graphs for pure-decode steps, one per batch-size bucket.

A decode step's work is a fixed sequence of kernels whose shapes depend only on the batch size,
so it is captured once per bucket and replayed: the inputs and metadata live in persistent
buffers, real rows are copied in and the rest of the bucket is padding (slot -1: nothing
written; sequence length 0: nothing read). Prefill and mixed steps run eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

from attention.metadata import DecodeMetadata, MLAMetadata

log = logging.getLogger(__name__)


def default_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16))
    return [b for b in sizes if b <= max_num_seqs] or [1]


class DecodeGraphs:
    def __init__(self, model, kv_caches: list[torch.Tensor], max_blocks_per_seq: int,
                 buckets: list[int], device: torch.device):
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.buckets = sorted(buckets)
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _meta(self, b: int) -> MLAMetadata:
        return MLAMetadata(num_decodes=b, num_decode_tokens=b, num_prefills=0, num_prefill_tokens=0,
                           slot_mapping=self.slot_mapping[:b],
                           decode=DecodeMetadata(self.block_table[:b], self.seq_lens[:b]), prefill=None)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        torch.cuda.empty_cache()  # torch.cuda.graph() empties the cache itself: measure from there
        free0 = torch.cuda.mem_get_info()[0]
        self.seq_lens.fill_(1)  # capture reads one (garbage) key per row; replays read real ones
        for b in reversed(self.buckets):  # largest first: the shared pool is sized by it
            args = (self.input_ids[:b], self.positions[:b], self.kv_caches, self._meta(b))
            for _ in range(2):  # warm up: Triton compiles, allocator settles
                self.model(*args)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.outputs[b] = self.model(*args)
            self.pool = g.pool()
            self.graphs[b] = g
        self.seq_lens.zero_()
        torch.cuda.synchronize()
        log.info("captured %d decode CUDA graphs (batch %d..%d) in %.1f s, %.2f GiB",
                 len(self.graphs), self.buckets[0], self.buckets[-1], time.perf_counter() - t0,
                 (free0 - torch.cuda.mem_get_info()[0]) / 2**30)

    def bucket_for(self, batch: int) -> int | None:
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: MLAMetadata) -> torch.Tensor:
        """Replay the bucket's graph for a pure-decode batch; returns hidden `[B, hidden]`."""
        B = input_ids.shape[0]
        b = self.bucket_for(B)
        d = meta.decode
        self.input_ids[:B].copy_(input_ids, non_blocking=True)
        self.positions[:B].copy_(positions, non_blocking=True)
        self.slot_mapping[:B].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:B].copy_(d.seq_lens, non_blocking=True)
        self.block_table[:B, : d.block_table.shape[1]].copy_(d.block_table, non_blocking=True)
        if b > B:
            self.slot_mapping[B:b].fill_(-1)
            self.seq_lens[B:b].zero_()
        self.graphs[b].replay()
        return self.outputs[b][:B]
