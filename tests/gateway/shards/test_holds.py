"""The front's held connections (gateway/shards/holds.py) on a fake clock: a shard's hold message, which
frames the front then refuses (request batches naming the held agent on the held connection, until the
hold ends), the pace of reading them (and a lapsed connection's, passed on), what is counted, and a hold
forgotten on request."""

from __future__ import annotations

import pytest
import zmq

from edgewire import new_id, pb
from gateway.config import LimitsConfig
from gateway.ingress.budget import HELD_READS_BURST, LAPSED_KEEP_S
from gateway.ops.metrics import GatewayMetrics
from gateway.shards.holds import MAX_HOLD_S, FrontHolds
from gateway.shards.link import HOLD, tag

CARRIERS = ["hgc", "pccw"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def holds_on(clock: Clock, per_s: float = 1000.0) -> tuple[FrontHolds, GatewayMetrics]:
    metrics = GatewayMetrics(models={})
    return FrontHolds(CARRIERS, per_s, metrics, LimitsConfig().max_header_bytes, clock), metrics


def hold_message(carrier: int, routing_id: bytes, agent: str, seconds: str) -> list[zmq.Frame]:
    """A shard's hold as the relay hands it over (after the shard's routing id)."""
    return [zmq.Frame(p) for p in (tag(HOLD, carrier), routing_id, agent.encode(), seconds.encode())]


def frame(
    routing_id: bytes, agent: str, kind: pb.MessageKind.ValueType = pb.MESSAGE_KIND_REQUEST_BATCH
) -> list[zmq.Frame]:
    envelope = pb.Envelope(schema_version=1, message_id=new_id(), agent_id=agent, kind=kind)
    return [zmq.Frame(routing_id), zmq.Frame(envelope.SerializeToString()), zmq.Frame(b"payload")]


def refused(verdict: tuple[bool, float] | None) -> bool:
    return verdict is not None and verdict[0]


def counted(metrics: GatewayMetrics, carrier: str) -> tuple[float, float]:
    """(frames refused over_budget, read pauses) on ``carrier``."""
    registry = metrics.registry
    refused = registry.get_sample_value(
        "hkgw_frames_rejected_total", {"carrier": carrier, "reason": "over_budget"}
    )
    pauses = registry.get_sample_value("hkgw_carrier_read_pauses_total", {"carrier": carrier})
    return refused or 0.0, pauses or 0.0


def test_a_held_connection_has_its_agents_request_batches_refused_until_the_hold_ends() -> None:
    clock = Clock()
    holds, metrics = holds_on(clock)
    assert not holds and holds.check("hgc", frame(b"conn-1", "flooder")) is None  # nothing held
    assert holds.hold(hold_message(0, b"conn-1", "flooder", "2.5"))
    assert len(holds) == 1
    assert holds.check("hgc", frame(b"conn-1", "flooder")) == (True, 0.0)  # refused, within the burst
    # not refused: another kind, another agent named, another connection, another carrier
    assert holds.check("hgc", frame(b"conn-1", "flooder", pb.MESSAGE_KIND_PING)) is None
    assert holds.check("hgc", frame(b"conn-1", "someone-else")) is None
    assert holds.check("hgc", frame(b"conn-2", "flooder")) is None
    assert holds.check("pccw", frame(b"conn-1", "flooder")) is None
    assert counted(metrics, "hgc") == (1.0, 0.0)
    clock.now += 2.4
    assert holds.check("hgc", frame(b"conn-1", "flooder")) == (True, 0.0)
    clock.now += 0.1  # the hold's end: the shard's budget decides again, the frames still paced
    assert holds.check("hgc", frame(b"conn-1", "flooder")) == (False, 0.0)
    assert counted(metrics, "hgc") == (2.0, 0.0)
    clock.now += LAPSED_KEEP_S  # a minute after it: forgotten
    assert holds.check("hgc", frame(b"conn-1", "flooder")) is None


def test_past_the_burst_each_held_frame_pauses_the_carriers_reading_and_is_counted() -> None:
    clock = Clock()
    holds, metrics = holds_on(clock, per_s=1000.0)
    holds.hold(hold_message(1, b"conn-1", "flooder", "10"))
    verdicts = [holds.check("pccw", frame(b"conn-1", "flooder")) for _ in range(HELD_READS_BURST + 5)]
    assert verdicts[:HELD_READS_BURST] == [(True, 0.0)] * HELD_READS_BURST
    assert verdicts[HELD_READS_BURST:] == [(True, pytest.approx(0.001))] * 5
    assert counted(metrics, "pccw") == (HELD_READS_BURST + 5, 5.0)
    assert counted(metrics, "hgc") == (0.0, 0.0)


def test_a_lapsed_connections_frames_pass_on_at_the_pace() -> None:
    """Once the hold ends, the flood that waited in ZeroMQ during it goes to the shard no faster than the
    pace (the shard's budget decides each), and none of it is refused here."""
    clock = Clock()
    holds, metrics = holds_on(clock, per_s=1000.0)
    holds.hold(hold_message(0, b"conn-1", "flooder", "1"))
    clock.now += 1.0
    verdicts = [holds.check("hgc", frame(b"conn-1", "flooder")) for _ in range(HELD_READS_BURST + 3)]
    assert verdicts[:HELD_READS_BURST] == [(False, 0.0)] * HELD_READS_BURST
    assert verdicts[HELD_READS_BURST:] == [(False, pytest.approx(0.001))] * 3
    assert counted(metrics, "hgc") == (0.0, 3.0)


def test_a_shorter_or_longer_hold_replaces_the_last_and_none_outlasts_the_cap() -> None:
    clock = Clock()
    holds, _ = holds_on(clock)
    holds.hold(hold_message(0, b"conn-1", "flooder", "1e9"))
    clock.now += MAX_HOLD_S - 1
    assert refused(holds.check("hgc", frame(b"conn-1", "flooder")))
    clock.now += 1
    assert not refused(holds.check("hgc", frame(b"conn-1", "flooder")))
    holds.hold(hold_message(0, b"conn-1", "flooder", "0.5"))  # held again by the shard's budget
    assert refused(holds.check("hgc", frame(b"conn-1", "flooder")))
    holds.hold(hold_message(0, b"conn-1", "flooder", "0"))  # ends now: nothing to hold
    assert refused(holds.check("hgc", frame(b"conn-1", "flooder")))  # the last hold stands


@pytest.mark.parametrize(
    "parts",
    [
        hold_message(2, b"conn-1", "flooder", "1"),  # no third carrier
        hold_message(0, b"conn-1", "flooder", "soon"),
        hold_message(0, b"conn-1", "flooder", "nan"),
        hold_message(0, b"conn-1", "flooder", "inf"),
        hold_message(0, b"conn-1", "flooder", "-1"),
        hold_message(0, b"conn-1", "flooder", "1")[:3],
        [zmq.Frame(HOLD), *hold_message(0, b"conn-1", "flooder", "1")[1:]],
        [zmq.Frame(p) for p in (tag(HOLD, 0), b"conn-1", b"\xff\xfe", b"1")],
    ],
)
def test_a_malformed_hold_holds_nothing(parts: list[zmq.Frame]) -> None:
    holds, _ = holds_on(Clock())
    assert not holds.hold(parts)
    assert len(holds) == 0


def test_frames_that_are_not_a_readable_envelope_go_on_to_the_shard() -> None:
    """The shard refuses those with their own reason: the front refuses only what it has read as held."""
    holds, metrics = holds_on(Clock())
    holds.hold(hold_message(0, b"conn-1", "flooder", "10"))
    too_long = bytes(LimitsConfig().max_header_bytes + 1)
    assert holds.check("hgc", [zmq.Frame(b"conn-1"), zmq.Frame(too_long), zmq.Frame(b"p")]) is None
    assert holds.check("hgc", [zmq.Frame(b"conn-1"), zmq.Frame(b"\xff\xff\xff"), zmq.Frame(b"p")]) is None
    assert holds.check("hgc", [zmq.Frame(b"conn-1")]) is None
    assert counted(metrics, "hgc") == (0.0, 0.0)


def test_clear_forgets_every_hold() -> None:
    holds, _ = holds_on(Clock())
    holds.hold(hold_message(0, b"conn-1", "flooder", "10"))
    holds.hold(hold_message(1, b"conn-9", "other", "10"))
    holds.clear()  # e.g. from the loop's thread, at a reload: done at the relay thread's next call
    assert holds.check("hgc", frame(b"conn-1", "flooder")) is None
    assert holds.check("pccw", frame(b"conn-9", "other")) is None
    assert len(holds) == 0
