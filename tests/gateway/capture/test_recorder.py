"""The capture recorder: rotation and retention caps, drops counted when the queue or the disk fails."""

from __future__ import annotations

import errno
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from edgewire import DictionaryStore, FrameCodec, pb
from gateway.capture import format as capture_format
from gateway.capture.format import SUFFIX, read_capture, read_header
from gateway.capture.recorder import CaptureRecorder
from gateway.capture.redact import Redactor
from gateway.config import CaptureConfig
from gateway.ops.metrics import GatewayMetrics
from gateway.testing import wait_for


def recorder(tmp_path: Path, **overrides: Any) -> tuple[CaptureRecorder, GatewayMetrics]:
    metrics = GatewayMetrics(["rank-mlp"])
    config = CaptureConfig(enabled=True, directory=str(tmp_path / "cap"), flush_interval_s=0.05, **overrides)
    return CaptureRecorder(config, instance="gw", dictionaries=lambda: [], metrics=metrics), metrics


def count(metrics: GatewayMetrics, outcome: str) -> float:
    return metrics.registry.get_sample_value("hkgw_capture_records_total", {"outcome": outcome}) or 0.0


def records(directory: Path) -> list[Any]:
    out = []
    for path in sorted(directory.glob(f"*{SUFFIX}")):
        out.extend(e for e in read_capture(path) if not isinstance(e, capture_format.Corrupt))
    return out


async def test_offered_messages_reach_a_private_file_in_order(tmp_path: Path) -> None:
    """Every offered message is written, in order, with its carrier, agent and region; files are 0600."""
    rec, metrics = recorder(tmp_path)
    rec.start()
    for i in range(100):
        rec.offer("hgc", f"agent-{i % 2}", "us-west", [b"env%d" % i, memoryview(b"payload")])
    rec.close()
    got = records(tmp_path / "cap")
    assert [r.frames[0] for r in got] == [b"env%d" % i for i in range(100)]
    assert {(r.carrier, r.region) for r in got} == {("hgc", "us-west")}
    assert count(metrics, "written") == 100
    for path in (tmp_path / "cap").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "cap").stat().st_mode) == 0o700


async def test_files_rotate_by_size_and_the_oldest_go_beyond_the_caps(tmp_path: Path) -> None:
    """Small files rotate; no more than max_files stay, and their total stays near max_total_bytes."""
    rec, metrics = recorder(tmp_path, max_file_bytes=1 << 16, max_files=3, max_total_bytes=1 << 20, level=1)
    rec.start()
    for i in range(100):
        rec.offer("hgc", "a", "r", [i.to_bytes(4, "little") + os.urandom(20_000)])  # incompressible
        if i % 20 == 0:
            await wait_for(lambda: rec._queue.qsize() < 5, timeout_s=10)
    rec.close()
    files = list((tmp_path / "cap").glob(f"*{SUFFIX}"))
    assert len(files) <= 3
    assert sum(p.stat().st_size for p in files) <= (1 << 20) + (1 << 16) + 20_100
    assert count(metrics, "written") == 100
    kept = [int.from_bytes(r.frames[0][:4], "little") for r in records(tmp_path / "cap")]
    assert kept and kept == list(range(100 - len(kept), 100))  # the newest survive, the oldest were deleted
    assert all(read_header(p) is not None for p in files)


def test_full_queue_drops_and_counts_without_blocking(tmp_path: Path) -> None:
    """With the writer stalled, offers beyond the queue bound are dropped and counted instead of waiting for
    room (nothing drains this queue: an offer that waited would never return)."""
    rec, metrics = recorder(tmp_path, queue_records=5)  # not started: nothing drains the queue
    for _ in range(50):
        rec.offer("hgc", "a", "r", [b"x" * 100])
    assert rec._queue.qsize() == 5
    assert count(metrics, "dropped_queue_full") == 45


