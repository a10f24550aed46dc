"""Health for GeoDNS: UP / DEGRADED / DRAINING / DOWN, hysteresis, and metrics that promtool accepts."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from edgewire import pb
from gateway.ops.health import CarrierState, Hysteresis
from gateway.server import Gateway, GatewayStartError
from gateway.testing import WireClient, run_gateway, wait_for
from tests.gateway.daemon.process import SHARDS, GatewayProcess, agent_ids, write_config
from tests.gateway.daemon.test_dispatch import backend, split_backends
from tests.gateway.daemon.test_serving import synthetic


async def get(gw: Gateway, path: str) -> tuple[int, str]:
    assert gw.http is not None
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{gw.http.port}{path}") as resp,
    ):
        return resp.status, await resp.text()


async def wait_status(gw: Gateway, carrier: str, expected: str, timeout_s: float = 5.0) -> tuple[int, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        status, body = await get(gw, f"/health/carriers/{carrier}")
        if body.startswith(f"STATUS:{expected}") or time.monotonic() > deadline:
            return status, body
        await asyncio.sleep(0.05)


async def test_carrier_health_walks_through_every_state(models_dir: Path) -> None:
    """UP, DEGRADED when a tier has no healthy pool, UP again, DRAINING when disabled, DOWN when unbound."""
    async with run_gateway(models_dir=models_dir, **split_backends(models_dir)) as gw:
        assert await get(gw, "/health/carriers/hgc") == (200, "STATUS:UP bound and passing traffic\n")
        assert (await get(gw, "/readyz"))[0] == 200

        backend(gw, "gpu").healthy = False
        status, body = await wait_status(gw, "hgc", "DEGRADED")
        assert (status, body.split()[0]) == (200, "STATUS:DEGRADED")
        assert (await get(gw, "/readyz"))[0] == 503

        backend(gw, "gpu").healthy = True
        assert (await wait_status(gw, "hgc", "UP"))[0] == 200

        async with aiohttp.ClientSession() as session:
            assert gw.http is not None
            url = f"http://127.0.0.1:{gw.http.port}/admin/carriers/pccw/disable"
            async with session.post(url) as resp:
                assert resp.status == 200
        status, body = await wait_status(gw, "pccw", "DRAINING")
        assert (status, body.split()[0]) == (503, "STATUS:DRAINING")
        assert (await get(gw, "/health/carriers/hgc"))[0] == 200

        await gw.carriers["tgt"].close()
        status, body = await wait_status(gw, "tgt", "DOWN")
        assert (status, body.split()[0]) == (503, "STATUS:DOWN")
        assert (await get(gw, "/health/carriers/nope"))[0] == 404


async def test_admin_routes_need_the_bearer_token_when_one_is_configured(
    models_dir: Path, tmp_path: Path
) -> None:
    """With http.admin_token_file, /admin answers 401 without the token or with a wrong one (counted by
    reason), however the path is spelt, and obeys with it; health and metrics need no token."""
    token_file = tmp_path / "admin-token"
    token_file.write_text("s3cret-token-0123456789\n")
    async with run_gateway(models_dir=models_dir, http={"admin_token_file": str(token_file)}) as gw:
        assert gw.http is not None
        base = f"http://127.0.0.1:{gw.http.port}"
        disable = f"{base}/admin/carriers/pccw/disable"
        async with aiohttp.ClientSession() as session:
            for url, headers in (
                (disable, {}),
                (disable, {"Authorization": "Bearer wrong-token-0123456789"}),
                (disable, {"Authorization": "Basic s3cret-token-0123456789"}),
                (f"{base}/%61dmin/carriers/pccw/disable", {}),  # the route aiohttp matches is what counts
            ):
                async with session.post(url, headers=headers) as resp:
                    assert resp.status == 401, (url, headers, resp.status)
                    assert resp.headers["WWW-Authenticate"].startswith("Bearer")
            # Bytes that are not UTF-8 in the header: refused like any wrong token, not a server error.
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.http.port)
            writer.write(
                b"POST /admin/carriers/pccw/disable HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
                b"Content-Length: 0\r\nConnection: close\r\n\r\n"
            )
            status_line = await reader.readline()
            writer.close()
            assert status_line.split()[1] == b"401", status_line
            assert not gw.disabled_carriers
            async with session.post(
                disable, headers={"Authorization": "Bearer s3cret-token-0123456789"}
            ) as resp:
                assert resp.status == 200
        assert (await wait_status(gw, "pccw", "DRAINING"))[0] == 503
        assert (await get(gw, "/healthz"))[0] == 200
        assert (await get(gw, "/metrics"))[0] == 200
        registry = gw.metrics.registry
        missing = registry.get_sample_value("hkgw_admin_refused_total", {"reason": "missing"})
        wrong = registry.get_sample_value("hkgw_admin_refused_total", {"reason": "wrong"})
    assert (missing, wrong) == (2, 3)


@pytest.mark.parametrize(("content", "words"), [(None, "cannot read"), ("abc\n", "at least 16")])
async def test_an_unusable_admin_token_file_stops_the_start(
    models_dir: Path, tmp_path: Path, content: str | None, words: str
) -> None:
    """A missing token file or a short token fails the start, naming the key (never a gateway whose /admin
    is open because its token could not be read)."""
    path = tmp_path / "admin-token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(GatewayStartError, match=f"http.admin_token_file: .*{words}"):
        async with run_gateway(models_dir=models_dir, http={"admin_token_file": str(path)}):
            pass


async def test_drain_turns_every_carrier_draining_at_once(models_dir: Path) -> None:
    """On drain every carrier answers 503 STATUS:DRAINING without waiting for hysteresis."""
    async with run_gateway(models_dir=models_dir) as gw:
        await gw.drain()
        for name in gw.carriers:
            status, body = await get(gw, f"/health/carriers/{name}")
            assert (status, body.split()[0]) == (503, "STATUS:DRAINING")


async def test_readyz_names_draining_while_the_gateway_drains(models_dir: Path) -> None:
    """/readyz is 200 READY until the drain, then 503 with a body that says draining before the tiers'
    health (which is fine: draining alone is why it is not ready)."""
    async with run_gateway(models_dir=models_dir) as gw:
        assert await get(gw, "/readyz") == (200, "READY\n")
        await gw.drain()
        assert await get(gw, "/readyz") == (503, "NOT READY draining edge_server=ok cloud=ok\n")


async def test_health_is_answered_while_the_event_loop_is_blocked(models_dir: Path) -> None:
    """The HTTP thread answers while the ingest loop is wedged, and says DOWN once the snapshot is stale."""
    async with run_gateway(models_dir=models_dir) as gw:
        assert gw.http is not None
        url = f"http://127.0.0.1:{gw.http.port}/health/carriers/hgc"
        prober_done = threading.Event()

        def probe() -> list[int | str]:
            """Ask until the answer is 503 (the snapshot went stale) or 10 s pass: the status of each
            answer, or the error of an unanswered request."""
            seen: list[int | str] = []
            deadline = time.monotonic() + 10.0
            try:
                while not seen or (seen[-1] != 503 and time.monotonic() < deadline):
                    try:
                        with urllib.request.urlopen(url, timeout=2) as resp:
                            seen.append(resp.status)
                    except urllib.error.HTTPError as err:
                        seen.append(err.code)
                    except OSError as err:  # unanswered: the server would be waiting on the loop
                        seen.append(repr(err))
                    if seen[-1] != 503:
                        time.sleep(0.05)  # poll interval
            finally:
                prober_done.set()
            return seen

        prober = asyncio.get_running_loop().run_in_executor(None, probe)
        # Wedge the event loop on purpose until the prober is done: every answer came from the HTTP thread.
        assert prober_done.wait(timeout=30.0)
        seen = await prober
    assert seen[0] == 200, seen
    assert seen[-1] == 503, seen
    assert all(isinstance(status, int) for status in seen), seen


@pytest.mark.parametrize("shards", SHARDS)
async def test_metrics_scrape_passes_promtool(models_dir: Path, tmp_path: Path, shards: int) -> None:
    """After traffic, /metrics is valid Prometheus exposition by promtool's own check (with shards: the
    front's merge of its own series and every shard's, after traffic in each shard)."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool is installed by the test command (Debian package prometheus)"
    process = GatewayProcess(write_config(tmp_path / "gateway.toml", models_dir, shards=shards))
    rejected = 'hkgw_frames_rejected_total{carrier="hgc",reason="wrong_frame_count"} 1.0'
    try:
        await process.start()
        url = f"http://127.0.0.1:{process.http_port}/metrics"
        async with aiohttp.ClientSession() as session:

            async def scrape() -> tuple[int, str]:
                async with session.get(url) as resp:
                    return resp.status, await resp.text()

            for agent_id in agent_ids(shards):
                async with WireClient(process.endpoint("hgc"), agent_id=agent_id) as agent:
                    await agent.infer(synthetic(30, seed=21))
            async with WireClient(process.endpoint("hgc")) as agent:
                await agent.send_raw([b"garbage"])
                deadline = time.monotonic() + 10
                while rejected not in (await scrape())[1]:
                    assert time.monotonic() < deadline, "the refused frame was not counted"
                    await asyncio.sleep(0.05)
            status, body = await scrape()
    finally:
        await process.stop()
    assert status == 200
    assert "hkgw_responses_total" in body
    assert "test-agent" not in body  # agent ids are never label values
    command = [promtool, "check", "metrics"]
    result = await asyncio.to_thread(
        subprocess.run, command, input=body, capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


async def test_failed_repository_rescans_are_exported(models_dir: Path, tmp_path: Path) -> None:
    """A model config broken at run time fails the ONNX backend's periodic rescans: counted per backend
    in hkgw_backend_rescan_failures_total (0 before), while the loaded models keep serving."""
    repository = tmp_path / "models"
    shutil.copytree(models_dir, repository)
    backends = {"embedded": {"repository": str(repository), "rescan_interval_s": 0.05}}
    async with run_gateway(models_dir=models_dir, backends=backends) as gw:
        registry = gw.metrics.registry

        def failures() -> float | None:
            return registry.get_sample_value("hkgw_backend_rescan_failures_total", {"backend": "embedded"})

        assert failures() == 0.0
        (repository / "rank-mlp" / "config.pbtxt").write_text("max_batch_size: {")
        await wait_for(lambda: (failures() or 0.0) >= 1.0)
        async with WireClient(gw.endpoint("hgc")) as agent:
            responses = await agent.infer(synthetic(10, seed=4))
    assert all(r.status == pb.STATUS_OK for r in responses), [r.error_message for r in responses]


async def test_failed_remote_server_checks_are_exported(models_dir: Path) -> None:
    """A triton backend whose server is not there: its failed checks are counted per backend in
    hkgw_backend_check_failures_total (the embedded backend has none to count), the gateway serving on."""
    from gateway.testing_servers import free_port

    url = f"127.0.0.1:{free_port()}"
    down = {"type": "triton", "url": url, "health_interval_s": 0.1, "control_timeout_s": 0.2}
    async with run_gateway(models_dir=models_dir, backends={"down": down}) as gw:
        registry = gw.metrics.registry

        def failures(backend: str) -> float | None:
            return registry.get_sample_value("hkgw_backend_check_failures_total", {"backend": backend})

        await wait_for(lambda: (failures("down") or 0.0) >= 2.0)
        assert failures("embedded") is None
        assert (await get(gw, "/healthz"))[0] == 200


@pytest.mark.parametrize(
    ("raws", "expected"),
    [
        (["UP", "DOWN", "UP", "DOWN", "UP"], ["UP", "UP", "UP", "UP", "UP"]),
        (["UP", "DOWN", "DOWN", "DOWN"], ["UP", "UP", "DOWN", "DOWN"]),
        (["DOWN", "UP", "UP", "UP"], ["DOWN", "DOWN", "UP", "UP"]),
        (["UP", "DRAINING", "UP", "UP"], ["UP", "DRAINING", "UP", "UP"]),
        (["UP", "DEGRADED", "DEGRADED", "UP", "UP"], ["UP", "UP", "DEGRADED", "DEGRADED", "UP"]),
    ],
)
def test_hysteresis_suppresses_flapping(raws: list[str], expected: list[str]) -> None:
    """A state changes only after rise/fall consecutive evaluations agree; DRAINING applies at once."""
    h = Hysteresis(rise=2, fall=2)
    assert [h.update(CarrierState(r)).value for r in raws] == expected
