"""Capture at a real gateway, then inspect and replay: golden decisions, policy diffs, dedupe, full disk."""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.capture import format as capture_format
from gateway.capture.format import SUFFIX
from gateway.capture.inspect import inspect
from gateway.capture.replay import ReplayOptions, compare_decisions, read_decisions, replay, write_decisions
from gateway.cli import main
from gateway.testing import WireClient, fresh_requests, run_gateway, wait_for
from tests.gateway.daemon.test_serving import synthetic
from tests.replay.support import capture_synthetic, gateway_overrides


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 synthetic requests of every kind and region, captured by a real gateway."""
    from inference.models.demo import write_demo_repository

    root = tmp_path_factory.mktemp("capture-case")
    write_demo_repository(root / "models")
    ok = asyncio.run(capture_synthetic(root / "models", root / "capture", 300, seed=31))
    assert ok == 300
    return root


def capture_files(root: Path) -> list[Path]:
    return sorted((root / "capture").glob(f"*{SUFFIX}"))


async def test_capture_holds_every_received_request(captured: Path) -> None:
    """inspect counts exactly what was sent: 300 requests, all kinds, six regions, three carriers."""
    stats = inspect(capture_files(captured)).as_dict()
    assert stats["requests"] == 300
    assert set(stats["requests_by_kind"]) == {"ranking", "text", "image"}
    assert len(stats["messages_by_region"]) == 6
    assert set(stats["messages_by_carrier"]) == {"hgc", "pccw", "tgt"}
    assert stats["corrupt"] == [] and stats["undecodable"] == 0 and stats["span_s"] > 0


async def test_replay_reproduces_golden_decisions_and_a_policy_change_is_named(
    captured: Path, tmp_path: Path
) -> None:
    """Two fresh gateways decide every request alike; a changed threshold shows up as named differences."""
    files, models = capture_files(captured), captured / "models"
    async with run_gateway(models_dir=models, **gateway_overrides()) as gw:
        summary, golden = await replay(files, ReplayOptions(endpoint=gw.endpoint("hgc"), speed=4.0))
    assert summary.requests_sent == 300 and summary.lost == 0
    assert summary.answered_by_status == {"ok": 300}
    write_decisions(golden, tmp_path / "golden.jsonl")
    async with run_gateway(models_dir=models, **gateway_overrides()) as gw:
        _, again = await replay(files, ReplayOptions(endpoint=gw.endpoint("pccw"), speed=4.0))
    assert compare_decisions(read_decisions(tmp_path / "golden.jsonl"), again) == []
    changed = gateway_overrides(thresholds={"edge_server": 0.3, "cloud": 0.95})
    async with run_gateway(models_dir=models, **changed) as gw:
        _, after = await replay(files, ReplayOptions(endpoint=gw.endpoint("tgt"), speed=4.0))
    differences = compare_decisions(read_decisions(tmp_path / "golden.jsonl"), after)
    moved = {d.id for d in differences}
    assert differences and {d.field for d in differences} <= {"tier", "pool", "reason"}
    assert all(g.tier == "cloud" for g in golden if g.id in moved)  # the requests that left the cloud tier


async def test_cli_replay_with_expect_exits_1_and_names_differences(
    captured: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hk-gateway replay --expect` prints each difference with the request id and exits 1."""
    golden = tmp_path / "golden.jsonl"
    files = [str(p) for p in capture_files(captured)]
    async with run_gateway(models_dir=captured / "models", **gateway_overrides()) as gw:
        args = [
            "replay",
            *files,
            "--to",
            gw.endpoint("hgc"),
            "--speed",
            "max",
            "--record-decisions",
            str(golden),
        ]
        assert await _run_cli(args) == 0
    changed = gateway_overrides(thresholds={"edge_server": 0.3, "cloud": 0.95})
    async with run_gateway(models_dir=captured / "models", **changed) as gw:
        code = await _run_cli(
            ["replay", *files, "--to", gw.endpoint("hgc"), "--speed", "10x", "--expect", str(golden)]
        )
    err = capsys.readouterr().err
    assert code == 1
    assert "DIFF " in err and "tier: golden 'cloud'" in err
    assert len(read_decisions(golden)) == 300


async def test_replay_with_original_ids_is_all_deduplicated(captured: Path) -> None:
    """Original ids against a gateway that already served them: every request a duplicate, none served."""
    files = capture_files(captured)
    async with run_gateway(models_dir=captured / "models", **gateway_overrides()) as gw:
        first, _ = await replay(
            files, ReplayOptions(endpoint=gw.endpoint("hgc"), speed=None, original_ids=True)
        )
        served = _served(gw)
        second, decisions = await replay(
            files, ReplayOptions(endpoint=gw.endpoint("pccw"), speed=None, original_ids=True)
        )
        served_again = _served(gw)
    assert first.answered_by_status == {"ok": 300}
    assert second.duplicates == 300 and not second.answered_by_status and second.lost == 0
    assert {d.outcome for d in decisions} == {"duplicate"}
    assert served_again == served  # nothing executed twice


