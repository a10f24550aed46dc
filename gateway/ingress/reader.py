"""Reading a plain (not zmq.asyncio) ZeroMQ socket from the event loop's reader callback.

A zmq.asyncio receive costs a Future, a task wake-up and several enum conversions per message, about as
much as decoding the message. ZMQ_FD is edge-triggered: it fires when the socket's state changed, not while
messages wait, and any send or ZMQEVENTS read on the socket may consume the edge. So the reader drains
until EAGAIN, a burst at a time, and every send on the socket schedules one more drain for the same tick
(:meth:`EdgeReader.schedule`). Used by the carriers' ROUTERs and by both ends of the shards' link.

At most one drain is pending at a time. Under a flood the FD fires on almost every loop iteration (each
batch of messages ZeroMQ's I/O thread hands over raises an edge), while the burst that ran out of time is
already queued to go on: draining on that edge too would put a second burst ahead of everything the
first one queued (the batchers' passes, answers, timers), and then a third, so that a request read in a
burst waited tens of milliseconds for its batch (measured: bench/budget_attack.py, a victim's p50 25 ms
behind a bomb flood, 4-5 ms with one drain pending).

A reader can be paused (:meth:`EdgeReader.pause`): nothing is read until the pause ends, then it drains.
The budget paces a held connection's flood this way (gateway/ingress/budget.py HeldReadPace).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import zmq

from edgewire.parts import recv_parts, waiting

READ_BUDGET_S = 0.0005
"""A wake-up reads messages for at most about this long (one frame of 100 requests may take longer: a
burst always reads at least one message), then lets everything else on the loop run: a burst of large
frames must not keep the CPU workers' answers, and so the workers, waiting, and a request read at the
start of a burst waits for its batcher's pass behind the rest of the burst. 0.5 ms rather than 2 ms: a
victim's p50 behind a full-rate bomb flood 1.9 ms instead of 4.7 ms (bench/budget_attack.py), while a
lone request's CPU stayed within noise (bench/frame_path.py, both orders). Fewer frames are read between
two passes of a batcher, so batches came out smaller in bench/frame_path.py (null backend): its cpu pool's
14.5 requests on average instead of 27, all then under ``inline_max_requests`` and run on the loop instead
of the CPU workers: the process tree's CPU per record 12% lower, the loop's 1-2.5 us higher, and so, the
batched run being bound by the loop, records/s 2-9% lower in three of four same-run comparisons (not
measured with a backend that takes time)."""


class EdgeReader:
    """Drains one socket on the loop; ``deliver`` gets each message, ``failed`` the error that stops it."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        deliver: Callable[[list[zmq.Frame]], None],
        failed: Callable[[zmq.ZMQError], None],
        max_messages: int,
    ) -> None:
        self._sock = sock
        self._deliver = deliver
        self._failed = failed
        self._max = max_messages
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False
        self._paused: asyncio.TimerHandle | None = None
        self.reading = False

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._sock.FD, self._readable)
        self.reading = True
        self.schedule()  # messages may have arrived before the reader was added (no edge for them)

    def stop(self) -> None:
        if self.reading and self._loop is not None:
            self._loop.remove_reader(self._sock.FD)
        self.reading = False
        if self._paused is not None:
            self._paused.cancel()
            self._paused = None

    def pause(self, seconds: float) -> None:
        """Read nothing for ``seconds`` (the burst under way stops after the message being delivered), then
        drain: a held connection's frames paced (gateway/ingress/budget.py HeldReadPace). Edges that fire
        meanwhile are not lost: the drain at the end reads whatever waits."""
        if self._paused is not None or self._loop is None or not self.reading:
            return
        self._paused = self._loop.call_later(seconds, self._resume)

    @property
    def paused(self) -> bool:
        return self._paused is not None

    def _resume(self) -> None:
        self._paused = None
        self.schedule()

    def schedule(self) -> None:
        """Drain once more this tick: after a send, or a ZMQEVENTS read, which may consume the edge."""
        if not self._scheduled and self._loop is not None and self.reading:
            self._loop.call_soon(self._read)
            self._scheduled = True  # after call_soon: a closed loop's raise leaves no edge muted

    def waiting_now(self) -> bool:
        """Whether a message waits on the socket now (ZMQ_EVENTS): asked after a send, and by a frame's
        handler before it serves a lone realtime request at once, so that requests arriving while a frame is
        handled still share a batch. Reading ZMQ_EVENTS may consume the FD's edge: what waits is drained
        this tick."""
        try:
            pending = waiting(self._sock)
        except zmq.ZMQError:
            pending = True  # the drain meets the error and says so
        if pending:
            self.schedule()
        return pending

    def after_send(self) -> None:
        """A send on the socket may have taken its FD's edge: drain this tick if a message waits. Asking
        ZMQ_EVENTS costs less than a drain scheduled to find nothing (most sends), and after it a message
        that arrives later raises an edge of its own."""
        if self._scheduled or not self.reading:
            return
        self.waiting_now()

    def _readable(self) -> None:
        """The FD fired: drain now, unless a drain is queued already (it reads what this edge announced)."""
        if not self._scheduled:
            self._read()

    def _read(self) -> None:
        self._scheduled = False
        if not self.reading or self._paused is not None:
            return  # paused: the pause's end drains (what waits, whatever edges fired meanwhile)
        sock = self._sock
        until = time.monotonic() + READ_BUDGET_S
        for _ in range(self._max):
            try:
                # Asking first is cheaper than the exception an empty receive raises; most wake-ups
                # scheduled after a send find nothing.
                if not waiting(sock):
                    return
                frames = recv_parts(sock)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                self.stop()
                self._failed(exc)
                return
            self._deliver(frames)
            if self._paused is not None:
                return  # the pause's end drains
            if time.monotonic() >= until:
                break
        # A full burst or the time budget: more may wait. Let the batchers, the CPU workers' answers,
        # replies and health checks run first.
        self.schedule()
