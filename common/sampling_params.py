"""Per-request sampling and stopping parameters, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

# Logprobs beyond this many alternatives per token are refused (OpenAI caps at 5 for completions,
# 20 for chat; lm_eval asks for 1).
MAX_LOGPROBS = 20

# Integers reach torch as int64 (seeds through Generator.manual_seed, top_k as a tensor): every
# integer field is bounded so that no request can carry a value torch refuses mid-step.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TOP_K = 2**31 - 1  # any top_k at or above the vocabulary size keeps every token
# OpenAI's range of a logit_bias value: -100 bans a token, 100 all but forces it.
MAX_LOGIT_BIAS = 100.0
# Temperatures below this sample greedily: dividing logits by ~1e-38 overflows them to inf and
# the softmax to nan. (vLLM instead raises any temperature in (0, 0.01) to 0.01 and samples.)
GREEDY_TEMPERATURE_EPS = 1e-5
# temperature and repetition_penalty are unbounded above (vLLM's rule) but become fp32 columns:
# the smallest magnitude that rounds to inf in fp32 is their limit
FP32_OVERFLOW = 3.4028235677973366e38


# The kinds of structured output a request may ask for (engine/structured_outputs.py).
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the output: `kind` in STRUCTURED_KINDS and its `spec` as text (a JSON
    schema, a regex, a JSON list of choices, a Lark or GBNF grammar; empty for json_object).
    JSON options: `whitespace_pattern` (whitespace allowed between tokens; default none but a
    space after ',' and ':'), `disable_any_whitespace`, `disable_additional_properties`.
    `source` is not part of the constraint: two requests that differ only there share a compile."""

    kind: str
    spec: str = ""
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    # the request field it came from, which its errors name
    source: str = field(default="structured_outputs", compare=False)
    # The constraint starts after this token (a reasoning model's `</think>`, as vLLM starts its
    # grammar where the reasoning ends): the tokens up to and including it are free. None: from
    # the first token. Not part of the constraint: requests differing only here share a compile.
    start_after: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.start_after is not None and (isinstance(self.start_after, bool) or not isinstance(self.start_after, int)
                                             or self.start_after < 0):
            raise ValueError(f"structured_outputs: start_after must be a token id, got {self.start_after!r}")
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured_outputs: unknown kind {self.kind!r} "
                             f"(one of {', '.join(STRUCTURED_KINDS)})")
        if not isinstance(self.spec, str):
            raise ValueError(f"structured_outputs: the {self.kind} spec must be text")


