"""`POST /v1/responses` request models (pydantic): OpenAI's Responses fields, checked, and their
translation into the chat completions request the route runs (`ResponsesRequest.to_chat`).

The translation: `instructions` become a system message first; `input` (a string: one user
message; or a list of items) becomes chat messages: `message` items keep their role
(`developer` becomes `system`, which DeepSeek's templates know) and their text parts,
`function_call` items become `tool_calls` of an assistant turn (consecutive calls, and calls
right after an assistant message, share one turn, as the model wrote them), `function_call_output`
items `tool` turns, and `reasoning` items are dropped (DeepSeek's templates drop earlier turns'
reasoning too; vLLM skips a previous response's reasoning likewise); `tools` take chat's nested
function form; `text.format` becomes the output constraint; `reasoning.effort` chat's
`reasoning_effort`; `max_output_tokens` chat's `max_tokens`; `include:
["message.output_text.logprobs"]` or `top_logprobs` > 0 chat's logprobs. vLLM's sampling extras
(`PASSED_THROUGH`) go to the chat request as they are. Chat's own checks then run on the result,
and their errors name the Responses field (`renamed_errors`).
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator

from common.sampling_params import INT64_MAX, StructuredOutputs
from server.chat_protocol import ChatCompletionRequest
from server.request_fields import (UNSUPPORTED, BaseRequest, Logprobs, _json_spec, bounded, refuse_unsupported,
                                   text_checked)

# vLLM's extensions the chat route takes, handed to the chat request as they are (its checks
# name them); the chat request's other fields are refused unless at their defaults (`_refused`),
# and any other unknown field is ignored, as OpenAI's SDK extras are elsewhere
PASSED_THROUGH = frozenset({
    "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "stop", "stop_token_ids", "ignore_eos", "min_tokens", "include_stop_str_in_output",
    "skip_special_tokens", "logit_bias", "allowed_token_ids", "bad_words", "request_id",
    "priority", "cache_salt", "return_tokens_as_token_ids", "chat_template_kwargs"})
# `include` values: logprobs are returned; reasoning comes back as text (`content`), which a
# later request may send back (it is dropped from the prompt, see above), so no encrypted form
# is needed
INCLUDE = ("message.output_text.logprobs", "reasoning.encrypted_content")
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text")
# OpenAI's metadata bounds: pairs, characters of a key, of a value
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def shown(value: Any, limit: int = 80) -> str:
    """A value as an error message quotes it: its repr, cut short (a field may be megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class FunctionTool(BaseRequest):
    """A Responses tool: `{"type": "function", "name", "description", "parameters", "strict"}`."""

    type: Literal["function"] = "function"
    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; None: any object
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type", "function") != "function":
            raise ValueError(f"only function tools are supported, got type {shown(data.get('type'))} "
                             "(this server runs no built-in tools such as web_search)")
        return data


class TextFormat(BaseRequest):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced, strict or not

    @model_validator(mode="after")
    def _schema_with_json_schema(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("schema is required when type is json_schema")
        if self.type == "json_schema" and self.name is None:  # OpenAI's, as chat's json_schema.name
            raise ValueError("name is required when type is json_schema")
        if self.type != "json_schema" and self.schema_ is not None:  # else it would go unused
            raise ValueError(f"schema: only with type json_schema (this format is {self.type})")
        return self


class TextConfig(BaseRequest):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    @field_validator("verbosity")
    @classmethod
    def _medium_only(cls, v):
        if v not in (None, "medium"):
            raise ValueError("only \"medium\" (the default): the model's verbosity cannot be set")
        return v


class ReasoningConfig(BaseRequest):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # OpenAI's older name

    @field_validator("summary", "generate_summary")
    @classmethod
    def _no_summaries(cls, v):
        if v not in (None, "auto"):
            raise ValueError("summaries are not produced (the reasoning comes back as "
                             "text); only \"auto\" or null")
        return v


class ResponsesChat(ChatCompletionRequest):
    """The chat request a Responses request runs as; `text.format` is its output constraint,
    named as such in errors (set by `ResponsesRequest.to_chat`)."""

    _text_format: StructuredOutputs | None = PrivateAttr(None)

    @property
    def asks_for_structure(self) -> bool:
        return super().asks_for_structure or self._text_format is not None

    @property
    def constraint_chars(self) -> int:
        own = self._text_format
        return super().constraint_chars + (len(own.spec) if own is not None else 0)

    def structured(self) -> StructuredOutputs | None:
        own = self._text_format
        if own is None:
            return super().structured()
        if self.forced_tool_choice is not None:
            raise ValueError("text.format: a forced tool_choice constrains the output to the "
                             "call; text.format must then be text")
        from engine.structured_outputs import validate
        validate(own, own.source)
        return own


class ResponsesRequest(BaseRequest):
    endpoint: ClassVar[str] = "responses"
    # unknown fields are kept: those of PASSED_THROUGH go to the chat request
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: bounded(1, INT64_MAX) | None = None
    temperature: float | None = None  # bounds: the chat request's
    top_p: float | None = None
    top_logprobs: Logprobs | None = None
    include: list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None  # OpenAI's include_obfuscation: no padding is sent
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Any = "auto"  # "none" | "auto" | "required" | {"type": "function", "name"}
    parallel_tool_calls: bool = True
    max_tool_calls: bounded(1, INT64_MAX) | None = None  # built-in tools' bound: none run here
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool = True
    previous_response_id: str | None = Field(None, min_length=1, max_length=512)
    prompt_cache_key: str | None = None  # a routing hint; the prefix cache works on its own
    safety_identifier: str | None = None
    background: bool = False  # run as a task, polled with GET (server/responses.py)
    # refused unless at their defaults (UNSUPPORTED["responses"]), echoed in the response
    truncation: Literal["auto", "disabled"] = "disabled"
    service_tier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        refuse_unsupported(data, cls.endpoint)
        if isinstance(data, dict):  # chat's and vLLM's fields this route would otherwise drop
            for name, (asks, why) in _refused().items():
                if name in data and asks(data[name]):
                    raise ValueError(f"{name}: {why}")
        return data

    @field_validator("input")
    @classmethod
    def _input_not_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("must be a string or a non-empty list of items")
        return v

    @field_validator("include")
    @classmethod
    def _include_known(cls, v):
        for value in v or ():
            if value not in INCLUDE:
                raise ValueError(f"{shown(value)} is not supported (supported: {', '.join(INCLUDE)})")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, v):
        if v is not None and len(v) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} key-value pairs, got {len(v)}")
        for key, value in (v or {}).items():
            if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                raise ValueError(f"keys of at most {MAX_METADATA_KEY} characters and values of "
                                 f"at most {MAX_METADATA_VALUE}; {key[:MAX_METADATA_KEY]!r} is over")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_shape(cls, v):
        if v is None:
            return "auto"
        if v in ("none", "auto", "required"):
            return v
        if (isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("name"), str)
                and set(v) <= {"type", "name"}):
            return v
        raise ValueError('must be "none", "auto", "required" or {"type": "function", "name": ...} '
                         f"(no built-in tools, allowed_tools or custom tools here), got {shown(v)}")

    @property
    def wants_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or ()) or bool(self.top_logprobs)

    @property
    def history_at(self) -> int:
        """Where a previous response's conversation goes in the chat messages: after the system
        message of `instructions`."""
        return 1 if self.instructions else 0

    @property
    def num_items(self) -> int:
        return 1 if isinstance(self.input, str) else len(self.input)

    def to_chat(self) -> ResponsesChat:
        """The chat request this request runs as; ValueError naming an `input` item, or
        pydantic's ValidationError of the chat request (see renamed_errors)."""
        turns = [{"role": "system", "content": self.instructions}] if self.instructions else []
        turns += ([{"role": "user", "content": self.input}] if isinstance(self.input, str)
                  else input_turns(self.input))
        body: dict[str, Any] = {k: v for k, v in (self.model_extra or {}).items() if k in PASSED_THROUGH}
        body.update(messages=turns, stream=self.stream, parallel_tool_calls=self.parallel_tool_calls)
        for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"),
                             ("max_output_tokens", "max_tokens"), ("user", "user")):
            if getattr(self, ours) is not None:
                body[theirs] = getattr(self, ours)
        if self.wants_logprobs:
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        choice = self.tool_choice
        if isinstance(choice, dict):
            body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
        else:  # OpenAI's default "auto" without tools asks for nothing; chat's would be refused
            body["tool_choice"] = "none" if choice == "auto" and not self.tools else choice
        with text_checked():  # this request's text was checked when it was parsed
            chat = ResponsesChat.model_validate(body)
        chat._text_format = self.text_constraint()
        return chat

    def text_constraint(self) -> StructuredOutputs | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputs("json_object", "", source="text.format")
        return StructuredOutputs("json", _json_spec(fmt.schema_, "text.format.schema"),
                                 source="text.format.schema")


