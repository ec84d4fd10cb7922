"""Speculative decoding: the `--speculative-config` (vLLM's JSON keys), the drafters, and the
verification of drafts against the target model's own samples.

A request with k drafts d_1..d_k is a decode of q_len = 1 + k (its last token, then the drafts):
row j's logits give the target's distribution p_j for the token after d_j (d_0 = the last
token). Row j is sampled exactly as a plain decode would sample that position (the same logit
processing, penalties over the outputs plus d_1..d_j, the request's own noise draw t_j); the step
outputs t_0 .. t_a where a is the first j with t_j != d_{j+1} (or k), so every output token is a
sample of the target distribution given the tokens before it.

For drafts that are point masses (ngram lookup; the MTP head's argmax) this is rejection
sampling exactly: the draft d is accepted with probability p(d) = min(1, p(d) / q(d)) with q = 1
at d, and when rejected the token is t ~ p conditioned on t != d, which is the residual
distribution (p - q)+ normalised. Greedy requests accept by exact match of the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.args import json_object

METHODS = ("ngram", "mtp")
# vLLM's other names for these methods: "deepseek_mtp" is its name for the DeepSeek checkpoints'
# MTP layer, "[ngram]" the old spelling of prompt lookup
ALIASES = {"deepseek_mtp": "mtp", "[ngram]": "ngram"}
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1  # ngram: shortest suffix matched
    prompt_lookup_max: int = 3  # ngram: longest suffix matched (tried first)

    @classmethod
    def parse(cls, value: dict | str | None) -> SpeculativeConfig | None:
        """From `--speculative-config` (a JSON object or a dict); ValueError naming the key."""
        if value is None:
            return None
        if isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "--speculative-config")
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(f"--speculative-config: unknown key(s) {unknown}; supported: {sorted(_KEYS)}")
        method = ALIASES.get(value.get("method"), value.get("method"))
        if method not in METHODS:
            raise ValueError(f"--speculative-config: method must be one of {list(METHODS)} (or vLLM's "
                             f"{', '.join(ALIASES)}), got {method!r}")
        k = value.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 15:
            raise ValueError(f"--speculative-config: num_speculative_tokens must be an integer in [1, 15], got {k!r}")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if method != "ngram" and (lo is not None or hi is not None):
            raise ValueError("--speculative-config: prompt_lookup_min/max apply to method 'ngram' only")
        if hi is None:
            hi = max(lo or 0, cls.prompt_lookup_max)
        if lo is None:
            lo = min(cls.prompt_lookup_min, hi)
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--speculative-config: {name} must be an integer >= 1, got {v!r}")
        if lo > hi:
            raise ValueError(f"--speculative-config: prompt_lookup_min {lo} exceeds prompt_lookup_max {hi}")
        return cls(method, k, lo, hi)

    @property
    def decode_threshold(self) -> int:
        """Longest decode query: the last token and every draft."""
        return 1 + self.num_speculative_tokens


def ngram_propose(tokens: list[int] | np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Prompt lookup: the tokens that followed the earliest earlier occurrence of the longest
    suffix of `tokens` (n_max down to n_min tokens long); at most k, [] when nothing matches."""
    arr = np.asarray(tokens, dtype=np.int64)
    L = arr.shape[0]
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        # windows starting at 0 .. L-1-n: every earlier occurrence with a token after it
        windows = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)
        hits = np.flatnonzero((windows == arr[L - n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return arr[start: start + k].tolist()
    return []


def accepted_prefix(targets: list[int], drafts: list[int]) -> int:
    """How many leading drafts equal the target's tokens at their positions."""
    a = 0
    while a < len(drafts) and targets[a] == drafts[a]:
        a += 1
    return a
