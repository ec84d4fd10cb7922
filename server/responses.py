"""`POST /v1/responses` (OpenAI's Responses API, as vLLM serves it) and the stored responses'
routes: `GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`.

A request runs as the chat completion it translates to (server/responses_protocol.py): the chat
route's checks, chat template, sampling, reasoning split and tool-call parsing (server/chat.py:
`chat_inputs`, ChatBuilder), so a conversation gets the same prompt and, greedy, the same text on
both routes. Its message and stream deltas become output items and events here
(server/responses_stream.py). A response sent with `store` (OpenAI's default) is kept in a bounded
store (server/responses_store.py): `previous_response_id` puts its conversation, output included,
before the new input (after the new `instructions`; the old ones are not carried over, as in
OpenAI's API). A `background` response runs as a task (server/responses_background.py).
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import time

from fastapi import APIRouter, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from common.offload import large_lane
from engine.outputs import RequestOutput
from server.chat import MANY_MESSAGES, ChatBuilder, chat_inputs
from server.chat_protocol import ChatMessage
from server.errors import APIError, param_of
from server.handler import OFF_LOOP_ENTRIES, _collect, _entries, response_id, start_streams
from server.reasoning import end_token_id
from server import responses_background as background
from server.request_body import body_openapi, parse_body
from server.request_fields import MAX_REQUEST_ID_CHARS
from server.responses_protocol import INCLUDE, ResponsesChat, ResponsesRequest, listed_items, renamed_errors, shown
from server.responses_store import ResponseStore, Stored, input_bytes
from server.responses_stream import ResponseEvents, content_after_calls, items_of, stream_events
from server.streams import ClientDisconnected, until_disconnect

# the chat request's fields an error may name -> the Responses field they came from
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens",
           "max_completion_tokens": "max_output_tokens", "reasoning_effort": "reasoning.effort"}


def install(v1: APIRouter, state, args=None) -> ResponseStore:
    """The Responses routes on the /v1 router (its API key and HTTP metrics apply); the store is
    sized by --responses-store-size and --responses-store-max-bytes."""
    store = ResponseStore.from_args(args)

    @v1.post("/responses", openapi_extra=body_openapi(ResponsesRequest))
    async def create_response_route(raw: Request) -> Response:
        return await create_response(state, store, await parse_body(raw, ResponsesRequest), raw)

    @v1.get("/responses/{response_id}")
    async def retrieve_response(response_id: str, stream: bool = False, starting_after: int | None = None) -> Response:
        found = _stored(store, response_id)
        if not stream:
            return Response(found.response, media_type="application/json")
        log = store.event_logs.get(response_id)
        if log is None:
            raise APIError(400, "stream: this response has no events kept: only a background response "
                           "created with stream true keeps them, while they fit --responses-store-max-bytes "
                           "with it; GET it without stream", param="stream")
        if starting_after is not None and starting_after < 0:
            raise APIError(400, f"starting_after: a sequence number, >= 0 (got {starting_after})",
                           param="starting_after")
        return StreamingResponse(log.follow(-1 if starting_after is None else starting_after),
                                 media_type="text/event-stream")

    @v1.get("/responses/{response_id}/input_items")
    async def input_items(response_id: str, after: str | None = None, before: str | None = None,
                          limit: int = 20, order: str = "desc",
                          include: list[str] | None = Query(None)) -> dict:
        found = _stored(store, response_id)
        return await _input_page(found, response_id, after, before, limit, order, include)

    @v1.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        # a running background response is cancelled first (even when the store evicted it)
        if await background.stop(store, response_id) is None:
            _stored(store, response_id)
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @v1.post("/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> Response:
        body = await background.stop(store, response_id)
        if body is None:
            found = _stored(store, response_id)  # a 404 for an id not held
            if _status_of(found.response) == "cancelled":  # idempotent, as OpenAI's
                return Response(found.response, media_type="application/json")
            raise APIError(400, "response_id: only a background response that is still running can "
                           "be cancelled; this one has finished", param="response_id")
        return Response(body, media_type="application/json")

    return store


# `include` on input_items: OpenAI's values, each a no-op here (no images, files or tool results)
_ITEM_INCLUDE = ("message.input_image.image_url", "file_search_call.results", "web_search_call.action.sources",
                 "computer_call_output.output.image_url", "code_interpreter_call.outputs", *INCLUDE)


async def _input_page(found: Stored, rid: str, after: str | None, before: str | None, limit: int,
                      order: str, include: list[str] | None) -> dict:
    """A page of a stored response's input items, as OpenAI's list: `order` desc (the default,
    last item first) or asc, the items after the one `after` names and before `before`, at most
    `limit` (1-100)."""
    if not 1 <= limit <= 100:
        raise APIError(400, f"limit: must be in [1, 100], got {limit}", param="limit")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order: must be asc or desc, got {shown(order)}", param="order")
    for value in include or ():
        if value not in _ITEM_INCLUDE:
            raise APIError(400, f"include: {shown(value)} is not supported (supported: "
                           f"{', '.join(_ITEM_INCLUDE)})", param="include")
    given = found.input if found.input is not None else []
    many = not isinstance(given, str) and len(given) > MANY_MESSAGES
    items = await large_lane(listed_items, given, rid) if many else listed_items(given, rid)
    if order == "desc":
        items.reverse()
    ids = [it["id"] for it in items]
    start, end = 0, len(items)
    for name, value in (("after", after), ("before", before)):
        if value is not None and value not in ids:
            raise APIError(400, f"{name}: response {shown(rid)} has no input item {shown(value)}", param=name)
    if after is not None:
        start = ids.index(after) + 1
    if before is not None:
        end = ids.index(before)
    page = items[start:end][:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < end}


# A stored response's JSON starts with its head: "id" (at most MAX_REQUEST_ID_CHARS of the
# client's, 6 bytes a character escaped), "object", "created_at", then "status". A quote inside a
# string is escaped, so the first `"status": "` is that key.
_STATUS = re.compile(rb'"status": "([a-z_]+)"')
_NOT_IN_A_PATH = "/?#% "  # characters a response id may not hold: it is a URL path segment
_HEAD_BYTES = 6 * MAX_REQUEST_ID_CHARS + 256


def _status_of(body: bytes) -> str | None:
    """A stored response's status, read from the head of its JSON (not parsing a body that may
    hold megabytes of output on the event loop)."""
    m = _STATUS.search(body, 0, _HEAD_BYTES)
    return m.group(1).decode() if m else None


def _stored(store: ResponseStore, rid: str) -> Stored:
    found = store.get(rid)
    if found is None:
        why = (f"this server stores no responses ({store.off_reason})" if not store.enabled
               else "never stored (store false), evicted, or deleted")
        raise APIError(404, f"response_id: response {shown(rid)} not found: {why}", param="response_id",
                       code="not_found")
    return found


def _previous(store: ResponseStore, req: ResponsesRequest) -> Stored | None:
    """The stored response `previous_response_id` names; 400 when the store is off, 404 when it
    does not hold it."""
    rid = req.previous_response_id
    if rid is None:
        return None
    if not store.enabled:
        raise APIError(400, f"previous_response_id: this server keeps no responses "
                       f"({store.off_reason}); send the whole conversation as input",
                       param="previous_response_id")
    found = store.get(rid)
    if found is None:
        raise APIError(404, f"previous_response_id: response {shown(rid)} not found (never stored, "
                       "evicted, or deleted); send the whole conversation as input",
                       param="previous_response_id", code="previous_response_not_found")
    if rid in store.running:
        raise APIError(400, f"previous_response_id: background response {shown(rid)} is still "
                       "running; continue it once its status is final", param="previous_response_id")
    return found


async def _chat_of(req: ResponsesRequest) -> ResponsesChat:
    """The chat request `req` runs as (a long input's built on the large lane, as chat's);
    errors name the Responses fields."""
    try:
        return req.to_chat() if req.num_items <= MANY_MESSAGES else await large_lane(req.to_chat)
    except ValidationError as e:  # the chat request's checks
        raise RequestValidationError(renamed_errors(e.errors())) from None
    except ValueError as e:  # an input item
        raise APIError(400, str(e), param=param_of(str(e))) from None


def _check_call_outputs(req: ResponsesRequest, earlier: list[ChatMessage]) -> None:
    """Every function_call_output answers a function_call made before it (in this input or the
    previous response's conversation), as OpenAI requires; 400 naming the input item otherwise."""
    if isinstance(req.input, str):
        return
    calls = {c.get("id") for m in earlier for c in m.tool_calls or ()}  # the previous conversation's
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        if kind == "function_call":
            calls.add(item.get("call_id"))
        elif kind == "function_call_output" and item.get("call_id") not in calls:
            raise APIError(400, f"input.{i}.call_id: no function_call with call_id {shown(item.get('call_id'))} "
                           "comes before this function_call_output (in this input or the previous "
                           "response)", param=f"input.{i}.call_id")


def _renamed(e: APIError) -> APIError:
    """A chat check's error, naming the Responses field instead of chat's."""
    param = e.param or ""
    head = param.split(".")[0]
    if head not in _PARAMS:
        return e
    # chat's message numbers are not the input's item numbers: input alone
    new = _PARAMS[head] if head == "messages" else _PARAMS[head] + param[len(head):]
    message = new + e.message[len(param):] if e.message.startswith(param) else e.message
    return APIError(e.status, message, new, e.code)


async def create_response(state, store: ResponseStore, req: ResponsesRequest, raw: Request) -> Response:
    """Handle one Responses request end to end."""
    state.check_model(req.model)
    chat = await _chat_of(req)
    previous = _previous(store, req)
    own_turns = chat.messages[req.history_at:]  # this request's input, without instructions
    if previous is not None:
        chat.messages[req.history_at:req.history_at] = previous.turns
    earlier = previous.turns if previous is not None else []
    if req.num_items + len(earlier) <= MANY_MESSAGES:
        _check_call_outputs(req, earlier)
    else:  # a long conversation is scanned on the large lane, as it was built
        await large_lane(_check_call_outputs, req, earlier)
    try:
        params, prompt_ids = await chat_inputs(state, chat)
    except APIError as e:
        raise _renamed(e) from None
    rid, engine_id = response_id("resp_", raw, chat)
    if any(c in _NOT_IN_A_PATH for c in rid) or not rid.isprintable():
        raise APIError(400, "request_id / X-Request-Id: a response's id names it in URL paths "
                       "(GET /v1/responses/{id}), so it may not hold '/', '?', '#', '%', spaces or "
                       f"control characters; got {rid.removeprefix('resp_')[:64]!r}", param="request_id")
    keep = req.store and store.enabled
    if req.background and not keep:
        raise APIError(400, "background: a background response is polled from the store, so it needs "
                       "store true and a server that keeps responses (--responses-store-size > 0"
                       + ("" if store.enabled else f"; here {store.off_reason}") + ")",
                       param="background")
    if keep:
        background.check_running(store, rid, req.background)
    head = response_head(state, req, chat, rid, keep)
    builder = ChatBuilder(state, chat)
    tracker = state.metrics.tracker(params.n, params.max_tokens, state.frontend.output_logger())

    def save(response: dict, body: bytes | None) -> bool:
        """Keep the response (`body`: its JSON, None: written here) if asked, before it is sent;
        False when it could not be (alone over the store's byte bound): its `store` is then
        false, so that the client is told."""
        if not keep:
            return True
        if not req.background and rid in store.running:  # a background response of this id started
            response["store"] = False                      # meanwhile: its entry, which GET polls, stays
            return False
        body = json.dumps(response, allow_nan=False).encode() if body is None else body
        if _save(store, rid, body, response["output"], previous, own_turns, req.input):
            return True
        response["store"] = False
        return False

    if req.background:  # submitted, not primed: the answer does not wait for the queue and prefill
        def events_of(streams, progress, save_final):
            return stream_events(streams, builder, ResponseEvents(head), progress,
                                 functools.partial(finished, state, head), save_final)
        return background.submit(state, store, rid, engine_id, prompt_ids, params, tracker, head, save,
                                 functools.partial(_whole, state, head, builder), req.input,
                                 events_of if req.stream else None)
    try:
        streams = await start_streams(state, raw, [prompt_ids], params, engine_id,
                                      ("input", "max_output_tokens"))
    except ClientDisconnected:  # gone while its prompt was being accepted: aborted
        tracker.close(1)
        return Response(status_code=499)

    if req.stream:
        streams.stall_timeout = state.limits.stream_stall_timeout
        events = stream_events(streams, builder, ResponseEvents(head), tracker,
                               functools.partial(finished, state, head), save)
        return StreamingResponse(events, media_type="text/event-stream")
    try:
        finals = await until_disconnect(raw, _collect(streams, tracker))
    except ClientDisconnected:
        return Response(status_code=499)
    except ValueError as e:  # the output failed its constraint (handler._check_failed)
        raise APIError(400, str(e), param=param_of(str(e))) from None
    finally:
        streams.close()
        tracker.close(1)

    response, body = await _whole(state, head, builder, finals)
    if not save(response, body):  # a large body: written again off the loop
        body = await asyncio.to_thread(lambda: json.dumps(response, allow_nan=False).encode())
    return Response(body, media_type="application/json")


async def _whole(state, head: dict, builder: ChatBuilder, finals: list[RequestOutput]) -> tuple[dict, bytes]:
    """The finished response and its JSON; a large one (many tokens with logprobs) built on a
    worker thread, as chat's."""
    def build() -> tuple[dict, bytes]:
        final = finals[0]
        choice = builder.choice(0, final.outputs[0])
        logprobs = (choice["logprobs"] or {}).get("content") or []
        o = final.outputs[0]
        items = items_of(choice["message"], logprobs, o.finish_reason, content_after_calls(builder, o.text))
        response = finished(state, head, final, items)
        return response, json.dumps(response, allow_nan=False).encode()
    return await asyncio.to_thread(build) if _entries(finals) > OFF_LOOP_ENTRIES else build()


def response_head(state, req: ResponsesRequest, chat: ResponsesChat, rid: str, stored: bool) -> dict:
    """The response object before its output: the request's settings echoed, as OpenAI returns
    them (temperature, top_p and max_output_tokens as the request runs, defaults applied)."""
    fmt = req.text.format if req.text is not None else None
    text = {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}}
    if req.text is not None and req.text.verbosity is not None:
        text["verbosity"] = req.text.verbosity
    reasoning = req.reasoning
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": req.background, "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": chat.max_tokens,
            "max_tool_calls": req.max_tool_calls, "model": state.model_name, "output": [],
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "prompt_cache_key": req.prompt_cache_key,
            "reasoning": {"effort": reasoning.effort if reasoning else None,
                          "summary": reasoning.summary if reasoning else None},
            "safety_identifier": req.safety_identifier, "service_tier": "default", "store": stored,
            "temperature": chat.temperature, "text": text, "tool_choice": req.tool_choice,
            "tools": [t.model_dump() for t in req.tools], "top_logprobs": req.top_logprobs or 0,
            "top_p": chat.top_p, "truncation": "disabled", "usage": None, "user": req.user,
            "metadata": req.metadata or {}}


