"""The gateway as a process: systemd notify, SIGTERM drain without loss, SIGHUP reload."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from edgewire import pb
from gateway.testing import WireClient, fresh_requests, wait_for
from tests.gateway.daemon.process import (
    SHARDS,
    GatewayProcess,
    agent_ids,
    write_config,
)
from tests.gateway.daemon.test_serving import synthetic


@pytest.fixture(params=SHARDS)
async def gateway_process(
    request: pytest.FixtureRequest, tmp_path: Path, models_dir: Path
) -> AsyncIterator[GatewayProcess]:
    """The gateway as one process (shards1), and as a front with two shards behind it (shards2)."""
    shards: int = request.param
    process = GatewayProcess(write_config(tmp_path / "gateway.toml", models_dir, shards=shards))
    try:
        await process.start()
        assert process.shards == shards
        if shards > 1:
            assert len(process.ready["shard_pids"]) == shards
        yield process
    finally:
        await process.stop()


@contextlib.asynccontextmanager
async def agents_on_every_shard(process: GatewayProcess, carrier: str) -> AsyncIterator[list[WireClient]]:
    """One agent per shard (one in all for a single process), so that traffic reaches every shard."""
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(WireClient(process.endpoint(carrier), agent_id=agent))
            for agent in agent_ids(process.shards)
        ]


# Every log line is one write(2) (service/logs.py), so the front's and the shards' simultaneous lines (the
# "reloaded" of each on SIGHUP) never run together; GatewayProcess raises InterleavedLogLines if they do.
RELOAD_CASES = [pytest.param(1, id="shards1"), pytest.param(2, id="shards2")]


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
    assert notes.count("READY=1") == 1  # with shards, only the front talks to systemd
    assert "STOPPING=1" in notes
    assert notes.index("STOPPING=1") > notes.index("WATCHDOG=1")


async def test_sigterm_drains_without_losing_accepted_work(gateway_process: GatewayProcess) -> None:
    """Every request acknowledged before SIGTERM is answered (served, or handed back retryable: drained, or
    pushed out of a full queue for a more urgent one); exit 0.
    With shards, an agent on each shard: every shard drains its own accepted work."""
    base = synthetic(40, seed=51)
    async with agents_on_every_shard(gateway_process, "hgc") as agents:
        sent = {
            agent.agent_id: [await agent.send(fresh_requests(base, budget_s=30)) for _ in range(25)]
            for agent in agents
        }
        for agent in agents:
            await agent.wait_ack(sent[agent.agent_id][0])
        gateway_process.signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while gateway_process.proc is not None and gateway_process.proc.returncode is None:
            for agent in agents:
                await agent.receive_one(0.1 / len(agents))
            if time.monotonic() > deadline:
                break
        for agent in agents:
            for _ in range(100_000):
                if not await agent.receive_one(0.2):
                    break
        code = await gateway_process.wait()
    assert code == 0
    for agent in agents:
        accepted = [rid for ack in agent.acks.values() for rid in ack.accepted_ids]
        assert accepted, agent.agent_id
        missing = [rid for rid in accepted if rid not in agent.responses]
        assert not missing, f"{agent.agent_id}: {len(missing)} accepted requests got no answer"
        statuses = {agent.responses[rid].status for rid in accepted}
        # OVERLOADED: a less urgent request whose place in a full queue a more urgent one took
        assert statuses <= {pb.STATUS_OK, pb.STATUS_UNAVAILABLE, pb.STATUS_OVERLOADED}
        for rid in accepted:
            if agent.responses[rid].status != pb.STATUS_OK:
                assert agent.responses[rid].retry_after_ms > 0
        nacked = [n for ack in agent.acks.values() for n in ack.nacks]
        assert {n.reason for n in nacked} <= {pb.NACK_REASON_DRAINING, pb.NACK_REASON_OVERLOADED}, nacked[:3]
        assert agent.duplicate_responses == 0


@pytest.mark.parametrize("gateway_process", RELOAD_CASES, indirect=True)
async def test_sighup_reloads_routing_and_keeps_serving(
    gateway_process: GatewayProcess, models_dir: Path
) -> None:
    """A SIGHUP applies a new routing policy without dropping traffic; an invalid file keeps the old one.
    With shards, the front signals every shard, and each applies it to its own agents."""
    ranking = synthetic(6, seed=52, kind=pb.REQUEST_KIND_RANKING)
    async with agents_on_every_shard(gateway_process, "pccw") as agents:
        before = [r for agent in agents for r in await agent.infer(fresh_requests(ranking))]
        assert {r.route_reason for r in before} != {"model_pinned"}
        pinned = write_config(
            gateway_process.config,
            models_dir,
            extra=PINNED_RANKING + _default_routing_pools(),
            shards=gateway_process.shards,
        )
        assert pinned.exists()
        gateway_process.signal(signal.SIGHUP)
        # The front's line and every shard's (a shard reads the file when its own SIGHUP arrives).
        await wait_for(gateway_process.reloaded_everywhere, timeout_s=10)
        after = [r for agent in agents for r in await agent.infer(fresh_requests(ranking))]
        gateway_process.config.write_text("this is [not toml")
        gateway_process.signal(signal.SIGHUP)
        await wait_for(lambda: any("reload failed" in str(r.get("event")) for r in gateway_process.logs), 10)
        still = [r for agent in agents for r in await agent.infer(fresh_requests(ranking))]
    assert {(r.pool, r.route_reason) for r in after} == {("gpu-a100", "model_pinned")}
    assert {(r.pool, r.route_reason) for r in still} == {("gpu-a100", "model_pinned")}
    _, body = await scrape(gateway_process)
    # With shards the front alone counts reloads (a shard's count is not added in: one SIGHUP, one reload).
    assert 'hkgw_reloads_total{outcome="ok"} 1.0' in body
    assert 'hkgw_reloads_total{outcome="failed"} 1.0' in body


PINNED_RANKING = """
[routing.models.rank-mlp]
kind = "ranking"
pin_pool = "gpu-a100"
[routing.models.text-encoder]
kind = "text"
[routing.models.image-classifier]
kind = "image"
"""


@pytest.mark.parametrize("gateway_process", RELOAD_CASES, indirect=True)
async def test_sighup_applies_a_new_log_level(gateway_process: GatewayProcess, models_dir: Path) -> None:
    """A reload to level "warning" silences info lines (its own "reloaded" included) while errors still
    show; a reload back to "info" brings them back, saying the logging changed. With shards, the front
    and every shard change level."""
    path = gateway_process.config
    shards = gateway_process.shards
    events = gateway_process.events

    # The quiet file also pins rank-mlp: an agent of each shard routed by the pin is the sign that its
    # shard has read the file (a quiet reload writes no line, and only the front counts reloads), before
    # the file is overwritten below (a shard reads it when its own SIGHUP from the front arrives).
    write_config(path, models_dir, extra=PINNED_RANKING + _default_routing_pools(), shards=shards)
    path.write_text(
        path.read_text().replace(
            '[logging]\nformat = "json"', '[logging]\nformat = "json"\nlevel = "warning"'
        )
    )
    assert 'level = "warning"' in path.read_text()
    gateway_process.signal(signal.SIGHUP)

    async def reloaded_ok() -> bool:
        return 'hkgw_reloads_total{outcome="ok"} 1.0' in (await scrape(gateway_process))[1]

    ranking = synthetic(2, seed=54, kind=pb.REQUEST_KIND_RANKING)
    deadline = time.monotonic() + 10
    while not await reloaded_ok():  # the quiet reload is done (its own line is not written)
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    async with agents_on_every_shard(gateway_process, "hgc") as agents:
        for agent in agents:
            while {r.route_reason for r in await agent.infer(fresh_requests(ranking))} != {"model_pinned"}:
                assert time.monotonic() < deadline, f"{agent.agent_id}'s shard did not reload"
                await asyncio.sleep(0.05)
    quiet = path.read_text()
    path.write_text("this is [not toml")
    gateway_process.signal(signal.SIGHUP)  # processed after the first: an error line, still written
    await wait_for(lambda: bool(events("reload failed; keeping the running config")), timeout_s=10)
    assert not events("reloaded")
    path.write_text(quiet.replace('level = "warning"', 'level = "info"'))
    gateway_process.signal(signal.SIGHUP)
    await wait_for(gateway_process.reloaded_everywhere, timeout_s=10)
    if shards == 1:
        [reloaded] = events("reloaded")
        assert reloaded["logging_changed"] is True and reloaded["level"] == "info"
    else:
        # One line from the front (it names the shards it signalled, not what changed) and one from each
        # shard, which says its logging changed.
        lines = events("reloaded")
        [front] = [r for r in lines if "shard" not in r]
        assert front["role"] == "front" and front["level"] == "info"
        from_shards = sorted((r for r in lines if "shard" in r), key=lambda r: int(r["shard"]))
        assert [r["shard"] for r in from_shards] == list(range(shards))
        for reloaded in from_shards:
            assert reloaded["logging_changed"] is True and reloaded["level"] == "info"
        # The front checks the file first: an invalid one reaches no shard.
        assert all("shard" not in r for r in events("reload failed; keeping the running config"))


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


@pytest.mark.parametrize("shards", SHARDS)
async def test_health_goes_draining_while_in_flight_work_finishes(
    tmp_path: Path, models_dir: Path, shards: int
) -> None:
    """Right after SIGTERM the carriers answer 503 DRAINING while the process finishes its work (with
    shards: the front answers while its shards finish theirs)."""
    process = GatewayProcess(write_config(tmp_path / "slow.toml", models_dir, shards=shards))
    try:
        await process.start()
        async with WireClient(process.endpoint("hgc")) as agent:  # with shards, work in one of them
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
