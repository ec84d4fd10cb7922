"""The request models' building blocks (pydantic): bounded integers, the text check, the fields
this server refuses (`UNSUPPORTED`), null-as-unset, the base model, stream options and the
structured-output request objects. server/protocol.py builds the sampling fields and the
completions request from them, server/chat_protocol.py the chat and tokenizer requests.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from common.sampling_params import INT64_MAX, INT64_MIN, MAX_LOGPROBS

MAX_N = 128  # OpenAI's cap on choices per prompt
MAX_REQUEST_ID_CHARS = 256  # a client's request id (field or X-Request-Id header), echoed in ids
MAX_CACHE_SALT_CHARS = 1024  # a request's cache_salt (vLLM advises 43 characters: 256 bits in base64)
# logit_bias entries per request: each one is host work in every step of the request
MAX_LOGIT_BIAS_TOKENS = 1024
# allowed_token_ids entries per request: their mask is built on the host for every row, every
# step (a request's n and prompts multiply it), as logit_bias's entries are
MAX_ALLOWED_TOKEN_IDS = 1024
# stop_token_ids entries per request: each sampled token is looked up in them, and while
# min_tokens holds they are masked out of the row on the host every step
MAX_STOP_TOKEN_IDS = 1024
# bad_words per request, and characters per word: each is matched against every output each step
MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 128, 64
# guided_choice / structured_outputs.choice: compiled as one regex alternation, bounded in count
# and in characters. Against a 100k-token vocabulary (each off the loops): 10,000 short choices
# took 0.06 s to validate and 0.05 s to compile; 1,000,000 characters of punctuation (escaped,
# 6x as long in the regex) 0.47 s and 0.35 s, holding the GIL for at most 26 ms at a time
MAX_CHOICES, MAX_CHOICE_CHARS = 10_000, 1_000_000


def bounded(lo: int, hi: int, why: str = ""):
    """An int field limited to [lo, hi]; the 400 names the whole range (Python ints are
    unbounded, torch's are int64), and `why` it is the range where a flag sets it. JSON's true
    and false are not integers here (pydantic would read them as 1 and 0), as in prompts of token
    ids. A whole number written as a float (1e20) outside the range gets the same message
    (pydantic's would speak of parsing a string)."""
    span = f"[{lo}, {hi}]" + (f" ({why})" if why else "")

    def not_bool(v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError(f"must be an integer in {span}, not a boolean")
        if isinstance(v, float) and not lo <= v <= hi:
            raise ValueError(f"must be an integer in {span}")
        return v

    def check(v: int) -> int:
        if not lo <= v <= hi:
            raise ValueError(f"must be an integer in {span}")
        return v
    return Annotated[int, BeforeValidator(not_bool), AfterValidator(check)]


Int64 = bounded(INT64_MIN, INT64_MAX)
NonNegInt64 = bounded(0, INT64_MAX)
# alternatives per token (logprobs, top_logprobs, prompt_logprobs): the engine's cap, which
# --max-logprobs may lower (server/limits.py names the flag then)
Logprobs = bounded(0, MAX_LOGPROBS, "the most --max-logprobs allows")


_CONTAINERS = (str, dict, list)
_SCALARS = {int, float, bool, type(None)}


def check_text(value: Any, path: str) -> None:
    """Refuse strings that are not valid Unicode text (a lone surrogate such as "\ud800" parses
    from JSON but cannot be encoded, tokenized or echoed): ValueError naming the field.

    Numbers and other scalars are skipped without building their path: a prompt of token ids
    is a list of thousands of ints."""
    if isinstance(value, str):
        _check_str(value, path or "request", "")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_str(k, path or "request", "a key is ")
            if isinstance(v, _CONTAINERS):
                check_text(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        if set(map(type, value)) <= _SCALARS:
            return  # token ids: one pass at C speed
        for i, v in enumerate(value):
            if isinstance(v, _CONTAINERS):
                check_text(v, f"{path}.{i}" if path else str(i))


def _check_str(value: str, path: str, what: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{path}: {what}not valid Unicode text (unpaired surrogate "
                         f"{value[e.start]!r} at character {e.start})") from None


def _set(v: Any) -> bool:
    return v is not None


# Recognised fields this server cannot honour: field -> (does this value ask for it?, why), per
# route. A request that sets one is a 400 naming the field; removing a line enables the field
# (it must then be declared on the request model).
UNSUPPORTED: dict[str, dict[str, tuple]] = {
    "completions": {
        "suffix": (bool, "fill-in-the-middle (a non-empty suffix) is not supported"),
    },
    "chat": {
        "functions": (bool, "function calls are not supported"),
        "function_call": (lambda v: v is not None and v != "none", "function calls are not "
                          "supported; only \"none\""),
        "documents": (bool, "documents (retrieval-augmented templates) are not supported"),
        "chat_template": (_set, "a per-request chat template is not supported; start the server "
                          "with --chat-template"),
    },
    "responses": {
        "truncation": (lambda v: v == "auto", "\"auto\" (dropping the oldest input items to fit "
                       "the context) is not supported; only \"disabled\""),
        "service_tier": (lambda v: v not in (None, "auto", "default"), "only \"auto\" or "
                         "\"default\": one tier serves every request"),
        "prompt": (_set, "reusable prompt templates are not supported; send input and instructions"),
        "conversation": (_set, "conversations are not supported; use previous_response_id"),
        # chat's names, which a request moved over from chat may still carry
        "messages": (_set, "not a Responses field: send the conversation as input"),
        "max_tokens": (_set, "not a Responses field: use max_output_tokens"),
        "max_completion_tokens": (_set, "not a Responses field: use max_output_tokens"),
        "response_format": (_set, "not a Responses field: use text.format"),
        "reasoning_effort": (_set, "not a Responses field: use reasoning.effort"),
        "logprobs": (_set, "not a Responses field: use include [\"message.output_text.logprobs\"] "
                     "and top_logprobs"),
        "n": (lambda v: v not in (None, 1), "a response has one output; only 1"),
    },
}
# vLLM's extensions both routes refuse (their names, so that a request written for vLLM is told)
_BOTH: dict[str, tuple] = {
    "spaces_between_special_tokens": (lambda v: v is False, "only true (the default) is supported"),
    "logits_processors": (bool, "custom logits processors are not supported"),
    "prompt_embeds": (_set, "prompt embeddings are not supported; send text or token ids"),
    "kv_transfer_params": (_set, "KV transfer (disaggregated prefill) is not supported"),
    "vllm_xargs": (bool, "vllm_xargs (custom logits processors' arguments) is not supported"),
}
for _route in UNSUPPORTED.values():
    _route.update(_BOTH)


def refuse_unsupported(data: Any, route: str) -> None:
    """ValueError naming the first field of `UNSUPPORTED[route]` that `data` asks for."""
    if not isinstance(data, dict):
        return
    for name, (asks, why) in UNSUPPORTED[route].items():
        if name in data and asks(data[name]):
            raise ValueError(f"{name}: {why}")


# Set while a request's text has been checked whole: the models nested in it (a chat body's
# messages, each a model) skip the check instead of walking their own part again.
_TEXT_CHECKED: contextvars.ContextVar[bool] = contextvars.ContextVar("text_checked", default=False)


@contextlib.contextmanager
def text_checked():
    """Validation inside skips the text check: the caller has seen that the request's text is
    valid (server/request_body.py decides it from the raw bytes)."""
    token = _TEXT_CHECKED.set(True)
    try:
        yield
    finally:
        _TEXT_CHECKED.reset(token)


def _text_is_valid(data: Any) -> bool:
    """Whether every string in `data` (parsed JSON) encodes as UTF-8, at C speed; False also
    when it cannot tell (then check_text walks it and names the field)."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except (ValueError, TypeError, RecursionError):  # UnicodeEncodeError is a ValueError
        return False
    return True


class BaseRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="wrap")
    @classmethod
    def _valid_text(cls, data: Any, handler) -> Any:
        """Refuse text that is not valid Unicode (check_text), once per request: the outermost
        model checks everything, the models inside it are validated without a second pass."""
        if _TEXT_CHECKED.get():
            return handler(data)
        if not _text_is_valid(data):
            check_text(data, "")
        token = _TEXT_CHECKED.set(True)
        try:
            return handler(data)
        finally:
            _TEXT_CHECKED.reset(token)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_as_numbers(cls, data: Any) -> Any:
        """JSON's true and false are not numbers (pydantic would read them as 1.0 and 0.0): a
        400 naming the field, as the int fields do (`bounded`)."""
        if isinstance(data, dict):
            for name in _float_fields(cls):
                if isinstance(data.get(name), bool):
                    raise ValueError(f"{name}: must be a number, not a boolean")
        return data

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """An explicit null in a field that takes no null means "not set", as in vLLM (which
        declares them Optional), in nested objects too: the default applies, or
        --generation-config's. Clients built on OpenAI's SDK types (LangChain, LiteLLM) send
        nulls for what they leave out. Fields where null means something keep it
        (`max_tokens`: up to the context; `stream_options.include_usage`: no usage)."""
        if not isinstance(data, dict):
            return data
        if None not in data.values():  # the common case, at C speed
            return data
        fields = _non_nullable(cls)
        if not any(v is None and k in fields for k, v in data.items()):
            return data
        return {k: v for k, v in data.items() if v is not None or k not in fields}


class StreamOptions(BaseRequest):
    # vLLM's default: a stream_options object without include_usage still asks for the usage;
    # an explicit null asks for none (vLLM's field is Optional and tested for truth)
    include_usage: bool | None = True
    # vLLM: with include_usage, every chunk also carries the usage so far
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseRequest):
    """OpenAI's `response_format.json_schema`; the schema is always enforced (strict or not)."""

    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None


class ResponseFormat(BaseRequest):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format.json_schema is required when type is json_schema")
        return self


class StructuredOutputsRequest(BaseRequest):
    """vLLM's `structured_outputs`: one constraint (json, regex, choice, grammar, json_object)
    and the JSON whitespace options."""

    json_: str | dict | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


def _json_spec(value: str | dict, field: str) -> str:
    """A JSON schema as text (key order kept: it is the order the output's keys follow)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{field}: not valid JSON ({e})") from None
        except RecursionError:
            raise ValueError(f"{field}: nested too deeply to parse") from None
    if not isinstance(value, (dict, bool)):
        raise ValueError(f"{field}: a JSON schema must be an object")
    return json.dumps(value)


def _takes_none(annotation: Any) -> bool:
    if annotation is Any or annotation is None or annotation is type(None):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_takes_none(a) for a in typing.get_args(annotation))
    return False


def _is_float(annotation: Any) -> bool:
    if annotation is float:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, typing.Annotated):
        args = typing.get_args(annotation)
        return _is_float(args[0]) if typing.get_origin(annotation) is typing.Annotated else \
            any(_is_float(a) for a in args)
    return False


@functools.cache
def _float_fields(cls: type) -> frozenset:
    """The names (and aliases) of `cls`'s fields that take a float."""
    return frozenset(n for name, f in cls.model_fields.items() if _is_float(f.annotation)
                     for n in (name, f.alias) if n)


@functools.cache
def _non_nullable(cls: type) -> frozenset:
    """The names (and aliases) of `cls`'s fields whose type does not take None."""
    return frozenset(n for name, f in cls.model_fields.items() if not _takes_none(f.annotation)
                     for n in (name, f.alias) if n)


_SPEC_KINDS = ("regex", "choice", "grammar")  # constraints passed on as given (json is checked first)
