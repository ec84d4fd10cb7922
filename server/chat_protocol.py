"""Chat completions and tokenizer request models (pydantic): messages, tools, tool choice, and
their translation to `SamplingParams`. The shared sampling fields and validators:
server/protocol.py."""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from common.sampling_params import INT64_MAX, SamplingParams, StructuredOutputs
from server.protocol import SamplingFields
from server.request_fields import BaseRequest, Int64, Logprobs, bounded


# Content part types that carry text, and the key that holds it: OpenAI's chat `text` and an
# assistant's `refusal`, and the Responses API's `input_text` / `output_text` (vLLM reads all four).
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


class ChatMessage(BaseRequest):
    role: str
    content: str | list[dict] | None = None
    # earlier turns of a tool conversation, handed to the chat template as they are
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls_shaped(cls, calls: list[dict] | None) -> list[dict] | None:
        """Each earlier call as OpenAI shapes it, {"id", "type": "function", "function": {"name",
        "arguments"}}, which the chat template reads: a named function with its arguments (a
        JSON string; an object is written as one; none or "" is "{}", as vLLM reads it), "type"
        "function" when left out. A call without them failed in the template, with a message
        about the template."""
        shaped = []
        for j, call in enumerate(calls or ()):
            fn = call.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ValueError(f"tool_calls[{j}].function must be an object with a non-empty name")
            args = fn.get("arguments")
            if args is None or args == "":
                args = "{}"
            if isinstance(args, dict):
                args = json.dumps(args, ensure_ascii=False)
            if not isinstance(args, str):
                raise ValueError(f"tool_calls[{j}].function.arguments must be a JSON string")
            if call.get("type", "function") != "function":
                raise ValueError(f"tool_calls[{j}].type must be \"function\"")
            shaped.append({**call, "type": "function", "function": {**fn, "arguments": args}})
        return None if calls is None else shaped

    def text(self) -> str:
        """The message's text: a list of text parts joined with newlines, as vLLM joins them for a
        chat template that takes string content; content parts other than text are refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            kind = part.get("type")
            key = TEXT_PARTS.get(kind)
            if key is None:
                raise ValueError(f"messages: only text content parts are supported "
                                 f"({', '.join(TEXT_PARTS)}), got {str(kind)[:40]!r}")
            if not isinstance(part.get(key), str):
                raise ValueError(f"messages: a {kind!r} content part needs a string {key!r}")
            texts.append(part[key])
        return "\n".join(texts)


def template_turns(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template reads them. An assistant turn of tool calls without
    content keeps `content: None`: DeepSeek's templates render the calls under `content is none`
    (server/chat.py renders with the Nones kept). An empty `tool_calls` list is left out, as vLLM
    leaves it out, so that the turn renders as plain text."""
    turns = []
    for m in messages:
        turn: dict = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            turn["tool_calls"] = m.tool_calls
            if m.content is None:
                turn["content"] = None
        for key in ("tool_call_id", "name"):
            if getattr(m, key) is not None:
                turn[key] = getattr(m, key)
        turns.append(turn)
    return turns


class FunctionDefinition(BaseRequest):
    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; None: any object
    strict: bool | None = None


class Tool(BaseRequest):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseRequest):
    name: str


