"""The front's relay thread on real sockets: a carrier's ROUTER on loopback, the link's ROUTER (bound on ipc
as in the gateway, and on inproc for the DEALER standing in for a shard). Frames go to the shard the front's
route names, replies back to the agent, what a shard says to the front reaches the loop, a bug in one frame's
route is counted and the rest flow, the last replies are passed on at stop, and a dead thread makes the
carrier stalled and not receiving."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from edgewire import new_id, pb
from edgewire.parts import recv_parts, send_parts
from gateway.config import CarrierConfig, LimitsConfig, ZmqConfig
from gateway.ingress.budget import HELD_READS_BURST
from gateway.ingress.carrier import CarrierIngress
from gateway.ops.metrics import GatewayMetrics
from gateway.shards.holds import FrontHolds
from gateway.shards.link import HOLD, REPLY, STATUS, tag
from gateway.shards.relay import Relay

SHARD_ID = b"shard-0"
TIMEOUT_MS = 5000


@dataclass
class Rig:
    relay: Relay
    carrier: CarrierIngress
    agent: zmq.Socket[bytes]
    shard: zmq.Socket[bytes]
    metrics: GatewayMetrics
    to_front: list[list[bytes]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)


def _recv(sock: zmq.Socket[bytes]) -> list[bytes]:
    assert sock.poll(TIMEOUT_MS), "nothing arrived"
    return [bytes(f.buffer) for f in recv_parts(sock)]


@asynccontextmanager
async def rig(
    tmp_path: Path, held_reads_per_s: float | None = None, clock: Callable[[], float] = time.monotonic
) -> AsyncIterator[Rig]:
    """A relay over a real carrier and link; with ``held_reads_per_s``, the front's held connections
    (FrontHolds) at that pace, on ``clock``."""
    ctx = zmq.asyncio.Context()
    metrics = GatewayMetrics(models={})
    zcfg = ZmqConfig()
    carrier = CarrierIngress(
        CarrierConfig(name="hgc", bind="tcp://127.0.0.1:*"),
        ctx,
        zcfg,
        LimitsConfig(),
        metrics,
        lambda c, f: pytest.fail("the loop must not read a carrier handed to the relay"),
    )
    carrier.start()
    link = zmq.Socket(ctx, zmq.ROUTER)
    link.setsockopt(zmq.ROUTER_MANDATORY, 1)
    link.bind(f"ipc://{tmp_path}/link")
    # the stand-in shard is on inproc: a message it sends is in the link's queue when send returns, so a
    # test knows what the relay has to pass on (over ipc, bytes in the kernel's buffer are not yet there)
    link.bind(f"inproc://link-{id(link)}")
    shard = zmq.Socket(ctx, zmq.DEALER)
    shard.setsockopt(zmq.ROUTING_ID, SHARD_ID)
    shard.connect(f"inproc://link-{id(link)}")
    agent = zmq.Socket(ctx, zmq.DEALER)
    agent.setsockopt(zmq.ROUTING_ID, b"agent-a")
    agent.connect(carrier.endpoint)
    to_front: list[list[bytes]] = []
    dropped: list[str] = []

    def route(c: CarrierIngress, frames: list[zmq.Frame]) -> list[bytes | zmq.Frame] | None:
        if frames[1].bytes == b"boom":
            raise ValueError("a bug in routing one frame")
        if frames[1].bytes == b"nowhere":
            return [b"shard-9", tag(b"F", 0), *frames]  # a shard that is not connected
        return [SHARD_ID, tag(b"F", 0), *frames]

    holds = None
    if held_reads_per_s is not None:
        holds = FrontHolds(["hgc"], held_reads_per_s, metrics, LimitsConfig().max_header_bytes, clock)
    relay = Relay(
        ctx,
        link,
        [carrier],
        route,
        lambda frames: to_front.append([bytes(f.buffer) for f in frames]),
        dropped.append,
        metrics,
        asyncio.get_running_loop(),
        max_messages=8,
        holds=holds,
    )
    r = Rig(relay, carrier, agent, shard, metrics, to_front, dropped)
    relay.start()
    # the shard's DEALER says hello first, so that the link's ROUTER knows its routing id
    send_parts(shard, [STATUS, b"{}"])
    await _until(lambda: bool(to_front))
    to_front.clear()
    try:
        yield r
    finally:
        relay.stop()
        for sock in (agent, shard, link):
            sock.close(0)
        await carrier.close()
        ctx.term()


async def _until(condition: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_frames_to_the_shard_and_replies_to_the_agent(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        for i in range(20):  # more than one burst (max_messages 8)
            r.agent.send_multipart([b"envelope-%d" % i, b"payload"])
        got = [await asyncio.to_thread(_recv, r.shard) for _ in range(20)]
        assert [g[0] for g in got] == [tag(b"F", 0)] * 20
        assert [g[1] for g in got] == [b"agent-a"] * 20  # the agent's routing id on that carrier
        assert [g[2] for g in got] == [b"envelope-%d" % i for i in range(20)]
        assert r.carrier.messages == 20
        assert r.carrier.last_recv > 0
        send_parts(r.shard, [tag(REPLY, 0), b"agent-a", b"answer-head", b"answer-body"])
        assert await asyncio.to_thread(_recv, r.agent) == [b"answer-head", b"answer-body"]
        # a reply to an agent the carrier does not know is counted, not sent
        send_parts(r.shard, [tag(REPLY, 0), b"agent-gone", b"x"])
        send_parts(r.shard, [STATUS, b'{"ready": true}'])
        await _until(lambda: bool(r.to_front))
        assert r.to_front == [[SHARD_ID, STATUS, b'{"ready": true}']]
        assert r.dropped == ["reply_unreachable"]


async def test_a_bad_frame_is_counted_and_the_rest_flow(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        r.agent.send_multipart([b"boom", b"payload"])
        r.agent.send_multipart([b"nowhere", b"payload"])
        r.agent.send_multipart([b"fine", b"payload"])
        got = await asyncio.to_thread(_recv, r.shard)
        assert got[2] == b"fine"
        assert r.metrics.ingest_errors.labels("hgc")._value.get() == 1
        assert r.dropped == ["shard_down"]
        assert r.relay.failed is None and r.carrier.receiving


async def test_the_loop_reaches_a_shard_and_stop_passes_the_last_replies_on(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        assert r.relay.to_shard([SHARD_ID, b"Q", b"7"])
        assert await asyncio.to_thread(_recv, r.shard) == [b"Q", b"7"]
        r.agent.send_multipart([b"hello", b"p"])
        await asyncio.to_thread(_recv, r.shard)
        for i in range(50):
            send_parts(r.shard, [tag(REPLY, 0), b"agent-a", b"last-%d" % i])
        r.relay.stop()  # whatever the thread had not read yet, it reads and sends before it ends
        got = [await asyncio.to_thread(_recv, r.agent) for _ in range(50)]
        assert got == [[b"last-%d" % i] for i in range(50)]
        assert not r.relay.to_shard([SHARD_ID, b"Q", b"8"])


async def test_the_thread_notes_it_is_alive_without_traffic(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        before = r.relay.cycle_at
        await _until(lambda: r.relay.cycle_at > before + 0.15)  # it wakes every POLL_MS at most
        assert not r.carrier.stalled(time.monotonic(), 1.0)
        assert r.carrier.receiving


async def test_a_dead_relay_stalls_its_carriers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: Relay, frames: list[zmq.Frame]) -> None:
        raise RuntimeError("a bug in the relay's own code")

    monkeypatch.setattr(Relay, "_from_loop", broken)
    async with rig(tmp_path) as r:
        assert r.relay.to_shard([SHARD_ID, b"Q", b"1"])
        await _until(lambda: r.relay.failed is not None)
        assert "a bug in the relay's own code" in str(r.carrier.failed)
        assert not r.carrier.receiving
        assert r.carrier.stalled(time.monotonic(), 1.0)
        assert not r.relay.to_shard([SHARD_ID, b"Q", b"2"])


# ----------------------------------------------------------- held connections


def batch_of(agent: str, kind: pb.MessageKind.ValueType = pb.MESSAGE_KIND_REQUEST_BATCH) -> list[bytes]:
    envelope = pb.Envelope(schema_version=1, message_id=new_id(), agent_id=agent, kind=kind)
    return [envelope.SerializeToString(), b"payload"]


def envelope_agent(got: list[bytes]) -> tuple[str, int]:
    """(agent id, kind) of an agent message as the shard receives it ([tag, routing id, envelope, ...])."""
    envelope = pb.Envelope.FromString(got[2])
    return envelope.agent_id, envelope.kind


def over_budget(r: Rig) -> float:
    value = r.metrics.registry.get_sample_value(
        "hkgw_frames_rejected_total", {"carrier": "hgc", "reason": "over_budget"}
    )
    return value or 0.0


async def test_a_connection_a_shard_holds_is_refused_and_paced_here_and_the_rest_reach_the_shard(
    tmp_path: Path,
) -> None:
    """The shard holds agent-a's connection for "flooder" (its H message): agent-a's 100 request batches
    naming flooder never reach the shard, refused here and counted, read at 100 a second past the burst
    (pauses counted); its Ping and a batch naming another agent do reach it, and so does agent-b's batch
    sent after the flood, long before the flood is read through (the ROUTER reads connections in turn)."""
    flood = 100
    async with rig(tmp_path, held_reads_per_s=100.0) as r:
        other = zmq.Socket(r.agent.context, zmq.DEALER)
        other.setsockopt(zmq.ROUTING_ID, b"agent-b")
        other.connect(r.carrier.endpoint)
        try:
            send_parts(r.shard, [tag(HOLD, 0), b"agent-a", b"flooder", b"30"])
            send_parts(r.shard, [STATUS, b"{}"])  # after the hold on the link: once it is here, so is that
            await _until(lambda: bool(r.to_front))
            for _ in range(flood):
                r.agent.send_multipart(batch_of("flooder"))
            r.agent.send_multipart(batch_of("flooder", pb.MESSAGE_KIND_PING))
            r.agent.send_multipart(batch_of("someone-else"))
            await _until(lambda: over_budget(r) >= HELD_READS_BURST)
            other.send_multipart(batch_of("flooder"))
            first = await asyncio.to_thread(_recv, r.shard)
            refused_then = over_budget(r)
            assert first[1] == b"agent-b" and envelope_agent(first) == (
                "flooder",
                pb.MESSAGE_KIND_REQUEST_BATCH,
            )
            assert refused_then < flood - 20, refused_then  # read between the held frames, not after them
            rest = [await asyncio.to_thread(_recv, r.shard) for _ in range(2)]
            assert [(g[1], envelope_agent(g)) for g in rest] == [
                (b"agent-a", ("flooder", pb.MESSAGE_KIND_PING)),
                (b"agent-a", ("someone-else", pb.MESSAGE_KIND_REQUEST_BATCH)),
            ]
            assert over_budget(r) == flood
            pauses = r.metrics.registry.get_sample_value("hkgw_carrier_read_pauses_total", {"carrier": "hgc"})
            assert pauses is not None and pauses >= flood - HELD_READS_BURST - 2
            assert not r.shard.poll(50)  # nothing else came through
        finally:
            other.close(0)


class Clock:
    """The holds' clock, moved by the test (read on the relay thread)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_hold_that_ended_or_was_cleared_lets_the_frames_through(tmp_path: Path) -> None:
    clock = Clock()
    async with rig(tmp_path, held_reads_per_s=0.0, clock=clock) as r:
        send_parts(r.shard, [tag(HOLD, 0), b"agent-a", b"flooder", b"0.2"])
        send_parts(r.shard, [STATUS, b"{}"])
        await _until(lambda: bool(r.to_front))
        r.agent.send_multipart(batch_of("flooder"))
        await _until(lambda: over_budget(r) == 1)
        clock.now += 0.2  # the hold's end
        r.agent.send_multipart(batch_of("flooder"))
        got = await asyncio.to_thread(_recv, r.shard)
        assert envelope_agent(got) == ("flooder", pb.MESSAGE_KIND_REQUEST_BATCH)
        r.to_front.clear()
        send_parts(r.shard, [tag(HOLD, 0), b"agent-a", b"flooder", b"30"])
        send_parts(r.shard, [STATUS, b"{}"])
        await _until(lambda: bool(r.to_front))
        r.agent.send_multipart(batch_of("flooder"))
        await _until(lambda: over_budget(r) == 2)
        assert r.relay._holds is not None
        r.relay._holds.clear()  # as the front does at a reload or a capture
        r.agent.send_multipart(batch_of("flooder"))
        got = await asyncio.to_thread(_recv, r.shard)
        assert envelope_agent(got) == ("flooder", pb.MESSAGE_KIND_REQUEST_BATCH)
        assert over_budget(r) == 2
        assert r.metrics.registry.get_sample_value("hkgw_carrier_read_pauses_total", {"carrier": "hgc"}) in (
            None,
            0.0,
        )
