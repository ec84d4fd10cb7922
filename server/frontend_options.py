"""vLLM's front-end flags that change what responses carry and what the server reports:
--enable-prompt-tokens-details, --enable-force-include-usage, --return-tokens-as-token-ids,
--enable-request-id-headers, --max-log-len, --enable-server-load-tracking, --response-role,
--default-chat-template-kwargs and the access log's --disable-uvicorn-access-log and
--disable-access-log-for-endpoints.

`add_frontend_flags` puts them on the `serve` parser; `FrontendOptions.from_args` is what the app
reads (build_app) and checks the values (a ValueError naming the flag). The X-Request-Id header
and the load count are middleware, installed with vLLM's other extras (server/vllm_compat.py).
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


def add_frontend_flags(p: argparse.ArgumentParser) -> None:
    """The flags' group on the `serve` parser."""
    g = p.add_argument_group("responses and request logs (vLLM's front-end flags)")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage (whole responses and the streamed usage chunk) carries "
                        "prompt_tokens_details: {\"cached_tokens\": N}, N being the prompt tokens "
                        "found in the prefix cache")
    g.add_argument("--enable-force-include-usage", action="store_true",
                   help="every stream carries usage as if the client had sent stream_options "
                        "{\"include_usage\": true, \"continuous_usage_stats\": true}: the usage so "
                        "far in each chunk and a usage chunk at the end (as in vLLM)")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name each token \"token_id:ID\" (completions' tokens and "
                        "top_logprobs keys, chat's token fields), so that tokens that are not "
                        "valid text on their own stay identifiable; a request's "
                        "return_tokens_as_token_ids overrides it")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="every response but an internal error (500) carries an X-Request-Id "
                        "header: the request's own X-Request-Id header, else a random id")
    g.add_argument("--max-log-len", type=int, default=None, metavar="N",
                   help="with --enable-log-requests, the request log (its debug line) shows at "
                        "most N characters of each prompt and N of its token ids; unset: all")
    g.add_argument("--enable-log-outputs", action="store_true",
                   help="with --enable-log-requests, each finished choice's output at info level: "
                        "its text and token ids (each cut to --max-log-len) and finish reason, as vLLM")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line in the log (vLLM's, every VLLM_LOG_STATS_INTERVAL "
                        "seconds, default 10: prompt and generation throughput, running and waiting "
                        "requests, KV cache usage, prefix cache hit rate, speculative acceptance); "
                        "/metrics keeps every figure")
    g.add_argument("--enable-server-load-tracking", action="store_true",
                   help="count the completions, chat, responses and /invocations requests in flight "
                        "(until their response is sent) and report the count at GET /load as "
                        "{\"server_load\": N}; without it /load answers 0")


    g.add_argument("--response-role", default="assistant", metavar="ROLE",
                   help="the role of chat responses to requests with add_generation_prompt true "
                        "(the default); otherwise the role of the request's last message, as in vLLM")
    g.add_argument("--default-chat-template-kwargs", type=json_arg(dict, '{"thinking": true}'), default=None, metavar="JSON",
                   help="chat template variables every chat request (and /tokenize with messages) "
                        "gets, e.g. '{\"thinking\": true}' to make DeepSeek-V3.1 think by default "
                        "(with --reasoning-parser deepseek_v3); a request's chat_template_kwargs "
                        "win key by key")

    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no HTTP access log (this server writes one only at --log-level debug)")
    g.add_argument("--disable-access-log-for-endpoints", default=None, metavar="PATHS",
                   help="comma-separated paths, e.g. /health,/metrics, whose requests the access "
                        "log leaves out (health checks and scrapes)")
    g.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="accepted: GET /tokenizer_info (lm_eval's remote tokenizer) is always served")


class _AccessPathFilter(logging.Filter):
    """Drops uvicorn access-log records of the given paths (the query string aside)."""

    def __init__(self, paths: frozenset[str]) -> None:
        super().__init__()
        self.paths = paths

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's access record: args = (client, method, path with query, HTTP version, status)
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].partition("?")[0] not in self.paths
        return True