def input_turns(items: list[dict]) -> list[dict]:
    """Chat messages of Responses input items; ValueError naming the item's field."""
    turns: list[dict] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in ROLES:  # a list or object is no role
                raise ValueError(f"{where}.role: must be one of {', '.join(ROLES)}, got {shown(role)}")
            turns.append({"role": ROLES[role], "content": _content(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            args = item.get("arguments")
            if not isinstance(args, str):
                raise ValueError(f"{where}.arguments: must be a string (the call's JSON arguments)")
            call = {"id": _name(item, "call_id", where), "type": "function",
                    "function": {"name": _name(item, "name", where), "arguments": args}}
            if turns and turns[-1]["role"] == "assistant":  # the same turn as the model wrote it
                turns[-1].setdefault("tool_calls", []).append(call)
            else:
                turns.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            turns.append({"role": "tool", "tool_call_id": _name(item, "call_id", where),
                          "content": _content(item.get("output"), f"{where}.output")})
        elif kind != "reasoning":
            raise ValueError(f"{where}.type: {shown(kind)} items are not supported (message, "
                             "function_call, function_call_output, reasoning)")
    return turns


def listed_items(given: str | list[dict], rid: str) -> list[dict]:
    """A response's input as `GET /v1/responses/{id}/input_items` lists it: items as OpenAI
    returns them (a string input is one user message; message content as parts; status
    completed), each with its own `id` or one made from the response's id and its place, so that
    the same id names the same item on every call (pagination by `after` / `before`)."""
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": given}]
    prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
    base = rid.removeprefix("resp_")
    items = []
    for i, item in enumerate(given):
        kind = item.get("type", "message")
        it = {"id": item.get("id") or f"{prefix.get(kind, 'item')}_{base}_{i}", **item, "type": kind}
        if kind == "message":
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            content = item.get("content")
            it["content"] = [{"type": part, "text": content}] if isinstance(content, str) else content
        it.setdefault("status", "completed")
        items.append(it)
    return items


def _name(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}.{key}: must be a non-empty string")
    return value


def _content(content: Any, where: str) -> str | list[dict]:
    """A message's content as chat takes it: a string, or its text parts (chat joins them with
    newlines, as for chat's own parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: must be a string or a list of text parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("refusal") if kind == "refusal" else part.get("text") if kind else None
        if kind not in (*TEXT_PARTS, "refusal"):
            raise ValueError(f"{where}.{j}.type: only text parts ({', '.join(TEXT_PARTS)}) are "
                             f"supported, got {shown(kind)}")
        if not isinstance(text, str):
            raise ValueError(f"{where}.{j}: a {kind} part needs its text as a string")
        parts.append({"type": "text", "text": text})
    return parts


@functools.cache
def _refused() -> dict[str, tuple]:
    """Fields a request may carry that this route neither takes nor passes on, and which ask
    for something (not null, not chat's default): name -> (does this value ask?, why). The chat
    request's own fields (`guided_json`, `use_beam_search`, `prompt_logprobs`, `echo`, ...) and
    vLLM's Responses extensions that change the conversation or the response."""
    out: dict[str, tuple] = {
        "previous_input_messages": (bool, "not supported: send the earlier turns as input items, "
                                    "or continue a stored response with previous_response_id"),
        "enable_response_messages": (bool, "not supported: the response has no input_messages "
                                     "or output_messages"),
    }
    own = {f.alias or n for n, f in ResponsesRequest.model_fields.items()}
    for name, f in ChatCompletionRequest.model_fields.items():
        name = f.alias or name
        if name in own or name in PASSED_THROUGH or name in UNSUPPORTED["responses"]:
            continue
        default = f.get_default(call_default_factory=True)
        why = ("a chat completions field; output constraints here are text.format's"
               if name.startswith("guided_") or name == "structured_outputs"
               else "a chat completions field that /v1/responses does not take")
        out[name] = (lambda v, d=default: v is not None and v != d, why)
    return out


# chat fields -> the Responses field a client sent them as
_FIELDS = {"messages": ("input",), "max_tokens": ("max_output_tokens",),
           "reasoning_effort": ("reasoning", "effort"), "logprobs": ("top_logprobs",)}


def renamed_errors(errors: list[dict]) -> list[dict]:
    """pydantic errors of the chat request with the locations of the Responses fields they came
    from: `messages.*` -> `input` (item numbers differ), `tools.N.function.X` -> `tools.N.X`."""
    out = []
    for err in errors:
        loc = tuple(err.get("loc", ()))
        if loc and loc[0] in _FIELDS:
            loc = _FIELDS[loc[0]]
        elif loc[:1] == ("tools",) and loc[2:3] == ("function",):
            loc = loc[:2] + loc[3:]
        out.append({**err, "loc": loc})
    return out

