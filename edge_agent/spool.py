"""The agent's on-disk spool: a write-ahead log of requests not yet accepted by the gateway.

Batch-class and interactive requests are appended here before the local caller is acknowledged, and stay
until the gateway acks them. After a crash (kill -9, power loss) the spool reopens, skips and counts what
was torn or corrupted, and hands back everything else for resending. It never refuses to start over bad
content; only an unusable directory (permissions, another live agent holding it) raises.

Directory layout (directory 0700, files 0600)::

    <directory>/spool.lock               flock held while a Spool is open (one writer per directory)
    <directory>/0000000000000001.wal     segments, 16-digit sequence, appended in order
    <directory>/0000000000000002.wal     ...

Any other file in the directory is ignored and counted in ``ignored_files``.

Record layout (little-endian), one after another in a segment::

    offset size field
    0      4    magic       b"\\x89WAL"
    4      4    crc32       zlib.crc32 over bytes 8.. of the header, then key, then value
    8      1    version     1
    9      1    kind        1 = PUT (a request), 2 = DEL (tombstone: the gateway acked the key)
    10     2    key_len     16 (the request id)
    12     4    value_len   payload length; 0 for DEL
    16     8    stamp       unix seconds when appended (float64), for ``oldest_age_s`` after a restart
    24     8    deadline    unix seconds (float64) after which the request is worthless; 0 = none
    32     ...  key, then value

Lifecycle of a record: a PUT is live until it is acked (a DEL record is appended), it expires (its
deadline passes: ``purge_expired`` and recovery drop it using the header alone, no tombstone is written),
or the spool is full under ``drop_oldest`` (its whole segment file is deleted). Live data is never
rewritten: a segment file is deleted once none of its PUTs is live and every PUT its tombstones killed is
in a segment already deleted (otherwise deleting the tombstones first could resurrect an acked record).
The segment being appended to is kept until the spool rolls past it.

Recovery reads every segment in sequence order. Damage followed by a valid record is ``corrupt`` (skipped
by its length when the header is plausible, otherwise by scanning for the next magic that starts a record
with a good checksum); damage that runs to the end of a file is ``torn`` and the file is truncated there.
Appends after a restart always go to a fresh segment.

Size cap: ``max_bytes`` bounds the bytes of all segment files on disk (live, acked and tombstones alike),
because the cap protects the edge box's disk. Tombstones are always written, so an ack may overshoot the
cap by a few bytes per record; the next append applies ``when_full``. Under ``drop_oldest`` room is made a
whole segment at a time (the oldest one), each of its live records counted as ``dropped_oldest``.

Durability: ``fsync="always"`` fsyncs every append and ack before returning; ``"batch"`` leaves it to
``sync()``, or to :class:`GroupCommit`, which the agent awaits once per intake frame before acknowledging
its callers: the fsync runs on a thread, and the frames that arrive meanwhile share the next one
(segments are fsynced as they are rolled); ``"never"`` relies on the OS. A kill -9 loses nothing that
``append`` returned under any policy (the page cache survives the process); power loss may lose unsynced
records.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import fcntl
import heapq
import os
import re
import struct
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal, get_args

FsyncPolicy = Literal["always", "batch", "never"]
FullPolicy = Literal["block", "drop_oldest", "drop_newest"]
DropReason = Literal["dropped_oldest", "dropped_newest", "too_large", "expired", "torn", "corrupt"]
DROP_REASONS: Final[tuple[DropReason, ...]] = get_args(DropReason)

MAGIC: Final = b"\x89WAL"
VERSION: Final = 1
KEY_BYTES: Final = 16
LOCK_NAME: Final = "spool.lock"
SEGMENT_SUFFIX: Final = ".wal"

_HEADER: Final = struct.Struct("<4sI")  # magic, crc32
_REST: Final = struct.Struct("<BBHIdd")  # version, kind, key_len, value_len, stamp, deadline
HEADER_BYTES: Final = _HEADER.size + _REST.size
_SEGMENT_NAME: Final = re.compile(r"(\d{16})" + re.escape(SEGMENT_SUFFIX))


class RecordKind(enum.IntEnum):
    """What a record on disk says."""

    PUT = 1
    DEL = 2


class AppendResult(enum.StrEnum):
    """What ``Spool.append`` did with a record."""

    STORED = "stored"
    DROPPED_NEWEST = "dropped_newest"  # full, policy drop_newest: refused and counted
    WOULD_BLOCK = "would_block"  # full, policy block: nothing written, the caller waits or sheds
    TOO_LARGE = "too_large"  # the record alone exceeds max_bytes: refused and counted under any policy


class SpoolBusyError(OSError):
    """Another open Spool (this process or another) holds the directory's lock."""


