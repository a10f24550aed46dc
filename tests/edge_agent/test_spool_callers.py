"""The spool keeps who asked with each request (record version 2), and still loads version 1 files."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest

from edge_agent.spool import (
    HEADER_BYTES,
    KEY_BYTES,
    RecordKind,
    Spool,
    SpooledRequest,
    encode_record,
    scan_segment,
)


def rid(n: int) -> bytes:
    return n.to_bytes(16, "big")


def body(n: int) -> bytes:
    return bytes([n % 256]) * 50


def test_the_caller_comes_back_with_its_request_after_a_reopen(tmp_path: Path) -> None:
    """append(caller=...) then reopen: records() hands back each request with the caller that asked."""
    with Spool(tmp_path) as spool:
        spool.append(rid(1), body(1), 1e10, caller=b"search.host.1")
        spool.append(rid(2), body(2), 0.0)
        spool.append(rid(3), body(3), 0.0, caller=b"ads")
        spool.ack([rid(3)])
    with Spool(tmp_path) as spool:
        assert list(spool.records()) == [
            SpooledRequest(rid(1), body(1), 1e10, b"search.host.1"),
            SpooledRequest(rid(2), body(2), 0.0, b""),
        ]
        assert list(spool.pending()) == [(rid(1), body(1), 1e10), (rid(2), body(2), 0.0)]


def test_a_version_1_file_loads_with_no_caller(tmp_path: Path) -> None:
    """A segment an older agent wrote (version 1 records only) loads; its requests have no caller."""
    old = b"".join(encode_record(RecordKind.PUT, rid(n), body(n), 0.0, 0.0) for n in range(3))
    old += encode_record(RecordKind.DEL, rid(1), b"", 0.0, 0.0)
    assert {old[8 + i * (HEADER_BYTES + KEY_BYTES + 50)] for i in range(3)} == {1}  # version byte
    (tmp_path / f"{1:016d}.wal").write_bytes(old)
    with Spool(tmp_path) as spool:
        assert list(spool.records()) == [
            SpooledRequest(rid(0), body(0), 0.0, b""),
            SpooledRequest(rid(2), body(2), 0.0, b""),
        ]
        assert spool.drops["corrupt"] == 0 and spool.drops["torn"] == 0
        spool.append(rid(7), body(7), 0.0, caller=b"svc")  # new records go to a fresh segment
    with Spool(tmp_path) as spool:
        assert [r.caller for r in spool.records()] == [b"", b"", b"svc"]


def test_records_without_a_caller_are_written_as_version_1(tmp_path: Path) -> None:
    """Byte for byte what older agents wrote, so a downgrade keeps requests that named no caller."""
    with Spool(tmp_path, fsync="never") as spool:
        spool.append(rid(1), body(1), 5.0)
    data = (tmp_path / f"{1:016d}.wal").read_bytes()
    assert data[8] == 1 and len(data) == HEADER_BYTES + KEY_BYTES + 50
    assert data[HEADER_BYTES + KEY_BYTES :] == body(1)


def test_a_version_2_record_holds_the_caller_before_the_request() -> None:
    """value = caller length, caller, serialized request; the scan finds where the request starts."""
    data = encode_record(RecordKind.PUT, rid(1), body(1), 1.0, 2.0, caller=b"svc")
    assert data[8] == 2
    assert data[HEADER_BYTES + KEY_BYTES :] == b"\x03svc" + body(1)
    (record,) = scan_segment(data).records
    assert (record.caller, record.payload_at) == (b"svc", HEADER_BYTES + KEY_BYTES + 4)


def test_a_caller_length_beyond_its_record_is_damage_not_a_caller() -> None:
    """A version 2 record whose caller length overruns its value (CRC made to match) is skipped."""
    good = encode_record(RecordKind.PUT, rid(2), body(2), 1.0, 2.0, caller=b"ok")
    value = b"\xff" + b"abc"
    rest = struct.pack("<BBHIdd", 2, RecordKind.PUT, KEY_BYTES, len(value), 1.0, 2.0)
    crc = zlib.crc32(value, zlib.crc32(rid(1), zlib.crc32(rest)))
    bad = b"\x89WAL" + struct.pack("<I", crc) + rest + rid(1) + value
    scan = scan_segment(bad + good)
    assert [r.key for r in scan.records] == [rid(2)] and scan.corrupt == 1


def test_a_caller_is_at_most_255_bytes(tmp_path: Path) -> None:
    """The caller length is one byte: a longer caller is refused, not truncated."""
    with Spool(tmp_path) as spool:
        with pytest.raises(ValueError, match="at most 255 bytes"):
            spool.append(rid(1), body(1), 0.0, caller=b"x" * 256)
        spool.append(rid(2), body(2), 0.0, caller=b"x" * 255)
        assert [r.caller for r in spool.records()] == [b"x" * 255]


def test_the_caller_counts_toward_the_record_size(tmp_path: Path) -> None:
    """live_bytes includes the caller prefix: the size cap bounds what is on disk."""
    with Spool(tmp_path, fsync="never") as spool:
        spool.append(rid(1), body(1), 0.0, caller=b"svc")
        assert spool.live_bytes == HEADER_BYTES + KEY_BYTES + 4 + 50 == spool.disk_bytes
