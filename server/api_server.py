"""The FastAPI app: OpenAI routes, tokenizer routes, health and metrics.

The engine core steps in its own process (AsyncLLM); handlers only await its async generators,
so a slow client never stalls a step and HTTP work never waits for one.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from functools import lru_cache

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from server.chat import chat_prompt_ids, create_chat_completion
from server.completions import create_completion
from server.errors import APIError, error_response, install_error_handlers
from server.metrics import ServerMetrics
from server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                             TokenizeRequest)


class ServerState:
    """What the handlers share: the engine, its tokenizer, metrics and the API key."""

    def __init__(self, engine, api_key: str | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name: str = engine.model_name
        self.max_model_len: int = engine.max_model_len
        self.api_key = api_key
        self.metrics = ServerMetrics(engine)
        self.background: set[asyncio.Task] = set()  # abort tasks outliving their request
        self.created = int(time.time())
        # Logprobs name every token they mention; decoding ids one by one is the hot part.
        self.token_str = lru_cache(maxsize=1 << 16)(self._token_str)

    def _token_str(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def need_tokenizer(self) -> None:
        """400 on routes that only a tokenizer can answer."""
        if self.tokenizer is None:
            raise APIError(400, "this server has no tokenizer (started with --skip-tokenizer-init, "
                           "or the model directory has none): send and read token ids",
                           code="no_tokenizer")

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def check_model(self, model: str | None) -> None:
        """404 for a model name this server does not serve (None means the served one); 503
        once the engine has died."""
        if self.engine.errored:
            raise APIError(503, "the engine stopped; restart the server")
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")

    async def check_api_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
                token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")


def build_app(engine, args=None) -> FastAPI:
    """The HTTP app around a started engine (AsyncLLM or anything with its interface).

    `args` is the parsed `serve` namespace (or None); only `api_key` is read from it.
    """
    state = ServerState(engine, api_key=getattr(args, "api_key", None))
    app = FastAPI(title="mla-serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    install_error_handlers(app)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(state.check_api_key)])

    @v1.post("/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await create_completion(state, req, raw)

    @v1.post("/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(state, req, raw)

    @v1.get("/models")
    async def models() -> dict:
        card = {"id": state.model_name, "object": "model", "created": state.created,
                "owned_by": "mla-serve", "root": state.model_name,
                "max_model_len": state.max_model_len}
        vocab = getattr(engine, "vocab_size", None)
        if vocab is not None:  # token-id clients need it when there is no /tokenizer_info
            card["vocab_size"] = vocab
        return {"object": "list", "data": [card]}

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if engine.errored:
            return error_response(503, "the engine stopped; restart the server")
        return JSONResponse({})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        state.check_model(req.model)
        state.need_tokenizer()
        if req.messages is not None:
            try:
                conversation = [{"role": m.role, "content": m.text()} for m in req.messages]
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
            ids = chat_prompt_ids(state.tokenizer, conversation, req.add_generation_prompt)
        else:
            ids = state.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
        body = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids)
        return body

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        state.check_model(req.model)
        state.need_tokenizer()
        vocab = len(state.tokenizer)
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens: token id {bad} is outside [0, {vocab})", param="tokens")
        return {"prompt": state.decode(req.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        state.need_tokenizer()
        tok = state.tokenizer
        return {"tokenizer_class": type(tok).__name__,
                "bos_token": _str_or_none(tok.bos_token), "bos_token_id": tok.bos_token_id,
                "eos_token": _str_or_none(tok.eos_token), "eos_token_id": tok.eos_token_id,
                "pad_token": _str_or_none(tok.pad_token), "unk_token": _str_or_none(tok.unk_token),
                "chat_template": getattr(tok, "chat_template", None),
                "model_max_length": state.max_model_len, "vocab_size": len(tok)}

    return app


def _str_or_none(token) -> str | None:
    return None if token is None else str(token)
