"""The spool keeps requests across restarts and kill -9, bounded, and never refuses to start."""

from __future__ import annotations

import asyncio
import errno
import os
import random
import select
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge_agent.spool import (
    HEADER_BYTES,
    KEY_BYTES,
    AppendResult,
    GroupCommit,
    RecordKind,
    Spool,
    SpoolBusyError,
    encode_record,
    scan_segment,
)
from gateway.testing import wait_for
from tests.edge_agent.spool_writer import payload_for, plan, request_id

ROOT = Path(__file__).resolve().parents[2]
PAYLOAD = 100
RECORD = HEADER_BYTES + KEY_BYTES + PAYLOAD  # 148 bytes on disk per test record
TWO_PER_SEGMENT = 2 * RECORD + 4


def rid(n: int) -> bytes:
    return n.to_bytes(16, "big")


def body(n: int) -> bytes:
    return bytes([n % 256]) * PAYLOAD


def ids(spool: Spool) -> list[int]:
    return [int.from_bytes(k, "big") for k, _, _ in spool.pending()]


def wal_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.wal"))


@pytest.fixture
def spool_dir(tmp_path: Path) -> Path:
    return tmp_path / "spool"


def fill(directory: Path, count: int, segment_bytes: int = 8 * 1024 * 1024) -> None:
    with Spool(directory, segment_bytes=segment_bytes) as spool:
        for n in range(count):
            assert spool.append(rid(n), body(n)) is AppendResult.STORED


def test_pending_returns_appended_records_in_order(spool_dir: Path) -> None:
    """Appended records come back from pending() with their payload and deadline, in append order."""
    with Spool(spool_dir) as spool:
        for n in (5, 1, 9):
            assert spool.append(rid(n), body(n), deadline=1e10 + n) is AppendResult.STORED
        assert list(spool.pending()) == [(rid(n), body(n), 1e10 + n) for n in (5, 1, 9)]


def test_pending_survives_reopen(spool_dir: Path) -> None:
    """Records appended before close are pending after reopening the directory."""
    fill(spool_dir, 5)
    with Spool(spool_dir) as spool:
        assert list(spool.pending()) == [(rid(n), body(n), 0.0) for n in range(5)]


def test_ack_removes_records_from_pending(spool_dir: Path) -> None:
    """Acked records leave pending(); ack counts only records that were live."""
    with Spool(spool_dir) as spool:
        for n in range(4):
            spool.append(rid(n), body(n))
        assert spool.ack([rid(1), rid(3), rid(3), rid(99)]) == 2
        assert ids(spool) == [0, 2]
        assert spool.live_records == 2


def test_ack_survives_reopen(spool_dir: Path) -> None:
    """Acks are persisted as tombstones: acked records stay gone after a reopen."""
    with Spool(spool_dir) as spool:
        for n in range(4):
            spool.append(rid(n), body(n))
        spool.ack([rid(0), rid(2)])
    with Spool(spool_dir) as spool:
        assert ids(spool) == [1, 3]


def test_append_of_live_id_writes_nothing(spool_dir: Path) -> None:
    """A retried append of a live id is stored once, keeping the first payload."""
    with Spool(spool_dir) as spool:
        spool.append(rid(1), body(1))
        before = spool.disk_bytes
        assert spool.append(rid(1), body(2)) is AppendResult.STORED
        assert spool.disk_bytes == before
        assert list(spool.pending()) == [(rid(1), body(1), 0.0)]


def test_id_may_be_appended_again_after_ack(spool_dir: Path) -> None:
    """An acked id appended again is pending again, after reopen too."""
    with Spool(spool_dir) as spool:
        spool.append(rid(1), body(1))
        spool.ack([rid(1)])
        spool.append(rid(1), body(7))
    with Spool(spool_dir) as spool:
        assert list(spool.pending()) == [(rid(1), body(7), 0.0)]


