"""The intake: the ROUTER local services send RequestBatch frames to, read one frame at a time.

A frame is decoded and taken at once (``Admission.take``); one whose requests wait for the spool's fsync
finishes in a task of its own, so frames that arrive meanwhile are spooled and share the next fsync. At
most ``MAX_FRAMES_TAKING`` wait at once: the intake reads no more until one is done, so local services feel
the disk's pace. Frames that cannot be taken are counted by reason, never answered with a guess.

A caller is its routing id, which ``EdgeClient`` sets to its caller id: the ROUTER hands an id over to
the newest connection that claims it (``ROUTER_HANDOVER``: a caller that reconnected, or restarted, gets
its answers on the new connection), and a send to an id not connected fails instead of vanishing
(``ROUTER_MANDATORY``), so the answer is parked for the caller's return (``callers``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Final

import structlog
import zmq
import zmq.asyncio

from edge_agent.errors import ErrorCounts, ErrorReason
from edge_agent.sockets import send_nowait
from edge_agent.stats import AgentStats
from edgewire import FrameCodec, FrameError, labels, pb

log = structlog.get_logger("edge_agent")

MAX_FRAMES_TAKING: Final = 64
"""Intake frames being taken at once (spooled, waiting for their fsync)."""

Take = Callable[[bytes, list[pb.InferRequest]], Coroutine[Any, Any, None] | None]
"""Takes one frame's requests from a caller; returns what is left to run when it waits for an fsync."""


class Intake:
    """Reads intake frames and hands each to ``take``; sends replies on the same socket.

    ``on_done`` is called as each frame that waited for an fsync finishes (the drain waits for them).
    """

    def __init__(
        self,
        context: zmq.asyncio.Context,
        endpoint: str,
        stats: AgentStats,
        errors: ErrorCounts,
        on_done: Callable[[], None],
    ) -> None:
        self._configured = endpoint
        self._stats = stats
        self._errors = errors
        self._on_done = on_done
        self._sock = context.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        try:
            self._sock.bind(endpoint)
        except BaseException:
            self._sock.close(0)  # else the context's term() waits for it forever
            raise
        self._closed = False
        self._codec = FrameCodec()
        self._reader: asyncio.Task[None] | None = None
        self._taking: set[asyncio.Task[None]] = set()

    @property
    def endpoint(self) -> str:
        """The bound endpoint (the port chosen when the configured one was ``*``)."""
        if self._closed:
            return self._configured
        return self._sock.get_string(zmq.LAST_ENDPOINT)

    @property
    def taking(self) -> int:
        """Frames spooled and waiting for their fsync: they are acknowledged, sent, then answered."""
        return len(self._taking)

    def start(self, take: Take) -> None:
        self._reader = asyncio.create_task(self._read(take), name="intake")

    def send(self, frames: list[bytes]) -> bool:
        """Send to a caller without waiting (``frames[0]`` is its routing id)."""
        if self._closed:
            return False
        return send_nowait(self._sock, frames)

    async def stop_reading(self) -> None:
        """Take no new frames (the drain); frames being taken go on to their end. Frames that arrive
        meanwhile stay unread (their callers get no Ack and time out). The socket's RCVHWM is left alone:
        libzmq 4.3.5 changing it on a live ROUTER while peers come and go crashed its I/O thread (SIGSEGV,
        2 runs in 12 of ``edge-agent --synthetic``)."""
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)

    async def stop(self) -> None:
        """Stop reading and cancel the frames still waiting (what they spooled is resent by the next
        start); replies can still be sent until ``close``."""
        await self.stop_reading()
        for task in self._taking:
            task.cancel()
        await asyncio.gather(*self._taking, return_exceptions=True)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close(0)

    async def _read(self, take: Take) -> None:
        slots = asyncio.Semaphore(MAX_FRAMES_TAKING)
        while True:
            # The slot first: this loop is cancelled (drain) only where it awaits, and no await may come
            # between receiving a frame and taking it, or a received frame would be dropped unanswered.
            await slots.acquire()
            try:
                frames = await self._sock.recv_multipart()
            except BaseException:
                slots.release()
                raise
            waiting = self._take_frame(take, frames)
            if waiting is None:
                slots.release()
                continue
            task = asyncio.create_task(waiting)
            self._taking.add(task)
            task.add_done_callback(lambda done: self._finished(done, slots))

    def _finished(self, task: asyncio.Task[None], slots: asyncio.Semaphore) -> None:
        self._taking.discard(task)
        slots.release()
        self._on_done()

    def _take_frame(self, take: Take, frames: list[bytes]) -> Coroutine[Any, Any, None] | None:
        caller, body = frames[0], frames[1:]
        try:
            batch = self._codec.decode(body).payload
        except FrameError as exc:
            self._stats.bad_frames[exc.label] += 1
            log.warning("bad frame from a local service", reason=exc.label)
            return None
        if not isinstance(batch, pb.RequestBatch):
            reason = labels.REJECT[pb.REJECT_REASON_UNEXPECTED_KIND]
            self._stats.bad_frames[reason] += 1
            log.warning("bad frame from a local service", reason=reason, message=type(batch).__name__)
            return None
        try:
            return take(caller, list(batch.requests))
        except Exception:  # one bad batch must not stop the intake for every local service
            self._errors.count(ErrorReason.TAKE_FRAME)
            log.exception("taking a batch from a local service failed", requests=len(batch.requests))
            return None
