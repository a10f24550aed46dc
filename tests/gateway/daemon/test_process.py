"""The gateway as a process: systemd notify, SIGTERM drain without loss, SIGHUP reload."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from edgewire import pb
from gateway.testing import WireClient, fresh_requests, wait_for
from tests.gateway.daemon.process import GatewayProcess, write_config
from tests.gateway.daemon.test_serving import synthetic


@pytest.fixture
async def gateway_process(tmp_path: Path, models_dir: Path) -> AsyncIterator[GatewayProcess]:
    process = GatewayProcess(write_config(tmp_path / "gateway.toml", models_dir))
    try:
        await process.start()
        yield process
    finally:
        await process.stop()


async def scrape(process: GatewayProcess, path: str = "/metrics") -> tuple[int, str]:
    url = f"http://127.0.0.1:{process.http_port}{path}"
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return resp.status, await resp.text()


async def test_notify_ready_watchdog_and_stopping(gateway_process: GatewayProcess) -> None:
    """systemd sees READY=1 once bound, WATCHDOG=1 while the loop runs, STOPPING=1 on SIGTERM, then exit 0."""
    await wait_for(lambda: gateway_process.read_notifications().count("WATCHDOG=1") >= 3, timeout_s=10)
    gateway_process.signal(signal.SIGTERM)
    assert await gateway_process.wait() == 0
    notes = gateway_process.read_notifications()
    assert notes[0] == "READY=1"
    assert "STOPPING=1" in notes
    assert notes.index("STOPPING=1") > notes.index("WATCHDOG=1")


async def test_sigterm_drains_without_losing_accepted_work(gateway_process: GatewayProcess) -> None:
    """Every request acknowledged before SIGTERM is answered (served, or handed back retryable); exit 0."""
    base = synthetic(40, seed=51)
    async with WireClient(gateway_process.endpoint("hgc")) as agent:
        message_ids = [await agent.send(fresh_requests(base, budget_s=30)) for _ in range(25)]
        await agent.wait_ack(message_ids[0])
        gateway_process.signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while gateway_process.proc is not None and gateway_process.proc.returncode is None:
            await agent.receive_one(0.1)
            if time.monotonic() > deadline:
                break
        while await agent.receive_one(0.2):
            pass
        code = await gateway_process.wait()
    accepted = [rid for ack in agent.acks.values() for rid in ack.accepted_ids]
    assert code == 0
    assert accepted
    missing = [rid for rid in accepted if rid not in agent.responses]
    assert not missing, f"{len(missing)} accepted requests got no answer"
    statuses = {agent.responses[rid].status for rid in accepted}
    assert statuses <= {pb.STATUS_OK, pb.STATUS_UNAVAILABLE}
    for rid in accepted:
        if agent.responses[rid].status == pb.STATUS_UNAVAILABLE:
            assert agent.responses[rid].retry_after_ms > 0
    nacked = [n for ack in agent.acks.values() for n in ack.nacks]
    assert {n.reason for n in nacked} <= {pb.NACK_REASON_DRAINING, pb.NACK_REASON_OVERLOADED}, nacked[:3]
    assert agent.duplicate_responses == 0


async def test_sighup_reloads_routing_and_keeps_serving(
    gateway_process: GatewayProcess, models_dir: Path
) -> None:
    """A SIGHUP applies a new routing policy without dropping traffic; an invalid file keeps the old one."""
    ranking = synthetic(6, seed=52, kind=pb.REQUEST_KIND_RANKING)
    async with WireClient(gateway_process.endpoint("pccw")) as agent:
        before = await agent.infer(fresh_requests(ranking))
        assert {r.route_reason for r in before} != {"model_pinned"}
        pinned = write_config(
            gateway_process.config,
            models_dir,
            extra="""
