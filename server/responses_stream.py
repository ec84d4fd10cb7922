"""The Responses API's output items and stream events, made from what the chat route's builder
(ChatBuilder, server/chat.py) makes of the engine's outputs: a whole message (reasoning, content,
tool calls) becomes output items; a stream's message deltas become events.

Items, in the order the model writes them: `reasoning` (with --reasoning-parser; its text in
`content` as `reasoning_text`, `summary` empty, as vLLM returns it), `message` (the content as one
`output_text` part), one `function_call` per tool call, then a message of the text written
after the calls, if any (`content_after_calls`). An output with none of them is an empty
message. The last item of an output cut by `max_output_tokens` has status "incomplete".

Streamed (`event: TYPE` and `data: {...}` lines, each event numbered by `sequence_number`, as
OpenAI and vLLM send them; no `[DONE]`): `response.created`, `response.in_progress`; per item
`response.output_item.added`, then for reasoning and messages `response.content_part.added`,
`response.reasoning_text.delta` / `response.output_text.delta` (with logprobs when asked),
`response.reasoning_text.done` / `response.output_text.done`, `response.content_part.done`; for
calls `response.function_call_arguments.delta` and `.done`; then `response.output_item.done`;
last `response.completed` or `response.incomplete` with the whole response. A failure after the
headers: an `error` event, then `response.failed`.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable

from engine.outputs import RequestOutput
from server.errors import error_body, param_of
from server.handler import _check_failed
from server.reasoning import split_reasoning
from server.streams import EngineStreams, StreamStalled
from server.tool_calls import CALL_END, ToolCallParser

logger = logging.getLogger(__name__)


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None,
            "status": status}


def output_text(text: str, logprobs: list[dict]) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def message_item(item_id: str, text: str, logprobs: list[dict], status: str) -> dict:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [output_text(text, logprobs)]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id,
            "name": name, "arguments": arguments}


def content_after_calls(builder, text: str) -> str:
    """The end of a whole output's content that the model wrote after its tool calls (text
    after the calls block, or a later call that broke the format), which a stream sends as a
    message after the calls; "" when none. `text`: the output as generated."""
    if builder.tool_parser is None or CALL_END not in text:
        return ""
    if builder.think:
        text = split_reasoning(text)[1] or ""
    parser, after = ToolCallParser(builder.tool_parser), ""
    # fed up to the end of each call: content from a later piece on comes after a call
    pieces = text.split(CALL_END)
    for i, piece in enumerate(pieces):
        called = parser.num_calls > 0
        d = parser.feed(piece if i == len(pieces) - 1 else piece + CALL_END)
        after += d.content if called else ""
    return after + (parser.finish().content if parser.num_calls else "")


def items_of(message: dict, logprobs: list[dict], finish_reason: str | None,
             after: str = "") -> list[dict]:
    """The output items of a whole chat message (ChatBuilder.choice's); `logprobs` (chat's
    entries of every generated token, as vLLM attaches them) go with the message's text, the
    first message's; `after`: the end of the content that follows the calls (a second message,
    as the stream sends it)."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs_"), message["reasoning_content"], "completed"))
    calls = message.get("tool_calls") or []
    content = message.get("content") or ""
    before = content[:len(content) - len(after)] if calls and after and content.endswith(after) else content
    after = content[len(before):]
    if before or not (items or calls or after):
        items.append(message_item(new_id("msg_"), before, logprobs, "completed"))
    for c in calls:
        items.append(call_item(new_id("fc_"), c["id"], c["function"]["name"],
                               c["function"]["arguments"], "completed"))
    if after:
        items.append(message_item(new_id("msg_"), after, [] if before else logprobs, "completed"))
    if finish_reason == "length":
        items[-1]["status"] = "incomplete"
    return items


