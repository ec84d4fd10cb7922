"""Data parallelism in the engine core (vLLM's `--data-parallel-size`): `dp` schedulers, one per
DP rank, behind the one-scheduler interface the core drives.

Each DP rank is a TP group of worker processes with its own KV cache; the core gives each new
request to a DP rank (`DataParallelScheduler.add_request`: the fewest unfinished requests, or,
within a slack of that, the longest prefix-cache hit), and every step schedules each DP rank on
its own. Every DP rank runs every step, since the MoE layers are
split over all ranks and gather every DP rank's tokens (models/data_parallel_moe.py): a step
carries `dp_rows`, the rows every DP rank pads its MoE input to (at least the most tokens any DP
rank runs, rounded up to a captured CUDA-graph size where one takes it), and a DP rank with none
joins the MoE layers' collectives alone. A step with no tokens on any rank runs nowhere.

One core process schedules every DP rank (as one scheduler with dp times the requests would), so
the front end and the output processing see one engine; the metrics see the sum and each DP rank
(`stats_per_engine`, vLLM's `engine` label).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Iterable

from engine.cuda_graph import smallest_at_least
from scheduler.config import SchedulerConfig
from scheduler.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from scheduler.stats import SchedulerStats, SpecDecodeStats


@dataclass
class DPSchedulerOutput:
    """One step of every DP rank: `parts[d]` is DP rank d's."""

    parts: list[SchedulerOutput]

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(p.total_num_scheduled_tokens for p in self.parts)

    @property
    def is_empty(self) -> bool:
        return all(p.is_empty for p in self.parts)

    @cached_property
    def num_scheduled_tokens(self) -> dict[str, int]:
        """Every part's, merged once (the core looks ids up in it as requests arrive)."""
        return {rid: n for p in self.parts for rid, n in p.num_scheduled_tokens.items()}


@dataclass
class DPModelRunnerOutput:
    """The outputs of one step: `parts[d]` from DP rank d's TP rank 0."""

    parts: list[ModelRunnerOutput]


def padded_rows(so: SchedulerOutput, decode_sizes: list[int], piecewise_sizes: list[int]) -> int:
    """The rows one DP rank's step would run as on its own: the smallest captured CUDA-graph size
    that takes it (a decode batch's for a step of one-token requests, else a piecewise graph's),
    else its token count (eager)."""
    T = so.total_num_scheduled_tokens
    if not T:
        return 0
    decode_only = len(so.num_scheduled_tokens) == T  # every request one token (the runner's decodes)
    return (decode_only and smallest_at_least(decode_sizes, T)) or smallest_at_least(piecewise_sizes, T) or T


