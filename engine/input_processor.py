"""Tokenize and validate prompts before they reach the engine core (errors name the field)."""

from __future__ import annotations

import dataclasses
import logging

from engine.sampling_params import SamplingParams
from models.config import ModelConfig

log = logging.getLogger(__name__)


def load_tokenizer(path: str, required: bool = True):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any failure means "no usable tokenizer here"
        if required:
            raise ValueError(f"--tokenizer: cannot load a tokenizer from {path}: {e}") from None
        log.warning("no tokenizer in %s (%s): only token-id prompts will be accepted", path,
                    type(e).__name__)
        return None


class InputProcessor:
    def __init__(self, tokenizer, cfg: ModelConfig, max_model_len: int, capacity_tokens: int = 0):
        self.tokenizer, self.cfg, self.max_model_len = tokenizer, cfg, max_model_len
        self.capacity_tokens = capacity_tokens  # KV cache capacity; 0: unknown, unchecked

    @property
    def eos_token_id(self) -> int | None:
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
            text, ids = prompt, self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        else:
            text, ids = None, list(prompt)
            if not ids:
                raise ValueError("prompt must not be empty")
            V = self.cfg.vocab_size
            bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < V), None)
            if bad is not None:
                raise ValueError(f"prompt: token id {bad!r} is outside the vocabulary [0, {V})")
        if self.capacity_tokens and len(ids) > self.capacity_tokens:
            raise ValueError(f"prompt has {len(ids)} tokens, more than the KV cache holds "
                             f"({self.capacity_tokens} tokens)")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ValueError(f"prompt has {len(ids)} tokens; the context length (max_model_len) is "
                             f"{self.max_model_len}, which leaves no room for output")
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=room)
        elif params.max_tokens > room:
            raise ValueError(f"max_tokens {params.max_tokens} + prompt {len(ids)} tokens exceeds "
                             f"the context length (max_model_len) {self.max_model_len}")
        if any(t >= self.cfg.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be below the vocabulary size {self.cfg.vocab_size}")
        return text, ids, params
