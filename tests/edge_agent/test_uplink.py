"""The uplink's failover rules against scripted carriers (real ZeroMQ ROUTERs on loopback), and its parts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import zmq
import zmq.asyncio

from edge_agent.agent import EdgeAgent
from edge_agent.client import EdgeClient
from edge_agent.uplink.dictionaries import ASK_AGAIN_S, DictionaryNegotiation
from edge_agent.uplink.outstanding import OutstandingTable, SentFrame
from edgewire import DictionaryStore, FrameCodec, new_id, pb
from gateway.testing import wait_for
from tests.edge_agent.conftest import agent_config

Answer = Callable[[pb.InferRequest], pb.InferResponse | None]


class ScriptedCarrier:
    """One carrier ingress of a scripted gateway: Pongs (with ``epoch``, RTT ``extra_rtt_us`` above the
    real one) while not ``silent``; every request accepted in the Ack, then answered by ``answer``."""

    def __init__(self, context: zmq.asyncio.Context, answer: Answer, extra_rtt_us: int = 0) -> None:
        self.answer = answer
        self.extra_rtt_us = extra_rtt_us
        self.epoch = 1
        self.silent = False
        self.received: list[bytes] = []  # request ids, in arrival order (resends included)
        self._codec = FrameCodec()
        self._router = context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self._router.bind_to_random_port('tcp://127.0.0.1')}"
        self._task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            routing_id, *body = await self._router.recv_multipart()
            decoded = self._codec.decode(body)
            replies: list[pb.Pong | pb.Ack | pb.ResponseBatch] = []
            if isinstance(decoded.payload, pb.Ping):
                if not self.silent:
                    sent_at = decoded.envelope.sent_at_unix_us - self.extra_rtt_us
                    replies.append(
                        pb.Pong(
                            nonce=decoded.payload.nonce,
                            gateway_epoch=self.epoch,
                            ping_sent_at_unix_us=sent_at,
                        )
                    )
            elif isinstance(decoded.payload, pb.RequestBatch):
                ids = [r.request_id for r in decoded.payload.requests]
                self.received.extend(ids)
                replies.append(pb.Ack(acked_message_id=decoded.envelope.message_id, accepted_ids=ids))
                answers = [a for r in decoded.payload.requests if (a := self.answer(r)) is not None]
                if answers:
                    replies.append(pb.ResponseBatch(responses=answers))
            for reply in replies:
                frames = self._codec.encode(reply, agent_id="hk", region="hk")
                await self._router.send_multipart([routing_id, *frames])

    async def aclose(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._router.close(0)


def never(_: pb.InferRequest) -> None:
    """Accepts and never answers: the answer is lost with the carrier."""
    return None


def ok(request: pb.InferRequest) -> pb.InferResponse:
    return pb.InferResponse(request_id=request.request_id, status=pb.STATUS_OK, model_name=request.model_name)


@asynccontextmanager
async def scripted_carriers(*answers: tuple[Answer, int]) -> AsyncIterator[list[ScriptedCarrier]]:
    context = zmq.asyncio.Context()
    carriers = [ScriptedCarrier(context, answer, extra) for answer, extra in answers]
    try:
        yield carriers
    finally:
        for carrier in carriers:
            await carrier.aclose()
        context.term()


def batch_request() -> pb.InferRequest:
    return pb.InferRequest(
        model_name="rank-mlp",
        kind=pb.REQUEST_KIND_RANKING,
        priority=pb.PRIORITY_CLASS_BATCH,
        complexity_hint=0.9,
    )


async def test_accepted_requests_on_a_carrier_that_dies_are_resent_on_a_live_one(
    models_dir: Path, tmp_path: Path
) -> None:
    """A request accepted over a carrier that then goes silent (its answer lost with it) is resent on a
    live carrier of the same gateway and answered there, long before its 60 s deadline."""
    async with scripted_carriers((never, 0), (ok, 50_000)) as (first, second):
        config = agent_config(
            {"a": first.endpoint, "b": second.endpoint},
            models_dir,
            tmp_path / "spool",
            local={"enabled": False},
        )
        async with EdgeAgent(config) as agent, EdgeClient(agent.intake_endpoint) as client:
            uplink = agent.uplink
            assert uplink is not None
            await wait_for(lambda: (b := uplink.best()) is not None and b.name == "a")
            await wait_for(lambda: uplink.carriers["b"].up)
            answering = asyncio.create_task(client.infer(batch_request(), deadline_s=60))
            await wait_for(lambda: len(first.received) == 1, what="the request reached carrier a")
            rid = first.received[0]
            await wait_for(lambda: (e := uplink.outstanding.get(rid)) is not None and e.accepted)
            first.silent = True  # carrier a stops answering: dead after dead_after_s
            response = await asyncio.wait_for(answering, timeout=15)
    assert response.status == pb.STATUS_OK
    assert second.received == [rid]
    assert uplink.stats.resent["carrier_down"] == 1
    assert uplink.stats.re_executions == 0


async def test_a_gateway_that_comes_back_with_a_new_epoch_re_executes_what_it_had_accepted(
    models_dir: Path, tmp_path: Path
) -> None:
    """The only carrier goes silent and comes back from a restarted gateway (a new epoch): the accepted
    request is resent once, counted as a re-execution, not as a lost carrier's resend."""
    async with scripted_carriers((never, 0)) as (carrier,):
        config = agent_config(
            {"a": carrier.endpoint}, models_dir, tmp_path / "spool", local={"enabled": False}
        )
        async with EdgeAgent(config) as agent, EdgeClient(agent.intake_endpoint) as client:
            uplink = agent.uplink
            assert uplink is not None
            await wait_for(lambda: uplink.best() is not None)
            answering = asyncio.create_task(client.infer(batch_request(), deadline_s=60))
            await wait_for(lambda: len(carrier.received) == 1)
            rid = carrier.received[0]
            await wait_for(lambda: (e := uplink.outstanding.get(rid)) is not None and e.accepted)
            carrier.silent = True
            await wait_for(lambda: not uplink.carriers["a"].up, what="carrier a found dead")
            carrier.answer, carrier.epoch, carrier.silent = ok, 2, False
            response = await asyncio.wait_for(answering, timeout=15)
    assert response.status == pb.STATUS_OK
    assert carrier.received == [rid, rid]
    assert uplink.stats.re_executions == 1
    assert dict(uplink.stats.resent) == {"gateway_restarted": 1}


