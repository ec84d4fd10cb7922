"""Front-end bookkeeping: fan out n samples, detokenize, apply stop strings, build RequestOutputs.

A request with `n` samples becomes n engine requests `"{id}#{i}"` (prefix caching shares their
prompt blocks); sample i of a seeded request uses seed + i so the samples differ but each is
reproducible.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from scheduler.outputs import EngineCoreOutput


@dataclass
class _Sample:
    completion: CompletionOutput
    detok: IncrementalDetokenizer | None  # None: no tokenizer (token-id benchmarks), no text


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

    @property
    def finished(self) -> bool:
        return all(s.completion.finished for s in self.samples)


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
            samples.append(_Sample(CompletionOutput(index=i, logprobs=[] if p.logprobs is not None else None),
                                   detok))
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
            c = s.completion
            if c.finished:
                continue
            if o.prompt_logprobs is not None and i == 0:
                parent.prompt_logprobs = o.prompt_logprobs
            if o.num_cached_tokens:
                parent.num_cached_tokens = max(parent.num_cached_tokens, o.num_cached_tokens)
            if o.queue_time is not None and parent.queue_time is None:
                parent.queue_time = o.queue_time  # the first sample admitted (n > 1)
            # A "stop" finish from the engine is always a token (EOS or a stop token id): its
            # text is left out, as OpenAI and vLLM do.
            stop_str = None if s.detok is None else \
                s.detok.update(o.new_token_ids, stop_terminated=o.finish_reason == "stop")
            c.token_ids.extend(o.new_token_ids)
            c.delta_token_ids.extend(o.new_token_ids)
            if c.logprobs is not None:
                c.logprobs.extend(lp for lp in o.new_logprobs if lp is not None)
            if stop_str is not None:
                c.finish_reason, c.stop_reason = "stop", stop_str
                if not o.finished:
                    to_abort.append(o.req_id)
            elif o.finished:
                c.finish_reason, c.stop_reason = o.finish_reason, o.stop_reason
            if s.detok is not None:
                if c.finished and s.detok.finish() is not None:  # the flushed tail held a stop string
                    c.finish_reason, c.stop_reason = "stop", s.detok.stop_str
                c.text = s.detok.output_text
                c.delta_text += s.detok.get_delta()
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
            if not s.completion.finished:
                s.completion.finish_reason = "abort"
        out = self._snapshot(parent)
        self.remove(request_id)
        return out

    def _snapshot(self, p: _Parent) -> RequestOutput:
        """A RequestOutput copy carrying the deltas accumulated since the last snapshot."""
        outs = []
        for s in p.samples:
            c = s.completion
            outs.append(dataclasses.replace(
                c, token_ids=list(c.token_ids), delta_token_ids=list(c.delta_token_ids),
                logprobs=None if c.logprobs is None else list(c.logprobs)))
            c.delta_text, c.delta_token_ids = "", []
        return RequestOutput(request_id=p.request_id, prompt=p.prompt,
                             prompt_token_ids=p.prompt_token_ids, outputs=outs,
                             prompt_logprobs=p.prompt_logprobs, finished=p.finished,
                             num_cached_tokens=p.num_cached_tokens, queue_time=p.queue_time)
