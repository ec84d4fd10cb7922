"""The scheduler's counters (scheduler/scheduler.py `Scheduler.stats`), read by the metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float  # used / total blocks, 0..1
    num_preemptions: int  # cumulative
    prefix_cache_queries: int  # tokens looked up, cumulative
    prefix_cache_hits: int  # tokens found, cumulative
    spec: SpecDecodeStats | None = None  # speculative decoding counters, when it is on
    # cumulative, as vLLM counts them: each request's prompt when its first output comes (an n > 1
    # request's every choice), and every token output
    prompt_tokens: int = 0
    generation_tokens: int = 0


@dataclass
class SpecDecodeStats:
    """Cumulative counts with vLLM's spec_decode meaning: drafts verified (one per request and
    step that had any), draft tokens verified, draft tokens accepted, and accepted per position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] | None = None  # [num_speculative_tokens]

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

