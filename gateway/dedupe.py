"""Request ids seen in a bounded time window, shared by all carriers, and the answers to re-deliver.

An agent that fails over resends whatever it has not seen acknowledged, on another carrier, possibly
re-batched. The window answers "already accepted" for those, so no request is served twice; the response
cache lets the gateway answer a resend whose response went out on a carrier the agent has since left.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from dataclasses import dataclass


class RequestState(enum.Enum):
    PENDING = "pending"  # accepted, answer not yet sent
    DONE = "done"  # answered


@dataclass(slots=True)
class _Entry:
    state: RequestState
    expires: float


class DedupeWindow:
    """Bounded by time (``window_s``) and by count (``max_entries``, oldest evicted first, and counted)."""

    def __init__(self, window_s: float, max_entries: int) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._entries: dict[bytes, _Entry] = {}
        self._order: deque[tuple[float, bytes]] = deque()
        self.evicted_early = 0  # entries dropped by the count bound before their time: dedupe got weaker

    def __len__(self) -> int:
        return len(self._entries)

    def state(self, request_id: bytes, now: float) -> RequestState | None:
        entry = self._entries.get(request_id)
        if entry is None or entry.expires <= now:
            return None
        return entry.state

    def accept(self, request_id: bytes, now: float) -> None:
        """Record a newly accepted request as PENDING."""
        self._expire(now)
        while len(self._entries) >= self.max_entries and self._order:
            _, oldest = self._order.popleft()
            if self._entries.pop(oldest, None) is not None:
                self.evicted_early += 1
        self._entries[request_id] = _Entry(RequestState.PENDING, now + self.window_s)
        self._order.append((now + self.window_s, request_id))

    def done(self, request_id: bytes) -> None:
        entry = self._entries.get(request_id)
        if entry is not None:
            entry.state = RequestState.DONE

    def forget(self, request_id: bytes) -> None:
        """Drop an id so that a resend is served (used when queued work is handed back on drain)."""
        self._entries.pop(request_id, None)

    def _expire(self, now: float) -> None:
        order, entries = self._order, self._entries
        while order and order[0][0] <= now:
            expires, request_id = order.popleft()
            entry = entries.get(request_id)
            if entry is not None and entry.expires == expires:
                del entries[request_id]


class ResponseCache:
    """Serialized responses of recent requests, bounded in bytes (oldest dropped first)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[bytes, bytes] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def put(self, request_id: bytes, response: bytes) -> None:
        if len(response) > self.max_bytes:
            return
        old = self._items.pop(request_id, None)
        if old is not None:
            self._bytes -= len(old)
        self._items[request_id] = response
        self._bytes += len(response)
        while self._bytes > self.max_bytes:
            _, dropped = self._items.popitem(last=False)
            self._bytes -= len(dropped)

    def get(self, request_id: bytes) -> bytes | None:
        return self._items.get(request_id)
