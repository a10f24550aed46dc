"""Capture files: round trip, 0600, and every record before a cut survives (crash, full disk)."""

from __future__ import annotations

import stat
from pathlib import Path

from edgewire.pb.edgeinfer.v1 import capture_pb2 as cpb
from gateway.capture.format import FORMAT_VERSION, MAGIC, CaptureFile, Corrupt, read_capture, read_header


def header() -> cpb.CaptureHeader:
    return cpb.CaptureHeader(magic=MAGIC, format_version=FORMAT_VERSION, instance="t", created_unix_us=1)


def record(i: int) -> cpb.CaptureRecord:
    return cpb.CaptureRecord(
        arrival_unix_us=1000 + i,
        carrier="hgc",
        agent_id=f"a{i % 3}",
        region="us-west",
        frames=[b"e" * i, b"p"],
    )


def test_records_round_trip_in_order_and_file_is_private(tmp_path: Path) -> None:
    """What is appended is read back in order; the file is created 0600."""
    path = tmp_path / "x.hkcap"
    capture = CaptureFile(path, header())
    for i in range(200):
        capture.append(record(i))
    capture.close()
    capture.close()  # twice is safe
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    got = list(read_capture(path))
    assert got == [record(i) for i in range(200)]
    assert read_header(path) == header()


def test_flushed_records_are_readable_while_the_file_is_open(tmp_path: Path) -> None:
    """After flush(), a reader sees every record so far, and the open end is reported, not raised."""
    path = tmp_path / "open.hkcap"
    capture = CaptureFile(path, header())
    for i in range(10):
        capture.append(record(i))
    capture.flush()
    entries = list(read_capture(path))
    capture.close()
    assert entries[:10] == [record(i) for i in range(10)]
    assert all(isinstance(e, Corrupt) for e in entries[10:])


def test_cut_file_keeps_every_record_before_the_cut(tmp_path: Path) -> None:
    """A file cut after a flush (crash, full disk) gives every record flushed before the cut, then Corrupt."""
    path = tmp_path / "full.hkcap"
    capture = CaptureFile(path, header())
    flushed = 0
    for i in range(100):
        capture.append(record(i))
        if i == 49:
            capture.flush()
            flushed = capture.compressed_bytes
    capture.close()
    data = path.read_bytes()
    cut = path.parent / "cut.hkcap"
    cut.write_bytes(data[: flushed + (len(data) - flushed) // 2])
    entries = list(read_capture(cut))
    records = [e for e in entries if isinstance(e, cpb.CaptureRecord)]
    assert records == [record(i) for i in range(len(records))]
    assert len(records) >= 50
    assert isinstance(entries[-1], Corrupt)


def test_other_files_are_reported_not_raised(tmp_path: Path) -> None:
    """Garbage, an empty file and a zstd stream without a header are each one Corrupt entry."""
    import zstandard

    garbage = tmp_path / "g.hkcap"
    garbage.write_bytes(b"not zstd at all" * 10)
    empty = tmp_path / "e.hkcap"
    empty.write_bytes(b"")
    headless = tmp_path / "h.hkcap"
    headless.write_bytes(zstandard.ZstdCompressor().compress(b"\x03\x00\x00\x00abc"))
    assert all(isinstance(e, Corrupt) for e in read_capture(garbage))
    assert list(read_capture(empty)) == []
    assert [type(e) for e in read_capture(headless)] == [Corrupt]