class NamedToolChoice(BaseRequest):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    endpoint: ClassVar[str] = "chat"
    messages: list[ChatMessage] = Field(..., min_length=1)
    tools: list[Tool] | None = None
    # None: "auto" when tools are given, else "none" (OpenAI's default)
    tool_choice: Any = None  # "none" | "auto" | "required" | NamedToolChoice, see below
    parallel_tool_calls: bool = True  # false: "required" makes exactly one call
    max_tokens: bounded(1, INT64_MAX) | None = None
    max_completion_tokens: bounded(1, INT64_MAX) | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    # vLLM's: the response's `prompt_logprobs`, the top-k of every token of the rendered prompt
    # (whole responses only, as in vLLM)
    prompt_logprobs: Logprobs | None = None
    add_generation_prompt: bool = True
    # vLLM's: the last message stays open (no end-of-turn) and the output continues it; needs
    # add_generation_prompt false
    continue_final_message: bool = False
    # vLLM's: special tokens added on top of the rendered template (its own BOS is in the text)
    add_special_tokens: bool = False
    # extra variables of the chat template (e.g. {"thinking": true} for DeepSeek-V3.1)
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's field; handed to the chat template as `reasoning_effort` (DeepSeek's templates
    # do not read it: their thinking is on or off, see chat_template_kwargs)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # vLLM's: false leaves the reasoning out of the response (with --reasoning-parser the
    # message and the deltas carry only the content); the model still reasons
    include_reasoning: bool = True
    # vLLM's: each choice carries its `token_ids` and the response the prompt's
    # `prompt_token_ids` (in a stream: the new ids in every chunk, the prompt's in the role chunk)
    return_token_ids: bool = False
    # vLLM's: when the response's role is the last message's (add_generation_prompt false), that
    # message's content goes before the generated content
    echo: bool = False

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs is only allowed when logprobs is true")
        return self

    @model_validator(mode="after")
    def _prompt_logprobs_whole_only(self):
        if self.prompt_logprobs and self.stream:  # 0 passes, as in vLLM (and is not computed)
            raise ValueError("prompt_logprobs: not available when stream is true (as in vLLM); "
                             "ask without streaming")
        return self

    @model_validator(mode="after")
    def _continue_or_generation_prompt(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: cannot be true together with "
                             "add_generation_prompt (set add_generation_prompt to false)")
        return self

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_value(cls, v):
        if v is None or v in ("none", "auto", "required"):
            return v
        if isinstance(v, dict):
            return NamedToolChoice.model_validate(v)
        raise ValueError('must be "none", "auto", "required" or {"type": "function", '
                         f'"function": {{"name": ...}}}}, got {v!r}')

    @model_validator(mode="after")
    def _tool_choice_needs_its_tool(self):
        choice, names = self.tool_choice, [t.function.name for t in self.tools or []]
        if self.tool_choice is None:
            self.tool_choice = "auto" if names else "none"
        elif choice in ("auto", "required") and not names:
            raise ValueError(f"tool_choice: {choice!r} needs a non-empty tools list")
        elif isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: function {choice.function.name!r} is not in tools "
                             f"({', '.join(names) or 'none given'})")
        return self

    @property
    def forced_tool_choice(self) -> str | dict | None:
        """"required" or the named choice (as a dict) when the output must be a tool call."""
        if self.tool_choice == "required":
            return "required"
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return None

    def tool_dicts(self) -> list[dict] | None:
        """The tools as the chat template sees them (None: no tools)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @property
    def asks_for_structure(self) -> bool:
        return super().asks_for_structure or self.forced_tool_choice is not None

    @property
    def constraint_chars(self) -> int:
        forced = self.forced_tool_choice is not None and self.tools
        return super().constraint_chars + (len(str(self.tools)) if forced else 0)

    def structured(self) -> StructuredOutputs | None:
        """As for completions, plus the JSON constraint of a forced tool choice."""
        own = super().structured()
        choice = self.forced_tool_choice
        if choice is None:
            return own
        if own is not None:
            raise ValueError("tool_choice: a forced tool call constrains the output; no other "
                             "output constraint may be set")
        from server.tool_calls import forced_schema
        schema = forced_schema(self.tool_dicts(), choice)
        if choice == "required" and not self.parallel_tool_calls:
            schema["maxItems"] = 1
        out = StructuredOutputs("json", json.dumps(schema), source="tools")
        from engine.structured_outputs import validate
        validate(out, "tools")
        return out

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens or self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs, None if self.stream else self.prompt_logprobs)

    def conversation(self) -> list[dict]:
        return template_turns(self.messages)

    def template_kwargs(self) -> dict[str, Any]:
        """The variables passed to the chat template besides the conversation."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return kwargs


class TokenizeRequest(BaseRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompt: default true; messages: default false, as in chat
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # with messages, as in chat
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # with messages, as in chat completions
    tools: list[Tool] | None = None  # with messages: rendered by the template, as in chat

    @model_validator(mode="after")
    def _exactly_one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        if self.continue_final_message and self.add_generation_prompt and self.messages is not None:
            raise ValueError("continue_final_message: cannot be true together with "
                             "add_generation_prompt (set add_generation_prompt to false)")
        return self


class DetokenizeRequest(BaseRequest):
    model: str | None = None
    tokens: list[Int64]