def summed_stats(parts: list[SchedulerStats]) -> SchedulerStats:
    """DP ranks' counts as one engine's: summed, the KV usage over all their blocks."""
    total = sum(p.num_total_blocks for p in parts)
    summed = {f.name: sum(getattr(p, f.name) for p in parts) for f in fields(SchedulerStats)
              if f.name not in ("kv_cache_usage", "spec")}
    spec = None
    if parts[0].spec is not None:  # speculative decoding's counters, summed
        spec = SpecDecodeStats(*(sum(getattr(p.spec, f) for p in parts)
                                 for f in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")),
                               [sum(c) for c in zip(*(p.spec.accepted_per_pos for p in parts))])
    used = sum(p.kv_cache_usage * p.num_total_blocks for p in parts)
    return SchedulerStats(**summed, kv_cache_usage=used / total if total else 0.0, spec=spec)


class Chained:
    """Every DP rank's queue (running or waiting) as one, read live: its length and its requests."""

    def __init__(self, queues: list):
        self.queues = queues

    def __len__(self) -> int:
        return sum(map(len, self.queues))

    def __iter__(self):
        return (r for q in self.queues for r in q)


class DataParallelScheduler:
    """`dp` Schedulers of `config` (each its own block pool) as one. `graph_sizes`: the decode batch
    sizes and piecewise token counts the ranks captured as CUDA graphs (engine/worker.py
    `graph_sizes`)."""

    ROUTED_BLOCKS = 1 << 16  # the prompt blocks `_routed` remembers (LRU; ~10 MB of hashes)

    def __init__(self, config: SchedulerConfig, dp: int, graph_sizes: tuple[list[int], list[int]] = ([], [])):
        self.config = config  # each DP rank's: capacity_tokens is what one request can have
        self.schedulers = [Scheduler(config) for _ in range(dp)]
        for d, s in enumerate(self.schedulers):
            s.engine_index = d
        self.decode_sizes, self.piecewise_sizes = sorted(graph_sizes[0]), sorted(graph_sizes[1])
        # how many more unfinished requests than the least loaded rank a rank may hold and still
        # take a request for its prefix-cache hit
        self.affinity_slack = max(1, config.max_num_seqs // 8)
        # block hash -> (the rank it was routed to last, that request's prompt_logprobs or None)
        self._routed: OrderedDict[bytes, tuple[int, int | None]] = OrderedDict()

    def _owner(self, request_id: str) -> Scheduler | None:
        return next((s for s in self.schedulers if request_id in s.requests), None)

    # ---- intake ----

    def check_request(self, request: Request) -> None:
        if self._owner(request.request_id) is not None:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.schedulers[0].check_request(request)

    def check_priority(self, params) -> None:
        self.schedulers[0].check_priority(params)

    def add_request(self, request: Request) -> None:
        """To the DP rank that holds the most of its prompt among those within `affinity_slack`
        unfinished requests of the least loaded, else to the least loaded (the lowest index on a
        tie): a conversation's next turn finds its history where the last turn left it, and
        prompts sharing a prefix that arrive together (the n choices of one request, a few-shot
        preamble) meet on one rank, while no rank takes more than its share. A rank
        holds a prefix that its prefix cache has, or that a request routed there recently had
        (`_routed`: its blocks are computed, or will be, on that rank). For a request that wants
        prompt logprobs only blocks that keep them count (BlockManager.usable_prefix_blocks): a
        prefix a plain request computed is computed again wherever it goes."""
        self.check_request(request)
        loads = [len(s.requests) for s in self.schedulers]
        least = min(loads)
        near = [d for d, n in enumerate(loads) if n <= least + self.affinity_slack]
        hits = {d: self.schedulers[d].block_manager.usable_prefix_blocks(request) for d in near}
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.schedulers[0].block_manager.tokens_per_block]
        # the deepest prefix a request routed to each rank had; for a prompt-logprob request one
        # that wanted at least as many alternatives (only its blocks will keep records it can use)
        k = request.sampling_params.prompt_logprobs
        for i, h in enumerate(hashes):
            d, kept = self._routed.get(h, (None, None))
            if d is None or (k is not None and (kept is None or kept < k)):
                break
            if d in hits:
                hits[d] = max(hits[d], i + 1)
        best = max(near, key=lambda d: (hits[d], -loads[d], -d))
        self.schedulers[best].add_request(request)
        for h in hashes:
            self._routed[h] = (best, k)
            self._routed.move_to_end(h)
        while len(self._routed) > self.ROUTED_BLOCKS:
            self._routed.popitem(last=False)

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        outputs = []
        for rid in request_ids:
            owner = self._owner(rid)
            if owner is not None:
                outputs += owner.abort_requests([rid])
        return outputs

    def has_unfinished_requests(self) -> bool:
        return any(s.has_unfinished_requests() for s in self.schedulers)

    @property
    def requests(self) -> dict[str, Request]:
        return {rid: r for s in self.schedulers for rid, r in s.requests.items()}

    @property
    def running(self) -> Chained:
        return Chained([s.running for s in self.schedulers])

    @property
    def waiting(self) -> Chained:
        return Chained([s.waiting for s in self.schedulers])

    @property
    def stats(self) -> SchedulerStats:
        """Every DP rank's counts summed (the KV usage over all their blocks)."""
        return summed_stats(self.stats_per_engine)

    @property
    def stats_per_engine(self) -> list[SchedulerStats]:
        """Each DP rank's own counts, in rank order."""
        return [s.stats for s in self.schedulers]

    # ---- steps ----

    def schedule(self) -> DPSchedulerOutput:
        """Every DP rank's step, each to pad its MoE rows to the same count: the largest of the
        ranks' own padded counts (`padded_rows`), so that where that is a captured size every rank
        that can replays its graph of it (engine/model_runner.py)."""
        parts = [s.schedule() for s in self.schedulers]
        rows = max(padded_rows(p, self.decode_sizes, self.piecewise_sizes) for p in parts)
        for p in parts:
            p.dp_rows = rows
        return DPSchedulerOutput(parts)

    def parts(self, so: DPSchedulerOutput) -> list[tuple[Scheduler, SchedulerOutput]]:
        return list(zip(self.schedulers, so.parts))

    def needs_sync(self) -> bool:
        return any(s.needs_sync() for s in self.schedulers)

    def update_from_output(self, so: DPSchedulerOutput, out: DPModelRunnerOutput) -> list[EngineCoreOutput]:
        return [o for s, p, r in zip(self.schedulers, so.parts, out.parts) for o in s.update_from_output(p, r)]
