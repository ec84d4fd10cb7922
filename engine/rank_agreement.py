"""Every TP rank samples for itself; this checks that the ranks keep sampling the same tokens.

Why no broadcast of rank 0's tokens: the logits every rank samples from are the output of one
all-gather (bit-identical on every rank), every rank seeds the same RNG state (the engine seed,
per-request seeds) and draws from it in the same order, so the ranks' samples are equal by
construction. A broadcast would put a collective between sampling and the next step's input on
every step (and, with async scheduling, tie the next launch to it), to guard against a fault
that should never happen. Instead each rank folds its sampled ids into a running CRC32 and every
`interval` sampling steps the ranks compare digests over the gloo control group (a few bytes, on
the host, off the GPU stream). A mismatch means the KV caches have begun to differ between ranks
(logits not bit-identical, RNG state out of step): it stops the engine with an error instead of
serving text computed from inconsistent ranks.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch
import torch.distributed as dist

from common import distributed as pd


class RankDivergenceError(RuntimeError):
    pass


class RankAgreement:
    """Running digest of this rank's sampled ids, compared across TP ranks every `interval` steps."""

    def __init__(self, interval: int):
        self.interval = interval  # 0: never compare
        self.steps = 0  # sampling steps recorded
        self.checked = 0  # steps up to which the ranks agreed
        self.digest = 0

    def record(self, ids: np.ndarray) -> None:
        """Fold one step's sampled ids (int64, sampler row order) in; compare when one is due."""
        self.steps += 1
        self.digest = zlib.crc32(np.ascontiguousarray(ids, dtype=np.int64).tobytes(), self.digest)
        if self.interval and self.steps % self.interval == 0:
            self.check()

    def check(self) -> None:
        tp = pd.tp()
        if tp.size == 1:
            return
        mine = torch.tensor([self.steps, self.digest], dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(tp.size)]
        dist.all_gather(every, mine, group=pd.cpu_group())
        seen = [tuple(t.tolist()) for t in every]
        if len(set(seen)) > 1:
            by_rank = ", ".join(f"rank {r}: {d:#010x}" for r, (_, d) in enumerate(seen))
            raise RankDivergenceError(
                f"tensor-parallel ranks sampled different tokens in sampling steps "
                f"{self.checked + 1}..{self.steps} (digests {by_rank}); every rank samples for "
                f"itself, which needs bit-identical logits and RNG state on all ranks")
        self.checked = self.steps