def test_appends_roll_over_into_new_segments(spool_dir: Path) -> None:
    """Past segment_bytes the spool starts a new segment file, and reads records across all of them."""
    fill(spool_dir, 7, segment_bytes=TWO_PER_SEGMENT)
    assert [p.name for p in wal_files(spool_dir)] == [f"{n:016d}.wal" for n in (1, 2, 3, 4)]
    assert all(p.stat().st_size <= TWO_PER_SEGMENT for p in wal_files(spool_dir))
    with Spool(spool_dir, segment_bytes=TWO_PER_SEGMENT) as spool:
        assert ids(spool) == list(range(7))


def test_segment_deleted_once_all_its_records_are_acked(spool_dir: Path) -> None:
    """A sealed segment file is deleted as soon as every record in it is acked."""
    with Spool(spool_dir, segment_bytes=TWO_PER_SEGMENT) as spool:
        for n in range(5):
            spool.append(rid(n), body(n))
        first, second = wal_files(spool_dir)[:2]
        spool.ack([rid(0)])
        assert first.exists()
        spool.ack([rid(1), rid(3)])
        assert not first.exists()
        assert second.exists()
        assert spool.segments == 2


def test_tombstones_kept_while_the_segment_they_guard_is_on_disk(spool_dir: Path) -> None:
    """A segment holding an ack for an older, still-present segment is kept, so no acked record returns."""
    with Spool(spool_dir, segment_bytes=TWO_PER_SEGMENT) as spool:
        spool.append(rid(0), body(0))
        spool.append(rid(1), body(1))
        spool.append(rid(2), body(2))  # second segment
        spool.ack([rid(0)])  # its tombstone lands in the second segment
        spool.append(rid(3), body(3))  # third segment: the second is sealed
        spool.ack([rid(2)])  # second segment has no live record, but guards the ack of 0
        assert len(wal_files(spool_dir)) == 3
    with Spool(spool_dir, segment_bytes=TWO_PER_SEGMENT) as spool:
        assert ids(spool) == [1, 3]
        spool.ack([rid(1)])
        assert [p.name for p in wal_files(spool_dir)] == [f"{3:016d}.wal", f"{4:016d}.wal"]


def test_drop_oldest_makes_room_and_counts(spool_dir: Path) -> None:
    """Full under drop_oldest: the oldest segment's records are dropped and counted, the new one stored."""
    with Spool(
        spool_dir, segment_bytes=TWO_PER_SEGMENT, max_bytes=3 * TWO_PER_SEGMENT, when_full="drop_oldest"
    ) as spool:
        for n in range(6):
            assert spool.append(rid(n), body(n)) is AppendResult.STORED
        assert spool.append(rid(6), body(6)) is AppendResult.STORED
        assert ids(spool) == [2, 3, 4, 5, 6]
        assert spool.drops["dropped_oldest"] == 2
        assert spool.disk_bytes <= 3 * TWO_PER_SEGMENT
    with Spool(spool_dir, segment_bytes=TWO_PER_SEGMENT, max_bytes=3 * TWO_PER_SEGMENT) as spool:
        assert ids(spool) == [2, 3, 4, 5, 6]


def test_drop_newest_refuses_and_counts(spool_dir: Path) -> None:
    """When full under drop_newest, the new record is refused and counted; the old ones stay."""
    with Spool(
        spool_dir, segment_bytes=TWO_PER_SEGMENT, max_bytes=3 * TWO_PER_SEGMENT, when_full="drop_newest"
    ) as spool:
        for n in range(6):
            spool.append(rid(n), body(n))
        assert spool.append(rid(6), body(6)) is AppendResult.DROPPED_NEWEST
        assert ids(spool) == list(range(6))
        assert spool.drops["dropped_newest"] == 1


