"""Prompt logprobs kept with cached KV blocks, so that a prompt-logprob request can use the cache.

A request that wants prompt logprobs (lm_eval's loglikelihood requests: `echo` with `logprobs`)
must report every prompt token's logprob, and the logprob of token i comes from the model's
output at position i - 1. A plain prefix hit skips those positions, so vLLM computes such
prompts whole, and so did this engine. Here, when a prompt-logprob request fills a cached block,
the logprobs of that block's own tokens (entry i of a block starting at token s: token s + i's
logprob given tokens 0 .. s + i, all inside the block's chained hash) are kept beside it, in
compact arrays, for as long as the block stays cached. A later request with the same prefix then
takes its KV from the cache for all but the last of the matching blocks that have a record, and
its logprobs for those blocks' tokens and the first token of the last one from the records; the
last block is computed again (its first token's logprob would need the previous block's last
output, which is not kept), so its prompt is computed from there on. With a few-shot preamble
shared by every question of a task and the choices of each question sharing their context, that
is most of a loglikelihood workload's prompt tokens.

Each record holds the top-k alternatives of the request that wrote it; a later request asking for
more than that k does not use it (it computes the block, and its record then replaces the
smaller one).
"""

from __future__ import annotations

from array import array

from scheduler.outputs import TokenLogprobs


class _Record:
    __slots__ = ("k", "width", "first", "logprob", "rank", "top_ids", "top_vals")

    def __init__(self, k: int, entries: list[TokenLogprobs | None]):
        # `first`: entry 0 is None (the prompt's first token, which has no logprob)
        self.k, self.first = k, entries[0] is None
        real = entries[1:] if self.first else entries
        # alternatives an entry: k, or the vocabulary where k exceeds it
        self.width = len(real[0].top) if real else 0
        if any(e is None or len(e.top) != self.width for e in real):
            raise ValueError("a block's prompt logprobs need one entry a token (None only for the prompt's "
                             "first) with the same number of alternatives each")
        # float32 values (the device's logprobs), and token ids and ranks below the vocabulary
        # size: array('f') / ('i') hold them exactly, 8 bytes an alternative (a 16-token block with
        # 1 alternative: ~0.6 KB with the objects; with 20, the most a request may ask, ~3 KB)
        self.logprob = array("f", [e.logprob for e in real])
        self.rank = array("i", [e.rank for e in real])
        self.top_ids = array("i", [t for e in real for t, _ in e.top])
        self.top_vals = array("f", [v for e in real for _, v in e.top])

    def entries(self, token_ids: list[int], k: int, count: int) -> list[TokenLogprobs | None]:
        """The first `count` entries for a block of tokens `token_ids`, top alternatives cut to k."""
        out: list[TokenLogprobs | None] = [None] if self.first else []
        w, k = self.width, min(k, self.width)
        for i in range(max(count - len(out), 0)):
            j = i + (1 if self.first else 0)
            top = [(self.top_ids[i * w + t], self.top_vals[i * w + t]) for t in range(k)]
            out.append(TokenLogprobs(token_id=token_ids[j], logprob=self.logprob[i], rank=self.rank[i], top=top))
        return out[:count]


class LogprobRecords:
    """Block hash -> the prompt logprobs of that block's tokens (`_Record`), for cached blocks."""

    def __init__(self) -> None:
        self._by_hash: dict[bytes, _Record] = {}

    def __len__(self) -> int:
        return len(self._by_hash)

    def covers(self, block_hash: bytes, k: int) -> bool:
        """Whether the block has a record of at least top-k alternatives."""
        rec = self._by_hash.get(block_hash)
        return rec is not None and rec.k >= k

    def put(self, block_hash: bytes, k: int, entries: list[TokenLogprobs | None]) -> None:
        """Keep `entries` (the block's tokens' logprobs, each with k alternatives) unless a record
        of at least k is already there."""
        if not self.covers(block_hash, k):
            self._by_hash[block_hash] = _Record(k, entries)

    def entries(self, block_hash: bytes, token_ids: list[int], k: int, count: int) -> list[TokenLogprobs | None]:
        """The first `count` logprob entries of the block (tokens `token_ids`), with k alternatives."""
        return self._by_hash[block_hash].entries(token_ids, k, count)

    def drop(self, block_hash: bytes) -> None:
        self._by_hash.pop(block_hash, None)

    def clear(self) -> None:
        self._by_hash.clear()
