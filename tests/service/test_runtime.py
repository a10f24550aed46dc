"""Process-level settings: the start-up heap leaves the collector's scans; young collections are rarer."""

from __future__ import annotations

import gc
import weakref

from service.runtime import YOUNG_THRESHOLD, collect_young_less_often, freeze_startup_objects


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the cyclic collector could ever free it


def test_objects_alive_at_start_up_are_frozen_and_garbage_is_collected_first() -> None:
    """Live objects move to the permanent generation (no longer scanned); garbage made before the freeze
    is collected, not frozen with them."""
    kept = _Node()
    garbage = _Node()
    gone = weakref.ref(garbage)
    del garbage
    try:
        frozen = freeze_startup_objects()
        assert frozen > 0
        assert gc.get_freeze_count() == frozen
        tracked = {id(o) for o in gc.get_objects()}
        assert id(kept) not in tracked  # frozen: outside every generation the collector scans
        assert gone() is None  # collected before the freeze
    finally:
        gc.unfreeze()
    assert any(o is kept for o in gc.get_objects())


def test_young_collections_come_after_the_larger_threshold_and_still_free_cycles() -> None:
    before = gc.get_threshold()
    try:
        collect_young_less_often()
        assert gc.get_threshold() == (YOUNG_THRESHOLD, before[1], before[2])
        assert before[0] < YOUNG_THRESHOLD
        gc.collect()
        young = gc.get_stats()[0]["collections"]
        kept: list[list[int]] = [[] for _ in range(YOUNG_THRESHOLD // 2)]  # 5x the default's threshold
        assert gc.get_stats()[0]["collections"] == young  # no young collection under the threshold
        cycle = _Node()
        gone = weakref.ref(cycle)
        del cycle
        kept += [[] for _ in range(YOUNG_THRESHOLD)]  # past it: a young collection ran and freed the cycle
        assert gc.get_stats()[0]["collections"] > young
        assert gone() is None
    finally:
        gc.set_threshold(*before)
