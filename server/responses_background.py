"""Background responses (`POST /v1/responses` with `background: true`; server/responses.py).

The prompt is submitted to the engine, not primed, so the POST is answered at once with the
response `queued`; a task then collects the output, marks the stored entry `in_progress` at the
first output, and stores the final state (`completed`, `incomplete`, `failed` or `cancelled`).
`store.running` holds the running tasks by id: GET polls the store, /cancel and DELETE cancel the
task (`stop`). The store never evicts a running entry, and at most --responses-store-size run at
once (a 429 past that).

With `stream: true` too, the task writes the response's stream events (server/responses_stream.py)
into an `EventLog` kept in the store with the entry, and the POST is answered with a stream that
follows that log: a client that goes away stops only its own stream, not the response, and
`GET /v1/responses/{id}?stream=true&starting_after=N` streams the events after sequence number N
again, following them while the response runs, as OpenAI's background streaming does.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable

from fastapi.responses import Response, StreamingResponse

from engine.outputs import RequestOutput
from server.errors import APIError
from server.handler import _collect, refusal_error, submit_streams
from server.responses_protocol import shown
from server.responses_store import ResponseStore, input_bytes

logger = logging.getLogger(__name__)


def check_running(store: ResponseStore, rid: str, background: bool) -> None:
    """No stored response of a running background one's id; no more running than the store
    keeps."""
    if rid in store.running:
        raise APIError(400, f"request_id: background response {shown(rid)} is still running "
                       "(X-Request-Id / request_id name it)", param="request_id")
    if background and len(store.running) >= store.max_entries:  # each would evict the others
        raise APIError(429, f"background: {len(store.running)} background responses are running, as many "
                       "as the store keeps (--responses-store-size); wait for one to finish",
                       param="background")


class _Progress:
    """The request tracker of a background response, which also marks it in_progress in the
    store at its first output (it is queued until then)."""

    def __init__(self, tracker, mark) -> None:
        self._tracker, self._mark = tracker, mark

    def observe(self, i: int, out: RequestOutput) -> None:
        if self._mark is not None:
            self._mark()
            self._mark = None
        self._tracker.observe(i, out)

    def close(self, n: int) -> None:
        self._tracker.close(n)


class EventLog:
    """A background response's stream events as sent: one SSE event an entry, the entry's index
    its sequence_number (ResponseEvents numbers them from 0), kept for readers that join late or
    come back. Used on the event loop only."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.nbytes = 0
        self.done = False
        self._changed = asyncio.Event()

    def extend(self, text: str) -> None:
        """Add the events of one write (`event: ...\ndata: {...}\n\n` each; the JSON holds no
        raw newline, so an event ends at its blank line)."""
        for piece in text.split("\n\n"):
            if piece:
                self.events.append(piece + "\n\n")
                self.nbytes += len(piece) + 2
        self._wake()

    def close(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, after: int) -> AsyncIterator[str]:
        """The events after sequence number `after` (-1: all), then each new batch as it comes,
        until the response's last event."""
        i = max(after + 1, 0)
        while True:
            if i < len(self.events):
                chunk = "".join(self.events[i:])
                i = len(self.events)
                yield chunk
            elif self.done:
                return
            else:
                await self._changed.wait()


def _terminal_response(log: EventLog) -> dict | None:
    """The response a failed stream's last event (`response.failed`) carries, if it is one."""
    if not log.events:
        return None
    data = log.events[-1].partition("\ndata: ")[2]
    try:
        event = json.loads(data)
    except ValueError:
        return None
    return event.get("response") if event.get("type") == "response.failed" else None


