"""Tokenize and validate prompts before they reach the engine core (errors name the field)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

from common.sampling_params import SamplingParams, check_token_ids
from models.config import ModelConfig

log = logging.getLogger(__name__)


# Files AutoTokenizer can build a tokenizer from; a directory with none of them has no tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json",
                    "vocab.txt", "spiece.model", "tiktoken.model")
# A prompt longer than (longest token in characters) x max_model_len x this margin certainly has
# more than max_model_len tokens; the margin covers normalizers that shrink text (NFC
# composition) before splitting.
_CHARS_PER_TOKEN_MARGIN = 4


def load_tokenizer(path: str, required: bool = True):
    from transformers import AutoTokenizer
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f))
                                       for f in _TOKENIZER_FILES):
        msg = f"no tokenizer files in {path} (use --tokenizer or token-id prompts)"
        if required:
            raise ValueError(msg)
        log.warning("%s: only token-id prompts will be accepted", msg)
        return None
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any failure means "no usable tokenizer here"
        if required:
            raise ValueError(f"--tokenizer: cannot load a tokenizer from {path}: {e}") from None
        log.warning("no tokenizer in %s (%s): only token-id prompts will be accepted", path,
                    type(e).__name__)
        return None


class ContextLengthError(ValueError):
    """A prompt (with its max_tokens) longer than the context: OpenAI's wording, which clients
    match on ("maximum context length"), its code, and the field to blame. `max_tokens` None:
    the prompt alone leaves no room. `renamed` words it for another endpoint's fields (chat:
    `messages`, `max_completion_tokens`)."""

    code = "context_length_exceeded"

    def __init__(self, max_model_len: int, prompt_tokens: int, max_tokens: int | None = None,
                 prompt_field: str = "prompt", max_tokens_field: str = "max_tokens") -> None:
        self.max_model_len, self.prompt_tokens, self.max_tokens = max_model_len, prompt_tokens, max_tokens
        self.fields = (prompt_field, max_tokens_field)
        self.param = prompt_field if max_tokens is None else max_tokens_field
        head = f"This model's maximum context length is {max_model_len} tokens (max_model_len). "
        if max_tokens is None:
            verb = "have" if prompt_field.endswith("s") else "has"  # "messages" is plural
            text = (f"However, your {prompt_field} {verb} {prompt_tokens} tokens, which leaves no room for "
                    f"output. Please reduce the length of the {prompt_field}.")
        else:
            text = (f"However, you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
                    f"{prompt_field}, {max_tokens} in the completion: {max_tokens_field}). Please reduce "
                    f"the length of the {prompt_field} or {max_tokens_field}.")
        super().__init__(head + text)

    def renamed(self, prompt_field: str, max_tokens_field: str) -> ContextLengthError:
        return ContextLengthError(self.max_model_len, self.prompt_tokens, self.max_tokens,
                                  prompt_field, max_tokens_field)


class CacheCapacityError(ValueError):
    """A max_tokens past what a KV cache smaller than the context leaves after the prompt (the
    cache holds every token but the last); `renamed` as ContextLengthError's."""

    def __init__(self, capacity: int, prompt_tokens: int, max_tokens: int, max_tokens_field: str = "max_tokens"):
        self.capacity, self.prompt_tokens, self.max_tokens, self.param = (capacity, prompt_tokens, max_tokens,
                                                                           max_tokens_field)
        super().__init__(f"{max_tokens_field}: {max_tokens} after a prompt of {prompt_tokens} tokens is more than "
                         f"the KV cache holds ({capacity} tokens, and the last one); at most "
                         f"{capacity + 1 - prompt_tokens}")

    def renamed(self, prompt_field: str, max_tokens_field: str) -> CacheCapacityError:
        return CacheCapacityError(self.capacity, self.prompt_tokens, self.max_tokens, max_tokens_field)


