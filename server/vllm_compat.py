"""vLLM's server extras that its users' scripts and load balancers call: `/version`, `POST
/invocations` (SageMaker's inference
route: chat or completions by the body's shape), CORS from `--allowed-origins`,
`--allowed-methods`, `--allowed-headers`, `--allow-credentials`, the X-Request-Id response header
(`--enable-request-id-headers`), `/load` (`--enable-server-load-tracking`), `POST
/reset_prefix_cache` (SGLang's `/flush_cache` the same), which benchmarks call between runs, and
with `--profiler-config` `POST /start_profile` and `/stop_profile` (`vllm bench serve --profile`).

CORS differs from vLLM in one way: vLLM always installs the middleware (every origin allowed by
default); here it is installed only when one of those flags is given, the others then taking
vLLM's defaults (["*"], credentials off), so a server started without them sends no CORS headers.
"""

from __future__ import annotations

import uuid
from importlib import metadata

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from engine.async_llm import EngineDeadError
from server.chat import create_chat_completion
from server.chat_protocol import ChatCompletionRequest
from server.completions import create_completion
from server.errors import APIError, error_response
from server.frontend_options import FrontendOptions
from server.http_metrics import route_path
from server.protocol import CompletionRequest
from server.request_body import parse_body
from server.request_fields import MAX_REQUEST_ID_CHARS

# the routes whose POSTs --enable-server-load-tracking counts (vLLM's generating ones here)
LOAD_TRACKED = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations"})


def version() -> str:
    try:
        return metadata.version("mla-serve")
    except metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "0.1.0"


def install(app: FastAPI, engine, args=None) -> None:
    """Add the routes and, when any CORS flag is set, the CORS middleware; the X-Request-Id and
    load-counting middleware as --enable-request-id-headers and --enable-server-load-tracking say."""
    origins, methods, headers = (getattr(args, f, None) for f in
                                 ("allowed_origins", "allowed_methods", "allowed_headers"))
    credentials = bool(getattr(args, "allow_credentials", False))
    if origins is not None or methods is not None or headers is not None or credentials:
        app.add_middleware(CORSMiddleware, allow_origins=origins or ["*"],
                           allow_methods=methods or ["*"], allow_headers=headers or ["*"],
                           allow_credentials=credentials)

    @app.get("/version")
    async def get_version() -> dict:
        return {"version": version()}

    frontend = FrontendOptions.from_args(args)
    app.state.server_load_metrics = 0  # vLLM's name; stays 0 without load tracking
    if frontend.server_load_tracking:
        app.add_middleware(LoadTrackingMiddleware, state=app.state)
    # Added last: the outermost user middleware, so every response has the header but a 500
    # (Starlette's error handler sits outside user middleware; vLLM's has the same gap).
    if frontend.request_id_headers:
        app.add_middleware(RequestIdHeaderMiddleware)

    @app.get("/load")
    async def load() -> dict:
        return {"server_load": app.state.server_load_metrics}

    state = app.state.server

    # Forgets the prefix cache's blocks: no request sent after the response hits a block cached
    # before it. vLLM's query flags are accepted: running requests keep their blocks either way
    # (their KV stays right; vLLM preempts them with reset_running_requests=true because its
    # weights may have changed, which cannot happen here) and there is no external cache. It
    # needs --api-key's header as /v1 does: anyone able to reach it could otherwise cost every
    # user their cache hits.
    async def reset_prefix_cache(reset_running_requests: bool = False, reset_external: bool = False) -> Response:
        if engine.errored:
            return error_response(503, "the engine stopped; restart the server")
        engine.reset_prefix_cache()
        return Response(status_code=200)

    auth = [Depends(state.check_api_key)]
    app.add_api_route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"], dependencies=auth)
    for method in ("GET", "POST"):  # SGLang's route
        app.add_api_route("/flush_cache", reset_prefix_cache, methods=[method], dependencies=auth,
                          operation_id=f"flush_cache_{method.lower()}")

    if getattr(getattr(engine, "args", None), "profiler_config", None) is not None:
        async def profile_call(call):
            """The engine's answer; misuse (already running, not running) a 400, a dead engine 503."""
            try:
                return await call()
            except ValueError as e:
                raise APIError(400, str(e)) from None
            except EngineDeadError as e:
                raise APIError(503, str(e)) from None

        async def start_profile() -> Response:
            await profile_call(engine.start_profile)
            return JSONResponse({})

        async def stop_profile() -> Response:
            """Answers once every rank has written its trace (seconds to minutes for a long
            profile; the engine steps no further meanwhile)."""
            return JSONResponse({"traces": await profile_call(engine.stop_profile)})
        app.add_api_route("/start_profile", start_profile, methods=["POST"], dependencies=auth)
        app.add_api_route("/stop_profile", stop_profile, methods=["POST"], dependencies=auth)

    @app.post("/invocations", dependencies=[Depends(state.check_api_key)])
    async def invocations(raw: Request) -> Response:
        """SageMaker's inference route, as vLLM serves it: a body with `messages` is a chat
        completion, one with `prompt` a completion. Unlike vLLM's, it asks for --api-key as /v1
        does (vLLM leaves it open)."""
        req = await parse_body(raw, _invocation_model, any_content_type=True)
        create = create_chat_completion if isinstance(req, ChatCompletionRequest) else create_completion
        return await create(state, req, raw)


def _invocation_model(body) -> type:
    """/invocations' body is a chat completion with `messages`, a completion with `prompt`."""
    if isinstance(body, dict) and "messages" in body:
        return ChatCompletionRequest
    if isinstance(body, dict) and "prompt" in body:
        return CompletionRequest
    raise APIError(400, "/invocations: the body needs `messages` (a chat completion) or "
                   "`prompt` (a completion)", param="messages")


class RequestIdHeaderMiddleware:
    """ASGI middleware: every HTTP response carries X-Request-Id, the request's own header when it
    sent one (the completions' ids are built from it too), else a random hex id (vLLM's). A header
    past MAX_REQUEST_ID_CHARS, which the API routes refuse, is not echoed: its response gets a
    random id, so an oversized header costs the server no more than its parse."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = [v for k, v in scope.get("headers") or [] if k.lower() == b"x-request-id"]
        fits = given and len(given[0]) <= MAX_REQUEST_ID_CHARS
        rid = given[0] if fits else uuid.uuid4().hex.encode()

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers") or []
                           if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class LoadTrackingMiddleware:
    """ASGI middleware: `state.server_load_metrics` counts the POSTs to LOAD_TRACKED in flight,
    from their arrival until their response has been sent (a stream: its last event) or the
    client left. vLLM's count starts a little later, once the body is read and validated."""

    def __init__(self, app, state) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or route_path(scope) not in LOAD_TRACKED:
            return await self.app(scope, receive, send)
        self.state.server_load_metrics += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.server_load_metrics -= 1
