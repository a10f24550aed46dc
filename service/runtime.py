"""Process-level settings for the long-running programs (hk-gateway, edge-agent)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Coroutine
from typing import Any, Final, TypeVar

T = TypeVar("T")

YOUNG_THRESHOLD: Final = 7_000
"""Container objects allocated (net of those freed) between two collections of the youngest generation:
ten times CPython's default of 700 (gateway/ops notes in docs/BENCHMARKS.md)."""


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

    What a served request leaves alive for a while (its dedupe and response cache entries, an answer
    waiting for its frame) counts as an allocation until it is freed: in frames of 100 the gateway's
    loop ran a young collection every ~1,300 records, and the young and middle collections cost it ~0.9
    us of CPU per record, ~2.5% (bench.lone_profile --frame 100, gc.callbacks). Each collection scans
    what is alive in the generation, so ten times fewer of them scan the survivors fewer times: ~0.3 us
    per record. A young collection then scans at most a few thousand objects (well under a millisecond);
    cyclic garbage waits that much longer to be freed. The older generations keep their thresholds.
    """
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