class InputProcessor:
    def __init__(self, tokenizer, cfg: ModelConfig, max_model_len: int, capacity_tokens: int = 0):
        self.tokenizer, self.cfg, self.max_model_len = tokenizer, cfg, max_model_len
        self.capacity_tokens = capacity_tokens  # KV cache capacity; 0: unknown, unchecked
        # Token ids a prompt may hold: those the model embeds AND the tokenizer can decode (the
        # config's vocab may be padded past the tokenizer's), so that completions accept exactly
        # the ids /detokenize does.
        self.vocab_size = cfg.vocab_size if tokenizer is None else min(cfg.vocab_size, len(tokenizer))
        self._max_token_chars = None if tokenizer is None else \
            max((len(t) for t in tokenizer.get_vocab()), default=1)

    @functools.cached_property
    def eos_token_id(self) -> int | None:
        """Read once: transformers looks the EOS token's id up anew on every read (one a request)."""
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return self.tokenizer.eos_token_id
        ids = self.cfg.eos_token_ids
        return ids[0] if ids else None

    def process(self, prompt: str | list[int], params: SamplingParams,
                ) -> tuple[str | None, list[int], SamplingParams]:
        """Returns (prompt text or None, prompt token ids, params with max_tokens resolved)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("prompt: this server has no tokenizer; send token ids")
            self.check_text_length(prompt, "prompt")
            text, ids = prompt, self.encode(prompt, "prompt", add_special_tokens=params.add_special_tokens)
        else:
            text, ids = None, list(prompt)
            if not ids:
                raise ValueError("prompt must not be empty")
            V = self.vocab_size
            # one pass over the types and min/max at C speed; the item scan only to name a bad one
            if not (set(map(type, ids)) <= {int} and 0 <= min(ids) and max(ids) < V):
                bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < V), None)
                if bad is not None:
                    raise ValueError(f"prompt: token id {bad!r} is outside the vocabulary [0, {V})")
        keep = params.truncate_prompt_tokens
        if keep is not None:
            keep = self.max_model_len if keep == -1 else keep
            if keep > self.max_model_len:
                raise ValueError(f"truncate_prompt_tokens {keep} is more than the context length "
                                 f"(max_model_len) {self.max_model_len}")
            if len(ids) > keep:  # left truncation: the prompt's end is what the output follows
                text, ids = None, ids[-keep:]
        if self.capacity_tokens and len(ids) > self.capacity_tokens:
            raise ValueError(f"prompt has {len(ids)} tokens, more than the KV cache holds "
                             f"({self.capacity_tokens} tokens)")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ContextLengthError(self.max_model_len, len(ids))
        # The KV cache holds every token but the last: a request may grow to capacity + 1 tokens
        # (the scheduler ends it there), so a smaller cache than the context bounds max_tokens too
        fits = self.capacity_tokens + 1 - len(ids) if self.capacity_tokens else room
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=min(room, fits))
        elif params.max_tokens > room:
            raise ContextLengthError(self.max_model_len, len(ids), params.max_tokens)
        elif params.max_tokens > fits:
            raise CacheCapacityError(self.capacity_tokens, len(ids), params.max_tokens)
        check_token_ids(params, self.vocab_size, self.eos_token_id)
        return text, ids, params

    def check_text_length(self, text: str, field: str) -> None:
        """ValueError, without tokenizing, for text too long to fit max_model_len in any case."""
        if self._max_token_chars is None:
            return  # no tokenizer: text is refused elsewhere
        limit = self._max_token_chars * self.max_model_len * _CHARS_PER_TOKEN_MARGIN
        if len(text) > limit:
            raise ValueError(f"{field} has {len(text)} characters: more than the context length "
                             f"(max_model_len) {self.max_model_len} tokens can hold with this "
                             f"tokenizer (refused above {limit} characters, before tokenizing)")

    def encode(self, text: str, field: str, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`; any tokenizer failure is a ValueError naming the field."""
        try:
            return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        except Exception as e:  # noqa: BLE001 - the tokenizer refused this input (TypeError, ...)
            raise ValueError(f"{field}: the tokenizer cannot encode it ({type(e).__name__})") from None
