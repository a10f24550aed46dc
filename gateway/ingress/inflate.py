"""Large zstd payloads decompressed on a thread of their own, not on the event loop.

A frame declaring tens of MiB (an honest one no agent's batching sends, or a decompression bomb the
agent's budget admitted: one 32 MiB frame of zeros per 4 s with the defaults) takes libzstd 15-25 ms to
inflate. On the loop that is 15-25 ms in which no other agent's frame is read and no batch is cut: the
victims of a bomb flood saw it as their slowest 1% (docs/BENCHMARKS.md, issue 24 item 4). libzstd
releases the GIL while it works, so on a thread the loop goes on meanwhile. Small payloads stay on the
loop: a hop to a thread and back costs more than inflating an agent's usual frame.

One thread, at most ``max_pending`` frames waiting for it or in it (``[limits] inflate_off_loop_*``);
beyond that a large frame is inflated on the loop as before, so nothing is refused here and the frames
held for the thread, with their buffers, stay bounded. The result comes back to the loop with the
thread's CPU seconds spent on it (``time.thread_time``), which the agent's decode budget is charged;
parsing, which holds the GIL anyway, stays on the loop. A frame inflated here is handled after frames
received later (PROTOCOL.md section 12: frames are not necessarily acknowledged in the order they came);
:meth:`OffLoopInflater.settle` waits for the ones still out (drain).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import structlog
import zstandard as zstd

from edgewire import FrameCodec, FrameError, pb
from edgewire.codec import Buffer

log = structlog.get_logger("gateway.ingress.inflate")

Inflated = Callable[[Buffer | FrameError, float], None]
"""Called on the loop with the inflated bytes (or why they are refused) and the CPU seconds it took."""


class OffLoopInflater:
    """Inflates large zstd payloads on one thread; hands each result back to the loop that submitted it."""

    def __init__(self, codec: FrameCodec, min_bytes: int, max_pending: int) -> None:
        self._codec = codec
        self.min_bytes = min_bytes  # 0: never
        self.max_pending = max_pending
        self.pending = 0  # submitted, not yet handed back
        self.inflated = 0  # handed back, in all
        self._executor: ThreadPoolExecutor | None = None
        self._decompressors: dict[int, zstd.ZstdDecompressor] = {}  # the thread's own (codec.inflate)
        self._submitted = 0  # frames submitted, in all
        self._returned = 0  # frames handed back (or dropped by close), in all
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []  # settle(): (returns awaited, future)
        self._closed = False

    def takes(self, envelope: pb.Envelope) -> bool:
        """Whether this frame goes to the thread: a zstd payload of at least ``min_bytes``, with room."""
        return (
            self.min_bytes > 0
            and not self._closed
            and envelope.codec == pb.CODEC_ZSTD
            and envelope.uncompressed_length >= self.min_bytes
            and self.pending < self.max_pending
        )

    def submit(self, envelope: pb.Envelope, body: Buffer, done: Inflated) -> None:
        """Inflate ``body`` on the thread; ``done`` runs on this loop with the result. Call from the loop,
        for a frame :meth:`takes` took."""
        loop = asyncio.get_running_loop()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hkgw-inflate")
        self.pending += 1
        self._submitted += 1
        future = self._executor.submit(self._inflate, envelope, body)
        future.add_done_callback(functools.partial(self._back, loop, done))

    def _inflate(self, envelope: pb.Envelope, body: Buffer) -> tuple[Buffer | FrameError, float]:
        started = time.thread_time()
        try:
            raw: Buffer | FrameError = self._codec.inflate(envelope, body, self._decompressors)
        except FrameError as exc:
            raw = exc
        except Exception as exc:  # noqa: BLE001  (handed back as a refusal: the loop must hear of every frame)
            raw = FrameError(pb.REJECT_REASON_DECOMPRESSION_FAILED, f"{type(exc).__name__}: {exc}")
        return raw, time.thread_time() - started

    def _back(
        self,
        loop: asyncio.AbstractEventLoop,
        done: Inflated,
        future: Future[tuple[Buffer | FrameError, float]],
    ) -> None:
        if future.cancelled():  # by close(), on the loop's thread, before the thread took it
            self._handed_back()
            return
        try:
            loop.call_soon_threadsafe(self._deliver, future.result(), done)
        except RuntimeError:  # the loop closed first (the process is ending): nobody is left to tell
            log.warning("inflated frame dropped: the event loop is closed")

    def _deliver(self, result: tuple[Buffer | FrameError, float], done: Inflated) -> None:
        self._handed_back()
        self.inflated += 1
        done(*result)

    def _handed_back(self) -> None:
        self.pending -= 1
        self._returned += 1
        if self._waiters:
            waiting = []
            for target, future in self._waiters:
                if self._returned >= target:
                    if not future.done():
                        future.set_result(None)
                else:
                    waiting.append((target, future))
            self._waiters = waiting

    async def settle(self, timeout_s: float) -> bool:
        """Wait until every frame submitted so far has been handed back (at most ``timeout_s``); True if
        so. Frames submitted meanwhile are not waited for: a stream of them cannot hold a drain up."""
        if self._returned >= self._submitted:
            return True
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((self._submitted, future))
        try:
            await asyncio.wait_for(future, max(0.0, timeout_s))
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        """Take no more frames and stop the thread: what waits for it is dropped, and a frame still in it
        finishes there and is dropped too (the loop is ending)."""
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
