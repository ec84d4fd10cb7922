"""Transport-level limits: request body size, body read time, header read time.

A client must not hold a socket or the server's memory without bound: the request line and
headers must arrive within `header_timeout` seconds of the connection (or of the previous
response, on a kept-alive connection), the whole body within `body_timeout` seconds, and the body
may not exceed `max_body_bytes` (413, checked on Content-Length before anything is read and again
while reading); the bodies being read at once may not exceed `max_inflight_bytes` together (503).
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.h11_impl import H11Protocol

from server.errors import error_body


class BodyLimitMiddleware:
    """ASGI middleware: reads the whole body under a size and a time limit, then hands it on.

    Later `receive()` calls go to the server's, so disconnect detection keeps working.
    """

    def __init__(self, app, max_body_bytes: int, body_timeout: float,
                 max_inflight_bytes: int | None = None) -> None:
        self.app, self.max_body_bytes, self.body_timeout = app, max_body_bytes, body_timeout
        # bytes of bodies still being read, over every connection: each body is bounded alone,
        # but many slow ones at once would hold max_body_bytes each (60 held ~1 GB)
        self.max_inflight_bytes, self.inflight = max_inflight_bytes, 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await self._refuse(send, 413, self._too_large())
        try:
            body = await _with_timeout(self._read(receive), self.body_timeout)
        except asyncio.TimeoutError:
            return await self._refuse(send, 408, f"the request body did not arrive within "
                                                 f"{self.body_timeout:g} s (--http-body-timeout)")
        except _TooLarge:
            return await self._refuse(send, 413, self._too_large())
        except _Busy:
            return await self._refuse(send, 503, f"the server is reading more than {self.max_inflight_bytes} "
                                                 "bytes of request bodies at once (--max-inflight-body-bytes); "
                                                 "retry later")
        except _Disconnected:
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive) -> bytes:
        chunks, total = [], 0
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise _Disconnected()
                chunk = message.get("body", b"")
                if not message.get("more_body", False) and not chunks:  # the whole body at once
                    if len(chunk) > self.max_body_bytes:
                        raise _TooLarge()
                    return chunk
                total += len(chunk)
                self.inflight += len(chunk)
                if total > self.max_body_bytes:
                    raise _TooLarge()
                if self.max_inflight_bytes is not None and self.inflight > self.max_inflight_bytes:
                    raise _Busy()
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
        finally:
            self.inflight -= total

    def _too_large(self) -> str:
        return (f"request body is larger than {self.max_body_bytes} bytes "
                f"(--max-request-body-bytes)")

    @staticmethod
    async def _refuse(send, status: int, message: str) -> None:
        body = json.dumps(error_body(status, message)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


async def _with_timeout(coro, seconds: float):
    """`await coro` under a time limit (asyncio.TimeoutError past it). Where the event loop has
    asyncio.timeout (Python 3.11+) the coroutine runs in the caller's task: a body that is already
    in is read without giving up the loop, so that a burst of requests each reaches the engine in
    one go, rather than all of them a stage at a time (wait_for runs it as a task of its own,
    one more turn of the loop over every other request for each)."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(seconds):
            return await coro
    return await asyncio.wait_for(coro, seconds)


class _TooLarge(Exception):
    pass


class _Busy(Exception):
    pass


class _Disconnected(Exception):
    pass


def header_timeout_protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing connections whose request headers take longer than
    `header_timeout` seconds (uvicorn itself times out only idle kept-alive connections)."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _awaiting_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout, self._header_timed_out)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timed_out(self) -> None:
            self._header_timer = None
            if self._awaiting_headers() and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._awaiting_headers():
                self._arm()  # a new request starts on a kept-alive connection
            super().data_received(data)
            if not self._awaiting_headers():
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol
