"""The agent honours an ``over_budget`` refusal: the frame's requests are sent again (not failed), no
earlier than the retry-after, and no new frame goes to that gateway before it either."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.asyncio

from edge_agent.agent import EdgeAgent
from edge_agent.client import EdgeClient
from edge_agent.ops import AgentCollector
from edge_agent.synthetic import SyntheticTraffic
from edgewire import FrameCodec, pb
from gateway.testing import run_gateway, wait_for
from tests.edge_agent.conftest import agent_config

RETRY_AFTER_MS = 400


@dataclass
class BudgetGateway:
    """A scripted gateway that refuses the first request frame ``over_budget`` (retry after
    RETRY_AFTER_MS) and accepts and answers every later one; it notes when each frame came."""

    endpoint: str = ""
    refused_at: float = 0.0  # monotonic time the refusal was sent
    frames: list[tuple[float, list[bytes]]] = field(default_factory=list)  # (arrival, request ids)


@asynccontextmanager
async def budget_gateway() -> AsyncIterator[BudgetGateway]:
    codec = FrameCodec()
    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    gateway = BudgetGateway(f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}")

    async def reply(routing_id: bytes, message: pb.Pong | pb.Ack | pb.ResponseBatch) -> None:
        await router.send_multipart([routing_id, *codec.encode(message, agent_id="hk", region="hk")])

    async def serve() -> None:
        while True:
            routing_id, *body = await router.recv_multipart()
            decoded = codec.decode(body)
            payload, message_id = decoded.payload, decoded.envelope.message_id
            if isinstance(payload, pb.Ping):
                await reply(routing_id, pb.Pong(nonce=payload.nonce, gateway_epoch=1))
                continue
            if not isinstance(payload, pb.RequestBatch):
                continue
            ids = [r.request_id for r in payload.requests]
            gateway.frames.append((time.monotonic(), ids))
            if len(gateway.frames) == 1:
                gateway.refused_at = time.monotonic()
                refusal = pb.Ack(
                    acked_message_id=message_id,
                    frame_reject=pb.REJECT_REASON_OVER_BUDGET,
                    frame_reject_detail="test",
                    frame_retry_after_ms=RETRY_AFTER_MS,
                )
                await reply(routing_id, refusal)
                continue
            await reply(routing_id, pb.Ack(acked_message_id=message_id, accepted_ids=ids))
            answers = [
                pb.InferResponse(request_id=r.request_id, status=pb.STATUS_OK, model_name=r.model_name)
                for r in payload.requests
            ]
            await reply(routing_id, pb.ResponseBatch(responses=answers))

    task = asyncio.create_task(serve())
    try:
        yield gateway
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        router.close(0)
        context.term()


def ranking(n: int, seed: int) -> list[pb.InferRequest]:
    out = [g.request for g in SyntheticTraffic(seed).take(n * 4) if g.request.kind == pb.REQUEST_KIND_RANKING]
    for request in out[:n]:
        request.request_id = b""
        request.priority = pb.PRIORITY_CLASS_BATCH
    return out[:n]


async def test_an_over_budget_frame_is_resent_after_the_retry_after_and_new_frames_wait_too(
    models_dir: Path, tmp_path: Path
) -> None:
    """The refused frame's request is answered OK (not failed), from a frame that left no earlier than
    the retry-after; a request taken while the agent is held back waits for the same moment."""
    first, later = ranking(2, seed=41)
    async with budget_gateway() as gateway:
        config = agent_config(
            {"hgc": gateway.endpoint}, models_dir, tmp_path / "spool", local={"enabled": False}
        )
        async with EdgeAgent(config) as agent, EdgeClient(agent.intake_endpoint) as client:
            uplink = agent.uplink
            assert uplink is not None
            await wait_for(lambda: uplink.best() is not None)
            asking = asyncio.create_task(client.infer_many([first], deadline_s=20))
            await wait_for(lambda: uplink.stats.over_budget_holds == 1, what="the refusal reached the agent")
            answers = await asyncio.gather(asking, client.infer_many([later], deadline_s=20))
            exported = {
                sample.name: sample.value
                for family in AgentCollector(agent).collect()
                for sample in family.samples
                if sample.name == "edge_over_budget_holds_total"
            }
    assert exported == {"edge_over_budget_holds_total": 1.0}  # what an operator sees of the hold
    (_, refused_ids), *after = gateway.frames
    assert [r.status for batch in answers for r in batch] == [pb.STATUS_OK, pb.STATUS_OK]
    assert {i for _, ids in after for i in ids} >= set(refused_ids)  # sent again, and not failed
    assert all(at - gateway.refused_at >= RETRY_AFTER_MS / 1000 for at, _ in after)
    assert uplink.stats.frames_rejected["over_budget"] == 1
    assert uplink.stats.resent["over_budget"] == len(refused_ids) == 1


async def test_an_agent_over_a_real_gateways_budget_gets_every_request_answered(
    models_dir: Path, tmp_path: Path
) -> None:
    """A gateway whose budget holds about two frames of this agent's at a time (64 KiB, 256 KiB/s) refuses
    the rest over_budget; the agent waits each retry-after out and sends again, until all 60 are OK."""
    budget = {"bytes_per_s": 256 << 10, "burst_bytes": 64 << 10}
    requests = ranking(60, seed=42)
    async with run_gateway(models_dir=models_dir, budget=budget) as gw:
        endpoints = {name: gw.endpoint(name) for name in gw.carriers}
        config = agent_config(
            endpoints,
            models_dir,
            tmp_path / "spool",
            local={"enabled": False},
            batching={"max_records": 10, "linger_ms": 5},
        )
        async with EdgeAgent(config) as agent, EdgeClient(agent.intake_endpoint) as client:
            uplink = agent.uplink
            assert uplink is not None
            await wait_for(lambda: uplink.best() is not None)
            responses = await client.infer_many(requests, deadline_s=30)
        refused = sum(
            gw.metrics.registry.get_sample_value(
                "hkgw_frames_rejected_total", {"carrier": name, "reason": "over_budget"}
            )
            or 0.0
            for name in gw.carriers
        )
    assert [r.status for r in responses] == [pb.STATUS_OK] * 60
    assert refused >= 1
    assert uplink.stats.frames_rejected["over_budget"] == refused
    assert uplink.stats.resent["over_budget"] >= 1
