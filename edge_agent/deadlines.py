"""Keys that fall due at a time: a heap, so finding what expired costs what expired, not what is held.

The uplink keeps up to ``max_inflight`` (20k) requests outstanding and the spool every request not yet
accepted; both must find the few whose deadline has passed without looking at the rest. Removal is lazy
(a removed key's heap entry stays until it reaches the top), and the heap is rebuilt from the live keys
once stale entries outnumber them, so its size stays within twice the keys held (plus a small floor).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from typing import Final, Generic, TypeVar

K = TypeVar("K", bound=Hashable)

COMPACT_FLOOR: Final = 64
"""Below this many heap entries stale ones are left to surface on their own (a rebuild costs more)."""


class DeadlineHeap(Generic[K]):
    """Each key has one due time; ``pop_due(now)`` takes the keys due by ``now``, earliest first.

    ``set`` adds a key or moves it (the old time no longer counts); ``discard`` forgets it. Every
    operation is O(log n) amortised; ``pop_due`` is O(k log n) for the k keys it returns.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, K]] = []
        self._due: dict[K, tuple[float, int]] = {}  # key -> (due, sequence of its live heap entry)
        self._sequence = 0

    def __len__(self) -> int:
        return len(self._due)

    def __contains__(self, key: object) -> bool:
        return key in self._due

    @property
    def heap_size(self) -> int:
        """Heap entries, stale ones included (bounded: see the module docstring)."""
        return len(self._heap)

    def due(self, key: K) -> float | None:
        """The key's due time, or None when it is not held."""
        entry = self._due.get(key)
        return None if entry is None else entry[0]

    def set(self, key: K, due: float) -> None:
        """Hold ``key`` until ``due`` (replacing any earlier time for it)."""
        self._sequence += 1
        self._due[key] = (due, self._sequence)
        heapq.heappush(self._heap, (due, self._sequence, key))
        self._compact_if_stale()

    def discard(self, key: K) -> None:
        """Forget ``key`` (nothing happens when it is not held)."""
        if self._due.pop(key, None) is not None:
            self._compact_if_stale()

    def next_due(self) -> float | None:
        """The earliest due time held, or None when empty."""
        self._drop_stale_top()
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> list[K]:
        """Remove and return every key due at or before ``now``, earliest first."""
        out: list[K] = []
        heap, live = self._heap, self._due
        while heap and heap[0][0] <= now:
            due, sequence, key = heapq.heappop(heap)
            if live.get(key) == (due, sequence):
                del live[key]
                out.append(key)
        return out

    def _drop_stale_top(self) -> None:
        heap, live = self._heap, self._due
        while heap and live.get(heap[0][2]) != heap[0][:2]:
            heapq.heappop(heap)

    def _compact_if_stale(self) -> None:
        if len(self._heap) > COMPACT_FLOOR and len(self._heap) > 2 * len(self._due):
            self._heap = [(due, sequence, key) for key, (due, sequence) in self._due.items()]
            heapq.heapify(self._heap)
