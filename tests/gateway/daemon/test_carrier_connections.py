"""Frames an agent sends right before it closes its socket: what reaches the gateway and what it counts.

The gateway's ZAP handler runs on the event loop these tests run on. While a test does not yield, no CURVE
handshake can complete: frames the agent sends meanwhile wait in the agent's own queue, which is exactly
where a socket closed at once leaves them.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq
import zmq.auth

from edgewire import FrameCodec, pb
from gateway.ingress.auth import write_keypair
from gateway.ingress.carrier import CONNECTION_EVENTS
from gateway.server import Gateway
from gateway.testing import run_gateway, wait_for

AGENT = "edge-us-west-1"
FRAMES = 200


@pytest.fixture
def curve(tmp_path: Path) -> tuple[dict[str, str], tuple[bytes, bytes, bytes]]:
    """A gateway security section allowing one agent, and that agent's (public, secret, server public)."""
    _, server_secret = write_keypair(tmp_path / "server", "gateway")
    agent_public, agent_secret = write_keypair(tmp_path / "agent", AGENT, {"agent-id": AGENT})
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    shutil.copy(agent_public, authorized / agent_public.name)
    public, secret = zmq.auth.load_certificate(agent_secret)
    server_public, _ = zmq.auth.load_certificate(server_secret)
    assert secret is not None
    security = {
        "mode": "curve",
        "server_secret_key": str(server_secret),
        "authorized_agents": str(authorized),
    }
    return security, (public, secret, server_public)


@pytest.fixture
async def gateway(
    models_dir: Path, curve: tuple[dict[str, str], tuple[bytes, bytes, bytes]]
) -> AsyncIterator[Gateway]:
    async with run_gateway(models_dir=models_dir, security=curve[0]) as gw:
        yield gw


def connections(gw: Gateway) -> dict[str, float]:
    return {
        event: gw.metrics.registry.get_sample_value(
            "hkgw_carrier_connections_total", {"carrier": "hgc", "event": event}
        )
        or 0.0
        for event in CONNECTION_EVENTS
    }


def pings_received(gw: Gateway) -> float:
    labels = {"carrier": "hgc", "kind": "ping"}
    return gw.metrics.registry.get_sample_value("hkgw_frames_received_total", labels) or 0.0


def connected_dealer(
    context: zmq.Context[zmq.Socket[bytes]], endpoint: str, keys: tuple[bytes, bytes, bytes], linger_ms: int
) -> zmq.Socket[bytes]:
    """A CURVE DEALER whose TCP connection is up (its own monitor says so); the handshake is still on."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = keys
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED)
    sock.connect(endpoint)
    assert monitor.poll(5000), "agent did not connect"
    sock.disable_monitor()
    monitor.close(0)
    return sock


def send_pings(sock: zmq.Socket[bytes]) -> None:
    codec = FrameCodec()
    for nonce in range(FRAMES):
        sock.send_multipart(codec.encode(pb.Ping(nonce=nonce), agent_id=AGENT))


async def test_frames_dropped_by_an_agent_closing_with_linger_0_never_arrive_but_its_connection_is_counted(
    gateway: Gateway, curve: tuple[dict[str, str], tuple[bytes, bytes, bytes]]
) -> None:
    """Linger 0: the queued frames die with the agent's socket; the gateway counts the connection's life."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = connected_dealer(context, gateway.endpoint("hgc"), curve[1], linger_ms=0)
    send_pings(sock)
    sock.close()
    context.term()  # without yielding: the handshake could not finish, so none of the frames left the agent
    await wait_for(lambda: connections(gateway)["disconnected"] == 1, what="disconnect counted")
    assert pings_received(gateway) == 0
    assert connections(gateway) == {
        "accepted": 1,
        "accept_failed": 0,
        "handshake_succeeded": 0,
        "handshake_failed": 1,
        "disconnected": 1,
    }
    failures = {"carrier": "hgc", "reason": "no_detail"}
    assert gateway.metrics.registry.get_sample_value("hkgw_handshake_failures_total", failures) == 1
    assert gateway.carriers["hgc"].peers == 0


async def test_an_agent_closing_with_linger_has_every_frame_counted(
    gateway: Gateway, curve: tuple[dict[str, str], tuple[bytes, bytes, bytes]]
) -> None:
    """Linger > 0: the same frames, sent and closed at once, all arrive once the handshake completes."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = connected_dealer(context, gateway.endpoint("hgc"), curve[1], linger_ms=10_000)
    send_pings(sock)
    sock.close()
    # term waits for the agent's queue to drain (linger); meanwhile the loop answers the handshake.
    await asyncio.to_thread(context.term)
    await wait_for(lambda: pings_received(gateway) == FRAMES, what="every ping counted")
    await wait_for(lambda: connections(gateway)["disconnected"] == 1, what="disconnect counted")
    assert connections(gateway) == {
        "accepted": 1,
        "accept_failed": 0,
        "handshake_succeeded": 1,
        "handshake_failed": 0,
        "disconnected": 1,
    }


async def test_connection_events_are_exported_before_any_connection(gateway: Gateway) -> None:
    """Every carrier's connection series exist at zero from the start (an alert can compare them)."""
    body = gateway.metrics.render().decode()
    for carrier in ("hgc", "pccw", "tgt"):
        for event in CONNECTION_EVENTS:
            assert f'hkgw_carrier_connections_total{{carrier="{carrier}",event="{event}"}} 0.0' in body
