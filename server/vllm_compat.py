"""vLLM's server extras that its users' scripts and load balancers call: `/version`, `/ping`
(GET and POST, as SageMaker's health check sends it) and CORS from `--allowed-origins`,
`--allowed-methods`, `--allowed-headers`, `--allow-credentials`.

CORS differs from vLLM in one way: vLLM always installs the middleware (every origin allowed by
default); here it is installed only when one of those flags is given, the others then taking
vLLM's defaults (["*"], credentials off), so a server started without them sends no CORS headers.
"""

from __future__ import annotations

from importlib import metadata

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from server.errors import error_response


def version() -> str:
    try:
        return metadata.version("mla-serve")
    except metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "0.1.0"


def install(app: FastAPI, engine, args=None) -> None:
    """Add the routes and, when any CORS flag is set, the CORS middleware."""
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

    async def ping() -> Response:  # as /health
        if engine.errored:
            return error_response(503, "the engine stopped; restart the server")
        state = getattr(app.state, "server", None)
        reason = state.stall_reason() if state is not None else None
        if reason is not None:
            return error_response(503, reason)
        return JSONResponse({})

    for method in ("GET", "POST"):  # a route each: each method its own OpenAPI operation id
        app.add_api_route("/ping", ping, methods=[method], operation_id=f"ping_{method.lower()}")
