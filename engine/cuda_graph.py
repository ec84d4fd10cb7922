"""CUDA graphs for pure-decode steps, one per (batch-size bucket, decode query length).

A decode step's work is a fixed sequence of kernels whose shapes depend only on the batch size
and the query length (1, or 1 + k with k speculative tokens), so it is captured once per bucket
and length and replayed: the inputs and metadata live in persistent buffers, real rows are
copied in and the rest of the bucket is padding (slot -1: nothing written; sequence length 0:
nothing read). Prefill and mixed steps run eagerly, and so do decode steps whose decodes differ
in length (padded to the longest for the attention) or have another length.

The same class captures the MTP drafter's step (engine/mtp_drafter.py `MTPStep`), which also
takes each row's hidden state: `hidden=(width, dtype)` gives it a persistent input of its own.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from attention.metadata import DecodeMetadata, MLAMetadata
from common.launch_settings import pdl, use_pdl

log = logging.getLogger(__name__)


def smallest_at_least(sizes: list[int], n: int) -> int | None:
    """The smallest of the sorted `sizes` that is >= n, or None: the captured graph a step of n
    rows (or sequences) replays, padded to it."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def default_buckets(max_num_seqs: int, sizes: tuple[int, ...] | None = None) -> list[int]:
    """The decode batch sizes captured: `sizes` (--cuda-graph-sizes; EngineArgs checks that one
    is at most max_num_seqs), else 1, 2, 4, 8 and every 16 up to 256; those above max_num_seqs
    left out (a decode batch never has more sequences)."""
    if sizes is None:
        return [b for b in [1, 2, 4, 8, *range(16, 257, 16)] if b <= max_num_seqs]
    kept = sorted({b for b in sizes if b <= max_num_seqs})
    dropped = len(set(sizes)) - len(kept)
    if dropped:
        log.info("decode CUDA-graph sizes: %d above --max-num-seqs %d left out (up to %d)",
                 dropped, max_num_seqs, max(sizes))
    return kept


class DecodeGraphs:
    """`model(input_ids, positions, kv_caches, meta[, hidden])` captured per (batch bucket, q_len);
    `kv_caches` is passed through as given (the model's list of layer caches, or one cache)."""

    def __init__(self, model, kv_caches, max_blocks_per_seq: int,
                 buckets: list[int], device: torch.device, q_lens: tuple[int, ...] = (1,),
                 hidden: tuple[int, torch.dtype] | None = None, pdl_max_batch: int = 0):
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.pdl_max_batch = pdl_max_batch  # buckets up to this batch are captured with PDL
        self.buckets = sorted(buckets)
        self.q_lens = tuple(sorted(set(q_lens)))
        n = self.buckets[-1]
        rows = n * self.q_lens[-1]  # token rows of the largest graph
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.q_pos = torch.zeros(rows, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.hidden = None if hidden is None else torch.zeros(rows, hidden[0], dtype=hidden[1], device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.pool = None

    def _meta(self, b: int, q: int) -> MLAMetadata:
        decode = DecodeMetadata(self.block_table[:b], self.seq_lens[:b], q_len=q,
                                q_pos=self.q_pos[: b * q] if q > 1 else None)
        return MLAMetadata(num_decodes=b, num_decode_tokens=b * q, num_prefills=0, num_prefill_tokens=0,
                           slot_mapping=self.slot_mapping[: b * q], decode=decode, prefill=None)

    def _args(self, b: int, q: int) -> tuple:
        args = (self.input_ids[: b * q], self.positions[: b * q], self.kv_caches, self._meta(b, q))
        return args if self.hidden is None else args + (self.hidden[: b * q],)

    @torch.inference_mode()
    def capture(self, what: str = "decode") -> None:
        t0 = time.perf_counter()
        torch.cuda.empty_cache()  # torch.cuda.graph() empties the cache itself: measure from there
        free0 = torch.cuda.mem_get_info()[0]
        pdl_everywhere = pdl()  # pdl=1: every launch, eager steps too
        self.seq_lens.fill_(1)  # capture reads one (garbage) key per row; replays read real ones
        self.q_pos.zero_()  # every capture query sees that key
        for q in reversed(self.q_lens):
            for b in reversed(self.buckets):  # largest first: the shared pool is sized by it
                args = self._args(b, q)
                # PDL (a launch attribute and a kernel variant) is baked into the graph: set it for
                # the warm-up too, so the variant is compiled and tuned before capture
                use_pdl(pdl_everywhere or b <= self.pdl_max_batch)
                try:
                    for _ in range(2):  # warm up: Triton compiles, allocator settles
                        self.model(*args)
                    torch.cuda.synchronize()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=self.pool):
                        self.outputs[b, q] = self.model(*args)
                finally:
                    use_pdl(pdl_everywhere)
                self.pool = g.pool()
                self.graphs[b, q] = g
        self.seq_lens.zero_()
        torch.cuda.synchronize()
        log.info("captured %d %s CUDA graphs (batch %d..%d, query length %s%s) in %.1f s, %.2f GiB",
                 len(self.graphs), what, self.buckets[0], self.buckets[-1], "/".join(map(str, self.q_lens)),
                 "; all with PDL" if pdl_everywhere else
                 f"; PDL up to batch {self.pdl_max_batch}" if self.pdl_max_batch else "",
                 time.perf_counter() - t0, (free0 - torch.cuda.mem_get_info()[0]) / 2**30)

    def bucket_for(self, batch: int, q_len: int = 1) -> int | None:
        """The smallest captured batch size >= `batch` for decodes of `q_len` tokens, or None."""
        if q_len not in self.q_lens:
            return None
        return smallest_at_least(self.buckets, batch)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: MLAMetadata,
            hidden: torch.Tensor | None = None, bucket: int | None = None) -> torch.Tensor:
        """Replay the bucket's graph for a pure-decode batch (with `hidden` rows when captured
        with them); returns the output rows `[B*q_len, width]`. `bucket`: that captured size
        (>= the batch) instead of the smallest that fits (data parallelism: every DP rank's)."""
        d = meta.decode
        B, q = meta.num_decodes, d.q_len
        b = bucket or self.bucket_for(B, q)
        T = B * q
        self.input_ids[:T].copy_(input_ids, non_blocking=True)
        self.positions[:T].copy_(positions, non_blocking=True)
        if (hidden is None) != (self.hidden is None):
            raise ValueError("DecodeGraphs.run: hidden rows are given exactly when captured with them")
        if hidden is not None:
            self.hidden[:T].copy_(hidden, non_blocking=True)
        self.slot_mapping[:T].copy_(meta.slot_mapping, non_blocking=True)
        if d.q_pos is not None:
            self.q_pos[:T].copy_(d.q_pos, non_blocking=True)
        self.seq_lens[:B].copy_(d.seq_lens, non_blocking=True)
        self.block_table[:B, : d.block_table.shape[1]].copy_(d.block_table, non_blocking=True)
        if b > B:
            self.slot_mapping[T: b * q].fill_(-1)
            self.seq_lens[B:b].zero_()
        self.graphs[b, q].replay()
        return self.outputs[b, q][:T]
