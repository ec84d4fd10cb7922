"""The request skeleton completions and chat share: sampling parameters, submission, the whole
(JSON) or streamed (SSE) response, client disconnects and error mapping.

An endpoint validates its request, builds its prompts and a builder (the endpoint's choice and
delta format), then calls `respond`. Errors map the same way for both endpoints: a ValueError
before the response starts is a 400 naming the field; once a stream's headers are sent, a
ValueError is reported in-band as a 400 error event and anything else as a 500 one, then
`[DONE]`; a client that leaves gets 499 (nothing is sent) and its engine requests are aborted.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Protocol

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common.offload import check_off_loop
from common.sampling_params import SamplingParams
from engine.outputs import RequestOutput
from engine.input_processor import CacheCapacityError, ContextLengthError
from scheduler.prompt_logprobs import PromptLogprobs
from server.beam_search import check_beam_request, respond_beams
from server.errors import APIError, error_body, param_of
from server.request_fields import MAX_REQUEST_ID_CHARS
from server.streams import ClientDisconnected, EngineStreams, StreamStalled, engine_request_ids, until_disconnect

logger = logging.getLogger(__name__)

# JSON has no -inf; OpenAI-compatible servers clamp impossible tokens to this.
MIN_LOGPROB = -9999.0


def finite(x: float) -> float:
    return x if x > MIN_LOGPROB else MIN_LOGPROB


def usage_of(state, prompt_tokens: int, completion_tokens: int,
             finals: list[RequestOutput | None]) -> dict:
    """A response's usage; with --enable-prompt-tokens-details also the prompt tokens the
    prefix cache held, over the request's prompts (`finals`: their latest outputs)."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    if state.frontend.prompt_tokens_details:
        cached = sum(f.num_cached_tokens for f in finals if f is not None)
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


class FastJSONResponse(JSONResponse):
    """JSONResponse encoded by orjson: the compact UTF-8 JSON of starlette's (no spaces, no ASCII
    escapes; floats in their shortest form, dict keys as strings), ~14x faster on logprob-heavy
    answers (a 581-token echo answer of lm_eval: 0.05 ms against 0.73 on this machine's CPU, on the
    event loop for every response). A non-finite float becomes null instead of an error (the
    logprobs are clamped to finite values before this anyway)."""

    def render(self, content) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS).decode()}\n\n"


class Builder(Protocol):
    """An endpoint's response format over the final or streamed engine outputs of its prompts."""

    def choices(self, finals: list[RequestOutput]) -> list[dict]:
        """The whole response's choices, by index."""

    def usage(self, finals: list[RequestOutput | None]) -> dict:
        """Token counts of the whole request (prompts not yet seen count 0)."""

    def chunks(self, i: int, out: RequestOutput) -> Iterator[tuple[dict, dict, dict]]:
        """(choice delta, usage so far of that choice, the chunk's other top-level fields) for
        each delta prompt i's output brings."""

    def response_fields(self, finals: list[RequestOutput]) -> dict:
        """The whole response's top-level fields besides id, choices and usage."""


async def sampling_params(req, tokenizer=None) -> SamplingParams:
    """The request's SamplingParams (a ValueError is a 400 naming the field); a structured-output
    grammar is compiled off the event loop, and bad_words are tokenized with `tokenizer`."""
    try:
        if req.asks_for_structure:
            params = await check_off_loop(req.constraint_chars, req.to_sampling_params)
        else:
            params = req.to_sampling_params()
    except ValueError as e:
        raise APIError(400, str(e), param=param_of(str(e))) from None
    if req.bad_words:
        if tokenizer is None:
            raise APIError(400, "bad_words: this server has no tokenizer to read them with",
                           param="bad_words")
        params.bad_words_token_ids = bad_words_token_ids(tokenizer, req.bad_words)
    return params


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """bad_words as token sequences: each word as it would start the text and as it would
    follow a space (its prefix-space form), when that differs. vLLM keeps the spaced form only
    when it has as many tokens as the plain one, so a word whose spaced form is one token
    (" apples" here, against "app" "les") could still follow a space there; not here."""
    seqs: list[list[int]] = []
    for word in words:
        plain = tokenizer(word.lstrip(), add_special_tokens=False)["input_ids"]
        spaced = tokenizer(" " + word.lstrip(), add_special_tokens=False)["input_ids"]
        if plain:
            seqs.append(list(plain))
        if spaced and spaced != plain:
            seqs.append(list(spaced))
    return seqs