def encode_record(kind: RecordKind, key: bytes, value: bytes, stamp: float, deadline: float) -> bytes:
    """One record in the on-disk layout described in the module docstring."""
    rest = _REST.pack(VERSION, kind, len(key), len(value), stamp, deadline)
    crc = zlib.crc32(value, zlib.crc32(key, zlib.crc32(rest)))
    return _HEADER.pack(MAGIC, crc) + rest + key + value


@dataclass(frozen=True, slots=True)
class ScannedRecord:
    """A record that recovery found intact: where it is and what its header says."""

    offset: int
    size: int
    kind: RecordKind
    key: bytes
    stamp: float
    deadline: float


@dataclass(slots=True)
class SegmentScan:
    """One segment as recovery read it: its intact records and the damage between and after them."""

    records: list[ScannedRecord] = field(default_factory=list)
    corrupt: int = 0
    torn: bool = False
    valid_end: int = 0


def _parse_at(buf: memoryview, pos: int) -> ScannedRecord | None:
    """The record starting at ``pos`` if it is complete, well formed and its checksum matches."""
    end = len(buf)
    if pos + HEADER_BYTES > end:
        return None
    magic, crc = _HEADER.unpack_from(buf, pos)
    if magic != MAGIC:
        return None
    version, kind, key_len, value_len, stamp, deadline = _REST.unpack_from(buf, pos + _HEADER.size)
    size = HEADER_BYTES + key_len + value_len
    if version != VERSION or key_len != KEY_BYTES or pos + size > end:
        return None
    if kind not in (RecordKind.PUT, RecordKind.DEL) or (kind == RecordKind.DEL and value_len):
        return None
    if zlib.crc32(buf[pos + _HEADER.size : pos + size]) != crc:
        return None
    key = bytes(buf[pos + HEADER_BYTES : pos + HEADER_BYTES + key_len])
    return ScannedRecord(pos, size, RecordKind(kind), key, stamp, deadline)


def _resync(buf: memoryview, data: bytes, pos: int) -> int:
    """Where the next valid record after the damage at ``pos`` starts, or -1 if none does."""
    if pos + HEADER_BYTES <= len(buf) and bytes(buf[pos : pos + len(MAGIC)]) == MAGIC:
        _, _, key_len, value_len, _, _ = _REST.unpack_from(buf, pos + _HEADER.size)
        skip = pos + HEADER_BYTES + int(key_len) + int(value_len)
        if skip < len(buf) and _parse_at(buf, skip) is not None:
            return skip
    candidate = data.find(MAGIC, pos + 1)
    while candidate >= 0:
        if _parse_at(buf, candidate) is not None:
            return candidate
        candidate = data.find(MAGIC, candidate + 1)
    return -1


def scan_segment(data: bytes) -> SegmentScan:
    """Every valid record of one segment's bytes, with counts of the damage skipped."""
    scan = SegmentScan()
    buf = memoryview(data)
    pos = 0
    while pos < len(data):
        record = _parse_at(buf, pos)
        if record is not None:
            scan.records.append(record)
            pos += record.size
            scan.valid_end = pos
            continue
        nxt = _resync(buf, data, pos)
        if nxt < 0:
            scan.torn = True
            break
        scan.corrupt += 1
        pos = nxt
    return scan


@dataclass(slots=True)
class _Segment:
    seq: int
    path: Path
    size: int = 0
    live: int = 0  # live PUTs in this file
    refs: set[int] = field(default_factory=set)  # older segments holding PUTs this file's DELs killed
    fd: int | None = None  # open for appending only while it is the active segment


@dataclass(frozen=True, slots=True)
class _Entry:
    seq: int
    offset: int
    size: int
    deadline: float
    stamp: float
    order: int


