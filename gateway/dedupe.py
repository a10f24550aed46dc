"""Request ids seen in a bounded time window, shared by all carriers, and the answers to re-deliver.

An agent that fails over resends whatever it has not seen acknowledged, on another carrier, possibly
re-batched. The window answers "already accepted" for those, so no request is served twice; the response
cache lets the gateway answer a resend whose response went out on a carrier the agent has since left.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque


class RequestState(enum.Enum):
    PENDING = "pending"  # accepted, answer not yet sent
    DONE = "done"  # answered


class DedupeWindow:
    """Bounded by time (``window_s``) and by count (``max_entries``, oldest evicted first, and counted).

    Kept small because it holds every id of the last ``window_s`` (millions at full rate): one dict entry
    (id -> expiry time, negated once the request is answered) and one deque slot per id, about 150 bytes
    with the 16-byte id itself. Expiry times only grow (a monotonic clock plus a fixed window), so the
    deque in acceptance order is also in expiry order.
    """

    def __init__(self, window_s: float, max_entries: int) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._entries: dict[bytes, float] = {}  # id -> expiry; negative: answered (DONE)
        self._order: deque[bytes] = deque()  # ids in acceptance order; a forgotten, resent id may recur
        self.evicted_early = 0  # entries dropped by the count bound before their time: dedupe got weaker

    def __len__(self) -> int:
        return len(self._entries)

    def state(self, request_id: bytes, now: float) -> RequestState | None:
        expires = self._entries.get(request_id)
        if expires is None or abs(expires) <= now:
            return None
        return RequestState.DONE if expires < 0 else RequestState.PENDING

    def accept(self, request_id: bytes, now: float) -> None:
        """Record a newly accepted request as PENDING."""
        self._expire(now)
        entries, order = self._entries, self._order
        while len(entries) >= self.max_entries and order:
            if entries.pop(order.popleft(), None) is not None:
                self.evicted_early += 1
        entries[request_id] = now + self.window_s
        order.append(request_id)

    def accept_many(self, request_ids: list[bytes], now: float) -> None:
        """:meth:`accept` for each of ``request_ids`` in turn, with the one expiry pass they share."""
        self._expire(now)
        entries, order, limit = self._entries, self._order, self.max_entries
        expires = now + self.window_s
        if len(entries) + len(request_ids) <= limit:  # room for every one: nothing to evict on the way
            entries.update(dict.fromkeys(request_ids, expires))
            order.extend(request_ids)
            return
        for request_id in request_ids:
            while len(entries) >= limit and order:
                if entries.pop(order.popleft(), None) is not None:
                    self.evicted_early += 1
            entries[request_id] = expires
            order.append(request_id)

    def done(self, request_id: bytes) -> None:
        expires = self._entries.get(request_id)
        if expires is not None and expires > 0:
            self._entries[request_id] = -expires

    def done_many(self, request_ids: list[bytes]) -> None:
        """:meth:`done` for each of ``request_ids``."""
        entries = self._entries
        for request_id in request_ids:
            expires = entries.get(request_id)
            if expires is not None and expires > 0:
                entries[request_id] = -expires

    def forget(self, request_id: bytes) -> None:
        """Drop an id so that a resend is served (used when queued work is handed back on drain)."""
        self._entries.pop(request_id, None)

    def _expire(self, now: float) -> None:
        order, entries = self._order, self._entries
        while order:
            expires = entries.get(order[0])
            if expires is not None and abs(expires) > now:
                return  # the oldest live id has not expired: neither has anything after it
            entries.pop(order.popleft(), None)


ENTRY_BYTES = 190
"""What a cached response costs beyond its own bytes (measured with tracemalloc: the 16-byte id as a bytes
object, the response's bytes header and the ordered dict's entry): counted, so ``max_bytes`` bounds the
cache's memory, not only its payload (~190 bytes a response more, a quarter of a typical ranking answer)."""


class ResponseCache:
    """Serialized responses of recent requests, bounded in bytes of memory (oldest dropped first)."""

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
        cost = len(response) + ENTRY_BYTES
        if cost > self.max_bytes:
            return
        old = self._items.pop(request_id, None)
        if old is not None:
            self._bytes -= len(old) + ENTRY_BYTES
        self._items[request_id] = response
        self._bytes += cost
        while self._bytes > self.max_bytes:
            _, dropped = self._items.popitem(last=False)
            self._bytes -= len(dropped) + ENTRY_BYTES

    def put_many(self, request_ids: list[bytes], responses: list[bytes]) -> None:
        """:meth:`put` for each pair in turn, the bound applied once at the end (the same entries stay)."""
        items, limit = self._items, self.max_bytes
        added = 0
        for request_id, response in zip(request_ids, responses, strict=True):
            cost = len(response) + ENTRY_BYTES
            if cost > limit:
                continue
            old = items.pop(request_id, None)
            if old is not None:
                added -= len(old) + ENTRY_BYTES
            items[request_id] = response
            added += cost
        self._bytes += added
        while self._bytes > limit:
            _, dropped = items.popitem(last=False)
            self._bytes -= len(dropped) + ENTRY_BYTES

    def get(self, request_id: bytes) -> bytes | None:
        return self._items.get(request_id)
