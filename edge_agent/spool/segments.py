"""The spool's directory: its lock, its segment files, appends to the active one, and their durability.

Directory layout (directory 0700, files 0600)::

    <directory>/spool.lock               flock held while a Spool is open (one writer per directory)
    <directory>/0000000000000001.wal     segments, 16-digit sequence, appended in order
    <directory>/0000000000000002.wal     ...

Any other file in the directory is ignored (and counted by the spool). Writes go to the active segment,
created on first use; rolling seals it (fsynced unless the policy is ``never``) and the next write starts
the following one.
"""

from __future__ import annotations

import fcntl
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

FsyncPolicy = Literal["always", "batch", "never"]

LOCK_NAME: Final = "spool.lock"
SEGMENT_SUFFIX: Final = ".wal"
_SEGMENT_NAME: Final = re.compile(r"(\d{16})" + re.escape(SEGMENT_SUFFIX))


class SpoolBusyError(OSError):
    """Another open Spool (this process or another) holds the directory's lock."""


class HeldWriteError(OSError):
    """Writing the held records failed: the file ``seq`` holds them intact only up to ``intact_end``
    (the rest is lost; the segment is sealed). Raised with the error that caused it as its cause."""

    def __init__(self, seq: int, intact_end: int, cause: OSError) -> None:
        super().__init__(cause.errno, cause.strerror or str(cause))
        self.seq = seq
        self.intact_end = intact_end


@dataclass(slots=True)
class Segment:
    """One segment file, and what the spool keeps per file to know when it may be deleted."""

    seq: int
    path: Path
    size: int = 0
    live: int = 0  # live PUTs in this file
    refs: set[int] = field(default_factory=set)  # older segments holding PUTs this file's DELs killed
    fd: int | None = None  # open for appending only while it is the active segment


def _nothing() -> None:
    """A sync with nothing to do."""