class Spool:
    """A segmented, checksummed write-ahead log of requests keyed by their 16-byte request id.

    Synchronous and single-threaded: the agent calls it from its event loop (appends are small; fsync
    follows ``fsync``). Records come back from ``pending()`` in append order until ``ack`` deletes them.

    ``drops`` counts lost or refused records by ``DropReason`` (every label present from the start, for
    metrics); ``ignored_files`` counts files in the directory that are not segments (never read or deleted).
    """

    def __init__(
        self,
        directory: Path,
        *,
        segment_bytes: int = 8 * 1024 * 1024,
        max_bytes: int = 256 * 1024 * 1024,
        fsync: FsyncPolicy = "batch",
        when_full: FullPolicy = "drop_oldest",
        clock: Callable[[], float] = time.time,
    ) -> None:
        if fsync not in get_args(FsyncPolicy):
            raise ValueError(f"fsync must be one of {get_args(FsyncPolicy)}, not {fsync!r}")
        if when_full not in get_args(FullPolicy):
            raise ValueError(f"when_full must be one of {get_args(FullPolicy)}, not {when_full!r}")
        if not 0 < segment_bytes <= max_bytes:
            raise ValueError("need 0 < segment_bytes <= max_bytes")
        self.directory = Path(directory)
        self._segment_bytes = segment_bytes
        self._max_bytes = max_bytes
        self._fsync: FsyncPolicy = fsync
        self._when_full: FullPolicy = when_full
        self._clock = clock
        self.drops: Counter[DropReason] = Counter(dict.fromkeys(DROP_REASONS, 0))
        self.ignored_files = 0
        self._segments: dict[int, _Segment] = {}  # ascending sequence order
        self._live: dict[bytes, _Entry] = {}  # append order
        self._deadlines: list[tuple[float, int, bytes]] = []  # heap of (deadline, order, key)
        self._live_bytes = 0
        self._disk_bytes = 0
        self._order = 0
        self._dir_dirty = False
        self._closed = False

        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.directory.chmod(0o700)
        self._lock_fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(self._lock_fd)
            raise SpoolBusyError(f"spool directory {self.directory} is in use by another Spool") from exc
        self._active_seq = 1
        try:
            self._recover()
        except OSError:
            os.close(self._lock_fd)
            raise

    @property
    def live_records(self) -> int:
        """Records appended and neither acked, expired nor dropped."""
        return len(self._live)

    @property
    def live_bytes(self) -> int:
        """On-disk bytes (headers included) of the live records."""
        return self._live_bytes

    @property
    def disk_bytes(self) -> int:
        """Bytes of all segment files: what ``max_bytes`` bounds."""
        return self._disk_bytes

    @property
    def segments(self) -> int:
        """Segment files on disk."""
        return len(self._segments)

    @property
    def oldest_age_s(self) -> float:
        """Seconds since the oldest live record was appended; 0 when the spool is empty."""
        oldest = next(iter(self._live.values()), None)
        return 0.0 if oldest is None else max(0.0, self._clock() - oldest.stamp)

    def append(self, request_id: bytes, payload: bytes, deadline: float = 0.0) -> AppendResult:
        """Write one request; once this returns ``STORED`` it comes back from ``pending()`` until acked.

        Appending an id that is already live writes nothing and returns ``STORED`` (a retried request).
        """
        self._check_open()
        if len(request_id) != KEY_BYTES:
            raise ValueError(f"request_id must be {KEY_BYTES} bytes, got {len(request_id)}")
        if request_id in self._live:
            return AppendResult.STORED
        size = HEADER_BYTES + KEY_BYTES + len(payload)
        if size > self._max_bytes:
            self.drops["too_large"] += 1
            return AppendResult.TOO_LARGE
        self._roll_if_needed(size)
        if not self._make_room(size):
            if self._when_full == "block":
                return AppendResult.WOULD_BLOCK
            self.drops["dropped_newest"] += 1
            return AppendResult.DROPPED_NEWEST
        stamp = self._clock()
        seq, offset = self._write(encode_record(RecordKind.PUT, request_id, payload, stamp, deadline))
        self._remember(request_id, seq, offset, size, stamp, deadline)
        return AppendResult.STORED

    def ack(self, request_ids: Iterable[bytes]) -> int:
        """Mark records delivered (the gateway accepted them); returns how many were live until now."""
        self._check_open()
        stamp = self._clock()
        killed: list[_Entry] = []
        tombstones = bytearray()
        for request_id in request_ids:
            entry = self._forget(request_id)
            if entry is not None:
                killed.append(entry)
                tombstones += encode_record(RecordKind.DEL, request_id, b"", stamp, 0.0)
        if not killed:
            return 0
        self._roll_if_needed(len(tombstones))
        seq, _ = self._write(bytes(tombstones))
        active = self._segments[seq]
        active.refs.update(e.seq for e in killed if e.seq != seq and e.seq in self._segments)
        self._collect()
        return len(killed)

    def pending(self) -> Iterator[tuple[bytes, bytes, float]]:
        """``(request_id, payload, deadline)`` of the live records in append order.

        A snapshot taken at the first ``next()``; records acked or dropped while iterating are skipped.
        """
        self._check_open()
        snapshot = list(self._live.items())
        readers: dict[int, int] = {}
        try:
            for request_id, entry in snapshot:
                if self._live.get(request_id) is not entry:
                    continue
                fd = readers.get(entry.seq)
                if fd is None:
                    fd = readers[entry.seq] = os.open(self._segments[entry.seq].path, os.O_RDONLY)
                value_bytes = entry.size - HEADER_BYTES - KEY_BYTES
                payload = os.pread(fd, value_bytes, entry.offset + HEADER_BYTES + KEY_BYTES)
                yield request_id, payload, entry.deadline
        finally:
            for fd in readers.values():
                os.close(fd)

    def purge_expired(self, now: float | None = None) -> int:
        """Drop live records whose deadline has passed (counted as ``expired``); returns how many."""
        self._check_open()
        now = self._clock() if now is None else now
        purged = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            _, order, request_id = heapq.heappop(self._deadlines)
            entry = self._live.get(request_id)
            if entry is not None and entry.order == order:
                self._forget(request_id)
                purged += 1
        self.drops["expired"] += purged
        if purged:
            self._collect()
        return purged

    def sync(self) -> None:
        """Make everything appended or acked so far durable (fsync of the active segment and directory)."""
        self._check_open()
        active = self._segments.get(self._active_seq)
        if active is not None and active.fd is not None:
            os.fsync(active.fd)
        if self._dir_dirty:
            self._fsync_directory()

    def begin_sync(self) -> Callable[[], None]:
        """:meth:`sync` split in two so the disk wait can leave the event loop: call this on the spool's
        thread; run what it returns on any thread. That makes everything appended or acked before this
        call durable, even if the segment is rolled or the spool closed meanwhile (it syncs its own
        duplicate of the segment's descriptor). The directory, dirty only when a segment was created or
        deleted, is synced here."""
        self._check_open()
        if self._dir_dirty:
            self._fsync_directory()
        active = self._segments.get(self._active_seq)
        if active is None or active.fd is None:
            return _nothing
        fd = os.dup(active.fd)

        def run() -> None:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        return run

    def close(self) -> None:
        """Flush per the fsync policy and release the directory; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            active = self._segments.get(self._active_seq)
            if active is not None and active.fd is not None:
                if self._fsync != "never":
                    os.fsync(active.fd)
                os.close(active.fd)
                active.fd = None
            if self._dir_dirty and self._fsync != "never":
                self._fsync_directory()
        finally:
            os.close(self._lock_fd)

    def __enter__(self) -> Spool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("spool is closed")

    def _recover(self) -> None:
        """Load every segment, count the damage, and point new appends at a fresh segment."""
        now = self._clock()
        seqs: list[int] = []
        with os.scandir(self.directory) as entries:
            for dirent in entries:
                if dirent.name == LOCK_NAME:
                    continue
                match = _SEGMENT_NAME.fullmatch(dirent.name)
                if match and dirent.is_file(follow_symlinks=False):
                    seqs.append(int(match[1]))
                else:
                    self.ignored_files += 1
        for seq in sorted(seqs):
            path = self._segment_path(seq)
            data = path.read_bytes()
            scan = scan_segment(data)
            self.drops["corrupt"] += scan.corrupt
            size = len(data)
            if scan.torn:
                self.drops["torn"] += 1
                os.truncate(path, scan.valid_end)
                size = scan.valid_end
            segment = self._segments[seq] = _Segment(seq, path, size)
            self._disk_bytes += size
            for record in scan.records:
                if record.kind == RecordKind.DEL:
                    killed = self._forget(record.key)
                    if killed is not None and killed.seq != seq:
                        segment.refs.add(killed.seq)
                elif 0 < record.deadline <= now:
                    self.drops["expired"] += 1
                else:
                    # Only a clock stepped backwards can bring back an expired PUT of a re-appended id;
                    # the later PUT wins.
                    self._forget(record.key)
                    self._remember(record.key, seq, record.offset, record.size, record.stamp, record.deadline)
        self._active_seq = max(seqs, default=0) + 1
        self._collect()

    def _segment_path(self, seq: int) -> Path:
        return self.directory / f"{seq:016d}{SEGMENT_SUFFIX}"

    def _remember(
        self, request_id: bytes, seq: int, offset: int, size: int, stamp: float, deadline: float
    ) -> None:
        self._order += 1
        self._live[request_id] = _Entry(seq, offset, size, deadline, stamp, self._order)
        self._segments[seq].live += 1
        self._live_bytes += size
        if deadline > 0:
            heapq.heappush(self._deadlines, (deadline, self._order, request_id))

    def _forget(self, request_id: bytes) -> _Entry | None:
        entry = self._live.pop(request_id, None)
        if entry is not None:
            self._segments[entry.seq].live -= 1
            self._live_bytes -= entry.size
        return entry

    def _roll_if_needed(self, size: int) -> None:
        active = self._segments.get(self._active_seq)
        if active is not None and active.size > 0 and active.size + size > self._segment_bytes:
            self._roll()

    def _roll(self) -> None:
        """Seal the active segment; the next write creates the following one."""
        active = self._segments.get(self._active_seq)
        if active is None or active.size == 0:
            return
        if active.fd is not None:
            if self._fsync != "never":
                os.fsync(active.fd)
            os.close(active.fd)
            active.fd = None
        self._active_seq += 1

    def _make_room(self, size: int) -> bool:
        """Whether ``size`` more bytes fit under ``max_bytes``, dropping oldest segments if policy says so."""
        if self._disk_bytes + size <= self._max_bytes:
            return True
        active = self._segments.get(self._active_seq)
        if active is not None and active.live == 0:
            self._roll()  # a fully acked active segment can go as soon as it is sealed
            self._collect()
        while self._disk_bytes + size > self._max_bytes:
            if self._when_full != "drop_oldest":
                return False
            oldest = next(iter(self._segments.values()))
            if oldest.seq == self._active_seq:
                self._roll()
                continue
            doomed = [k for k, e in self._live.items() if e.seq == oldest.seq]
            for request_id in doomed:
                self._forget(request_id)
            self.drops["dropped_oldest"] += len(doomed)
            self._delete(oldest)
            self._collect()
        return True

    def _write(self, data: bytes) -> tuple[int, int]:
        """Append ``data`` to the active segment (created on first use); returns (sequence, offset)."""
        segment = self._segments.get(self._active_seq)
        if segment is None:
            segment = self._create_segment(self._active_seq)
        assert segment.fd is not None  # the active segment is open for as long as it is active
        offset = segment.size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(segment.fd, view) :]
            if self._fsync == "always":
                os.fsync(segment.fd)
                if self._dir_dirty:
                    self._fsync_directory()
        except OSError:
            # A partial record may be on disk: account for it and seal the file, so the next append
            # starts a clean segment and recovery counts the tail as torn.
            written = os.fstat(segment.fd).st_size - offset
            segment.size += written
            self._disk_bytes += written
            self._roll()
            raise
        segment.size += len(data)
        self._disk_bytes += len(data)
        return segment.seq, offset

    def _create_segment(self, seq: int) -> _Segment:
        path = self._segment_path(seq)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        os.fchmod(fd, 0o600)  # whatever the umask: requests may carry personal data
        segment = self._segments[seq] = _Segment(seq, path, fd=fd)
        self._dir_dirty = True
        return segment

    def _collect(self) -> None:
        """Delete sealed segments with no live PUT whose tombstones no longer guard an older segment."""
        for segment in list(self._segments.values()):
            if segment.seq == self._active_seq or segment.live:
                continue
            if any(ref in self._segments for ref in segment.refs):
                continue
            self._delete(segment)

    def _delete(self, segment: _Segment) -> None:
        if segment.fd is not None:
            os.close(segment.fd)
            segment.fd = None
        segment.path.unlink()
        del self._segments[segment.seq]
        self._disk_bytes -= segment.size
        if self._fsync != "never":
            # Tombstones in a later segment may be deleted next; this deletion must land on disk first.
            self._fsync_directory()

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self._dir_dirty = False


def _nothing() -> None:
    """A sync with nothing to do."""


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
