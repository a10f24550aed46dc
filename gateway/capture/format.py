"""Capture files: one zstd stream of length-prefixed ``CaptureEntry`` messages (docs/CAPTURE.md).

:class:`CaptureFile` writes one file (created 0600, header first, records after, flushed to a readable
state on :meth:`CaptureFile.flush`); :func:`read_capture` reads one back, yielding each record or a
:class:`Corrupt` marker, never raising on bad content: a file cut short by a crash or a full disk still gives
every record before the cut.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeAlias

import zstandard
from google.protobuf.message import DecodeError

from edgewire import CodecLimits, DictionaryStore, FrameCodec
from edgewire.pb.edgeinfer.v1 import capture_pb2 as cpb

MAGIC: Final = "hk-edge-gateway capture"
FORMAT_VERSION: Final = 1
SUFFIX: Final = ".hkcap"
# Captured frames were within the capturing gateway's limits (or were refused there): read them generously.
READ_LIMITS: Final = CodecLimits(
    max_frame_bytes=64 << 20, max_decompressed_bytes=256 << 20, max_records=1 << 16
)
MAX_ENTRY_BYTES: Final = 128 << 20  # larger than any frame the gateway accepts, plus its record fields
_LENGTH: Final = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class Corrupt:
    """Unreadable content in a capture file: what was wrong, and where (byte offset in the stream)."""

    offset: int
    reason: str


Entry: TypeAlias = cpb.CaptureRecord | Corrupt


class CaptureFile:
    """One capture file being written. Not thread-safe: the capture writer thread owns it."""

    def __init__(self, path: Path, header: cpb.CaptureHeader, *, level: int = 3) -> None:
        self.path = path
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        self._raw = os.fdopen(fd, "wb")
        self._zstd = zstandard.ZstdCompressor(level=level).stream_writer(self._raw, closefd=False)
        self.records = 0
        self.uncompressed_bytes = 0
        self._write(cpb.CaptureEntry(header=header))

    @property
    def compressed_bytes(self) -> int:
        """Bytes on disk so far (what has left the compressor)."""
        return self._raw.tell()

    def append(self, record: cpb.CaptureRecord) -> int:
        """Add one record; returns its uncompressed size. Raises OSError when the disk refuses."""
        size = self._write(cpb.CaptureEntry(record=record))
        self.records += 1
        return size

    def flush(self) -> None:
        """End the current zstd block and write it out, so a reader sees every record appended so far."""
        self._zstd.flush(zstandard.FLUSH_BLOCK)
        self._raw.flush()

    def close(self) -> None:
        """Finish the zstd frame and close; safe twice. Raises OSError if the last write fails."""
        if self._raw.closed:
            return
        try:
            self._zstd.flush(zstandard.FLUSH_FRAME)
            self._raw.flush()
            os.fsync(self._raw.fileno())
        finally:
            self._raw.close()

    def abandon(self) -> None:
        """Close without flushing (after a write error); what reached the disk stays readable."""
        with contextlib.suppress(OSError):  # the buffered tail fails to flush; the descriptor still closes
            self._raw.close()

    def _write(self, entry: cpb.CaptureEntry) -> int:
        data = entry.SerializeToString()
        self._zstd.write(_LENGTH.pack(len(data)))
        self._zstd.write(data)
        self.uncompressed_bytes += _LENGTH.size + len(data)
        return _LENGTH.size + len(data)


def reader_codec(header: cpb.CaptureHeader | None) -> FrameCodec:
    """A codec that decodes a file's captured frames: generous limits, the dictionaries its header holds."""
    store = DictionaryStore()
    for dictionary in header.dictionaries if header is not None else ():
        store.add(dictionary.data, prefer=False)
    return FrameCodec(READ_LIMITS, store)


def read_header(path: Path) -> cpb.CaptureHeader | None:
    """The file's header, or None when the file does not start with one."""
    for entry in _entries(path):
        if isinstance(entry, cpb.CaptureEntry) and entry.WhichOneof("entry") == "header":
            return entry.header
        return None
    return None


def read_capture(path: Path) -> Iterator[Entry]:
    """Every record of a capture file in order; unreadable content as :class:`Corrupt` (then it stops)."""
    first = True
    for entry in _entries(path):
        if isinstance(entry, Corrupt):
            yield entry
            return
        which = entry.WhichOneof("entry")
        if first:
            first = False
            if which != "header" or entry.header.magic != MAGIC:
                yield Corrupt(0, "not a capture file (no header)")
                return
            if entry.header.format_version != FORMAT_VERSION:
                yield Corrupt(0, f"format version {entry.header.format_version}, this reads {FORMAT_VERSION}")
                return
            continue
        if which == "record":
            yield entry.record
        else:
            yield Corrupt(-1, f"unexpected {which or 'empty'} entry")


def _entries(path: Path) -> Iterator[cpb.CaptureEntry | Corrupt]:
    buffer = bytearray()
    offset = 0  # of buffer[0] in the decompressed stream
    stream = _decompressed(path)
    while True:
        while len(buffer) < _LENGTH.size or len(buffer) < _LENGTH.size + _LENGTH.unpack_from(buffer)[0]:
            if len(buffer) >= _LENGTH.size and _LENGTH.unpack_from(buffer)[0] > MAX_ENTRY_BYTES:
                size = _LENGTH.unpack_from(buffer)[0]
                yield Corrupt(offset, f"entry of {size} bytes, more than {MAX_ENTRY_BYTES}")
                return
            try:
                chunk = next(stream, None)
            except zstandard.ZstdError as exc:
                yield Corrupt(offset, f"zstd: {exc}")
                return
            except _Unfinished:
                yield Corrupt(offset, "ends inside a zstd frame (still being written, or cut short)")
                return
            if chunk is None:
                if buffer:
                    yield Corrupt(offset, f"truncated entry: {len(buffer)} bytes left at the end")
                return
            buffer += chunk
        (size,) = _LENGTH.unpack_from(buffer)
        entry = cpb.CaptureEntry()
        try:
            entry.ParseFromString(bytes(buffer[_LENGTH.size : _LENGTH.size + size]))
        except DecodeError as exc:
            yield Corrupt(offset, f"invalid entry: {exc}")
            return
        del buffer[: _LENGTH.size + size]
        offset += _LENGTH.size + size
        yield entry


def _decompressed(path: Path, chunk_bytes: int = 1 << 20) -> Iterator[bytes]:
    """The decompressed content, across zstd frames, including a last frame that was never finished
    (everything flushed before a crash or a full disk is there)."""
    dctx = zstandard.ZstdDecompressor()
    with path.open("rb") as raw:
        obj = dctx.decompressobj()
        fed = False  # input given to the current frame
        while chunk := raw.read(chunk_bytes):
            while chunk:
                fed = True
                out = obj.decompress(chunk)
                if out:
                    yield out
                if obj.eof:
                    chunk = obj.unused_data
                    obj = dctx.decompressobj()
                    fed = False
                else:
                    chunk = b""
        if fed:
            raise _Unfinished


class _Unfinished(Exception):
    """The content ends inside a zstd frame."""
