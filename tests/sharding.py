"""`pytest --shard I/N` (tests/conftest.py): which of the selected tests one shard runs."""

from __future__ import annotations

import pytest


def shard(items: list, spec: str) -> tuple[list, list]:
    """(kept, dropped) for `--shard I/N`: every N-th item from the I-th, in collection order (round
    robin, so the slow tests of one file spread over the shards)."""
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard {spec!r}: expected I/N, two integers") from None
    if not 0 <= i < n:
        raise pytest.UsageError(f"--shard {spec!r}: expected 0 <= I < N")
    return items[i::n], [it for j, it in enumerate(items) if j % n != i]
