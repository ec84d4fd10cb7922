"""Plain data that crosses the scheduler / model runner / front end boundaries (STYLE.md rule 2).

Each step: `Scheduler.schedule()` -> `SchedulerOutput` -> runner -> `ModelRunnerOutput` ->
`Scheduler.update_from_output()` -> `EngineCoreOutput` per request with news for the front end.
The runner keeps its own per-request state (token ids, block table) and receives only diffs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from common.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen, or one resumed after preemption (all its tokens again)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty only when resuming a preempted request
    sampling_params: SamplingParams
    block_ids: list[int]  # virtual block ids under DCP (block_size * dcp tokens each)
    num_computed_tokens: int  # tokens already in the KV cache (prefix-cache hit)


@dataclass
class CachedRequestData:
    """A request the runner already holds: only what changed since last step."""

    req_id: str
    new_block_ids: list[int]  # appended to the request's block table
    num_computed_tokens: int  # before this step's tokens


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens to compute this step
    total_num_scheduled_tokens: int
    # Requests the runner must forget before this step: finished, aborted or preempted since the
    # last step. A preempted request comes back later as a NewRequestData.
    finished_req_ids: set[str] = field(default_factory=set)
    # Structured outputs: the constrained requests that sample this step, and for each one row
    # of allowed next tokens (int32 words, bit t % 32 of word t // 32 for token t). Filled by
    # the engine core once, so every TP rank masks its logits alike; empty: nothing constrained.
    grammar_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: np.ndarray | None = None  # [len(grammar_req_ids), ceil(V / 32)] int32
    # Speculative decoding: req_id -> the draft tokens it verifies this step, computed after its
    # known tokens (they count in num_scheduled_tokens and have KV slots allocated)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Data parallelism: the rows every DP rank pads its MoE input to this step (at least the most
    # tokens any DP rank runs; engine/data_parallel.py); a DP rank with no tokens runs the MoE
    # layers' collectives alone (models/data_parallel_moe.py). 0: no DP.
    dp_rows: int = 0

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class TokenLogprobs:
    """Logprob of one chosen token, its rank (1 = most likely) and the top-N alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]  # (token_id, logprob), most likely first


@dataclass
class ModelRunnerOutput:
    # Requests that sampled a token this step: those whose scheduled tokens reached the end of
    # their known tokens. A partial prefill chunk samples nothing.
    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # parallel to req_ids; None unless requested
    # req_id -> logprobs of the prompt tokens whose predictions were computed this step, in order
    # (the runner's are a PromptLogprobs: scheduler/prompt_logprobs.py). The first prompt token has
    # no prediction; the runner reports it as None once.
    prompt_logprobs: dict[str, Sequence[TokenLogprobs | None]] = field(default_factory=dict)
    # Speculative decoding: req_id -> its accepted drafts, the output tokens that precede its
    # sampled_token_ids entry this step (with their logprobs, parallel, when it wants them)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    # req_id -> drafts proposed for its next step (after this step's tokens)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """News about one request after a step, for the front end."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs: Sequence[TokenLogprobs | None] | None = None  # complete, once, when known (a PromptLogprobs)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id that ended it, if any
    num_cached_tokens: int = 0
    queue_time: float | None = None  # with the first token: seconds waiting before admission
    # a "stop" because the request's grammar allows nothing more: its last token is output text,
    # not an eos / stop token
    grammar_ended: bool = False
    engine_index: int = 0  # the DP rank whose scheduler holds the request (vLLM's `engine` label)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
