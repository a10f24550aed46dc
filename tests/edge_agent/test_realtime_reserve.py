"""The agent's send window keeps a realtime reserve (``[uplink] realtime_reserve``): a region's batch requests
filling the window do not hold its realtime requests back at the agent. A real gateway whose backend calls are
all held (every request accepted and running, nothing answered: the window stays full) and an in-process
agent on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.agent import EdgeAgent
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
