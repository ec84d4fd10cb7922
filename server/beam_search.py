"""Beam search (vLLM's `use_beam_search`) over the engine, as vLLM runs it in its front end.

The search keeps `n` beams (the request's `n` is the beam width, as in vLLM). Each step runs every
beam as a request of one token asking for its 2n most likely next tokens (their logprobs), all
beams in one engine step; every beam extended by one of them is a candidate, scored by its
cumulative logprob over its length (prompt included, an ending EOS not counted) to the power
`length_penalty`. A candidate ending in EOS is finished (unless `ignore_eos`); the n best others
go on. After `max_tokens` steps (or the context's end) the n best of the finished and the live
beams are the choices, best first. With the prefix cache on, a beam's step recomputes only its
last partial block.

Beam search answers whole responses only (as vLLM's: it has nothing to stream before the end) and
takes only the fields in BEAM_FIELDS; any other field set to other than its default is a 400
naming it, rather than being ignored."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from common.offload import off_loop
from common.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.outputs import CompletionOutput, RequestOutput
from server.errors import APIError, param_of
from server.streams import ClientDisconnected, EngineStreams, until_disconnect

# Fields a beam-search request may set (others only to their defaults).
BEAM_FIELDS = frozenset({
    "model", "prompt", "messages", "n", "best_of", "max_tokens", "max_completion_tokens",
    "use_beam_search", "length_penalty", "ignore_eos", "include_stop_str_in_output", "temperature",
    "stream", "user", "request_id", "seed", "add_special_tokens", "add_generation_prompt",
    "continue_final_message", "chat_template_kwargs", "truncate_prompt_tokens", "cache_salt",
    "priority", "skip_special_tokens", "return_token_ids",
})
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each beam asks for its 2n most likely next tokens


def check_beam_request(req, defaults: dict) -> None:
    """400 naming the field that beam search cannot honour. Fields at their default, or at the
    server's (`defaults`: --generation-config, --override-generation-config), pass; so does the
    tool_choice "none" a chat without tools gets."""
    if req.stream:
        raise APIError(400, "stream: beam search answers whole responses only (use_beam_search "
                       "with stream=false), as vLLM", param="stream")
    if req.n > MAX_BEAM_WIDTH:
        raise APIError(400, f"n: the beam width is at most {MAX_BEAM_WIDTH} (each beam asks for its "
                       f"2n most likely next tokens, at most {MAX_LOGPROBS}), got {req.n}", param="n")
    fields = type(req).model_fields
    asks_nothing = {"tool_choice": lambda v: v == "none",  # what a chat without tools gets
                    "response_format": lambda v: getattr(v, "type", None) == "text",
                    "parallel_tool_calls": lambda v: not getattr(req, "tools", None)}
    for name in sorted(req.model_fields_set - BEAM_FIELDS):
        if name not in fields or (name in asks_nothing and asks_nothing[name](getattr(req, name))):
            continue
        value, default = getattr(req, name), fields[name].get_default(call_default_factory=True)
        # an empty list or object where the default is null asks for nothing either (tools: [])
        at_default = value == default or (default is None and isinstance(value, (list, dict)) and not value)
        at_server_default = name in defaults and value == defaults[name]
        if at_default or at_server_default:
            continue
        raise APIError(400, f"{name}: not supported with use_beam_search", param=name)


@dataclass
class Beam:
    tokens: list[int]  # generated so far
    logprob: float = 0.0  # their cumulative logprob
    eos: bool = False  # ends in the EOS token (finished)


def beam_score(beam: Beam, prompt_len: int, length_penalty: float) -> float:
    """A key that orders beams as vLLM's score does: cumulative logprob / (sequence length **
    length_penalty), the prompt counted and an ending EOS not. Taken in log space, -(log(-logprob)
    - penalty * log(length)), so that no penalty overflows or underflows the power (vLLM's form
    raised OverflowError from a penalty of ~93 at 2,048 tokens); a logprob of 0 ranks first."""
    length = prompt_len + len(beam.tokens) - (1 if beam.eos else 0)
    if beam.logprob >= 0.0:
        return math.inf
    return length_penalty * math.log(max(length, 1)) - math.log(-beam.logprob)


async def beam_search(state, prompt_ids: list[int], params: SamplingParams, width: int,
                      length_penalty: float, request_id: str) -> RequestOutput:
    """The `width` best beams for one prompt, as a finished RequestOutput of `width` outputs."""
    eos = state.engine.inputs.eos_token_id
    # as far as an ordinary request would go: the context, and the KV cache (a step's prompt of
    # P + s tokens must fit it; 0: unknown)
    limit = state.max_model_len - len(prompt_ids)
    capacity = getattr(state.engine.inputs, "capacity_tokens", 0)
    if capacity:
        limit = min(limit, capacity - len(prompt_ids) + 1)
    steps = limit if params.max_tokens is None else min(params.max_tokens, limit)
    step_params = dataclasses.replace(
        params, n=1, max_tokens=1, min_tokens=0, logprobs=2 * width, prompt_logprobs=None,
        temperature=0.0, seed=None, stop=[], stop_token_ids=[], ignore_eos=True)
    live, done = [Beam([])], []
    for step in range(steps):
        outs = await _one_token(state, [prompt_ids + b.tokens for b in live], step_params,
                                f"{request_id}-beam{step}")
        candidates = []
        for beam, out in zip(live, outs):
            lp = out.outputs[0].logprobs[0]
            for tid, logprob in lp.top or [(lp.token_id, lp.logprob)]:
                new = Beam(beam.tokens + [tid], beam.logprob + logprob)
                if tid == eos and not params.ignore_eos:
                    new.eos = True
                    done.append(new)
                else:
                    candidates.append(new)
        candidates.sort(key=lambda b: beam_score(b, len(prompt_ids), length_penalty), reverse=True)
        live = candidates[:width]
        if not live:
            break
    best = sorted(done + live, key=lambda b: beam_score(b, len(prompt_ids), length_penalty),
                  reverse=True)[:width]
    outputs = []
    for i, b in enumerate(best):
        shown = b.tokens[:-1] if b.eos and not params.include_stop_str_in_output else b.tokens
        text = ("" if state.tokenizer is None
                else state.tokenizer.decode(shown, skip_special_tokens=params.skip_special_tokens))
        outputs.append(CompletionOutput(i, text=text, token_ids=list(b.tokens),
                                        finish_reason="stop" if b.eos else "length",
                                        delta_token_ids=list(b.tokens)))
    return RequestOutput(request_id, None, list(prompt_ids), outputs, finished=True)


async def _one_token(state, prompts: list[list[int]], params: SamplingParams,
                     request_id: str) -> list[RequestOutput]:
    """Run each prompt for one token in the engine; the final outputs in prompt order."""
    streams = EngineStreams(state.engine, prompts, params, request_id, state.background)
    try:
        await streams.prime()
        last: list[RequestOutput | None] = [None] * len(prompts)
        async for i, out in streams:
            last[i] = out
    finally:
        streams.close()
    if any(o is None or not o.finished or not o.outputs[0].logprobs for o in last):
        raise RuntimeError("beam search: the engine ended a step without its logprobs")
    return last


async def beam_search_all(state, prompts: list[list[int]], params: SamplingParams, width: int,
                          length_penalty: float, request_id: str) -> list[RequestOutput]:
    """Every prompt's beam search, side by side."""
    return list(await asyncio.gather(*(
        beam_search(state, p, params, width, length_penalty, f"{request_id}-{i}")
        for i, p in enumerate(prompts))))


