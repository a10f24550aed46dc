"""Process-level settings for the long-running programs (hk-gateway, edge-agent)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Coroutine
from typing import Any, Final, TypeVar

T = TypeVar("T")

YOUNG_THRESHOLD: Final = 3_000
"""Container objects allocated (net of those freed) between two collections of the youngest generation:
about four times CPython's default of 700 (see :func:`collect_young_less_often`)."""


def run_main(main: Coroutine[Any, Any, T]) -> T:
    """Run the program's main coroutine on uvloop (faster socket and timer handling), or on asyncio's own
    loop where uvloop is not installed (it is optional off Linux)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def freeze_startup_objects() -> int:
    """Collect once, then move every object alive now to the garbage collector's permanent generation.

    After start-up the heap holds ~80k container objects that live as long as the process (modules,
    protobuf descriptors, numpy and ONNX Runtime bindings, the config, routing plans). Every full
    collection scans them all: ~40 ms with the event loop stopped, a stall every realtime request in
    flight waits out. Frozen, they are never scanned again and a full collection of what requests leave
    behind takes about a millisecond (measured on the gateway after a load run). Returns how many
    objects were frozen.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def collect_young_less_often() -> None:
    """Collect the youngest generation after :data:`YOUNG_THRESHOLD` net allocations instead of 700.

    A frame of 100 requests keeps a few hundred containers alive at once while it is served (work items,
    lists, answers), and 8 frames in flight crossed 700 every ~300 records: each young collection scanned
    them, and with the middle generation's cost ~0.5 us of the gateway loop's CPU per record, ~1.7%
    (bench.lone_profile --frame 100 with the start-up heap frozen, gc.callbacks timing the loop thread, per
    100k records: 360 young and 32 middle collections, 0.05 s). At 1,500: 43 and 4 (0.017 s); at 3,000:
    5 young (0.002 s); at 7,000: 1. Lone realtime requests make none at runtime either way. A young
    collection then scans at most a few thousand objects (well under a millisecond); garbage held in
    reference cycles waits that much longer to be freed, which 3,000 keeps to ~4x the default rather
    than the 10x of 7,000. The older generations keep their thresholds.
    """
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