async def test_full_disk_drops_capture_records_but_never_stalls_ingest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every capture write failing (ENOSPC), all requests are still answered; drops are counted."""
    from inference.models.demo import write_demo_repository

    write_demo_repository(tmp_path / "models")

    def disk_full(self: Any, record: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(capture_format.CaptureFile, "append", disk_full)
    overrides = gateway_overrides(tmp_path / "capture")
    async with (
        run_gateway(models_dir=tmp_path / "models", **overrides) as gw,
        WireClient(gw.endpoint("hgc")) as agent,
    ):
        responses = await agent.infer(synthetic(60, seed=32), timeout_s=20)
        await wait_for(lambda: _capture(gw, "dropped_write_error") >= 1)
    assert all(r.status == 1 for r in responses)
    assert _capture(gw, "written") == 0


async def test_admin_endpoint_captures_for_a_bounded_time(tmp_path: Path) -> None:
    """POST /admin/capture?seconds=N switches capture on for N seconds on a gateway started without it."""
    from inference.models.demo import write_demo_repository

    write_demo_repository(tmp_path / "models")
    overrides = {"capture": {"directory": str(tmp_path / "capture"), "flush_interval_s": 0.1}}
    async with (
        run_gateway(models_dir=tmp_path / "models", **overrides) as gw,
        WireClient(gw.endpoint("hgc")) as agent,
    ):
        await agent.infer(synthetic(5, seed=33))
        assert _capture(gw, "written") == 0
        url = f"http://127.0.0.1:{gw.http.port if gw.http else 0}/admin/capture"
        async with aiohttp.ClientSession() as session:
            async with session.post(url, params={"seconds": "30"}) as response:
                assert response.status == 200 and "capture on" in await response.text()
            await agent.infer(fresh_requests(synthetic(5, seed=34)))
            await wait_for(lambda: _capture(gw, "written") >= 1)
            async with session.post(url, params={"seconds": "0"}) as response:
                assert "capture off" in await response.text()
            async with session.post(url, params={"seconds": "soon"}) as response:
                assert response.status == 400
        written = _capture(gw, "written")
        await agent.infer(fresh_requests(synthetic(5, seed=35)))
    assert _capture(gw, "written") == written


def _served(gw: Any) -> float:
    return sum(
        gw.metrics.registry.get_sample_value("hkgw_batch_size_sum", {"pool": pool}) or 0.0
        for pool in gw.pools
    )


def _capture(gw: Any, outcome: str) -> float:
    return gw.metrics.registry.get_sample_value("hkgw_capture_records_total", {"outcome": outcome}) or 0.0


async def _run_cli(args: list[str]) -> int:
    return await asyncio.to_thread(main, args)


async def test_replay_against_a_silent_peer_stops_and_reports_instead_of_hanging(captured: Path) -> None:
    """Nothing answers: once the window is full and the timeout passes, replay stops and counts the lost."""
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    silent = ctx.socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        options = ReplayOptions(endpoint=f"tcp://127.0.0.1:{port}", speed=None, window=20, timeout_s=0.3)
        summary, decisions = await replay(capture_files(captured), options)
    finally:
        silent.close(0)
        ctx.term()
    assert summary.stopped_early and summary.lost == summary.requests_sent >= 20
    assert {d.outcome for d in decisions} == {"lost"}


async def test_cli_replay_as_a_curve_agent(captured: Path, tmp_path: Path) -> None:
    """--as-agent/--server-key: the whole capture replays over CURVE as that agent, from its key's region."""
    import shutil

    from gateway.ingress.auth import write_keypair

    _, server_secret = write_keypair(tmp_path / "server", "gateway")
    agent_public, agent_secret = write_keypair(
        tmp_path / "agent", "edge-eu-west-1", {"agent-id": "edge-eu-west-1", "region": "eu-west"}
    )
    (tmp_path / "authorized").mkdir()
    shutil.copy(agent_public, tmp_path / "authorized" / agent_public.name)
    security = {
        "mode": "curve",
        "server_secret_key": str(server_secret),
        "authorized_agents": str(tmp_path / "authorized"),
    }
    files = [str(p) for p in capture_files(captured)]
    async with run_gateway(models_dir=captured / "models", security=security, **gateway_overrides()) as gw:
        args = ["replay", *files, "--to", gw.endpoint("tgt"), "--speed", "max", "--json"]
        args += ["--as-agent", str(agent_secret), "--server-key", str(server_secret.with_suffix(".key"))]
        code = await _run_cli(args)
        regions = {
            labels["region"]
            for metric in gw.metrics.registry.collect()  # as a scrape reads it (the hot path's tally added)
            for sample in metric.samples
            if sample.name == "hkgw_requests_total" and (labels := sample.labels) and sample.value
        }
    assert code == 0
    assert regions == {"eu-west"}
