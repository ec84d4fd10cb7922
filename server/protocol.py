"""OpenAI request models (pydantic) and their translation to `SamplingParams`: the fields and
validators completions and chat share, and the completions request (chat, tokenize and
detokenize: server/chat_protocol.py).

Unknown fields are ignored, as OpenAI does. Fields that OpenAI or vLLM define but this server
cannot honour are listed in `UNSUPPORTED` (server/request_fields.py) and answer a 400 naming
them, never silently dropped.
Limits live in `Field(...)` so that a bad value is a 400 naming the field and the limit before
anything reaches the engine.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar

from pydantic import Field, field_validator, model_validator

from common.sampling_params import (INT64_MAX, INT64_MIN, MAX_LOGIT_BIAS, MAX_TOP_K,
                                    SamplingParams, StructuredOutputs)
from server.request_fields import (_SPEC_KINDS, MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORD_CHARS, MAX_BAD_WORDS,
                                   MAX_CACHE_SALT_CHARS, MAX_CHOICE_CHARS, MAX_CHOICES,
                                   MAX_LOGIT_BIAS_TOKENS, MAX_N, MAX_REQUEST_ID_CHARS,
                                   MAX_STOP_TOKEN_IDS, BaseRequest, Int64, Logprobs, NonNegInt64,
                                   ResponseFormat, StreamOptions, StructuredOutputsRequest,
                                   _json_spec, bounded, refuse_unsupported)


class SamplingFields(BaseRequest):
    """Fields shared by completions and chat completions (OpenAI names, plus vLLM's extensions)."""

    endpoint: ClassVar[str]  # "completions" | "chat": names the endpoint in refusals

    model: str | None = None
    # vLLM's bounds, wider than OpenAI's [0, 2]: any finite temperature >= 0 and
    # repetition_penalty > 0
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: bounded(-1, MAX_TOP_K) = 0
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: bounded(1, MAX_N) = 1
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt64] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: NonNegInt64 = 0
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # logprobs name tokens "token_id:N" (vLLM); None: as --return-tokens-as-token-ids says
    return_tokens_as_token_ids: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # structured outputs (engine/structured_outputs.py): at most one of these constraints
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # OpenAI: token id (a string key) -> bias in [-100, 100] added to its logit
    logit_bias: dict[str, float] | None = None
    # vLLM's: only these token ids may be sampled (at most MAX_ALLOWED_TOKEN_IDS)
    allowed_token_ids: list[NonNegInt64] | None = Field(None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    # vLLM's: words the output may not contain (tokenized by the handler, server/handler.py)
    bad_words: list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]] | None = Field(
        None, max_length=MAX_BAD_WORDS)
    # vLLM's: keep only the prompt's last k tokens (-1: the last max_model_len)
    truncate_prompt_tokens: bounded(-1, INT64_MAX) | None = None
    # vLLM's: prompt blocks cached by the prefix cache are shared only between requests with the
    # same salt (multi-tenant isolation; vLLM advises a random 256-bit value)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # vLLM's: with --scheduling-policy priority, lower values start first and are preempted last
    priority: Int64 = 0
    # vLLM's beam search (server/beam_search.py): n beams, scored by logprob / length ** penalty
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, allow_inf_nan=False)
    # vLLM's: the response's id (`cmpl-<id>`, `chatcmpl-<id>`; an X-Request-Id header wins)
    request_id: str | None = Field(None, min_length=1, max_length=MAX_REQUEST_ID_CHARS)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias_count(cls, v):
        """The count first: a million entries are refused before each is validated."""
        if isinstance(v, dict) and len(v) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_TOKENS} token ids, got {len(v)}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_ids(cls, v):
        if v is None:
            return None
        bias = {}
        for key, b in v.items():
            if not (key.strip().isascii() and key.strip().isdigit()):  # not "٣": int() reads it
                raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
            if len(key.strip()) > 19:  # past int64 (and past what int() converts, at 4300 digits)
                raise ValueError(f"token id {key.strip()[:19]}... is outside the vocabulary")
            if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                raise ValueError(f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                 f"got {b!r} for token {key}")
            bias[int(key)] = float(b)
        return bias

    @field_validator("bad_words")
    @classmethod
    def _bad_words_not_blank(cls, v):
        if v is not None and any(not w.strip() for w in v):
            raise ValueError("words must hold more than whitespace (a blank word would ban the space)")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate_not_zero(cls, v):
        if v == 0:
            raise ValueError("must be -1 (the context length) or a token count >= 1, got 0")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty")
        return v

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        refuse_unsupported(data, cls.endpoint)
        return data

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _length_penalty_needs_beams(self):
        if self.length_penalty != 1.0 and not self.use_beam_search:
            raise ValueError("length_penalty applies to beam search only (use_beam_search: true); "
                             "without it only 1.0")
        return self

    @model_validator(mode="after")
    def _seeds_of_every_sample_fit(self):
        # sample i of n is seeded with seed + i: the last one must still be an int64
        if self.seed is not None and self.seed + self.n - 1 > INT64_MAX:
            raise ValueError(f"seed must be in [{INT64_MIN}, {INT64_MAX - self.n + 1}] with "
                             f"n = {self.n} (sample i uses seed + i), got {self.seed}")
        return self

    @property
    def asks_for_structure(self) -> bool:
        """True when a constraint field is set (its validation compiles a grammar: seconds for a
        huge schema, so the handlers run it off the event loop)."""
        rf = self.response_format
        return (self.structured_outputs is not None or (rf is not None and rf.type != "text")
                or any(v is not None for v in (self.guided_json, self.guided_regex,
                                               self.guided_choice, self.guided_grammar)))

    @property
    def constraint_chars(self) -> int:
        """Characters of the request's output constraints (what checking them costs, roughly)."""
        values = [self.structured_outputs, self.response_format, self.guided_json, self.guided_regex,
                  self.guided_choice, self.guided_grammar]
        return sum(len(v) if isinstance(v, str) else len(str(v)) for v in values if v is not None)

    def structured(self) -> StructuredOutputs | None:
        """The request's output constraint, validated (llguidance); ValueError naming the field."""
        found: list[tuple[str, str, str]] = []  # (field, kind, spec)
        so = self.structured_outputs
        if so is not None:
            if so.structural_tag is not None:
                raise ValueError("structured_outputs.structural_tag: not supported")
            if so.json_ is not None:
                found.append(("structured_outputs.json", "json",
                              _json_spec(so.json_, "structured_outputs.json")))
            found += [(f"structured_outputs.{kind}", kind, getattr(so, kind)) for kind in _SPEC_KINDS
                      if getattr(so, kind) is not None]
            if so.json_object:
                found.append(("structured_outputs.json_object", "json_object", ""))
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", "json_object", ""))
        elif rf is not None and rf.type == "json_schema":
            where, schema = "response_format.json_schema.schema", rf.json_schema.schema_
            found.append((where, "json_object", "") if schema is None else
                         (where, "json", _json_spec(schema, where)))
        if self.guided_json is not None:
            found.append(("guided_json", "json", _json_spec(self.guided_json, "guided_json")))
        found += [(f"guided_{kind}", kind, getattr(self, f"guided_{kind}")) for kind in _SPEC_KINDS
                  if getattr(self, f"guided_{kind}") is not None]
        if not found:
            return None
        if len(found) > 1:
            raise ValueError(f"{found[0][0]}: only one output constraint per request, got "
                             f"{', '.join(f for f, _, _ in found)}")
        field, kind, spec = found[0]
        if kind == "choice":
            if not spec or any(not c for c in spec):
                raise ValueError(f"{field}: must be a non-empty list of non-empty strings")
            if len(spec) > MAX_CHOICES:  # these two bound the compile's work
                raise ValueError(f"{field}: {len(spec)} choices; at most {MAX_CHOICES}")
            chars = sum(map(len, spec))
            if chars > MAX_CHOICE_CHARS:
                raise ValueError(f"{field}: {chars} characters in all; at most {MAX_CHOICE_CHARS}")
            spec = json.dumps(spec)
        out = StructuredOutputs(
            kind, spec,
            whitespace_pattern=(so and so.whitespace_pattern) or self.guided_whitespace_pattern,
            disable_any_whitespace=bool(so and so.disable_any_whitespace),
            disable_additional_properties=bool(so and so.disable_additional_properties), source=field)
        from engine.structured_outputs import validate
        validate(out, field)
        return out

    def apply_defaults(self, defaults: dict) -> None:
        """Fields this request did not set, or set to null, take the server's defaults
        (--generation-config: temperature, top_p, top_k, min_p, repetition_penalty, max_tokens),
        as in vLLM: a null max_tokens then means the config's, not the whole context."""
        given = self.model_fields_set
        for name, value in defaults.items():
            if name == "max_tokens" and getattr(self, "max_completion_tokens", None) is not None:
                continue
            if name not in given or getattr(self, name) is None:
                setattr(self, name, value)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every streamed chunk (vLLM: only together with include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None, add_special_tokens: bool = True,
                        ) -> SamplingParams:
        """The engine's view of this request; raises ValueError naming a field."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=stop, stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, structured_outputs=self.structured(),
            logit_bias=self.logit_bias or None, allowed_token_ids=self.allowed_token_ids,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            add_special_tokens=add_special_tokens, cache_salt=self.cache_salt,
            priority=self.priority)


Prompt = str | list[int]


class CompletionRequest(SamplingFields):
    endpoint: ClassVar[str] = "completions"
    prompt: Any  # str | list[str] | list[int] | list[list[int]], see _normalize_prompt
    max_tokens: NonNegInt64 | None = 16
    logprobs: Logprobs | None = None
    echo: bool = False
    # vLLM: the top-k logprobs of every prompt token, as `prompt_logprobs` on each choice
    prompt_logprobs: Logprobs | None = None
    best_of: bounded(1, MAX_N) | None = None  # only best_of == n (no ranking of extra samples)
    add_special_tokens: bool = True  # a text prompt's BOS (vLLM's field)
    # vLLM's: each choice also carries its `token_ids` and the prompt's `prompt_token_ids` (in a
    # stream: the new ids in every chunk, the prompt's in the first)
    return_token_ids: bool = False

    @model_validator(mode="after")
    def _best_of_is_n(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of: only best_of == n ({self.n}) is supported (extra samples "
                             f"are not generated and ranked), got {self.best_of}")
        return self

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, v):
        return _normalize_prompt(v)

    @model_validator(mode="after")
    def _zero_tokens_only_with_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be >= 1 (0 is allowed only with echo=true)")
        return self

    def prompts(self) -> list[Prompt]:
        return self.prompt

    def to_sampling_params(self) -> SamplingParams:
        # echo with max_tokens=0 (prompt scoring only): the engine samples one token that the
        # response then drops.
        max_tokens = 1 if self.max_tokens == 0 else self.max_tokens
        # the engine computes one set for both uses: the larger k, each use trims to its own
        wanted = [k for k in (self.prompt_logprobs,
                              self.logprobs if self.echo else None) if k is not None]
        prompt_logprobs = max(wanted) if wanted else None
        return self.sampling_params(max_tokens, self.logprobs, prompt_logprobs,
                                    add_special_tokens=self.add_special_tokens)


def _normalize_prompt(v: Any) -> list[Prompt]:
    """One of: str, list[str], list[int], list[list[int]] -> a non-empty list of prompts."""
    shape = ("prompt must be a string, a list of strings, a list of token ids "
             "or a list of token-id lists")
    if v is None:
        raise ValueError("prompt is required")
    if isinstance(v, str):
        prompts: list[Prompt] = [v]
    elif isinstance(v, list) and v and _all_tokens(v):
        prompts = [list(v)]
    elif isinstance(v, list) and v and all(isinstance(p, str) for p in v):
        prompts = list(v)
    elif (isinstance(v, list) and v and all(isinstance(p, list) for p in v)
          and all(_all_tokens(p) for p in v)):
        prompts = [list(p) for p in v]
    else:
        raise ValueError(shape if v != [] else "prompt must not be empty")
    for p in prompts:
        if len(p) == 0:
            raise ValueError("prompt must not be empty")
        if isinstance(p, list) and not 0 <= min(p) <= max(p) <= INT64_MAX:
            raise ValueError(f"prompt token ids must be in [0, {INT64_MAX}]")
    return prompts


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _all_tokens(p: list) -> bool:
    """Every item an int (not a bool). JSON gives exact ints, so the common case is one pass
    over the item types at C speed; the per-item test runs only when that fails."""
    return set(map(type, p)) <= {int} or all(_is_token(t) for t in p)
