"""Per-request state owned by the scheduler: tokens, progress, status, prefix-cache hashes."""

from __future__ import annotations

import enum
import time

from common.sampling_params import SamplingParams
from scheduler.prompt_logprobs import PromptLogprobs


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # the request's own constraint failed (its stop_reason says how)

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One generation request: prompt + outputs so far, and how much of it is in the KV cache."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_id: int | None, arrival_time: float | None = None) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must hold at least 1 token, got 0")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time

        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)  # prompt + outputs
        # Tokens whose KV is (or, after schedule(), is being) written: advanced by schedule().
        self.num_computed_tokens = 0
        # Async scheduling: tokens sampled by steps still in flight, not yet in output_token_ids.
        self.num_output_placeholders = 0
        # Speculative decoding: drafts proposed after its last token, verified by its next step
        self.spec_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # set by the engine core when the step's grammar mask leaves none of allowed_token_ids:
        # the token sampled from that row ends the request in this error
        self.no_allowed_token: str | None = None

        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until admitted
        self.queue_time: float | None = None  # seconds from arrival to first admission
        self.prompt_logprobs = PromptLogprobs.empty()  # accumulated over prefill chunks (new objects)
        self.prompt_logprobs_emitted = False
        # Chained hashes of this request's full virtual blocks, computed once each (block_manager).
        self.block_hashes: list[bytes] = []
        # Structured outputs: the matcher of its constraint (engine.structured_outputs
        # RequestGrammar), set by the engine core; advanced by each token appended here, once,
        # so that a preempted request that recomputes its tokens keeps its matcher state.
        self.grammar = None
        self.ended_by_grammar = False  # it stopped because its grammar allows nothing more

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True while this request still owes the client its prompt logprobs."""
        return self.sampling_params.prompt_logprobs is not None and not self.prompt_logprobs_emitted

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