def test_block_policy_writes_nothing_when_full(spool_dir: Path) -> None:
    """When full under block, append returns would_block, writes nothing and drops nothing."""
    with Spool(
        spool_dir, segment_bytes=TWO_PER_SEGMENT, max_bytes=3 * TWO_PER_SEGMENT, when_full="block"
    ) as spool:
        for n in range(6):
            spool.append(rid(n), body(n))
        sizes = {p.name: p.stat().st_size for p in wal_files(spool_dir)}
        assert spool.append(rid(6), body(6)) is AppendResult.WOULD_BLOCK
        assert {p.name: p.stat().st_size for p in wal_files(spool_dir)} == sizes
        assert ids(spool) == list(range(6))
        assert sum(spool.drops.values()) == 0


def test_block_policy_accepts_again_after_acks(spool_dir: Path) -> None:
    """Under block, acking the oldest segment's records frees room for the next append."""
    with Spool(
        spool_dir, segment_bytes=TWO_PER_SEGMENT, max_bytes=3 * TWO_PER_SEGMENT, when_full="block"
    ) as spool:
        for n in range(6):
            spool.append(rid(n), body(n))
        spool.ack([rid(0), rid(1)])
        assert spool.append(rid(6), body(6)) is AppendResult.STORED


def test_record_larger_than_cap_refused_as_too_large(spool_dir: Path) -> None:
    """A record that alone exceeds max_bytes is refused and counted, whatever the policy."""
    with Spool(spool_dir, segment_bytes=RECORD, max_bytes=RECORD) as spool:
        assert spool.append(rid(1), body(1)) is AppendResult.STORED
        assert spool.append(rid(2), b"x" * (PAYLOAD + 1)) is AppendResult.TOO_LARGE
        assert spool.drops["too_large"] == 1
        assert ids(spool) == [1]


def test_purge_expired_drops_records_past_deadline(spool_dir: Path) -> None:
    """purge_expired drops records whose deadline passed, counts them, and keeps the rest."""
    with Spool(spool_dir) as spool:
        spool.append(rid(1), body(1), deadline=100.0)
        spool.append(rid(2), body(2))
        spool.append(rid(3), body(3), deadline=300.0)
        assert spool.purge_expired(now=200.0) == 1
        assert ids(spool) == [2, 3]
        assert spool.drops["expired"] == 1


def test_expired_records_are_dropped_on_reopen(spool_dir: Path) -> None:
    """Recovery drops records whose deadline passed while the agent was down, using the header alone."""
    now = [1000.0]
    with Spool(spool_dir, clock=lambda: now[0]) as spool:
        spool.append(rid(1), body(1), deadline=1500.0)
        spool.append(rid(2), body(2), deadline=3000.0)
    now[0] = 2000.0
    with Spool(spool_dir, clock=lambda: now[0]) as spool:
        assert ids(spool) == [2]
        assert spool.drops["expired"] == 1


def test_stats_report_live_disk_and_age(spool_dir: Path) -> None:
    """live_records, live_bytes, disk_bytes and oldest_age_s describe what is spooled."""
    now = [1000.0]
    with Spool(spool_dir, clock=lambda: now[0]) as spool:
        assert spool.oldest_age_s == 0.0
        spool.append(rid(1), body(1))
        now[0] = 1004.0
        spool.append(rid(2), body(2))
        now[0] = 1010.0
        assert (spool.live_records, spool.live_bytes, spool.disk_bytes) == (2, 2 * RECORD, 2 * RECORD)
        assert spool.oldest_age_s == 10.0
        spool.ack([rid(1)])
        assert spool.oldest_age_s == 6.0
        assert spool.live_bytes == RECORD


def test_torn_last_record_is_counted_and_the_rest_delivered(spool_dir: Path) -> None:
    """A segment cut in the middle of its last record opens with that record counted as torn."""
    fill(spool_dir, 3)
    (segment,) = wal_files(spool_dir)
    os.truncate(segment, 3 * RECORD - 40)
    with Spool(spool_dir) as spool:
        assert ids(spool) == [0, 1]
        assert spool.drops["torn"] == 1
    assert segment.stat().st_size == 2 * RECORD  # truncated at the last intact record


