"""HTTP-level Prometheus series on /metrics, under the names vLLM's server exports (it uses
prometheus-fastapi-instrumentator's defaults), so request-rate, error-rate and latency alerts
written for vLLM work here: `http_requests_total{handler,method,status}` (status grouped as
"2xx", "4xx", ...), `http_request_duration_seconds{handler,method}`,
`http_request_duration_highr_seconds`, `http_request_size_bytes{handler}` and
`http_response_size_bytes{handler}`.

`handler` is the path template of the route that served the request ("/v1/completions"), as the
router writes it into the request's scope; for a request refused before routing (413 and 408 from
the body limit) the template of the route its path and method match; "none" for a path no route
serves. The routes vLLM leaves out (/metrics, /health, /load, /ping, /version, /server_info) are
not counted. A duration runs from the request's arrival until its response's last byte was handed
to the server (a stream's whole length). The request size is its Content-Length header, as the
instrumentator reads it (the bytes read when there is none). Written here on prometheus_client rather than taking the
instrumentator as a dependency: five series in one ASGI middleware.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, Summary
from starlette.routing import Match

METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "CONNECT", "TRACE"})
EXCLUDED = frozenset({"/metrics", "/health", "/load", "/ping", "/version", "/server_info"})
# the instrumentator's buckets: coarse per route, fine without labels
_BUCKETS = (0.1, 0.5, 1.0)
_HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5,
                  4.0, 4.5, 5.0, 7.5, 10.0, 30.0, 60.0)


class HttpMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("http_requests_total", "Total number of requests by method, status "
                                "and handler.", ["method", "status", "handler"], registry=registry)
        self.duration = Histogram("http_request_duration_seconds", "Latency with only few buckets "
                                  "by handler.", ["handler", "method"], buckets=_BUCKETS,
                                  registry=registry)
        self.duration_highr = Histogram("http_request_duration_highr_seconds", "Latency with many "
                                        "buckets but no labels.", buckets=_HIGHR_BUCKETS,
                                        registry=registry)
        self.request_size = Summary("http_request_size_bytes", "Content length of incoming "
                                    "requests by handler.", ["handler"], registry=registry)
        self.response_size = Summary("http_response_size_bytes", "Content length of outgoing "
                                     "responses by handler.", ["handler"], registry=registry)


def route_path(scope) -> str:
    """The request's path below --root-path: uvicorn puts the root path in front of
    scope["path"] (and in scope["root_path"])."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        return path[len(root):] or "/"
    return path


def handler_of(routes, scope) -> str:
    """The path template of the first of `routes` that serves the request's path with its method,
    else of the first that serves the path (the router's 405), else "none"."""
    partial = None
    for route in routes:
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return route.path
        if match == Match.PARTIAL and partial is None:
            partial = route.path
    return partial or "none"


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class HttpMetricsMiddleware:
    """ASGI middleware that observes every HTTP request but those of EXCLUDED routes. `routes()`
    lists the app's routes (each with a `path`), matched only for a request that the router
    never saw."""

    def __init__(self, app, registry: CollectorRegistry, routes=lambda: []) -> None:
        self.app = app
        self.m = HttpMetrics(registry)
        self.routes = routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status, sent, received = 500, 0, 0

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
            return message

        async def counting_send(message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, counting_receive, counting_send)
        finally:
            # the router writes the matched route into the scope it was handed, this one
            route = scope.get("route")
            handler = getattr(route, "path", None) or handler_of(self.routes(), scope)
            if handler not in EXCLUDED:
                self._observe(scope, handler, status, time.perf_counter() - start, received, sent)

    def _observe(self, scope, handler: str, status: int, elapsed: float, received: int, sent: int) -> None:
        # a label value per method a client may invent would grow /metrics without bound
        method = scope["method"] if scope["method"] in METHODS else "other"
        length = _content_length(scope)
        self.m.requests.labels(method, f"{str(status)[0]}xx", handler).inc()
        self.m.duration.labels(handler, method).observe(elapsed)
        self.m.duration_highr.observe(elapsed)
        self.m.request_size.labels(handler).observe(received if length is None else length)
        self.m.response_size.labels(handler).observe(sent)