def filter_access_log(paths: str | None, root_path: str = "") -> None:
    """--disable-access-log-for-endpoints on uvicorn's access logger (replacing an earlier one).
    uvicorn logs the path with --root-path in front: each path is dropped with and without it."""
    log = logging.getLogger("uvicorn.access")
    for f in [f for f in log.filters if isinstance(f, _AccessPathFilter)]:
        log.removeFilter(f)
    wanted = {p.strip() for p in (paths or "").split(",") if p.strip()}
    if root_path:  # as given ("/llm/" logs "/llm//health") and without its trailing slash
        wanted |= {root + p for p in wanted for root in (root_path, root_path.rstrip("/"))}
    if wanted:
        log.addFilter(_AccessPathFilter(frozenset(wanted)))


def json_arg(kind: type, example: str):
    """An argparse `type` for a flag whose value is JSON of `kind` (list, dict); the error
    names the kind needed, with `example`."""
    name = {list: "a JSON list", dict: "a JSON object"}[kind]

    def parse(value: str):
        try:
            v = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
        if not isinstance(v, kind):
            raise argparse.ArgumentTypeError(f"{name} is needed, e.g. '{example}'")
        return v
    return parse


JSON_LIST = json_arg(list, '["GET", "POST"]')


def reserved_template_kwargs(tokenizer=None) -> set[str]:
    """What chat template variables may not set: apply_chat_template's own parameters
    (`tokenize`, `chat_template`, `add_generation_prompt`, ...) and the variables it hands the
    template itself (`messages`, `tools`, `documents`, the special tokens such as `bos_token`).
    Without a tokenizer: those of transformers' tokenizer base class."""
    if tokenizer is None:
        from transformers import PreTrainedTokenizerBase
        method = PreTrainedTokenizerBase.apply_chat_template
        special = getattr(PreTrainedTokenizerBase, "SPECIAL_TOKENS_ATTRIBUTES", [])
    else:
        method = tokenizer.apply_chat_template
        special = getattr(tokenizer, "special_tokens_map", {})
    own = set(inspect.signature(method).parameters) - {"self", "kwargs"}
    return own | {"messages", "tools", "documents"} | set(special)


@dataclass(frozen=True)
class StreamUsage:
    """Which usage a stream carries: a usage chunk before [DONE], and usage in every chunk."""

    include_usage: bool
    continuous_usage: bool


