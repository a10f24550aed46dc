"""The edge agent end to end against a real gateway on loopback."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import zmq
import zmq.asyncio

from edge_agent.agent import EdgeAgent
from edge_agent.client import EdgeClient
from edge_agent.discovery import FailureReason
from edge_agent.drive import drive
from edge_agent.ops import AgentCollector
from edge_agent.synthetic import SyntheticTraffic
from edgewire import FrameCodec, pb
from gateway.testing import run_gateway, wait_for
from tests.edge_agent.conftest import agent_config, agent_on_gateway, spawn_agent


async def test_every_request_answered_with_the_right_tier(models_dir: Path, tmp_path: Path) -> None:
    """Synthetic traffic through the agent: all answered; edge-device requests never reach the gateway."""
    async with run_gateway(models_dir=models_dir) as gw:
        endpoints = {name: gw.endpoint(name) for name in gw.carriers}
        async with EdgeAgent(agent_config(endpoints, models_dir, tmp_path / "spool")) as agent:
            assert agent.uplink is not None
            await wait_for(lambda: agent.uplink is not None and agent.uplink.best() is not None)
            result = await drive(agent.intake_endpoint, "us-west", 300, rate=300)
        at_gateway = sum(
            gw.metrics.registry.get_sample_value(
                "hkgw_requests_total", {"region": "us-west", "model": m, "priority": p}
            )
            or 0
            for m in ("rank-mlp", "text-encoder", "image-classifier")
            for p in ("realtime", "interactive", "batch")
        )
    assert result.lost == 0
    assert sum(result.by_status.values()) == 300
    local = sum(v for k, v in result.by_route.items() if k.startswith("edge_device/"))
    assert local > 0
    assert at_gateway == agent.stats.remote
    assert agent.stats.local + agent.stats.remote + sum(agent.stats.failed_fast.values()) == 300


async def test_client_gets_one_answer_per_request(models_dir: Path, tmp_path: Path) -> None:
    """EdgeClient.infer_many returns exactly one response per request, matched by id."""
    async with run_gateway(models_dir=models_dir) as gw:
        endpoints = {name: gw.endpoint(name) for name in gw.carriers}
        async with EdgeAgent(agent_config(endpoints, models_dir, tmp_path / "spool")) as agent:
            await wait_for(lambda: agent.uplink is not None and agent.uplink.best() is not None)
            requests = [r.request for r in SyntheticTraffic(3, regions=("us-west",)).take(20)]
            for r in requests:
                r.request_id = b""
            async with EdgeClient(agent.intake_endpoint) as client:
                responses = await client.infer_many(requests, deadline_s=5.0)
    assert [r.request_id for r in responses] == [r.request_id for r in requests]
    assert Counter(r.status for r in responses) == Counter({pb.STATUS_OK: 20})


async def test_answers_from_hong_kong_reach_a_caller_in_few_frames(models_dir: Path, tmp_path: Path) -> None:
    """The gateway answers up to 256 requests per frame; the agent passes them on to the local caller the
    same way (one intake frame per caller per loop tick), not one frame per answer."""
    requests = [r.request for r in SyntheticTraffic(5, regions=("us-west",)).take(300)]
    for r in requests:
        r.priority = pb.PRIORITY_CLASS_BATCH  # spooled until answered
    codec = FrameCodec()
    answers: Counter[bytes] = Counter()
    response_frames = 0
    async with agent_on_gateway(models_dir, tmp_path / "spool", local={"enabled": False}) as (_, agent):
        ctx = zmq.asyncio.Context()
        caller = ctx.socket(zmq.DEALER)
        caller.connect(agent.intake_endpoint)
        try:
            await caller.send_multipart(codec.encode(pb.RequestBatch(requests=requests), agent_id="t"))
            while sum(answers.values()) < len(requests):
                decoded = codec.decode(await asyncio.wait_for(caller.recv_multipart(), timeout=20))
                if isinstance(decoded.payload, pb.ResponseBatch):
                    response_frames += 1
                    answers.update(r.request_id for r in decoded.payload.responses)
        finally:
            caller.close(0)
            ctx.term()
    assert set(answers) == {r.request_id for r in requests}
    assert set(answers.values()) == {1}
    assert response_frames <= len(requests) // 10


async def test_carrier_failure_moves_traffic_without_loss_or_double_service(
    models_dir: Path, tmp_path: Path
) -> None:
    """Stopping the carrier in use mid-stream: traffic moves within 3 s, 0 lost, none served twice."""
    import asyncio

    async with run_gateway(models_dir=models_dir) as gw:
        endpoints = {name: gw.endpoint(name) for name in gw.carriers}
        async with EdgeAgent(
            agent_config(
                endpoints,
                models_dir,
                tmp_path / "spool",
                routing={"thresholds": {"edge_server": 0.0, "cloud": 0.7}},
            )
        ) as agent:
            uplink = agent.uplink
            assert uplink is not None
            await wait_for(lambda: uplink.best() is not None)
            driving = asyncio.create_task(drive(agent.intake_endpoint, "us-west", 900, rate=300))
            await wait_for(lambda: uplink.stats.sent_requests > 100)
            victim = uplink.best()
            assert victim is not None
            await gw.carriers[victim.name].close()
            # The agent moves to another carrier (bounded wait, no wall-clock assert: the time it takes is
            # a figure for a benchmark, not for a test on a shared machine).
            await wait_for(lambda: (b := uplink.best()) is not None and b.name != victim.name, timeout_s=15)
            result = await driving
        served = sum(
            gw.metrics.registry.get_sample_value(
                "hkgw_responses_total", {"status": "ok", "tier": t, "pool": p}
            )
            or 0
            for t in ("edge_server", "cloud")
            for p in ("cpu", "gpu-a100-mig", "gpu-a100", "gpu-v100")
        )
    assert result.lost == 0
    assert result.by_status["OK"] + sum(v for k, v in result.by_status.items() if k != "OK") == 900
    # Never served twice: the gateway's OK answers cannot outnumber the distinct requests sent to it.
    assert sum(v for k, v in result.by_route.items() if not k.startswith("edge_device/")) <= served
    assert served <= agent.stats.remote


async def test_gateway_killed_and_restarted_loses_nothing(models_dir: Path, tmp_path: Path) -> None:
    """kill -9 of the gateway mid-stream, then a restart: every request answered once; re-runs counted."""
    import asyncio
    import socket

    from tests.gateway.daemon.process import GatewayProcess, write_config

    ports = []
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    config = write_config(tmp_path / "gw.toml", models_dir)
    config.write_text(config.read_text().replace('bind = "tcp://127.0.0.1:*"', "bind = PLACEHOLDER"))
    text = config.read_text()
    for port in ports:
        text = text.replace("bind = PLACEHOLDER", f'bind = "tcp://127.0.0.1:{port}"', 1)
    config.write_text(text)
    endpoints = {
        name: f"tcp://127.0.0.1:{port}" for name, port in zip(("hgc", "pccw", "tgt"), ports, strict=True)
    }
    first = GatewayProcess(config)
    await first.start()
    agent = EdgeAgent(
        agent_config(
            endpoints,
            models_dir,
            tmp_path / "spool",
            routing={"thresholds": {"edge_server": 0.0, "cloud": 0.7}},
        )
    )
    await agent.start()
    second: GatewayProcess | None = None
    try:
        uplink = agent.uplink
        assert uplink is not None
        await wait_for(lambda: uplink.best() is not None, timeout_s=10)
        driving = asyncio.create_task(drive(agent.intake_endpoint, "us-west", 900, rate=300))
        await wait_for(lambda: uplink.stats.sent_requests > 150, timeout_s=10)
        first.kill_group()
        await first.wait()
        first.notify.close()
        first.notify_path.unlink()
        second = GatewayProcess(config)
        await second.start()
        result = await driving
    finally:
        await agent.aclose()
        if second is not None:
            await second.stop()
    assert result.lost == 0
    assert sum(result.by_status.values()) == 900
    # A second answer from Hong Kong needs a second copy sent to a gateway that still had the first: a
    # resend after an Ack timeout or a lost carrier. The restart itself (re-executions) makes none.
    resent = uplink.stats.resent
    assert uplink.stats.duplicate_responses <= resent["ack_timeout"] + resent["carrier_down"]
    assert uplink.stats.re_executions == resent["gateway_restarted"]
    assert uplink.stats.re_executions <= agent.config.uplink.max_inflight


async def test_agent_killed_while_spooling_delivers_what_it_acknowledged(
    models_dir: Path, tmp_path: Path
) -> None:
    """kill -9 of the agent while Hong Kong is unreachable: on restart it recovers its spool and delivers
    every request it had acknowledged to callers."""
    import asyncio
    import os
    import signal
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        intake_port = s.getsockname()[1]
    async with run_gateway(models_dir=models_dir) as gw:
        endpoints = {name: gw.endpoint(name) for name in gw.carriers}
        for carrier in gw.carriers.values():  # Hong Kong unreachable while the agent spools
            gw.set_carrier_enabled(carrier.name, False)
        closed = {name: gw.carriers[name] for name in gw.carriers}
        for carrier in closed.values():
            await carrier.close()
        toml = tmp_path / "agent.toml"
        carriers = "\n".join(f'[[carriers]]\nname = "{n}"\nendpoint = "{e}"' for n, e in endpoints.items())
        toml.write_text(f"""
