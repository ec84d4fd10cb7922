"""The garbage collector around a long-lived engine.

Everything start-up builds (the model's modules and parameters, compiled code and its caches,
the CUDA graphs' bookkeeping) lives as long as the process. Left in the collector's generations,
each full collection walks it all again: on V2-Lite one took ~0.4 s, a stall of every running
request. `freeze_startup_objects` collects once and moves the survivors to the permanent
generation, so that later collections walk only what requests allocate, and makes full
collections (which walk every object the requests in flight hold) ten times rarer: one after
FULL_GC_EVERY collections of the middle generation instead of Python's 10. Objects frozen are
still freed by reference counting; only cycles among them wait until `thaw_frozen_objects` (the
engine's shutdown) returns them to the collector, and cyclic garbage that reaches the oldest
generation is still collected, less often.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)

# Full collections after this many collections of the middle generation (Python's default: 10).
# With 1000 streams at once (scripts/bench_core_overhead.py, a busy 2-core CPU) the HTTP process
# ran 8 full collections, 2.0 s in all, after the freeze alone, and none with this.
FULL_GC_EVERY = 100
PYTHON_FULL_GC_EVERY = 10


def freeze_startup_objects(full_every: int = FULL_GC_EVERY) -> int:
    """Collect, freeze every object alive now and space full collections `full_every` middle
    collections apart; returns how many objects were frozen."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    g0, g1, _ = gc.get_threshold()
    gc.set_threshold(g0, g1, full_every)
    n = gc.get_freeze_count()
    log.info("gc: %d start-up objects frozen out of collection (%.2f s); a full collection after every "
             "%d of the middle generation", n, time.perf_counter() - t0, full_every)
    return n


def thaw_frozen_objects() -> None:
    """Give frozen objects back to the collector (an engine shut down: its cycles may go), with
    Python's spacing of full collections."""
    gc.unfreeze()
    g0, g1, _ = gc.get_threshold()
    gc.set_threshold(g0, g1, PYTHON_FULL_GC_EVERY)
