"""launch/gc_tune.py: a serving process's collector after startup."""

from __future__ import annotations

import gc

from launch.gc_tune import YOUNG_THRESHOLD, settle_gc


def test_settle_gc_freezes_what_exists_and_collects_young_objects_less_often() -> None:
    before = gc.get_threshold()
    gc.unfreeze()
    try:
        settle_gc()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (YOUNG_THRESHOLD, before[1], before[2])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
