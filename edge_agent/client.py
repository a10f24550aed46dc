"""``EdgeClient``: how a local service hands requests to its edge agent and gets the answers back.

    async with EdgeClient("tcp://127.0.0.1:5600") as client:
        response = await client.infer(request, deadline_s=0.15, priority=pb.PRIORITY_CLASS_REALTIME)

    with SyncEdgeClient("tcp://127.0.0.1:5600") as client:      # for non-asyncio services
        response = client.infer(request, deadline_s=1.0)

The client speaks the wire protocol (docs/PROTOCOL.md) to the agent's local intake: one RequestBatch
frame per call (or per ``infer_many``), an Ack, then the responses.

The client has a caller id, its routing id at the intake: the agent spools it with each request, so a
restarted agent knows whom to answer, and parks answers while the caller is away. When the connection
comes back (the agent restarted, or the link broke) the client sends every request it still waits for
again, unchanged: the agent re-attaches each one it holds (Ack ``duplicate_ids``; a parked answer goes at
once) and takes any other as new (Hong Kong's dedupe window answers one it ran already). Each call gets
one answer: a second copy of an answer is dropped. A service that restarts keeps its answers by passing
the same ``caller_id`` and sending its unanswered requests again (same ids, ``deadline_s=None``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import socket
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, Final, TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from edge_agent.parked import GRACE_S
from edgewire import FrameCodec, FrameError, new_id, now_unix_us, pb

T = TypeVar("T")
MAX_REMEMBERED = 100_000
CALLER_ID: Final = re.compile(r"[A-Za-z0-9._:@/-]{1,128}")
"""What a caller id may be: its bytes are the routing id at the intake (never a leading zero byte)."""
RESEND_CHUNK: Final = 256  # requests per frame when sending again after a reconnect
NACK_STATUS = {
    pb.NACK_REASON_OVERLOADED: pb.STATUS_OVERLOADED,
    pb.NACK_REASON_DRAINING: pb.STATUS_OVERLOADED,
    pb.NACK_REASON_DEADLINE_EXPIRED: pb.STATUS_DEADLINE_EXCEEDED,
    pb.NACK_REASON_UNKNOWN_MODEL: pb.STATUS_MODEL_NOT_FOUND,
}
DEFAULT_TIMEOUT_S = 60.0  # a call without any deadline still ends


def default_caller_id(service: str) -> str:
    """``<service>.<host>.<pid>.<random>``: one per client, stable across its reconnects (not across a
    restart of its process: pass ``caller_id`` for that)."""
    clean = [re.sub(r"[^A-Za-z0-9._-]", "-", part)[:40] for part in (service, socket.gethostname())]
    return f"{clean[0] or 'local'}.{clean[1] or 'host'}.{os.getpid()}.{secrets.token_hex(4)}"


class EdgeClient:
    """asyncio client of the agent's intake; many calls may be in flight at once.

    ``caller_id`` (``CALLER_ID``: up to 128 of ``A-Z a-z 0-9 . _ : @ / -``) names this caller to the agent
    across reconnects and agent restarts, and across restarts of this process when the service passes the
    same one again; one client per caller id at a time. Default: ``default_caller_id(service)``.

    ``compress``: send the intake frames zstd-compressed. Off by default: the intake is a local hop (the
    agent answers its callers uncompressed too), and compressing a frame only for the agent to decompress
    it costs both sides CPU for no bytes that cross a slow link. On for a service that reaches its agent
    over one.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        context: zmq.asyncio.Context | None = None,
        service: str = "local",
        caller_id: str | None = None,
        compress: bool = False,
    ) -> None:
        self.endpoint = endpoint
        self.compress = compress
        self.service = service
        self.caller_id = default_caller_id(service) if caller_id is None else caller_id
        if not CALLER_ID.fullmatch(self.caller_id):
            raise ValueError(f"caller_id must match {CALLER_ID.pattern}, not {self.caller_id!r}")
        self._own_ctx = context is None
        self._ctx = context or zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTING_ID, self.caller_id.encode())
        self._codec = FrameCodec()
        self._waiting: dict[bytes, asyncio.Future[pb.InferResponse]] = {}
        # Requests waiting for an answer, and the connection (``_link``) they were last sent on.
        self._sent: dict[bytes, tuple[pb.InferRequest, int]] = {}
        self._link = 0  # +1 at each disconnect: what was sent before it may be lost with that connection
        # Ids the agent acknowledged (spooled or in flight, or re-attached), most recent last; bounded.
        self.accepted: dict[bytes, None] = {}
        self.reconnects = 0  # connections to the agent after the first
        self.resent = 0  # requests sent again after a reconnect
        self.dropped_answers = 0  # answers to requests no longer waited for (a second copy, or late)
        self._reader: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._monitor: zmq.asyncio.Socket | None = None

    async def __aenter__(self) -> EdgeClient:
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._watcher = asyncio.create_task(self._watch(self._monitor))
        self._sock.connect(self.endpoint)
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for future in self._waiting.values():
            future.cancel()
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(0)
        self._sock.close(0)
        if self._own_ctx:
            self._ctx.term()

    async def infer(
        self,
        request: pb.InferRequest,
        *,
        deadline_s: float | None = None,
        priority: pb.PriorityClass.ValueType | None = None,
    ) -> pb.InferResponse:
        """Send one request; returns its response (DEADLINE_EXCEEDED if none arrives in time)."""
        (response,) = await self.infer_many([request], deadline_s=deadline_s, priority=priority)
        return response

    async def infer_many(
        self,
        requests: Sequence[pb.InferRequest],
        *,
        deadline_s: float | None = None,
        priority: pb.PriorityClass.ValueType | None = None,
    ) -> list[pb.InferResponse]:
        loop = asyncio.get_running_loop()
        futures = []
        for request in requests:
            if not request.request_id:
                request.request_id = new_id()
            if deadline_s is not None:
                request.deadline_unix_us = now_unix_us() + int(deadline_s * 1e6)
            if priority is not None:
                request.priority = priority
            if not request.tenant:
                request.tenant = self.service
            future: asyncio.Future[pb.InferResponse] = loop.create_future()
            self._waiting[request.request_id] = future
            self._sent[request.request_id] = (request, self._link)
            futures.append(future)
        try:
            frames = self._codec.encode(
                pb.RequestBatch(requests=list(requests)), agent_id=self.service, compress=self.compress
            )
            await self._sock.send_multipart(frames)
            budget = max((r.deadline_unix_us for r in requests), default=0)
            # The agent answers every request by its deadline (a restarted one, or one this client
            # reconnected to, as well); the grace covers a busy host, not a lost answer.
            timeout = max(0.05, (budget - now_unix_us()) / 1e6 + GRACE_S) if budget else None
            done, _ = await asyncio.wait(futures, timeout=timeout or DEFAULT_TIMEOUT_S)
        finally:  # also when the caller cancels us: no entry outlives its call
            for request in requests:
                self._waiting.pop(request.request_id, None)
                self._sent.pop(request.request_id, None)
        out = []
        for request, future in zip(requests, futures, strict=True):
            if future in done:
                out.append(future.result())
            else:
                future.cancel()
                out.append(
                    pb.InferResponse(
                        request_id=request.request_id,
                        status=pb.STATUS_DEADLINE_EXCEEDED,
                        error_message="no answer from the edge agent in time",
                    )
                )
        return out

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            try:
                payload = self._codec.decode(frames).payload
            except FrameError:
                continue
            if isinstance(payload, pb.ResponseBatch):
                for response in payload.responses:
                    future = self._waiting.get(response.request_id)
                    if future is not None and not future.done():
                        future.set_result(response)
                        self._sent.pop(response.request_id, None)
                    else:
                        self.dropped_answers += 1
            elif isinstance(payload, pb.Ack):
                for rid in (*payload.accepted_ids, *payload.duplicate_ids):
                    self.accepted[rid] = None
                while len(self.accepted) > MAX_REMEMBERED:
                    del self.accepted[next(iter(self.accepted))]
                for nack in payload.nacks:
                    future = self._waiting.get(nack.request_id)
                    if future is not None and not future.done():
                        self._sent.pop(nack.request_id, None)
                        future.set_result(
                            pb.InferResponse(
                                request_id=nack.request_id,
                                status=NACK_STATUS.get(nack.reason, pb.STATUS_INVALID_ARGUMENT),
                                error_message=nack.detail,
                                retry_after_ms=nack.retry_after_ms,
                            )
                        )

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        """Follow the connection: after each reconnect, send again what may have been lost with the old
        one (anything sent before it broke and not answered yet)."""
        connected = 0
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._link += 1  # sent from now on: queued in the socket for the next connection
            elif event["event"] == zmq.EVENT_CONNECTED:
                connected += 1
                if connected > 1:
                    self.reconnects += 1
                    await self._resend()

    async def _resend(self) -> None:
        link = self._link
        again = [request for request, sent_on in self._sent.values() if sent_on < link]
        for request in again:
            self._sent[request.request_id] = (request, link)
        for start in range(0, len(again), RESEND_CHUNK):
            chunk = again[start : start + RESEND_CHUNK]
            frames = self._codec.encode(
                pb.RequestBatch(requests=chunk), agent_id=self.service, compress=self.compress
            )
            await self._sock.send_multipart(frames)
            self.resent += len(chunk)


class SyncEdgeClient:
    """Blocking wrapper for services without an event loop: runs an EdgeClient on a private thread."""

    def __init__(
        self, endpoint: str, *, service: str = "local", caller_id: str | None = None, compress: bool = False
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="edge-client")
        self._client = EdgeClient(endpoint, service=service, caller_id=caller_id, compress=compress)

    def __enter__(self) -> SyncEdgeClient:
        self._thread.start()
        self._call(self._client.__aenter__())
        return self

    def __exit__(self, *exc: object) -> None:
        self._call(self._client.__aexit__(None, None, None))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def infer(self, request: pb.InferRequest, **kwargs: Any) -> pb.InferResponse:
        return self._call(self._client.infer(request, **kwargs))

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=DEFAULT_TIMEOUT_S + 5)
