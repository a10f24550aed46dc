"""Realtime fallbacks when Hong Kong is out of reach, and the agent's own health and metrics."""

from __future__ import annotations

import asyncio
import errno
import os
import random
import shutil
import stat
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from google.protobuf.message import Message
from prometheus_client.parser import text_string_to_metric_families

from edge_agent.agent import EdgeAgent
from edge_agent.client import EdgeClient
from edge_agent.drive import drive
from edge_agent.errors import ErrorReason
from edge_agent.ops import AgentCollector
from edge_agent.synthetic import SyntheticTraffic
from edgewire import pb
from gateway.testing import run_gateway, wait_for
from tests.edge_agent.conftest import NOWHERE, agent_config, agent_on_gateway, heavy_realtime, spawn_agent


async def test_realtime_without_hong_kong_is_served_locally(models_dir: Path, tmp_path: Path) -> None:
    """A realtime request that cannot make the round trip is served by the local model when one exists."""
    config = agent_config(NOWHERE, models_dir, tmp_path / "spool")
    async with EdgeAgent(config) as agent, EdgeClient(agent.intake_endpoint) as client:
        # No carrier answers, so no deadline covers the round trip: 5 s of it, not a race with the machine.
        responses = await client.infer_many(
            heavy_realtime(5), deadline_s=5, priority=pb.PRIORITY_CLASS_REALTIME
        )
    assert {(r.status, r.tier, r.pool) for r in responses} == {(pb.STATUS_OK, pb.TIER_EDGE_DEVICE, "local")}


async def test_realtime_without_hong_kong_or_local_model_fails_fast(models_dir: Path, tmp_path: Path) -> None:
    """Without a local model the same request fails fast with a clear status, long before its deadline:
    answered by the agent itself at the intake, never queued for Hong Kong or spooled."""
    requests = heavy_realtime(3)
    async with (
        EdgeAgent(agent_config(NOWHERE, models_dir, tmp_path / "spool", local={"enabled": False})) as agent,
        EdgeClient(agent.intake_endpoint) as client,
    ):
        assert agent.uplink is not None and agent.spool is not None
        responses = await client.infer_many(requests, deadline_s=2.0, priority=pb.PRIORITY_CLASS_REALTIME)
        uplink, spool = agent.uplink, agent.spool
        queued, spooled = uplink.inflight, spool.live_records
    assert {r.status for r in responses} == {pb.STATUS_DEADLINE_EXCEEDED}
    assert all("round trip" in r.error_message for r in responses)
    assert agent.stats.failed_fast == {"round_trip": 3, "local_busy": 0}
    # The mechanism, not a stopwatch: answered by the agent, nothing handed to the uplink, sent or spooled.
    assert agent.stats.remote == 0 and queued == 0 and spooled == 0
    assert uplink.stats.sent_requests == 0 and uplink.stats.sent_frames == 0
    assert agent.stats.responses == {"deadline_exceeded": 3}


