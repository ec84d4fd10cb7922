"""Background responses (`POST /v1/responses` with `background: true`; server/responses.py).

The prompt is submitted to the engine, not primed, so the POST is answered at once with the
response `queued`; a task then collects the output, marks the stored entry `in_progress` at the
first output, and stores the final state (`completed`, `incomplete`, `failed` or `cancelled`).
`store.running` holds the running tasks by id: GET polls the store, /cancel and DELETE cancel the
task (`stop`). The store never evicts a running entry, and at most --responses-store-size run at
once (a 429 past that).
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi.responses import Response

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


def submit(state, store: ResponseStore, rid: str, engine_id: str, prompt_ids, params, tracker, head: dict,
           save, whole, given) -> Response:
    """Hand the prompt to the engine (a refusal at submission: a 400) and start its task, with no
    await in between, so the checks made before (check_running) still hold. `save(response,
    body)` stores a response (False: too large), `whole(finals)` builds the finished one; `given`
    is the request's input, stored with the queued response for its input_items."""
    streams = submit_streams(state, [prompt_ids], params, engine_id)
    if streams.refused is not None:
        streams.close()
        tracker.close(1)
        if not isinstance(streams.refused, ValueError):
            raise streams.refused
        raise refusal_error(streams.refused, ("input", "max_output_tokens"))

    def put(status: str) -> bytes:
        body = json.dumps({**head, "status": status}, allow_nan=False).encode()
        store.put(rid, body, [], 0, len(body) + input_bytes(given), given)
        return body

    def final(response: dict, body: bytes | None) -> bytes:
        if not save(response, body):  # alone over --responses-store-max-bytes: keep why
            response = {**head, "status": "failed", "error": {"code": "server_error", "message":
                        "the response is larger than --responses-store-max-bytes"}}
            save(response, None)
        return json.dumps(response, allow_nan=False).encode() if body is None else body

    async def run() -> bytes:
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
        if store.running.get(rid) is t:
            del store.running[rid]

    body = put("queued")
    task = asyncio.ensure_future(run())
    task.add_done_callback(gone)
    store.running[rid] = task
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