def test_torn_header_is_counted(spool_dir: Path) -> None:
    """A segment ending inside a record header opens with the record counted as torn."""
    fill(spool_dir, 3)
    (segment,) = wal_files(spool_dir)
    os.truncate(segment, 2 * RECORD + 10)
    with Spool(spool_dir) as spool:
        assert ids(spool) == [0, 1]
        assert spool.drops["torn"] == 1


def test_appends_continue_cleanly_after_a_torn_tail(spool_dir: Path) -> None:
    """After a torn tail is skipped, new appends survive the next reopen and the tear is not recounted."""
    fill(spool_dir, 3)
    os.truncate(wal_files(spool_dir)[0], 3 * RECORD - 1)
    with Spool(spool_dir) as spool:
        spool.append(rid(7), body(7))
    with Spool(spool_dir) as spool:
        assert ids(spool) == [0, 1, 7]
        assert spool.drops["torn"] == 0


def test_corrupt_middle_record_is_skipped_by_length(spool_dir: Path) -> None:
    """Flipped payload bytes in a middle record fail its checksum: counted corrupt, the others delivered."""
    fill(spool_dir, 3)
    (segment,) = wal_files(spool_dir)
    data = bytearray(segment.read_bytes())
    data[RECORD + HEADER_BYTES + KEY_BYTES + 10] ^= 0xFF
    segment.write_bytes(bytes(data))
    with Spool(spool_dir) as spool:
        assert ids(spool) == [0, 2]
        assert spool.drops["corrupt"] == 1
        assert spool.drops["torn"] == 0


def test_corrupt_header_is_skipped_by_scanning_for_magic(spool_dir: Path) -> None:
    """A middle record with a garbled header is skipped by finding the next record's magic."""
    fill(spool_dir, 3)
    (segment,) = wal_files(spool_dir)
    data = bytearray(segment.read_bytes())
    data[RECORD : RECORD + 16] = b"\xff" * 16
    segment.write_bytes(bytes(data))
    with Spool(spool_dir) as spool:
        assert ids(spool) == [0, 2]
        assert spool.drops["corrupt"] == 1


def test_unknown_files_in_directory_are_ignored(spool_dir: Path) -> None:
    """Files that are not segments are ignored and counted, never read or deleted."""
    fill(spool_dir, 2)
    (spool_dir / "notes.txt").write_bytes(b"hello")
    (spool_dir / "12.wal").write_bytes(os.urandom(64))
    (spool_dir / "subdir").mkdir()
    with Spool(spool_dir) as spool:
        assert ids(spool) == [0, 1]
        assert spool.ignored_files == 3
    assert (spool_dir / "notes.txt").read_bytes() == b"hello"


def test_segment_of_random_bytes_never_raises(spool_dir: Path) -> None:
    """A segment-named file full of garbage opens as damage, and later segments are still read."""
    spool_dir.mkdir(mode=0o700)
    (spool_dir / f"{1:016d}.wal").write_bytes(random.Random(3).randbytes(5000))
    (spool_dir / f"{2:016d}.wal").write_bytes(encode_record(RecordKind.PUT, rid(9), body(9), 0.0, 0.0))
    with Spool(spool_dir) as spool:
        assert ids(spool) == [9]
        assert spool.drops["torn"] + spool.drops["corrupt"] >= 1


@given(
    cut=st.integers(0, 5 * RECORD),
    start=st.integers(0, 5 * RECORD),
    garbage=st.binary(min_size=1, max_size=300),
)
def test_any_damage_delivers_every_intact_record(cut: int, start: int, garbage: bytes) -> None:
    """Overwriting any byte range, then truncating anywhere, loses only the records those bytes touched."""
    records = [encode_record(RecordKind.PUT, rid(n), body(n), 0.0, 0.0) for n in range(5)]
    data = bytearray(b"".join(records))
    data[start : start + len(garbage)] = garbage
    data = data[: min(cut, len(data))]
    intact = [n for n, rec in enumerate(records) if data[n * RECORD : (n + 1) * RECORD] == rec]
    damaged = len(data) > len(intact) * RECORD
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "spool"
        directory.mkdir(mode=0o700)
        (directory / f"{1:016d}.wal").write_bytes(bytes(data))
        with Spool(directory) as spool:
            assert ids(spool) == intact
            assert (spool.drops["corrupt"] + spool.drops["torn"] > 0) == damaged