[routing.models.rank-mlp]
kind = "ranking"
pin_pool = "gpu-a100"
[routing.models.text-encoder]
kind = "text"
[routing.models.image-classifier]
kind = "image"
"""
            + _default_routing_pools(),
        )
        assert pinned.exists()
        gateway_process.signal(signal.SIGHUP)
        await wait_for(lambda: any(r.get("event") == "reloaded" for r in gateway_process.logs), timeout_s=10)
        after = await agent.infer(fresh_requests(ranking))
        gateway_process.config.write_text("this is [not toml")
        gateway_process.signal(signal.SIGHUP)
        await wait_for(lambda: any("reload failed" in str(r.get("event")) for r in gateway_process.logs), 10)
        still = await agent.infer(fresh_requests(ranking))
    assert {(r.pool, r.route_reason) for r in after} == {("gpu-a100", "model_pinned")}
    assert {(r.pool, r.route_reason) for r in still} == {("gpu-a100", "model_pinned")}
    _, body = await scrape(gateway_process)
    assert 'hkgw_reloads_total{outcome="ok"} 1.0' in body
    assert 'hkgw_reloads_total{outcome="failed"} 1.0' in body


async def test_sighup_applies_a_new_log_level(gateway_process: GatewayProcess, models_dir: Path) -> None:
    """A reload to level "warning" silences info lines (its own "reloaded" included) while errors still
    show; a reload back to "info" brings them back, saying the logging changed."""
    path = gateway_process.config

    def events(name: str) -> list[dict[str, object]]:
        return [r for r in gateway_process.logs if r.get("event") == name]

    write_config(path, models_dir)
    path.write_text(
        path.read_text().replace(
            '[logging]\nformat = "json"', '[logging]\nformat = "json"\nlevel = "warning"'
        )
    )
    assert 'level = "warning"' in path.read_text()
    gateway_process.signal(signal.SIGHUP)

    async def reloaded_ok() -> bool:
        return 'hkgw_reloads_total{outcome="ok"} 1.0' in (await scrape(gateway_process))[1]

    deadline = time.monotonic() + 10
    while not await reloaded_ok():  # the quiet reload is done (its own line is not written)
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    quiet = path.read_text()
    path.write_text("this is [not toml")
    gateway_process.signal(signal.SIGHUP)  # processed after the first: an error line, still written
    await wait_for(lambda: bool(events("reload failed; keeping the running config")), timeout_s=10)
    assert not events("reloaded")
    path.write_text(quiet.replace('level = "warning"', 'level = "info"'))
    gateway_process.signal(signal.SIGHUP)
    await wait_for(lambda: bool(events("reloaded")), timeout_s=10)
    [reloaded] = events("reloaded")
    assert reloaded["logging_changed"] is True and reloaded["level"] == "info"


def test_reload_keeps_the_command_lines_overrides(tmp_path: Path, models_dir: Path) -> None:
    """`hk-gateway --log-level debug`, then SIGHUP with the file unchanged: the command line's level stays
    (a reload reads the file with the same overrides), so the logging is not touched."""
    import structlog

    from gateway.config import load_config
    from gateway.server import Gateway

    path = write_config(tmp_path / "gateway.toml", models_dir)
    overrides = {"logging": {"level": "debug"}}
    gateway = Gateway(load_config(path, overrides=overrides), config_path=path, overrides=overrides)
    with structlog.testing.capture_logs() as logs:
        assert gateway.reload()
    [reloaded] = [e for e in logs if e["event"] == "reloaded"]
    assert reloaded["logging_changed"] is False


def _default_routing_pools() -> str:
    return "\n".join(
        f"""
[[routing.pools]]
name = "{name}"
tier = "{tier}"
models = ["rank-mlp", "text-encoder", "image-classifier"]
priorities = {priorities}
"""
        for name, tier, priorities in [
            ("cpu", "edge_server", '["realtime", "interactive", "batch"]'),
            ("gpu-a100-mig", "cloud", '["realtime", "interactive"]'),
            ("gpu-a100", "cloud", '["interactive", "batch"]'),
            ("gpu-v100", "cloud", '["interactive", "batch"]'),
        ]
    )


async def test_health_goes_draining_while_in_flight_work_finishes(tmp_path: Path, models_dir: Path) -> None:
    """Right after SIGTERM the carriers answer 503 DRAINING while the process finishes its work."""
    process = GatewayProcess(write_config(tmp_path / "slow.toml", models_dir))
    try:
        await process.start()
        async with WireClient(process.endpoint("hgc")) as agent:
            await agent.send(fresh_requests(synthetic(40, seed=53, kind=pb.REQUEST_KIND_IMAGE), budget_s=30))
            process.signal(signal.SIGTERM)
            seen: set[tuple[int, str]] = set()
            for _ in range(20):
                try:
                    status, body = await scrape(process, "/health/carriers/hgc")
                except aiohttp.ClientError:
                    break
                seen.add((status, body.split()[0]))
                await asyncio.sleep(0.01)
        assert await process.wait() == 0
    finally:
        await process.stop()
    assert (503, "STATUS:DRAINING") in seen
