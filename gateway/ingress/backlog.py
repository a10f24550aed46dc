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
really cost. The backlog is worked off in turns of its own on the loop, in arrival order, one frame at
least and then frames for up to ``budget_s``, between the reader's turns and the batchers' passes.
Bounded by frames and by bytes: a frame arriving at a full backlog waits after its oldest frames have been
served to make room (arrival order kept; the reader's turn then ends on its time budget as before the
backlog, and the rest waits in ZeroMQ, whose high-water marks push back on the agents).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Backlog(Generic[T]):
    """Items waiting for a turn of ``serve`` on the event loop, oldest first; ``failed`` is told of an item
    whose ``serve`` raised (the rest go on)."""

    def __init__(
        self,
        serve: Callable[[T], None],
        failed: Callable[[T, Exception], None],
        max_items: int,
        max_bytes: int,
        budget_s: float,
    ) -> None:
        self._serve = serve
        self._failed = failed
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._budget_s = budget_s
        self._items: deque[tuple[T, int]] = deque()
        self.bytes = 0
        self._scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return len(self._items)

    def offer(self, item: T, nbytes: int) -> bool:
        """Queue ``item`` (holding ``nbytes``) for a turn, after serving the oldest items now as long as the
        backlog is full (arrival order kept: a full backlog serves as the reader reads, as before there was
        one); False when the backlog is off (``max_items`` or ``max_bytes`` 0): the caller serves it now."""
        if self.max_items <= 0 or self.max_bytes <= 0:
            return False
        while self._items and (
            len(self._items) >= self.max_items or self.bytes + nbytes > self.max_bytes
        ):  # a lone item larger than max_bytes still waits when nothing else does
            self._serve_next()
        if not self._scheduled:
            if self._loop is None or self._loop.is_closed():
                self._loop = asyncio.get_running_loop()
            self._loop.call_soon(self._turn)
            self._scheduled = True
        self._items.append((item, nbytes))
        self.bytes += nbytes
        return True

    def _turn(self) -> None:
        """Serve the oldest item, then more while the turn's budget lasts; another turn if any are left
        (also when serving one raised past ``failed``)."""
        self._scheduled = False
        until = time.monotonic() + self._budget_s
        try:
            while self._items:
                self._serve_next()
                if time.monotonic() >= until:
                    break
        finally:
            if self._items and self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon(self._turn)
                self._scheduled = True

    def _serve_next(self) -> None:
        item, nbytes = self._items.popleft()
        self.bytes -= nbytes
        try:
            self._serve(item)
        except Exception as exc:  # noqa: BLE001  (handed to ``failed``, which counts and logs it)
            self._failed(item, exc)

    def serve_all(self) -> int:
        """Serve every item waiting now, at once (the drain: what was read before it is answered); how
        many."""
        served = 0
        while self._items:
            self._serve_next()
            served += 1
        return served

    def close(self) -> int:
        """Forget every item waiting (unacknowledged: their agents send them again) and take no more (an
        offer is refused: served at once); how many were forgotten."""
        dropped = len(self._items)
        self._items.clear()
        self.bytes = 0
        self.max_items = 0
        return dropped