def test_scan_reports_offsets_of_intact_records() -> None:
    """scan_segment finds each intact record at its offset and reports a trailing partial record as torn."""
    data = b"".join(encode_record(RecordKind.PUT, rid(n), body(n), 1.0, 2.0) for n in range(3))
    scan = scan_segment(data[:-5])
    assert [(r.offset, r.key, r.deadline) for r in scan.records] == [(0, rid(0), 2.0), (RECORD, rid(1), 2.0)]
    assert (scan.torn, scan.corrupt, scan.valid_end) == (True, 0, 2 * RECORD)


def test_files_are_private(spool_dir: Path) -> None:
    """The spool directory is made 0700 (even if it existed wider) and its files 0600."""
    spool_dir.mkdir(mode=0o755)
    fill(spool_dir, 1)
    assert stat.S_IMODE(spool_dir.stat().st_mode) == 0o700
    for path in spool_dir.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_second_spool_on_same_directory_is_refused(spool_dir: Path) -> None:
    """Only one Spool may hold a directory at a time; the lock goes with close."""
    with Spool(spool_dir), pytest.raises(SpoolBusyError):
        Spool(spool_dir)
    Spool(spool_dir).close()


def test_unusable_directory_raises(tmp_path: Path) -> None:
    """A spool path that cannot be a directory raises instead of starting without durability."""
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        Spool(blocker / "spool")


def test_close_twice_is_safe_and_use_after_close_raises(spool_dir: Path) -> None:
    """close() may be called twice; appending to a closed spool raises ValueError."""
    spool = Spool(spool_dir)
    spool.close()
    spool.close()
    with pytest.raises(ValueError, match="closed"):
        spool.append(rid(1), body(1))


@pytest.mark.parametrize("policy", ["always", "batch", "never"])
def test_every_fsync_policy_round_trips(spool_dir: Path, policy: Literal["always", "batch", "never"]) -> None:
    """Under each fsync policy, records appended, synced and acked read back the same after reopen."""
    with Spool(spool_dir, fsync=policy, segment_bytes=TWO_PER_SEGMENT) as spool:
        for n in range(5):
            spool.append(rid(n), body(n))
        spool.sync()
        spool.ack([rid(0)])
    with Spool(spool_dir) as spool:
        assert ids(spool) == [1, 2, 3, 4]


def test_pending_skips_records_acked_while_iterating(spool_dir: Path) -> None:
    """Acking during a pending() iteration skips the acked records instead of failing."""
    with Spool(spool_dir, segment_bytes=TWO_PER_SEGMENT) as spool:
        for n in range(6):
            spool.append(rid(n), body(n))
        seen = []
        for key, _, _ in spool.pending():
            seen.append(int.from_bytes(key, "big"))
            spool.ack([rid(0), rid(1), rid(3)])
        assert seen == [0, 2, 4, 5]


def model_after(ops: int) -> list[int]:
    """The writer's live request numbers after its first ``ops`` operations, in append order."""
    live: dict[int, None] = {}
    steps: Iterator[tuple[str, list[int]]] = plan()
    for _ in range(ops):
        op, numbers = next(steps)
        for n in numbers:
            if op == "put":
                live[n] = None
            else:
                live.pop(n, None)
    return list(live)


def read_confirmed(proc: subprocess.Popen[bytes], at_least: int, timeout_s: float) -> bytes:
    """The writer's stdout once it has confirmed ``at_least`` operations (bounded by ``timeout_s``)."""
    assert proc.stdout is not None
    out = b""
    deadline = time.monotonic() + timeout_s
    while out.count(b"\n") < at_least:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"writer confirmed only {len(out.splitlines())} operations"
        ready, _, _ = select.select([proc.stdout], [], [], remaining)
        if ready:
            chunk = os.read(proc.stdout.fileno(), 65536)
            assert chunk, f"writer exited early: {proc.wait()}"
            out += chunk
    return out


