"""What the engine returns to its users (offline `LLM` and the HTTP server).

Outputs are per-step deltas: each RequestOutput of a request carries only what is new since the
previous one (`delta_*`). The cumulative fields (`text`, `token_ids`, `logprobs`) are filled in
the final output only (`finished`), built once from the front end's running lists, so no step
costs more for a long request than for a short one. A consumer that wants cumulative values
before the end accumulates the deltas itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from scheduler.outputs import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int  # which of the n samples
    text: str = ""  # cumulative; complete in the final output only
    token_ids: list[int] = field(default_factory=list)  # cumulative; final output only
    logprobs: list[TokenLogprobs] | None = None  # cumulative when requested; final output only
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    # the stop string or token id that ended it; with "error", what failed (the request's
    # structured-output constraint could not be followed)
    stop_reason: int | str | None = None
    delta_text: str = ""  # text new since the previous RequestOutput of this request
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] | None = None  # parallel to delta_token_ids, when requested
    engine_index: int = 0  # the DP rank that runs this sample (each sample is an engine request)
    queue_time: float | None = None  # seconds this sample's engine request waited before its first step

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # first entry None; a PromptLogprobs (columns) from the engine, any sequence of entries otherwise
    prompt_logprobs: Sequence[TokenLogprobs | None] | None = None
    finished: bool = False
    num_cached_tokens: int = 0
    queue_time: float | None = None  # seconds the request waited before its first step
    engine_index: int = 0  # the DP rank that ran it (its first choice admitted), 0 without -dp
