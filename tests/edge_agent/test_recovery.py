"""Recovery after outages (issue 23 items 1 and 3): every carrier black-holed under traffic, and a gateway
killed with kill -9 and restarted on the same ports while the agent holds a backlog.

Counts and mechanisms only (socket options in force, connection events, the send window's state); the
recovery times are bench/chaos.py's figures, not asserted here.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter
from pathlib import Path

import pytest
import zmq

from bench.blackhole import BlackHole, unavailable
from edge_agent.agent import EdgeAgent
from edge_agent.client import EdgeClient
from edgewire import pb
from gateway.testing import wait_for
from tests.edge_agent.conftest import agent_config, agent_on_gateway, heavy_realtime
from tests.gateway.daemon.process import GatewayProcess, write_config

TO_HONG_KONG = {"thresholds": {"edge_server": 0.0, "cloud": 0.7}}  # nothing is edge-device work


def isolated_network() -> str | None:
    """Why black-holes must not be made here (this namespace has more than loopback), or None."""
    interfaces = {name for _, name in socket.if_nameindex()}  # this namespace's (not sysfs's view)
    if interfaces - {"lo"}:
        return f"run inside 'unshare --net' (black-holes apply to the namespace; here: {sorted(interfaces)})"
    return None


TEMPLATES = heavy_realtime(16)


def interactive(n: int) -> list[pb.InferRequest]:
    """``n`` ranking requests for Hong Kong of a spooled class (interactive), without ids; copies of a
    few synthetic ones (generating thousands would hold the event loop the agent runs on)."""
    requests = []
    for i in range(n):
        request = pb.InferRequest()
        request.CopyFrom(TEMPLATES[i % len(TEMPLATES)])
        request.priority = pb.PRIORITY_CLASS_INTERACTIVE
        requests.append(request)
    return requests


def free_ports(n: int) -> list[int]:
    ports = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    return ports


async def test_every_carrier_black_holed_reconnects_with_bounded_attempts_and_loses_nothing(
    models_dir: Path, tmp_path: Path
) -> None:
    """Every carrier black-holed (packets dropped, no RST) while requests arrive: the intake refuses none
    (the spool takes them), each carrier goes down and keeps making timed-out, bounded connect attempts
    instead of waiting in the kernel's SYN backoff, and after the restore a carrier comes up again and
    every request is answered once, OK."""
    skip = unavailable() or isolated_network()
    if skip:
        pytest.skip(skip)
    async with agent_on_gateway(
        models_dir, tmp_path / "spool", local={"enabled": False}, routing=TO_HONG_KONG
    ) as (gw, agent):
        uplink = agent.uplink
        assert uplink is not None
        up = agent.config.uplink
        for carrier in uplink.carriers.values():
            assert carrier.sock.getsockopt(zmq.CONNECT_TIMEOUT) == up.connect_timeout_ms
            assert carrier.sock.getsockopt(zmq.TCP_MAXRT) == up.tcp_maxrt_ms
            assert carrier.sock.getsockopt(zmq.RECONNECT_IVL_MAX) <= up.reconnect_ivl_max_ms * (
                1 + up.reconnect_jitter
            )
        ports = [int(gw.endpoint(name).rsplit(":", 1)[1]) for name in gw.carriers]
        carriers = dict(uplink.carriers)  # aclose empties the uplink's
        assert len(carriers) == len(ports) == 3
        retried = {name: c.events["connect_retried"] for name, c in uplink.carriers.items()}
        down = {name: c.went_down for name, c in uplink.carriers.items()}
        async with EdgeClient(agent.intake_endpoint) as client:
            before = asyncio.create_task(client.infer_many(interactive(50), deadline_s=30))
            await wait_for(lambda: uplink.stats.sent_requests >= 50, what="traffic flowing")
            with contextlib.ExitStack() as holes:
                for port in ports:
                    holes.enter_context(BlackHole(port))
                await wait_for(lambda: uplink.best() is None, timeout_s=10, what="every carrier dead")
                during = asyncio.create_task(client.infer_many(interactive(200), deadline_s=30))
                # Two reconnect attempts each that ended by timing out (a connect into a black hole
                # otherwise ends only with the kernel's SYN retries, minutes later).
                await wait_for(
                    lambda: all(
                        c.events["connect_retried"] >= retried[n] + 2 for n, c in uplink.carriers.items()
                    ),
                    timeout_s=20,
                    what="connect attempts timed out and retried on every carrier",
                )
                await wait_for(lambda: agent.stats.remote >= 250, what="the outage's requests accepted")
                assert agent.spool is not None
                spooled_at_restore = agent.spool.live_records
            await wait_for(lambda: uplink.best() is not None, timeout_s=20, what="a carrier up again")
            after = await client.infer_many(interactive(50), deadline_s=30)
            responses = [*await before, *await during, *after]
    assert Counter(r.status for r in responses) == Counter({pb.STATUS_OK: 300})
    assert len({r.request_id for r in responses}) == 300
    assert agent.stats.refused == 0
    assert spooled_at_restore >= 200  # the outage's requests waited in the spool, none refused
    for name, carrier in carriers.items():
        assert carrier.went_down > down[name]
        assert all(
            0 < wait <= up.reconnect_ivl_max_ms * (1 + up.reconnect_jitter) for wait in carrier.retry_waits_ms
        )
    assert sum(c.came_up for c in carriers.values()) >= len(ports) + 1  # at start, and after


async def test_gateway_killed_and_restarted_under_a_backlog_is_paced_not_stormed(
    models_dir: Path, tmp_path: Path
) -> None:
    """kill -9 of a real gateway under traffic, a backlog far above its pool queues built while it is
    down, a restart on the same ports: every request is answered once, OK (no DEADLINE_EXCEEDED with 30 s
    deadlines), with at most 0.1 OVERLOADED refusals per request, because the send window started again
    small after the restart and held the backlog back."""
    ports = free_ports(3)
    names = ("hgc", "pccw", "tgt")
    binds = {name: f"tcp://127.0.0.1:{port}" for name, port in zip(names, ports, strict=True)}
    config = write_config(tmp_path / "gw.toml", models_dir, binds=binds)
    first = GatewayProcess(config)
    await first.start()
    agent = EdgeAgent(
        agent_config(binds, models_dir, tmp_path / "spool", local={"enabled": False}, routing=TO_HONG_KONG)
    )
    await agent.start()
    second: GatewayProcess | None = None
    try:
        uplink = agent.uplink
        assert uplink is not None
        await wait_for(lambda: uplink.best() is not None, timeout_s=10)
        async with EdgeClient(agent.intake_endpoint) as client:
            flowing = asyncio.create_task(client.infer_many(interactive(200), deadline_s=30))
            await wait_for(lambda: uplink.stats.sent_requests >= 100, what="traffic flowing")
            first.kill_group()
            await first.wait()
            first.notify.close()
            first.notify_path.unlink()
            await wait_for(lambda: uplink.best() is None, timeout_s=10, what="the gateway found gone")
            backlog = [
                asyncio.create_task(client.infer_many(interactive(300), deadline_s=30)) for _ in range(12)
            ]
            await wait_for(lambda: agent.stats.remote >= 3800, timeout_s=20, what="the backlog accepted")
            second = GatewayProcess(config)
            await second.start()
            responses = [*await flowing]
            for part in backlog:
                responses.extend(await part)
    finally:
        await agent.aclose()
        if second is not None:
            await second.stop()
        else:
            await first.stop()
    total = len(responses)
    assert total == 3800
    assert Counter(r.status for r in responses) == Counter({pb.STATUS_OK: total})
    assert len({r.request_id for r in responses}) == total
    refused = uplink.stats.nacks["overloaded"] + uplink.stats.resent["retryable_status"]
    assert refused <= 0.1 * total, f"{refused} OVERLOADED refusals for {total} requests"
    assert uplink.window.restarts >= 1
    assert uplink.stats.window_full > 0  # the window, not the gateway's queues, held the backlog back
