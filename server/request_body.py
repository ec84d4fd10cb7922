"""Request bodies read, parsed and validated by the routes themselves, a large one on a worker
thread.

FastAPI validates a body model declared in a route's signature on the event loop. On this
project's 2-core CPU that held every other client of the server for as long as one large body
took: a 16 MB chat body of 450,000 messages stopped a running stream for 2.25 s, a completion of
1,000,000 token-id prompts for 2.23 s, a logit_bias of 1,000,000 entries for 1.36 s (before the
400 each earned; scripts/bench_body_stall.py). So the OpenAI routes take the raw request and call `parse_body`: a body of up to
INLINE_BODY_BYTES is parsed and validated inline (a thread hop would cost more than it does), a
larger one on the one thread of its own lane, so that huge bodies queue behind each other and
never in front of ordinary requests. The event loop then runs between the validators' Python
steps; what stays on the GIL in one piece is C work on the whole body (the JSON parser, ~0.3 s
for a 16 MB body of token ids on that CPU).

The text check (a lone surrogate such as "\\ud800" is refused, `check_text`) is decided from the
raw bytes when it can be: a UTF-8 body can only hold one through a `\\uD800`-`\\uDFFF` escape or the
bytes ED A0-BF, which the JSON parser decodes leniently. Without either the check is skipped;
with one the models check their text as before.

The errors are those FastAPI's own parsing gave: a 400 naming the field (RequestValidationError,
rendered by server/errors.py), an empty body, a body that is not JSON, a Content-Type other than
JSON. The models' schemas still appear in /openapi.json (`body_openapi`, `add_body_schemas`).
"""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor
from email.message import Message
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from server.errors import APIError, body_parse_error
from server.request_fields import text_checked

INLINE_BODY_BYTES = 1 << 18  # 256 KB: validated inline in well under 10 ms
_LARGE = ThreadPoolExecutor(max_workers=1, thread_name_prefix="body-large")

# what in a UTF-8 JSON body can become a lone surrogate once parsed: an escape of one, or its
# (invalid) UTF-8 encoding, which json.loads decodes with surrogatepass
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


async def parse_body(raw: Request, model: type[BaseModel] | Callable[[Any], type[BaseModel]],
                     any_content_type: bool = False) -> Any:
    """The request's body validated as `model`, or as the model `model(data)` picks for the parsed
    JSON (a callable; it may raise APIError). Raises APIError or RequestValidationError (400).
    `any_content_type`: read the body as JSON whatever its Content-Type says (/invocations, as
    vLLM's; SageMaker clients may send none)."""
    if not any_content_type:
        _check_content_type(raw.headers.get("content-type"))
    body = await raw.body()
    if not body:
        raise APIError(400, "request body is empty: a JSON object with the request's fields is needed")
    if len(body) <= INLINE_BODY_BYTES:
        return _parse(body, model)
    return await asyncio.get_running_loop().run_in_executor(_LARGE, _parse, body, model)


def _check_content_type(ctype: str | None) -> None:
    """JSON bodies only, as FastAPI reads them: Content-Type application/json or a +json type
    (none given is not JSON either: curl -d sends its form encoding's)."""
    if ctype:
        msg = Message()
        msg["content-type"] = ctype
        main, sub = msg.get_content_maintype(), msg.get_content_subtype()
        if main == "application" and (sub == "json" or sub.endswith("+json")):
            return
    shown = (ctype or "").split(";")[0].strip().lower()[:100] or "none"
    raise APIError(400, f"the request body must be a JSON object sent with Content-Type: "
                   f"application/json (got Content-Type: {shown})")


def _parse(body: bytes, model) -> Any:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise APIError(400, body_parse_error(e)) from None
    if not isinstance(model, type):
        model = model(data)
    # each of _SURROGATE's two forms starts with `\u` or the byte 0xED: two substring scans (~5 µs
    # for a 580-token body) skip the regex's (~23 µs) for the bodies that have neither
    clean = json.detect_encoding(body) == "utf-8" and (
        (b"\\u" not in body and b"\xed" not in body) or _SURROGATE.search(body) is None)
    try:
        if clean:
            with text_checked():
                return model.model_validate(data)
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


def body_openapi(model: type[BaseModel]) -> dict:
    """A route's `openapi_extra`: its JSON body is `model` (its schema added by add_body_schemas)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def add_body_schemas(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """/openapi.json carries `models`' schemas among its components, as it did when FastAPI read
    the bodies itself."""
    default = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = default()
            found = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                own = model.model_json_schema(ref_template="#/components/schemas/{model}")
                found.update(own.pop("$defs", {}))
                found[model.__name__] = own
        return app.openapi_schema

    app.openapi = openapi
