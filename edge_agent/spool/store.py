"""``Spool``: which requests are live, recovery after a crash, the size cap and expiry.

Lifecycle of a record: a PUT (the request, and the caller that asked when it is known) is live until it
is acked (a DEL record is appended: the agent answered it), it expires (its
deadline passes: ``purge_expired`` and recovery drop it using the header alone, no tombstone is written),
or the spool is full under ``drop_oldest`` (its whole segment file is deleted). Live data is never
rewritten: a segment file is deleted once none of its PUTs is live and every PUT its tombstones killed is
in a segment already deleted (otherwise deleting the tombstones first could resurrect an acked record).
The segment being appended to is kept until the spool rolls past it.

Recovery reads every segment in sequence order (``records.scan_segment``); a torn tail is truncated.
Appends after a restart always go to a fresh segment.

Size cap: ``max_bytes`` bounds the bytes of all segment files on disk (live, acked and tombstones alike),
because the cap protects the edge box's disk. Tombstones are always written, so an ack may overshoot the
cap by a few bytes per record; the next append applies ``when_full``. Under ``drop_oldest`` room is made a
whole segment at a time (the oldest one), each of its live records counted as ``dropped_oldest``.
"""

from __future__ import annotations

import contextlib
import enum
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal, NamedTuple, get_args

from edge_agent.deadlines import DeadlineHeap
from edge_agent.spool.records import (
    HEADER_BYTES,
    KEY_BYTES,
    MAX_CALLER_BYTES,
    RecordKind,
    encode_record,
    scan_segment,
)
from edge_agent.spool.segments import FsyncPolicy, HeldWriteError, SegmentFiles

FullPolicy = Literal["block", "drop_oldest", "drop_newest"]
DropReason = Literal["dropped_oldest", "dropped_newest", "too_large", "expired", "torn", "corrupt"]
DROP_REASONS: Final[tuple[DropReason, ...]] = get_args(DropReason)


class AppendResult(enum.StrEnum):
    """What ``Spool.append`` did with a record."""

    STORED = "stored"
    DROPPED_NEWEST = "dropped_newest"  # full, policy drop_newest: refused and counted
    WOULD_BLOCK = "would_block"  # full, policy block: nothing written, the caller waits or sheds
    TOO_LARGE = "too_large"  # the record alone exceeds max_bytes: refused and counted under any policy


class SpooledRequest(NamedTuple):
    """A live record as ``Spool.records()`` hands it back."""

    request_id: bytes
    payload: bytes  # the serialized request
    deadline: float  # unix seconds; 0 = none
    caller: bytes  # the intake routing id of the caller that asked; empty when not known


@dataclass(frozen=True, slots=True)
class _Entry:
    seq: int
    offset: int
    size: int
    deadline: float
    stamp: float
    caller: bytes = b""
    payload_at: int = HEADER_BYTES + KEY_BYTES  # from ``offset``


