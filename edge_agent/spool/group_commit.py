"""``GroupCommit``: callers await the fsync that covers their appends; the fsync runs on a thread and
the callers that arrive during one share the next."""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor

from edge_agent.spool.store import Spool


class GroupCommit:
    """``await commit()`` returns once everything appended to the spool before the call is on disk.

    The fsync runs on a thread of its own, so the event loop keeps serving (pings, acks, answers) while
    the disk works; commits that arrive during one fsync share the next. On a disk that takes a
    millisecond per fsync, frames coming in faster than that cost one fsync per millisecond, not one
    each.
    """

    def __init__(self, spool: Spool) -> None:
        self._spool = spool
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spool-fsync")
        self._requested = 0  # commits asked for so far
        self._durable = 0  # every commit up to this number is on disk
        self._running: asyncio.Future[None] | None = None
        self._covers = 0  # the commits the running fsync covers
        # Commits up to this number were covered by an fsync that failed. They fail too, even if a later
        # fsync succeeds: after a write-back error Linux reports it once and may have dropped the dirty
        # pages, so a later success says nothing about their records.
        self._failed_through = 0
        self._error: OSError | None = None
        self.fsyncs = 0

    async def commit(self) -> None:
        """Raises OSError when the fsync that would cover this call failed."""
        self._requested += 1
        mine = self._requested
        while self._durable < mine:
            if mine <= self._failed_through:
                assert self._error is not None
                raise OSError(self._error.errno, f"spool fsync failed: {self._error.strerror or self._error}")
            running = self._running
            if running is not None and running.done():
                # Finished, its callbacks not run yet (they run a loop step later): settle it here,
                # or this loop would await the finished future forever without yielding.
                self._settle(running)
                continue
            if running is not None:
                # Started before this call's appends, maybe: wait for it, then look again.
                with contextlib.suppress(Exception):
                    await asyncio.shield(running)
                continue
            work = self._spool.begin_sync()
            running = self._running = asyncio.get_running_loop().run_in_executor(self._thread, work)
            self._covers = self._requested
            running.add_done_callback(self._settle)
            self.fsyncs += 1
            with contextlib.suppress(Exception):
                await asyncio.shield(running)  # covers this call: its outcome is read at the loop's top

    def _settle(self, done: asyncio.Future[None]) -> None:
        if self._running is not done:
            return  # settled already
        self._running = None
        if done.cancelled():
            return
        error = done.exception()
        if error is None:
            self._durable = max(self._durable, self._covers)
        else:
            self._failed_through = max(self._failed_through, self._covers)
            self._error = error if isinstance(error, OSError) else OSError(str(error))

    def close(self) -> None:
        self._thread.shutdown(wait=False)