@dataclass
class SamplingParams:
    """What to sample and when to stop; the names and meanings follow the OpenAI API and vLLM."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # alternatives per sampled token (0: only the sampled token)
    prompt_logprobs: int | None = None  # alternatives per prompt token
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None  # None: unconstrained
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    allowed_token_ids: list[int] | None = None  # only these may be sampled (vLLM's); None: any
    # vLLM's bad_words as token sequences (the server tokenizes the words): a sequence's last
    # token may not follow its other tokens (a one-token sequence: never sampled)
    bad_words_token_ids: list[list[int]] | None = None
    # the prompt (vLLM's request fields): keep its last k tokens (-1: the last max_model_len);
    # a text prompt is tokenized with its special tokens (BOS) or without
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    # vLLM's: prefix-cache hits only between requests with the same salt (scheduler/block_manager.py)
    cache_salt: str | None = None
    # vLLM's: with --scheduling-policy priority, lower values are admitted first and preempted last
    priority: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))  # each id once, in order (validated ints)
        if self.temperature < GREEDY_TEMPERATURE_EPS:
            self.temperature = 0.0

    def _validate(self) -> None:
        def bad(name: str, value, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {value!r}")

        def integer(name: str, lo: int, hi: int, optional: bool = False) -> None:
            v = getattr(self, name)
            if optional and v is None:
                return
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                raise bad(name, v, f"must be an integer in [{lo}, {hi}]")

        integer("n", 1, INT64_MAX)
        if not 0 <= self.temperature < FP32_OVERFLOW:
            raise bad("temperature", self.temperature, "must be >= 0 and finite in fp32 (below 3.4e38)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= MAX_TOP_K:
            raise bad("top_k", self.top_k,
                      f"must be an integer in [-1, {MAX_TOP_K}] (0 or -1 disables it)")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        integer("max_tokens", 1, INT64_MAX, optional=True)
        integer("min_tokens", 0, INT64_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, "must be in [0, max_tokens]")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS):
                raise bad(name, v, f"must be an integer in [0, {MAX_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2 <= v <= 2:
                raise bad(name, v, "must be in [-2, 2]")
        if not 0 < self.repetition_penalty < FP32_OVERFLOW:
            raise bad("repetition_penalty", self.repetition_penalty,
                      "must be > 0 and finite in fp32 (below 3.4e38)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "must hold non-empty strings")
        if any(not isinstance(t, int) or not 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids,
                      f"must hold integers in [0, {INT64_MAX}]")
        for t, b in (self.logit_bias or {}).items():
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= INT64_MAX:
                raise bad("logit_bias", t, f"keys must be token ids in [0, {INT64_MAX}]")
            if not isinstance(b, (int, float)) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                raise bad("logit_bias", b, f"values must be in [-{MAX_LOGIT_BIAS:g}, "
                          f"{MAX_LOGIT_BIAS:g}]")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or any(
                    not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= INT64_MAX for t in ids):
                raise bad("allowed_token_ids", ids, f"must be a non-empty list of token ids in [0, {INT64_MAX}]")
        for seq in self.bad_words_token_ids or ():
            if not isinstance(seq, (list, tuple)) or not seq or any(
                    not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= INT64_MAX for t in seq):
                raise bad("bad_words", seq, "must be non-empty token sequences")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise bad("cache_salt", self.cache_salt, "must be a non-empty string")
        integer("priority", INT64_MIN, INT64_MAX)
        integer("seed", INT64_MIN, INT64_MAX, optional=True)
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            integer("truncate_prompt_tokens", 1, INT64_MAX)
        if self.seed is not None and self.seed + self.n - 1 > INT64_MAX:
            # sample i of n is seeded with seed + i (OutputProcessor)
            raise bad("seed", self.seed, f"must be at most {INT64_MAX} - (n - 1) = "
                      f"{INT64_MAX - self.n + 1} with n = {self.n} (sample i uses seed + i)")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def reads_history(self) -> bool:
        """Sampling reads the request's own tokens (penalties, min_tokens, multi-token bad words)."""
        return (self.needs_penalties or self.min_tokens > 0
                or any(len(seq) > 1 for seq in self.bad_words_token_ids or ()))


def check_token_ids(params: SamplingParams, vocab_size: int, eos_token_id: int | None = None) -> None:
    """ValueError naming the field when a token id the sampler indexes the logits by is outside
    [0, vocab_size), or when the params leave some step nothing to sample: every id of
    allowed_token_ids banned by a one-token bad word, or by the stop ids (EOS too, unless
    ignore_eos) that min_tokens masks. The engine core runs it on every request (cfg.vocab_size);
    the InputProcessor runs it first with the ids the tokenizer can decode, for the HTTP paths."""
    fields = (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {}),
              ("allowed_token_ids", params.allowed_token_ids or ()),
              ("bad_words", [t for seq in params.bad_words_token_ids or () for t in seq]))
    for name, ids in fields:
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab_size})")
    if nothing_to_sample(params, [], eos_token_id):
        raise ValueError(f"allowed_token_ids: every listed token is also banned (by a one-token bad word, "
                         f"or as a stop/EOS token while below min_tokens {params.min_tokens}), so nothing "
                         "could be sampled")


def bad_word_bans(sequences: list[list[int]], output: list[int]) -> list[int]:
    """The tokens a row may not sample next: each bad word's last token where the output ends
    with the word's other tokens (a one-token word: always)."""
    bans = []
    for seq in sequences:
        k = len(seq) - 1
        if k == 0 or (len(output) >= k and output[-k:] == seq[:-1]):
            bans.append(seq[-1])
    return bans


def banned_next(params: SamplingParams, output: list[int], eos_token_id: int | None) -> set[int]:
    """The tokens the sampler's masks forbid after `output`: bad words' last tokens where the output
    ends with the rest, and stop / EOS tokens while below min_tokens."""
    banned = set(bad_word_bans(params.bad_words_token_ids or (), output))
    if len(output) < params.min_tokens:
        banned.update(params.stop_token_ids)
        if eos_token_id is not None and not params.ignore_eos:
            banned.add(eos_token_id)
    return banned


def nothing_to_sample(params: SamplingParams, output: list[int], eos_token_id: int | None) -> bool:
    """Whether, after `output`, the sampler's masks leave no token of allowed_token_ids: all
    `banned_next` (the sampler would then pick from a row of -inf, a token outside the list)."""
    if params.allowed_token_ids is None:
        return False
    return banned_next(params, output, eos_token_id).issuperset(params.allowed_token_ids)