async def respond_beams(state, raw: Request, req, prompts: list, params: SamplingParams,
                        ids: tuple[str, str], builder, obj: str) -> Response:
    """server/handler.py's `respond` for a use_beam_search request: `n` beams per prompt, answered
    whole through the route's own builder."""
    request_id, engine_id = ids
    head = {"id": request_id, "object": obj, "created": int(time.time()), "model": state.model_name}
    tracker = state.metrics.tracker(params.n, params.max_tokens)
    try:
        # the engine's own checks and truncation, and a text prompt's token ids
        token_ids = [(await off_loop(len(p), state.engine.inputs.process, p, params))[1] for p in prompts]
        finals = await until_disconnect(raw, beam_search_all(state, token_ids, params, req.n,
                                                             req.length_penalty, engine_id))
        for i, out in enumerate(finals):
            tracker.observe(i, out)
    except ClientDisconnected:
        return Response(status_code=499)
    except ValueError as e:  # refused by the engine's checks, as respond() answers them
        raise APIError(400, str(e), param=getattr(e, "param", None) or param_of(str(e)),
                       code=getattr(e, "code", None)) from None
    finally:
        tracker.close(len(prompts) * req.n)
    return JSONResponse({**head, "choices": builder.choices(finals), "usage": builder.usage(finals),
                         **builder.response_fields(finals)})
