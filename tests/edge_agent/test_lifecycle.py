"""The agent's lifecycle: serve(stop) = start -> wait -> drain -> close; aclose is safe before start and
safe twice."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from edge_agent.agent import EdgeAgent
from edge_agent.client import EdgeClient
from edge_agent.spool import Spool, SpoolBusyError
from edgewire import pb
from gateway.testing import run_gateway, wait_for
from tests.edge_agent.conftest import NOWHERE, agent_config, heavy_realtime

BOUND_S = 20.0  # bounds each test; the drains below have deadlines far beyond it


def spool_is_free(agent: EdgeAgent) -> bool:
    """True when another Spool may open the agent's spool directory (the agent let go of it)."""
    try:
        Spool(agent.config.spool.directory / agent.config.name).close()
    except SpoolBusyError:
        return False
    return True


async def test_aclose_before_start_is_safe_and_a_closed_agent_does_not_start(
    models_dir: Path, tmp_path: Path
) -> None:
    """aclose() on an agent never started does nothing harmful; start() afterwards refuses clearly."""
    agent = EdgeAgent(agent_config(NOWHERE, models_dir, tmp_path / "spool"))
    await agent.aclose()
    await agent.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await agent.start()
    assert agent.intake is None and agent.spool is None and agent.uplink is None


async def test_aclose_twice_after_start_is_safe_and_releases_everything(
    models_dir: Path, tmp_path: Path
) -> None:
    """The first aclose() releases the spool and the intake; the second is a no-op."""
    agent = EdgeAgent(agent_config(NOWHERE, models_dir, tmp_path / "spool", local={"enabled": False}))
    await agent.start()
    assert not spool_is_free(agent)
    await agent.aclose()
    assert spool_is_free(agent)
    await agent.aclose()
    assert spool_is_free(agent)


async def test_drain_with_nothing_in_flight_returns_at_once_not_at_its_deadline(
    models_dir: Path, tmp_path: Path
) -> None:
    """An idle agent's drain returns 0 without waiting for its (hour-long) deadline."""
    async with EdgeAgent(
        agent_config(NOWHERE, models_dir, tmp_path / "spool", local={"enabled": False})
    ) as agent:
        left = await asyncio.wait_for(agent.drain(timeout_s=3600), timeout=BOUND_S)
    assert left == 0


async def test_serve_answers_what_is_in_flight_when_stopped_then_closes(
    models_dir: Path, tmp_path: Path
) -> None:
    """serve(stop): the agent takes requests; when stop is set it takes no more, answers what it has in
    flight, returns 0 (nothing unanswered) and has released its spool."""
    async with run_gateway(models_dir=models_dir) as gw:
        endpoints = {name: gw.endpoint(name) for name in gw.carriers}
        agent = EdgeAgent(agent_config(endpoints, models_dir, tmp_path / "spool", local={"enabled": False}))
        stop = asyncio.Event()
        serving = asyncio.create_task(agent.serve(stop, drain_timeout_s=3600))
        await wait_for(lambda: agent.uplink is not None and agent.uplink.best() is not None)
        assert agent.uplink is not None
        uplink = agent.uplink
        async with EdgeClient(agent.intake_endpoint) as client:
            answering = asyncio.create_task(
                client.infer_many(heavy_realtime(10), deadline_s=10, priority=pb.PRIORITY_CLASS_BATCH)
            )
            await wait_for(lambda: uplink.stats.sent_requests >= 10)
            stop.set()
            left = await asyncio.wait_for(serving, timeout=BOUND_S)
            responses = await answering
    assert left == 0
    assert [r.status for r in responses] == [pb.STATUS_OK] * 10
    assert spool_is_free(agent)


async def test_serve_closes_the_agent_when_its_start_fails(models_dir: Path, tmp_path: Path) -> None:
    """A start that fails (the spool held by another) raises from serve() and leaves nothing open."""
    config = agent_config(NOWHERE, models_dir, tmp_path / "spool", local={"enabled": False})
    with Spool(config.spool.directory / config.name):
        agent = EdgeAgent(config)
        with pytest.raises(SpoolBusyError):
            await asyncio.wait_for(agent.serve(asyncio.Event()), timeout=BOUND_S)
    assert agent.intake is None
    with pytest.raises(RuntimeError, match="closed"):
        await agent.start()


async def test_a_start_that_fails_to_bind_the_intake_raises_and_releases_everything(
    models_dir: Path, tmp_path: Path
) -> None:
    """The intake's port already in use: start() raises the bind error, promptly (the sockets it had
    made are closed, so the ZeroMQ context can end), and the spool is released."""
    context = zmq.asyncio.Context()
    holder = context.socket(zmq.ROUTER)
    holder.setsockopt(zmq.LINGER, 0)
    port = holder.bind_to_random_port("tcp://127.0.0.1")
    try:
        config = agent_config(
            NOWHERE,
            models_dir,
            tmp_path / "spool",
            local={"enabled": False},
            intake=f"tcp://127.0.0.1:{port}",
        )
        agent = EdgeAgent(config)
        with pytest.raises(zmq.ZMQError):
            await asyncio.wait_for(agent.start(), timeout=BOUND_S)
    finally:
        holder.close(0)
        context.term()
    assert spool_is_free(agent)
