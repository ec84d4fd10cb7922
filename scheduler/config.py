"""Engine knobs of the scheduler and KV block pool (not model hyperparameters)."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    """Token budget, request cap and KV pool shape; validated at construction."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 4096
    block_size: int = 16  # tokens per block on one rank
    num_blocks: int = 1024  # KV blocks in the pool (same ids on every rank)
    enable_prefix_caching: bool = True
    # Decode context parallel: token i lives on DCP rank i % dcp_size, so one block id holds
    # block_size * dcp_size tokens across the group (the "virtual block", DESIGN.md §7).
    dcp_size: int = 1
    # Schedule step N+1 while step N runs: a request that samples in step N holds an output
    # placeholder until N's token arrives (its next input is read on the device).
    async_scheduling: bool = False
    # Speculative decoding: the most drafts one decode verifies (0: off)
    num_speculative_tokens: int = 0
    # KV slots allocated past each step's tokens (the MTP drafter writes its layer's cache at the
    # positions of its drafts after the first)
    num_lookahead_tokens: int = 0
    # A prefill chunk takes at most this many of one request's tokens a step (0: the budget
    # alone), so that one long prompt leaves room in each step for others to start (vLLM's
    # long_prefill_token_threshold)
    long_prefill_token_threshold: int = 0
    # fcfs: admitted in arrival order, the newest running request preempted first; priority:
    # admitted by (priority, arrival time), the running request last in that order preempted
    # first (vLLM's --scheduling-policy; a lower value is served first)
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size",
                     "num_blocks", "dcp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("num_speculative_tokens", "long_prefill_token_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.num_speculative_tokens and self.async_scheduling:
            raise ValueError("async_scheduling cannot be combined with speculative decoding")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool, got {self.async_scheduling!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")

    @property
    def virtual_block_size(self) -> int:
        """Tokens per block id across the DCP group: the scheduler's allocation unit."""
        return self.block_size * self.dcp_size

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole pool can hold for one request."""
        return self.num_blocks * self.virtual_block_size