region = "us-west"
intake = "tcp://127.0.0.1:{intake_port}"
{carriers}
[local]
enabled = false
[spool]
directory = "{tmp_path / "spool"}"
fsync = "always"
[uplink]
ping_interval_s = 0.1
dead_after_s = 0.6
[http]
port = 0
""")
        proc = await spawn_agent(toml)
        requests = [r.request for r in SyntheticTraffic(5, regions=("us-west",)).take(400)]
        acked: list[bytes] = []
        async with EdgeClient(f"tcp://127.0.0.1:{intake_port}") as client:
            calls = []
            for request in requests:
                request.request_id = b""
                request.priority = pb.PRIORITY_CLASS_BATCH
                calls.append(asyncio.create_task(client.infer(request, deadline_s=120)))
            # kill -9 mid-stream: once the agent has acknowledged (spooled) a good part of them
            await wait_for(lambda: len(client.accepted) > 150, timeout_s=60, what="150 requests acked")
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            acked = list(client.accepted)
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
        spooled = len(list((tmp_path / "spool").rglob("*.wal")))
        assert spooled > 0
        # Hong Kong comes back; the agent restarts and must deliver its spool.
        for name in closed:
            gw.set_carrier_enabled(name, True)
        async with run_gateway(
            models_dir=models_dir, carriers=[{"name": n, "bind": e} for n, e in endpoints.items()]
        ) as gw2:
            restarted = await spawn_agent(toml)
            try:
                assert gw2.ingest is not None
                ingest = gw2.ingest

                def missing() -> list[bytes]:
                    now = time.monotonic()
                    return [rid for rid in acked if ingest.dedupe.state(rid, now) is None]

                await wait_for(lambda: not missing(), timeout_s=30)
            finally:
                os.killpg(restarted.pid, signal.SIGKILL)
                await restarted.wait()
    assert len(acked) > 100


async def test_agent_follows_dns_srv_including_a_ttl_change(models_dir: Path, tmp_path: Path) -> None:
    """The agent finds the carriers through SRV on a real DNS responder and follows a change after the TTL."""
    from urllib.parse import urlsplit

    from edge_agent.testing_dns import AuthoritativeDNS

    srv = "_edgeinfer._tcp.ingest.hk.test."
    async with run_gateway(models_dir=models_dir) as gw, AuthoritativeDNS() as dns_server:
        ports = {name: urlsplit(gw.endpoint(name)).port or 0 for name in gw.carriers}
        for name in ports:
            dns_server.set_a(f"{name}.ingest.hk.test.", ["127.0.0.1"], ttl=1)
        dns_server.set_srv(
            srv, [(10, 10, port, f"{name}.ingest.hk.test.") for name, port in ports.items()], ttl=1
        )
        config = agent_config(
            {"static": "tcp://127.0.0.1:9"},
            models_dir,
            tmp_path / "spool",
            discovery={
                "mode": "srv",
                "name": srv,
                "nameservers": [f"127.0.0.1:{dns_server.port}"],
                "min_ttl_s": 0.2,
            },
        )
        async with EdgeAgent(config) as agent:
            uplink = agent.uplink
            assert uplink is not None
            await wait_for(lambda: set(uplink.carriers) == set(ports), timeout_s=5)
            await wait_for(lambda: uplink.best() is not None)
            dns_server.set_srv(
                srv,
                [
                    (10, 10, ports["pccw"], "pccw.ingest.hk.test."),
                    (20, 10, ports["tgt"], "tgt.ingest.hk.test."),
                ],
                ttl=1,
            )
            await wait_for(lambda: set(uplink.carriers) == {"pccw", "tgt"}, timeout_s=5)
            result = await drive(agent.intake_endpoint, "us-west", 60, rate=200)
            exported = [
                (sample.name, sample.labels, sample.value)
                for family in AgentCollector(agent).collect()
                for sample in family.samples
            ]
    assert result.lost == 0
    assert dns_server.query_count(srv, "SRV") >= 2
    answers = {
        labels["source"]: value for name, labels, value in exported if name == "edge_discovery_answers_total"
    }
    failures = [value for name, _, value in exported if name == "edge_discovery_failures_total"]
    assert answers["srv"] >= 2 and answers["cache"] == answers["static"] == 0
    assert len(failures) == len(FailureReason) and sum(failures) == 0
    assert ("edge_discovery_endpoints", {}, 2) in exported
