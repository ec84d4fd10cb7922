"""`POST /v1/completions`: one engine request per prompt, `n` choices each, JSON or SSE."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from itertools import accumulate

import numpy as np

from fastapi import Request
from fastapi.responses import Response

from engine.outputs import CompletionOutput, RequestOutput
from scheduler.outputs import TokenLogprobs
from scheduler.prompt_logprobs import PromptLogprobs
from server.handler import MIN_LOGPROB, finite, respond, response_id, sampling_params, usage_of
from server.protocol import CompletionRequest

logger = logging.getLogger(__name__)


def _finite(x: np.ndarray) -> np.ndarray:
    """`finite` over an array: values at or below MIN_LOGPROB (-inf, NaN) become it."""
    return np.where(x > MIN_LOGPROB, x, MIN_LOGPROB)


def prompt_entries(out: RequestOutput) -> list[tuple[int, TokenLogprobs | None]]:
    """(token id, its logprobs or None) per prompt token of an engine output."""
    plps = out.prompt_logprobs
    if plps is None or len(plps) != len(out.prompt_token_ids):
        logger.warning("engine returned no prompt logprobs for %s", out.request_id)
        plps = [None] * len(out.prompt_token_ids)
    return list(zip(out.prompt_token_ids, plps))


def prompt_logprob_rows(state, out: RequestOutput, k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs` (completions' choices, chat's response): per prompt token (the
    first is null) {token id: {logprob, rank, decoded_token}} for the prompt token and the top
    `k` alternatives. decoded_token is the token's text even with token-id names (vLLM's)."""
    rows: list[dict | None] = []
    for tid, lp in prompt_entries(out):
        if lp is None:
            rows.append(None)
            continue
        row = {str(tid): {"logprob": finite(lp.logprob), "rank": lp.rank,
                          "decoded_token": state.token_str(tid)}}
        for rank, (alt, alt_lp) in enumerate(lp.top[:k], 1):
            row.setdefault(str(alt), {"logprob": finite(alt_lp), "rank": rank,
                                      "decoded_token": state.token_str(alt)})
        rows.append(row)
    return rows