def _delta_logprobs(entries: list[dict]) -> list[dict]:
    """Chat's logprob entries as a text delta event carries them: without bytes."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
            for e in entries]


class ResponseEvents:
    """One response's stream events, numbered, from the chat deltas of its one choice. Items open
    as their first text arrives and close when another opens or the output ends; closed items
    collect in `items`, which the final response carries."""

    def __init__(self, head: dict) -> None:
        self.head = head  # the response object, before its output
        self.seq = 0
        self.items: list[dict] = []
        self.open: dict | None = None  # the item being written: kind, id, index, text, lps, call
        # logprob entries not yet sent: those of text held back or of reasoning go with the
        # message's next text, as a whole response attaches every token's to the message
        self.pending: list[dict] = []

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, allow_nan=False)}\n\n"

    def start(self) -> list[str]:
        """`response.created` (`queued` for a background response, as it is stored until its
        first output), then `response.in_progress`."""
        response = {**self.head, "status": "in_progress"}
        created = {**response, "status": "queued"} if self.head.get("background") else response
        return [self.event("response.created", response=created),
                self.event("response.in_progress", response=response)]

    def feed(self, choice: dict) -> list[str]:
        """The events of one chat delta (ChatBuilder.deltas' entry)."""
        out: list[str] = []
        delta = choice["delta"]
        if choice.get("logprobs"):
            self.pending += choice["logprobs"]["content"]
        if delta.get("reasoning_content"):
            out += self._ensure("reasoning")
            out.append(self._text_delta("response.reasoning_text.delta", delta["reasoning_content"]))
        # content in a delta that goes on a call already begun was written after it
        after_calls = self.open is not None and self.open["kind"] == "function_call"
        if delta.get("content") and not after_calls:
            out += self._content(delta["content"])
        for call in delta.get("tool_calls") or ():
            if "id" in call:  # a call's first entry: its id and name
                out += self._close("completed")
                out += self._open_item("function_call", call)
            fragment = call["function"].get("arguments") or ""
            if fragment and self.open is not None and self.open["kind"] == "function_call":
                self.open["text"] += fragment
                out.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                      output_index=self.open["index"], delta=fragment))
        if delta.get("content") and after_calls:
            out += self._content(delta["content"])
        if choice.get("finish_reason") is not None:
            if not self.items and self.open is None:
                out += self._ensure("message")  # an empty output is an empty message
            if self.pending and self.open is not None and self.open["kind"] == "message":
                # tokens without text (an EOS): their logprobs in a delta of no text, as chat's
                # finish chunk carries them
                out.append(self._text_delta("response.output_text.delta", ""))
            out += self._close("incomplete" if choice["finish_reason"] == "length" else "completed")
        return out

    def end(self, response: dict) -> str:
        """The last event: `response.<status>` of the finished response (completed or incomplete;
        failed for a background response too large to store, server/responses_background.py)."""
        kind = {"incomplete": "response.incomplete", "failed": "response.failed"}.get(response["status"],
                                                                                    "response.completed")
        return self.event(kind, response=response)

    def failed(self, status: int, message: str) -> dict:
        """The failed response, with the items closed so far."""
        code = "invalid_prompt" if status < 500 else "server_error"
        return {**self.head, "status": "failed", "output": self.items, "error": {"code": code, "message": message}}

    def fail(self, status: int, message: str, response: dict | None = None) -> list[str]:
        """An `error` event (its param the field a 400's message names), then `response.failed`
        with `response` (default: `failed`'s)."""
        err = error_body(status, message)["error"]
        response = self.failed(status, message) if response is None else response
        return [self.event("error", code=err["type"], message=message,
                           param=param_of(message) if status < 500 else None),
                self.event("response.failed", response=response)]

    def _content(self, text: str) -> list[str]:
        return self._ensure("message") + [self._text_delta("response.output_text.delta", text)]

    def _text_delta(self, kind: str, text: str) -> str:
        item = self.open
        item["text"] += text
        fields = {"item_id": item["id"], "output_index": item["index"], "content_index": 0, "delta": text}
        if item["kind"] == "message":
            sent, self.pending = self.pending, []
            item["lps"] += sent
            fields["logprobs"] = _delta_logprobs(sent)
        return self.event(kind, **fields)

    def _ensure(self, kind: str) -> list[str]:
        """Open an item of `kind` unless one is open (closing another)."""
        if self.open is not None and self.open["kind"] == kind:
            return []
        return self._close("completed") + self._open_item(kind)

    def _open_item(self, kind: str, call: dict | None = None) -> list[str]:
        prefix = {"reasoning": "rs_", "message": "msg_", "function_call": "fc_"}[kind]
        item = self.open = {"kind": kind, "id": new_id(prefix), "index": len(self.items), "text": "",
                            "lps": [], "call": call}
        added = self._item(item, "in_progress")
        if kind != "function_call":  # its part follows in content_part.added
            added["content"] = []
        out = [self.event("response.output_item.added", output_index=item["index"], item=added)]
        if kind != "function_call":
            part = ({"type": "reasoning_text", "text": ""} if kind == "reasoning" else output_text("", []))
            out.append(self.event("response.content_part.added", item_id=item["id"],
                                  output_index=item["index"], content_index=0, part=part))
        return out

    def _item(self, item: dict, status: str) -> dict:
        if item["kind"] == "reasoning":
            return reasoning_item(item["id"], item["text"], status)
        if item["kind"] == "message":
            return message_item(item["id"], item["text"], item["lps"], status)
        call = item["call"]
        return call_item(item["id"], call["id"], call["function"]["name"], item["text"], status)

    def _close(self, status: str) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        done = self._item(item, status)
        where = {"item_id": item["id"], "output_index": item["index"]}
        if item["kind"] == "function_call":
            out = [self.event("response.function_call_arguments.done", **where, name=done["name"],
                              arguments=item["text"])]
        elif item["kind"] == "reasoning":
            part = done["content"][0]
            out = [self.event("response.reasoning_text.done", **where, content_index=0, text=item["text"]),
                   self.event("response.content_part.done", **where, content_index=0, part=part)]
        else:
            part = done["content"][0]
            out = [self.event("response.output_text.done", **where, content_index=0, text=item["text"],
                              logprobs=part["logprobs"]),
                   self.event("response.content_part.done", **where, content_index=0, part=part)]
        self.items.append(done)
        out.append(self.event("response.output_item.done", output_index=item["index"], item=done))
        return out


