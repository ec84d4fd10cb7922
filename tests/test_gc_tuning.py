"""The engine freezes its start-up objects out of garbage collection and thaws them at shutdown."""

import gc

from common.gc_tuning import freeze_startup_objects, thaw_frozen_objects


def test_freeze_moves_live_objects_out_of_collection_and_thaw_returns_them():
    gc.unfreeze()
    keep = [[i] for i in range(1000)]  # tracked containers alive across the freeze
    n = freeze_startup_objects()
    # frozen objects are still freed by reference counting (another thread's temporaries, say):
    # the count may fall after the return, never rise
    assert n >= len(keep) and len(keep) <= gc.get_freeze_count() <= n
    assert gc.get_threshold()[2] == 100  # full collections ten times rarer than Python's 10
    assert all(not any(o is x for x in gc.get_objects()) for o in keep[:3])  # not in any generation
    thaw_frozen_objects()
    assert gc.get_freeze_count() == 0 and gc.get_threshold()[2] == 10
    assert any(o is keep[0] for o in gc.get_objects())


def test_engine_start_freezes_and_shutdown_thaws(tiny_v3):
    from engine import LLM
    gc.unfreeze()
    llm = LLM(tiny_v3[0], device="cpu", dtype="float32", num_kv_blocks=16)
    assert gc.get_freeze_count() > 0  # the model's modules and the rest of start-up
    llm.engine.shutdown()
    assert gc.get_freeze_count() == 0
