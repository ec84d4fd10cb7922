"""Front-end bookkeeping: fan out n samples, detokenize, apply stop strings, build RequestOutputs.

Each step costs O(new tokens) per request: the running token and logprob lists are appended to,
and every RequestOutput hands over only the news since the previous one; the cumulative lists go
out once, in the final output (engine/outputs.py).

A request with `n` samples becomes n engine requests `"{id}#{i}"` (prefix caching shares their
prompt blocks); sample i of a seeded request uses seed + i so the samples differ but each is
reproducible.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, RequestOutput
from common.sampling_params import SamplingParams
from scheduler.outputs import EngineCoreOutput, TokenLogprobs


@dataclass
class _Sample:
    index: int
    detok: IncrementalDetokenizer | None  # None: no tokenizer (token-id benchmarks), no text
    want_logprobs: bool
    token_ids: list[int] = field(default_factory=list)  # cumulative, appended to (never copied)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # news since the last RequestOutput: handed over (not copied) and started afresh
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] = field(default_factory=list)
    engine_index: int = 0  # the DP rank of its engine request
    queue_time: float | None = None  # seconds its engine request waited before its first step

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def take_delta(self, final: bool) -> CompletionOutput:
        """The news since the last call; with `final`, also the cumulative text and lists."""
        out = CompletionOutput(
            index=self.index, finish_reason=self.finish_reason, stop_reason=self.stop_reason,
            delta_text=self.delta_text, delta_token_ids=self.delta_token_ids,
            delta_logprobs=self.delta_logprobs if self.want_logprobs else None, engine_index=self.engine_index,
            queue_time=self.queue_time)
        if final:
            out.text = "" if self.detok is None else self.detok.output_text
            out.token_ids = self.token_ids
            out.logprobs = self.logprobs if self.want_logprobs else None
        self.delta_text, self.delta_token_ids, self.delta_logprobs = "", [], []
        return out


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    queue_time: float | None = None
    engine_index: int = 0  # the DP rank of the first sample admitted

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)


def child_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._child: dict[str, tuple[_Parent, int]] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> list[tuple[str, SamplingParams]]:
        """Register a request; returns the engine requests to submit: (child id, params)."""
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        children = []
        samples = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            p = dataclasses.replace(params, n=1, seed=seed)
            detok = None if self.tokenizer is None else \
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids, p)
            samples.append(_Sample(i, detok, want_logprobs=p.logprobs is not None))
            children.append((child_id(request_id, i), p))
        parent = _Parent(request_id, prompt, prompt_token_ids, params, samples)
        self._parents[request_id] = parent
        for i, (cid, _) in enumerate(children):
            self._child[cid] = (parent, i)
        return children

    def child_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return [] if parent is None else [child_id(request_id, i) for i in range(len(parent.samples))]

    def remove(self, request_id: str) -> None:
        for cid in self.child_ids(request_id):
            self._child.pop(cid, None)
        self._parents.pop(request_id, None)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply engine news; returns updated RequestOutputs and child ids to abort (stop strings)."""
        touched: dict[str, _Parent] = {}
        to_abort: list[str] = []
        for o in outputs:
            entry = self._child.get(o.req_id)
            if entry is None:
                continue  # news for a request the client already dropped
            parent, i = entry
            s = parent.samples[i]
            if s.finished:
                continue
            s.engine_index = o.engine_index
            if o.prompt_logprobs is not None and i == 0:
                parent.prompt_logprobs = o.prompt_logprobs
            if o.num_cached_tokens:
                parent.num_cached_tokens = max(parent.num_cached_tokens, o.num_cached_tokens)
            if o.queue_time is not None and s.queue_time is None:
                s.queue_time = o.queue_time
            if o.queue_time is not None and parent.queue_time is None:
                parent.queue_time = o.queue_time  # the first sample admitted (n > 1)
                parent.engine_index = o.engine_index
            # A "stop" finish from the engine is a token (EOS or a stop token id) whose text is
            # left out, as OpenAI and vLLM do, unless the request's grammar ended it.
            ends_stopped = o.finish_reason == "stop" and not o.grammar_ended
            news, news_lps = o.new_token_ids, o.new_logprobs
            if s.detok is not None and s.detok.has_stop_strings and len(news) > 1:
                # several tokens in one step (speculative decoding): token by token, so the
                # output ends at the token that completes a stop string, as one at a time would
                pieces = [(news[j:j + 1], news_lps[j:j + 1]) for j in range(len(news))]
            else:
                pieces = [(news, news_lps)]
            stop_str = None
            for j, (ids, lps) in enumerate(pieces):
                if s.detok is not None:
                    stop_str = s.detok.update(ids, stop_terminated=ends_stopped and j == len(pieces) - 1)
                s.token_ids.extend(ids)
                s.delta_token_ids.extend(ids)
                if s.want_logprobs:
                    lps = [lp for lp in lps if lp is not None]
                    s.logprobs.extend(lps)
                    s.delta_logprobs.extend(lps)
                if stop_str is not None:
                    break
            if stop_str is not None:
                s.finish_reason, s.stop_reason = "stop", stop_str
                if not o.finished:
                    to_abort.append(o.req_id)
            elif o.finished:
                s.finish_reason, s.stop_reason = o.finish_reason, o.stop_reason
            if s.detok is not None:
                if s.finished and s.detok.finish() is not None:  # the flushed tail held a stop string
                    s.finish_reason, s.stop_reason = "stop", s.detok.stop_str
                s.delta_text += s.detok.get_delta()
            touched[parent.request_id] = parent
        results = [self._snapshot(p) for p in touched.values()]
        for p in touched.values():
            if p.finished:
                self.remove(p.request_id)
        return results, to_abort

    def abort(self, request_id: str) -> RequestOutput | None:
        """Mark every unfinished sample aborted; returns the final output, or None if unknown."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        for s in parent.samples:
            if not s.finished:
                s.finish_reason = "abort"
        out = self._snapshot(parent)
        self.remove(request_id)
        return out

    def _snapshot(self, p: _Parent) -> RequestOutput:
        """A RequestOutput of the news since the last one (and the whole output when finished)."""
        final = p.finished
        return RequestOutput(request_id=p.request_id, prompt=p.prompt,
                             prompt_token_ids=p.prompt_token_ids,
                             outputs=[s.take_delta(final) for s in p.samples],
                             prompt_logprobs=p.prompt_logprobs, finished=final,
                             num_cached_tokens=p.num_cached_tokens, queue_time=p.queue_time,
                             engine_index=p.engine_index)