class SegmentFiles:
    """The segment files of one locked spool directory, in ascending sequence order.

    ``disk_bytes`` is the size of them all (what the spool's cap bounds). Raises ``SpoolBusyError`` when
    another Spool holds the directory, ``OSError`` when the directory is unusable.
    """

    def __init__(self, directory: Path, fsync: FsyncPolicy) -> None:
        self.directory = directory
        self._fsync: FsyncPolicy = fsync
        self.segments: dict[int, Segment] = {}
        self.active_seq = 1
        self.disk_bytes = 0
        self._dir_dirty = False
        # Records held in memory for one write (``hold``, then ``flush``): the active segment's tail.
        self._held: list[bytes] = []
        self._held_seq = 0
        self._held_from = 0  # the offset of the first held byte
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        directory.chmod(0o700)
        self._lock_fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(self._lock_fd)
            raise SpoolBusyError(f"spool directory {directory} is in use by another Spool") from exc

    def found(self) -> tuple[list[int], int]:
        """Sequence numbers of the segment files in the directory (ascending), and how many other files
        it holds (never read or deleted)."""
        seqs: list[int] = []
        ignored = 0
        with os.scandir(self.directory) as entries:
            for dirent in entries:
                if dirent.name == LOCK_NAME:
                    continue
                match = _SEGMENT_NAME.fullmatch(dirent.name)
                if match and dirent.is_file(follow_symlinks=False):
                    seqs.append(int(match[1]))
                else:
                    ignored += 1
        return sorted(seqs), ignored

    def path(self, seq: int) -> Path:
        return self.directory / f"{seq:016d}{SEGMENT_SUFFIX}"

    def adopt(self, seq: int, size: int) -> Segment:
        """Take an existing file of ``size`` bytes (recovery; it is never appended to again)."""
        segment = self.segments[seq] = Segment(seq, self.path(seq), size)
        self.disk_bytes += size
        return segment

    def open_after(self, seq: int) -> None:
        """New writes go to a fresh segment after ``seq``."""
        self.active_seq = seq + 1

    @property
    def active(self) -> Segment | None:
        return self.segments.get(self.active_seq)

    @property
    def oldest(self) -> Segment:
        return next(iter(self.segments.values()))

    def roll_if_needed(self, size: int, segment_bytes: int) -> None:
        active = self.active
        if active is not None and active.size > 0 and active.size + size > segment_bytes:
            self.roll()

    def roll(self) -> None:
        """Seal the active segment; the next write creates the following one."""
        self.flush()
        active = self.active
        if active is None or active.size == 0:
            return
        if active.fd is not None:
            if self._fsync != "never":
                os.fsync(active.fd)
            os.close(active.fd)
            active.fd = None
        self.active_seq += 1

    def write(self, data: bytes) -> tuple[int, int]:
        """Append ``data`` to the active segment (created on first use); returns (sequence, offset)."""
        self.flush()
        segment = self.active
        if segment is None:
            segment = self._create(self.active_seq)
        assert segment.fd is not None  # the active segment is open for as long as it is active
        offset = segment.size
        try:
            self._append(segment.fd, data)
        except OSError:
            # A partial record may be on disk: account for it and seal the file, so the next append
            # starts a clean segment and recovery counts the tail as torn.
            written = os.fstat(segment.fd).st_size - offset
            segment.size += written
            self.disk_bytes += written
            self.roll()
            raise
        segment.size += len(data)
        self.disk_bytes += len(data)
        return segment.seq, offset

    def hold(self, data: bytes) -> tuple[int, int]:
        """As ``write``, but ``data`` stays in memory until ``flush`` (or any other write, roll or sync),
        so that many records cost one write. Sizes count it at once, as if written."""
        segment = self.active
        if segment is None:
            segment = self._create(self.active_seq)
        if not self._held:
            self._held_seq, self._held_from = segment.seq, segment.size
        offset = segment.size
        self._held.append(data)
        segment.size += len(data)
        self.disk_bytes += len(data)
        return segment.seq, offset

    def flush(self) -> None:
        """Write what ``hold`` kept, in one write (and fsync, under ``always``). Raises ``HeldWriteError``
        when it fails: the bytes that did not reach the file are no longer counted, and the segment is
        sealed, as after a failed ``write``."""
        if not self._held:
            return
        data = b"".join(self._held) if len(self._held) > 1 else self._held[0]
        self._held = []
        segment = self.segments[self._held_seq]
        assert segment.fd is not None  # held bytes are the active segment's tail; it is still open
        try:
            self._append(segment.fd, data)
        except OSError as exc:
            # Whatever reached the file before the error stays (recovery reads a torn tail as torn); when
            # all of it did, the fsync failed, which makes none of it durable.
            end = os.fstat(segment.fd).st_size
            full = self._held_from + len(data)
            intact = self._held_from if end >= full else end
            lost = full - end
            segment.size -= lost
            self.disk_bytes -= lost
            try:
                self.roll()
            except OSError as again:
                raise HeldWriteError(segment.seq, intact, again) from exc
            raise HeldWriteError(segment.seq, intact, exc) from exc

    def _append(self, fd: int, data: bytes) -> None:
        """All of ``data`` to the end of the file, then the fsync the policy asks for each write."""
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if self._fsync == "always":
            os.fsync(fd)
            if self._dir_dirty:
                self._fsync_directory()

    def _create(self, seq: int) -> Segment:
        path = self.path(seq)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        os.fchmod(fd, 0o600)  # whatever the umask: requests may carry personal data
        segment = self.segments[seq] = Segment(seq, path, fd=fd)
        self._dir_dirty = True
        return segment

    def delete(self, segment: Segment) -> None:
        if segment.fd is not None:
            os.close(segment.fd)
            segment.fd = None
        segment.path.unlink()
        del self.segments[segment.seq]
        self.disk_bytes -= segment.size
        if self._fsync != "never":
            # Tombstones in a later segment may be deleted next; this deletion must land on disk first.
            self._fsync_directory()

    def sync(self) -> None:
        """Make everything written so far durable (fsync of the active segment and the directory)."""
        self.flush()
        active = self.active
        if active is not None and active.fd is not None:
            os.fsync(active.fd)
        if self._dir_dirty:
            self._fsync_directory()

    def begin_sync(self) -> Callable[[], None]:
        """``sync`` split in two so the disk wait can leave the event loop (see ``Spool.begin_sync``)."""
        self.flush()
        if self._dir_dirty:
            self._fsync_directory()
        active = self.active
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
        """Flush per the fsync policy and release the directory's lock."""
        try:
            self.flush()
            active = self.active
            if active is not None and active.fd is not None:
                if self._fsync != "never":
                    os.fsync(active.fd)
                os.close(active.fd)
                active.fd = None
            if self._dir_dirty and self._fsync != "never":
                self._fsync_directory()
        finally:
            os.close(self._lock_fd)

    def release(self) -> None:
        """Let go of the lock without flushing (an open that failed)."""
        os.close(self._lock_fd)

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self._dir_dirty = False