async def test_agent_health_and_metrics(models_dir: Path, tmp_path: Path) -> None:
    """/readyz follows Hong Kong reachability; /metrics has carriers, spool, routes and passes promtool."""
    async with run_gateway(models_dir=models_dir) as gw:
        endpoints = {name: gw.endpoint(name) for name in gw.carriers}
        async with EdgeAgent(
            agent_config(endpoints, models_dir, tmp_path / "spool", local={"enabled": False})
        ) as agent:
            assert agent.uplink is not None and agent.http is not None
            uplink = agent.uplink
            await wait_for(lambda: uplink.best() is not None)
            await drive(agent.intake_endpoint, "us-west", 50, rate=200)
            base = f"http://127.0.0.1:{agent.http.port}"
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{base}/readyz") as resp:
                    ready = resp.status
                async with session.get(f"{base}/metrics") as resp:
                    body = await resp.text()
    assert ready == 200
    for name in (
        "edge_carrier_rtt_seconds",
        "edge_carrier_up",
        "edge_spool_records",
        "edge_requests_total",
        "edge_responses_total",
        "edge_spool_drops_total",
        "edge_spool_ignored_files",
    ):
        assert name in body
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }
    assert samples[("edge_uplink_requests_sent_total", ())] >= 50
    assert (
        1
        <= samples[("edge_uplink_frames_sent_total", ())]
        <= samples[("edge_uplink_requests_sent_total", ())]
    )
    for reason in ("round_trip", "local_busy"):  # present before the first one
        assert samples[("edge_failed_fast_total", (("reason", reason),))] == 0
    promtool = shutil.which("promtool")
    assert promtool
    result = await asyncio.to_thread(
        subprocess.run,
        [promtool, "check", "metrics"],
        input=body,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


async def test_agent_speaks_curve_to_a_curve_gateway(models_dir: Path, tmp_path: Path) -> None:
    """With its key pair and the gateway's public key the agent is admitted and served over CurveZMQ."""
    import shutil as sh

    from gateway.ingress.auth import write_keypair

    server_public, server_secret = write_keypair(tmp_path / "server", "gateway")
    agent_public, agent_secret = write_keypair(
        tmp_path / "agent", "edge-us-west-1", {"agent-id": "edge-us-west-1", "region": "us-west"}
    )
    (tmp_path / "authorized").mkdir()
    sh.copy(agent_public, tmp_path / "authorized")
    security = {
        "mode": "curve",
        "server_secret_key": str(server_secret),
        "authorized_agents": str(tmp_path / "authorized"),
    }
    async with run_gateway(models_dir=models_dir, security=security) as gw:
        endpoints = {name: gw.endpoint(name) for name in gw.carriers}
        config = agent_config(
            endpoints,
            models_dir,
            tmp_path / "spool",
            local={"enabled": False},
            agent_id="edge-us-west-1",
            security={
                "mode": "curve",
                "agent_secret_key": str(agent_secret),
                "gateway_public_key": str(server_public),
            },
        )
        async with EdgeAgent(config) as agent:
            assert agent.uplink is not None
            uplink = agent.uplink
            await wait_for(lambda: uplink.best() is not None)
            result = await drive(agent.intake_endpoint, "us-west", 30, rate=200)
    assert result.lost == 0
    assert result.by_status["OK"] == 30


async def test_cli_synthetic_run_reports_json_with_nothing_lost(models_dir: Path, tmp_path: Path) -> None:
    """`edge-agent --config F --synthetic N --json` drives N requests through a real agent and gateway; the
    config's [logging] section sets the log level and format."""
    import json

    async with run_gateway(models_dir=models_dir) as gw:
        carriers = "\n".join(
            f'[[carriers]]\nname = "{n}"\nendpoint = "{gw.endpoint(n)}"' for n in gw.carriers
        )
        config = tmp_path / "agent.toml"
        config.write_text(f"""
region = "eu-west"
intake = "tcp://127.0.0.1:*"
{carriers}
[local]
repository = "{models_dir}"
[spool]
directory = "{tmp_path / "spool"}"
[http]
port = 0
[logging]
format = "json"
level = "info"
""")
        proc = await spawn_agent(
            config, "--synthetic", "80", "--rate", "200", "--json", capture=True, new_session=False
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()[-2000:]
    # [logging] level = "info" wins over --synthetic's quieter default; stdout stays the summary alone.
    levels = {json.loads(line)["level"] for line in err.decode().splitlines() if line.startswith("{")}
    assert "info" in levels, err.decode()[-2000:]
    summary = json.loads(out.decode())
    assert summary["sent"] == 80
    assert summary["lost"] == 0
    assert sum(summary["answered"].values()) == 80


async def test_agent_fetches_and_uses_the_gateways_dictionary(models_dir: Path, tmp_path: Path) -> None:
    """The gateway prefers a trained dictionary; the agent fetches it after a Pong and compresses with it."""
    from edgewire import DictionaryStore
    from edgewire.dictionaries import train

    samples = [
        pb.RequestBatch(requests=[r.request]).SerializeToString()
        for r in SyntheticTraffic(30, n_items=5000, n_users=500).take(300)
        if r.request.kind != pb.REQUEST_KIND_IMAGE
    ]
    store = DictionaryStore.from_raw([train(samples, 16 * 1024)])
    store.save(tmp_path / "dicts", store.preferred)
    async with run_gateway(models_dir=models_dir, dictionaries=str(tmp_path / "dicts")) as gw:
        endpoints = {name: gw.endpoint(name) for name in gw.carriers}
        async with EdgeAgent(
            agent_config(endpoints, models_dir, tmp_path / "spool", local={"enabled": False})
        ) as agent:
            uplink = agent.uplink
            assert uplink is not None
            await wait_for(lambda: uplink.dict_id == store.preferred, timeout_s=5)
            result = await drive(agent.intake_endpoint, "us-west", 40, rate=200)
    assert result.lost == 0
    assert result.by_status["OK"] == 40


async def test_oversized_frames_are_split_not_resent_unchanged(models_dir: Path, tmp_path: Path) -> None:
    """With a small gateway frame limit (from Pong) the agent splits its batches instead of sending them."""
    limits = {"max_frame_bytes": 32768, "max_decompressed_bytes": 65536}
    async with run_gateway(models_dir=models_dir, limits=limits) as gw:
        endpoints = {name: gw.endpoint(name) for name in gw.carriers}
        async with EdgeAgent(
            agent_config(
                endpoints,
                models_dir,
                tmp_path / "spool",
                local={"enabled": False},
                batching={"max_records": 100, "linger_ms": 20},
            )
        ) as agent:
            uplink = agent.uplink
            assert uplink is not None
            await wait_for(lambda: uplink.best() is not None)
            requests = [
                r.request
                for r in SyntheticTraffic(9, regions=("us-west",)).take(400)
                if r.request.kind == pb.REQUEST_KIND_RANKING
            ][:100]
            for r in requests:
                r.request_id = b""
                r.priority = pb.PRIORITY_CLASS_BATCH
            async with EdgeClient(agent.intake_endpoint) as client:
                responses = await client.infer_many(requests, deadline_s=20)
    assert uplink.stats.sent_frames >= 2  # 100 requests over the 32 KiB frame limit went out split
    assert {r.status for r in responses} <= {pb.STATUS_OK, pb.STATUS_INVALID_ARGUMENT}
    assert sum(r.status == pb.STATUS_OK for r in responses) >= 90


def test_bad_discovery_settings_are_config_errors() -> None:
    """A malformed name server or inverted TTL bounds fail validation naming the key."""
    import pytest

    from edge_agent.config import AgentConfigError, load_config

    with pytest.raises(AgentConfigError, match="discovery"):
        load_config(
            environ={},
            overrides={
                "region": "us-west",
                "discovery": {"mode": "srv", "name": "_x._tcp.example.", "nameservers": ["not an address"]},
            },
        )
    with pytest.raises(AgentConfigError, match="discovery"):
        load_config(
            environ={}, overrides={"region": "us-west", "discovery": {"min_ttl_s": 10, "max_ttl_s": 1}}
        )


async def test_reload_applies_routing_and_keeps_it_on_a_bad_file(
    models_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGHUP's reload applies a new routing policy and log level; an invalid file keeps the running ones."""
    import structlog

    saved = structlog.get_config()
    try:
        async with EdgeAgent(agent_config(NOWHERE, models_dir, tmp_path / "spool")) as agent:
            good = tmp_path / "agent.toml"
            good.write_text(
                'region = "us-west"\n[routing.thresholds]\nedge_server = 0.1\ncloud = 0.5\n'
                '[routing.models.rank-mlp]\nkind = "ranking"\n[[routing.pools]]\nname = "cpu"\n'
                'tier = "edge_server"\nmodels = ["rank-mlp"]\n[logging]\nformat = "json"\nlevel = "error"\n'
            )
            assert agent.reload(good)
            assert agent.policy.policy.config.thresholds.edge_server == 0.1
            probe = structlog.get_logger("test")
            probe.info("probe-info")
            probe.error("probe-error")
            bad = tmp_path / "bad.toml"
            bad.write_text("not [toml")
            assert not agent.reload(bad)
            assert agent.policy.policy.config.thresholds.edge_server == 0.1
            probe.info("probe-info-after-bad")
    finally:
        structlog.configure(**saved)
    err = capsys.readouterr().err
    assert "probe-error" in err and "reload failed" in err
    assert "probe-info" not in err


async def test_drain_waits_for_answers_in_flight(models_dir: Path, tmp_path: Path) -> None:
    """On stop the agent takes no new work and returns once everything in flight is answered."""
    async with run_gateway(models_dir=models_dir) as gw:
        endpoints = {name: gw.endpoint(name) for name in gw.carriers}
        async with EdgeAgent(
            agent_config(endpoints, models_dir, tmp_path / "spool", local={"enabled": False})
        ) as agent:
            uplink = agent.uplink
            assert uplink is not None
            await wait_for(lambda: uplink.best() is not None)
            async with EdgeClient(agent.intake_endpoint) as client:
                requests = heavy_realtime(10)
                pending = asyncio.create_task(
                    client.infer_many(requests, deadline_s=10, priority=pb.PRIORITY_CLASS_BATCH)
                )
                await wait_for(lambda: uplink.stats.sent_requests >= 10)
                left = await agent.drain(timeout_s=10)
                responses = await pending
    assert left == 0
    assert {r.status for r in responses} == {pb.STATUS_OK}


async def test_reused_request_id_is_refused_not_dropped(models_dir: Path, tmp_path: Path) -> None:
    """A second request with an id still in flight is nacked with a reason, never silently ignored."""
    async with EdgeAgent(
        agent_config(NOWHERE, models_dir, tmp_path / "spool", local={"enabled": False})
    ) as agent:
        (request,) = heavy_realtime(1)
        request.priority = pb.PRIORITY_CLASS_BATCH
        async with EdgeClient(agent.intake_endpoint) as client:
            first = asyncio.create_task(client.infer(request, deadline_s=0.5))
            assert agent.uplink is not None
            uplink = agent.uplink
            await wait_for(lambda: uplink.inflight == 1)
            again = pb.InferRequest()
            again.CopyFrom(request)
            async with EdgeClient(agent.intake_endpoint) as other:
                second = await other.infer(again, deadline_s=0.5)
            await first
    assert second.status == pb.STATUS_INVALID_ARGUMENT
    assert "already used" in second.error_message


async def test_a_failed_spool_fsync_refuses_the_frame_retryably(
    models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the disk cannot make a frame durable, its spooled requests are refused OVERLOADED with a
    retry-after (not acknowledged, not sent) and taken out of the spool; the next frame goes through."""
    real = os.fsync
    failures = [1]

    def fsync(fd: int) -> None:
        if stat.S_ISREG(os.fstat(fd).st_mode) and failures[0] > 0:
            failures[0] -= 1
            raise OSError(errno.EIO, "injected: I/O error")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    requests = [r.request for r in SyntheticTraffic(8, regions=("us-west",)).take(20)]
    for r in requests:
        r.request_id = b""
    batch = pb.PRIORITY_CLASS_BATCH
    async with agent_on_gateway(models_dir, tmp_path / "spool", local={"enabled": False}) as (_, agent):
        async with EdgeClient(agent.intake_endpoint) as client:
            refused = await client.infer_many(requests[:10], deadline_s=5, priority=batch)
            served = await client.infer_many(requests[10:], deadline_s=5, priority=batch)
        assert agent.spool is not None
        assert agent.spool.live_records == 0
        at_gateway = agent.stats.remote
    assert {r.status for r in refused} == {pb.STATUS_OVERLOADED}
    assert all(r.retry_after_ms > 0 and "fsync" in r.error_message for r in refused)
    assert {r.status for r in served} == {pb.STATUS_OK}
    assert at_gateway == 10  # the refused frame never left the agent


async def test_a_spool_write_that_fails_mid_frame_refuses_what_it_lost_retryably(
    models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frame's spooled requests reach the spool in one write; when the disk fills up partway through
    it, the requests whose records did not reach the file intact are refused OVERLOADED with a
    retry-after ("spool full (write_failed)", counted as spool_write), those before them are served, and
    once the disk has room again the refused ones go through when their caller sends them again."""
    spool_dir = (tmp_path / "spool").resolve()
    real = os.write
    room = [4096]  # bytes the disk takes before it is full: some of the frame's records, not all

    def write(fd: int, data: bytes | memoryview) -> int:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if not target.startswith(str(spool_dir)) or room[0] < 0:
            return real(fd, data)
        if room[0] == 0:
            raise OSError(errno.ENOSPC, "injected: no space left on device")
        n = real(fd, bytes(data)[: room[0]])
        room[0] -= n
        return n

    monkeypatch.setattr(os, "write", write)
    requests = _batch_class(40, seed=11)
    async with agent_on_gateway(models_dir, spool_dir, local={"enabled": False}) as (_, agent):
        async with EdgeClient(agent.intake_endpoint) as client:
            first = await client.infer_many(requests, deadline_s=5, priority=pb.PRIORITY_CLASS_BATCH)
            refused = [r for r, a in zip(requests, first, strict=True) if a.status != pb.STATUS_OK]
            room[0] = -1  # room again
            again = await client.infer_many(refused, deadline_s=5, priority=pb.PRIORITY_CLASS_BATCH)
        assert agent.spool is not None
        assert agent.spool.live_records == 0
        failures = agent.errors.by_reason[ErrorReason.SPOOL_WRITE]
    served = [a for a in first if a.status == pb.STATUS_OK]
    assert 0 < len(served) < len(requests), [a.status for a in first]
    assert all(a.status == pb.STATUS_OVERLOADED for a in first if a.status != pb.STATUS_OK)
    assert all(a.retry_after_ms > 0 and "write_failed" in a.error_message for a in first if a not in served)
    assert {a.status for a in again} == {pb.STATUS_OK}
    assert failures == 1


def _slow_file_fsyncs(monkeypatch: pytest.MonkeyPatch, delay_s: float) -> None:
    """Every fsync of a regular file (the spool's segments) takes ``delay_s``: a slow disk."""
    real = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            time.sleep(delay_s)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def _batch_class(n: int, seed: int) -> list[pb.InferRequest]:
    requests = [r.request for r in SyntheticTraffic(seed, regions=("us-west",)).take(n)]
    for r in requests:
        r.request_id = b""
        r.priority = pb.PRIORITY_CLASS_BATCH  # spooled, so each frame waits for an fsync
    return requests


async def test_drain_lets_frames_waiting_for_their_fsync_finish(
    models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM while a frame's requests wait for a slow fsync: the drain stops reading new frames but
    waits for that one to be acknowledged, sent and answered; nothing is left unanswered."""
    _slow_file_fsyncs(monkeypatch, 0.3)
    requests = _batch_class(5, seed=31)
    async with agent_on_gateway(models_dir, tmp_path / "spool", local={"enabled": False}) as (_, agent):
        assert agent.spool is not None
        spool = agent.spool
        async with EdgeClient(agent.intake_endpoint) as client:
            answering = asyncio.create_task(client.infer_many(requests, deadline_s=10))
            await wait_for(lambda: spool.live_records == 5, what="the frame spooled, its fsync running")
            left = await agent.drain(10.0)
            responses = await answering
    assert left == 0
    assert [r.status for r in responses] == [pb.STATUS_OK] * 5


async def test_frames_waiting_for_their_fsync_count_against_the_in_flight_window(
    models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """uplink.max_inflight holds while frames wait for a slow fsync: four frames of five arriving during
    one fsync with room for five get five accepted and fifteen refused, not twenty sent."""
    _slow_file_fsyncs(monkeypatch, 0.3)
    frames = [_batch_class(5, seed=40 + i) for i in range(4)]
    async with (
        agent_on_gateway(
            models_dir, tmp_path / "spool", local={"enabled": False}, uplink={"max_inflight": 5}
        ) as (_, agent),
        EdgeClient(agent.intake_endpoint) as client,
    ):
        answers = await asyncio.gather(*(client.infer_many(f, deadline_s=10) for f in frames))
    statuses = Counter(r.status for frame in answers for r in frame)
    assert statuses[pb.STATUS_OK] <= 5
    assert statuses[pb.STATUS_OK] + statuses[pb.STATUS_OVERLOADED] == 20
    refused = [r for frame in answers for r in frame if r.status == pb.STATUS_OVERLOADED]
    assert all("in-flight window full" in r.error_message for r in refused)


@asynccontextmanager
async def fake_gateway(
    answer: Callable[[pb.Envelope, Message], Message | None], pong: pb.Pong | None = None
) -> AsyncIterator[str]:
    """A scripted gateway on a loopback ROUTER (yields its endpoint): Pings get ``pong`` (with their nonce),
    any other message ``answer(envelope, payload)`` when that returns a message."""
    import zmq
    import zmq.asyncio

    from edgewire import FrameCodec

    codec = FrameCodec()
    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    async def serve() -> None:
        while True:
            routing_id, *body = await router.recv_multipart()
            decoded = codec.decode(body)
            reply: Message | None
            if isinstance(decoded.payload, pb.Ping):
                reply = pb.Pong(gateway_epoch=1)
                if pong is not None:
                    reply.CopyFrom(pong)
                reply.nonce = decoded.payload.nonce
            else:
                reply = answer(decoded.envelope, decoded.payload)
            if reply is not None:
                await router.send_multipart([routing_id, *codec.encode(reply, agent_id="hk", region="hk")])

    server = asyncio.create_task(serve())
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        server.cancel()
        router.close(0)
        context.term()


async def test_a_lost_dictionary_response_is_asked_for_again(models_dir: Path, tmp_path: Path) -> None:
    """A gateway that prefers a dictionary but never answers the DictionaryRequest (the response lost) is
    asked again at a Pong 5 s later, not once per process; the agent stays on plain zstd meanwhile."""
    asked: list[float] = []

    def drop(envelope: pb.Envelope, payload: Message) -> Message | None:
        if isinstance(payload, pb.DictionaryRequest):
            assert payload.dict_id == 7
            asked.append(time.monotonic())
        return None

    pong = pb.Pong(dict_ids=[7], preferred_dict_id=7, gateway_epoch=1)
    async with fake_gateway(drop, pong) as endpoint:
        config = agent_config({"hgc": endpoint}, models_dir, tmp_path / "spool")
        async with EdgeAgent(config) as agent:
            await wait_for(lambda: len(asked) >= 2, timeout_s=15)
            assert agent.uplink is not None and agent.uplink.dict_id == 0
    # Not before the 5 s an answer may take: test_uplink's test_a_dictionary_is_asked_for_again_only_after_
    # the_wait checks that on a controlled clock (a wall-clock bound here would time the machine).


async def test_gateway_refusals_are_counted_by_reason(models_dir: Path, tmp_path: Path) -> None:
    """A frame refused whole (unsupported_version: misconfiguration, not resent) fails its requests
    INTERNAL; a nacked request (unknown_model) gets its final status; the agent's metrics count both by
    reason, every reason present from the start."""
    frames: list[pb.RequestBatch] = []

    def refuse(envelope: pb.Envelope, payload: Message) -> Message | None:
        if not isinstance(payload, pb.RequestBatch):
            return None
        frames.append(payload)
        if len(frames) == 1:
            return pb.Ack(
                acked_message_id=envelope.message_id,
                frame_reject=pb.REJECT_REASON_UNSUPPORTED_VERSION,
                frame_reject_detail="test",
            )
        nacks = [
            pb.Nack(request_id=r.request_id, reason=pb.NACK_REASON_UNKNOWN_MODEL, detail="test")
            for r in payload.requests
        ]
        return pb.Ack(acked_message_id=envelope.message_id, nacks=nacks)

    request = next(
        r.request for r in SyntheticTraffic(3).take(50) if r.request.kind == pb.REQUEST_KIND_RANKING
    )
    request.priority = pb.PRIORITY_CLASS_BATCH
    async with fake_gateway(refuse) as endpoint:
        config = agent_config({"hgc": endpoint}, models_dir, tmp_path / "spool", local={"enabled": False})
        async with EdgeAgent(config) as agent, EdgeClient(agent.intake_endpoint) as client:
            assert agent.uplink is not None
            uplink = agent.uplink
            await wait_for(lambda: uplink.best() is not None)
            statuses = []
            for _ in range(2):
                request.request_id = b""
                [response] = await client.infer_many([request], deadline_s=10)
                statuses.append(response.status)
            exported = {
                (sample.name, sample.labels.get("reason")): sample.value
                for family in AgentCollector(agent).collect()
                for sample in family.samples
                if sample.name in ("edge_frames_rejected_total", "edge_nacks_total")
            }
    assert statuses == [pb.STATUS_INTERNAL, pb.STATUS_MODEL_NOT_FOUND]
    assert exported[("edge_frames_rejected_total", "unsupported_version")] == 1
    assert exported[("edge_nacks_total", "unknown_model")] == 1
    assert sum(exported.values()) == 2
    assert ("edge_nacks_total", "overloaded") in exported and (
        "edge_frames_rejected_total",
        "other",
    ) in exported


async def test_frames_zstd_would_not_shrink_go_uncompressed_and_are_counted(
    models_dir: Path, tmp_path: Path
) -> None:
    """Image bytes that do not compress travel raw to Hong Kong, are answered, and are counted; the
    compressible synthetic traffic before them is not."""
    noise = random.Random(2)
    images = [
        pb.InferRequest(
            model_name="image-classifier",
            kind=pb.REQUEST_KIND_IMAGE,
            image=pb.ImageInput(
                data=noise.randbytes(64 << 10), format=pb.IMAGE_FORMAT_JPEG, width=64, height=64
            ),
        )
        for _ in range(4)
    ]
    async with run_gateway(models_dir=models_dir) as gw:
        endpoints = {name: gw.endpoint(name) for name in gw.carriers}
        async with (
            EdgeAgent(
                agent_config(endpoints, models_dir, tmp_path / "spool", local={"enabled": False})
            ) as agent,
            EdgeClient(agent.intake_endpoint) as client,
        ):
            assert agent.uplink is not None
            uplink = agent.uplink
            await wait_for(lambda: uplink.best() is not None)
            await client.infer_many(
                [r.request for r in SyntheticTraffic(5).take(20) if r.request.kind != pb.REQUEST_KIND_IMAGE],
                deadline_s=10,
            )
            assert uplink.stats.sent_frames >= 1 and uplink.stats.sent_uncompressed == 0
            frames_before = uplink.stats.sent_frames
            responses = await client.infer_many(images, deadline_s=10)
    # not a JPEG: refused by the pipeline, but it reached Hong Kong and was answered
    assert [r.status for r in responses] == [pb.STATUS_INVALID_ARGUMENT] * 4
    assert 1 <= uplink.stats.sent_uncompressed == uplink.stats.sent_frames - frames_before