@dataclass(frozen=True)
class FrontendOptions:
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details
    force_include_usage: bool = False  # --enable-force-include-usage
    tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids: the requests' default
    request_id_headers: bool = False  # --enable-request-id-headers
    server_load_tracking: bool = False  # --enable-server-load-tracking
    log_requests: bool = False  # --enable-log-requests, and not --disable-log-requests
    log_outputs: bool = False  # --enable-log-outputs (with log_requests only, as vLLM)
    max_log_len: int | None = None  # --max-log-len; None: whole prompts
    response_role: str = "assistant"  # --response-role
    default_template_kwargs: dict | None = None  # --default-chat-template-kwargs

    def __post_init__(self) -> None:
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"--max-log-len must be >= 0 (characters and token ids of a prompt "
                             f"to log), got {self.max_log_len}")
        if not self.response_role:
            raise ValueError("--response-role must not be empty")
        self.check_template_defaults()

    def check_template_defaults(self, tokenizer=None) -> None:
        """ValueError naming --default-chat-template-kwargs for a key the chat template call
        itself owns: the served `tokenizer`'s (build_app checks again with it), or without one
        transformers' base class's. Nothing is imported without defaults."""
        if not self.default_template_kwargs:
            return
        reserved = sorted(set(self.default_template_kwargs) & reserved_template_kwargs(tokenizer))
        if reserved:
            raise ValueError(f"--default-chat-template-kwargs: {', '.join(reserved)} cannot be set "
                             "(a parameter of the chat template call itself)")

    @classmethod
    def from_args(cls, args) -> FrontendOptions:
        """Options from a parsed `serve` namespace (or any object; a missing flag is off)."""
        def flag(name: str):
            return getattr(args, name, None)
        return cls(prompt_tokens_details=bool(flag("enable_prompt_tokens_details")),
                   force_include_usage=bool(flag("enable_force_include_usage")),
                   tokens_as_token_ids=bool(flag("return_tokens_as_token_ids")),
                   request_id_headers=bool(flag("enable_request_id_headers")),
                   server_load_tracking=bool(flag("enable_server_load_tracking")),
                   log_requests=bool(flag("enable_log_requests")) and not flag("disable_log_requests"),
                   log_outputs=bool(flag("enable_log_outputs")),
                   max_log_len=flag("max_log_len"),
                   response_role="assistant" if flag("response_role") is None else flag("response_role"),
                   default_template_kwargs=flag("default_chat_template_kwargs"))

    def template_kwargs(self, given: dict | None) -> dict | None:
        """A request's chat_template_kwargs over --default-chat-template-kwargs (its keys win)."""
        if not self.default_template_kwargs:
            return given
        return {**self.default_template_kwargs, **(given or {})}

    def role(self, req) -> str:
        """The role of a chat response: --response-role after a generation prompt, else the role
        of the last message (the output continues it), as vLLM chooses."""
        return self.response_role if req.add_generation_prompt else req.messages[-1].role

    def stream_usage(self, req) -> StreamUsage:
        """vLLM's choice: forced usage is the final chunk and the usage in every chunk; else
        what the request's stream_options ask for."""
        if self.force_include_usage:
            return StreamUsage(True, True)
        return StreamUsage(req.include_usage, req.continuous_usage)

    def as_token_ids(self, req) -> bool:
        """Whether logprobs name tokens "token_id:ID": the request's field when it sets one,
        else --return-tokens-as-token-ids."""
        given = req.return_tokens_as_token_ids
        return self.tokens_as_token_ids if given is None else given

    def note_log_level(self) -> None:
        """Say at start-up where the prompts went when --enable-log-requests cannot show them."""
        if self.log_requests and not logger.isEnabledFor(logging.DEBUG):
            logger.info("--enable-log-requests: each request's prompt is logged at debug level "
                        "only (--log-level debug)")
        if self.log_outputs and not self.log_requests:
            logger.warning("--enable-log-outputs logs nothing without --enable-log-requests (as in vLLM)")

    def output_logger(self):
        """`log_output` where --enable-log-outputs (with --enable-log-requests) asks for it, else None."""
        return self.log_output if self.log_outputs and self.log_requests else None

    def log_output(self, out) -> None:
        """A finished prompt's choices at info level: text and token ids cut to --max-log-len."""
        n = self.max_log_len
        for o in out.outputs:
            text, ids = o.text, list(o.token_ids)
            if n is not None:
                text, ids = text[:n], ids[:n]
            logger.info("Generated response %s#%d: output: %r, output_token_ids: %s, finish_reason: %s",
                        out.request_id, o.index, text, ids, o.finish_reason)

    def log_prompts(self, request_ids: list[str], prompts: list) -> None:
        """With --enable-log-requests, each engine request's prompt at debug level (the engine
        logs its id, prompt length and parameters at info, as vLLM splits them), cut to
        --max-log-len: a text prompt's characters, a token-id prompt's ids."""
        if not self.log_requests or not logger.isEnabledFor(logging.DEBUG):
            return
        n = self.max_log_len
        for rid, p in zip(request_ids, prompts):
            text, ids = (p, None) if isinstance(p, str) else (None, list(p))
            if n is not None:
                text = None if text is None else text[:n]
                ids = None if ids is None else ids[:n]
            logger.debug("request %s: prompt: %r, prompt_token_ids: %s", rid, text, ids)