@dataclass(slots=True)
class SpoolBatch:
    """The appends of one ``Spool.batch()``: ``failed`` is filled when it ends, with the ids whose
    records (each ``STORED`` when appended) could not be written after all, and the error; they are not
    in the spool."""

    failed: dict[bytes, OSError] = field(default_factory=dict)
    held: list[tuple[bytes, _Entry]] = field(default_factory=list)  # appended, not written yet


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
        self._live: dict[bytes, _Entry] = {}  # append order
        self._deadlines: DeadlineHeap[bytes] = DeadlineHeap()
        self._live_bytes = 0
        self._closed = False
        self._batch: SpoolBatch | None = None
        self._files = SegmentFiles(self.directory, fsync)
        try:
            self._recover()
        except OSError:
            self._files.release()
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
        return self._files.disk_bytes

    @property
    def segments(self) -> int:
        """Segment files on disk."""
        return len(self._files.segments)

    @property
    def oldest_age_s(self) -> float:
        """Seconds since the oldest live record was appended; 0 when the spool is empty."""
        oldest = next(iter(self._live.values()), None)
        return 0.0 if oldest is None else max(0.0, self._clock() - oldest.stamp)

    def append(
        self, request_id: bytes, payload: bytes, deadline: float = 0.0, caller: bytes = b""
    ) -> AppendResult:
        """Write one request, and the ``caller`` that asked (its intake routing id, at most 255 bytes;
        empty = not known); once this returns ``STORED`` it comes back from ``pending()`` and
        ``records()`` until acked.

        Appending an id that is already live writes nothing and returns ``STORED`` (a retried request).
        """
        self._check_open()
        if len(request_id) != KEY_BYTES:
            raise ValueError(f"request_id must be {KEY_BYTES} bytes, got {len(request_id)}")
        if len(caller) > MAX_CALLER_BYTES:
            raise ValueError(f"caller must be at most {MAX_CALLER_BYTES} bytes, got {len(caller)}")
        if request_id in self._live:
            return AppendResult.STORED
        prefix = 1 + len(caller) if caller else 0
        size = HEADER_BYTES + KEY_BYTES + prefix + len(payload)
        if size > self._max_bytes:
            self.drops["too_large"] += 1
            return AppendResult.TOO_LARGE
        batch = self._batch
        try:
            room = self._room_for(size)
        except HeldWriteError as exc:  # the batch's records so far could not be written: this one may
            assert batch is not None
            self._lost(batch, exc)
            room = self._room_for(size)
        if not room:
            if self._when_full == "block":
                return AppendResult.WOULD_BLOCK
            self.drops["dropped_newest"] += 1
            return AppendResult.DROPPED_NEWEST
        stamp = self._clock()
        record = encode_record(RecordKind.PUT, request_id, payload, stamp, deadline, caller)
        seq, offset = self._files.write(record) if batch is None else self._files.hold(record)
        entry = _Entry(seq, offset, size, deadline, stamp, caller, HEADER_BYTES + KEY_BYTES + prefix)
        self._remember(request_id, entry)
        if batch is not None:
            batch.held.append((request_id, entry))
        return AppendResult.STORED

    @contextlib.contextmanager
    def batch(self) -> Iterator[SpoolBatch]:
        """Appends inside are written when it ends, in one write (and one fsync under ``always``), not one
        each. Each append answers as it would alone; a record that then fails to be written leaves the
        spool again and is listed in the batch's ``failed`` (as if its append had raised), so a caller
        acknowledges what it appended only after the block. Only appends may be made inside it: the other
        calls would read or write around the held records (they raise RuntimeError)."""
        self._check_open()
        if self._batch is not None:
            raise RuntimeError("Spool.batch() is not reentrant")
        batch = self._batch = SpoolBatch()
        try:
            yield batch
        finally:
            self._batch = None
            try:
                self._files.flush()
            except HeldWriteError as exc:
                self._lost(batch, exc)
            batch.held = []

    def _check_no_batch(self) -> None:
        self._check_open()
        if self._batch is not None:
            raise RuntimeError("only appends may be made inside Spool.batch()")

    def _room_for(self, size: int) -> bool:
        self._files.roll_if_needed(size, self._segment_bytes)
        return self._make_room(size)

    def _lost(self, batch: SpoolBatch, exc: HeldWriteError) -> None:
        """The batch's records past what reached the disk intact leave the spool; ``failed`` lists them."""
        kept: list[tuple[bytes, _Entry]] = []
        for request_id, entry in batch.held:
            if entry.seq == exc.seq and entry.offset + entry.size > exc.intact_end:
                if self._live.get(request_id) is entry:
                    self._forget(request_id)
                batch.failed[request_id] = exc
            elif entry.seq != exc.seq or self._live.get(request_id) is entry:
                kept.append((request_id, entry))
        batch.held = kept

    def ack(self, request_ids: Iterable[bytes]) -> int:
        """Mark records done (answered, or refused after all); returns how many were live until now."""
        self._check_no_batch()
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
        files = self._files
        files.roll_if_needed(len(tombstones), self._segment_bytes)
        seq, _ = files.write(bytes(tombstones))
        files.segments[seq].refs.update(e.seq for e in killed if e.seq != seq and e.seq in files.segments)
        self._collect()
        return len(killed)

    def pending(self) -> Iterator[tuple[bytes, bytes, float]]:
        """``(request_id, payload, deadline)`` of the live records in append order (``records()`` without
        the caller)."""
        for record in self.records():
            yield record.request_id, record.payload, record.deadline

    def records(self) -> Iterator[SpooledRequest]:
        """The live records in append order, each with the caller that asked.

        A snapshot taken at the first ``next()``; records acked or dropped while iterating are skipped.
        """
        self._check_no_batch()
        snapshot = list(self._live.items())
        readers: dict[int, int] = {}
        try:
            for request_id, entry in snapshot:
                if self._live.get(request_id) is not entry:
                    continue
                fd = readers.get(entry.seq)
                if fd is None:
                    fd = readers[entry.seq] = os.open(self._files.segments[entry.seq].path, os.O_RDONLY)
                payload = os.pread(fd, entry.size - entry.payload_at, entry.offset + entry.payload_at)
                yield SpooledRequest(request_id, payload, entry.deadline, entry.caller)
        finally:
            for fd in readers.values():
                os.close(fd)

    def purge_expired(self, now: float | None = None) -> int:
        """Drop live records whose deadline has passed (counted as ``expired``); returns how many."""
        self._check_no_batch()
        now = self._clock() if now is None else now
        purged = 0
        for request_id in self._deadlines.pop_due(now):
            if self._forget(request_id) is not None:
                purged += 1
        self.drops["expired"] += purged
        if purged:
            self._collect()
        return purged

    def sync(self) -> None:
        """Make everything appended or acked so far durable (fsync of the active segment and directory)."""
        self._check_no_batch()
        self._files.sync()

    def begin_sync(self) -> Callable[[], None]:
        """:meth:`sync` split in two so the disk wait can leave the event loop: call this on the spool's
        thread; run what it returns on any thread. That makes everything appended or acked before this
        call durable, even if the segment is rolled or the spool closed meanwhile (it syncs its own
        duplicate of the segment's descriptor). The directory, dirty only when a segment was created or
        deleted, is synced here."""
        self._check_no_batch()
        return self._files.begin_sync()

    def close(self) -> None:
        """Flush per the fsync policy and release the directory; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._files.close()

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
        files = self._files
        seqs, self.ignored_files = files.found()
        callers: dict[bytes, bytes] = {}  # one bytes object per caller, however many records name it
        for seq in seqs:
            path = files.path(seq)
            data = path.read_bytes()
            scan = scan_segment(data)
            self.drops["corrupt"] += scan.corrupt
            size = len(data)
            if scan.torn:
                self.drops["torn"] += 1
                os.truncate(path, scan.valid_end)
                size = scan.valid_end
            segment = files.adopt(seq, size)
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
                    caller = callers.setdefault(record.caller, record.caller)
                    self._remember(
                        record.key,
                        _Entry(
                            seq,
                            record.offset,
                            record.size,
                            record.deadline,
                            record.stamp,
                            caller,
                            record.payload_at,
                        ),
                    )
        files.open_after(max(seqs, default=0))
        self._collect()

    def _remember(self, request_id: bytes, entry: _Entry) -> None:
        self._live[request_id] = entry
        self._files.segments[entry.seq].live += 1
        self._live_bytes += entry.size
        if entry.deadline > 0:
            self._deadlines.set(request_id, entry.deadline)

    def _forget(self, request_id: bytes) -> _Entry | None:
        entry = self._live.pop(request_id, None)
        if entry is not None:
            self._files.segments[entry.seq].live -= 1
            self._live_bytes -= entry.size
            self._deadlines.discard(request_id)
        return entry

    def _make_room(self, size: int) -> bool:
        """Whether ``size`` more bytes fit under ``max_bytes``, dropping oldest segments if policy says so."""
        files = self._files
        if files.disk_bytes + size <= self._max_bytes:
            return True
        active = files.active
        if active is not None and active.live == 0:
            files.roll()  # a fully acked active segment can go as soon as it is sealed
            self._collect()
        while files.disk_bytes + size > self._max_bytes:
            if self._when_full != "drop_oldest":
                return False
            oldest = files.oldest
            if oldest.seq == files.active_seq:
                files.roll()
                continue
            doomed = [k for k, e in self._live.items() if e.seq == oldest.seq]
            for request_id in doomed:
                self._forget(request_id)
            self.drops["dropped_oldest"] += len(doomed)
            files.delete(oldest)
            self._collect()
        return True

    def _collect(self) -> None:
        """Delete sealed segments with no live PUT whose tombstones no longer guard an older segment."""
        files = self._files
        for segment in list(files.segments.values()):
            if segment.seq == files.active_seq or segment.live:
                continue
            if any(ref in files.segments for ref in segment.refs):
                continue
            files.delete(segment)