def test_kill_9_while_writing_loses_nothing_confirmed(spool_dir: Path) -> None:
    """After SIGKILL mid-stream the spool opens holding the writer's confirmed state (or one op more)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.edge_agent.spool_writer", str(spool_dir)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
    )
    try:
        out = read_confirmed(proc, at_least=400, timeout_s=60.0)
    finally:
        proc.send_signal(signal.SIGKILL)
        rest, _ = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    lines = (out + rest).split(b"\n")
    confirmed = int(lines[-2]) + 1  # lines[-1] is empty or a half-printed line of an operation that returned
    assert len(wal_files(spool_dir)) > 2
    with Spool(spool_dir) as spool:
        got = [(k, v) for k, v, _ in spool.pending()]
        assert spool.drops["torn"] <= 1
        assert spool.drops["corrupt"] == 0
    expected = {tuple(model_after(confirmed)), tuple(model_after(confirmed + 1))}
    assert tuple(int.from_bytes(k, "big") for k, _ in got) in expected
    assert all(v == payload_for(int.from_bytes(k, "big")) for k, v in got)
    assert all(k == request_id(int.from_bytes(k, "big")) for k, _ in got)


Op = tuple[str, list[int], bytes]
OPS = st.lists(
    st.tuples(
        st.sampled_from(["append", "append", "ack", "reopen"]),
        st.lists(st.integers(0, 12), min_size=1, max_size=4),
        st.binary(max_size=80),
    ),
    max_size=60,
)


@given(ops=OPS)
def test_pending_matches_model_through_appends_acks_and_reopens(ops: list[Op]) -> None:
    """Any sequence of append/ack/reopen keeps pending() equal to appended-minus-acked, in order."""
    model: dict[bytes, bytes] = {}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "spool"

        def open_spool() -> Spool:
            return Spool(directory, segment_bytes=256, max_bytes=1 << 40)

        spool = open_spool()
        try:
            for op, numbers, payload in ops:
                if op == "append":
                    key = rid(numbers[0])
                    assert spool.append(key, payload) is AppendResult.STORED
                    model.setdefault(key, payload)
                elif op == "ack":
                    keys = [rid(n) for n in numbers]
                    expected = len({k for k in keys if k in model})
                    for k in keys:
                        model.pop(k, None)
                    assert spool.ack(keys) == expected
                else:
                    spool.close()
                    spool = open_spool()
                assert [(k, v) for k, v, _ in spool.pending()] == list(model.items())
            spool.ack(list(model))
            assert spool.segments <= 1
            assert sum(spool.drops.values()) == 0
        finally:
            spool.close()


# ---------------------------------------------------------------------- group commit (fsync off the loop)


def _file_fsyncs(
    monkeypatch: pytest.MonkeyPatch, delays_s: tuple[float, ...] = (), failing: frozenset[int] = frozenset()
) -> list[tuple[str, float]]:
    """Wrap os.fsync for regular files (directories are synced as before): log ("start"/"end", time) per
    call; call ``n`` (from 0) first sleeps ``delays_s[n]`` (the last value for later calls, none if empty)
    and raises EIO when ``n`` is in ``failing``."""
    real = os.fsync
    log: list[tuple[str, float]] = []

    def fsync(fd: int) -> None:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            real(fd)
            return
        n = sum(1 for what, _ in log if what == "start")
        log.append(("start", time.monotonic()))
        if delays_s:
            time.sleep(delays_s[min(n, len(delays_s) - 1)])
        if n in failing:
            raise OSError(errno.EIO, "injected: I/O error")
        real(fd)
        log.append(("end", time.monotonic()))

    monkeypatch.setattr(os, "fsync", fsync)
    return log


async def test_concurrent_commits_share_fsyncs(spool_dir: Path) -> None:
    """Forty frames appended and committed at once: every commit returns, with far fewer fsyncs than
    commits, and every record is there after reopening."""
    spool = Spool(spool_dir, fsync="batch")
    commit = GroupCommit(spool)

    async def frame(n: int) -> None:
        assert spool.append(rid(n), body(n)) is AppendResult.STORED
        await commit.commit()

    try:
        await asyncio.wait_for(asyncio.gather(*(frame(n) for n in range(40))), timeout=10)
        assert 1 <= commit.fsyncs < 40
    finally:
        commit.close()
        spool.close()
    with Spool(spool_dir) as reopened:
        assert ids(reopened) == list(range(40))


async def test_a_commit_waits_for_an_fsync_that_started_after_its_append(
    spool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frame appended while an fsync is already running is not covered by it: its commit returns only
    after the next fsync has ended."""
    log = _file_fsyncs(monkeypatch, delays_s=(0.05,))
    spool = Spool(spool_dir, fsync="batch")
    commit = GroupCommit(spool)
    try:
        spool.append(rid(1), body(1))
        first = asyncio.create_task(commit.commit())
        await wait_for(lambda: bool(log), timeout_s=5, what="the first fsync started on its thread")
        spool.append(rid(2), body(2))
        await commit.commit()
        returned = time.monotonic()
        await first
        assert commit.fsyncs == 2
        ends = [t for what, t in log if what == "end"]
        assert len(ends) == 2
        assert returned >= ends[1]
    finally:
        commit.close()
        spool.close()


