"""Process-level settings: the start-up heap leaves the garbage collector's scans."""

from __future__ import annotations

import gc
import weakref

from service.runtime import freeze_startup_objects


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
