"""The Responses API's store: finished responses kept in memory, bounded in count and in bytes,
so that `previous_response_id` continues a conversation and `GET /v1/responses/{id}` returns one.

vLLM keeps them only with VLLM_ENABLE_RESPONSES_API_STORE=1, in a dict that never forgets; here
the store is on by default (OpenAI's `store` defaults to true) and bounded: past
--responses-store-size responses or --responses-store-max-bytes the oldest are evicted first.
An entry holds the response as sent (its JSON) and the conversation that led to it (without the
request's `instructions`, which OpenAI does not carry over), its output turn included. A conversation
continued N times is counted in full in each of its N entries (the turns are shared objects, so
the count is an upper bound of the memory held). Nothing is written to disk.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass

logger = logging.getLogger(__name__)

DEFAULT_SIZE = 1024  # responses
DEFAULT_MAX_BYTES = 64 << 20


def add_responses_flags(p: argparse.ArgumentParser) -> None:
    """The store's flags on the `serve` parser."""
    g = p.add_argument_group("Responses API (/v1/responses)")
    g.add_argument("--responses-store-size", type=int, default=None, metavar="N",
                   help=f"keep the last N responses of /v1/responses in memory (those sent with "
                        f"store true, OpenAI's default), for previous_response_id and GET "
                        f"/v1/responses/{{id}}; the oldest are evicted first; 0: keep none "
                        f"(previous_response_id is then a 400); default {DEFAULT_SIZE}, and 0 under "
                        f"--api-server-count > 1 (each process would keep its own)")
    g.add_argument("--responses-store-max-bytes", type=int, default=DEFAULT_MAX_BYTES, metavar="B",
                   help="at most this many bytes of stored responses and their conversations "
                        "(the response's JSON and the conversation's turns: their text and "
                        "~0.5 KB a turn); the oldest are evicted first")


ITEM_BYTES = 512  # a stored input item's dict and its keys, besides its text (as a turn's objects)


def input_bytes(given: str | list | None) -> int:
    """What keeping a request's parsed `input` adds: a string's characters (also counted in its
    turn: an upper bound), an item list's containers (their text is the turns')."""
    if given is None:
        return 0
    return len(given) if isinstance(given, str) else ITEM_BYTES * len(given)


@dataclass
class Stored:
    response: bytes  # its JSON, as sent
    turns: list  # ChatMessage: the conversation without instructions, the output turn last
    turn_bytes: int  # the turns' memory (text, calls, the objects holding them), counted in full
    nbytes: int  # that and the response's JSON
    input: str | list | None = None  # the request's `input` as parsed (GET .../input_items)


class ResponseStore:
    """Finished responses by id, oldest evicted first; used on the event loop only."""

    def __init__(self, max_entries: int = DEFAULT_SIZE, max_bytes: int = DEFAULT_MAX_BYTES,
                 off_reason: str = "--responses-store-size 0") -> None:
        if max_entries < 0:
            raise ValueError(f"--responses-store-size must be >= 0, got {max_entries}")
        if max_bytes < 1:
            raise ValueError(f"--responses-store-max-bytes must be >= 1, got {max_bytes}")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.off_reason = off_reason  # why it keeps none, when it keeps none: named in 400s and 404s
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self.nbytes = 0
        # background responses still running, by id (server/responses.py): each task stores its
        # final state, then leaves; until then its entry holds it queued or in_progress
        self.running: dict[str, asyncio.Task] = {}
        # the events of background responses created with stream (server/responses_background.py
        # EventLog), by id, for GET ?stream=true: only with their entry (put with `events` and
        # attach_events keep one, every put or delete of the id drops it), their bytes counted
        # against --responses-store-max-bytes (a running one's as it grows, at each put)
        self.event_logs: dict = {}

    @classmethod
    def from_args(cls, args) -> ResponseStore:
        """The store a parsed `serve` namespace asks for (defaults for a missing flag). Several API
        server processes keep none: a response kept by one would be missing from the others,
        which answer the next request as often."""
        size = getattr(args, "responses_store_size", None)
        max_bytes = getattr(args, "responses_store_max_bytes", None)
        servers = getattr(args, "api_server_count", 1) or 1
        if servers > 1:
            if size:
                raise ValueError(f"--responses-store-size {size} and --api-server-count {servers}: each API "
                                 "server process would keep its own responses, and a request naming one "
                                 "would reach another process; keep responses with --api-server-count 1")
            return cls(0, DEFAULT_MAX_BYTES if max_bytes is None else max_bytes,
                       off_reason=f"--api-server-count {servers}: responses are not kept across API "
                                  "server processes")
        return cls(DEFAULT_SIZE if size is None else size,
                   DEFAULT_MAX_BYTES if max_bytes is None else max_bytes)

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> Stored | None:
        return self._entries.get(response_id)

    def put(self, response_id: str, response: bytes, turns: list, turn_bytes: int, nbytes: int,
            given: str | list | None = None, events=None) -> bool:
        """Keep a response (replacing one of the same id, and its event log) and its request's
        `given` input, evicting the oldest past the bounds; False when it alone is over the byte
        bound (then it is not kept). `nbytes` counts the input too (its text is the turns'; its
        objects are counted by the caller). `events`: the response's EventLog, kept with it where
        both fit the byte bound (`attach_events`)."""
        self.delete(response_id)
        if not self.enabled or nbytes > self.max_bytes:
            if self.enabled:
                logger.warning("response %s not stored: %d bytes, over --responses-store-max-bytes %d",
                               response_id, nbytes, self.max_bytes)
            return False
        self._entries[response_id] = Stored(response, turns, turn_bytes, nbytes, given)
        self.nbytes += nbytes
        if events is not None:
            self.attach_events(response_id, events)
        self._evict(response_id)
        return True

    def attach_events(self, response_id: str, events) -> bool:
        """Keep `events` (an EventLog) with the stored response of that id, if there is one and
        both fit the byte bound together; evicts older entries for it. False when not kept."""
        found = self._entries.get(response_id)
        self.event_logs.pop(response_id, None)
        if found is None or found.nbytes + events.nbytes > self.max_bytes:
            return False
        self.event_logs[response_id] = events
        self._evict(response_id)
        return True

    def _evict(self, response_id: str) -> None:
        """Evict the oldest entries (and their logs) past the bounds, never `response_id`'s."""
        while len(self._entries) > self.max_entries or self.held_bytes() > self.max_bytes:
            # a running background response's entry stays (it is what GET polls; their number is
            # bounded by max_entries, a 429 past it), and so does the one just kept: with only
            # those left the store is over its bounds until one of them goes
            old_id = next((k for k in self._entries if k not in self.running and k != response_id), None)
            if old_id is None:
                break
            self.delete(old_id)

    def held_bytes(self) -> int:
        """The entries' bytes and their event logs' (which grow while their responses run)."""
        return self.nbytes + sum(log.nbytes for log in self.event_logs.values())

    def delete(self, response_id: str) -> bool:
        """Forget a response and its event log."""
        self.event_logs.pop(response_id, None)
        old = self._entries.pop(response_id, None)
        if old is None:
            return False
        self.nbytes -= old.nbytes
        return True
