"""The FastAPI app: OpenAI routes, tokenizer routes, health and metrics.

The engine core steps in its own process (AsyncLLM); handlers only await its async generators,
so a slow client never stalls a step and HTTP work never waits for one.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response

from common.offload import off_loop, text_chars
from server import responses, vllm_compat
from server.chat import chat_prompt_ids, create_chat_completion, encode
from server.chat_protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest, template_turns
from server.completions import create_completion
from server.errors import APIError, error_response, install_error_handlers
from server.frontend_options import FrontendOptions
from server.http_limits import BodyLimitMiddleware
from server.http_metrics import HttpMetricsMiddleware
from server.limits import ServerLimits
from server.metrics import ServerMetrics
from server.overrides import load_chat_template, load_generation_defaults
from server.protocol import CompletionRequest
from server.reasoning import check_parser_name, end_token_id
from server.request_body import add_body_schemas, body_openapi, parse_body
from server.responses_protocol import ResponsesRequest
from server.tool_calls import check_tool_flags
from server.token_bytes import token_bytes

logger = logging.getLogger(__name__)


class ServerState:
    """What the handlers share: the engine, its tokenizer, metrics and the API key."""

    def __init__(self, engine, api_key: str | None = None,
                 limits: ServerLimits | None = None, reasoning_parser: str | None = None,
                 tool_call_parser: str | None = None, chat_template: str | None = None,
                 request_defaults: dict | None = None,
                 frontend: FrontendOptions | None = None) -> None:
        self.engine = engine
        # vLLM's front-end flags: usage details, forced usage, token-id names, the request log
        self.frontend = frontend or FrontendOptions()
        self.reasoning_parser = reasoning_parser  # --reasoning-parser (server/reasoning.py)
        # --tool-call-parser with --enable-auto-tool-choice (server/tool_calls.py); None: a
        # request with tool_choice "auto" is refused
        self.tool_call_parser = tool_call_parser
        self.chat_template = chat_template  # --chat-template; None: the tokenizer's
        # --generation-config: values of fields a request does not set (server/overrides.py)
        self.request_defaults = dict(request_defaults or {})
        self.tokenizer = engine.tokenizer
        # `</think>` as one token (a constraint with reasoning starts after it: server/chat.py)
        self.think_end_id = end_token_id(self.tokenizer)
        if self.tokenizer is not None:
            self.frontend.check_template_defaults(self.tokenizer)
        self.model_name: str = engine.model_name  # the one responses report
        # Every --served-model-name is accepted as `model`, and so is the --model path (vLLM
        # serves the path by default), but only the first name is ever echoed back.
        self.model_names: list[str] = list(getattr(engine, "model_names", None) or [engine.model_name])
        path = getattr(getattr(engine, "args", None), "model", None)
        self.model_aliases = set(self.model_names) | ({path} if isinstance(path, str) else set())
        self.limits = limits or ServerLimits()
        self.max_model_len: int = engine.max_model_len
        self.api_key = api_key
        self.metrics = ServerMetrics(engine)
        self.background: set[asyncio.Task] = set()  # abort tasks outliving their request
        self.created = int(time.time())
        # Logprobs name every token they mention (lm_eval's echo requests: two a prompt token).
        # Each name is decoded once, here, for the tokenizer's whole vocabulary (~0.3 s for 100k
        # ids), and looked up by index: an LRU of decodes missed a third of the time on a 100k
        # vocabulary, at ~3 µs a miss. Ids past it (a model's padded vocabulary) decode when asked.
        self._names: list[str] = ([] if self.tokenizer is None else
                                  [self.tokenizer.decode([i]) for i in range(len(self.tokenizer))])

    def token_str(self, token_id: int) -> str:
        """The text of one token, as `tokenizer.decode([token_id])` gives it ("token_id:N"
        without a tokenizer)."""
        if 0 <= token_id < len(self._names):
            return self._names[token_id]
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (server/token_bytes.py): its text's UTF-8, or for a token
        holding part of a character the bytes that part is."""
        text = self.token_str(token_id)
        if self.tokenizer is None or "\ufffd" not in text:
            return text.encode("utf-8")
        return token_bytes(self.tokenizer, token_id, text)

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
        if model is not None and model not in self.model_aliases:
            served = " or ".join(repr(n) for n in self.model_names)
            raise APIError(404, f"model {model!r} does not exist; this server serves {served}",
                           param="model", code="model_not_found")

    def stall_reason(self) -> str | None:
        """Why the engine counts as wedged (requests held, no step finished for longer than
        --engine-stall-timeout), or None."""
        stalled_for = getattr(self.engine, "stalled_for", None)
        waited = stalled_for() if stalled_for is not None else 0.0
        if waited > self.limits.engine_stall_timeout:
            return (f"the engine has made no progress for {waited:.1f} s while it holds "
                    f"requests (--engine-stall-timeout {self.limits.engine_stall_timeout:g} s)")
        return None

    def check_text_length(self, text: str, field: str) -> None:
        """ValueError, without tokenizing, for text that cannot fit the context in any case."""
        inputs = getattr(self.engine, "inputs", None)
        if inputs is not None:
            inputs.check_text_length(text, field)

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

    `args` is the parsed `serve` namespace (or None): `api_key`, `reasoning_parser`,
    `enable_auto_tool_choice` and `tool_call_parser`, `chat_template`, `generation_config`, the
    CORS flags, the ServerLimits fields and the FrontendOptions flags are read from it.
    """
    limits = ServerLimits.from_args(args)
    frontend = FrontendOptions.from_args(args)
    frontend.note_log_level()
    reasoning_parser = getattr(args, "reasoning_parser", None)
    check_parser_name(reasoning_parser)
    tool_call_parser = check_tool_flags(getattr(args, "enable_auto_tool_choice", False),
                                        getattr(args, "tool_call_parser", None))
    model_dir = getattr(getattr(engine, "args", None), "model", None)
    defaults = load_generation_defaults(getattr(args, "generation_config", None) or "vllm",
                                        model_dir if isinstance(model_dir, str) else None,
                                        getattr(args, "override_generation_config", None))
    if defaults:
        logger.info("request defaults from generation_config.json and --override-generation-config: "
                    "%s (a request's own values win; --generation-config vllm turns the file's off)",
                    defaults)
    state = ServerState(engine, api_key=getattr(args, "api_key", None), limits=limits,
                        reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser,
                        chat_template=load_chat_template(getattr(args, "chat_template", None)),
                        request_defaults=defaults, frontend=frontend)
    # /docs, /redoc and /openapi.json as vLLM serves them, unless --disable-fastapi-docs
    docs = not getattr(args, "disable_fastapi_docs", False)
    app = FastAPI(title="mla-serve", docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    app.state.server = state
    install_error_handlers(app)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(state.check_api_key)])
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=limits.max_request_body_bytes,
                       max_inflight_bytes=limits.max_inflight_body_bytes,
                       body_timeout=limits.http_body_timeout)
    # outside the body limit: a request refused there (413, 408) is counted too, under the route
    # its path matches among the app's own and /v1's (FastAPI may keep an included router as one
    # entry of the app's list)
    app.add_middleware(HttpMetricsMiddleware, registry=state.metrics.registry,
                       routes=lambda: [*v1.routes, *(r for r in app.router.routes if hasattr(r, "path"))])

    # The routes with a JSON body read and validate it themselves (parse_body: a large body on a
    # worker thread, not on the event loop); their schemas are added to /openapi.json below.
    @v1.post("/completions", openapi_extra=body_openapi(CompletionRequest))
    async def completions(raw: Request) -> Response:
        return await create_completion(state, await parse_body(raw, CompletionRequest), raw)

    @v1.post("/chat/completions", openapi_extra=body_openapi(ChatCompletionRequest))
    async def chat_completions(raw: Request) -> Response:
        return await create_chat_completion(state, await parse_body(raw, ChatCompletionRequest), raw)

    weights = getattr(getattr(engine, "args", None), "model", None)  # the --model path
    vocab = getattr(engine, "vocab_size", None)

    def card(name: str) -> dict:
        """vLLM's model card: root is the weights' path, parent null, one permission record;
        vocab_size too (token-id clients need it when there is no /tokenizer_info)."""
        c = {"id": name, "object": "model", "created": state.created, "owned_by": "mla-serve",
             "root": weights if isinstance(weights, str) else state.model_name, "parent": None,
             "max_model_len": state.max_model_len,
             "permission": [{"id": f"modelperm-{name}", "object": "model_permission", "created": state.created,
                             "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                             "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                             "organization": "*", "group": None, "is_blocking": False}]}
        if vocab is not None:
            c["vocab_size"] = vocab
        return c

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [card(name) for name in state.model_names]}

    @v1.get("/models/{model:path}")
    async def retrieve_model(model: str) -> dict:
        """OpenAI's retrieve (client.models.retrieve): the card of a name `model` accepts."""
        state.check_model(model)
        return card(model if model in state.model_names else state.model_name)

    responses.install(v1, state, args)  # /v1/responses and its stored responses' routes
    app.include_router(v1)
    # every route with its full path, for a 405's Allow header (server/errors.py): newer FastAPI
    # keeps an included router whole in app.router.routes
    app.state.method_routes = lambda: [*v1.routes, *app.router.routes]

    async def health() -> Response:
        if engine.errored:
            return error_response(503, "the engine stopped; restart the server")
        reason = state.stall_reason()
        if reason is not None:
            return error_response(503, reason)
        return Response(status_code=200)  # an empty 200, as vLLM's

    # GET, and HEAD for load balancers that probe with it (the status alone; no body); a route
    # each, so that each method has its own OpenAPI operation id
    for method in ("GET", "HEAD"):
        app.add_api_route("/health", health, methods=[method], operation_id=f"health_{method.lower()}")
    # vLLM's /ping, GET and POST (as SageMaker's health check sends it): /health's answer
    for method in ("GET", "POST"):
        app.add_api_route("/ping", health, methods=[method], operation_id=f"ping_{method.lower()}")

    async def metrics(raw: Request) -> Response:
        body, content_type, encoding = state.metrics.render_for(raw.headers.get("accept"),
                                                                raw.headers.get("accept-encoding"))
        headers = {"Content-Encoding": encoding} if encoding else None
        return Response(body, media_type=content_type, headers=headers)

    # as prometheus_client's own handler (vLLM's): the text or OpenMetrics format by the Accept
    # header, gzip when asked; at /metrics and /metrics/, GET and HEAD
    for path in ("/metrics", "/metrics/"):
        for method in ("GET", "HEAD"):
            app.add_api_route(path, metrics, methods=[method], include_in_schema=path == "/metrics",
                              operation_id=f"metrics_{method.lower()}{'_slash' if path.endswith('/') else ''}")

    @app.post("/tokenize", openapi_extra=body_openapi(TokenizeRequest))
    async def tokenize(raw: Request) -> dict:
        req = await parse_body(raw, TokenizeRequest)
        state.check_model(req.model)
        state.need_tokenizer()
        # Tokenizing runs off the event loop: a long text must not stall other requests.
        if req.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            try:
                conversation = template_turns(req.messages)  # as chat renders them
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
            # with messages, as in chat: no special tokens on top of the template's unless asked
            add_special = "add_special_tokens" in req.model_fields_set and req.add_special_tokens
            ids = await off_loop(text_chars(conversation), chat_prompt_ids, state.tokenizer, conversation,
                                 req.add_generation_prompt, state.check_text_length,
                                 state.frontend.template_kwargs(req.chat_template_kwargs),
                                 tools, state.chat_template,
                                 req.continue_final_message, add_special)
        else:
            try:  # the bound completions use: no text that cannot fit the context is tokenized
                state.check_text_length(req.prompt, "prompt")
            except ValueError as e:
                raise APIError(400, str(e), param="prompt") from None
            ids = await off_loop(len(req.prompt), encode, state.tokenizer, req.prompt, "prompt",
                                 req.add_special_tokens)
        body = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
        # vLLM's field: null unless asked for
        body["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return body

    @app.post("/detokenize", openapi_extra=body_openapi(DetokenizeRequest))
    async def detokenize(raw: Request) -> dict:
        req = await parse_body(raw, DetokenizeRequest)
        state.check_model(req.model)
        state.need_tokenizer()
        vocab = len(state.tokenizer)
        # vLLM validates these ids as a prompt: no more than the context. The bound also keeps the
        # tokenizer's decode, which holds the GIL in one piece (5,000,000 ids: 1.7 s), short.
        if len(req.tokens) > state.max_model_len:
            raise APIError(400, f"tokens: {len(req.tokens)} ids, more than the model's context of "
                                f"{state.max_model_len} (--max-model-len)", param="tokens")
        if req.tokens and (min(req.tokens) < 0 or max(req.tokens) >= vocab):  # at C speed
            bad = next(t for t in req.tokens if not 0 <= t < vocab)
            raise APIError(400, f"tokens: token id {bad} is outside [0, {vocab})", param="tokens")
        return {"prompt": await off_loop(len(req.tokens) * 4, state.decode, req.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        state.need_tokenizer()
        tok = state.tokenizer
        return {"tokenizer_class": type(tok).__name__,
                "bos_token": _str_or_none(tok.bos_token), "bos_token_id": tok.bos_token_id,
                "eos_token": _str_or_none(tok.eos_token), "eos_token_id": tok.eos_token_id,
                "pad_token": _str_or_none(tok.pad_token), "unk_token": _str_or_none(tok.unk_token),
                "chat_template": state.chat_template or getattr(tok, "chat_template", None),
                "model_max_length": state.max_model_len, "vocab_size": len(tok)}

    vllm_compat.install(app, engine, args)
    add_body_schemas(app, [CompletionRequest, ChatCompletionRequest, ResponsesRequest, TokenizeRequest,
                           DetokenizeRequest])
    return app


def _str_or_none(token) -> str | None:
    return None if token is None else str(token)