def submit(state, store: ResponseStore, rid: str, engine_id: str, prompt_ids, params, tracker, head: dict,
           save, whole, given, events_of: Callable | None = None) -> Response:
    """Hand the prompt to the engine (a refusal at submission: a 400) and start its task, with no
    await in between, so the checks made before (check_running) still hold. `save(response,
    body)` stores a response (False: too large), `whole(finals)` builds the finished one; `given`
    is the request's input, stored with the queued response for its input_items. `events_of(streams,
    tracker, save)` (a request with stream): the response's stream events (responses_stream.
    stream_events), written to an EventLog in the store; the answer is then a stream of that log."""
    streams = submit_streams(state, [prompt_ids], params, engine_id)
    if streams.refused is not None:
        streams.close()
        tracker.close(1)
        if not isinstance(streams.refused, ValueError):
            raise streams.refused
        raise refusal_error(streams.refused, ("input", "max_output_tokens"))

    log = EventLog() if events_of is not None else None

    def put(status: str) -> bytes:
        body = json.dumps({**head, "status": status}, allow_nan=False).encode()
        store.put(rid, body, [], 0, len(body) + input_bytes(given), given, events=log)
        return body

    def final(response: dict, body: bytes | None) -> bytes:
        """Store the final response (in place of a too large one, a failed one saying why; a
        stream's last event says the same, as `response` is changed in place) with the log."""
        if not save(response, body):  # alone over --responses-store-max-bytes: keep why
            response.clear()
            response.update({**head, "status": "failed", "error": {"code": "server_error", "message":
                             "the response is larger than --responses-store-max-bytes"}})
            save(response, None)
            body = None
        if log is not None:
            store.attach_events(rid, log)  # the save replaced the entry and dropped it
        return json.dumps(response, allow_nan=False).encode() if body is None else body

    async def run_streamed() -> bytes:
        kept: list[bytes] = []

        def save_final(response: dict, body: bytes | None) -> bool:
            kept.append(final(response, body))
            return True
        try:  # stream_events closes the streams and the tracker itself
            async for chunk in events_of(streams, _Progress(tracker, lambda: put("in_progress")), save_final):
                log.extend(chunk)
        except asyncio.CancelledError:  # POST /cancel or DELETE (or the server stopping)
            kept.append(final({**head, "status": "cancelled"}, None))
        finally:
            log.close()
        if kept:
            return kept[-1]
        failed = _terminal_response(log) or {**head, "status": "failed", "error": {
            "code": "server_error", "message": "the response's stream ended without its final event"}}
        return final(failed, None)

    async def run() -> bytes:
        if log is not None:
            return await run_streamed()
        try:
            finals = await _collect(streams, _Progress(tracker, lambda: put("in_progress")))
            response, body = await whole(finals)
        except asyncio.CancelledError:  # POST /cancel or DELETE (or the server stopping)
            response, body = {**head, "status": "cancelled"}, None
        except Exception as e:  # as a stream's failure: the request's own (ValueError) or not
            if isinstance(e, ValueError):  # e.g. its output failed its constraint: no traceback
                logger.warning("background response %s failed: %s", rid, e)
                error = {"code": "invalid_prompt", "message": str(e)}
            else:
                logger.exception("background response %s failed", rid)
                error = {"code": "server_error", "message": f"internal server error ({type(e).__name__})"}
            response, body = {**head, "status": "failed", "error": error}, None
        finally:
            streams.close()
            tracker.close(1)
        return final(response, body)

    def gone(t: asyncio.Task) -> None:
        if t.cancelled():  # cancelled before its first step: run()'s try never ran
            streams.close()
            tracker.close(1)
            final({**head, "status": "cancelled"}, None)
            if log is not None:
                log.close()
        if store.running.get(rid) is t:
            del store.running[rid]

    body = put("queued")
    task = asyncio.ensure_future(run())
    task.add_done_callback(gone)
    store.running[rid] = task
    if log is not None:
        return StreamingResponse(log.follow(-1), media_type="text/event-stream")
    return Response(body, media_type="application/json")


async def stop(store: ResponseStore, rid: str) -> bytes | None:
    """Cancel a running background response and wait until it has stored its final state; its
    JSON, or None when none of this id is running."""
    task = store.running.get(rid)
    if task is None:
        return None
    task.cancel()
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.cancelled():  # this request itself was cancelled
            raise
        await asyncio.sleep(0)  # the task's done callback has stored it (callbacks run in order)
        found = store.get(rid)
        return found.response if found is not None else None
