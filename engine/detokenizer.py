"""Incremental detokenization for streaming, with stop strings.

Each update decodes only a small window of ids (vLLM-style prefix / read offsets):
  ids[prefix:read]  already emitted; decoded again only as context for the new text
  ids[read:]        new; its text is decoded(ids[prefix:]) minus decoded(ids[prefix:read])
The window advances only when the new text does not end in U+FFFD, i.e. when a multi-byte
character split across byte-level BPE tokens is complete, so `prefix` always sits on a character
boundary and the text equals a decode of the whole sequence; text before a trailing U+FFFD run is
final and is emitted at once. Decoding the context again keeps tokenizers whose decoders depend
on position (SentencePiece's leading "▁" strip) correct.

Byte-fallback tokenizers (SentencePiece / Llama style, byte pieces `<0x00>`..`<0xFF>`) decode a
whole run of consecutive byte tokens at once and replace every byte of an invalid run by U+FFFD:
`<0xE4><0xB8><0xAD>` is "中" but one more `<0xE4>` turns all four into U+FFFD. So a trailing run
of byte tokens is never decoded into the window: its text is final only once a token that is not
a byte ends the run (skipped special tokens do not end it: decode() drops them first).

Invariants (tested): output_text == tokenizer.decode(output ids, skip_special_tokens=...,
clean_up_tokenization_spaces=False) up to the stop-string cut; the concatenation of all
get_delta() results == the final output_text.
"""

from __future__ import annotations

import functools
import logging

from common.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_REPLACEMENT_CHAR = "\ufffd"


@functools.lru_cache(maxsize=8)
def _byte_token_ids(tokenizer) -> frozenset[int]:
    """Ids of the tokenizer's byte-fallback pieces `<0x00>`..`<0xFF>` (none for byte-level BPE)."""
    to_ids = getattr(tokenizer, "convert_tokens_to_ids", None)
    to_tokens = getattr(tokenizer, "convert_ids_to_tokens", None)
    if to_ids is None or to_tokens is None:
        return frozenset()
    pieces = [f"<0x{b:02X}>" for b in range(256)]
    ids = [i for i in to_ids(pieces) if i is not None]
    return frozenset(i for i, t in zip(ids, to_tokens(ids)) if t in pieces)


@functools.lru_cache(maxsize=8)
def _special_ids(tokenizer) -> frozenset[int]:
    """The tokenizer's special token ids, once: transformers computes `all_special_ids` anew on
    every read (a token-to-id lookup each), ~1% of the HTTP process's time at one read a request."""
    return frozenset(getattr(tokenizer, "all_special_ids", ()))