def submit_streams(state, prompts, params, request_id: str) -> EngineStreams:
    """Log and submit every prompt, without waiting for the engine (start_streams waits; a
    background response does not, server/responses_background.py)."""
    state.frontend.log_prompts(engine_request_ids(request_id, len(prompts)), prompts)
    return EngineStreams(state.engine, prompts, params, request_id, state.background)


def refusal_error(e: ValueError, fields: tuple[str, str] = ("prompt", "max_tokens")) -> APIError:
    """The 400 of a prompt the engine refused; a context or KV-cache overflow names `fields` (the
    request's prompt and max_tokens fields), a context overflow with OpenAI's code."""
    if isinstance(e, (ContextLengthError, CacheCapacityError)) and fields != ("prompt", "max_tokens"):
        e = e.renamed(*fields)
    return APIError(400, str(e), param=getattr(e, "param", None) or param_of(str(e)),
                    code=getattr(e, "code", None))


async def start_streams(state, raw: Request, prompts, params, request_id: str,
                        fields: tuple[str, str] = ("prompt", "max_tokens")) -> EngineStreams:
    """Submit every prompt and wait until the engine accepted all of them (ValueError -> 400,
    refusal_error)."""
    streams = submit_streams(state, prompts, params, request_id)
    try:
        await until_disconnect(raw, streams.prime())
    except ValueError as e:
        streams.close()
        raise refusal_error(e, fields) from None
    except BaseException:
        streams.close()
        raise
    return streams


def response_id(prefix: str, raw: Request, req) -> tuple[str, str]:
    """(the response's id, the base of its engine request ids): `prefix` + the client's id (the
    X-Request-Id header, else the request's `request_id`, as in vLLM) or a random one. A client's
    id need not be unique, so its engine ids get a random suffix."""
    client = raw.headers.get("x-request-id") or req.request_id
    if client is None:
        rid = f"{prefix}{uuid.uuid4().hex}"
        return rid, rid
    if len(client) > MAX_REQUEST_ID_CHARS:
        raise APIError(400, f"X-Request-Id / request_id: at most {MAX_REQUEST_ID_CHARS} characters, "
                       f"got {len(client)}", param="request_id")
    rid = f"{prefix}{client}"
    return rid, f"{rid}-{uuid.uuid4().hex[:8]}"


def _fields(req, obj: str) -> tuple[str, str]:
    """The request's prompt and max_tokens fields, as a context overflow names them."""
    if obj != "chat.completion":
        return "prompt", "max_tokens"
    return "messages", "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"


async def respond(state, raw: Request, req, prompts: list, params: SamplingParams, ids: tuple[str, str],
                  builder: Builder, obj: str, chunk_obj: str) -> Response:
    """Run `prompts` (n choices each) and answer: JSON `{id, object: obj, created, model, choices,
    usage}`, or with `req.stream` SSE chunks `{id, object: chunk_obj, ..., choices: [delta], usage}`.
    `ids`: `response_id`'s (response id, engine id base)."""
    if getattr(req, "use_beam_search", False):
        check_beam_request(req, state.request_defaults)
        return await respond_beams(state, raw, req, prompts, params, ids, builder, obj)
    request_id, engine_id = ids
    head = {"id": request_id, "object": obj, "created": int(time.time()), "model": state.model_name}
    tracker = state.metrics.tracker(params.n, params.max_tokens, state.frontend.output_logger())
    num_outputs = len(prompts) * req.n
    try:
        streams = await start_streams(state, raw, prompts, params, engine_id, _fields(req, obj))
    except ClientDisconnected:  # gone while its prompts were still being accepted: aborted
        tracker.close(num_outputs)
        return Response(status_code=499)
    if req.stream:
        streams.stall_timeout = state.limits.stream_stall_timeout
        return StreamingResponse(_events(streams, builder, {**head, "object": chunk_obj}, tracker,
                                         state.frontend.stream_usage(req), num_outputs),
                                 media_type="text/event-stream")
    try:
        limit = state.limits.max_response_logprob_entries if params.logprobs is not None else None
        field = "top_logprobs" if obj == "chat.completion" else "logprobs"
        finals = await until_disconnect(raw, _collect(streams, tracker, limit, field))
    except ClientDisconnected:
        return Response(status_code=499)
    except ValueError as e:  # a sample failed (_check_failed)
        raise APIError(400, str(e), param=param_of(str(e))) from None
    finally:
        streams.close()
        tracker.close(num_outputs)

    def whole() -> JSONResponse:
        return FastJSONResponse({**head, "choices": builder.choices(finals), "usage": builder.usage(finals),
                             **builder.response_fields(finals)})
    # A large answer (many tokens, logprobs with many alternatives: n x 800 tokens x 21 entries
    # took seconds and 2 GB) is built and encoded on a worker thread, so that the event loop
    # keeps serving everyone else; a small one inline, without the thread hop.
    if _entries(finals) > OFF_LOOP_ENTRIES:
        return await asyncio.to_thread(whole)
    return whole()