def test_begin_sync_still_works_after_the_segment_rolled_and_the_spool_closed(spool_dir: Path) -> None:
    """The fsync prepared on one thread may run after the spool rolled to a new segment and even closed
    (every descriptor of its own closed): it syncs its own duplicate, not a closed or reused one."""
    spool = Spool(spool_dir, segment_bytes=TWO_PER_SEGMENT, fsync="batch")
    spool.append(rid(1), body(1))
    run = spool.begin_sync()
    for n in range(2, 6):
        spool.append(rid(n), body(n))  # rolls, closing the first segment
    assert len(wal_files(spool_dir)) > 1
    spool.close()
    run()  # EBADF here if it synced the spool's own descriptor
    with Spool(spool_dir) as reopened:
        assert ids(reopened) == [1, 2, 3, 4, 5]


async def test_a_failed_fsync_fails_its_commit_and_the_next_one_retries(
    spool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An fsync error reaches the commit it would have covered; the next commit runs a new fsync."""
    _file_fsyncs(monkeypatch, failing=frozenset({0}))
    spool = Spool(spool_dir, fsync="batch")
    commit = GroupCommit(spool)
    try:
        spool.append(rid(1), body(1))
        with pytest.raises(OSError, match="injected"):
            await commit.commit()
        spool.append(rid(2), body(2))
        await commit.commit()
        assert commit.fsyncs == 2
    finally:
        commit.close()
        spool.close()


async def test_a_failed_fsync_fails_every_commit_it_covered_even_if_the_next_succeeds(
    spool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two frames appended while an fsync runs share the next one; when that fails, both commits fail,
    though a third fsync would succeed (after a write-back error the kernel may have dropped their pages:
    a later success does not cover them)."""
    # The first runs while frames 2 and 3 arrive; the second, covering them, fails.
    log = _file_fsyncs(monkeypatch, delays_s=(0.1, 0.0), failing=frozenset({1}))

    def started() -> int:
        return sum(1 for what, _ in log if what == "start")

    spool = Spool(spool_dir, fsync="batch")
    commit = GroupCommit(spool)
    try:
        spool.append(rid(1), body(1))
        first = asyncio.create_task(commit.commit())
        await wait_for(lambda: started() == 1, timeout_s=5, what="the first fsync started")
        spool.append(rid(2), body(2))
        second = asyncio.create_task(commit.commit())
        spool.append(rid(3), body(3))
        third = asyncio.create_task(commit.commit())
        outcomes = await asyncio.gather(first, second, third, return_exceptions=True)
        assert outcomes[0] is None
        assert all(isinstance(o, OSError) for o in outcomes[1:]), outcomes
        assert started() == 2
        spool.append(rid(4), body(4))
        await commit.commit()  # a frame after the failure gets an fsync of its own
        assert started() == 3
    finally:
        commit.close()
        spool.close()


# ---------------------------------------------------------------------- batches of appends (one write)


def _spool_writes(
    monkeypatch: pytest.MonkeyPatch, directory: Path, fail_after: int | None = None
) -> list[int]:
    """Wrap os.write for the files under ``directory``: log each call's size; with ``fail_after``, a call
    writes at most that many bytes in all (a partial write), then raises ENOSPC: a disk that filled up."""
    real = os.write
    log: list[int] = []
    prefix = str(directory.resolve())

    def write(fd: int, data: bytes | memoryview) -> int:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if not target.startswith(prefix):
            return real(fd, data)
        log.append(len(data))
        if fail_after is not None:
            room = fail_after - sum(log[:-1])
            if room <= 0:
                raise OSError(errno.ENOSPC, "injected: no space left on device")
            return real(fd, bytes(data)[:room])
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    return log


def test_a_batch_of_appends_is_one_write_at_its_end(spool_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Appends inside ``batch()`` answer STORED at once, reach the file in one write when the block ends,
    and read back (also after reopening) exactly as appends made one by one."""
    with Spool(spool_dir) as spool:
        writes = _spool_writes(monkeypatch, spool_dir)
        with spool.batch() as written:
            for n in range(10):
                assert spool.append(rid(n), body(n), deadline=1e10 + n) is AppendResult.STORED
            assert writes == []  # held until the block ends
            assert spool.live_records == 10
            with pytest.raises(RuntimeError, match="only appends"):
                ids(spool)  # it would read the file around the held records
        assert writes == [10 * RECORD]
        assert written.failed == {}
        assert spool.append(rid(10), body(10)) is AppendResult.STORED  # outside a batch: a write each
        assert writes == [10 * RECORD, RECORD]
    monkeypatch.undo()
    with Spool(spool_dir) as spool:
        assert list(spool.pending())[:10] == [(rid(n), body(n), 1e10 + n) for n in range(10)]
        assert ids(spool) == list(range(11))
        assert sum(spool.drops.values()) == 0


def test_a_batch_whose_write_fails_lists_what_did_not_reach_the_disk(
    spool_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that fills up in the middle of a batch's write: the records past the last intact one are
    listed in ``failed`` and leave the spool (not pending, not counted), the intact ones stay, reopening
    finds only those (the torn one counted), and the next appends go on in a new segment."""
    with Spool(spool_dir) as spool:
        _spool_writes(monkeypatch, spool_dir, fail_after=2 * RECORD + RECORD // 2)
        with spool.batch() as written:
            for n in range(5):
                assert spool.append(rid(n), body(n)) is AppendResult.STORED
        assert sorted(written.failed) == [rid(n) for n in range(2, 5)]
        assert all(e.errno == errno.ENOSPC for e in written.failed.values())
        assert ids(spool) == [0, 1]
        assert spool.live_records == 2
        monkeypatch.undo()
        assert spool.append(rid(7), body(7)) is AppendResult.STORED
        assert len(wal_files(spool_dir)) == 2  # the failed segment was sealed
    with Spool(spool_dir) as spool:
        assert ids(spool) == [0, 1, 7]
        assert spool.drops["torn"] == 1


def test_only_appends_are_made_inside_a_batch(spool_dir: Path) -> None:
    """Batches do not nest, and the calls that read or write around the held records are refused."""
    with Spool(spool_dir) as spool, spool.batch():
        with pytest.raises(RuntimeError, match="reentrant"), spool.batch():
            pass
        for call in (lambda: spool.ack([rid(1)]), spool.sync, spool.begin_sync, spool.purge_expired):
            with pytest.raises(RuntimeError, match="only appends"):
                call()
