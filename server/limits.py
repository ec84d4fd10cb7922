"""Per-request limits a shared server needs, each set by a `serve` flag (docs/server.md).

One request may not monopolise the FCFS queue (prompts, sequences) or the event loop (stop
strings are matched on the loop for every new token of every sequence).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from common.sampling_params import MAX_LOGPROBS
from server.errors import APIError


@dataclass(frozen=True)
class ServerLimits:
    max_request_body_bytes: int = 16 * 1024 * 1024
    # bytes of request bodies being read at once, over every connection (slow senders hold theirs)
    max_inflight_body_bytes: int = 512 * 1024 * 1024
    http_header_timeout: float = 10.0  # seconds for the request line and headers
    http_body_timeout: float = 30.0  # seconds for the whole body
    http_keep_alive_timeout: float = 30.0  # seconds an idle kept-alive connection stays open
    max_prompts_per_request: int = 256
    max_seqs_per_request: int = 512  # prompts x n
    # Matching costs each new token about (stop strings x longest stop) character comparisons on
    # the event loop, per sequence: 16 x 128 is ~0.25 ms per token on one CPU core.
    max_stop_strings: int = 16
    max_stop_str_len: int = 128  # characters
    engine_stall_timeout: float = 60.0  # /health 503 after this long without a finished step
    # a stream whose client has read nothing for this long while its outputs wait is aborted:
    # the outputs queue on the front end while the client does not read (server/streams.py)
    stream_stall_timeout: float = 30.0
    # alternatives per token a request may ask for (logprobs, top_logprobs, prompt_logprobs): vLLM's
    # --max-logprobs, whose default is also the engine's cap (MAX_LOGPROBS)
    max_logprobs: int = MAX_LOGPROBS
    # Prompt logprob entries (prompt tokens x (alternatives + 1), over the request's prompts) one
    # completions request may ask for. Scoring a prompt is one cheap prefill, but its answer is
    # built and serialised at once on the event loop: 64 prompts x 2000 tokens x 21 entries is a
    # 258 MB body that held /health for ~8 s. One lm_eval loglikelihood request (echo,
    # logprobs 1) of a 4k-token prompt is 8k entries.
    max_prompt_logprob_entries: int = 1_000_000
    # Generated logprob entries (tokens x (alternatives + 1), over every choice) a whole (not
    # streamed) answer may gather: its tokens' logprobs are held until the last token and the
    # answer is then built at once (a TokenLogprobs of 20 alternatives is ~2 KB of Python objects).
    # Counted as they come, so only a request that really produces that many is stopped; a stream
    # sends its entries as they come and is not limited.
    max_response_logprob_entries: int = 1_000_000

    @classmethod
    def from_args(cls, args) -> ServerLimits:
        """Limits from a parsed `serve` namespace (or any object); missing attributes keep their
        defaults."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)
                      if getattr(args, f.name, None) is not None})

    def check(self, num_prompts: int, n: int, stop: str | list[str] | None,
              logprobs: dict[str, int | None] | None = None) -> None:
        """400 naming the field and the limit for a request over one of them (`logprobs`: the
        request's fields of alternatives per token, by name)."""
        for field, k in (logprobs or {}).items():
            if k is not None and k > self.max_logprobs:
                raise APIError(400, f"{field}: {k} alternatives per token; at most "
                               f"{self.max_logprobs} (--max-logprobs)", param=field)
        if num_prompts > self.max_prompts_per_request:
            raise APIError(400, f"prompt: {num_prompts} prompts in one request; at most "
                           f"{self.max_prompts_per_request} (--max-prompts-per-request)",
                           param="prompt")
        if num_prompts * n > self.max_seqs_per_request:
            raise APIError(400, f"n: {num_prompts} prompt(s) x n = {n} is {num_prompts * n} "
                           f"sequences; at most {self.max_seqs_per_request} per request "
                           f"(--max-seqs-per-request)", param="n")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > self.max_stop_strings:
            raise APIError(400, f"stop: {len(stops)} stop strings; at most "
                           f"{self.max_stop_strings} (--max-stop-strings)", param="stop")
        longest = max((len(s) for s in stops), default=0)
        if longest > self.max_stop_str_len:
            raise APIError(400, f"stop: a stop string of {longest} characters; at most "
                           f"{self.max_stop_str_len} (--max-stop-str-len)", param="stop")

    def check_prompt_logprobs(self, prompts: list, k: int | list[int] | None, field: str, n: int = 1) -> None:
        """400 when the prompts' logprob entries (tokens x (k + 1), summed over the fields that
        spell them out, as echo's logprobs and prompt_logprobs both do in one completions answer;
        n times where each of the n choices of a prompt carries its prompt's, as completions' do)
        may exceed max_prompt_logprob_entries; a text prompt counts its UTF-8 bytes + 2 (a
        byte-fallback tokenizer makes at most a token a byte, plus BOS / EOS: an upper bound; exact
        for ids)."""
        ks = [k] if isinstance(k, int) else list(k or [])
        if not ks:
            return
        tokens = sum(len(p.encode("utf-8")) + 2 if isinstance(p, str) else len(p) for p in prompts)
        per_token = sum(x + 1 for x in ks)
        entries = tokens * per_token * n
        if entries > self.max_prompt_logprob_entries:
            per = f" x n = {n} choices" if n > 1 else ""
            raise APIError(400, f"{field}: {tokens} prompt tokens (at most, for text) x {per_token} logprob "
                           f"entries each{per} = {entries}; at most {self.max_prompt_logprob_entries} per "
                           f"request (--max-prompt-logprob-entries): send fewer prompts or choices per request",
                           param=field)