class Clock:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_dictionary_is_asked_for_again_only_after_the_wait() -> None:
    """Pongs preferring a dictionary the agent lacks ask for it once, then again only ASK_AGAIN_S later."""
    clock = Clock()
    negotiation = DictionaryNegotiation(DictionaryStore(), clock)
    asked: list[float] = []

    def ask(request: pb.DictionaryRequest) -> bool:
        assert request.dict_id == 7
        asked.append(clock.now)
        return True

    pong = pb.Pong(dict_ids=[7], preferred_dict_id=7)
    for step in range(60):  # a Pong every 0.1 s for 6 s
        clock.now = 100.0 + step / 10
        negotiation.on_pong(pong, ask)
    assert asked == [100.0, 100.0 + ASK_AGAIN_S]
    assert negotiation.dict_id == 0  # never held: plain zstd meanwhile


def test_outstanding_expiry_and_ack_timeouts_give_what_is_due() -> None:
    """Deadlines come out of the table when they pass, Ack timeouts when they are overdue; answered
    requests and acknowledged frames never do."""
    table = OutstandingTable(answered_window=8)
    requests = [pb.InferRequest(request_id=new_id(), deadline_unix_us=1_000 * (n + 1)) for n in range(5)]
    for request in requests:
        assert table.add(request)
    assert not table.add(requests[0])  # a known id is not taken twice
    ids = [r.request_id for r in requests]
    table.close(ids[0])  # answered
    assert table.expired(2_500) == [ids[1]]
    table.sent(SentFrame(b"m1", "a", ids[2:4], sent_at=10.0), ack_timeout_s=1.0)
    table.sent(SentFrame(b"m2", "b", ids[4:], sent_at=10.5), ack_timeout_s=1.0)
    assert table.acked(b"m2") is not None
    assert table.overdue_frames(10.9) == []
    assert [f.message_id for f in table.overdue_frames(11.0)] == [b"m1"]
    assert table.overdue_frames(100.0) == []
    assert table.knows(ids[0]) and ids[0] not in table
