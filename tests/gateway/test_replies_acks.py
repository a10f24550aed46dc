"""ReplyRouter's held Acks: they ride with the next answers on their connection, or go alone when their hold
is over, or at once on drain; never on another agent's or another connection's frame.

The carrier here records what it is given instead of sending it: what is tested is which frames the router
builds and where it sends them (the sockets are covered by tests/gateway/daemon/test_acks_in_responses.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import zmq

from edgewire import FrameCodec, new_id, pb
from gateway.config import RepliesConfig
from gateway.ingress.carrier import SendResult
from gateway.ops.metrics import GatewayMetrics
from gateway.replies import ReplyRouter


class RecordingCarrier:
    """A carrier that keeps each message it is asked to send (decoded), and says it was sent."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.endpoint = f"inproc://{name}"
        self.silent_after_s = 5.0
        self.bound = True
        self.receiving = True
        self.sent: list[tuple[bytes, object]] = []
        self.something_sent = asyncio.Event()
        self._codec = FrameCodec()

    def stalled(self, now: float, stall_s: float) -> bool:
        return False

    def more_waiting(self) -> bool:
        return False

    def pause_reading(self, seconds: float) -> bool:
        return False

    def hold(self, routing_id: bytes, agent_id: str, seconds: float) -> None:
        pass

    def peer_property(self, header: zmq.Frame, name: str) -> str:
        return ""

    def send(self, routing_id: bytes, frames: Sequence[bytes | zmq.Frame]) -> str:
        self.sent.append((routing_id, self._codec.decode([bytes(f) for f in frames]).payload))
        self.something_sent.set()
        return SendResult.SENT

    async def close(self) -> None:
        return None


def router(hold_us: int) -> tuple[ReplyRouter, RecordingCarrier, list[float]]:
    carrier = RecordingCarrier("hgc")
    clock = [100.0]
    replies = ReplyRouter(
        {"hgc": carrier},
        FrameCodec(),
        RepliesConfig(ack_hold_us=hold_us),
        GatewayMetrics(models=["m"]),
        "test",
        clock=lambda: clock[0],
    )
    return replies, carrier, clock


def ack_of(*ids: bytes) -> pb.Ack:
    return pb.Ack(acked_message_id=new_id(), accepted_ids=list(ids))


def answer(rid: bytes) -> bytes:
    return pb.InferResponse(request_id=rid, status=pb.STATUS_OK).SerializeToString()


async def test_ack_rides_with_the_answer_in_one_frame() -> None:
    """An Ack and an answer for the same agent and connection go as one ResponseBatch, Ack inside."""
    replies, carrier, clock = router(hold_us=2000)
    rid = new_id()
    replies.seen("a1", "hgc", b"conn-1", clock[0])
    ack = ack_of(rid)
    replies.acknowledge("a1", carrier, b"conn-1", ack)
    replies.respond("a1", answer(rid), "hgc")
    replies.flush()
    assert len(carrier.sent) == 1
    routing_id, payload = carrier.sent[0]
    assert routing_id == b"conn-1"
    assert isinstance(payload, pb.ResponseBatch)
    assert list(payload.acks) == [ack]
    assert [r.request_id for r in payload.responses] == [rid]


async def test_held_ack_waits_for_its_hold_then_goes_alone() -> None:
    """With no answer, a flush before the hold is over sends nothing; after it, the Ack alone."""
    replies, carrier, clock = router(hold_us=2000)
    replies.seen("a1", "hgc", b"conn-1", clock[0])
    ack = ack_of(new_id())
    replies.acknowledge("a1", carrier, b"conn-1", ack)
    replies.flush()
    assert carrier.sent == []
    clock[0] += 0.002
    replies.flush()
    assert carrier.sent == [(b"conn-1", ack)]


async def test_hold_timer_sends_the_ack_without_any_other_event() -> None:
    """The router's own timer sends a held Ack once its hold is over."""
    carrier = RecordingCarrier("hgc")
    replies = ReplyRouter(
        {"hgc": carrier}, FrameCodec(), RepliesConfig(ack_hold_us=5000), GatewayMetrics(models=["m"]), "t"
    )
    ack = ack_of(new_id())
    replies.acknowledge("a1", carrier, b"conn-1", ack)
    await asyncio.wait_for(carrier.something_sent.wait(), timeout=10)
    assert carrier.sent == [(b"conn-1", ack)]


