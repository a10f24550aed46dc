"""``EdgeClient``: how a local service hands requests to its edge agent and gets the answers back.

    async with EdgeClient("tcp://127.0.0.1:5600") as client:
        response = await client.infer(request, deadline_s=0.15, priority=pb.PRIORITY_CLASS_REALTIME)

    with SyncEdgeClient("tcp://127.0.0.1:5600") as client:      # for non-asyncio services
        response = client.infer(request, deadline_s=1.0)

The client speaks the wire protocol (docs/PROTOCOL.md) to the agent's local intake: one RequestBatch
frame per call (or per ``infer_many``), an Ack, then the responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from edgewire import FrameCodec, FrameError, new_id, now_unix_us, pb

T = TypeVar("T")
MAX_REMEMBERED = 100_000
NACK_STATUS = {
    pb.NACK_REASON_OVERLOADED: pb.STATUS_OVERLOADED,
    pb.NACK_REASON_DRAINING: pb.STATUS_OVERLOADED,
    pb.NACK_REASON_DEADLINE_EXPIRED: pb.STATUS_DEADLINE_EXCEEDED,
    pb.NACK_REASON_UNKNOWN_MODEL: pb.STATUS_MODEL_NOT_FOUND,
}
DEFAULT_TIMEOUT_S = 60.0  # a call without any deadline still ends


class EdgeClient:
    """asyncio client of the agent's intake; many calls may be in flight at once."""

    def __init__(
        self, endpoint: str, *, context: zmq.asyncio.Context | None = None, service: str = "local"
    ) -> None:
        self.endpoint = endpoint
        self.service = service
        self._own_ctx = context is None
        self._ctx = context or zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._codec = FrameCodec()
        self._waiting: dict[bytes, asyncio.Future[pb.InferResponse]] = {}
        # Ids the agent acknowledged (spooled or in flight), most recent last; bounded.
        self.accepted: dict[bytes, None] = {}
        self._reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> EdgeClient:
        self._sock.connect(self.endpoint)
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        for future in self._waiting.values():
            future.cancel()
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
            futures.append(future)
        frames = self._codec.encode(pb.RequestBatch(requests=list(requests)), agent_id=self.service)
        await self._sock.send_multipart(frames)
        budget = max((r.deadline_unix_us for r in requests), default=0)
        # The agent answers every request by its deadline; the grace covers a busy host, not a lost answer.
        timeout = max(0.05, (budget - now_unix_us()) / 1e6 + 2.0) if budget else None
        try:
            done, _ = await asyncio.wait(futures, timeout=timeout or DEFAULT_TIMEOUT_S)
        finally:  # also when the caller cancels us: no entry outlives its call
            for request in requests:
                self._waiting.pop(request.request_id, None)
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
            elif isinstance(payload, pb.Ack):
                for rid in payload.accepted_ids:
                    self.accepted[rid] = None
                while len(self.accepted) > MAX_REMEMBERED:
                    del self.accepted[next(iter(self.accepted))]
                for nack in payload.nacks:
                    future = self._waiting.get(nack.request_id)
                    if future is not None and not future.done():
                        future.set_result(
                            pb.InferResponse(
                                request_id=nack.request_id,
                                status=NACK_STATUS.get(nack.reason, pb.STATUS_INVALID_ARGUMENT),
                                error_message=nack.detail,
                                retry_after_ms=nack.retry_after_ms,
                            )
                        )


class SyncEdgeClient:
    """Blocking wrapper for services without an event loop: runs an EdgeClient on a private thread."""

    def __init__(self, endpoint: str, *, service: str = "local") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="edge-client")
        self._client = EdgeClient(endpoint, service=service)

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