# tokens plus logprob alternatives from which a whole response is built off the event loop
OFF_LOOP_ENTRIES = 20_000


def _entries(finals: list[RequestOutput]) -> int:
    """Tokens and logprob alternatives a whole response may spell out (prompts included, for echo
    and prompt_logprobs)."""
    n = 0
    for f in finals:
        if f is None:
            continue
        plps = f.prompt_logprobs
        n += len(f.prompt_token_ids) + (plps.num_alternatives() if isinstance(plps, PromptLogprobs) else
                                        sum(len(lp.top) for lp in plps or () if lp is not None))
        for o in f.outputs:
            n += len(o.token_ids) + sum(len(lp.top) for lp in o.logprobs or () if lp is not None)
    return n


def _check_failed(out: RequestOutput) -> None:
    """ValueError (a 400) when a sample ended in an error of the request's own making: its
    structured-output constraint could not be followed (`stop_reason` says why)."""
    for o in out.outputs:
        if o.finish_reason == "error":
            raise ValueError(str(o.stop_reason))


async def _collect(streams: EngineStreams, tracker, max_logprob_entries: int | None = None,
                   field: str = "logprobs") -> list[RequestOutput]:
    """The final output of every prompt, in prompt order. With `max_logprob_entries`, a 400
    naming `field` once the generated logprob entries (tokens x (alternatives + 1)) pass it."""
    last: list[RequestOutput | None] = [None] * len(streams.request_ids)
    entries = 0
    async for i, out in streams:
        tracker.observe(i, out)
        _check_failed(out)
        last[i] = out
        if max_logprob_entries is not None:
            entries += sum(1 + len(lp.top) for o in out.outputs for lp in o.delta_logprobs or () if lp is not None)
            if entries > max_logprob_entries:
                raise APIError(400, f"{field}: the answer reached {entries} logprob entries (tokens x "
                               f"(alternatives + 1)), more than {max_logprob_entries} "
                               "(--max-response-logprob-entries); stream it (stream: true), or ask for "
                               "fewer tokens, choices or alternatives", param=field)
    if any(f is None or not f.finished for f in last):
        raise RuntimeError("engine stream ended without a finished output")
    return last


async def _events(streams: EngineStreams, builder: Builder, head: dict, tracker, wants,
                  num_outputs: int) -> AsyncIterator[str]:
    """The SSE events of a stream: one per choice delta, in engine order, with the usage `wants`
    asks for (a StreamUsage: in every chunk, and a usage chunk at the end). The events of the
    outputs that have queued up since the last write (a front end behind the engine) go out in
    one write: still one event per delta, for far fewer socket writes and ASGI sends."""
    finals: list[RequestOutput | None] = [None] * len(streams.request_ids)
    pieces: list[str] = []
    try:
        try:
            async for batch in streams.batches():
                for i, out in batch:
                    tracker.observe(i, out)
                    _check_failed(out)  # reported in-band, below
                    finals[i] = out
                    for delta, usage, top in builder.chunks(i, out):
                        pieces.append(sse({**head, **top, "choices": [delta],
                                           "usage": usage if wants.continuous_usage else None}))
                if pieces and not streams.done:  # the last ones go out with [DONE]
                    yield "".join(pieces)
                    pieces = []
            if wants.include_usage:
                pieces.append(sse({**head, "choices": [], "usage": builder.usage(finals)}))
        except Exception as e:  # headers are gone: report in-band, as OpenAI does
            if isinstance(e, (ValueError, StreamStalled)):  # the client's doing: no traceback
                logger.warning("stream %s failed: %s", head["id"], e)
            else:
                logger.exception("stream %s failed", head["id"])
            status = 400 if isinstance(e, ValueError) else 408 if isinstance(e, StreamStalled) else 500
            pieces.append(sse(error_body(status, str(e) if status != 500
                                         else f"internal server error ({type(e).__name__})")))
        pieces.append(sse("[DONE]"))
        yield "".join(pieces)
    finally:
        streams.close()
        tracker.close(num_outputs)
