"""Fan-in of several engine requests (one per prompt) and client-disconnect detection."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request

from engine.outputs import RequestOutput
from common.sampling_params import SamplingParams

T = TypeVar("T")
logger = logging.getLogger(__name__)


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


def engine_request_ids(request_id: str, num_prompts: int) -> list[str]:
    """The engine request ids of a request's prompts, one each."""
    return [f"{request_id}-{i}" for i in range(num_prompts)]


class StreamStalled(Exception):
    """The consumer (a stream's client) read nothing for `stall_timeout` seconds while outputs waited."""


class EngineStreams:
    """Runs one engine request per prompt and yields `(prompt_index, RequestOutput)` as they come.

    Each engine generator is drained by its own task into one queue, so a slow prompt never holds
    back the others. `close()` cancels what is still running and aborts it in the engine (its KV
    blocks are freed); call it on every exit path.

    The queue holds what the consumer has not taken yet: for a stream, what its client has not
    read. A client that stops reading would let it grow for as long as the engine runs (a request
    of 128 choices with logprobs grew the HTTP process by 57 MB); so once outputs have waited
    `stall_timeout` seconds with none taken, the requests are aborted, the waiting outputs dropped,
    and the consumer, should it come back, gets StreamStalled.
    """

    def __init__(self, engine, prompts: list[str | list[int]], params: SamplingParams,
                 request_id: str, background: set[asyncio.Task]) -> None:
        self._engine = engine
        self._background = background  # strong refs to clean-up tasks that outlive the request
        self.stall_timeout: float | None = None  # set for a stream (the client reads its outputs)
        self._unread_since: float | None = None  # loop time since which outputs wait untaken
        self.request_id = request_id
        self.stalled = False
        self.request_ids = engine_request_ids(request_id, len(prompts))
        # items: (prompt_idx, output | None, exception | None); (i, None, None) = generator ended
        self._queue: asyncio.Queue = asyncio.Queue()
        self._buffer: list[tuple[int, RequestOutput]] = []
        self._open = set(range(len(prompts)))
        self._tasks = []
        self.refused: Exception | None = None  # the first prompt the engine refused at submission
        for i, p in enumerate(prompts):
            # AsyncLLM submits a token-id prompt here, before the task runs (engine/async_llm.py);
            # a refusal is delivered by the task, in order, like any failure
            try:
                source = engine.generate(p, params, self.request_ids[i])
            except Exception as e:  # noqa: BLE001 - the consumer maps it to 400/500
                source = e
                self.refused = self.refused or e
            self._tasks.append(asyncio.create_task(self._pump(i, source)))

    async def _pump(self, i: int, source: AsyncIterator[RequestOutput] | Exception) -> None:
        try:
            if isinstance(source, Exception):
                raise source
            async for out in source:
                self._queue.put_nowait((i, out, None))
                if self.stall_timeout is not None and self._stalled_now():
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # delivered to the consumer, which maps it to 400/500
            self._queue.put_nowait((i, None, e))
            return
        self._queue.put_nowait((i, None, None))

    def _stalled_now(self) -> bool:
        """After a put: whether the oldest untaken output has waited past stall_timeout; if so
        (once), drop what waits, hand the consumer StreamStalled, and abort every prompt."""
        now = asyncio.get_running_loop().time()
        if self._unread_since is None:
            self._unread_since = now
            return False
        if now - self._unread_since <= self.stall_timeout:
            return False
        waiting = self._queue.qsize()
        while not self._queue.empty():
            self._queue.get_nowait()
        logger.warning("request %s: its client read nothing for %.0f s while %d outputs waited: aborted "
                       "(--stream-stall-timeout)", self.request_id, now - self._unread_since, waiting)
        self.stalled = True
        self._queue.put_nowait((min(self._open, default=0), None, StreamStalled(
            f"the client read nothing for {self.stall_timeout:g} s (--stream-stall-timeout)")))
        self.close()
        return True

    async def _next(self) -> tuple[int, RequestOutput | None]:
        return self._take(await self._queue.get())

    def _next_nowait(self) -> tuple[int, RequestOutput | None]:
        return self._take(self._queue.get_nowait())

    def _take(self, item: tuple) -> tuple[int, RequestOutput | None]:
        # the consumer is reading: the clock runs again from now for what still waits
        self._unread_since = None if self._queue.empty() else asyncio.get_running_loop().time()
        i, out, exc = item
        if exc is not None:
            raise exc
        if out is None or out.finished:
            self._open.discard(i)
        return i, out

    async def prime(self) -> None:
        """Wait until every prompt was accepted (first output) or one was refused (raises)."""
        started: set[int] = set()
        while len(started) < len(self._tasks):
            i, out = await self._next()
            started.add(i)
            if out is not None:
                self._buffer.append((i, out))

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._buffer:
            yield self._buffer.pop(0)
        while self._open:
            i, out = await self._next()
            if out is not None:
                yield i, out

    @property
    def done(self) -> bool:
        """Every prompt's stream has ended (nothing more will come)."""
        return not self._open and not self._buffer

    async def batches(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """The same outputs, in the same order, as lists: each waits for one output, then takes
        every output that has already arrived. A consumer that fell behind the engine (several
        steps queued) handles them in one go, e.g. one socket write for all their SSE events. A
        failure is raised after the outputs that came before it were yielded."""
        batch, self._buffer = self._buffer, []
        while self._open or batch:
            if not batch:
                i, out = await self._next()
                if out is not None:
                    batch.append((i, out))
            try:
                while self._open and not self._queue.empty():
                    i, out = self._next_nowait()
                    if out is not None:
                        batch.append((i, out))
            except Exception:  # noqa: BLE001 - a failed prompt: after what came before it
                if batch:
                    yield batch
                raise
            if batch:
                yield batch
                batch = []

    def close(self) -> None:
        """Cancel unfinished engine requests and abort them (frees their KV blocks).

        Synchronous, so that it also runs to completion inside a cancelled scope (a streaming
        response whose client left); the aborts happen in a background task.
        """
        running = [(rid, t) for rid, t in zip(self.request_ids, self._tasks) if not t.done()]
        if not running:
            return
        for _, t in running:
            t.cancel()
        reap = asyncio.ensure_future(self._reap(running))
        self._background.add(reap)
        reap.add_done_callback(self._background.discard)

    async def _reap(self, running: list[tuple[str, asyncio.Task]]) -> None:
        await asyncio.gather(*(t for _, t in running), return_exceptions=True)
        for rid, _ in running:
            try:  # abort is a no-op for a request already gone: a failure here is the engine's
                await self._engine.abort(rid)
            except Exception:
                logger.warning("aborting %s after its stream was cancelled failed", rid, exc_info=True)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, raising ClientDisconnected (and cancelling it) if the client leaves first."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        # The body was already read, so the next ASGI message is the disconnect.
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