class CompletionBuilder:
    """Turns engine outputs into OpenAI completion choices, whole or as stream deltas."""

    def __init__(self, state, req: CompletionRequest) -> None:
        self.state, self.req = state, req
        self.drop_generated = req.max_tokens == 0  # echo-only scoring: hide the sampled token
        self.as_token_ids = state.frontend.as_token_ids(req)  # logprobs name tokens "token_id:N"
        self._sent_tokens: dict[int, int] = {}  # choice indices that have had a chunk
        self._finish_sent: set[int] = set()  # choice indices whose finish_reason went out
        self._offset: dict[int, int] = {}  # choice index -> text_offset of its next token
        self._num_tokens: dict[int, int] = {}  # choice index -> tokens generated so far

    def prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return "" if self.state.tokenizer is None else self.state.decode(out.prompt_token_ids)

    def _prompt_entries(self, out: RequestOutput) -> list[tuple[int, TokenLogprobs | None]]:
        return prompt_entries(out)

    def _generated(self, o: CompletionOutput) -> tuple[str, list[int], list[TokenLogprobs]]:
        if self.drop_generated:
            return "", [], []
        return o.text, o.token_ids, list(o.logprobs or [])

    def token_str(self, token_id: int) -> str:
        if self.as_token_ids:
            return f"token_id:{token_id}"
        return self.state.token_str(token_id)  # "token_id:N" too without a tokenizer

    def logprobs(self, entries: list[tuple[int, TokenLogprobs | None]], offset: int,
                 prompt: RequestOutput | None = None) -> dict:
        """OpenAI completions logprobs: tokens, token_logprobs, top_logprobs, text_offset; those
        of `prompt`'s tokens (echo) before `entries`."""
        tokens, values, tops = self._prompt_columns(prompt) if prompt is not None else ([], [], [])
        for tid, lp in entries:
            s = self.token_str(tid)
            tokens.append(s)
            if lp is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(finite(lp.logprob))
            top: dict[str, float] = {}
            for alt_id, alt_lp in lp.top[: self.req.logprobs]:
                top.setdefault(self.token_str(alt_id), finite(alt_lp))
            top.setdefault(s, finite(lp.logprob))  # the chosen token is always listed
            tops.append(top)
        offsets = list(accumulate(map(len, tokens[:-1]), initial=offset)) if tokens else []
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}

    def _prompt_columns(self, out: RequestOutput) -> tuple[list[str], list, list]:
        """tokens, token_logprobs and top_logprobs of the prompt's tokens, read a column at a time
        from the engine's PromptLogprobs (scheduler/prompt_logprobs.py) where it sent them so.
        An echo request's response is the front end's largest per-request cost (lm_eval scores
        every choice so): token strings come from one lookup per distinct id, and the common
        `logprobs: 1` builds each token's dict without an inner loop."""
        plps, k = out.prompt_logprobs, self.req.logprobs
        if not isinstance(plps, PromptLogprobs) or len(plps) != len(out.prompt_token_ids):
            got = self.logprobs(self._prompt_entries(out), 0)
            return got["tokens"], got["token_logprobs"], got["top_logprobs"]
        f = int(plps.first)
        values = [None] * f + _finite(plps.logprobs).tolist()
        tops: list = [None] * f
        if k == 1 and plps.top_ids.shape[1]:
            # flat columns: a list per row would be ~1,200 objects for the collector a request
            alt_ids, alt_vals = plps.top_ids[:, 0].tolist(), _finite(plps.top_vals[:, 0]).tolist()
            names = {t: self.token_str(t) for t in {*out.prompt_token_ids, *alt_ids}}
            tokens = [names[t] for t in out.prompt_token_ids]
            tops += [{a: b} if a == tok else {a: b, tok: v} for tok, v, a, b in
                     zip(tokens[f:], values[f:], [names[a] for a in alt_ids], alt_vals)]
            return tokens, values, tops
        alt_ids, alt_vals = plps.top_ids[:, :k].tolist(), _finite(plps.top_vals[:, :k]).tolist()
        names = {t: self.token_str(t) for t in {*out.prompt_token_ids, *(a for row in alt_ids for a in row)}}
        tokens = [names[t] for t in out.prompt_token_ids]
        for tok, v, ids, vals in zip(tokens[f:], values[f:], alt_ids, alt_vals):
            top: dict[str, float] = {}
            for a, b in zip(ids, vals):
                top.setdefault(names[a], b)
            top.setdefault(tok, v)  # the chosen token is always listed
            tops.append(top)
        return tokens, values, tops

    def prompt_logprobs(self, out: RequestOutput) -> list[dict | None]:
        return prompt_logprob_rows(self.state, out, self.req.prompt_logprobs)

    def chunk_usage(self, index: int, out: RequestOutput, o: CompletionOutput) -> dict:
        """Usage so far of choice `index` (continuous_usage_stats, as vLLM counts it: the
        choice's prompt and its own tokens)."""
        prompt = len(out.prompt_token_ids)
        completion = self._num_tokens.get(index, 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def choice(self, index: int, out: RequestOutput, o: CompletionOutput) -> dict:
        text, _, lps = self._generated(o)
        entries = [(lp.token_id, lp) for lp in lps]
        prompt = None
        if self.req.echo:
            text = self.prompt_text(out) + text
            prompt = out if self.req.logprobs is not None else None  # its logprobs exist only when asked for
        logprobs = self.logprobs(entries, 0, prompt) if self.req.logprobs is not None else None
        choice = {"index": index, "text": text, "logprobs": logprobs,
                  "finish_reason": _finish(o, self.drop_generated),
                  "stop_reason": None if self.drop_generated else o.stop_reason}
        if self.req.return_token_ids:
            choice["prompt_token_ids"] = list(out.prompt_token_ids)
        if self.state.tokenizer is None or self.req.return_token_ids:
            choice["token_ids"] = [] if self.drop_generated else list(o.token_ids)
        if self.req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs(out)
        return choice

    def delta(self, index: int, out: RequestOutput, o: CompletionOutput) -> dict | None:
        """The part of choice `index` new in this output, or None when there is nothing new.

        A chunk goes out for every output that brings tokens, even when their text is held back
        (a possible stop string, an incomplete character) or there is no text at all (no
        tokenizer): clients time tokens by chunks. Without a tokenizer each chunk also carries
        the new `token_ids`.
        """
        first = index not in self._sent_tokens
        self._sent_tokens[index] = 1
        if not self.drop_generated:
            self._num_tokens[index] = self._num_tokens.get(index, 0) + len(o.delta_token_ids)
        # delta_text, not a slice of o.text: the engine holds back text that may still turn
        # into a stop string and be cut.
        new_text = "" if self.drop_generated else o.delta_text
        new_ids = [] if self.drop_generated else o.delta_token_ids
        lps = [] if self.drop_generated else (o.delta_logprobs or [])
        entries = [(lp.token_id, lp) for lp in lps]
        prompt = None
        if self.req.echo and first:
            new_text = self.prompt_text(out) + new_text
            prompt = out if self.req.logprobs is not None else None
        finish = _finish(o, self.drop_generated)
        if finish is not None:
            if index in self._finish_sent:
                finish = None  # a finished sample stays in its request's later outputs
            self._finish_sent.add(index)
        owes_prompt_logprobs = first and self.req.prompt_logprobs is not None
        owes_prompt_ids = first and self.req.return_token_ids
        if not new_text and not entries and prompt is None and not new_ids and finish is None \
                and not owes_prompt_logprobs and not owes_prompt_ids:
            return None
        logprobs = None
        if self.req.logprobs is not None:
            # offsets continue over the token strings sent so far, as in the whole response
            logprobs = self.logprobs(entries, self._offset.get(index, 0), prompt)
            self._offset[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1]) \
                if logprobs["tokens"] else self._offset.get(index, 0)
        chunk = {"index": index, "text": new_text, "logprobs": logprobs, "finish_reason": finish,
                 "stop_reason": None if finish is None or self.drop_generated else o.stop_reason}
        if owes_prompt_ids:  # once, in the choice's first chunk
            chunk["prompt_token_ids"] = list(out.prompt_token_ids)
        if self.state.tokenizer is None or self.req.return_token_ids:
            chunk["token_ids"] = list(new_ids)
        if owes_prompt_logprobs:  # once, in the choice's first chunk
            chunk["prompt_logprobs"] = self.prompt_logprobs(out)
        return chunk

    def usage(self, finals: list[RequestOutput | None]) -> dict:
        finals = [f for f in finals if f is not None]
        prompt = sum(len(f.prompt_token_ids) for f in finals)
        completion = 0 if self.drop_generated else sum(
            len(o.token_ids) for f in finals for o in f.outputs)
        return usage_of(self.state, prompt, completion, finals)

    def choices(self, finals: list[RequestOutput]) -> list[dict]:
        n = self.req.n
        choices = [self.choice(i * n + o.index, f, o) for i, f in enumerate(finals) for o in f.outputs]
        return sorted(choices, key=lambda c: c["index"])

    def chunks(self, i: int, out: RequestOutput) -> Iterator[tuple[dict, dict, dict]]:
        for o in out.outputs:
            index = i * self.req.n + o.index
            delta = self.delta(index, out, o)
            if delta is not None:
                yield delta, self.chunk_usage(index, out, o), {}

    def response_fields(self, finals: list[RequestOutput]) -> dict:
        return {}  # completions carry their prompt's ids and logprobs on each choice


def _finish(o: CompletionOutput, drop_generated: bool) -> str | None:
    if o.finish_reason is None:
        return None
    return "length" if drop_generated else o.finish_reason


async def create_completion(state, req: CompletionRequest, raw: Request) -> Response:
    """Handle one completions request end to end (server/handler.py)."""
    state.check_model(req.model)
    req.apply_defaults(state.request_defaults)
    state.limits.check(len(req.prompts()), req.n, req.stop,
                       {"logprobs": req.logprobs, "prompt_logprobs": req.prompt_logprobs})
    # the answer spells the prompt's logprobs out once for echo and once for prompt_logprobs
    wanted = [v for v in (req.prompt_logprobs, req.logprobs if req.echo else None) if v is not None]
    state.limits.check_prompt_logprobs(req.prompts(), wanted,
                                       "prompt_logprobs" if req.prompt_logprobs is not None else "echo", req.n)
    params = await sampling_params(req, state.tokenizer)
    return await respond(state, raw, req, req.prompts(), params, response_id("cmpl-", raw, req),
                         CompletionBuilder(state, req), "text_completion", "text_completion")
