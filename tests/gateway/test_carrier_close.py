"""A carrier closes while its agents disconnect: libzmq's I/O thread sends each socket-monitor event blocking,
holding the socket's monitor mutex, so an event that comes after our end of the monitor closed blocked that
thread for good, and ``disable_monitor()`` (and the gateway's exit) with it. It did, about one close in six,
before the carrier disabled its monitor first. Each round here closes agents and the carrier together; a
round that does not finish within its time fails the test."""

from __future__ import annotations

import asyncio
import threading

import zmq
import zmq.asyncio

from gateway.config import CarrierConfig, LimitsConfig, ZmqConfig
from gateway.ingress.carrier import CarrierIngress
from gateway.ops.metrics import GatewayMetrics

ROUNDS = 30
AGENTS = 4
ROUND_S = 10.0


async def _round() -> None:
    ctx = zmq.asyncio.Context()
    carrier = CarrierIngress(
        CarrierConfig(name="hgc", bind="tcp://127.0.0.1:*"),
        ctx,
        ZmqConfig(),
        LimitsConfig(),
        GatewayMetrics(models={}),
        lambda c, f: None,
    )
    carrier.start()
    agents = []
    for _ in range(AGENTS):
        agent = zmq.Socket(ctx, zmq.DEALER)
        agent.connect(carrier.endpoint)
        agent.send(b"hello")
        agents.append(agent)
    for _ in range(500):  # every connection accepted (its events in the monitor's queue)
        if carrier.peers >= AGENTS:
            break
        await asyncio.sleep(0.01)
    assert carrier.peers == AGENTS
    for agent in agents:
        agent.close(0)  # their disconnects race the carrier's close
    await carrier.close()
    ctx.term()


def test_close_while_agents_disconnect_does_not_hang() -> None:
    for i in range(ROUNDS):
        errors: list[BaseException] = []

        def run(errors: list[BaseException] = errors) -> None:
            try:
                asyncio.run(_round())
            except BaseException as exc:  # noqa: BLE001  (reported by the test below)
                errors.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(ROUND_S)
        assert not thread.is_alive(), f"round {i}: the carrier's close hung"
        assert not errors, f"round {i}: {errors[0]!r}"
