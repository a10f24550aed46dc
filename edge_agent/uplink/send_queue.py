"""Requests waiting for a frame to Hong Kong, and the choice of what the next frame carries."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from edge_agent.uplink.outstanding import Outstanding, OutstandingTable
from edgewire import pb

LANES = (pb.PRIORITY_CLASS_REALTIME, pb.PRIORITY_CLASS_INTERACTIVE, pb.PRIORITY_CLASS_BATCH)
"""Most urgent first; a request without a class goes with interactive (the frame's default)."""


@dataclass(slots=True)
class NextFrame:
    """What ``SendQueue.take`` chose: the outstanding entries for one frame, ids past their deadline, and,
    when nothing can go, how long until something may (a retry-after running out)."""

    entries: list[Outstanding] = field(default_factory=list)
    expired: list[bytes] = field(default_factory=list)
    wait_s: float | None = None

    @property
    def requests(self) -> list[pb.InferRequest]:
        """The chosen entries' requests."""
        return [e.request for e in self.entries]


class SendQueue:
    """Ids to be sent, one lane per priority class, most urgent first and in arrival order within a lane:
    when the send window holds a backlog back (after a gateway restart), a realtime request does not wait
    behind it. Ids waiting out a retry-after are set aside until it runs out; an id no longer outstanding
    is skipped when met."""

    def __init__(self) -> None:
        self._lanes: dict[int, deque[bytes]] = {lane: deque() for lane in LANES}
        self._later: list[tuple[float, int, bytes]] = []  # (not before, order, id): a retry-after
        self._order = itertools.count()

    @property
    def realtime_waiting(self) -> bool:
        """Whether a realtime request is queued (not counting those waiting out a retry-after)."""
        return bool(self._lanes[pb.PRIORITY_CLASS_REALTIME])

    def __len__(self) -> int:
        return sum(len(lane) for lane in self._lanes.values()) + len(self._later)

    def __bool__(self) -> bool:
        return bool(self._later) or any(self._lanes.values())

    def _lane(self, table: OutstandingTable, rid: bytes) -> deque[bytes] | None:
        entry = table.get(rid)
        if entry is None:
            return None
        lane = self._lanes.get(entry.request.priority)
        return self._lanes[pb.PRIORITY_CLASS_INTERACTIVE] if lane is None else lane

    def push(self, table: OutstandingTable, ids: Iterable[bytes]) -> None:
        for rid in ids:
            lane = self._lane(table, rid)
            if lane is not None:
                lane.append(rid)

    def push_front(self, table: OutstandingTable, ids: Iterable[bytes]) -> None:
        """Put back a frame's requests that did not go out: they keep their place ahead of the rest."""
        for rid in reversed(list(ids)):
            lane = self._lane(table, rid)
            if lane is not None:
                lane.appendleft(rid)

    def take(
        self,
        table: OutstandingTable,
        now: float,
        wall_us: int,
        max_records: int,
        max_bytes: int,
        idle_wait_s: float,
        *,
        realtime_only: bool = False,
    ) -> NextFrame:
        """Up to ``max_records`` requests (and about ``max_bytes``: the one crossing it still goes) whose
        retry-after has passed, all of one class: the most urgent lane that has one; the rest stay queued
        for the next frames. One class per frame, so the envelope's priority is every request's: the gateway
        reads a realtime frame ahead of the batch frames read before it (its backlog), and a few realtime
        requests never make a frame of 100 batch ones realtime. ``idle_wait_s`` is the wait when nothing is
        queued or held back by a retry-after. ``realtime_only``: from the realtime lane or nothing (the
        send window's realtime reserve)."""
        while self._later and self._later[0][0] <= now:
            rid = heapq.heappop(self._later)[2]
            lane = self._lane(table, rid)
            if lane is not None:
                lane.appendleft(rid)  # older than what arrived meanwhile
        chosen = NextFrame()
        size = 0
        taken: set[bytes] = set()
        lanes = (self._lanes[pb.PRIORITY_CLASS_REALTIME],) if realtime_only else self._lanes.values()
        for lane in lanes:
            if chosen.entries:
                break
            while lane and len(chosen.entries) < max_records and size < max_bytes:
                rid = lane.popleft()
                entry = table.get(rid)
                if entry is None or rid in taken:
                    continue
                if entry.not_before > now:
                    heapq.heappush(self._later, (entry.not_before, next(self._order), rid))
                    continue
                if entry.request.deadline_unix_us and entry.request.deadline_unix_us <= wall_us:
                    chosen.expired.append(rid)
                    continue
                taken.add(rid)
                chosen.entries.append(entry)
                size += len(entry.raw)
        if not chosen.entries:
            chosen.wait_s = self._later[0][0] - now if self._later else idle_wait_s
        return chosen
