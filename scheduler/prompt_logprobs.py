"""Prompt logprobs as columns, from the runner to the HTTP response.

A loglikelihood request (lm_eval: `echo` with `logprobs`) wants an entry for every prompt token:
as one Python object each (`TokenLogprobs`) they cost the engine core ~1.7 µs a token to build
and the front end ~3 µs more to pickle, unpickle and read (bench_core_overhead.py --echo-logprobs
on this machine's CPU: a 580-token prompt took ~4 ms of host time over the two processes, so
~250 requests/s filled a core). Here a run of consecutive prompt tokens' logprobs is five
numpy arrays: made from the device's tensors without a loop, pickled as their bytes, kept with
cached blocks as slices (scheduler/logprob_records.py), and read by the server a column at a
time. Indexing builds `TokenLogprobs` lazily, so callers that walk entries still see them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from scheduler.outputs import TokenLogprobs


class PromptLogprobs(Sequence):
    """Entries of consecutive prompt tokens: entry i is the `TokenLogprobs` of the run's i-th
    token, or None for the prompt's first token (`first`: the run starts the prompt, and its
    entry 0 is that None). Columns over the n tokens that have logprobs: token_ids [n],
    logprobs [n] (float32), ranks [n], top_ids / top_vals [n, width] (the most likely first)."""

    __slots__ = ("first", "token_ids", "logprobs", "ranks", "top_ids", "top_vals")

    def __init__(self, first: bool, token_ids: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray,
                 top_ids: np.ndarray, top_vals: np.ndarray):
        n = len(token_ids)
        if not (len(logprobs) == len(ranks) == n and top_ids.shape == top_vals.shape and top_ids.shape[0] == n):
            raise ValueError(f"prompt logprob columns of {n}, {len(logprobs)}, {len(ranks)} rows and "
                             f"alternatives {top_ids.shape} / {top_vals.shape}")
        self.first, self.token_ids, self.logprobs, self.ranks = first, token_ids, logprobs, ranks
        self.top_ids, self.top_vals = top_ids, top_vals

    @classmethod
    def empty(cls, first: bool = False, width: int = 0) -> PromptLogprobs:
        ints, floats = np.zeros(0, np.int64), np.zeros(0, np.float32)
        return cls(first, ints, floats, ints, np.zeros((0, width), np.int64), np.zeros((0, width), np.float32))

    @classmethod
    def from_entries(cls, entries: Sequence[TokenLogprobs | None]) -> PromptLogprobs:
        """From entries (None only first), each with the same number of alternatives."""
        if isinstance(entries, PromptLogprobs):
            return entries
        first = bool(entries) and entries[0] is None
        real = list(entries[1:] if first else entries)
        width = len(real[0].top) if real else 0
        if any(e is None or len(e.top) != width for e in real):
            raise ValueError("prompt logprob entries need one TokenLogprobs a token (None only for the prompt's "
                             "first) with the same number of alternatives each")
        return cls(first, np.array([e.token_id for e in real], np.int64),
                   np.array([e.logprob for e in real], np.float32), np.array([e.rank for e in real], np.int64),
                   np.array([[t for t, _ in e.top] for e in real], np.int64).reshape(len(real), width),
                   np.array([[v for _, v in e.top] for e in real], np.float32).reshape(len(real), width))

    @property
    def width(self) -> int:
        return self.top_ids.shape[1]

    def __len__(self) -> int:
        return int(self.first) + len(self.token_ids)

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            return self.slice(start, stop)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        if self.first and i == 0:
            return None
        j = i - int(self.first)
        return TokenLogprobs(int(self.token_ids[j]), float(self.logprobs[j]), int(self.ranks[j]),
                             list(zip(self.top_ids[j].tolist(), self.top_vals[j].tolist())))

    def __eq__(self, other) -> bool:
        if not isinstance(other, (PromptLogprobs, list, tuple)):
            return NotImplemented
        return len(self) == len(other) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"PromptLogprobs({len(self)} entries, first={self.first}, width={self.width})"

    def slice(self, start: int, stop: int, width: int | None = None) -> PromptLogprobs:
        """Entries start .. stop - 1 (a PromptLogprobs; `first` only if it keeps entry 0), with
        at most `width` alternatives each."""
        stop = max(start, min(stop, len(self)))
        f = int(self.first)
        first = self.first and start == 0 < stop
        a, b = max(start - f, 0), max(stop - f, 0)
        w = self.width if width is None else min(width, self.width)
        return PromptLogprobs(first, self.token_ids[a:b], self.logprobs[a:b], self.ranks[a:b],
                              self.top_ids[a:b, :w], self.top_vals[a:b, :w])

    def num_alternatives(self) -> int:
        """The alternatives over all entries (what a response spells out besides the tokens)."""
        return self.top_ids.size

    def compact(self) -> PromptLogprobs:
        """A copy that owns its memory, ids and ranks as int32 (below any vocabulary size): what
        a cached block keeps."""
        return PromptLogprobs(self.first, self.token_ids.astype(np.int32), self.logprobs.copy(),
                              self.ranks.astype(np.int32), self.top_ids.astype(np.int32), self.top_vals.copy())

    @staticmethod
    def concat(parts: Sequence[PromptLogprobs]) -> PromptLogprobs:
        """The parts' entries in order (only the first part may start the prompt), at the
        narrowest part's width."""
        parts = [p for p in parts if len(p)] or list(parts[:1])
        if not parts:
            return PromptLogprobs.empty()
        if any(p.first for p in parts[1:]):
            raise ValueError("only the first run of prompt logprobs may start the prompt")
        if len(parts) == 1:
            return parts[0]
        w = min(p.width for p in parts)
        return PromptLogprobs(parts[0].first, *(np.concatenate([getattr(p, c) for p in parts]) for c in
                                                ("token_ids", "logprobs", "ranks")),
                              np.concatenate([p.top_ids[:, :w] for p in parts]),
                              np.concatenate([p.top_vals[:, :w] for p in parts]))

    def __add__(self, other) -> PromptLogprobs:
        return PromptLogprobs.concat([self, PromptLogprobs.from_entries(other)])
