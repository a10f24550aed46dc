"""Replay captured traffic through the real protocol, and compare routing decisions with a golden file.

:func:`replay` reads capture files in order and re-sends every captured request batch to a gateway
endpoint over a ZeroMQ DEALER, at the captured inter-arrival timing scaled by ``speed`` (or as fast as a
bounded window allows). Each batch is re-encoded: message and request ids are new (or the original ones,
which a gateway that already served them answers as duplicates), and deadlines keep the remaining budget
they had on arrival. Pings and dictionary requests are agent housekeeping and are not replayed; messages
that never decoded are counted and skipped.

Each request ends with one outcome: a response (status, tier, pool, route reason), a nack (reason), a
duplicate ack, or lost (nothing before the timeout). :class:`ReplaySummary` aggregates them;
``decisions`` lists them per request in capture order, keyed by the original request id, for
``--record-decisions`` and :func:`compare_decisions`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, TextIO

import numpy as np
import zmq
import zmq.asyncio

from edgewire import FrameCodec, FrameError, labels, new_id, now_unix_us, pb
from edgewire.pb.edgeinfer.v1 import capture_pb2 as cpb
from gateway.capture.format import READ_LIMITS, Corrupt, read_capture, read_header, reader_codec

DECISION_FIELDS: Final = ("outcome", "status", "tier", "pool", "reason")
_TIER: Final = {
    pb.TIER_EDGE_DEVICE: "edge_device",
    pb.TIER_EDGE_SERVER: "edge_server",
    pb.TIER_CLOUD: "cloud",
}


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    """How to replay: target, pace, ids, identity, and how long to wait for the last answers."""

    endpoint: str
    speed: float | None = 1.0  # 10.0 = ten times faster than captured; None = as fast as the window allows
    original_ids: bool = False
    curve: tuple[bytes, bytes, bytes] | None = None  # (client public, client secret, server public)
    agent: tuple[str, str] | None = None  # (agent id, region) to send as; None = as captured
    window: int = 2000  # requests sent and not yet answered, at most
    timeout_s: float = 30.0  # after the last send, how long to wait for outstanding answers
    progress: TextIO | None = None  # a TTY for a progress line


@dataclass(slots=True)
class Decision:
    """What became of one replayed request (keyed by its original id)."""

    id: str
    model: str
    region: str
    outcome: str  # "response" | "nack" | "duplicate" | "lost"
    status: str = ""
    tier: str = ""
    pool: str = ""
    reason: str = ""  # route reason (responses) or nack reason


@dataclass(slots=True)
class ReplaySummary:
    """Totals of one replay (``--json`` prints it)."""

    files: int = 0
    records: int = 0
    corrupt: int = 0
    undecodable: int = 0
    skipped_by_kind: dict[str, int] = field(default_factory=dict)
    batches_sent: int = 0
    requests_sent: int = 0
    answered_by_status: dict[str, int] = field(default_factory=dict)
    nacked_by_reason: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    lost: int = 0
    by_tier_pool: dict[str, int] = field(default_factory=dict)
    latency_ms: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    requests_per_s: float = 0.0
    stopped_early: str = ""  # why sending stopped before the end of the capture, if it did

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


@dataclass(slots=True)
class _Batch:
    arrival_unix_us: int
    agent_id: str
    region: str
    envelope: pb.Envelope
    batch: pb.RequestBatch


def captured_batches(paths: Sequence[Path], summary: ReplaySummary) -> Iterator[_Batch]:
    """Request batches of the capture files, in arrival order; other records are counted in ``summary``."""
    ordered = sorted(paths, key=lambda p: (h.created_unix_us if (h := read_header(p)) else 0, str(p)))
    for path in ordered:
        summary.files += 1
        codec = reader_codec(read_header(path))
        for entry in read_capture(path):
            if isinstance(entry, Corrupt):
                summary.corrupt += 1
                continue
            summary.records += 1
            decoded = _decode(codec, entry)
            if decoded is None:
                summary.undecodable += 1
                continue
            envelope, payload = decoded
            if not isinstance(payload, pb.RequestBatch):
                kind = labels.MESSAGE_KIND.get(envelope.kind, "other")
                summary.skipped_by_kind[kind] = summary.skipped_by_kind.get(kind, 0) + 1
                continue
            yield _Batch(entry.arrival_unix_us, entry.agent_id, entry.region, envelope, payload)


def _decode(codec: FrameCodec, record: cpb.CaptureRecord) -> tuple[pb.Envelope, Any] | None:
    try:
        decoded = codec.decode(list(record.frames))
    except (FrameError, ValueError):
        return None
    return decoded.envelope, decoded.payload


class _Replayer:
    def __init__(self, options: ReplayOptions, summary: ReplaySummary) -> None:
        self.options = options
        self.summary = summary
        self.codec = FrameCodec(READ_LIMITS)
        self.decisions: dict[bytes, Decision] = {}  # by original id, in send order
        self.original_of: dict[bytes, bytes] = {}  # sent id -> original id
        self.sent_at: dict[bytes, float] = {}  # sent id -> monotonic time
        self.latencies: list[float] = []
        self.outstanding = 0
        self._room = asyncio.Event()
        self._room.set()

    async def run(self, batches: Iterable[_Batch]) -> list[Decision]:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if self.options.curve is not None:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = self.options.curve
        sock.connect(self.options.endpoint)
        receiver = asyncio.create_task(self._receive(sock))
        started = time.monotonic()
        try:
            await self._send_all(sock, batches, started)
            deadline = time.monotonic() + self.options.timeout_s
            while self.outstanding and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
                self._show(started)
        finally:
            receiver.cancel()
            await asyncio.gather(receiver, return_exceptions=True)
            sock.close(0)
            ctx.term()
        self.summary.seconds = time.monotonic() - started
        self.summary.lost = self.outstanding
        for sent_id in self.sent_at:
            self.decisions[self.original_of[sent_id]].outcome = "lost"
        if self.options.progress is not None:
            self.options.progress.write("\n")
        return list(self.decisions.values())

    async def _send_all(self, sock: zmq.asyncio.Socket, batches: Iterable[_Batch], started: float) -> None:
        first_arrival: int | None = None
        for item in batches:
            first_arrival = item.arrival_unix_us if first_arrival is None else first_arrival
            if self.options.speed is not None:
                due = started + (item.arrival_unix_us - first_arrival) / 1e6 / self.options.speed
                if (delay := due - time.monotonic()) > 0:
                    await asyncio.sleep(delay)
            while self.outstanding >= self.options.window:
                self._room.clear()
                try:
                    await asyncio.wait_for(self._room.wait(), timeout=self.options.timeout_s)
                except TimeoutError:
                    waited, flying = self.options.timeout_s, self.outstanding
                    self.summary.stopped_early = (
                        f"no answer for {waited:g} s with {flying} requests in flight"
                    )
                    return
            await sock.send_multipart(self._frames(item))
            self.summary.batches_sent += 1
            self._show(started)

    def _frames(self, item: _Batch) -> list[bytes]:
        """Re-encode one captured batch: ids per option, deadlines shifted to keep their remaining budget."""
        now_us = now_unix_us()
        shift = now_us - item.arrival_unix_us
        sent_mono = time.monotonic()
        for request in item.batch.requests:
            original = request.request_id
            sent = original if self.options.original_ids else new_id()
            request.request_id = sent
            if request.deadline_unix_us:
                request.deadline_unix_us += shift
            self.original_of[sent] = original
            self.sent_at[sent] = sent_mono
            self.decisions.setdefault(
                original,
                Decision(original.hex(), request.model_name, item.region or item.envelope.region, ""),
            )
            self.outstanding += 1
            self.summary.requests_sent += 1
        agent_id, region = self.options.agent or (
            item.agent_id or item.envelope.agent_id,
            item.envelope.region,
        )
        envelope = item.envelope
        return self.codec.encode(
            item.batch,
            agent_id=agent_id,
            region=region,
            priority=envelope.priority,
            deadline_unix_us=envelope.deadline_unix_us + shift if envelope.deadline_unix_us else 0,
            message_id=envelope.message_id if self.options.original_ids else None,
            dict_id=0,
        )

    async def _receive(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                decoded = self.codec.decode(frames)
            except FrameError:
                continue
            payload = decoded.payload
            if isinstance(payload, pb.Ack):
                self._on_ack(payload)
            elif isinstance(payload, pb.ResponseBatch):
                for ack in payload.acks:  # captured frames of agents that read Acks there
                    self._on_ack(ack)
                for response in payload.responses:
                    self._on_response(response)

    def _on_ack(self, ack: pb.Ack) -> None:
        for rid in ack.duplicate_ids:
            decision, _ = self._settle(rid)
            if decision is not None:
                decision.outcome = "duplicate"
                self.summary.duplicates += 1
        for nack in ack.nacks:
            decision, _ = self._settle(nack.request_id)
            if decision is not None:
                reason = labels.NACK.get(nack.reason, "other")
                decision.outcome, decision.reason = "nack", reason
                self.summary.nacked_by_reason[reason] = self.summary.nacked_by_reason.get(reason, 0) + 1

    def _on_response(self, response: pb.InferResponse) -> None:
        decision, sent = self._settle(response.request_id)
        if decision is None:
            return
        status = labels.STATUS.get(response.status, "other")
        decision.outcome, decision.status = "response", status
        decision.tier, decision.pool, decision.reason = (
            _TIER.get(response.tier, ""),
            response.pool,
            response.route_reason,
        )
        self.summary.answered_by_status[status] = self.summary.answered_by_status.get(status, 0) + 1
        key = f"{decision.tier or '-'}/{decision.pool or '-'}"
        self.summary.by_tier_pool[key] = self.summary.by_tier_pool.get(key, 0) + 1
        self.latencies.append(time.monotonic() - sent)

    def _settle(self, sent_id: bytes) -> tuple[Decision | None, float]:
        """The decision a first answer for ``sent_id`` settles, and when it was sent; (None, 0) for an
        unknown id or a second answer (never counted twice). A capture replayed several times settles its
        original id's decision once per pass: the last pass's outcome is the one kept."""
        sent = self.sent_at.pop(sent_id, None)
        original = self.original_of.pop(sent_id, None)
        if sent is None or original is None:
            return None, 0.0
        self.outstanding -= 1
        if self.outstanding < self.options.window:
            self._room.set()
        return self.decisions[original], sent

    def _show(self, started: float) -> None:
        out = self.options.progress
        if out is None:
            return
        elapsed = time.monotonic() - started
        done = self.summary.requests_sent - self.outstanding
        out.write(
            f"\rreplay: sent {self.summary.requests_sent} requests, answered {done}, "
            f"outstanding {self.outstanding}, {elapsed:.1f} s"
        )
        out.flush()


async def replay(paths: Sequence[Path], options: ReplayOptions) -> tuple[ReplaySummary, list[Decision]]:
    """Replay capture files against ``options.endpoint``; returns the summary and per-request decisions."""
    summary = ReplaySummary()
    replayer = _Replayer(options, summary)
    decisions = await replayer.run(captured_batches(paths, summary))
    if replayer.latencies:
        ms = np.array(replayer.latencies) * 1e3
        summary.latency_ms = {f"p{q}": round(float(np.percentile(ms, q)), 3) for q in (50, 90, 99)}
        summary.latency_ms["max"] = round(float(ms.max()), 3)
    summary.requests_per_s = summary.requests_sent / summary.seconds if summary.seconds else 0.0
    return summary, decisions


def write_decisions(decisions: Iterable[Decision], path: Path) -> None:
    """One JSON object per line, in capture order."""
    with path.open("w", encoding="utf-8") as out:
        for decision in decisions:
            out.write(json.dumps(asdict(decision), sort_keys=True) + "\n")


def read_decisions(path: Path) -> dict[str, dict[str, str]]:
    """A decisions file, by request id."""
    out: dict[str, dict[str, str]] = {}
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                out[str(row["id"])] = {k: str(v) for k, v in row.items()}
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a decision line: {exc}") from None
    return out


@dataclass(frozen=True, slots=True)
class Difference:
    """A request whose decision differs from the golden one; ``field`` "missing"/"extra" for absence."""

    id: str
    model: str
    field: str
    golden: str
    replayed: str

    def __str__(self) -> str:
        return f"{self.id} ({self.model}): {self.field}: golden {self.golden!r}, replayed {self.replayed!r}"


def compare_decisions(golden: dict[str, dict[str, str]], decisions: Iterable[Decision]) -> list[Difference]:
    """Every difference in outcome, status, tier, pool or reason; requests missing on either side."""
    seen: set[str] = set()
    out: list[Difference] = []
    for decision in decisions:
        row = {k: str(v) for k, v in asdict(decision).items()}
        seen.add(decision.id)
        want = golden.get(decision.id)
        if want is None:
            out.append(Difference(decision.id, decision.model, "extra", "", decision.outcome))
            continue
        out.extend(
            Difference(decision.id, decision.model, name, want.get(name, ""), row[name])
            for name in DECISION_FIELDS
            if want.get(name, "") != row[name]
        )
    out.extend(
        Difference(rid, row.get("model", ""), "missing", row.get("outcome", ""), "")
        for rid, row in golden.items()
        if rid not in seen
    )
    return out


def summary_text(summary: ReplaySummary) -> str:
    """The human summary printed at the end of a replay."""
    lines = [
        f"replayed {summary.requests_sent} requests in {summary.batches_sent} batches from {summary.files} "
        f"file(s) in {summary.seconds:.1f} s ({summary.requests_per_s:,.0f} requests/s)",
        f"  answered: {_counts(summary.answered_by_status)}",
        f"  nacked:   {_counts(summary.nacked_by_reason)}",
        f"  duplicates: {summary.duplicates}   lost: {summary.lost}",
        f"  tier/pool: {_counts(summary.by_tier_pool)}",
        f"  latency ms: {_counts(summary.latency_ms)}",
    ]
    skipped = {**summary.skipped_by_kind, "undecodable": summary.undecodable, "corrupt": summary.corrupt}
    lines.append(f"  not replayed: {_counts({k: v for k, v in skipped.items() if v})}")
    if summary.stopped_early:
        lines.append(f"  STOPPED EARLY: {summary.stopped_early}")
    return "\n".join(lines)


def _counts(counts: dict[str, Any]) -> str:
    if not counts:
        return "-"
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: str(kv[0])))


def progress_stream() -> TextIO | None:
    """stderr when it is a terminal (the progress line), else None."""
    return sys.stderr if sys.stderr.isatty() else None


__all__ = [
    "Decision",
    "Difference",
    "ReplayOptions",
    "ReplaySummary",
    "compare_decisions",
    "read_decisions",
    "replay",
    "summary_text",
    "write_decisions",
]
