"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`, never a traceback."""

from __future__ import annotations

import logging
import sys

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error the client can act on; rendered with its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    err_type = _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def _allowed_methods(request: Request) -> set[str]:
    """The methods of every route whose path matches the request's (a route per method, as
    /health's GET and HEAD, each matches the path alone); `app.state.method_routes` lists the
    routes of included routers too (server/api_server.py)."""
    listed = getattr(request.app.state, "method_routes", None)
    methods: set[str] = set()
    for route in listed() if listed is not None else request.app.router.routes:
        if getattr(route, "methods", None) and route.matches(request.scope)[0] != Match.NONE:
            methods |= route.methods
    return methods


def param_of(message: str) -> str | None:
    """The field a validation message starts with ("max_tokens must be ...", "stop.0: ...")."""
    word = message.split(" ", 1)[0].rstrip(":")
    head = word.split(".", 1)[0]
    return word if head.isidentifier() and head.islower() else None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """First pydantic error as 'field: what is wrong (got value)'."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ())]
    if loc and loc[0] in ("query", "path", "header", "cookie"):  # where a non-body field came from
        loc = loc[1:]
    loc = [p for p in loc if p != "body"]
    # Pydantic appends the failing union branch or validator kind to loc; keep the field path.
    loc = [p for p in loc if p not in ("str", "int", "float", "bool", "none")
           and not p.startswith(("function-", "list[", "dict[", "constrained-"))]
    param = ".".join(loc) or None
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if err.get("type") == "json_invalid":
        return f"request body is not valid JSON: {msg}", None
    if err.get("type") == "missing" and param:
        return f"{param}: field required", param
    if err.get("type") == "missing":  # the body itself: empty
        return "request body is empty: a JSON object with the request's fields is needed", None
    got = err.get("input")
    suffix = f" (got {got!r})" if isinstance(got, (int, float, str, bool)) and len(repr(got)) < 80 else ""
    if param is None:  # a check across fields: its message starts with the field it blames
        param = param_of(msg)
    elif not msg.startswith(param.split(".")[0]):
        msg = f"{param}: {msg}"
    return msg + suffix, param


def _shown(path: str, limit: int = 200) -> str:
    """A request path as an error message quotes it: at most `limit` characters (a client's
    100 KB path came back whole)."""
    return path if len(path) <= limit else f"{path[:limit]}... ({len(path)} characters)"


def body_parse_error(cause: BaseException | None) -> str:
    """Why a body could not be parsed, from the JSON parser's error: valid JSON past the parser's
    limits (nesting, an integer's digits) is named as such, anything else is not JSON text."""
    if isinstance(cause, RecursionError):
        return "request body: JSON nested too deeply for the parser (Python's recursion limit, ~1000 levels)"
    if isinstance(cause, ValueError) and "Exceeds the limit" in str(cause):  # int() of a huge literal
        return (f"request body: a number too long to parse (an integer literal of more than "
                f"{sys.get_int_max_str_digits()} digits)")
    if cause is None or isinstance(cause, UnicodeDecodeError):
        return "request body is not valid JSON text (UTF-8)"
    return f"request body is not valid JSON text ({type(cause).__name__}: {str(cause)[:200]})"


def install_error_handlers(app: FastAPI) -> None:
    """Translate every failure into the OpenAI error shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        msg, param = _validation_message(exc)
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if param is None and ctype != "application/json" and any(
                tuple(e.get("loc", ())) == ("body",) for e in exc.errors()):
            # FastAPI reads a body of another type (curl -d's form encoding) as no JSON object
            msg = (f"the request body must be a JSON object sent with Content-Type: application/json "
                   f"(got Content-Type: {ctype or 'none'})")
        return error_response(400, msg, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = str(exc.detail)
        if exc.status_code == 404:
            msg = f"no route {request.method} {_shown(request.url.path)}"
        elif exc.status_code == 405:
            msg = f"method {request.method} is not allowed on {_shown(request.url.path)}"
        elif exc.status_code == 400 and msg == "There was an error parsing the body":
            msg = body_parse_error(exc.__cause__)  # FastAPI raises it from the parser's error
        response = error_response(exc.status_code, msg)
        if exc.status_code == 405:  # RFC 9110: a 405 lists the methods the path allows
            response.headers["Allow"] = ", ".join(sorted(_allowed_methods(request)))
        return response

    @app.exception_handler(Exception)
    async def _fault(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error ({type(exc).__name__})")
