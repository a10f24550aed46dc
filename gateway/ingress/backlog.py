"""Request frames read now and served in turns, so a realtime frame is never read behind a batch of them.

A carrier's ROUTER hands the loop one message at a time, fair-queued across connections: one message per
connection in turn, whatever each holds. Served as they are read, a frame of 100 batch requests costs the
loop about a millisecond to decode, screen, route and queue, and the next reader turn comes after the
batchers' passes: one agent loading the gateway with such frames got one read for each lone realtime
frame of another agent's, at about 250 turns a second, so realtime frames sent at 500/s queued in
ZeroMQ, unread, and waited 1.1-1.3 s at p50 and 2.1-2.6 s at p99 (bench/realtime_under_load.py; the
gateway's own part of those requests, from their decode to their reply, stayed under 3 ms); with the
backlog, 6-7 ms and 12-25 ms.

So the reader takes every request frame whose envelope does not say realtime into this backlog once its
envelope and identity have passed (microseconds), and goes on reading: a realtime frame, a Ping, a
DictionaryRequest is served as it is read. The agent's cost budget is applied when a frame's turn comes,
right before its decode, as before the backlog: each frame is admitted against what the ones before it
really cost. The backlog is worked off in turns of its own on the loop, one frame at least and then frames
for up to ``budget_s``, between the reader's turns and the batchers' passes: each agent's frames in the
order they were read, the agents sharing the turns by the work of their frames (deficit round robin,
:data:`QUANTUM` a round), so an agent with hundreds of frames waiting (a wide send window, a burst after a
failover) delays another agent's frame by about one round, not by all of its own; a round robin of frames
is not enough: an agent of small frames gets one per large frame of the other, whatever its rate (one
agent's 64 frames of 100 in flight held another's lone interactive requests 243 ms at p50 first come first
served, 1.35 s by frames, 12.6 ms by work in rounds of 64 KiB, 8.4 ms in rounds of :data:`QUANTUM`:
bench/realtime_under_load.py --lone interactive).
Bounded by frames and by bytes: a frame arriving at a full backlog waits after the oldest frames of the
agent holding the most have been served to make room (the flood pays for its room, not the agent that
arrives next; the reader's turn then ends on its time budget as before the backlog, and the rest waits in
ZeroMQ, whose high-water marks push back on the agents).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Final, Generic, TypeVar

T = TypeVar("T")


QUANTUM: Final = 8 * 1024
"""Work (bytes) each owner with items waiting may have served per round of the owners: a frame of 100
requests is ~20-200 KB decompressed, one lone request 1-3 KB (its work ~5 KB with ``FRAME_WORK_BYTES``).
A lone request's frame is served in its first round; a large frame waits several, so an agent that
arrives behind a flood waits for the frame being served, not for what is left of the flood's credit
(64 KiB let a flood's frame or two go first: the gateway's part of a lone interactive request beside a
flood, p50 6.5 -> 4.1 ms, bench/realtime_under_load.py --lone interactive)."""


class Backlog(Generic[T]):
    """Items waiting for a turn of ``serve`` on the event loop: each owner's (an agent's) oldest first, the
    owners sharing the turns by the work of their items (deficit round robin over their ``work``: an owner
    of small items gets as many of them served as another owner's large one costs); ``failed`` is told of
    an item whose ``serve`` raised (the rest go on)."""

    def __init__(
        self,
        serve: Callable[[T], None],
        failed: Callable[[T, Exception], None],
        max_items: int,
        max_bytes: int,
        budget_s: float,
        quantum: int = QUANTUM,
    ) -> None:
        self._serve = serve
        self._failed = failed
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._budget_s = budget_s
        self._quantum = quantum
        self._waiting: dict[str, deque[tuple[T, int, int]]] = {}  # by owner, oldest first: item, bytes, work
        self._owned_bytes: dict[str, int] = {}
        self._credit: dict[str, int] = {}  # work an owner may still have served in this round
        self._turns: deque[str] = deque()  # the owners with items waiting, the one being served first
        self._count = 0
        self.bytes = 0
        self._scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return self._count

    @property
    def owners(self) -> int:
        """How many owners have items waiting."""
        return len(self._turns)

    def offer(self, item: T, nbytes: int, owner: str = "", work: int | None = None) -> bool:
        """Queue ``item`` (holding ``nbytes``, of ``owner``, costing ``work`` to serve: ``nbytes`` unless
        said) for a turn, after serving now, while the backlog is full, the oldest item of the owner holding
        the most (a flood pays for its own room, whoever offers); False when the backlog is off
        (``max_items`` or ``max_bytes`` 0): the caller serves it now."""
        if self.max_items <= 0 or self.max_bytes <= 0:
            return False
        while self._count and (self._count >= self.max_items or self.bytes + nbytes > self.max_bytes):
            # a lone item larger than max_bytes still waits when nothing else does
            self._serve_item(self._heaviest(by_bytes=self._count < self.max_items))
        if not self._scheduled:
            if self._loop is None or self._loop.is_closed():
                self._loop = asyncio.get_running_loop()
            self._loop.call_soon(self._turn)
            self._scheduled = True
        waiting = self._waiting.get(owner)
        if waiting is None:
            waiting = self._waiting[owner] = deque()
            self._owned_bytes[owner] = 0
            self._credit[owner] = 0
            self._turns.append(owner)
        waiting.append((item, nbytes, nbytes if work is None else work))
        self._owned_bytes[owner] += nbytes
        self._count += 1
        self.bytes += nbytes
        return True

    def _heaviest(self, *, by_bytes: bool) -> str:
        """The owner holding the most items (or bytes); of equals, the one whose turn is nearest."""
        if by_bytes:
            return max(self._turns, key=self._owned_bytes.__getitem__)
        return max(self._turns, key=lambda owner: len(self._waiting[owner]))

    def _turn(self) -> None:
        """Serve the next item, then more while the turn's budget lasts; another turn if any are left
        (also when serving one raised past ``failed``)."""
        self._scheduled = False
        until = time.monotonic() + self._budget_s
        try:
            while self._count:
                self._serve_next()
                if time.monotonic() >= until:
                    break
        finally:
            if self._count and self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon(self._turn)
                self._scheduled = True

    def _serve_next(self) -> None:
        """Serve the oldest item of the owner in line whose credit covers its work; an owner whose credit
        does not is given another quantum and goes to the back of the line."""
        turns, credit = self._turns, self._credit
        while True:
            owner = turns[0]
            work = self._waiting[owner][0][2]
            if credit[owner] >= work:
                credit[owner] -= work
                self._serve_item(owner)
                return
            credit[owner] += self._quantum
            turns.rotate(-1)

    def _serve_item(self, owner: str) -> None:
        """Serve the oldest item of ``owner`` (an owner left with none leaves the line and its credit)."""
        waiting = self._waiting[owner]
        item, nbytes, _ = waiting.popleft()
        self._count -= 1
        self.bytes -= nbytes
        if waiting:
            self._owned_bytes[owner] -= nbytes
        else:
            del self._waiting[owner], self._owned_bytes[owner], self._credit[owner]
            self._turns.remove(owner)  # mostly the first in line
        try:
            self._serve(item)
        except Exception as exc:  # noqa: BLE001  (handed to ``failed``, which counts and logs it)
            self._failed(item, exc)

    def serve_all(self) -> int:
        """Serve every item waiting now, at once, owners sharing as in turns (the drain: what was read
        before it is answered); how many."""
        served = 0
        while self._count:
            self._serve_next()
            served += 1
        return served

    def close(self) -> int:
        """Forget every item waiting (unacknowledged: their agents send them again) and take no more (an
        offer is refused: served at once); how many were forgotten."""
        dropped = self._count
        self._waiting.clear()
        self._owned_bytes.clear()
        self._credit.clear()
        self._turns.clear()
        self._count = 0
        self.bytes = 0
        self.max_items = 0
        return dropped