async def stream_events(streams: EngineStreams, builder, events: ResponseEvents, tracker,
                        finish: Callable[[RequestOutput, list[dict]], dict],
                        save: Callable[[dict, bytes | None], bool]) -> AsyncIterator[str]:
    """A response's SSE body: the opening events at once, then the events of each batch of
    engine outputs in one write (a front end behind the engine catches up, as chat's stream
    does), then the final response `finish(final output, items)` makes, handed to
    `save(response, None)` before it is sent (which sets its `store` false if not kept)."""
    pieces: list[str] = []
    final: RequestOutput | None = None
    try:
        yield "".join(events.start())
        try:
            async for batch in streams.batches():
                for i, out in batch:
                    tracker.observe(i, out)
                    _check_failed(out)  # reported in-band, below
                    final = out
                    for o in out.outputs:
                        for choice in builder.deltas(o.index, o):
                            pieces += events.feed(choice)
                if pieces and not streams.done:  # the last ones go out with the final event
                    yield "".join(pieces)
                    pieces = []
            if final is None or not final.finished:
                raise RuntimeError("engine stream ended without a finished output")
            response = finish(final, events.items)
            save(response, None)  # not kept after all: the response says store false
            pieces.append(events.end(response))
        except Exception as e:  # headers are gone: report in-band, as OpenAI does
            if isinstance(e, (ValueError, StreamStalled)):  # the client's doing: no traceback
                logger.warning("response stream %s failed: %s", events.head["id"], e)
            else:
                logger.exception("response stream %s failed", events.head["id"])
            status = 400 if isinstance(e, ValueError) else 408 if isinstance(e, StreamStalled) else 500
            message = str(e) if status != 500 else f"internal server error ({type(e).__name__})"
            failed = events.failed(status, message)
            # kept as failed where asked (GET answers it, as for a background response); if it
            # cannot be, its store says false
            save(failed, None)
            pieces += events.fail(status, message, failed)
        yield "".join(pieces)
    finally:
        streams.close()
        tracker.close(1)
