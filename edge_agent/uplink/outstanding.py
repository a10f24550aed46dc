"""What the uplink owes its callers: every request sent to Hong Kong until its answer or its deadline.

Per request: whether the gateway accepted it (and in which gateway epoch), the carrier and frame it was
last sent in, how often it was sent, and the retry-after of a retryable refusal. Per frame not yet
acknowledged: its carrier, its requests and when its Ack is overdue. Deadlines and Ack timeouts are held
in heaps (``edge_agent.deadlines``), so finding what is due costs what is due, however much is held.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from edge_agent.deadlines import DeadlineHeap
from edgewire import pb


@dataclass(slots=True)
class Outstanding:
    """One request sent (or about to be sent) to Hong Kong, not answered yet."""

    request: pb.InferRequest
    raw: bytes = b""  # the request serialized, as frames carry it (``request`` is not changed once held)
    accepted: bool = False
    epoch: int = 0  # gateway epoch when accepted
    frame: bytes = b""  # message id of the frame it was last sent in
    carrier: str = ""  # the carrier it was last sent on
    attempts: int = 0
    not_before: float = 0.0  # retry-after of a retryable nack
    held: bool = False  # sent and not yet answered, refused or given up: counted in the send window
    sent_at: float = 0.0  # when it was last sent (monotonic)


@dataclass(slots=True)
class SentFrame:
    """A request frame sent and not acknowledged yet."""

    message_id: bytes
    carrier: str
    ids: list[bytes]
    sent_at: float


class OutstandingTable:
    """Requests owed an answer, frames owed an Ack, and the ids answered recently (a reused id).

    ``answered_window`` bounds the ids remembered after their answer (oldest forgotten first).
    """

    def __init__(self, answered_window: int) -> None:
        self._entries: OrderedDict[bytes, Outstanding] = OrderedDict()
        self._answered: OrderedDict[bytes, bool] = OrderedDict()  # id -> closed by its deadline
        self._answered_window = answered_window
        self._expiry: DeadlineHeap[bytes] = DeadlineHeap()  # request id -> deadline, unix microseconds
        self._frames: dict[bytes, SentFrame] = {}
        self._ack_due: DeadlineHeap[bytes] = DeadlineHeap()  # message id -> monotonic time
        self.held = 0  # entries with ``held`` set: what the gateway may be holding of ours
        self.held_realtime = 0  # of them, realtime requests (the send window's realtime reserve)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def __iter__(self) -> Iterator[tuple[bytes, Outstanding]]:
        return iter(list(self._entries.items()))

    def get(self, request_id: bytes) -> Outstanding | None:
        return self._entries.get(request_id)

    def knows(self, request_id: bytes) -> bool:
        """True while the id is outstanding or was answered recently."""
        return request_id in self._entries or request_id in self._answered

    def add(self, request: pb.InferRequest, raw: bytes | None = None) -> bool:
        """Owe ``request`` an answer (``raw``: it serialized, when made already); False (nothing changes)
        when its id is already known."""
        rid = request.request_id
        if self.knows(rid):
            return False
        self._entries[rid] = Outstanding(request, request.SerializeToString() if raw is None else raw)
        if request.deadline_unix_us:
            self._expiry.set(rid, request.deadline_unix_us)
        return True

    def close(self, request_id: bytes, *, expired: bool = False) -> Outstanding | None:
        """The request is answered (or given up; ``expired``: its deadline passed first): no longer owed,
        remembered as answered."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return None
        self.release(entry)
        self._expiry.discard(request_id)
        self._answered[request_id] = expired
        while len(self._answered) > self._answered_window:
            self._answered.popitem(last=False)
        return entry

    def expired_unanswered(self, request_id: bytes) -> bool:
        """True when the id was closed recently because its deadline passed before an answer came."""
        return self._answered.get(request_id, False)

    def expired(self, wall_us: int) -> list[bytes]:
        """Ids outstanding whose deadline is at or before ``wall_us`` (they stay until ``close``)."""
        return [rid for rid in self._expiry.pop_due(wall_us) if rid in self._entries]

    def next_expiry_us(self) -> float | None:
        return self._expiry.next_due()

    def accepted_by(self, epochs: set[int], on: set[str] | None = None) -> list[bytes]:
        """Accepted, unanswered ids accepted in one of the gateway ``epochs`` (and last sent on a carrier
        in ``on``, when given). A scan of every entry: for a lost carrier or a gateway restart, not per
        message."""
        return [
            rid
            for rid, e in self._entries.items()
            if e.accepted and e.epoch in epochs and (on is None or e.carrier in on)
        ]

    def sent(self, frame: SentFrame, ack_timeout_s: float) -> None:
        """A frame went out: its requests point at it, its Ack is due ``ack_timeout_s`` later."""
        for rid in frame.ids:
            entry = self._entries[rid]
            entry.frame = frame.message_id
            entry.carrier = frame.carrier
            entry.sent_at = frame.sent_at
            if not entry.held:
                entry.held = True
                self.held += 1
                if entry.request.priority == pb.PRIORITY_CLASS_REALTIME:
                    self.held_realtime += 1
        self._frames[frame.message_id] = frame
        self._ack_due.set(frame.message_id, frame.sent_at + ack_timeout_s)

    def release(self, entry: Outstanding) -> bool:
        """The gateway no longer holds ``entry`` (answered, refused, or to be sent again); True when it
        was counted as held."""
        if not entry.held:
            return False
        entry.held = False
        self.held -= 1
        if entry.request.priority == pb.PRIORITY_CLASS_REALTIME:
            self.held_realtime -= 1
        return True

    def acked(self, message_id: bytes) -> SentFrame | None:
        """The frame's Ack came (or it is given up): no longer waited for."""
        self._ack_due.discard(message_id)
        return self._frames.pop(message_id, None)

    def frames_on(self, carrier: str) -> list[SentFrame]:
        """Take every unacknowledged frame sent on ``carrier`` (it died or was removed)."""
        taken = [f for f in self._frames.values() if f.carrier == carrier]
        for frame in taken:
            self.acked(frame.message_id)
        return taken

    def overdue_frames(self, now: float) -> list[SentFrame]:
        """Take the frames whose Ack is overdue at ``now``."""
        return [f for m in self._ack_due.pop_due(now) if (f := self._frames.pop(m, None)) is not None]

    def next_ack_due(self) -> float | None:
        return self._ack_due.next_due()

    def unaccepted(self, ids: list[bytes]) -> list[bytes]:
        """Those of ``ids`` still outstanding and not accepted by the gateway."""
        out = []
        for rid in ids:
            entry = self._entries.get(rid)
            if entry is not None and not entry.accepted:
                out.append(rid)
        return out
