"""Prompt logprobs kept with cached KV blocks, so that a prompt-logprob request can use the cache.

A request that wants prompt logprobs (lm_eval's loglikelihood requests: `echo` with `logprobs`)
must report every prompt token's logprob, and the logprob of token i comes from the model's
output at position i - 1. A plain prefix hit skips those positions (vLLM computes such prompts
whole). Here, when a prompt-logprob request fills a cached block, the logprobs of that block's
own tokens (entry i of a block starting at token s: token s + i's logprob given tokens 0 .. s + i,
all inside the block's chained hash) are kept beside it, as compact columns
(scheduler/prompt_logprobs.py), for as long as the block stays cached. A later request with the
same prefix takes its KV from the cache for all but the last of the matching blocks that have a
record, and its logprobs for those blocks' tokens and the first token of the last one from the
records; the last block is computed again (its first token's logprob would need the previous
block's last output, which is not kept), so its prompt is computed from there on. With a few-shot
preamble shared by every question of a task and the choices of each question sharing their
context, that is most of a loglikelihood workload's prompt tokens.

Each record holds the top-k alternatives of the request that wrote it; a later request asking for
more than that k does not use it (it computes the block, and its record then replaces the
smaller one).
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.outputs import TokenLogprobs
from scheduler.prompt_logprobs import PromptLogprobs


class LogprobRecords:
    """Block hash -> (k, the prompt logprobs of that block's tokens with k alternatives), for
    cached blocks. A record is a compact copy (ids and ranks int32: ~0.7 KB for a 16-token block
    with one alternative, ~3 KB with 20, the most a request may ask)."""

    def __init__(self) -> None:
        self._by_hash: dict[bytes, tuple[int, PromptLogprobs]] = {}

    def __len__(self) -> int:
        return len(self._by_hash)

    def covers(self, block_hash: bytes, k: int) -> bool:
        """Whether the block has a record of at least top-k alternatives."""
        rec = self._by_hash.get(block_hash)
        return rec is not None and rec[0] >= k

    def put(self, block_hash: bytes, k: int, entries: Sequence[TokenLogprobs | None]) -> None:
        """Keep `entries` (the block's tokens' logprobs, each with k alternatives, or the
        vocabulary's size where k exceeds it) unless a record of at least k is already there."""
        if not self.covers(block_hash, k):
            self._by_hash[block_hash] = (k, PromptLogprobs.from_entries(entries).compact())

    def entries(self, block_hash: bytes, k: int, count: int) -> PromptLogprobs:
        """The block's first `count` entries, with at most k alternatives each."""
        return self._by_hash[block_hash][1].slice(0, count, width=k)

    def drop(self, block_hash: bytes) -> None:
        self._by_hash.pop(block_hash, None)

    def clear(self) -> None:
        self._by_hash.clear()
