"""The front's traffic thread: agent frames to their shards and shards' replies to the agents, off the
event loop.

On the loop every ZeroMQ wake-up costs the loop's own machinery (a reader callback, a ``call_soon`` after
each send to catch the edge it may have consumed, the tick around them): measured, about four fifths of the
front's CPU went there, not into moving frames (docs/BENCHMARKS.md, "Ingest shards"). Here one thread blocks
in ``zmq_poll`` over the carriers' ROUTERs, the link's ROUTER and a wake-up socket, without the GIL, and
moves each readable socket's messages in bursts: a wake-up that libzmq sees as only a state change never
reaches Python.

This thread is the only one that receives or sends on those sockets once they are handed over
(:meth:`gateway.ingress.carrier.CarrierIngress.hand_over`): the loop sends to a shard (metrics queries,
admin commands) through :meth:`Relay.to_shard`, which queues on an inproc PAIR this thread reads, and gets
what a shard says to the front itself (status, metrics) through ``call_soon_threadsafe``. The decisions
(which shard an agent's frame goes to, what a reply's head means) are the front's, given as callables.

Held connections (gateway/shards/holds.py): a shard's ``H`` message is taken here, and a held connection's
request batch is refused here before it is routed (a lapsed one's is routed); after either, its carrier's
ROUTER is not polled for the pause the pace asks (at most a millisecond), while the other carriers and the
link are.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog
import zmq

from edgewire.parts import recv_parts, send_parts, waiting
from gateway.ingress.carrier import CarrierIngress, SendResult, send_to_peer
from gateway.ops.metrics import GatewayMetrics
from gateway.shards.holds import FrontHolds
from gateway.shards.link import HOLD, REPLY

log = structlog.get_logger("gateway.front")

POLL_MS = 100
"""The longest the thread sleeps without input: how often it notes that it is alive (``cycle_at``) and
looks at its stop flag."""
DRY_LIMIT = 1_000_000
"""At stop, the most messages read off the link (the shards' last replies) before the thread ends."""
DRY_QUIET_MS = 20
"""At stop, bytes a shard wrote before it exited may still be in the kernel's buffer or ZeroMQ's I/O thread:
the dry read ends once the link has been quiet this long (or after DRY_MAX_S in all)."""
DRY_MAX_S = 1.0
_ids = itertools.count()

Route = Callable[[CarrierIngress, list[zmq.Frame]], "list[bytes | zmq.Frame] | None"]
"""An agent's message -> the link message that takes it to its shard (routing id first), or None."""
Dropped = Callable[[str], None]
"""Counts a frame or reply not passed on, by reason."""


class Relay:
    """One thread moving frames between the carriers and the shards' link."""

    def __init__(
        self,
        context: zmq.Context[Any],
        link: zmq.Socket[bytes],
        carriers: Sequence[CarrierIngress],
        route: Route,
        to_front: Callable[[list[zmq.Frame]], None],
        dropped: Dropped,
        metrics: GatewayMetrics,
        loop: asyncio.AbstractEventLoop,
        max_messages: int,
        holds: FrontHolds | None = None,
    ) -> None:
        self._ctx = context
        self._link = link
        self._carriers = list(carriers)
        self._route = route
        self._to_front = to_front
        self._dropped = dropped
        self._metrics = metrics
        self._loop = loop
        self._max = max_messages
        self._holds = holds
        self._poller: zmq.Poller | None = None
        self._paused: dict[zmq.Socket[bytes], float] = {}  # a carrier's socket -> when it is read again
        self._socks: list[zmq.Socket[bytes]] = []
        self._endpoint = f"inproc://hkgw-relay-{next(_ids)}"
        self._wake_in: zmq.Socket[bytes] | None = None  # the loop's end
        self._wake_out: zmq.Socket[bytes] | None = None  # this thread's end
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.cycle_at = time.monotonic()
        self.failed: str | None = None

    def start(self) -> None:
        """Take the carriers' traffic over and start the thread (on the loop)."""
        self._wake_out = zmq.Socket(self._ctx, zmq.PAIR)
        self._wake_out.bind(self._endpoint)
        self._wake_in = zmq.Socket(self._ctx, zmq.PAIR)
        self._wake_in.setsockopt(zmq.SNDHWM, 100_000)
        self._wake_in.connect(self._endpoint)
        self._socks = [c.hand_over(self.stalled) for c in self._carriers]
        self.cycle_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="front-relay", daemon=True)
        self._thread.start()

    def stalled(self, now: float, stall_s: float) -> bool:
        """The carriers' stall test: this thread reads whatever waits, so only a stuck or dead one stalls."""
        return self.failed is not None or now - self.cycle_at > stall_s

    def to_shard(self, parts: Sequence[bytes]) -> bool:
        """A message from the loop to a shard (routing id first); False when the thread is gone."""
        sock = self._wake_in
        if sock is None or self.failed is not None:
            return False
        try:
            send_parts(sock, parts)
        except zmq.ZMQError:
            return False
        return True

    def stop(self) -> None:
        """Stop the thread after it has passed on what the shards sent (on the loop; blocks briefly)."""
        self._stopping = True
        thread = self._thread
        if thread is not None:
            if self._wake_in is not None:
                with contextlib.suppress(zmq.ZMQError):  # else it sees the flag within POLL_MS
                    self._wake_in.send(b"", flags=zmq.NOBLOCK)
            thread.join(timeout=10.0)
            if thread.is_alive():
                log.error("front relay thread did not stop")
        self._thread = None
        for sock in (self._wake_in, self._wake_out):
            if sock is not None:
                sock.close(0)
        self._wake_in = self._wake_out = None

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # a bug here stops all traffic: health must say so
            self.failed = repr(exc)
            for carrier in self._carriers:
                carrier.failed = self.failed
            log.exception("front relay thread failed; no traffic passes")

    def _serve(self) -> None:
        assert self._wake_out is not None
        self._poller = poller = zmq.Poller()
        handlers: dict[zmq.Socket[bytes], Callable[[list[zmq.Frame]], None]] = {}
        for carrier, sock in zip(self._carriers, self._socks, strict=True):
            handlers[sock] = self._from_carrier(carrier, sock)
        handlers[self._link] = self._from_link
        handlers[self._wake_out] = self._from_loop
        for sock in handlers:
            poller.register(sock, zmq.POLLIN)
        limit = self._max
        paused = self._paused
        while not self._stopping:
            ready = poller.poll(self._resume_paused() if paused else POLL_MS)
            self.cycle_at = time.monotonic()
            for sock, _ in ready:
                handle = handlers[sock]
                for _ in range(limit):
                    # Asking is cheaper than the exception an empty receive raises (zmq.Again).
                    if sock in paused or not waiting(sock):
                        break
                    handle(recv_parts(sock))
        self._read_link_dry()

    def _pause(self, sock: zmq.Socket[bytes], seconds: float) -> None:
        """Read nothing more of a carrier's socket for ``seconds`` (a held connection's frames paced)."""
        if sock in self._paused or self._poller is None:
            return
        self._paused[sock] = time.monotonic() + seconds
        self._poller.unregister(sock)

    def _resume_paused(self) -> int:
        """Poll the sockets whose pause has ended again; how long the next poll may wait, in ms (until the
        next pause ends, rounded up: zmq_poll counts milliseconds)."""
        assert self._poller is not None
        now = time.monotonic()
        wait_ms = POLL_MS
        for sock, until in list(self._paused.items()):
            if until <= now:
                del self._paused[sock]
                self._poller.register(sock, zmq.POLLIN)
            else:
                wait_ms = min(wait_ms, max(1, math.ceil((until - now) * 1000)))
        return wait_ms

    def _from_carrier(
        self, carrier: CarrierIngress, sock: zmq.Socket[bytes]
    ) -> Callable[[list[zmq.Frame]], None]:
        route, link, dropped, errors = self._route, self._link, self._dropped, self._metrics.ingest_errors
        holds = self._holds

        def deliver(frames: list[zmq.Frame]) -> None:
            carrier.last_recv = time.monotonic()
            carrier.messages += 1
            if holds:  # some connection is held or lapsed (FrontHolds is falsy when none is)
                verdict = holds.check(carrier.name, frames)
                if verdict is not None:
                    refused, pause_s = verdict
                    if pause_s > 0:
                        self._pause(sock, pause_s)
                    if refused:
                        return
            try:
                parts = route(carrier, frames)
            except Exception:  # a bug in handling one frame must not stop the traffic
                errors.labels(carrier.name).inc()
                log.exception("routing a frame to its shard failed", carrier=carrier.name)
                return
            if parts is None:
                return
            try:
                send_parts(link, parts)
            except zmq.Again:
                dropped("shard_busy")
            except zmq.ZMQError as exc:
                if exc.errno != errno.EHOSTUNREACH:
                    raise
                dropped("shard_down")

        return deliver

    def _from_link(self, frames: list[zmq.Frame]) -> None:
        """A shard's message: a reply goes to its agent from here; anything else to the front's loop."""
        if len(frames) >= 3:
            head = frames[1].bytes
            if len(head) == 2 and head[:1] == REPLY and head[1] < len(self._socks):
                result = send_to_peer(self._socks[head[1]], frames[2].bytes, frames[3:])
                if result != SendResult.SENT:
                    self._dropped(f"reply_{result}")
                return
            if head[:1] == HOLD and self._holds is not None:
                if not self._holds.hold(frames[1:]):
                    log.error("malformed hold on the link", parts=len(frames), head=head[:8].hex())
                return
        with contextlib.suppress(RuntimeError):  # a closed loop: the front is gone, and what it was told
            self._loop.call_soon_threadsafe(self._to_front, frames)

    def _from_loop(self, frames: list[zmq.Frame]) -> None:
        if self._stopping or len(frames) < 2:
            return  # the stop signal
        # A query or command for a shard that is gone: the scrape times out, the command is moot.
        with contextlib.suppress(zmq.ZMQError):
            send_parts(self._link, frames)

    def _read_link_dry(self) -> None:
        """What the shards sent before they exited (their last replies), passed on before carriers close."""
        deadline = time.monotonic() + DRY_MAX_S
        for _ in range(DRY_LIMIT):
            if not waiting(self._link) and (
                time.monotonic() >= deadline or not self._link.poll(DRY_QUIET_MS)
            ):
                return
            try:
                frames = recv_parts(self._link)
            except zmq.ZMQError:
                return
            self._from_link(frames)
