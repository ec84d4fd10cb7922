"""Tokenizing, chat templating and constraint checks off the event loop, in lanes of worker
threads.

The HTTP process tokenizes on threads so that one long prompt does not stall every other
request. asyncio's default executor has min(32, cores + 4) threads (6 on 2 cores): eight
concurrent 15 MB prompts filled it, and a small chat request then waited 67 s for a thread
(2026-12-05, fuzzing the server). So texts of more than LARGE_CHARS characters go to a lane of
their own, one thread: huge prompts queue behind each other, never in front of ordinary ones.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

LARGE_CHARS = 1 << 18  # 256k characters: ~64k tokens of English, seconds of tokenizing at most

# an executor starts its threads on first use, so a process that never tokenizes starts none
_SMALL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tokenize")
_LARGE = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize-large")


async def off_loop(chars: int, fn, *args):
    """`fn(*args)` on a worker thread of the lane for a text of `chars` characters."""
    pool = _LARGE if chars > LARGE_CHARS else _SMALL
    return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))


async def large_lane(fn, *args):
    """`fn(*args)` on the large lane's thread: work on one huge input (a chat of 450,000 messages)."""
    return await asyncio.get_running_loop().run_in_executor(_LARGE, functools.partial(fn, *args))


# Structured-output checks (llguidance validating a grammar: seconds for a large one) have lanes
# of their own for the same reason: twelve 900 KB grammars being checked on the default executor
# held a plain request's answer (built there) for 10 s. Constraints of more than
# LARGE_CONSTRAINT_CHARS characters queue behind each other on one thread.
LARGE_CONSTRAINT_CHARS = 1 << 16
_CHECK = ThreadPoolExecutor(max_workers=2, thread_name_prefix="constraint")
_CHECK_LARGE = ThreadPoolExecutor(max_workers=1, thread_name_prefix="constraint-large")


async def check_off_loop(chars: int, fn, *args):
    """`fn(*args)` on a worker thread of the constraint-check lane for `chars` characters of
    constraints."""
    pool = _CHECK_LARGE if chars > LARGE_CONSTRAINT_CHARS else _CHECK
    return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))


def text_chars(conversation: list[dict]) -> int:
    """Characters of a chat conversation's text contents (what tokenizing it costs)."""
    return sum(len(m["content"]) for m in conversation if isinstance(m.get("content"), str))