class IncrementalDetokenizer:
    """Turns a request's output token ids into text as they arrive, and spots stop strings."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        # The prompt is not used as decoding context on purpose: output_text must equal a decode
        # of the output ids alone (a character split across the prompt/output boundary, or a
        # SentencePiece leading space, would otherwise differ). It is kept for the interface.
        del prompt_token_ids
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stops = list(params.stop)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._byte_ids = _byte_token_ids(tokenizer)
        # ids a run of byte tokens passes over: specials that decode() drops before decoding
        self._skipped_ids = _special_ids(tokenizer) if self._skip_special else frozenset()

        self.token_ids: list[int] = []  # every output id passed to update (incl. ones after a stop)
        self._ids: list[int] = []  # ids that are part of the text (a final stop token is excluded)
        self._prefix = 0
        self._read = 0
        self._prefix_text = ""  # decode(ids[prefix:read]), cached between updates
        self._window_emitted = 0  # chars of decode(ids[prefix:]) past _prefix_text already emitted
        self.output_text = ""
        self._stop_checked = 0  # output_text[:_stop_checked] holds no stop string
        self._sent = 0  # output_text[:_sent] has been returned by get_delta
        self.finished = False
        self.stop_str: str | None = None

    @property
    def has_stop_strings(self) -> bool:
        return bool(self._stops)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special,
                                      clean_up_tokenization_spaces=False)

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append tokens; return the stop string that ended the output (text cut there), or None.

        `stop_terminated`: the last id is the eos / stop token that ends the request; its text
        is left out unless include_stop_str_in_output, as in vLLM.
        """
        if self.finished:
            # a step already in flight may deliver tokens after a stop string ended the request
            logger.debug("ignoring %d token(s) after finish", len(new_token_ids))
            return None
        self.token_ids.extend(new_token_ids)
        if stop_terminated and new_token_ids and not self._include_stop:
            new_token_ids = new_token_ids[:-1]
        if not new_token_ids:
            return None
        self._ids.extend(new_token_ids)
        end = self._run_start()
        if end > self._read:
            self._advance(self._decode(self._ids[self._prefix:end]), end, final=False)
        if len(self.token_ids) <= self._min_tokens:
            # vLLM: a stop string completed by the first min_tokens tokens does not count
            self._stop_checked = len(self.output_text)
            return None
        return self._check_stop()

    def _run_start(self) -> int:
        """Where a trailing run of byte-fallback tokens starts (len(ids) when there is none)."""
        ids, end = self._ids, len(self._ids)
        if not self._byte_ids:
            return end
        i = end
        while i > self._read and (ids[i - 1] in self._byte_ids or ids[i - 1] in self._skipped_ids):
            i -= 1
        # specials alone at the end are no run: their text (none, or kept) is final
        return i if any(t in self._byte_ids for t in ids[i:end]) else end

    def _advance(self, window_text: str, end: int, final: bool) -> None:
        """Append the new part of window_text = decode(ids[prefix:end]) to output_text."""
        done = len(self._prefix_text) + self._window_emitted  # window chars already in the text
        if final or not window_text.endswith(_REPLACEMENT_CHAR):
            if len(window_text) > len(self._prefix_text):
                self.output_text += window_text[done:]
                self._prefix, self._read = self._read, end
                self._prefix_text = self._decode(self._ids[self._prefix:self._read])
                self._window_emitted = 0
            return
        # A trailing U+FFFD run may be a character still being completed (byte-level BPE gives
        # one U+FFFD for it, byte-fallback decoders one per byte). Only the text before the run
        # is final; emit it now but keep the window open until the run resolves.
        stable = window_text.rstrip(_REPLACEMENT_CHAR)
        if len(stable) > done:
            self.output_text += stable[done:]
            self._window_emitted = len(stable) - len(self._prefix_text)

    def _check_stop(self) -> str | None:
        if not self._stops or self._stop_checked == len(self.output_text):
            return None
        text, checked = self.output_text, self._stop_checked
        start = max(0, checked - self._max_stop_len + 1)
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            i = text.find(stop, start)
            while i != -1 and i + len(stop) <= checked:  # wholly in already-checked text
                i = text.find(stop, i + 1)
            if i != -1:
                cand = (i + len(stop), i, stop)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        self._stop_checked = len(text)
        if best is None:
            return None
        # The first stop string to be completed wins (what a token-by-token stream would see
        # first, whatever the token boundaries); on equal ends the one starting earlier.
        end, begin, stop = best
        self.output_text = text[:end] if self._include_stop else text[:begin]
        self._stop_checked = len(self.output_text)
        self.stop_str = stop
        self.finished = True
        return stop

    def _held_back(self) -> int:
        """Length of the longest tail of output_text that could still grow into a stop string."""
        if self.finished or not self._stops:
            return 0
        text = self.output_text
        for k in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(len(s) > k and s.startswith(tail) for s in self._stops):
                return k
        return 0

    def get_delta(self) -> str:
        """Text added since the last call that can no longer change or be cut by a stop string."""
        end = max(self._sent, len(self.output_text) - self._held_back())
        delta = self.output_text[self._sent:end]
        self._sent = end
        return delta

    def finish(self) -> str | None:
        """Mark the output complete: flush a trailing partial character or byte run and release
        held text; return the stop string the flushed text completed (text cut there), or None."""
        if self.finished:
            return None
        stop = None
        if self._read < len(self._ids):
            # the tail still ends in U+FFFD (an incomplete character, or a real U+FFFD) or in a
            # run of byte tokens: emit it as decode() of the whole sequence would
            self._advance(self._decode(self._ids[self._prefix:]), len(self._ids), final=True)
            if len(self.token_ids) > self._min_tokens:
                stop = self._check_stop()
        self.finished = True
        return stop