async def test_write_error_drops_and_counts_then_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk (injected ENOSPC) drops and counts records; when space returns a new file is written."""
    rec, metrics = recorder(tmp_path, retry_after_s=0.2)
    rec.start()
    for i in range(10):
        rec.offer("hgc", "a", "r", [b"before-%d" % i])
    await wait_for(lambda: len(records(tmp_path / "cap")) == 10)  # written and flushed to the file

    def disk_full(self: Any, record: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(capture_format.CaptureFile, "append", disk_full)
        for i in range(20):
            rec.offer("hgc", "a", "r", [b"lost-%d" % i])
        await wait_for(lambda: count(metrics, "dropped_write_error") == 20)
    await wait_for(lambda: time.monotonic() > rec._retry_at)
    for i in range(5):
        rec.offer("hgc", "a", "r", [b"after-%d" % i])
    await wait_for(lambda: count(metrics, "written") == 15)
    rec.close()
    frames = [r.frames[0] for r in records(tmp_path / "cap")]
    assert frames == [b"before-%d" % i for i in range(10)] + [b"after-%d" % i for i in range(5)]


def test_capture_off_costs_nothing_and_bounded_capture_ends(tmp_path: Path) -> None:
    """Off: offers are ignored. enable_for(s) captures until s have passed, capped by max_enable_s."""
    now = [1000.0]
    metrics = GatewayMetrics([])
    config = CaptureConfig(directory=str(tmp_path), max_enable_s=60)
    rec = CaptureRecorder(
        config, instance="gw", dictionaries=lambda: [], metrics=metrics, clock=lambda: now[0]
    )
    rec.offer("hgc", "a", "r", [b"x"])
    assert rec._queue.qsize() == 0 and not rec.active()
    assert rec.enable_for(3600) == 1060.0
    rec.offer("hgc", "a", "r", [b"x"])
    now[0] = 1061.0
    rec.offer("hgc", "a", "r", [b"x"])
    assert rec._queue.qsize() == 1
    assert metrics.registry.get_sample_value("hkgw_capture_active") == 0


def test_redaction_hashes_user_and_session_ids_consistently() -> None:
    """Ranking user/session ids become keyed tokens, the same id the same token; the batch still decodes."""
    codec = FrameCodec()
    batch = pb.RequestBatch(
        requests=[
            pb.InferRequest(
                model_name="rank-mlp", ranking=pb.RankingFeatures(user_id="u-1", session_id="s-9")
            ),
            pb.InferRequest(model_name="rank-mlp", ranking=pb.RankingFeatures(user_id="u-1")),
        ]
    )
    frames = codec.encode(batch, agent_id="a", region="us-west")
    redactor = Redactor(b"k" * 32, DictionaryStore())
    out = codec.decode(list(redactor.redact(frames)))
    assert isinstance(out.payload, pb.RequestBatch)
    first, second = out.payload.requests
    assert first.ranking.user_id == second.ranking.user_id == redactor.token("u-1") != "u-1"
    assert first.ranking.session_id.startswith("r-") and second.ranking.session_id == ""
    assert out.envelope.message_id == codec.decode(frames).envelope.message_id
    assert Redactor(b"z" * 32, DictionaryStore()).token("u-1") != redactor.token("u-1")


def test_unredactable_message_is_dropped_not_written_in_clear(tmp_path: Path) -> None:
    """With redaction on, a message that does not decode is dropped and counted."""
    metrics = GatewayMetrics([])
    config = CaptureConfig(enabled=True, directory=str(tmp_path / "cap"), redact=True)
    rec = CaptureRecorder(
        config,
        instance="gw",
        dictionaries=lambda: [],
        metrics=metrics,
        redactor=Redactor(b"k" * 32, DictionaryStore()),
    )
    rec.start()
    rec.offer("hgc", "", "", [b"\xff garbage", b"more"])
    rec.close()
    assert count(metrics, "dropped_redaction") == 1
    assert records(tmp_path / "cap") == []