async def test_drain_sends_every_held_ack() -> None:
    """flush(every_ack=True), as the gateway's drain calls it, does not wait for any hold."""
    replies, carrier, _ = router(hold_us=100_000)
    acks = [ack_of(new_id()), ack_of(new_id())]
    for ack in acks:
        replies.acknowledge("a1", carrier, b"conn-1", ack)
    replies.flush(every_ack=True)
    assert len(carrier.sent) == 1
    _, payload = carrier.sent[0]
    assert isinstance(payload, pb.ResponseBatch)  # two Acks of one connection: one frame
    assert list(payload.acks) == acks and not payload.responses


async def test_ack_never_rides_on_another_connection() -> None:
    """Answers that go on another connection (the agent came back on a new one) carry no Ack of the old
    one: the Ack goes on its own connection, alone, and the answer on the route the router chose."""
    replies, carrier, clock = router(hold_us=2000)
    rid = new_id()
    ack = ack_of(rid)
    replies.acknowledge("a1", carrier, b"old-conn", ack)
    replies.seen("a1", "hgc", b"new-conn", clock[0], sent_us=2)
    replies.respond("a1", answer(rid), "hgc")
    replies.flush()
    assert (b"old-conn", ack) in carrier.sent
    [(routing_id, batch)] = [(r, p) for r, p in carrier.sent if isinstance(p, pb.ResponseBatch)]
    assert routing_id == b"new-conn" and not batch.acks
    assert [r.request_id for r in batch.responses] == [rid]


async def test_answers_of_another_agent_carry_no_ack() -> None:
    """An Ack waits for its own agent's answers; another agent's answers leave without it."""
    replies, carrier, clock = router(hold_us=2000)
    replies.seen("a2", "hgc", b"conn-2", clock[0])
    replies.acknowledge("a1", carrier, b"conn-1", ack_of(new_id()))
    replies.respond("a2", answer(new_id()), "hgc")
    replies.flush()
    [(routing_id, payload)] = carrier.sent
    assert routing_id == b"conn-2"
    assert isinstance(payload, pb.ResponseBatch) and not payload.acks


async def test_send_now_sends_only_the_urgent_agents_answers_with_their_acks() -> None:
    """send_now (an urgent frame's batch answered) sends its agents' answers, each with the Acks held for
    its connection; another agent's answers and Acks of the same tick wait for the tick's flush, so that a
    flood's answers of one tick still leave in one frame."""
    replies, carrier, clock = router(hold_us=2000)
    urgent, flood = new_id(), [new_id(), new_id()]
    replies.seen("lone", "hgc", b"conn-lone", clock[0])
    replies.seen("flood", "hgc", b"conn-flood", clock[0])
    lone_ack, flood_ack = ack_of(urgent), ack_of(*flood)
    replies.acknowledge("lone", carrier, b"conn-lone", lone_ack)
    replies.acknowledge("flood", carrier, b"conn-flood", flood_ack)
    replies.respond("flood", answer(flood[0]), "hgc")
    replies.respond("lone", answer(urgent), "hgc")
    replies.send_now({"lone"})
    assert len(carrier.sent) == 1
    routing_id, payload = carrier.sent[0]
    assert routing_id == b"conn-lone" and isinstance(payload, pb.ResponseBatch)
    assert list(payload.acks) == [lone_ack]
    assert [r.request_id for r in payload.responses] == [urgent]
    replies.respond("flood", answer(flood[1]), "hgc")  # later in the same tick
    replies.send_now({"lone"})  # nothing more for it: nothing sent
    assert len(carrier.sent) == 1
    replies.flush()
    assert len(carrier.sent) == 2
    routing_id, payload = carrier.sent[1]
    assert routing_id == b"conn-flood" and isinstance(payload, pb.ResponseBatch)
    assert list(payload.acks) == [flood_ack]
    assert [r.request_id for r in payload.responses] == flood
