"""The spool's on-disk record format, and the reader recovery uses to find intact records in a segment.

Record layout (little-endian), one after another in a segment::

    offset size field
    0      4    magic       b"\\x89WAL"
    4      4    crc32       zlib.crc32 over bytes 8.. of the header, then key, then value
    8      1    version     1, or 2 for a PUT that names its caller
    9      1    kind        1 = PUT (a request), 2 = DEL (tombstone: the request needs no resend)
    10     2    key_len     16 (the request id)
    12     4    value_len   value length; 0 for DEL
    16     8    stamp       unix seconds when appended (float64), for ``oldest_age_s`` after a restart
    24     8    deadline    unix seconds (float64) after which the request is worthless; 0 = none
    32     ...  key, then value

The value of a version 1 PUT is the serialized request. A version 2 PUT's value is one byte ``caller_len``
(1..255), the caller's identity (its intake routing id), then the serialized request: so a restarted agent
knows whom to answer. A PUT without a caller and every DEL are written as version 1, byte for byte what
agents before version 2 wrote, so their spool files load unchanged (an older agent skips a version 2
record as corrupt: downgrading loses the spooled requests that named a caller).

Damage followed by a valid record is ``corrupt`` (skipped by its length when the header is plausible,
otherwise by scanning for the next magic that starts a record with a good checksum); damage that runs to
the end of a file is ``torn``.
"""

from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass, field
from typing import Final

MAGIC: Final = b"\x89WAL"
VERSION: Final = 2
"""The newest record version written (a PUT with a caller); ``VERSIONS`` are those read."""
VERSIONS: Final = (1, 2)
KEY_BYTES: Final = 16
MAX_CALLER_BYTES: Final = 255

_HEADER: Final = struct.Struct("<4sI")  # magic, crc32
_REST: Final = struct.Struct("<BBHIdd")  # version, kind, key_len, value_len, stamp, deadline
HEADER_BYTES: Final = _HEADER.size + _REST.size


class RecordKind(enum.IntEnum):
    """What a record on disk says."""

    PUT = 1
    DEL = 2


def encode_record(
    kind: RecordKind, key: bytes, value: bytes, stamp: float, deadline: float, caller: bytes = b""
) -> bytes:
    """One record in the on-disk layout described in the module docstring: version 2 when a PUT names its
    ``caller``, else version 1."""
    if not caller:
        rest = _REST.pack(1, kind, len(key), len(value), stamp, deadline)
        crc = zlib.crc32(value, zlib.crc32(key, zlib.crc32(rest)))
        return b"".join((_HEADER.pack(MAGIC, crc), rest, key, value))
    if kind != RecordKind.PUT or len(caller) > MAX_CALLER_BYTES:
        raise ValueError(f"a caller goes on a PUT only, 1..{MAX_CALLER_BYTES} bytes")
    prefix = bytes((len(caller),)) + caller
    rest = _REST.pack(2, kind, len(key), len(prefix) + len(value), stamp, deadline)
    crc = zlib.crc32(value, zlib.crc32(prefix, zlib.crc32(key, zlib.crc32(rest))))
    return b"".join((_HEADER.pack(MAGIC, crc), rest, key, prefix, value))  # one copy of the payload


@dataclass(frozen=True, slots=True)
class ScannedRecord:
    """A record that recovery found intact: where it is and what its header says."""

    offset: int
    size: int
    kind: RecordKind
    key: bytes
    stamp: float
    deadline: float
    caller: bytes = b""  # who asked (version 2), empty when not known
    payload_at: int = HEADER_BYTES + KEY_BYTES  # where the serialized request starts, from ``offset``


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
    if version not in VERSIONS or key_len != KEY_BYTES or pos + size > end:
        return None
    if kind not in (RecordKind.PUT, RecordKind.DEL) or (kind == RecordKind.DEL and value_len):
        return None
    value_at = pos + HEADER_BYTES + key_len
    caller_len = buf[value_at] if version == 2 and value_len else 0
    if version == 2 and (kind != RecordKind.PUT or not caller_len or 1 + caller_len > value_len):
        return None
    if zlib.crc32(buf[pos + _HEADER.size : pos + size]) != crc:
        return None
    key = bytes(buf[pos + HEADER_BYTES : value_at])
    if version == 1:
        return ScannedRecord(pos, size, RecordKind(kind), key, stamp, deadline)
    caller = bytes(buf[value_at + 1 : value_at + 1 + caller_len])
    payload_at = HEADER_BYTES + key_len + 1 + caller_len
    return ScannedRecord(pos, size, RecordKind(kind), key, stamp, deadline, caller, payload_at)


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
