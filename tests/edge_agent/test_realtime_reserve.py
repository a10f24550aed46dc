"""The agent's send window keeps a realtime reserve (``[uplink] realtime_reserve``): a region's batch requests
filling the window do not hold its realtime requests back at the agent. A real gateway whose backend calls are
all held (every request accepted and running, nothing answered: the window stays full) and an in-process
agent on it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from edge_agent.agent import EdgeAgent
from edge_agent.client import EdgeClient
from edgewire import pb
from gateway.testing import wait_for
from tests.edge_agent.conftest import agent_on_gateway
from tests.gateway.daemon.test_answers_follow import Caller, Gate, ids_of, slow_backends, synthetic


def held(agent: EdgeAgent, ids: list[bytes]) -> list[bool]:
    """Whether each request is at the gateway (sent and not answered)."""
    uplink = agent.uplink
    assert uplink is not None
    return [(e := uplink.outstanding.get(rid)) is not None and e.held for rid in ids]


@pytest.mark.parametrize(("reserve", "sent"), [(2, [True, True, False]), (0, [False, False, False])])
async def test_realtime_requests_go_past_a_full_send_window_up_to_the_reserve(
    models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reserve: int, sent: list[bool]
) -> None:
    """The window (8) full of batch requests the gateway holds, 10 more batch ones queued behind it: of three
    realtime requests, ``realtime_reserve`` (2) go to the gateway at once and the third waits, as do the batch
    ones; with no reserve all three wait. Once the calls are let go, every request is answered OK."""
    async with agent_on_gateway(
        models_dir,
        tmp_path / "spool",
        gateway=slow_backends(),
        local={"enabled": False},
        uplink={"send_window_initial": 8, "send_window_min": 8, "realtime_reserve": reserve},
    ) as (gw, agent):
        gate = Gate(gw, monkeypatch)
        uplink = agent.uplink
        assert uplink is not None
        caller = Caller(agent.intake_endpoint)
        try:
            first, queued, urgent = synthetic(8, seed=41), synthetic(10, seed=42), synthetic(3, seed=43)
            for request in [*first, *queued]:
                request.priority = pb.PRIORITY_CLASS_BATCH
            for request in urgent:
                request.priority = pb.PRIORITY_CLASS_REALTIME
            await caller.send(first)
            await wait_for(lambda: all(held(agent, ids_of(first))), what="the window full")
            await caller.send(queued)
            await wait_for(lambda: uplink.stats.window_full > 0, what="the batch ones held back")
            for request in urgent:
                await caller.send([request])
            await wait_for(lambda: uplink.inflight == 21, what="every request taken in")
            await wait_for(lambda: held(agent, ids_of(urgent)) == sent, what="the reserve's sends")
            await wait_for(lambda: gate.held >= 1, what="the gateway running the first calls")
            assert held(agent, ids_of(urgent)) == sent  # still: the third waits for room
            assert not any(held(agent, ids_of(queued)))
            gate.open()
            everything = ids_of([*first, *queued, *urgent])
            await wait_for(lambda: all(caller.answers[r] for r in everything), timeout_s=20)
        finally:
            await caller.aclose()
    assert caller.statuses == {pb.STATUS_OK: 21}


@pytest.mark.parametrize(
    ("reserve", "batch_taken", "realtime_status"), [(2, 6, pb.STATUS_OK), (0, 8, pb.STATUS_OVERLOADED)]
)
async def test_the_agents_intake_keeps_room_for_realtime_requests_when_batch_ones_fill_it(
    models_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    reserve: int,
    batch_taken: int,
    realtime_status: int,
) -> None:
    """``max_inflight`` (8) bounds what the agent holds for Hong Kong; batch requests may fill it only up to
    ``realtime_reserve`` (2) short of it, so with the gateway's calls all held, 6 of 8 batch requests are
    taken (2 refused "agent in-flight window full") and a realtime request still is, answered OK once the
    calls go. With no reserve the batch requests fill it and the realtime request is refused."""
    async with (
        agent_on_gateway(
            models_dir,
            tmp_path / "spool",
            gateway=slow_backends(),
            local={"enabled": False},
            uplink={"max_inflight": 8, "send_window_initial": 8, "realtime_reserve": reserve},
        ) as (gw, agent),
        EdgeClient(agent.intake_endpoint) as client,
    ):
        gate = Gate(gw, monkeypatch)
        uplink = agent.uplink
        assert uplink is not None
        batch, urgent = synthetic(8, seed=51), synthetic(1, seed=52)
        for request in batch:
            request.priority = pb.PRIORITY_CLASS_BATCH
        flood = asyncio.create_task(client.infer_many(batch, deadline_s=20))
        await wait_for(lambda: uplink.inflight == batch_taken, what="the batch requests taken in")
        page = asyncio.create_task(
            client.infer(urgent[0], deadline_s=20, priority=pb.PRIORITY_CLASS_REALTIME)
        )
        if realtime_status == pb.STATUS_OK:
            await wait_for(lambda: uplink.inflight == batch_taken + 1, what="the realtime request taken in")
        gate.open()
        batch_answers, page_answer = await asyncio.wait_for(asyncio.gather(flood, page), timeout=20)
    refused = [r for r in batch_answers if r.status == pb.STATUS_OVERLOADED]
    assert len(refused) == 8 - batch_taken
    assert all("in-flight window full" in r.error_message for r in refused)
    assert [r.status for r in batch_answers].count(pb.STATUS_OK) == batch_taken
    assert page_answer.status == realtime_status
