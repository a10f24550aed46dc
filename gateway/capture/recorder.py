"""Traffic capture at the gateway: messages as received, written to rotating files off the hot path.

:meth:`CaptureRecorder.offer` runs on the event loop for every received message while capture is on: it
copies the frames into a bounded queue (by records and by bytes) and returns. One writer thread drains the
queue into the current capture file, rotates it by size and age, and deletes the oldest files beyond the
total size and count caps. Nothing here waits for the disk on the event loop: a full queue (slow disk) or a
failed write (full disk) drops the record and counts it (``hkgw_capture_records_total{outcome}``), and the
writer tries a new file after a pause.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from edgewire import FrameError
from edgewire.pb.edgeinfer.v1 import capture_pb2 as cpb
from gateway.capture.format import FORMAT_VERSION, MAGIC, SUFFIX, CaptureFile
from gateway.capture.redact import Redactor
from gateway.config import CaptureConfig
from gateway.ops.metrics import GatewayMetrics

log = structlog.get_logger("gateway.capture")

WRITTEN: Final = "written"
DROPPED_QUEUE_FULL: Final = "dropped_queue_full"
DROPPED_WRITE_ERROR: Final = "dropped_write_error"
DROPPED_REDACTION: Final = "dropped_redaction"
OUTCOMES: Final = (WRITTEN, DROPPED_QUEUE_FULL, DROPPED_WRITE_ERROR, DROPPED_REDACTION)
_STOP: Final = object()


@dataclass(frozen=True, slots=True)
class _Pending:
    arrival_unix_us: int
    carrier: str
    agent_id: str
    region: str
    frames: tuple[bytes, ...]


class CaptureRecorder:
    """Capture of one gateway's received traffic; see the module docstring.

    ``dictionaries`` returns the zstd dictionaries to embed in each new file's header, so that payloads
    compressed with them can be read back. ``clock`` is wall time (capture records carry Unix times).
    """

    def __init__(
        self,
        config: CaptureConfig,
        *,
        instance: str,
        dictionaries: Callable[[], Sequence[tuple[int, bytes]]],
        metrics: GatewayMetrics,
        redactor: Redactor | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.directory = Path(config.directory)
        self._instance = instance
        self._dictionaries = dictionaries
        self._metrics = metrics
        self._redactor = redactor
        self._clock = clock
        self._queue: queue.Queue[_Pending | object] = queue.Queue(config.queue_records)
        self._queued_bytes = 0
        self._bytes_lock = threading.Lock()
        self._until = float("inf") if config.enabled else 0.0
        self._thread: threading.Thread | None = None
        self._file: CaptureFile | None = None
        self._file_opened = 0.0
        self._retry_at = 0.0
        self._sequence = 0
        self._counters = {o: metrics.child(metrics.capture_records, o) for o in OUTCOMES}
        metrics.capture_active.set(1 if config.enabled else 0)

    # ------------------------------------------------------------------ control (event loop)

    def active(self) -> bool:
        return self._clock() < self._until

    def enable_for(self, seconds: float) -> float:
        """Capture for ``seconds`` from now (capped by ``max_enable_s``); returns the Unix time it ends."""
        seconds = min(max(seconds, 0.0), self.config.max_enable_s)
        self._until = self._clock() + seconds
        self._metrics.capture_active.set(1)
        log.info("capture on", seconds=seconds, directory=str(self.directory))
        return self._until

    def disable(self) -> None:
        self._until = 0.0
        self._metrics.capture_active.set(0)
        log.info("capture off")

    def start(self) -> None:
        """Start the writer thread (the directory is created 0700 on the first file)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="capture-writer", daemon=True)
            self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Write out what is queued (within ``timeout_s``), close the file, stop the thread. Safe twice."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._queue.put(_STOP, timeout=0.1)
                break
            except queue.Full:
                if time.monotonic() > deadline:
                    break
        thread.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ hot path (event loop)

    def offer(self, carrier: str, agent_id: str, region: str, frames: Sequence[bytes | memoryview]) -> None:
        """Queue one received message if capture is on; drop and count it when the queue is full."""
        if not self._until:  # off: the common case costs one comparison
            return
        now = self._clock()
        if now >= self._until:
            self._until = 0.0
            self._metrics.capture_active.set(0)
            return
        size = sum(len(f) for f in frames)
        with self._bytes_lock:
            over = self._queued_bytes + size > self.config.queue_bytes
            if not over:
                self._queued_bytes += size
        if over:
            self._counters[DROPPED_QUEUE_FULL].inc()
            return
        pending = _Pending(int(now * 1e6), carrier, agent_id, region, tuple(bytes(f) for f in frames))
        try:
            self._queue.put_nowait(pending)
        except queue.Full:
            with self._bytes_lock:
                self._queued_bytes -= size
            self._counters[DROPPED_QUEUE_FULL].inc()

    # ------------------------------------------------------------------ writer thread

    def _run(self) -> None:
        interval = self.config.flush_interval_s
        last_flush = time.monotonic()
        while True:
            try:
                item = self._queue.get(timeout=interval)
            except queue.Empty:
                item = None
            if item is _STOP:
                break
            if isinstance(item, _Pending):
                with self._bytes_lock:
                    self._queued_bytes -= sum(len(f) for f in item.frames)
                self._write(item)
            now = time.monotonic()
            if self._file is not None and (item is None or now - last_flush >= interval):
                self._guarded(self._file.flush)
                last_flush = now
            if self._file is not None and now - self._file_opened >= self.config.max_file_age_s:
                self._rotate()
        while True:  # what was queued before the stop
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Pending):
                self._write(item)
        self._close_file()

    def _write(self, item: _Pending) -> None:
        frames = item.frames
        if self._redactor is not None:
            try:
                frames = self._redactor.redact(frames)
            except (FrameError, ValueError) as exc:  # never written in the clear: dropped instead
                self._counters[DROPPED_REDACTION].inc()
                log.warning("capture record not redactable; dropped", error=str(exc))
                return
        record = cpb.CaptureRecord(
            arrival_unix_us=item.arrival_unix_us,
            carrier=item.carrier,
            agent_id=item.agent_id,
            region=item.region,
            frames=list(frames),
        )
        if self._file is None and not self._open():
            self._counters[DROPPED_WRITE_ERROR].inc()
            return
        file = self._file
        assert file is not None
        before = file.compressed_bytes
        if not self._guarded(lambda: file.append(record)):
            self._counters[DROPPED_WRITE_ERROR].inc()
            return
        self._counters[WRITTEN].inc()
        self._metrics.capture_bytes.inc(max(0, file.compressed_bytes - before))
        if file.compressed_bytes >= self.config.max_file_bytes:
            self._rotate()

    def _guarded(self, action: Callable[[], object]) -> bool:
        """Run a file operation; on OSError drop the file and pause new ones for ``retry_after_s``."""
        try:
            action()
        except OSError as exc:
            log.warning("capture write failed; dropping until a new file opens", error=str(exc))
            if self._file is not None:
                self._file.abandon()
                self._file = None
            self._retry_at = time.monotonic() + self.config.retry_after_s
            return False
        return True

    def _open(self) -> bool:
        if time.monotonic() < self._retry_at:
            return False
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._enforce_retention(reserve=1)
            self._sequence += 1
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(self._clock()))
            path = self.directory / f"{self._instance}-{stamp}-{os.getpid()}-{self._sequence:06d}{SUFFIX}"
            header = cpb.CaptureHeader(
                magic=MAGIC,
                format_version=FORMAT_VERSION,
                instance=self._instance,
                created_unix_us=int(self._clock() * 1e6),
                redacted=self._redactor is not None,
                dictionaries=[cpb.CaptureDictionary(dict_id=i, data=d) for i, d in self._dictionaries()],
            )
            self._file = CaptureFile(path, header, level=self.config.level)
        except OSError as exc:
            log.warning("capture file not opened", error=str(exc))
            self._retry_at = time.monotonic() + self.config.retry_after_s
            return False
        self._file_opened = time.monotonic()
        return True

    def _rotate(self) -> None:
        self._close_file()
        with contextlib.suppress(OSError):
            self._enforce_retention(reserve=0)

    def _close_file(self) -> None:
        if self._file is not None:
            self._guarded(self._file.close)
            self._file = None

    def _enforce_retention(self, reserve: int) -> None:
        """Delete the oldest capture files beyond ``max_files`` (minus ``reserve``) or ``max_total_bytes``."""
        files = sorted(self.directory.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        while files and (len(files) > self.config.max_files - reserve or total > self.config.max_total_bytes):
            oldest = files.pop(0)
            total -= oldest.stat().st_size
            oldest.unlink(missing_ok=True)
