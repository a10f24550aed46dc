"""Requests waiting for a frame to Hong Kong, and the choice of what the next frame carries."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from edge_agent.uplink.outstanding import OutstandingTable
from edgewire import pb


@dataclass(slots=True)
class NextFrame:
    """What ``SendQueue.take`` chose: requests for one frame, ids past their deadline, and, when nothing
    can go, how long until something may (a retry-after running out)."""

    requests: list[pb.InferRequest] = field(default_factory=list)
    expired: list[bytes] = field(default_factory=list)
    wait_s: float | None = None


class SendQueue:
    """Ids in the order they are to be sent; an id no longer outstanding is skipped when met."""

    def __init__(self) -> None:
        self._ids: list[bytes] = []

    def __len__(self) -> int:
        return len(self._ids)

    def __bool__(self) -> bool:
        return bool(self._ids)

    def push(self, ids: Iterable[bytes]) -> None:
        self._ids.extend(ids)

    def push_front(self, ids: Iterable[bytes]) -> None:
        """Put back a frame's requests that did not go out: they keep their place ahead of the rest."""
        self._ids[:0] = list(ids)

    def take(
        self,
        table: OutstandingTable,
        now: float,
        wall_us: int,
        max_records: int,
        max_bytes: int,
        idle_wait_s: float,
    ) -> NextFrame:
        """Up to ``max_records`` requests (and about ``max_bytes``: the one crossing it still goes) whose
        retry-after has passed, in queue order; the rest stay queued. ``idle_wait_s`` is the wait when
        nothing is held back by a retry-after."""
        chosen = NextFrame()
        size = 0
        rest: list[bytes] = []
        for rid in self._ids:
            entry = table.get(rid)
            if entry is None:
                continue
            if entry.not_before > now or len(chosen.requests) >= max_records or size >= max_bytes:
                rest.append(rid)
                continue
            if entry.request.deadline_unix_us and entry.request.deadline_unix_us <= wall_us:
                chosen.expired.append(rid)
                continue
            chosen.requests.append(entry.request)
            size += entry.request.ByteSize()
        self._ids = rest
        if not chosen.requests:
            waits = [e.not_before - now for r in rest if (e := table.get(r)) is not None]
            chosen.wait_s = min(waits, default=idle_wait_s)
        return chosen
