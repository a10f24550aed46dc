"""Answers for local callers that could not take them: kept, bounded, until their deadline.

An answer is parked when the send to its caller fails: the caller is not connected (it is reconnecting,
or its process restarts; the intake's ROUTER reports an unknown routing id) or not reading (its queue is
full). It is handed over when the same caller, by its identity, sends that request again, which
``EdgeClient`` does for every request it still waits for as soon as it has reconnected. Parked answers
live in memory only: one the agent loses in a restart is asked of Hong Kong again when the caller resends
the request, and the gateway answers it from its response cache (docs/AGENT.md section 9).

Bounded by count and by bytes (the oldest parked answer makes room for a new one) and by time (an answer
is kept until its request's deadline plus ``GRACE_S``, the time ``EdgeClient`` waits past it); every
answer dropped unclaimed is counted by reason.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal, get_args

from edge_agent.deadlines import DeadlineHeap
from edgewire import now_unix_us, pb

ParkedDropReason = Literal["expired", "full"]
"""Why a parked answer was dropped unclaimed: its deadline (plus grace) passed, or it made room."""
PARKED_DROP_REASONS: Final[tuple[ParkedDropReason, ...]] = get_args(ParkedDropReason)

GRACE_S: Final = 2.0
"""Kept this long past the request's deadline: ``EdgeClient`` waits for an answer until then."""
UNKNOWN_DEADLINE_S: Final = 10.0
"""Kept this long when the request's deadline is not known here (an answer of the local tier)."""
ENTRY_BYTES: Final = 200
"""What a parked answer costs beyond its serialized size (the entry, its heap slot, the message object):
counted, so ``max_bytes`` bounds memory rather than payload alone."""


@dataclass(frozen=True, slots=True)
class _Parked:
    caller: bytes
    response: pb.InferResponse
    cost: int


class ParkedAnswers:
    """Answers by request id, each for one caller, until claimed, expired or evicted.

    ``max_answers`` and ``max_bytes`` bound what is held (oldest evicted first, counted ``full``); an
    answer expires at its deadline plus ``GRACE_S`` (counted ``expired``, at the next ``purge``, ``park``
    or ``claim``). ``clock`` is unix microseconds, the unit of request deadlines.
    """

    def __init__(self, max_answers: int, max_bytes: int, *, clock: Callable[[], int] = now_unix_us) -> None:
        if max_answers < 1 or max_bytes < 1:
            raise ValueError("max_answers and max_bytes must be positive")
        self.max_answers = max_answers
        self.max_bytes = max_bytes
        self._clock = clock
        self._held: OrderedDict[bytes, _Parked] = OrderedDict()  # request id -> answer, oldest first
        self._expiry: DeadlineHeap[bytes] = DeadlineHeap()  # request id -> unix microseconds
        self._bytes = 0
        self.parked = 0  # answers parked so far
        self.claimed = 0  # of those, handed to their caller
        self.dropped: Counter[ParkedDropReason] = Counter(dict.fromkeys(PARKED_DROP_REASONS, 0))

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    @property
    def nbytes(self) -> int:
        """What the held answers cost, as ``max_bytes`` counts it."""
        return self._bytes

    def park(self, caller: bytes, response: pb.InferResponse, deadline_unix_us: int = 0) -> None:
        """Keep ``response`` for ``caller`` until its request's deadline (0 = not known) plus the grace."""
        now = self._clock()
        self.purge(now)
        rid = response.request_id
        self._discard(rid)
        expires = (deadline_unix_us or now + int(UNKNOWN_DEADLINE_S * 1e6)) + int(GRACE_S * 1e6)
        self.parked += 1
        if expires <= now:
            self.dropped["expired"] += 1
            return
        cost = response.ByteSize() + ENTRY_BYTES
        if cost > self.max_bytes:
            self.dropped["full"] += 1
            return
        while self._held and (len(self._held) >= self.max_answers or self._bytes + cost > self.max_bytes):
            oldest = next(iter(self._held))
            self._discard(oldest)
            self.dropped["full"] += 1
        self._held[rid] = _Parked(caller, response, cost)
        self._bytes += cost
        self._expiry.set(rid, expires)

    def claim(self, caller: bytes, request_id: bytes) -> pb.InferResponse | None:
        """The answer parked for ``caller`` under ``request_id``, now handed over; None when there is none
        (or it is another caller's, which stays parked)."""
        self.purge()
        parked = self._held.get(request_id)
        if parked is None or parked.caller != caller:
            return None
        self._discard(request_id)
        self.claimed += 1
        return parked.response

    def purge(self, now_unix_us: int | None = None) -> int:
        """Drop the answers whose deadline plus grace has passed; returns how many."""
        now = self._clock() if now_unix_us is None else now_unix_us
        expired = [rid for rid in self._expiry.pop_due(now) if self._discard(rid)]
        self.dropped["expired"] += len(expired)
        return len(expired)

    def next_expiry_us(self) -> float | None:
        """When the next held answer expires (unix microseconds), or None when none is held."""
        return self._expiry.next_due()

    def _discard(self, request_id: bytes) -> bool:
        parked = self._held.pop(request_id, None)
        if parked is None:
            return False
        self._bytes -= parked.cost
        self._expiry.discard(request_id)
        return True
