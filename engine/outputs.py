"""What the engine returns to its users (offline `LLM` and the HTTP server)."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.outputs import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int  # which of the n samples
    text: str = ""  # cumulative
    token_ids: list[int] = field(default_factory=list)  # cumulative
    logprobs: list[TokenLogprobs] | None = None  # cumulative, when requested
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    delta_text: str = ""  # text new since the previous RequestOutput of this request
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # first entry None
    finished: bool = False
    num_cached_tokens: int = 0
    queue_time: float | None = None  # seconds the request waited before its first step