def finished(state, head: dict, final: RequestOutput, items: list[dict]) -> dict:
    """The whole response: its status (incomplete when max_output_tokens or the context cut
    it), output items and usage."""
    o = final.outputs[0]
    cut = o.finish_reason == "length"
    reasoning = "".join(part["text"] for item in items if item["type"] == "reasoning"
                        for part in item["content"])
    n_in, n_out = len(final.prompt_token_ids), len(o.token_ids)
    usage = {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
             "output_tokens": n_out,
             "output_tokens_details": {"reasoning_tokens": reasoning_tokens(state.tokenizer, o.token_ids,
                                                                            reasoning)},
             "total_tokens": n_in + n_out}
    return {**head, "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "output": items, "usage": usage}


def reasoning_tokens(tokenizer, token_ids: list[int], reasoning: str) -> int:
    """Output tokens spent reasoning: those before `</think>` where it is one token (DeepSeek's
    tokenizers), else the reasoning text's own tokens."""
    if not reasoning or tokenizer is None:
        return 0
    end = end_token_id(tokenizer)
    if end is not None:
        return token_ids.index(end) if end in token_ids else len(token_ids)
    return min(len(token_ids), len(tokenizer(reasoning, add_special_tokens=False)["input_ids"]))


def _save(store: ResponseStore, rid: str, body: bytes, items: list[dict], previous: Stored | None,
          own_turns: list[ChatMessage], given: str | list) -> bool:
    """Store a finished response (its JSON, its output `items`) with its conversation: the
    previous one's, this input, and this output as an assistant turn (its text and calls;
    reasoning is not replayed); and the request's `given` input, for its input_items."""
    text = "".join(it["content"][0]["text"] for it in items if it["type"] == "message")
    calls = [{"id": it["call_id"], "type": "function",
              "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    out_turn = ChatMessage(role="assistant", content=text if text or not calls else None,
                           tool_calls=calls or None)
    new = [*own_turns, out_turn]
    turn_bytes = sum(map(_turn_bytes, new)) + (previous.turn_bytes if previous is not None else 0)
    turns = [*(previous.turns if previous is not None else ()), *new]
    return store.put(rid, body, turns, turn_bytes, len(body) + turn_bytes + input_bytes(given), given)


# the memory of a stored turn's objects besides its text, in bytes (tracemalloc, CPython 3.11:
# a ChatMessage of one character 489, with one text part 736, with one call 945)
TURN_BYTES, PART_BYTES, CALL_BYTES = 512, 256, 512


def _turn_bytes(m: ChatMessage) -> int:
    """A stored turn's memory, estimated without serialising it (a long input's turns on the
    event loop): its text and calls' characters, and the objects that hold them."""
    parts = m.content if isinstance(m.content, list) else ()
    text = m.content if isinstance(m.content, str) else "".join(
        p.get("text") or "" for p in parts if isinstance(p, dict))
    calls = sum(CALL_BYTES + len(c["function"]["name"]) + len(c["function"]["arguments"])
                + len(c.get("id") or "") for c in m.tool_calls or ())
    return TURN_BYTES + PART_BYTES * len(parts) + len(text) + calls
